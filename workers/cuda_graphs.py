"""CUDA graphs of the target's decode and verify steps: B sequences of L rows each, B rounded up
to a bucket, captured at start-up (or on first use) and replayed over static input buffers.

A captured step runs embedding, every layer and the logits of every row; the host only fills
the buffers. Rows of the padding sequences write their K/V into a block and their SSM state into
a slot that the worker keeps for them, so they never touch a real sequence's cache.
"""

from __future__ import annotations

import numpy as np
import torch

from metrale.workers.batch import ForwardBatch, RowsLayout, SeqRows

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)


def buckets_up_to(most: int) -> list[int]:
    """The batch sizes graphs are captured at for batches of up to `most` sequences."""
    return [b for b in BUCKETS if b < most] + [most]


def bucket_for(buckets: list[int], n: int) -> int | None:
    """The smallest bucket that holds n sequences (None: more than the largest)."""
    return next((b for b in buckets if b >= n), None)


def capture(step, pool):
    """Runs `step` once on a side stream (compiling kernels and settling the allocator), then
    captures it into a graph sharing `pool`. Returns the graph and what the captured call
    returned: the tensors each replay rewrites."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = step()
    return graph, out


class GraphRunner:
    """The target's captured steps. A step's inputs are two buffers (int64: ids, positions, KV
    indices, SSM slots; int32: row starts and counts, cached lengths, block tables) laid out for
    its bucket and row count; the host fills them, padding included, and sends each with one
    asynchronous copy from pinned memory. The graphs read them there, and the block tables from
    `tables`, into which one device copy spreads the step's."""

    def __init__(self, model, kv, ssm, max_seqs: int, max_rows: int, max_blocks_per_seq: int,
                 capture_layers: tuple[int, ...], pad_block: int, pad_slot: int):
        self.model, self.kv, self.ssm = model, kv, ssm
        self.capture_layers = capture_layers
        self.buckets = buckets_up_to(max_seqs)
        self.max_rows, self.pad_block, self.pad_slot = max_rows, pad_block, pad_slot
        self.block_size, self.width = kv.block_size, max_blocks_per_seq
        device = kv.k.device
        n_seq = self.buckets[-1]
        sizes = (3 * n_seq * max_rows + n_seq, 3 * n_seq + n_seq * max_blocks_per_seq)
        self.inputs = [torch.zeros(n, dtype=t, device=device)
                       for n, t in zip(sizes, (torch.long, torch.int32))]
        self.tables = torch.zeros(n_seq, max_blocks_per_seq, dtype=torch.int32, device=device)
        # two pinned staging sets, so a step fills one while the other's copy may still fly
        # (pinned, and the copies' events, on CUDA: tests rerun steps on the CPU for replays)
        cuda = device.type == "cuda"
        self.staging = [[torch.zeros(n, dtype=t, pin_memory=cuda)
                         for n, t in zip(sizes, (torch.long, torch.int32))] for _ in range(2)]
        self.copied = [torch.cuda.Event(), torch.cuda.Event()] if cuda else None
        self.turn = 0
        self.graphs: dict[tuple[int, int, bool], tuple] = {}
        self.pool = None
        # one set of outputs that every graph writes (each graph keeps only its view)
        cfg = model.config
        n_rows = n_seq * max_rows
        self.out_hidden = torch.empty(n_rows, cfg.hidden_size, dtype=cfg.dtype, device=device)
        self.out_captured = [torch.empty_like(self.out_hidden) for _ in capture_layers]
        self.out_logits = torch.empty(n_rows, cfg.vocab_size, dtype=torch.float32, device=device)

    def capture_all(self, lengths: list[int], verify: bool) -> None:
        """Captures every bucket for each row count (k + 1 for a verify of k drafts, with the
        hybrid's verify pool when `verify`), largest first, so no step waits for a capture."""
        for length in lengths:
            for bucket in reversed(self.buckets):
                key = (bucket, length, verify and length > 1)
                if key not in self.graphs:
                    self.graphs[key] = self._capture(*key)

    def bucket(self, n: int) -> int | None:
        return bucket_for(self.buckets, n)

    def fits(self, seqs: int, length: int, width: int) -> bool:
        """Whether `seqs` sequences of `length` rows each, their block tables `width` wide, fit
        a captured shape (the worker asks before it lays a step out; `eligible` after)."""
        return length <= self.max_rows and self.bucket(seqs) is not None and width <= self.width

    def eligible(self, layout: RowsLayout) -> bool:
        length = layout.uniform_length
        return (length is not None and len({s.verify for s in layout.seqs}) == 1
                and self.fits(len(layout.seqs), length, layout.tables.shape[1]))

    @torch.inference_mode()
    def run(self, layout: RowsLayout, patch=None, keep_hidden: bool = True
            ) -> tuple[torch.Tensor | None, list[torch.Tensor], torch.Tensor]:
        """Hidden rows, captured layers and float32 logits of every row of an eligible step;
        `patch(ids)` edits the input ids on the device (drafts or tokens still there) before the
        replay. The logits are the shared output buffer, valid until the next replay; the hidden
        rows are copied out of it unless `keep_hidden` is False (then None)."""
        graph, hidden, captured, logits = self.prepare(layout)
        rows = len(layout.seqs) * layout.uniform_length
        if patch is not None:
            patch(self.inputs[0][:rows])
        graph.replay()
        if not keep_hidden:
            return None, [], logits[:rows]
        return hidden[:rows].clone(), [c[:rows].clone() for c in captured], logits[:rows]

    def prepare(self, layout: RowsLayout) -> tuple:
        """Fills the buffers of an eligible step without replaying it (what `run` replays, or a
        graph captured around the step: `capture_around`, a chain's rounds in workers.chain).
        Returns the step's graph and its output buffers, capturing them on first use."""
        n, length, verify = len(layout.seqs), layout.uniform_length, layout.seqs[0].verify
        if self.ssm is not None:
            self.ssm.check_verify(layout.seqs)
        bucket = self.bucket(n)
        key = (bucket, length, verify)
        if key not in self.graphs:
            self.graphs[key] = self._capture(bucket, length, verify)
        self._fill(layout, bucket, length)
        return self.graphs[key]

    def input_ids(self, rows: int) -> torch.Tensor:
        """The first `rows` input ids of the step replayed last (drafts patched in)."""
        return self.inputs[0][:rows]

    def _views(self, bucket: int, length: int, width: int, tensors: list[torch.Tensor]):
        """The step's fields in `tensors` (device inputs or a staging set), for this shape: ids,
        positions, KV indices, slots; row starts, row counts, cached lengths, and the block
        tables `width` wide (the graphs read them from `self.tables`, where they are copied)."""
        rows, b = bucket * length, bucket
        wide, narrow = tensors
        return (wide[:rows], wide[rows:2 * rows], wide[2 * rows:3 * rows],
                wide[3 * rows:3 * rows + b], narrow[:b], narrow[b:2 * b], narrow[2 * b:3 * b],
                narrow[3 * b:3 * b + b * width].view(b, width))

    def _fill(self, layout: RowsLayout | None, bucket: int, length: int) -> None:
        """Writes the step's inputs, and the padding sequences' (position 0.., their own block
        and slot), into a staging set; one copy per buffer sends it to the device."""
        self.turn ^= 1
        staging = self.staging[self.turn]
        if self.copied:
            self.copied[self.turn].synchronize()   # its previous copy has left
        n = len(layout.seqs) if layout is not None else 0
        rows, bs = n * length, self.block_size
        # (no layout: a capture, whose padding sequences may run several rounds, every one of
        # them in the block kept for padding)
        width = layout.tables.shape[1] if layout is not None else self.width
        ids, pos, kv_index, slots, q_start, q_len, ctx, tables = (
            t.numpy() for t in self._views(bucket, length, width, staging))
        if layout is not None:
            ids[:rows], pos[:rows], kv_index[:rows] = layout.ids, layout.positions, layout.slot_mapping
            slots[:n] = [s.slot for s in layout.seqs]
            ctx[:n] = [s.context_len for s in layout.seqs]
            tables[:n] = layout.tables
        ids[rows:], pos[rows:] = 0, 0
        kv_index[rows:] = self.pad_block * bs + np.tile(np.arange(length) % bs, bucket - n)
        slots[n:], ctx[n:] = self.pad_slot, 0
        tables[n:] = self.pad_block
        q_start[:] = np.arange(0, bucket * length, length)
        q_len[:] = length
        sizes = (3 * bucket * length + bucket, 3 * bucket + bucket * width)
        for device_in, host, size in zip(self.inputs, staging, sizes):
            device_in[:size].copy_(host[:size], non_blocking=True)
        if self.copied:
            self.copied[self.turn].record()
        self.tables[:bucket, :width].copy_(self._views(bucket, length, width, self.inputs)[-1])

    def capture_around(self, bucket: int, length: int, verify: bool, before, after,
                       rounds: int = 1):
        """A graph of `rounds` steps in a row, each with the caller's work on its sides:
        `before(views)` writes the step's per-row inputs into its buffer views (`_views`: ids,
        positions, KV indices, ...), `after(logits, hidden, captured, r)` takes step r's
        float32 logits [bucket * length, vocab], its hidden rows and those of the captured
        layers. Captured over padding sequences only (the capture runs the steps once), so it
        writes no sequence's caches; `prepare` then fills a real step's buffers before each
        use."""
        return self._capture(bucket, length, verify, before, after, rounds)[0]

    def _capture(self, bucket: int, length: int, verify: bool, before=None, after=None,
                 rounds: int = 1):
        rows = bucket * length
        ids, pos, kv_index, slots, q_start, q_len, ctx, _ = self._views(bucket, length, 1,
                                                                        self.inputs)
        static = ForwardBatch(
            ids, pos, kv_index,
            [SeqRows(i * length, length, 0, None, self.pad_slot, verify) for i in range(bucket)],
            self.block_size, q_start, q_len, ctx, self.tables[:bucket], slots, backend="triton")
        self._fill(None, bucket, length)

        def step():
            if after is not None:
                for r in range(rounds):
                    before(self._views(bucket, length, 1, self.inputs))
                    hidden, captured = self.model(static, self.kv, self.ssm,
                                                  capture=self.capture_layers)
                    after(self.model.logits(hidden), hidden, captured, r)
                return
            hidden, captured = self.model(static, self.kv, self.ssm, capture=self.capture_layers)
            self.out_hidden[:rows].copy_(hidden)
            for out, c in zip(self.out_captured, captured):
                out[:rows].copy_(c)
            self.out_logits[:rows].copy_(self.model.logits(hidden))
        graph, _ = capture(step, self.pool)
        self.pool = graph.pool()
        return (graph, self.out_hidden[:rows], [c[:rows] for c in self.out_captured],
                self.out_logits[:rows])

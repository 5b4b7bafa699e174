"""CUDA graphs of the target's decode and verify steps: B sequences of L rows each, B rounded up
to a bucket, captured at start-up (or on first use) and replayed over static input buffers.

A captured step runs embedding, every layer and the logits of every row; the host only fills
the buffers. Rows of the padding sequences write their K/V into a block and their SSM state into
a slot that the worker keeps for them, so they never touch a real sequence's cache.
"""

from __future__ import annotations

import torch

from metrale.workers.batch import ForwardBatch, SeqRows

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
    def __init__(self, model, kv, ssm, max_seqs: int, max_rows: int, max_blocks_per_seq: int,
                 capture_layers: tuple[int, ...], pad_block: int, pad_slot: int):
        self.model, self.kv, self.ssm = model, kv, ssm
        self.capture_layers = capture_layers
        self.buckets = buckets_up_to(max_seqs)
        self.max_rows, self.pad_block, self.pad_slot = max_rows, pad_block, pad_slot
        self.block_size = kv.block_size
        device = kv.k.device
        n_seq, n_rows = self.buckets[-1], self.buckets[-1] * max_rows

        def zeros(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype, device=device)
        self.input_ids, self.positions, self.slot_mapping = zeros(n_rows), zeros(n_rows), zeros(n_rows)
        self.q_start, self.q_len = zeros(n_seq, dtype=torch.int32), zeros(n_seq, dtype=torch.int32)
        self.context_lens = zeros(n_seq, dtype=torch.int32)
        self.block_tables = zeros(n_seq, max_blocks_per_seq, dtype=torch.int32)
        self.slots = zeros(n_seq)
        self.graphs: dict[tuple[int, int, bool], tuple] = {}
        self.pool = None
        # one set of outputs that every graph writes (each graph keeps only its view)
        cfg = model.config
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

    def eligible(self, batch: ForwardBatch) -> bool:
        length = batch.uniform_length
        return (length is not None and length <= self.max_rows
                and self.bucket(len(batch.seqs)) is not None
                and len({s.verify for s in batch.seqs}) == 1
                and batch.block_tables.shape[1] <= self.block_tables.shape[1])

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """Hidden rows, captured layers and float32 logits of every row of an eligible batch."""
        n, length, verify = len(batch.seqs), batch.uniform_length, batch.seqs[0].verify
        if self.ssm is not None:
            self.ssm.check_verify(batch.seqs)
        bucket = self.bucket(n)
        key = (bucket, length, verify)
        if key not in self.graphs:
            self.graphs[key] = self._capture(bucket, length, verify)
        graph, hidden, captured, logits = self.graphs[key]
        self._fill(batch, n, bucket, length)
        graph.replay()
        rows = n * length
        return hidden[:rows].clone(), [c[:rows].clone() for c in captured], logits[:rows]

    def _fill(self, batch: ForwardBatch | None, n: int, bucket: int, length: int) -> None:
        rows, width = n * length, (batch.block_tables.shape[1] if batch is not None else 0)
        if batch is not None:
            self.input_ids[:rows].copy_(batch.input_ids)
            self.positions[:rows].copy_(batch.positions)
            self.slot_mapping[:rows].copy_(batch.slot_mapping)
            self.context_lens[:n].copy_(batch.context_lens)
            self.block_tables[:n, :width].copy_(batch.block_tables)
            self.slots[:n].copy_(batch.slots)
        # padding sequences: position 0.., their own block and slot
        pad = slice(n, bucket)
        self.slot_mapping[rows:bucket * length].copy_(
            self.pad_block * self.block_size
            + torch.arange(length, device=self.slots.device).repeat(bucket - n) % self.block_size)
        self.positions[rows:bucket * length].zero_()
        self.context_lens[pad] = 0
        self.block_tables[pad] = self.pad_block
        self.slots[pad] = self.pad_slot
        self.q_len[:bucket] = length
        torch.arange(0, bucket * length, length, out=self.q_start[:bucket])

    def _capture(self, bucket: int, length: int, verify: bool):
        rows = bucket * length
        static = ForwardBatch(
            self.input_ids[:rows], self.positions[:rows], self.slot_mapping[:rows],
            [SeqRows(i * length, length, 0, None, self.pad_slot, verify) for i in range(bucket)],
            self.block_size, self.q_start[:bucket], self.q_len[:bucket],
            self.context_lens[:bucket], self.block_tables[:bucket], self.slots[:bucket],
            backend="triton")
        self._fill(None, 0, bucket, length)

        def step():
            hidden, captured = self.model(static, self.kv, self.ssm, capture=self.capture_layers)
            self.out_hidden[:rows].copy_(hidden)
            for out, c in zip(self.out_captured, captured):
                out[:rows].copy_(c)
            self.out_logits[:rows].copy_(self.model.logits(hidden))
        graph, _ = capture(step, self.pool)
        self.pool = graph.pool()
        return (graph, self.out_hidden[:rows], [c[:rows] for c in self.out_captured],
                self.out_logits[:rows])

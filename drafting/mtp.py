"""The MTP proposer: the checkpoint's own multi-token-prediction layer, chained for k drafts."""

from __future__ import annotations

import math

import torch
from torch import nn

from metrale.drafting.proposer import (CommittedRows, HeldRows, Proposal, ProposeRequest,
                                       ProposerError, gather_rows, in_batches, masked_argmax)
from metrale.workers.batch import ForwardBatch, SeqRows, to_device
from metrale.workers.cuda_graphs import bucket_for, buckets_up_to, capture
from metrale.workers.kv_cache import PagedKVCache
from metrale.workers.models.config import ModelConfig
from metrale.workers.models.decoder import CausalLM, DecoderLayer, fuse_projections
from metrale.workers.models.layers import RMSNorm, Rotary


class MTPHead(nn.Module):
    """`h = fc([norm_e(embed(token)), norm_h(hidden)])`, then full-attention decoder layer(s)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, eps, offset=True)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, offset=True)
        self.layers = nn.ModuleList(DecoderLayer(cfg, "full_attention", i)
                                    for i in range(cfg.mtp_num_hidden_layers))
        self.norm = RMSNorm(h, eps, offset=True)

    def forward(self, embed: nn.Embedding, rotary: Rotary, tokens: torch.Tensor,
                hidden: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache | None) -> torch.Tensor:
        """Row p reads (token p+1, target hidden at p); returns hidden rows before the MTP norm.
        `embed` and `rotary` are the target's; without `kv` (training) rows attend within batch."""
        if batch.backend == "triton":   # one kernel per norm
            e = self.pre_fc_norm_embedding.fused(embed(tokens))
            h = self.pre_fc_norm_hidden.fused(hidden)
        else:
            e, h = self.pre_fc_norm_embedding(embed(tokens)), self.pre_fc_norm_hidden(hidden)
        x = self.fc(torch.cat((e, h), dim=-1))
        cos_sin = rotary.cos_sin(batch.positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos_sin, batch, kv, None)
        return x


class MTPProposer:
    method = "mtp"
    capture_layers: tuple[int, ...] = ()
    fixed_drafts = None
    keeps_row_state = True

    def __init__(self, target: CausalLM, tensors: dict[str, torch.Tensor], num_blocks: int,
                 block_size: int, num_slots: int, confidence_threshold: float | None = None,
                 max_batch: int = 64, backend: str = "torch", graphs: bool = False):
        cfg = target.config
        if cfg.mtp_num_hidden_layers < 1 or not tensors:
            raise ProposerError("speculative method 'mtp' needs the checkpoint's MTP layer: "
                                "config.json has no mtp_num_hidden_layers and the weights no mtp.* "
                                "tensors (use 'dflash', 'ngram' or 'self' instead)")
        device, dtype = target.lm_head.weight.device, cfg.dtype
        with torch.device("meta"):
            head = MTPHead(cfg)
        state = {name[len("mtp."):]: t for name, t in tensors.items()}
        missing = sorted(set(head.state_dict()) - set(state))
        unexpected = sorted(set(state) - set(head.state_dict()))
        if missing or unexpected:
            raise ProposerError(f"mtp.* tensors do not fit the target (missing {missing[:4]}, "
                                f"unexpected {unexpected[:4]})")
        for name, t in state.items():
            if t.shape != head.state_dict()[name].shape:
                raise ProposerError(f"mtp.{name} has shape {tuple(t.shape)}, the target's "
                                    f"dimensions imply {tuple(head.state_dict()[name].shape)}")
        head.load_state_dict(state, assign=True)
        self.head, self.target = head.eval(), target
        self.backend = backend
        if backend == "triton":
            fuse_projections(self.head.layers)
        self.kv = PagedKVCache(cfg.mtp_num_hidden_layers, num_blocks, block_size,
                               cfg.num_key_value_heads, cfg.head_dim, dtype, device)
        # Stash: the MTP output at each slot's last committed row, which yields the first draft
        # (one row more, written by the padding sequences of a captured catch-up).
        self.stash = torch.zeros(num_slots + 1, cfg.hidden_size, dtype=dtype, device=device)
        self.stash_pos = [0] * num_slots
        self.block_size, self.max_batch = block_size, max_batch
        self.held = HeldRows()
        # a draft whose probability is below the threshold ends its chain (the first is always kept)
        self.threshold = math.log(confidence_threshold) if confidence_threshold else None
        # greedy chains without a threshold replay a CUDA graph (the spare KV block takes the
        # writes of padding rows and of positions past a sequence's blocks)
        self.graphs = (MTPGraphs(self, max_batch, num_blocks - 1)
                       if graphs and backend == "triton" and self.threshold is None else None)

    @classmethod
    def from_worker(cls, target, mtp_tensors, num_blocks, block_size, num_slots,
                    mtp_confidence_threshold=None, propose_batch_max=64, backend="torch",
                    cuda_graphs=False, **_):
        return cls(target, mtp_tensors, num_blocks, block_size, num_slots,
                   mtp_confidence_threshold, propose_batch_max, backend, cuda_graphs)

    def _run(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        model = self.target.model
        return self.head(model.embed_tokens, model.rotary, batch.input_ids, hidden, batch, self.kv)

    def commit(self, rows: list[CommittedRows]) -> None:
        self._catch_up(self.held.add(rows))

    def before_chain(self, slots: list[int], context_lens: list[int]) -> None:
        """Before a chain of rounds drafts on the device (workers.chain): catches the slots up
        on every row they hold, so each stash is at the row before its pending token (position
        context_len - 1). The chain needs nothing else from the host."""
        self._catch_up(self.held.take(slots))
        assert all(self.stash_pos[s] == c - 1 for s, c in zip(slots, context_lens)), \
            "an MTP chain drafts from the row before each pending token"

    def after_chain(self, slot: int, context_len: int, tokens: int) -> None:
        """After a chain that emitted `tokens` from context_len: its rounds' catch-ups left the
        stash at the row before the next pending token."""
        self.stash_pos[slot] = context_len + tokens - 1

    @torch.inference_mode()
    def _catch_up(self, rows: list[CommittedRows]) -> None:
        """MTP rows for every committed position, including serially decoded ones: by replay of
        a captured catch-up when one fits, else eagerly."""
        if not rows:
            return
        if self.graphs is None or not self.graphs.catch_up(rows):
            batch = ForwardBatch.build([(r.next_tokens, r.start, r.block_table, -1) for r in rows],
                                       self.block_size, self.stash.device, self.backend)
            out = self._run(batch, gather_rows(rows, lambda r: [r.step_hidden]))
            last = [s.start + s.length - 1 for s in batch.seqs]
            index = to_device([[r.slot for r in rows], last], out.device)
            self.stash[index[0]] = out[index[1]]
        for r in rows:
            self.stash_pos[r.slot] = r.start + len(r.tokens) - 1

    @torch.inference_mode()
    def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        self._catch_up(self.held.take(r.slot for r in requests))
        return in_batches(requests, self.max_batch, self._propose_batch)

    @torch.inference_mode()
    def propose_on_device(self, requests: list[ProposeRequest]) -> torch.Tensor | None:
        """Greedy drafts [n, k] by the captured chain, left on the device (None without
        graphs or beyond one batch: then `propose` drafts)."""
        if self.graphs is None or len(requests) > self.max_batch:
            return None
        self._catch_up(self.held.take(r.slot for r in requests))
        return self.graphs.run(requests, max(r.num_drafts for r in requests))[0]

    def _propose_batch(self, requests: list[ProposeRequest]) -> list[Proposal]:
        if self.graphs is not None and not any(r.allowed for r in requests):
            k = max(r.num_drafts for r in requests)
            tokens, logp = self.graphs.run(requests, k)
            tokens, logp = tokens.tolist(), logp.tolist()   # the one host sync of a proposal
            return [Proposal(tokens[i][:r.num_drafts], logp[i][:r.num_drafts])
                    for i, r in enumerate(requests)]
        proposals = [Proposal([]) for _ in requests]
        hidden = self.stash[[r.slot for r in requests]]
        active = list(range(len(requests)))
        for step in range(max(r.num_drafts for r in requests)):
            norm = self.head.norm.fused if self.backend == "triton" else self.head.norm
            logits = self.target.lm_head(norm(hidden)).float()
            best = None
            if not any(requests[i].allowed for i in active):   # one host sync for the step
                top = torch.log_softmax(logits, -1).max(-1)
                best = list(zip(top.indices.tolist(), top.values.tolist()))
            still, next_rows = [], []
            for row, i in enumerate(active):
                req, prop = requests[i], proposals[i]
                if best is not None:
                    token, conf = best[row]
                else:
                    token, conf = masked_argmax(logits[row], req.allowed(prop.tokens)
                                                if req.allowed else None)
                if self.threshold is not None and prop.tokens and conf < self.threshold:
                    continue   # a low-confidence draft ends this chain
                prop.tokens.append(token)
                prop.confidence.append(conf)
                if len(prop.tokens) < req.num_drafts:
                    still.append(i)
                    next_rows.append(row)
            if not still:
                break
            # Chain: the next row reads (this draft, this row's MTP hidden) one position later.
            chunks = [(proposals[i].tokens[-1:], self.stash_pos[requests[i].slot] + step + 1,
                       requests[i].block_table, -1) for i in still]
            batch = ForwardBatch.build(chunks, self.block_size, hidden.device, self.backend)
            hidden = self._run(batch, hidden[next_rows])
            active = still
        return proposals


CATCH_UP_LENGTHS = (1, 2, 4, 8, 16)   # rows per sequence of a captured catch-up, padded up


class MTPGraphs:
    """CUDA graphs of greedy MTP chains per batch bucket and k: k argmaxes over the target's
    lm_head and the k - 1 MTP layer runs between them, positions and KV slots computed on the
    device from static inputs (each row's slot, stashed position and block table). And of the
    catch-up per batch bucket and rows per sequence L: each sequence's committed rows padded to
    L, the padding rows' K/V written into the spare block and the padding sequences' stash into
    the spare stash row."""

    def __init__(self, proposer: MTPProposer, max_batch: int, spare_block: int):
        self.p, self.spare = proposer, spare_block
        self.spare_row = proposer.stash.shape[0] - 1   # the padding sequences' stash row
        self.buckets = buckets_up_to(max_batch)
        cfg, device = proposer.target.config, proposer.stash.device
        width = -(-cfg.max_position_embeddings // proposer.block_size)
        n = self.buckets[-1]
        # each row's slot and its stashed row's position, sent together
        self.chain_in = torch.zeros(2, n, dtype=torch.long, device=device)
        self.slots, self.last = self.chain_in
        self.tables = torch.full((n, width), spare_block, dtype=torch.int32, device=device)
        self.sent: tuple | None = None   # (bucket, tables) last sent into `tables`
        self.graphs: dict[tuple[int, int], tuple] = {}
        # catch-up inputs: each row's next token, then each sequence's start, rows and slot
        rows = n * CATCH_UP_LENGTHS[-1]
        self.caught = torch.zeros(rows + 3 * n, dtype=torch.long, device=device)
        self.hidden = torch.zeros(rows, cfg.hidden_size, dtype=cfg.dtype, device=device)
        self.catch_ups: dict[tuple[int, int], object] = {}
        self.pool = None

    @torch.inference_mode()
    def capture_all(self, max_drafts: int) -> None:
        """Every bucket's chain for k = 1..max_drafts and catch-up for every captured length
        (a capture met while serving would stall its round: kernels compile for the graph's
        shapes), over the spare block."""
        for k in range(1, max_drafts + 1):
            for bucket in reversed(self.buckets):
                if (bucket, k) not in self.graphs:
                    self.graphs[bucket, k] = self._capture(bucket, k)
        for length in CATCH_UP_LENGTHS:
            for bucket in reversed(self.buckets):
                if (bucket, length) not in self.catch_ups:
                    self.catch_ups[bucket, length] = self._capture_catch_up(bucket, length)

    def run(self, requests: list[ProposeRequest], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft tokens and log-probabilities [len(requests), k], on the device."""
        n, p = len(requests), self.p
        bucket = bucket_for(self.buckets, n)
        if (bucket, k) not in self.graphs:   # (its capture writes the inputs)
            self.graphs[bucket, k] = self._capture(bucket, k)
        self._tables([r.block_table for r in requests], bucket)
        to_device([[r.slot for r in requests] + [0] * (bucket - n),
                   [p.stash_pos[r.slot] for r in requests] + [0] * (bucket - n)],
                  self.slots.device, out=self.chain_in[:, :bucket])
        graph, tokens, logp = self.graphs[bucket, k]
        graph.replay()
        return tokens[:n], logp[:n]

    def catch_up(self, rows: list[CommittedRows]) -> bool:
        """The MTP rows and stash of `rows` by replay; False when they do not fit a captured
        shape (more sequences than the largest bucket, or more rows than the longest length),
        and the caller runs them eagerly."""
        n = len(rows)
        bucket = bucket_for(self.buckets, n)
        length = bucket_for(CATCH_UP_LENGTHS, max(len(r.tokens) for r in rows))
        if bucket is None or length is None:
            return False
        if (bucket, length) not in self.catch_ups:   # (its capture writes the inputs)
            self.catch_ups[bucket, length] = self._capture_catch_up(bucket, length)
        pad = bucket - n
        tokens = [0] * (bucket * length)
        source = [0] * (bucket * length)   # each row's row in the step's hidden states
        shared = all(r.step_hidden is rows[0].step_hidden for r in rows)
        for i, r in enumerate(rows):
            tokens[i * length:i * length + len(r.next_tokens)] = r.next_tokens
            if shared:
                first = r.rows.indices(r.step_hidden.shape[0])[0]
                source[i * length:i * length + len(r.tokens)] = range(first, first + len(r.tokens))
            else:   # held rows joined from several steps: one copy per sequence
                self.hidden[i * length:i * length + len(r.tokens)].copy_(r.hidden)
        size = bucket * (length + 3)
        sent = to_device(tokens + [r.start for r in rows] + [0] * pad
                         + [len(r.tokens) for r in rows] + [1] * pad
                         + [r.slot for r in rows] + [self.spare_row] * pad
                         + (source if shared else []), self.caught.device)
        self.caught[:size].copy_(sent[:size])
        if shared:
            torch.index_select(rows[0].step_hidden, 0, sent[size:],
                               out=self.hidden[:bucket * length])
        self._tables([r.block_table for r in rows], bucket)
        self.catch_ups[bucket, length].replay()
        return True

    def _tables(self, tables: list[list[int]], bucket: int) -> None:
        """`tables` into the first rows of the static tables, the rest and the padding
        sequences' pointing at the spare block. Not sent again when they are the last sent (a
        round's catch-up and drafts mostly have the same)."""
        if self.sent is not None and self.sent[0] == bucket and self.sent[1] == tables:
            return
        self.sent = (bucket, [list(t) for t in tables])
        width = max(len(t) for t in tables)
        self.tables[:bucket].fill_(self.spare)
        to_device([list(t) + [self.spare] * (width - len(t)) for t in tables]
                  + [[self.spare] * width] * (bucket - len(tables)),
                  self.tables.device, torch.int32, out=self.tables[:bucket, :width])

    def _capture(self, bucket: int, k: int):
        # captured over padding sequences, whose drafts' K/V go to the spare block
        self.slots[:bucket].zero_()
        self.last[:bucket].zero_()
        self.tables[:bucket].fill_(self.spare)
        self.sent = None
        graph, out = capture(lambda: self._chain(bucket, k), self.pool)
        self.pool = graph.pool()
        return graph, *out

    def _capture_catch_up(self, bucket: int, length: int):
        # captured over padding sequences only: one row each, into the spare block and stash row
        rows = bucket * length
        self.caught[:rows + bucket].zero_()
        self.caught[rows + bucket:rows + 2 * bucket].fill_(1)
        self.caught[rows + 2 * bucket:rows + 3 * bucket].fill_(self.spare_row)
        self.tables[:bucket].fill_(self.spare)
        self.sent = None
        graph, _ = capture(lambda: self._catch_up(bucket, length), self.pool)
        self.pool = graph.pool()
        return graph

    def _catch_up(self, n: int, length: int) -> None:
        """The catch-up's forward over n sequences of `length` rows each, from the static
        inputs."""
        rows = n * length
        start, count, slot = self.caught[rows:rows + 3 * n].view(3, n)
        self.catch_up_rows(self.caught[:rows], start, count, slot, self.tables[:n],
                           self.hidden[:rows], length)

    def catch_up_rows(self, tokens: torch.Tensor, start: torch.Tensor, count: torch.Tensor,
                      slot: torch.Tensor, tables: torch.Tensor, hidden: torch.Tensor,
                      length: int) -> None:
        """The eager catch-up's forward, on the device and capturable, over n sequences of
        `length` rows each (`tokens` [n * length], each row's next token; `hidden` the
        target's rows), of which sequence i's first count[i] are real, from position start[i]
        in slot slot[i] with block table tables[i]: writes their MTP K/V (padding rows' into
        the spare block) and the stash at each one's last real row."""
        p, bs = self.p, self.p.block_size
        n, device = start.shape[0], start.device
        rows = n * length
        offset = torch.arange(length, device=device)
        real = offset[None, :] < count[:, None]
        pos = torch.where(real, start[:, None] + offset[None, :], start[:, None])
        block = tables.gather(1, pos // bs).long()
        kv_slot = torch.where(real, block * bs + pos % bs, self.spare * bs)
        q_start = torch.arange(0, rows, length, dtype=torch.int32, device=device)
        seqs = [SeqRows(i * length, length, 0, None, -1) for i in range(n)]
        batch = ForwardBatch(tokens, pos.flatten(), kv_slot.flatten(), seqs, bs, q_start,
                             count.int(), start.int(), tables, None, backend="triton")
        out = p._run(batch, hidden)
        p.stash[slot] = out[q_start.long() + count - 1]

    def round_drafts(self, slots, pending, context, seen, tables, k: int) -> torch.Tensor:
        """A chained round's drafts [n, k] (workers.chain): each stash is the MTP output at the
        row before the pending token."""
        return self.draft_chain(slots, context - 1, tables, k)[0]

    def round_commit(self, best, context, count, seen, slots, tables, hidden, captured,
                     length: int) -> None:
        """A chained round's catch-up on the first count[i] of each sequence's rows."""
        self.catch_up_rows(best, context, count, slots, tables, hidden, length)

    def _chain(self, n: int, k: int):
        return self.draft_chain(self.slots[:n], self.last[:n], self.tables[:n], k)

    def draft_chain(self, slots: torch.Tensor, last: torch.Tensor, tables: torch.Tensor,
                    k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy drafts and their log-probabilities [n, k], on the device and capturable, of
        the sequences in `slots` whose stashed rows are at positions `last`, with block tables
        `tables`."""
        p, bs = self.p, self.p.block_size
        n, device = slots.shape[0], slots.device
        hidden = p.stash[slots]
        ones = torch.ones(n, dtype=torch.int32, device=device)
        q_start = torch.arange(n, dtype=torch.int32, device=device)
        seqs = [SeqRows(i, 1, 0, None, -1) for i in range(n)]
        tokens, logps = [], []
        for step in range(k):
            top = torch.log_softmax(p.target.lm_head(p.head.norm.fused(hidden)).float(), -1).max(-1)
            tokens.append(top.indices)
            logps.append(top.values)
            if step == k - 1:
                break
            pos = last + step + 1
            block = tables.gather(1, (pos // bs)[:, None]).squeeze(1).long()
            batch = ForwardBatch(top.indices, pos, block * bs + pos % bs, seqs, bs, q_start, ones,
                                 pos.int(), tables, None, backend="triton")
            hidden = p._run(batch, hidden)
        return torch.stack(tokens, 1), torch.stack(logps, 1)

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
        # Stash: the MTP output at each slot's last committed row, which yields the first draft.
        self.stash = torch.zeros(num_slots, cfg.hidden_size, dtype=dtype, device=device)
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

    @torch.inference_mode()
    def _catch_up(self, rows: list[CommittedRows]) -> None:
        """MTP rows for every committed position, including serially decoded ones."""
        if not rows:
            return
        batch = ForwardBatch.build([(r.next_tokens, r.start, r.block_table, -1) for r in rows],
                                   self.block_size, self.stash.device, self.backend)
        out = self._run(batch, gather_rows(rows, lambda r: [r.step_hidden]))
        last = [s.start + s.length - 1 for s in batch.seqs]
        index = to_device([[r.slot for r in rows], last], out.device)
        self.stash[index[0]] = out[index[1]]
        for r, s in zip(rows, batch.seqs):
            self.stash_pos[r.slot] = s.context_len + s.length - 1

    @torch.inference_mode()
    def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        self._catch_up(self.held.take(r.slot for r in requests))
        return in_batches(requests, self.max_batch, self._propose_batch)

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


class MTPGraphs:
    """CUDA graphs of greedy MTP chains per batch bucket and k: k argmaxes over the target's
    lm_head and the k - 1 MTP layer runs between them, positions and KV slots computed on the
    device from static inputs (each row's slot, stashed position and block table)."""

    def __init__(self, proposer: MTPProposer, max_batch: int, spare_block: int):
        self.p, self.spare = proposer, spare_block
        self.buckets = buckets_up_to(max_batch)
        cfg, device = proposer.target.config, proposer.stash.device
        width = -(-cfg.max_position_embeddings // proposer.block_size)
        n = self.buckets[-1]
        self.slots = torch.zeros(n, dtype=torch.long, device=device)
        self.last = torch.zeros(n, dtype=torch.long, device=device)   # stashed row's position
        self.tables = torch.full((n, width), spare_block, dtype=torch.int32, device=device)
        self.graphs: dict[tuple[int, int], tuple] = {}
        self.pool = None

    def capture_all(self, max_drafts: int) -> None:
        """Every bucket's chain for k = 1..max_drafts (a capture met while serving would
        stall its round: kernels compile for the chain's shapes), over the spare block."""
        self.slots.zero_()
        self.last.zero_()
        self.tables.fill_(self.spare)
        for k in range(1, max_drafts + 1):
            for bucket in reversed(self.buckets):
                if (bucket, k) not in self.graphs:
                    self.graphs[bucket, k] = self._capture(bucket, k)

    def run(self, requests: list[ProposeRequest], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft tokens and log-probabilities [len(requests), k], on the device."""
        n, p = len(requests), self.p
        bucket = bucket_for(self.buckets, n)
        width = max(len(r.block_table) for r in requests)
        device = self.slots.device
        tables = to_device([list(r.block_table) + [self.spare] * (width - len(r.block_table))
                            for r in requests] + [[self.spare] * width] * (bucket - n),
                           device, torch.int32)
        rows = to_device([[r.slot for r in requests] + [0] * (bucket - n),
                          [p.stash_pos[r.slot] for r in requests] + [0] * (bucket - n)], device)
        self.slots[:bucket].copy_(rows[0])
        self.last[:bucket].copy_(rows[1])
        self.tables[:bucket].fill_(self.spare)
        self.tables[:bucket, :width].copy_(tables)
        if (bucket, k) not in self.graphs:
            self.graphs[bucket, k] = self._capture(bucket, k)
        graph, tokens, logp = self.graphs[bucket, k]
        graph.replay()
        return tokens[:n], logp[:n]

    def _capture(self, bucket: int, k: int):
        graph, out = capture(lambda: self._chain(bucket, k), self.pool)
        self.pool = graph.pool()
        return graph, *out

    def _chain(self, n: int, k: int):
        p, bs = self.p, self.p.block_size
        tables, device = self.tables[:n], self.slots.device
        hidden = p.stash[self.slots[:n]]
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
            pos = self.last[:n] + step + 1
            block = tables.gather(1, (pos // bs)[:, None]).squeeze(1).long()
            batch = ForwardBatch(top.indices, pos, block * bs + pos % bs, seqs, bs, q_start, ones,
                                 pos.int(), tables, None, backend="triton")
            hidden = p._run(batch, hidden)
        return torch.stack(tokens, 1), torch.stack(logps, 1)

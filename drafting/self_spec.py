"""Self-speculation: the target's first layers draft (layer skip), all layers verify."""

from __future__ import annotations

import torch

from metrale.drafting.proposer import (CommittedRows, Proposal, ProposeRequest, ProposerError,
                                       in_batches, masked_argmax)
from metrale.workers.batch import ForwardBatch
from metrale.workers.kv_cache import PagedKVCache
from metrale.workers.models.decoder import CausalLM
from metrale.workers.ssm_pool import SSMSlotPool


class SelfSpecProposer:
    method = "self"
    capture_layers: tuple[int, ...] = ()
    fixed_drafts = None
    keeps_row_state = False

    def __init__(self, target: CausalLM, kv: PagedKVCache, ssm: SSMSlotPool | None,
                 num_layers: int, max_batch: int = 64):
        n = target.config.num_hidden_layers
        if not 1 <= num_layers < n:
            raise ProposerError(f"self-speculation drafts with the first L layers: need "
                                f"1 <= L < {n}, got {num_layers}")
        self.target, self.kv, self.ssm, self.num_layers = target, kv, ssm, num_layers
        self.linear_layers = sum(1 for t in target.config.layer_types[:num_layers]
                                 if t == "linear_attention")
        self.block_size, self.max_batch = kv.block_size, max_batch

    @classmethod
    def from_worker(cls, target, kv, ssm, self_spec_layers=None, propose_batch_max=64, **_):
        layers = self_spec_layers or max(target.config.num_hidden_layers // 2, 1)
        return cls(target, kv, ssm, layers, propose_batch_max)

    @torch.inference_mode()
    def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        return in_batches(requests, self.max_batch, self._propose_batch)

    def _propose_batch(self, requests: list[ProposeRequest]) -> list[Proposal]:
        # The draft pass advances a copy of the linear-attention state; its K/V rows land where
        # the verify writes the same positions again.
        scratch = (self.ssm.scratch([r.slot for r in requests], self.linear_layers)
                   if self.ssm is not None else None)
        proposals = [Proposal([]) for _ in requests]
        inputs = [r.pending for r in requests]
        for step in range(max(r.num_drafts for r in requests)):
            active = [i for i, r in enumerate(requests) if r.num_drafts > step]
            chunks = [([inputs[i]], requests[i].position + step, requests[i].block_table, i)
                      for i in active]
            batch = ForwardBatch.build(chunks, self.block_size, self.kv.k.device)
            hidden, _ = self.target(batch, self.kv, scratch, num_layers=self.num_layers)
            logits = self.target.logits(hidden)
            for row, i in enumerate(active):
                req, prop = requests[i], proposals[i]
                token, conf = masked_argmax(logits[row], req.allowed(prop.tokens)
                                            if req.allowed else None)
                prop.tokens.append(token)
                prop.confidence.append(conf)
                inputs[i] = token
        return proposals

    def commit(self, rows: list[CommittedRows]) -> None:
        """The draft layers are the target's own: its caches are already up to date."""

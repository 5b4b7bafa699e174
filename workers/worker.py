"""A worker: owns the device, the target model, its KV cache and SSM slot pool, and runs step plans."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from metrale.cluster.plan import SampledToken, StepPlan, StepResult, WorkerCapacity
from metrale.workers.batch import ForwardBatch
from metrale.workers.kv_cache import PagedKVCache
from metrale.workers.models import load_model
from metrale.workers.sampler import logprobs_of, sample
from metrale.workers.ssm_pool import SSMSlotPool

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerConfig:
    model: str
    device: str = "auto"                 # auto | cpu | cuda | cuda:N
    dtype: str = "auto"                  # auto (from config.json) | float32 | bfloat16 | float16
    block_size: int = 16
    kv_cache_bytes: int = 256 << 20      # memory budget for the paged KV cache
    max_num_seqs: int = 64               # SSM slots for hybrid models: one per running sequence

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} requested but CUDA is not available")
        return torch.device(self.device)


class Worker:
    def __init__(self, config: WorkerConfig):
        self.config = config
        self.device = config.torch_device
        self.model, self.mtp_tensors = load_model(Path(config.model), self.device, config.dtype)
        cfg = self.model.config
        per_block = PagedKVCache.bytes_per_block(len(cfg.full_attention_layers), config.block_size,
                                                 cfg.num_key_value_heads, cfg.head_dim, cfg.dtype)
        num_blocks = max(config.kv_cache_bytes // max(per_block, 1), 1)
        if not cfg.full_attention_layers:
            num_blocks = (cfg.max_position_embeddings * config.max_num_seqs) // config.block_size
        if num_blocks * config.block_size < 2 * config.block_size:
            raise ValueError(f"kv_cache_bytes={config.kv_cache_bytes} holds fewer than two blocks "
                             f"of {per_block} bytes")
        self.kv = PagedKVCache(len(cfg.full_attention_layers), num_blocks, config.block_size,
                               cfg.num_key_value_heads, cfg.head_dim, cfg.dtype, self.device)
        self.ssm = None
        if cfg.is_hybrid:
            self.ssm = SSMSlotPool(len(cfg.linear_attention_layers), config.max_num_seqs,
                                   cfg.linear_conv_dim, cfg.linear_conv_kernel_dim,
                                   cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                   cfg.linear_value_head_dim, cfg.dtype, self.device)
        self.capacity = WorkerCapacity(
            num_blocks=num_blocks, block_size=config.block_size,
            num_slots=config.max_num_seqs if cfg.is_hybrid else 0,
            max_model_len=cfg.max_position_embeddings, vocab_size=cfg.vocab_size,
            eos_token_ids=cfg.eos_token_ids, hybrid=cfg.is_hybrid)
        log.info("worker on %s: %s, %d KV blocks x %d tokens (%.1f MiB), %d SSM slots (%.1f MiB)",
                 self.device, cfg.family, num_blocks, config.block_size,
                 self.kv.k.nbytes * 2 / 2**20, self.capacity.num_slots, self.ssm_bytes / 2**20)

    @property
    def ssm_bytes(self) -> int:
        return 0 if self.ssm is None else self.ssm.conv.nbytes + self.ssm.state.nbytes

    def memory_report(self) -> dict:
        return {"kv_cache_bytes": self.kv.k.nbytes * 2, "kv_blocks": self.capacity.num_blocks,
                "ssm_pool_bytes": self.ssm_bytes, "ssm_slots": self.capacity.num_slots}

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        if not plan.work:
            return StepResult([])
        fresh = [w.slot for w in plan.work if w.context_len == 0 and w.slot >= 0]
        if fresh and self.ssm is not None:
            self.ssm.reset(fresh)
        batch = ForwardBatch.build([(w.tokens, w.context_len, w.block_table, w.slot)
                                    for w in plan.work], self.config.block_size, self.device)
        hidden = self.model(batch, self.kv, self.ssm)
        rows = [(w, s.start + s.length - 1) for w, s in zip(plan.work, batch.seqs) if w.sample]
        if not rows:
            return StepResult([])
        logits = self.model.logits(hidden[[r for _, r in rows]])
        specs = [w.sample for w, _ in rows]
        tokens = sample(logits, specs)
        top = max((s.logprobs or 0) for s in specs)
        want_lp = any(s.logprobs is not None for s in specs)
        chosen, top_ids, top_vals = logprobs_of(logits, tokens, top) if want_lp else (None,) * 3
        out = []
        for i, ((w, _), tok) in enumerate(zip(rows, tokens.tolist())):
            sampled = SampledToken(w.seq_id, tok)
            if want_lp and w.sample.logprobs is not None:
                n = w.sample.logprobs
                sampled.logprob = float(chosen[i])
                sampled.top = list(zip(top_ids[i, :n].tolist(), top_vals[i, :n].tolist()))
            out.append(sampled)
        return StepResult(out)

"""The Qwen3 / Qwen3.5 decoder-only language model over metrale's paged KV cache and SSM slot pool."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from metrale.workers.batch import ForwardBatch
from metrale.workers.kv_cache import PagedKVCache
from metrale.workers.models import kernels
from metrale.workers.models.config import ModelConfig
from metrale.workers.models.gated_deltanet import GatedDeltaNet
from metrale.workers.models.layers import MLP, RMSNorm, Rotary, paged_attention
from metrale.workers.models.parallel import (SINGLE, ColumnParallelLinear, ParallelLMHead,
                                             RowParallelLinear, VocabParallelEmbedding)
from metrale.workers.parallel import TensorParallel

if TYPE_CHECKING:   # ssm_pool imports metrale.workers.models, whose package imports this module
    from metrale.workers.ssm_pool import SSMSlotPool


class Attention(nn.Module):
    """GQA with per-head q/k RMSNorm and RoPE; Qwen3.5 adds an output gate and partial RoPE.
    Under tensor parallelism each rank holds its share of the query and key/value heads."""

    def __init__(self, cfg: ModelConfig, kv_index: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.kv_index = kv_index
        self.gated = cfg.family == "qwen3_5"
        heads, kv_heads, self.head_dim = (cfg.num_attention_heads, cfg.num_key_value_heads,
                                          cfg.head_dim)
        self.heads, self.kv_heads = tp.split(heads), tp.split(kv_heads)
        # per head [query | gate], so a rank's share of whole heads is one contiguous slice
        q_out = heads * self.head_dim * (2 if self.gated else 1)
        bias, hidden = cfg.attention_bias, cfg.hidden_size
        self.q_proj = ColumnParallelLinear(hidden, q_out, bias, tp)
        self.k_proj = ColumnParallelLinear(hidden, kv_heads * self.head_dim, bias, tp)
        self.v_proj = ColumnParallelLinear(hidden, kv_heads * self.head_dim, bias, tp)
        self.o_proj = RowParallelLinear(heads * self.head_dim, hidden, bias, tp)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, offset=self.gated)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, offset=self.gated)

    def forward(self, x, cos_sin, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        rows = x.shape[0]
        if batch.backend == "triton" and hasattr(self, "qkv") and kv is not None:
            q, gate = self._fused_qkv_to_cache(x, cos_sin, batch, kv)
            out = kernels.paged_attention(q, kv.k[self.kv_index], kv.v[self.kv_index],
                                          batch.block_tables, batch.q_start, batch.q_len,
                                          batch.context_lens, batch.max_q_len,
                                          self.head_dim ** -0.5)
        else:
            q = self.q_proj(x).view(rows, self.heads, -1)
            if self.gated:  # per head: [query | gate]
                q, gate = q.chunk(2, dim=-1)
            q = Rotary.apply(self.q_norm(q), *cos_sin)
            k = Rotary.apply(self.k_norm(self.k_proj(x).view(rows, self.kv_heads, self.head_dim)),
                             *cos_sin)
            v = self.v_proj(x).view(rows, self.kv_heads, self.head_dim)
            out = paged_attention(q, k, v, kv, self.kv_index, batch, self.head_dim ** -0.5)
        out = out.reshape(rows, -1)
        if self.gated:
            out = out * torch.sigmoid(gate.reshape(rows, -1))
        return self.o_proj(out)

    def _fused_qkv_to_cache(self, x, cos_sin, batch: ForwardBatch, kv: PagedKVCache):
        """q and gate (None unless gated) from one GEMM; norm and rotary of q and k, and the K/V
        cache write, in one kernel."""
        rows, d = x.shape[0], self.head_dim
        qkv = kernels.linear(x, self.qkv)
        q_width = self.heads * d * (2 if self.gated else 1)
        q = qkv[:, :q_width].view(rows, self.heads, -1)
        k = qkv[:, q_width:q_width + self.kv_heads * d].view(rows, self.kv_heads, d)
        v = qkv[:, q_width + self.kv_heads * d:].view(rows, self.kv_heads, d)
        gate = q[..., d:] if self.gated else None
        q = kernels.qk_norm_rope_to_cache(
            q[..., :d], k, v, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
            self.q_norm.offset, *cos_sin, kv.k[self.kv_index], kv.v[self.kv_index],
            batch.slot_mapping)
        return q, gate


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str, cache_index: int,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        offset = cfg.family == "qwen3_5"
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, cache_index, tp)
        else:
            self.self_attn = Attention(cfg, cache_index, tp)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset)

    def forward(self, x, cos_sin, batch, kv, ssm):
        fused = batch.backend == "triton"
        h = self.input_layernorm.fused(x) if fused else self.input_layernorm(x)
        h = self._mixer(h, cos_sin, batch, kv, ssm)
        if fused:   # the residual add and the norm in one kernel
            h, x = self.post_attention_layernorm.fused(h, residual=x)
            return x + self.mlp(h, fused=True)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_deferred(self, x, pending, cos_sin, batch, kv, ssm):
        """The Triton path with the residual add left pending: the layer's output is x + pending,
        and the previous layer's `pending` (None before the first layer) is added inside this
        layer's input norm, so no layer runs an add of its own. Returns (x, pending)."""
        if pending is None:
            h = self.input_layernorm.fused(x)
        else:
            h, x = self.input_layernorm.fused(pending, residual=x)
        h = self._mixer(h, cos_sin, batch, kv, ssm)
        h, x = self.post_attention_layernorm.fused(h, residual=x)
        return x, self.mlp(h, fused=True)

    def _mixer(self, h, cos_sin, batch, kv, ssm):
        if hasattr(self, "linear_attn"):
            return self.linear_attn(h, batch, ssm)
        return self.self_attn(h, cos_sin, batch, kv)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        full, linear = cfg.full_attention_layers, cfg.linear_attention_layers
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, t, (full if t == "full_attention" else linear).index(i), tp)
            for i, t in enumerate(cfg.layer_types))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=cfg.family == "qwen3_5")
        self.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta)


def fuse(owner: nn.Module, name: str, parts: list[nn.Linear]) -> None:
    """`owner.<name>`: the parts' weights in one tensor, each part's weight now a view of it."""
    whole = torch.cat([p.weight.data for p in parts])
    start = 0
    for p in parts:
        n = p.weight.shape[0]
        p.weight.data = whole[start:start + n]
        start += n
    setattr(owner, name, whole)


def fuse_projections(layers) -> None:
    """Concatenates q/k/v, gate/up and DeltaNet input weights into one tensor each, the separate
    parameters becoming views of it, so the Triton path runs one GEMM where the torch path runs
    two to four. For a single rank without biases (the fused path is not used otherwise)."""
    for layer in layers:
        fuse(layer.mlp, "gate_up", [layer.mlp.gate_proj, layer.mlp.up_proj])
        d = getattr(layer, "linear_attn", None)
        if d is not None:
            fuse(d, "in_proj", [d.in_proj_qkv, d.in_proj_z, d.in_proj_b, d.in_proj_a])
        a = getattr(layer, "self_attn", None)
        if a is not None and a.q_proj.bias is None:
            fuse(a, "qkv", [a.q_proj, a.k_proj, a.v_proj])


class CausalLM(nn.Module):
    """Embeddings, decoder layers and lm_head; parameter names follow the Hugging Face checkpoints.
    With `tp` of several ranks, this rank's shard: hidden states and logits are whole on every rank."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.config, self.tp = cfg, tp
        self.model = DecoderModel(cfg, tp)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: PagedKVCache | None, ssm: SSMSlotPool | None,
                capture: tuple[int, ...] = (), num_layers: int | None = None
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Runs every row of the batch through the first `num_layers` layers (all by default).

        Returns the hidden states before the final norm, [T, hidden], and the output of each layer
        listed in `capture` (DFlash drafters read them).
        """
        x = self.model.embed_tokens(batch.input_ids)
        cos_sin = self.model.rotary.cos_sin(batch.positions, x.dtype)
        captured = {}
        if batch.backend == "triton":   # each layer's residual add runs in the next one's norm
            pending = None
            for i, layer in enumerate(self.model.layers[:num_layers]):
                x, pending = layer.forward_deferred(x, pending, cos_sin, batch, kv, ssm)
                if i in capture:
                    captured[i] = x + pending
            return (x + pending if pending is not None else x), [captured[i] for i in capture]
        for i, layer in enumerate(self.model.layers[:num_layers]):
            x = layer(x, cos_sin, batch, kv, ssm)
            if i in capture:
                captured[i] = x
        return x, [captured[i] for i in capture]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits from pre-norm hidden rows."""
        return self.lm_head(self.model.norm(hidden)).float()

"""Building blocks shared by the Qwen3 and Qwen3.5 decoders: norms, rotary embedding, MLP, paged attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metrale.workers.batch import ForwardBatch, to_device
from metrale.workers.kv_cache import PagedKVCache
from metrale.workers.models import kernels
from metrale.workers.models.parallel import SINGLE, ColumnParallelLinear, RowParallelLinear
from metrale.workers.parallel import TensorParallel


class RMSNorm(nn.Module):
    """RMSNorm; `offset=True` is Qwen3.5's zero-centred form that scales by (1 + weight)."""

    def __init__(self, dim: int, eps: float, offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps, self.offset = eps, offset

    def fused(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """The same in one Triton kernel; with `residual`, of x + residual: (normed, sum)."""
        return kernels.rms_norm(x, self.weight, self.eps, self.offset, residual)

    def fused_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Per-head norm of x [T, heads, D], then rotary, in one Triton kernel."""
        return kernels.norm_rope(x, self.weight, self.eps, self.offset, cos, sin)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:  # Qwen3.5 multiplies in float32 and casts last
            return (normed * (1.0 + self.weight.float())).type_as(x)
        return self.weight * normed.to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm of the linear-attention output, then multiplied by SiLU(gate)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def fused(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The same in one Triton kernel, for x and gate [T, heads, dim]."""
        return kernels.gated_rms_norm(x, gate, self.weight, self.eps)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * normed.to(dtype) * F.silu(gate.float())).to(dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden, intermediate, False, tp)
        self.up_proj = ColumnParallelLinear(hidden, intermediate, False, tp)
        self.down_proj = RowParallelLinear(intermediate, hidden, False, tp)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        if fused and hasattr(self, "gate_up"):   # one GEMM, one activation kernel
            return self.down_proj(kernels.linear_silu_mul(x, self.gate_up))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Rotary(nn.Module):
    """Rotary embedding on the first `rotary_dim` features of each head (all of them when full)."""

    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rotary_dim = rotary_dim

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, head_dim]; cos, sin: [T, 1, rotary_dim]."""
        d = cos.shape[-1]
        rot, rest = x[..., :d], x[..., d:]
        half = d // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PagedKVCache,
                    layer: int, batch: ForwardBatch, scale: float) -> torch.Tensor:
    """Writes this batch's K/V into the paged cache, then attends causally over each sequence's cache.

    q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim]. Returns [T, heads, head_dim].
    Without a cache (training) each sequence attends over its own rows, from position 0.
    """
    if cache is None:
        return _attend_rows(q, k, v, batch, scale)
    if batch.backend == "triton":   # K and V written by one kernel, not two index_puts
        kernels.write_kv(k, v, cache.k[layer], cache.v[layer], batch.slot_mapping)
        return kernels.paged_attention(q, cache.k[layer], cache.v[layer], batch.block_tables,
                                       batch.q_start, batch.q_len, batch.context_lens,
                                       batch.max_q_len, scale)
    cache.write(layer, batch, k, v)
    if batch.uniform_length is not None and len(batch.seqs) > 1:
        return _attend_padded(q, cache, layer, batch, scale)
    out = torch.empty_like(q)
    for s in batch.seqs:
        keys, values = cache.read(layer, s)
        rows = slice(s.start, s.start + s.length)
        q_pos = torch.arange(s.context_len, s.total_len, device=q.device)
        mask = torch.arange(s.total_len, device=q.device)[None, :] <= q_pos[:, None]
        out[rows] = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=True).transpose(0, 1)
    return out


def _attend_rows(q, k, v, batch, scale):
    if batch.uniform_length is not None:   # equal sequences (training batches): one call
        n, length = len(batch.seqs), batch.uniform_length
        q, k, v = (t.view(n, length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                             enable_gqa=True).transpose(1, 2)
        return out.reshape(n * length, *out.shape[-2:])
    out = []
    for s in batch.seqs:
        assert s.context_len == 0, "attention without a cache needs whole sequences"
        rows = slice(s.start, s.start + s.length)
        out.append(F.scaled_dot_product_attention(
            q[rows].transpose(0, 1), k[rows].transpose(0, 1), v[rows].transpose(0, 1),
            is_causal=True, scale=scale, enable_gqa=True).transpose(0, 1))
    return torch.cat(out)


def _attend_padded(q, cache, layer, batch, scale):
    """All sequences have L rows (decode, verify): one attention call over padded caches."""
    n_seq, length = len(batch.seqs), batch.uniform_length
    keys, values = cache.read_padded(layer, batch.seqs)          # [B, S, kv_heads, head_dim]
    ctx = to_device([s.context_len for s in batch.seqs], q.device)
    q_pos = ctx[:, None] + torch.arange(length, device=q.device)[None, :]        # [B, L]
    k_pos = torch.arange(keys.shape[1], device=q.device)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]                              # [B, L, S]
    qb = q.view(n_seq, length, *q.shape[1:]).transpose(1, 2)                      # [B, H, L, D]
    out = F.scaled_dot_product_attention(qb, keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=mask[:, None], scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(q.shape)

"""Gated DeltaNet, the linear-attention token mixer of Qwen3.5, over per-slot conv and recurrent state."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from metrale.workers.batch import ForwardBatch
from metrale.workers.models import kernels
from metrale.workers.models.config import ModelConfig
from metrale.workers.models.layers import GatedRMSNorm
from metrale.workers.models.parallel import (SINGLE, ColumnParallelLinear, RowParallelLinear,
                                             Shard)
from metrale.workers.parallel import TensorParallel
from metrale.workers.ssm_pool import SSMSlotPool


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule(q, k, v, g, beta, state, keep_states: bool = False):
    """The recurrence, token by token, in float32.

    q, k: [B, L, H, dk] (already repeated to the value heads); v: [B, L, H, dv]; g, beta: [B, L, H];
    state: [B, H, dk, dv]. Returns outputs [B, L, H, dv], the final state, and, with `keep_states`,
    the state after every token [B, L, H, dk, dv].
    """
    q = l2norm(q.float()) * q.shape[-1] ** -0.5
    k, v, g, beta = l2norm(k.float()), v.float(), g.float(), beta.float()
    out = torch.empty_like(v)
    states = [] if keep_states else None
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]                    # S <- exp(g_t) S
        kv_mem = (k[:, t].unsqueeze(-2) @ state).squeeze(-2)             # S^T k_t
        delta = (v[:, t] - kv_mem) * beta[:, t, :, None]                  # u_t
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]        # S <- S + k_t u_t^T
        out[:, t] = (q[:, t].unsqueeze(-2) @ state).squeeze(-2)          # o_t = S^T q_t
        if keep_states:
            states.append(state)
    return out, state, (torch.stack(states, dim=1) if keep_states else None)


def causal_conv1d_update(mixed: torch.Tensor, weight: torch.Tensor, window: torch.Tensor,
                         slots: torch.Tensor, keep: torch.Tensor | None = None,
                         entries: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal conv then SiLU over B sequences of L rows, mixed [B, L, C], with weight
    [C, 1, K]. Each sequence's inputs are its conv window, one layer's windows [slots, C, K-1]
    read at `slots` [B] (kept in their dtype), then its rows. Without `keep` the slots' windows
    become their last K-1 inputs; with it the window after row t goes to keep[entries[b, t]].
    Returns [B, L, C] in mixed's dtype."""
    kernel = weight.shape[-1]
    extended = torch.cat((window[slots], mixed.transpose(1, 2).to(window.dtype)), -1)
    if keep is not None:
        # the conv window after row t is columns t+1 .. t+K-1 of the extended window
        per_row = extended.unfold(-1, kernel - 1, 1)[:, :, 1:]      # [B, C, L, K-1]
        keep[entries] = per_row.permute(0, 2, 1, 3)
    else:
        window[slots] = extended[..., -(kernel - 1):]
    # depthwise causal conv: out[t] = sum_i w[:, i] * extended[:, t + i]
    taps = extended.to(weight.dtype).unfold(-1, kernel, 1)   # [B, C, L, K]
    conv = F.silu((taps * weight[:, 0][None, :, None, :]).sum(-1))
    return conv.transpose(1, 2).to(mixed.dtype)


class GatedDeltaNet(nn.Module):
    """Under tensor parallelism each rank holds its share of the key and value heads (a key head
    and the consecutive value heads it serves stay on one rank), with their conv channels."""

    def __init__(self, cfg: ModelConfig, pool_index: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.pool_index = pool_index
        self.num_k_heads = tp.split(cfg.linear_num_key_heads)
        self.num_v_heads = tp.split(cfg.linear_num_value_heads)
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        kernel = cfg.linear_conv_kernel_dim
        conv_dim = 2 * self.key_dim + self.value_dim
        # q | k | v channels, each split by heads
        qkv = (cfg.linear_key_dim, cfg.linear_key_dim, cfg.linear_value_dim)
        hidden, v_heads = cfg.hidden_size, cfg.linear_num_value_heads
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, kernel, groups=conv_dim, bias=False,
                                padding=kernel - 1)
        self.conv1d.shards = {"weight": Shard(0, qkv)}
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.shards = {"dt_bias": Shard(0, (v_heads,)), "A_log": Shard(0, (v_heads,))}
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = RowParallelLinear(cfg.linear_value_dim, hidden, False, tp)
        self.in_proj_qkv = ColumnParallelLinear(hidden, sum(qkv), False, tp, sections=qkv)
        self.in_proj_z = ColumnParallelLinear(hidden, cfg.linear_value_dim, False, tp)
        self.in_proj_b = ColumnParallelLinear(hidden, v_heads, False, tp)
        self.in_proj_a = ColumnParallelLinear(hidden, v_heads, False, tp)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, pool: SSMSlotPool) -> torch.Tensor:
        n_rows = x.shape[0]
        if batch.backend == "triton" and hasattr(self, "in_proj"):   # one GEMM for all four
            mixed, z, b, a = F.linear(x, self.in_proj).split(
                [2 * self.key_dim + self.value_dim, self.value_dim, self.num_v_heads,
                 self.num_v_heads], dim=-1)
        else:
            mixed, z, b, a = (self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x),
                              self.in_proj_a(x))
        z = z.reshape(n_rows, self.num_v_heads, self.head_v_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        core = torch.empty(n_rows, self.num_v_heads, self.head_v_dim, dtype=x.dtype, device=x.device)
        pool.check_verify(batch.seqs)
        for rows, slots, verify in _groups(batch, x.device):
            out = self._mix(mixed[rows], g[rows], beta[rows], slots, pool, verify, batch.backend)
            core[rows] = out.to(x.dtype)
        out = self.norm.fused(core, z) if batch.backend == "triton" else self.norm(core, z)
        return self.out_proj(out.reshape(n_rows, self.value_dim))

    def _mix(self, mixed, g, beta, slots, pool, verify: bool, backend: str):
        """mixed: [B, L, conv_dim] for B sequences of L rows each. Updates their slots in place, or
        with `verify` writes the state after each row into the slots' verify-pool entries 0..L-1."""
        layer, length = self.pool_index, mixed.shape[1]
        entries = pool.entries(slots, length) if verify else None
        keep = pool.verify_conv[layer] if verify else None
        if backend == "triton":
            conv = kernels.causal_conv1d_update(mixed, self.conv1d.weight, pool.conv[layer], slots,
                                                keep, pool.offsets if verify else None)
            return self._mix_on_gpu(*self._heads(conv), g, beta, slots, pool, entries)
        conv = causal_conv1d_update(mixed, self.conv1d.weight, pool.conv[layer], slots, keep,
                                    entries)
        q, k, v = self._heads(conv)
        if self.num_v_heads != self.num_k_heads:  # each key head serves consecutive value heads
            rep = self.num_v_heads // self.num_k_heads
            q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        out, state, states = gated_delta_rule(q, k, v, g, beta, pool.state[layer, slots],
                                              keep_states=verify)
        if verify:
            pool.verify_state[layer, entries] = states
        else:
            pool.state[layer, slots] = state
        return out

    def _mix_on_gpu(self, q, k, v, g, beta, slots, pool, entries):
        """The recurrence in Triton, reading and writing the pool in place; long chunks without a
        verify go to flash-linear-attention's chunked kernel when it is installed."""
        layer, n_seq, length = self.pool_index, q.shape[0], q.shape[1]
        chunk = _fla_chunk() if entries is None and length >= FLA_CHUNK_MIN_ROWS else None
        if chunk is None:
            keep = pool.verify_state[layer] if entries is not None else None
            return kernels.gated_delta_rule(q, k, v, g.view(n_seq, length, -1),
                                            beta.view(n_seq, length, -1), pool.state[layer],
                                            slots, keep, entries)
        rep = self.num_v_heads // self.num_k_heads
        out, state = chunk(q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2), v,
                           g.view(n_seq, length, -1).float(), beta.view(n_seq, length, -1).float(),
                           scale=self.head_k_dim ** -0.5, initial_state=pool.state[layer, slots],
                           output_final_state=True, use_qk_l2norm_in_kernel=True)
        pool.state[layer, slots] = state
        return out

    def _heads(self, conv: torch.Tensor):
        """q, k [B, L, key_heads, dk] and v [B, L, value_heads, dv]: views of the conv output."""
        q, k, v = conv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.unflatten(-1, (self.num_k_heads, self.head_k_dim)),
                k.unflatten(-1, (self.num_k_heads, self.head_k_dim)),
                v.unflatten(-1, (self.num_v_heads, self.head_v_dim)))


def _fla_chunk():
    """flash-linear-attention's chunked recurrence for long chunks (prefill), when installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


FLA_CHUNK_MIN_ROWS = 64   # shorter chunks (decode, verify, short prefill) run token by token


def _groups(batch: ForwardBatch, device):
    """Row indices [B, L], slots [B] and the verify flag of each set of sequences that share a
    chunk length and a verify flag, so each set runs as one batched recurrence."""
    groups: dict[tuple[int, bool], list] = {}
    for s in batch.seqs:
        groups.setdefault((s.length, s.verify), []).append(s)
    if len(groups) == 1 and batch.slots is not None:   # decode or verify: from device tensors
        (length, verify), = groups
        rows = torch.arange(len(batch.seqs) * length, device=device).view(-1, length)
        yield rows, batch.slots, verify
        return
    for (length, verify), seqs in groups.items():
        starts = torch.tensor([s.start for s in seqs], device=device)
        rows = starts[:, None] + torch.arange(length, device=device)[None, :]
        yield rows, torch.tensor([s.slot for s in seqs], device=device), verify

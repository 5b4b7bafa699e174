"""Gated DeltaNet, the linear-attention token mixer of Qwen3.5, over per-slot conv and recurrent state."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from metrale.workers.batch import ForwardBatch, to_device
from metrale.workers.models import kernels
from metrale.workers.models.config import ModelConfig
from metrale.workers.models.layers import GatedRMSNorm
from metrale.workers.models.parallel import (SINGLE, ColumnParallelLinear, RowParallelLinear,
                                             Shard)
from metrale.workers.parallel import TensorParallel

if TYPE_CHECKING:   # ssm_pool imports metrale.workers.models, whose package imports this module
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
    k, v, beta = l2norm(k.float()), v.float(), beta.float()
    decay = g.float().exp()
    out = torch.empty_like(v)
    states = v.new_empty(*k.shape, v.shape[-1]) if keep_states else None   # [B, L, H, dk, dv]
    for t in range(q.shape[1]):
        state = state * decay[:, t, :, None, None]                        # S <- exp(g_t) S (a copy)
        kv_mem = (k[:, t].unsqueeze(-2) @ state).squeeze(-2)             # S^T k_t
        delta = (v[:, t] - kv_mem) * beta[:, t, :, None]                  # u_t
        state.addcmul_(k[:, t, :, :, None], delta[:, :, None, :])         # S <- S + k_t u_t^T
        out[:, t] = (q[:, t].unsqueeze(-2) @ state).squeeze(-2)          # o_t = S^T q_t
        if keep_states:
            states[:, t] = state
    return out, state, states


def gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """Per row and value head: the decay g = -exp(A_log) * softplus(a + dt_bias) in float32 and
    the write strength beta = sigmoid(b) in b's dtype."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


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
            mixed, z, b, a = kernels.linear(x, self.in_proj).split(
                [2 * self.key_dim + self.value_dim, self.value_dim, self.num_v_heads,
                 self.num_v_heads], dim=-1)
        else:
            mixed, z, b, a = (self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x),
                              self.in_proj_a(x))
        pool.check_verify(batch.seqs)
        mix = self._mix_on_gpu if batch.backend == "triton" else self._mix
        z = z.unflatten(-1, (self.num_v_heads, self.head_v_dim))
        parts = []
        for rows, slots, length, verify in _groups(batch, x.device):
            out = mix(_take(mixed, rows, length), _take(a, rows, length), _take(b, rows, length),
                      _take(z, rows, length), slots, pool, verify)
            parts.append((rows, out))
        return self.out_proj(_join(parts, n_rows).reshape(n_rows, self.value_dim))

    def _mix(self, mixed, a, b, z, slots, pool, verify: bool):
        """The torch reference over B sequences of L rows each: mixed [B, L, conv_dim], the
        gates' projections a, b [B, L, value_heads] and the output gate z [B, L, value_heads, dv].
        Updates their slots in place, or with `verify` writes the state after each row into the
        slots' verify-pool entries 0..L-1. Returns the normed, gated outputs [B, L, value_heads,
        dv] in z's dtype."""
        layer, length = self.pool_index, mixed.shape[1]
        entries = pool.entries(slots, length) if verify else None
        conv = causal_conv1d_update(mixed, self.conv1d.weight, pool.conv[layer], slots,
                                    pool.verify_conv[layer] if verify else None, entries)
        q, k, v = self._heads(conv)
        g, beta = gates(a, b, self.A_log, self.dt_bias)
        if self.num_v_heads != self.num_k_heads:  # each key head serves consecutive value heads
            rep = self.num_v_heads // self.num_k_heads
            q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        out, state, states = gated_delta_rule(q, k, v, g, beta, pool.state[layer, slots],
                                              keep_states=verify)
        if verify:
            pool.verify_state[layer, entries] = states
        else:
            pool.state[layer, slots] = state
        return self.norm(out.to(z.dtype), z)

    def _mix_on_gpu(self, mixed, a, b, z, slots, pool, verify: bool):
        """The same in Triton, reading and writing the pool in place: the conv, then the
        recurrence with its gates and the norm; long chunks without a verify (see fla_chunked)
        go to flash-linear-attention's chunked kernel when it is installed."""
        layer, length = self.pool_index, mixed.shape[1]
        offsets = pool.offsets if verify else None
        conv = kernels.causal_conv1d_update(mixed, self.conv1d.weight, pool.conv[layer], slots,
                                            pool.verify_conv[layer] if verify else None, offsets)
        q, k, v = self._heads(conv)
        chunk = _fla_chunk() if not verify and fla_chunked(mixed.shape[0], length) else None
        if chunk is None:
            return kernels.gated_delta_rule(q, k, v, a, b, self.A_log, self.dt_bias,
                                            pool.state[layer], slots,
                                            pool.verify_state[layer] if verify else None, offsets,
                                            z, self.norm.weight, self.norm.eps)
        g, beta = gates(a, b, self.A_log, self.dt_bias)
        rep = self.num_v_heads // self.num_k_heads
        # As one variable-length sequence of all B chunks, so the autotuner's key (which holds
        # the batch size) is the same for every prefill: keyed by B, each new count of prompts
        # in a step benchmarked its configs again, 0.7-2 s a step under steady load
        # (deploy/results/HISTORY.md).
        n = mixed.shape[0]
        ends, index = _varlen_index(n, length, mixed.device)
        out, state = chunk(*(t.flatten(0, 1).unsqueeze(0) for t in (
                               q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2), v, g,
                               beta.float())),
                           scale=self.head_k_dim ** -0.5, initial_state=pool.state[layer, slots],
                           output_final_state=True, use_qk_l2norm_in_kernel=True,
                           cu_seqlens=ends, chunk_indices=index, chunk_size=FLA_CHUNK)
        pool.state[layer, slots] = state
        return self.norm.fused(out.to(z.dtype).flatten(0, 1), z.flatten(0, 1)).view(z.shape)

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


# flash-linear-attention's chunked kernel costs about 2 ms of host time per layer (some 15 launches
# through its autotuner), while token by token a step's time follows its longest chunk until the GPU
# fills up. On the H200 (deploy/results/HISTORY.md, "Full bench: commit 816c4b0"), the Qwen3.5-2B
# shape prefilled 4 prompts of 256 rows in 23 ms token by token against 37 ms chunked, one of 1024
# rows in 21 against 34, and broke even at 8192 rows in all; one prompt of 4096 rows took 94 against
# 55. Decode, verify and other prefills run token by token (kernels.gated_delta_rule).
FLA_CHUNK_MIN_LEN = 64     # rows a chunk needs for fla's kernel at all
FLA_CHUNK_LONG = 2048      # a chunk this long goes to it
FLA_CHUNK_MIN_ROWS = 8192  # and so do a step's chunks of this many rows in all
FLA_CHUNK = 64   # rows per chunk of fla's kernels


def fla_chunked(sequences: int, length: int) -> bool:
    """Whether a prefill of `sequences` chunks of `length` rows runs fla's chunked kernel."""
    return length >= FLA_CHUNK_MIN_LEN and (length >= FLA_CHUNK_LONG
                                            or sequences * length >= FLA_CHUNK_MIN_ROWS)


@functools.lru_cache(maxsize=256)
def _varlen_index(n: int, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's cu_seqlens [n + 1] and chunk_indices [chunks, 2] (each chunk's sequence, and its
    place in it) for n sequences of `length` rows one after another, on the device. Made here
    from host values and kept, so no prefill waits: fla would build the indices on the host and
    copy them from pageable memory, a copy that waits for every kernel queued before it, in each
    layer."""
    chunks = -(-length // FLA_CHUNK)
    ends = np.arange(n + 1, dtype=np.int64) * length
    index = np.stack([np.repeat(np.arange(n), chunks), np.tile(np.arange(chunks), n)], 1)
    return to_device(ends, device), to_device(index, device)


def _groups(batch: ForwardBatch, device):
    """Row indices [B, L], slots [B], chunk length L and verify flag of each set of sequences that
    share a chunk length and a verify flag, so each set runs as one batched recurrence. The row
    indices are None for a set that is the whole batch in order (decode, verify): its rows are
    views of the batch's rows, with nothing to gather or scatter."""
    groups: dict[tuple[int, bool], list] = {}
    for s in batch.seqs:
        groups.setdefault((s.length, s.verify), []).append(s)
    if len(groups) == 1 and batch.slots is not None:   # decode or verify: from device tensors
        (length, verify), = groups
        yield None, batch.slots, length, verify
        return
    for (length, verify), seqs in groups.items():
        starts, slots = to_device([[s.start for s in seqs], [s.slot for s in seqs]], device)
        rows = starts[:, None] + torch.arange(length, device=device)[None, :]
        yield rows, slots, length, verify


def _take(t: torch.Tensor, rows: torch.Tensor | None, length: int) -> torch.Tensor:
    """A set's rows of t [T, ...] as [B, L, ...]: a view for the whole batch (rows None), else
    gathered."""
    return t.view(-1, length, *t.shape[1:]) if rows is None else t[rows]


def _join(parts: list[tuple], n_rows: int) -> torch.Tensor:
    """The sets' outputs [B, L, ...] as the batch's rows [T, ...]: the one set's output itself
    when it is the whole batch, else each scattered to its rows."""
    (rows, out), *_ = parts
    if rows is None:
        return out.reshape(n_rows, *out.shape[2:])
    core = out.new_empty(n_rows, *out.shape[2:])
    for rows, out in parts:
        core[rows] = out
    return core

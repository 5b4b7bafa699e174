"""Triton kernels for the GPU: paged attention over the block tables; the Gated DeltaNet
recurrence and causal conv, which read and write the SSM slot pool in place (every per-token
state for a verify); and fused norms and activations.

All read only device tensors (no host values per sequence), so a step built from them can be
captured in a CUDA graph. `available()` says whether Triton imports; the torch code in layers.py
and gated_deltanet.py is the reference they are tested against.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs: the torch paths run instead
    triton = None


def available() -> bool:
    return triton is not None


def runs_on(device: torch.device) -> bool:
    """Whether the kernels run for tensors on `device`: CUDA, or CPU under Triton's interpreter
    (TRITON_INTERPRET=1, for tests)."""
    return triton is not None and (device.type == "cuda"
                                   or os.environ.get("TRITON_INTERPRET") == "1")


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


PDL = True   # programmatic dependent launch where the GPU has it (False: off, for A/B runs)
FEW = True   # few_rows for a verify's projections (False: F.linear, for A/B runs)
CHAIN = True  # a chained round's n-gram lookup and bookkeeping in one launch each (False: the
              # tensor ops they replace, for A/B runs)
ROUND_FUSED = True   # with CHAIN, a chained n-gram verify's lookup with its rows, and its
                     # verdicts with its land, in one launch each (False: two each, for A/B)


def chain_kernels(device: torch.device) -> bool:
    """Whether a chained round's lookup and bookkeeping run as the kernels here on `device`."""
    return CHAIN and runs_on(device)


def round_fused(device: torch.device) -> bool:
    """Whether a chained round's kernels on `device` pair up (ROUND_FUSED)."""
    return ROUND_FUSED and chain_kernels(device)


@functools.cache
def _device_pdl(device: int) -> bool:
    """NVIDIA Hopper or later (a ROCm build also reports its GPUs as cuda devices)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9


def _pdl() -> dict:
    """Launch options for every kernel here. On Hopper and later each kernel is launched with
    programmatic dependent launch: it may start while the kernel before it finishes, and waits
    for it (gdc_wait, all its writes visible) before it reads anything a kernel wrote or writes
    anything at all; only weights, which no step writes, are read before the wait (the GEMVs'
    first stretch). So the launch and the ramp-up of each of a step's few hundred small kernels
    hide behind the one before. Off under the interpreter and on older GPUs."""
    on = (PDL and os.environ.get("TRITON_INTERPRET") != "1"
          and _device_pdl(torch.cuda.current_device()))
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


if triton is not None:
    @triton.jit
    def _after_previous(PDL: tl.constexpr):
        """Lets the next kernel launch, then waits until the one before has finished (see
        _pdl); a no-op without PDL."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()

    @triton.jit
    def _attend_block(q, k, v, n, n_ok, q_pos, m_i, l_i, acc, scale, CAUSAL: tl.constexpr,
                      IEEE: tl.constexpr):
        """One block of keys k [D, BLOCK_N] and values v [BLOCK_N, D] (positions n, n_ok the real
        ones) folded into the online softmax (m_i, l_i, acc) of the query rows q."""
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * scale
        ok = n_ok[None, :]
        if CAUSAL:
            ok = ok & (n[None, :] <= q_pos[:, None])
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        return m_new, l_i, acc * alpha[:, None] + pv

    @triton.jit
    def _key_offsets(tables_ptr, seq, stride_tb, n, n_ok, kv_head, stride_kb, stride_ks,
                     stride_kh, PAGE: tl.constexpr):
        """Where the keys (and values) at positions n (n_ok the real ones) of sequence `seq` lie
        in one layer's pages, for one KV head, through the sequence's block table."""
        page = tl.load(tables_ptr + seq * stride_tb + n // PAGE, mask=n_ok, other=0)
        return page * stride_kb + (n % PAGE) * stride_ks + kv_head * stride_kh

    @triton.jit
    def _load_kv(k_ptr, v_ptr, kv, d, d_ok, mask):
        """Keys [D, BLOCK_N] and values [BLOCK_N, D] at offsets kv where `mask` holds, zeros
        elsewhere."""
        k = tl.load(k_ptr + kv[None, :] + d[:, None], mask=mask[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_ptr + kv[:, None] + d[None, :], mask=mask[:, None] & d_ok[None, :], other=0.0)
        return k, v

    # Prefills run eagerly with layouts that change step by step: the per-sequence tensors are
    # rows of one copy (their alignment follows the count of sequences) and the tables' width
    # follows the longest context, so neither is specialised, or each new count or width
    # compiled the kernel again, about 0.8 s inside a step under steady load
    # (deploy/results/HISTORY.md).
    @triton.jit(do_not_specialize=["tables_ptr", "q_start_ptr", "q_len_ptr", "ctx_ptr",
                                   "stride_tb"])
    def _paged_attention_kernel(
            q_ptr, k_ptr, v_ptr, out_ptr, acc_ptr, m_ptr, l_ptr, tables_ptr, q_start_ptr,
            q_len_ptr, ctx_ptr, scale, heads, stride_qt, stride_qh, stride_kb, stride_ks,
            stride_kh, stride_tb, stride_ot, stride_oh,
            GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_L: tl.constexpr,
            BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
            PAGE: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr, SPLITS: tl.constexpr,
            PDL: tl.constexpr):
        """One program: BLOCK_L query rows of one sequence for the GROUP query heads that share
        one KV head, over one of SPLITS equal ranges (whole BLOCK_N blocks) of the keys those rows
        see; keys stream from the paged cache with an online softmax. With one range the rows are
        normalised into `out`; with several each range leaves its un-normalised float32 partial
        (acc, running max m, sum l) for _combine_splits_kernel.

        Before waiting for the kernel before (see _pdl) it reads what no kernel of the step
        writes: the rows' layout and block tables (host copies) and, of its first block, the keys
        and values before the sequence's cached length (earlier steps'); its block's keys from the
        cached length on (this step's rows, written by the kernel before) it reads after."""
        seq, kv_head = tl.program_id(0), tl.program_id(1)
        tile, split = tl.program_id(2) // SPLITS, tl.program_id(2) % SPLITS
        q_len = tl.load(q_len_ptr + seq)
        q_start = tl.load(q_start_ptr + seq)
        ctx = tl.load(ctx_ptr + seq)
        live = tile * BLOCK_L < q_len
        m = tl.arange(0, G_PAD * BLOCK_L)            # query row m: row m // G_PAD, head m % G_PAD
        row = tile * BLOCK_L + m // G_PAD
        head = kv_head * GROUP + m % G_PAD
        row_ok = (row < q_len) & (m % G_PAD < GROUP)
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        q_pos = ctx + row
        end = ctx + q_len
        if CAUSAL:   # the tile's last row sees keys up to its own position
            end = ctx + min(q_len, (tile + 1) * BLOCK_L)
        chunk = tl.cdiv(tl.cdiv(end, SPLITS), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.where(live, min(lo + chunk, end), lo)
        n = lo + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        kv = _key_offsets(tables_ptr, seq, stride_tb, n, n_ok, kv_head, stride_kb, stride_ks,
                          stride_kh, PAGE)
        k, v = _load_kv(k_ptr, v_ptr, kv, d, d_ok, n_ok & (n < ctx))
        _after_previous(PDL)
        if live:
            q = tl.load(q_ptr + (q_start + row)[:, None] * stride_qt + head[:, None] * stride_qh
                        + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            new = n_ok & (n >= ctx)
            k_new, v_new = _load_kv(k_ptr, v_ptr, kv, d, d_ok, new)
            k = tl.where(new[None, :], k_new, k)
            v = tl.where(new[:, None], v_new, v)
            m_i = tl.full([G_PAD * BLOCK_L], float("-inf"), tl.float32)
            l_i = tl.zeros([G_PAD * BLOCK_L], tl.float32)
            acc = tl.zeros([G_PAD * BLOCK_L, D_PAD], tl.float32)
            if lo < hi:
                m_i, l_i, acc = _attend_block(q, k, v, n, n_ok, q_pos, m_i, l_i, acc, scale,
                                              CAUSAL, IEEE)
            for start in range(lo + BLOCK_N, hi, BLOCK_N):
                n = start + tl.arange(0, BLOCK_N)
                n_ok = n < hi
                kv = _key_offsets(tables_ptr, seq, stride_tb, n, n_ok, kv_head, stride_kb,
                                  stride_ks, stride_kh, PAGE)
                k, v = _load_kv(k_ptr, v_ptr, kv, d, d_ok, n_ok)
                m_i, l_i, acc = _attend_block(q, k, v, n, n_ok, q_pos, m_i, l_i, acc, scale,
                                              CAUSAL, IEEE)
            if SPLITS == 1:
                out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
                tl.store(out_ptr + (q_start + row)[:, None] * stride_ot
                         + head[:, None] * stride_oh + d[None, :],
                         out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
            else:   # rows that saw no key here keep m = -inf and no acc: the combine skips them
                part = ((q_start + row) * heads + head) * SPLITS + split
                tl.store(m_ptr + part, m_i, mask=row_ok)
                tl.store(l_ptr + part, l_i, mask=row_ok)
                saw = row_ok & (m_i > float("-inf"))
                tl.store(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc,
                         mask=saw[:, None] & d_ok[None, :])

    @triton.jit
    def _combine_splits_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, heads, stride_ot, stride_oh,
                               SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                               D_PAD: tl.constexpr, PDL: tl.constexpr):
        """One query row of one head: its SPLITS partials, each weighted by exp(m_i - max m), so a
        range with no key for the row (m_i = -inf) weighs nothing; a row with no key at all
        gets zeros, as in the single-range path."""
        _after_previous(PDL)
        row, head = tl.program_id(0), tl.program_id(1)
        part = (row * heads + head) * SPLITS + tl.arange(0, SPLITS)
        d = tl.arange(0, D_PAD)
        m_s = tl.load(m_ptr + part)
        l_s = tl.load(l_ptr + part)
        saw = m_s > float("-inf")
        w = tl.where(saw, tl.exp(m_s - tl.max(m_s, 0)), 0.0)
        acc = tl.load(acc_ptr + part[:, None] * HEAD_DIM + d[None, :],
                      mask=saw[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
        total = tl.sum(w * l_s, 0)
        out = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
        tl.store(out_ptr + row * stride_ot + head * stride_oh + d,
                 out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)

    @triton.jit
    def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, stride_kt, stride_kh,
                         stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
                         KV_HEADS: tl.constexpr, H_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         D_PAD: tl.constexpr, PAGE: tl.constexpr, PDL: tl.constexpr):
        """One row: its keys and values of every KV head to its slot (block * PAGE + offset)."""
        _after_previous(PDL)
        row = tl.program_id(0)
        slot = tl.load(slots_ptr + row)
        h = tl.arange(0, H_PAD)[:, None]
        d = tl.arange(0, D_PAD)[None, :]
        ok = (h < KV_HEADS) & (d < HEAD_DIM)
        dst = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs + h * stride_ch + d
        k = tl.load(k_ptr + row * stride_kt + h * stride_kh + d, mask=ok)
        v = tl.load(v_ptr + row * stride_vt + h * stride_vh + d, mask=ok)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=ok)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _land(hist_ptr, used_ptr, ctx_ptr, best_ptr, landing_ptr, s, accepted, stride_h,
              stride_l, length, L_PAD: tl.constexpr):
        """Sequence s's round appended to its history (see round_advance)."""
        used = tl.load(used_ptr + s)
        j = tl.arange(0, L_PAD)
        ok = j < length
        best = tl.load(best_ptr + s * length + j, mask=ok, other=0)
        tl.store(hist_ptr + s.to(tl.int64) * stride_h + used + j, best, mask=ok)
        tl.store(landing_ptr + s * stride_l + j, best, mask=ok)
        tl.store(landing_ptr + s * stride_l + length, accepted)
        tl.store(used_ptr + s, used + accepted + 1)
        tl.store(ctx_ptr + s, tl.load(ctx_ptr + s) + accepted + 1)

    # Launched each greedy round outside the graphs: no argument that changes with the round's
    # k or batch is a constexpr or specialised (a pointer's alignment included: the slots follow
    # n drafts in one buffer), so the kernel compiles per L_PAD alone, at start-up
    # (SSMSlotPool.capture_commits), never inside a round. Its variants that land a chained
    # round (LAND, per ROWS_PAD) compile with the chain's graphs, when those are captured.
    @triton.jit(do_not_specialize=["ids_ptr", "best_ptr", "drafts_ptr", "slots_ptr",
                                   "offsets_ptr", "index_ptr", "accepted_ptr", "index_stride",
                                   "n", "pad_slot", "pad_entry", "length", "hist_ptr",
                                   "used_ptr", "ctx_ptr", "landing_ptr", "stride_h",
                                   "stride_l"])
    def _greedy_accept_kernel(ids_ptr, best_ptr, drafts_ptr, slots_ptr, offsets_ptr, index_ptr,
                              accepted_ptr, index_stride, n, pad_slot, pad_entry, length,
                              hist_ptr, used_ptr, ctx_ptr, landing_ptr, stride_h, stride_l,
                              L_PAD: tl.constexpr, LAND: tl.constexpr, ROWS_PAD: tl.constexpr,
                              PDL: tl.constexpr):
        """Program i < n: sequence i's rows i*length.. hold its pending token and drafts; it
        accepts drafts while draft j (row j + 1) is the argmax of row j, among its first
        drafts[i] (rows after them are filler). Writes the count, and the commit's pair (slot,
        its verify entry after the accepted drafts); with LAND it also appends the round to the
        sequence's history as round_advance does (one launch for both in a chained round).
        Programs i >= n write the padding pair."""
        _after_previous(PDL)
        i = tl.program_id(0)
        if i < n:
            d = tl.load(drafts_ptr + i)
            j = tl.arange(0, L_PAD)
            real = j < d
            draft = tl.load(ids_ptr + i * length + 1 + j, mask=real, other=0)
            best = tl.load(best_ptr + i * length + j, mask=real, other=0)
            accepted = tl.min(tl.where(real & (draft != best), j, d))
            slot = tl.load(slots_ptr + i)
            tl.store(accepted_ptr + i, accepted)
            tl.store(index_ptr + i, slot)
            tl.store(index_ptr + index_stride + i, tl.load(offsets_ptr + slot) + accepted)
            if LAND:
                _land(hist_ptr, used_ptr, ctx_ptr, best_ptr, landing_ptr, i, accepted,
                      stride_h, stride_l, length, ROWS_PAD)
        else:
            tl.store(index_ptr + i, pad_slot)
            tl.store(index_ptr + index_stride + i, pad_entry)

    @triton.jit
    def _argmax_rows_kernel(x_ptr, out_ptr, cols, stride, BLOCK: tl.constexpr,
                            PDL: tl.constexpr):
        """One row: the first column holding its largest value, a NaN counting as +inf."""
        _after_previous(PDL)
        row = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row.to(tl.int64) * stride + c, mask=c < cols,
                    other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("inf"), x)
        tl.store(out_ptr + row, tl.argmax(x, 0, tie_break_left=True).to(tl.int64))

    @triton.jit(do_not_specialize=["hist_ptr", "len_ptr", "out_ptr", "stride_h", "width"])
    def _ngram_lookup_kernel(hist_ptr, len_ptr, out_ptr, stride_h, width, num_drafts,
                             MIN_N: tl.constexpr, MAX_N: tl.constexpr, BLOCK: tl.constexpr,
                             D_PAD: tl.constexpr, PDL: tl.constexpr):
        """Program s: sequence s's n-gram drafts (ngram_drafts_on_device's, see ngram_lookup).
        Scans only the columns before its last token, BLOCK at a time, however wide the table:
        at each end e, the longest n (MIN_N..MAX_N) whose n tokens ending at e are the
        sequence's last n; the best (n, e) is the one with the largest n * width + e."""
        _after_previous(PDL)
        s = tl.program_id(0)
        j = tl.arange(0, D_PAD)
        drafts = _ngram_drafts(hist_ptr, len_ptr, stride_h, width, s, j, num_drafts, MIN_N,
                               MAX_N, BLOCK)
        tl.store(out_ptr + s * num_drafts + j, drafts, mask=j < num_drafts)

    @triton.jit
    def _ngram_drafts(hist_ptr, len_ptr, stride_h, width, s, d, num_drafts,
                      MIN_N: tl.constexpr, MAX_N: tl.constexpr, BLOCK: tl.constexpr):
        """Sequence s's draft d, for each d: the token after the match, else (no match, no
        token there, d < 0) the sequence's last token as filler."""
        row = hist_ptr + s.to(tl.int64) * stride_h
        last = tl.load(len_ptr + s).to(tl.int32) - 1
        at = _ngram_match(row, last, width, MIN_N, MAX_N, BLOCK) + d
        real = (d >= 0) & (at >= d) & (at <= last) & (d < num_drafts)   # at >= d: a match
        return tl.where(real, tl.load(row + at, mask=real, other=0), tl.load(row + last))

    @triton.jit
    def _ngram_match(row, last, width, MIN_N: tl.constexpr, MAX_N: tl.constexpr,
                     BLOCK: tl.constexpr):
        """The column where the drafts of the history at `row` (its last token at column
        `last`) begin, -1 without a match: the scan of _ngram_lookup_kernel."""
        best = tl.full([], -1, tl.int32)
        for start in range(0, last, BLOCK):
            e = start + tl.arange(0, BLOCK)
            agree = e < last
            score = tl.full([BLOCK], -1, tl.int32)
            for n in tl.static_range(1, MAX_N + 1):
                agree = agree & (e >= n - 1)
                token = tl.load(row + e - (n - 1), mask=agree, other=-1)
                agree = agree & (token == tl.load(row + tl.maximum(last - (n - 1), 0)))
                if n >= MIN_N:   # (e < last and e >= n - 1: the last n tokens exist)
                    score = tl.where(agree, n * width + e, score)
            best = tl.maximum(best, tl.max(score, 0))
        return tl.where(best >= 0, best % width + 1, -1)

    @triton.jit(do_not_specialize=["hist_ptr", "used_ptr", "ctx_ptr", "tables_ptr", "ids_ptr",
                                   "pos_ptr", "kv_ptr", "ctx_out_ptr", "drafts_ptr", "stride_h",
                                   "stride_t", "width"])
    def _ngram_round_kernel(hist_ptr, used_ptr, ctx_ptr, tables_ptr, ids_ptr, pos_ptr, kv_ptr,
                            ctx_out_ptr, drafts_ptr, stride_h, stride_t, width, length,
                            MIN_N: tl.constexpr, MAX_N: tl.constexpr, BLOCK: tl.constexpr,
                            PAGE: tl.constexpr, L_PAD: tl.constexpr, PDL: tl.constexpr):
        """Program s: sequence s's n-gram drafts (as _ngram_lookup_kernel finds them) and its
        round's rows (as _round_inputs_kernel writes them) in one launch: row j > 0 holds draft
        j - 1, row 0 the pending token, the history's last."""
        _after_previous(PDL)
        s = tl.program_id(0)
        j = tl.arange(0, L_PAD)
        token = _ngram_drafts(hist_ptr, used_ptr, stride_h, width, s, j - 1, length - 1, MIN_N,
                              MAX_N, BLOCK)
        ok = j < length
        tl.store(drafts_ptr + s * (length - 1) + j - 1, token, mask=ok & (j >= 1))
        _round_rows(s, token, j, ok, tl.load(ctx_ptr + s), tables_ptr, stride_t, ids_ptr,
                    pos_ptr, kv_ptr, ctx_out_ptr, length, PAGE)

    @triton.jit
    def _round_rows(s, token, j, ok, context, tables_ptr, stride_t, ids_ptr, pos_ptr, kv_ptr,
                    ctx_out_ptr, length, PAGE: tl.constexpr):
        """Sequence s's rows j of a round: their tokens at positions context + j, whose KV
        indices go through its block table."""
        position = context + j
        page = tl.load(tables_ptr + s.to(tl.int64) * stride_t + position // PAGE, mask=ok,
                       other=0).to(tl.int64)
        row = s * length + j
        tl.store(ids_ptr + row, token, mask=ok)
        tl.store(pos_ptr + row, position, mask=ok)
        tl.store(kv_ptr + row, page * PAGE + position % PAGE, mask=ok)
        tl.store(ctx_out_ptr + s, context)

    @triton.jit(do_not_specialize=["hist_ptr", "used_ptr", "ctx_ptr", "drafts_ptr",
                                   "tables_ptr", "ids_ptr", "pos_ptr", "kv_ptr", "ctx_out_ptr",
                                   "stride_h", "stride_t"])
    def _round_inputs_kernel(hist_ptr, used_ptr, ctx_ptr, drafts_ptr, tables_ptr, ids_ptr,
                             pos_ptr, kv_ptr, ctx_out_ptr, stride_h, stride_t, length,
                             PAGE: tl.constexpr, L_PAD: tl.constexpr, PDL: tl.constexpr):
        """Program s: sequence s's rows of a chained round (see round_inputs)."""
        _after_previous(PDL)
        s = tl.program_id(0)
        used = tl.load(used_ptr + s)
        context = tl.load(ctx_ptr + s)
        pending = tl.load(hist_ptr + s.to(tl.int64) * stride_h + used - 1)
        j = tl.arange(0, L_PAD)
        ok = j < length
        draft = tl.load(drafts_ptr + s * (length - 1) + j - 1, mask=ok & (j >= 1), other=0)
        _round_rows(s, tl.where(j == 0, pending, draft), j, ok, context, tables_ptr, stride_t,
                    ids_ptr, pos_ptr, kv_ptr, ctx_out_ptr, length, PAGE)

    @triton.jit(do_not_specialize=["hist_ptr", "used_ptr", "ctx_ptr", "best_ptr",
                                   "accepted_ptr", "landing_ptr", "stride_h", "stride_l"])
    def _round_advance_kernel(hist_ptr, used_ptr, ctx_ptr, best_ptr, accepted_ptr, landing_ptr,
                              stride_h, stride_l, length, L_PAD: tl.constexpr,
                              PDL: tl.constexpr):
        """Program s: appends sequence s's round to its history (see round_advance)."""
        _after_previous(PDL)
        s = tl.program_id(0)
        _land(hist_ptr, used_ptr, ctx_ptr, best_ptr, landing_ptr, s, tl.load(accepted_ptr + s),
              stride_h, stride_l, length, L_PAD)

    @triton.jit
    def _commit_states_kernel(conv_ptr, state_ptr, vconv_ptr, vstate_ptr, index_ptr,
                              index_stride, slots, entries, conv_size, state_size,
                              BLOCK: tl.constexpr, PDL: tl.constexpr):
        """One program: chunk c of one layer's conv window and recurrent state, copied from
        verify entry index[1, p] to slot index[0, p] (each a contiguous run of elements)."""
        _after_previous(PDL)
        p, layer, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        to_slot = (layer * slots + tl.load(index_ptr + p)).to(tl.int64)
        from_entry = (layer * entries + tl.load(index_ptr + index_stride + p)).to(tl.int64)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        ok = offs < conv_size
        tl.store(conv_ptr + to_slot * conv_size + offs,
                 tl.load(vconv_ptr + from_entry * conv_size + offs, mask=ok), mask=ok)
        ok = offs < state_size
        tl.store(state_ptr + to_slot * state_size + offs,
                 tl.load(vstate_ptr + from_entry * state_size + offs, mask=ok), mask=ok)

    @triton.jit
    def _gates(a, b, decay, dt_bias):
        """One row's gates of one value head from its raw projections a and b, as the torch
        reference computes them: the decay g = -exp(A_log) * softplus(a + dt_bias) in float32
        (decay holds -exp(A_log)), and the write strength beta = sigmoid(b) rounded to b's
        dtype."""
        x = a.to(tl.float32) + dt_bias
        # torch's softplus: x above 20, else log1p(exp(x)); log1p stays accurate for tiny exp(x)
        # through log(w) * u / (w - 1) (the interpreter has no libdevice log1p)
        u = tl.exp(x)
        w = 1.0 + u
        log1p = tl.where(w == 1.0, u, tl.log(w) * (u / tl.where(w == 1.0, 1.0, w - 1.0)))
        g = decay * tl.where(x > 20.0, x, log1p)
        beta = (1.0 / (1.0 + tl.exp(-b.to(tl.float32)))).to(b.dtype).to(tl.float32)
        return g, beta

    @triton.jit
    def _delta_inputs(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, r, stride_q, stride_k, stride_v,
                      stride_a, stride_b, hk, hv, dk, dv, DK: tl.constexpr, DV: tl.constexpr):
        """Row r's q and k of key head hk, v's columns dv and the raw gates a, b of value head
        hv, as stored."""
        return (tl.load(q_ptr + r * stride_q + hk * DK + dk),
                tl.load(k_ptr + r * stride_k + hk * DK + dk),
                tl.load(v_ptr + r * stride_v + hv * DV + dv),
                tl.load(a_ptr + r * stride_a + hv), tl.load(b_ptr + r * stride_b + hv))

    @triton.jit
    def _gated_delta_kernel(
            q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, out_ptr, state_ptr,
            slots_ptr, keep_ptr, offsets_ptr, gate_ptr, norm_ptr, length, scale, eps, stride_q,
            stride_k, stride_v, stride_a, stride_b, stride_g,
            HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
            BV: tl.constexpr, KEEP: tl.constexpr, ONE_PASS: tl.constexpr, NORM: tl.constexpr,
            PDL: tl.constexpr):
        """One program: BV value columns of one value head of one sequence, token by token in
        float32. Row r of q, k, v, a and b starts at r times its stride. The gates come from the
        raw projections a and b (see _gates). The state starts from the sequence's slot; with KEEP
        the state after token t goes to verify entry offsets[slot] + t and the slot is left
        alone, else the slot is updated. A row's inputs are loaded while the row before is
        computed (the last row's twice), so the rows wait on the recurrence alone. With
        ONE_PASS a row's output comes from the decayed state before its update, read with k in
        one pass: S q + delta (k . q), which is S' q for S' = S + k delta^T, so a row waits on
        one sum over the keys instead of two in turn. With NORM (a program holds the whole head,
        BV = DV) each output row is the layer's GatedRMSNorm of it with the gate's row, as
        _gated_rms_norm_kernel computes it, so the layer needs no kernel of its own for that."""
        _after_previous(PDL)
        seq, hv, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        hk = hv // (HV // HK)
        slot = tl.load(slots_ptr + seq)
        dk = tl.arange(0, DK)
        dv = vb * BV + tl.arange(0, BV)
        cell = (hv * DK + dk[:, None]) * DV + dv[None, :]
        state = tl.load(state_ptr + slot * HV * DK * DV + cell)
        decay = -tl.exp(tl.load(a_log_ptr + hv).to(tl.float32))
        dt_bias = tl.load(dt_bias_ptr + hv).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        if NORM:
            weight = tl.load(norm_ptr + dv).to(tl.float32)
        q_next, k_next, v_next, a_next, b_next = _delta_inputs(
            q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, seq * length, stride_q, stride_k, stride_v,
            stride_a, stride_b, hk, hv, dk, dv, DK, DV)
        for t in range(length):
            r = seq * length + t
            q, k, v = q_next.to(tl.float32), k_next.to(tl.float32), v_next.to(tl.float32)
            g, beta = _gates(a_next, b_next, decay, dt_bias)
            q_next, k_next, v_next, a_next, b_next = _delta_inputs(
                q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, seq * length + tl.minimum(t + 1, length - 1),
                stride_q, stride_k, stride_v, stride_a, stride_b, hk, hv, dk, dv, DK, DV)
            q = q * tl.rsqrt(tl.sum(q * q) + 1e-6) * scale
            k = k * tl.rsqrt(tl.sum(k * k) + 1e-6)
            state = state * tl.exp(g)
            if ONE_PASS:
                read = tl.sum(state * k[:, None], 0)
                before = tl.sum(state * q[:, None], 0)
                delta = (v - read) * beta
                out = before + delta * tl.sum(k * q)
                state = state + k[:, None] * delta[None, :]
            else:
                delta = (v - tl.sum(state * k[:, None], 0)) * beta
                state = state + k[:, None] * delta[None, :]
                out = tl.sum(state * q[:, None], 0)
            if NORM:   # the norm rounds where GatedRMSNorm does (see _gated_rms_norm_kernel)
                out = out.to(dtype).to(tl.float32)
                normed = (out * tl.rsqrt(tl.sum(out * out) / DV + eps)).to(dtype)
                out = (weight * normed.to(tl.float32)).to(dtype).to(tl.float32)
                gate = tl.load(gate_ptr + r * stride_g + hv * DV + dv).to(tl.float32)
                out = out * (gate / (1.0 + tl.exp(-gate)))
            tl.store(out_ptr + (r * HV + hv) * DV + dv, out.to(dtype))
            if KEEP:
                entry = tl.load(offsets_ptr + slot) + t
                tl.store(keep_ptr + entry * HV * DK * DV + cell, state)
        if not KEEP:
            tl.store(state_ptr + slot * HV * DK * DV + cell, state)

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                         HAS_RES: tl.constexpr, OFFSET: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
        """One row: (x + residual, rounded to x's dtype, stored) then RMSNorm times the weight,
        rounding where the torch modules round."""
        _after_previous(PDL)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=ok, other=0.0)
        if HAS_RES:
            x = (x.to(tl.float32) + tl.load(res_ptr + row * n_cols + cols, mask=ok,
                                            other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(res_out_ptr + row * n_cols + cols, x, mask=ok)
        xf = x.to(tl.float32)
        normed = xf * tl.rsqrt(tl.sum(xf * xf) / n_cols + eps)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        if OFFSET:
            y = normed * (1.0 + w)
        else:
            y = normed.to(x_ptr.dtype.element_ty).to(tl.float32) * w
        tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _norm_rope(base, w_ptr, cos_ptr, sin_ptr, row, eps, dtype: tl.constexpr,
                   HEAD_DIM: tl.constexpr, ROT: tl.constexpr, OFFSET: tl.constexpr):
        """The HEAD_DIM features at `base`: RMSNorm over them, then rotary on the first ROT,
        rounding where the torch modules round."""
        d = tl.arange(0, HEAD_DIM)
        half = ROT // 2
        partner = tl.where(d < half, d + half, tl.where(d < ROT, d - half, d))
        x = tl.load(base + d).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x) / HEAD_DIM + eps)
        xp = tl.load(base + partner).to(tl.float32)
        w, wp = tl.load(w_ptr + d).to(tl.float32), tl.load(w_ptr + partner).to(tl.float32)
        if OFFSET:
            y, yp = (x * r * (1.0 + w)).to(dtype), (xp * r * (1.0 + wp)).to(dtype)
        else:
            y = ((x * r).to(dtype).to(tl.float32) * w).to(dtype)
            yp = ((xp * r).to(dtype).to(tl.float32) * wp).to(dtype)
        c = tl.load(cos_ptr + row * ROT + d, mask=d < ROT, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + row * ROT + d, mask=d < ROT, other=0.0).to(tl.float32)
        rotated = tl.where(d < half, -yp.to(tl.float32), yp.to(tl.float32))
        a = (y.to(tl.float32) * c).to(dtype).to(tl.float32)
        b = (rotated * s).to(dtype).to(tl.float32)
        return tl.where(d < ROT, (a + b).to(dtype), y)

    @triton.jit
    def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, heads, stride_xt, stride_xh,
                          eps, HEAD_DIM: tl.constexpr, ROT: tl.constexpr, OFFSET: tl.constexpr,
                          PDL: tl.constexpr):
        """One head of one row: RMSNorm over the head, then rotary on its first ROT features."""
        _after_previous(PDL)
        row, head = tl.program_id(0), tl.program_id(1)
        out = _norm_rope(x_ptr + row * stride_xt + head * stride_xh, w_ptr, cos_ptr, sin_ptr, row,
                         eps, out_ptr.dtype.element_ty, HEAD_DIM, ROT, OFFSET)
        tl.store(out_ptr + (row * heads + head) * HEAD_DIM + tl.arange(0, HEAD_DIM), out)

    @triton.jit
    def _qk_norm_rope_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_out_ptr,
                             k_cache_ptr, v_cache_ptr, slots_ptr, heads, stride_qt, stride_qh,
                             stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs,
                             stride_ch, eps, HEAD_DIM: tl.constexpr, ROT: tl.constexpr,
                             OFFSET: tl.constexpr, PAGE: tl.constexpr, PDL: tl.constexpr):
        """One head of one row. Query heads (the first `heads`): norm and rotary into q_out. Key
        heads after them: norm and rotary into the key cache at the row's slot, and the value
        head copied into the value cache there."""
        _after_previous(PDL)
        row, head = tl.program_id(0), tl.program_id(1)
        d = tl.arange(0, HEAD_DIM)
        if head < heads:
            out = _norm_rope(q_ptr + row * stride_qt + head * stride_qh, qw_ptr, cos_ptr, sin_ptr,
                             row, eps, q_out_ptr.dtype.element_ty, HEAD_DIM, ROT, OFFSET)
            tl.store(q_out_ptr + (row * heads + head) * HEAD_DIM + d, out)
        else:
            h = head - heads
            slot = tl.load(slots_ptr + row)
            dst = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs + h * stride_ch + d
            key = _norm_rope(k_ptr + row * stride_kt + h * stride_kh, kw_ptr, cos_ptr, sin_ptr,
                             row, eps, k_ptr.dtype.element_ty, HEAD_DIM, ROT, OFFSET)
            tl.store(k_cache_ptr + dst, key.to(k_cache_ptr.dtype.element_ty))
            value = tl.load(v_ptr + row * stride_vt + h * stride_vh + d)
            tl.store(v_cache_ptr + dst, value.to(v_cache_ptr.dtype.element_ty))

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, out_ptr, n_out, n_in, BLOCK_N: tl.constexpr,
                     FIRST: tl.constexpr, BLOCK_K: tl.constexpr, SILU_MUL: tl.constexpr,
                     PDL: tl.constexpr):
        """BLOCK_N outputs of one row: x [n_in] times BLOCK_N contiguous rows of w [n_out, n_in]
        in float32, the first FIRST features as one stretch, loaded before waiting for the
        kernel before (see _pdl), then BLOCK_K at a time; rounded once at the end. With SILU_MUL
        w is [gate | up] ([2 * n_out, n_in]) and the outputs are silu(gate) * up, gate rows n and
        up rows n_out + n summed alike and rounded as _silu_mul_kernel rounds."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < n_out
        rows = w_ptr + n[:, None] * n_in
        k = tl.arange(0, FIRST)
        ok = n_ok[:, None] & (k < n_in)[None, :]
        w = tl.load(rows + k[None, :], mask=ok, other=0.0)
        if SILU_MUL:
            u = tl.load(rows + n_out * n_in + k[None, :], mask=ok, other=0.0)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        x = tl.load(x_ptr + k, mask=k < n_in, other=0.0).to(tl.float32)
        total = tl.sum(w.to(tl.float32) * x[None, :], 1)
        if SILU_MUL:
            total_up = tl.sum(u.to(tl.float32) * x[None, :], 1)
        if n_in > FIRST:
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            for start in range(FIRST, n_in, BLOCK_K):   # names of their own: other shapes
                kb = start + tl.arange(0, BLOCK_K)
                kb_ok = kb < n_in
                okb = n_ok[:, None] & kb_ok[None, :]
                xb = tl.load(x_ptr + kb, mask=kb_ok, other=0.0).to(tl.float32)
                acc += tl.load(rows + kb[None, :], mask=okb, other=0.0).to(tl.float32) * xb[None, :]
                if SILU_MUL:
                    acc_up += (tl.load(rows + n_out * n_in + kb[None, :], mask=okb, other=0.0)
                               .to(tl.float32) * xb[None, :])
            total += tl.sum(acc, 1)
            if SILU_MUL:
                total_up += tl.sum(acc_up, 1)
        dtype = out_ptr.dtype.element_ty
        out = total.to(dtype)
        if SILU_MUL:
            gate = out.to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            out = (act * total_up.to(dtype).to(tl.float32)).to(dtype)
        tl.store(out_ptr + n, out, mask=n_ok)

    @triton.jit
    def _few_rows_kernel(x_ptr, w_ptr, out_ptr, part_ptr, count_ptr, m, n_out, n_in, stride_x,
                         k_len, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, SPLITS: tl.constexpr, SILU_MUL: tl.constexpr,
                         IEEE: tl.constexpr, PDL: tl.constexpr):
        """BLOCK_N outputs of each of the M_PAD rows of tile t (rows t * M_PAD on, up to m):
        x [m, n_in] (rows stride_x apart) times BLOCK_N contiguous rows of w [n_out, n_in], on
        the tensor cores with float32 sums (IEEE: float32 inputs multiplied in full precision),
        rounded once at the end; the weights' first BLOCK_K features are loaded before waiting
        for the kernel before (see _pdl). With SILU_MUL as in _gemv_kernel.

        Program (i, s, t) sums features s * k_len up to (s + 1) * k_len. With SPLITS > 1 (one
        tile only) it stores its float32 sums in part[s] ([SPLITS, M_PAD, n_out]) and counts
        itself in count[i]; the last of column i's programs to arrive adds the parts in the
        order s = 0, 1, ..., so the result does not depend on which finished first, stores it,
        and sets count[i] back to 0 for the next launch."""
        col, split, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        n = col * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < n_out
        r = tile * M_PAD + tl.arange(0, M_PAD)
        r_ok = r < m
        k_first = split * k_len
        k_end = tl.minimum(k_first + k_len, n_in)
        k = k_first + tl.arange(0, BLOCK_K)
        rows = w_ptr + n[:, None] * n_in
        ok = n_ok[:, None] & (k < k_end)[None, :]
        w = tl.load(rows + k[None, :], mask=ok, other=0.0)
        if SILU_MUL:
            u = tl.load(rows + n_out * n_in + k[None, :], mask=ok, other=0.0)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        precision: tl.constexpr = "ieee" if IEEE else "tf32"
        x = tl.load(x_ptr + r[:, None] * stride_x + k[None, :],
                    mask=r_ok[:, None] & (k < k_end)[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), input_precision=precision)
        if SILU_MUL:
            acc_up = tl.dot(x, tl.trans(u), input_precision=precision)
        for start in range(k_first + BLOCK_K, k_end, BLOCK_K):
            kb = start + tl.arange(0, BLOCK_K)
            kb_ok = kb < k_end
            okb = n_ok[:, None] & kb_ok[None, :]
            xb = tl.load(x_ptr + r[:, None] * stride_x + kb[None, :],
                         mask=r_ok[:, None] & kb_ok[None, :], other=0.0)
            acc = tl.dot(xb, tl.trans(tl.load(rows + kb[None, :], mask=okb, other=0.0)), acc,
                         input_precision=precision)
            if SILU_MUL:
                acc_up = tl.dot(xb, tl.trans(tl.load(rows + n_out * n_in + kb[None, :], mask=okb,
                                                     other=0.0)),
                                acc_up, input_precision=precision)
        cells = r[:, None] * n_out + n[None, :]
        cells_ok = r_ok[:, None] & n_ok[None, :]
        if SILU_MUL:
            _few_rows_store(out_ptr, cells, cells_ok, acc, acc_up, True)
        elif SPLITS == 1:
            _few_rows_store(out_ptr, cells, cells_ok, acc, acc, False)
        else:
            tl.store(part_ptr + split * M_PAD * n_out + cells, acc, mask=cells_ok)
            tl.debug_barrier()   # every thread's part is written before the count says so
            if tl.atomic_add(count_ptr + col, 1, sem="acq_rel") == SPLITS - 1:
                total = tl.zeros([M_PAD, BLOCK_N], tl.float32)
                for s in tl.static_range(SPLITS):
                    total += tl.load(part_ptr + s * M_PAD * n_out + cells, mask=cells_ok,
                                     other=0.0, cache_modifier=".cg")
                tl.store(count_ptr + col, 0)
                _few_rows_store(out_ptr, cells, cells_ok, total, total, False)

    @triton.jit
    def _few_rows_store(out_ptr, cells, cells_ok, acc, acc_up, SILU_MUL: tl.constexpr):
        """Rounds float32 sums (with SILU_MUL, silu(gate) * up as _silu_mul_kernel rounds it)
        and stores them."""
        dtype = out_ptr.dtype.element_ty
        out = acc.to(dtype)
        if SILU_MUL:
            gate = out.to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
            out = (act * acc_up.to(dtype).to(tl.float32)).to(dtype)
        tl.store(out_ptr + cells, out, mask=cells_ok)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """x: [rows, 2 * n] as [gate | up]; out = silu(gate) * up, rounded as torch rounds."""
        _after_previous(PDL)
        row, block = tl.program_id(0), tl.program_id(1)
        cols = block * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n_cols
        gate = tl.load(x_ptr + row * 2 * n_cols + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * n_cols + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        tl.store(out_ptr + row * n_cols + cols, (act * up).to(dtype), mask=ok)

    @triton.jit
    def _conv_input(window_ptr, rows_ptr, stride_t, pos, c, ok, KM1: tl.constexpr):
        """Channels c of input `pos` of one sequence's conv inputs: its K-1 window inputs, then
        its rows (at stride_t), in the window's dtype."""
        pos = c * 0 + pos   # a block: the interpreter (Triton 3.9) takes only block masks
        old = tl.load(window_ptr + c * KM1 + pos, mask=ok & (pos < KM1), other=0.0)
        new = tl.load(rows_ptr + (pos - KM1) * stride_t + c, mask=ok & (pos >= KM1), other=0.0)
        return tl.where(pos < KM1, old, new.to(window_ptr.dtype.element_ty))

    # Not specialised on what follows a prefill's layout (as _paged_attention_kernel's): the
    # slots are a row of one copy, the length and the batch stride follow the prompts.
    @triton.jit(do_not_specialize=["slots_ptr", "keep_ptr", "offsets_ptr", "length",
                                   "stride_xb"])
    def _causal_conv1d_kernel(x_ptr, w_ptr, window_ptr, slots_ptr, keep_ptr, offsets_ptr,
                              out_ptr, length, channels, stride_xb, stride_xt,
                              K: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                              KEEP: tl.constexpr, PDL: tl.constexpr):
        """One program: BLOCK channels of ROWS rows of one sequence, row by row. Row t's output
        is silu(sum_i w[i] * input[t + i]), the inputs being the sequence's window then its rows;
        as in the torch reference, the taps and each product are rounded to the weight's dtype,
        and so are the sum and the SiLU. With KEEP the window after row t (inputs t+1 .. t+K-1)
        goes to verify entry offsets[slot] + t and the slot is left alone; else the first
        program of the rows (the only one that reads the window, as ROWS >= K-1) writes the
        slot's new window, the last K-1 inputs, after its reads: each channel is read and
        written by one thread."""
        _after_previous(PDL)
        seq, block, row_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        c = block * BLOCK + tl.arange(0, BLOCK)
        ok = c < channels
        slot = tl.load(slots_ptr + seq)
        window = window_ptr + slot * channels * (K - 1)
        rows = x_ptr + seq * stride_xb
        w_dtype = w_ptr.dtype.element_ty
        for t in range(row_block * ROWS, tl.minimum(row_block * ROWS + ROWS, length)):
            acc = tl.zeros([BLOCK], tl.float32)
            for i in tl.static_range(K):
                x = _conv_input(window, rows, stride_xt, t + i, c, ok, K - 1).to(w_dtype)
                w = tl.load(w_ptr + c * K + i, mask=ok, other=0.0)
                acc += (x.to(tl.float32) * w.to(tl.float32)).to(w_dtype).to(tl.float32)
            acc = acc.to(w_dtype).to(tl.float32)
            y = (acc / (1.0 + tl.exp(-acc))).to(w_dtype)
            tl.store(out_ptr + (seq * length + t) * channels + c,
                     y.to(out_ptr.dtype.element_ty), mask=ok)
            if KEEP:
                entry = tl.load(offsets_ptr + slot) + t
                for j in tl.static_range(K - 1):
                    tl.store(keep_ptr + (entry * channels + c) * (K - 1) + j,
                             _conv_input(window, rows, stride_xt, t + 1 + j, c, ok, K - 1),
                             mask=ok)
        if not KEEP:
            if row_block == 0:
                for j in tl.static_range(K - 1):   # reads input length + j > j before writing j
                    tl.store(window + c * (K - 1) + j,
                             _conv_input(window, rows, stride_xt, length + j, c, ok, K - 1),
                             mask=ok)

    @triton.jit
    def _gated_rms_norm_kernel(x_ptr, gate_ptr, w_ptr, out_ptr, heads, stride_xt, stride_gt,
                               eps, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                               HEADS: tl.constexpr, PDL: tl.constexpr):
        """HEADS heads of one row, each: RMSNorm rounded to x's dtype, times the weight (rounded
        again), times SiLU(gate) in float32, as GatedRMSNorm rounds."""
        _after_previous(PDL)
        row = tl.program_id(0)
        h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
        d = tl.arange(0, D_PAD)
        ok = (h[:, None] < heads) & (d[None, :] < HEAD_DIM)
        at = h[:, None] * HEAD_DIM + d[None, :]
        dtype = out_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * stride_xt + at, mask=ok, other=0.0).to(tl.float32)
        normed = (x * tl.rsqrt(tl.sum(x * x, 1)[:, None] / HEAD_DIM + eps)).to(dtype)
        w = tl.load(w_ptr + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
        gate = tl.load(gate_ptr + row * stride_gt + at, mask=ok, other=0.0).to(tl.float32)
        y = (w[None, :] * normed.to(tl.float32)).to(dtype).to(tl.float32)
        y = y * (gate / (1.0 + tl.exp(-gate)))
        tl.store(out_ptr + row * heads * HEAD_DIM + at, y.to(dtype), mask=ok)


# Split-KV: a grid smaller than PROGRAMS_PER_SM programs per SM splits each program's keys into
# up to MAX_SPLITS ranges, so a small batch (decode, verify) still spreads over the whole GPU.
PROGRAMS_PER_SM, MAX_SPLITS = 2, 32
# Key blocks a range spans, at least, at the longest context the block tables hold. 4 (16 ranges
# where 1 gives 32 at batch 1, tables of 4096 keys) made the 8B step faster at 512 keys and slower
# at 3000 on the H200 (deploy/results/HISTORY.md, "Results: the 8B decode step"); for A/B runs.
MIN_RANGE_BLOCKS = 1
INTERPRETER_SMS = 132   # an H100/H200, so that tests under the interpreter take the GPU's paths
GEMV_ROWS, GEMV_BLOCK = 2, 1024   # weight rows per gemv program, features per stretch (fastest
                                  # on the H200 at Qwen3-8B's shapes, scratch sweep 2026-12-01)
GEMV_FIRST = 4096   # features of the first stretch, loaded before the wait (see _pdl)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def attention_splits(programs: int, max_keys: int, block_n: int, device: torch.device) -> int:
    """How many key ranges each of `programs` attention programs is split into: doubled until the
    grid has PROGRAMS_PER_SM programs per SM, at most MAX_SPLITS, and no more ranges than a
    context of `max_keys` has runs of MIN_RANGE_BLOCKS blocks of `block_n` keys. Only host values
    go in (never the device context lengths), so a CUDA graph captured with it stays valid."""
    target = PROGRAMS_PER_SM * _sm_count(device)
    splits = 1
    while (programs * splits < target and splits < MAX_SPLITS
           and 2 * splits * MIN_RANGE_BLOCKS * block_n <= max_keys):
        splits *= 2
    return splits


def split_keys() -> int:
    """The widest block tables, in keys, whose width still changes what attention_splits gives
    some grid (block_n is at most 64): a wider table takes the same ranges."""
    return MAX_SPLITS * MIN_RANGE_BLOCKS * 64


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, q_start: torch.Tensor, q_len: torch.Tensor,
                    context_lens: torch.Tensor, max_q_len: int, scale: float,
                    causal: bool = True, splits: int | None = None) -> torch.Tensor:
    """q: [T, heads, D] rows of S sequences (sequence s owns rows q_start[s] .. + q_len[s], at
    positions context_lens[s] ..); k_cache, v_cache: one layer's pages [blocks, page, kv_heads, D]
    already holding these rows' keys; block_tables: [S, W]. Returns [T, heads, D].

    `splits` (a power of two) fixes the number of key ranges; by default attention_splits picks
    it from the grid and the longest context the block tables can hold."""
    rows, heads, dim = q.shape
    page, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    g_pad = _pow2(group)
    block_l = max(_pow2(min(max_q_len, max(64 // g_pad, 1))), max(16 // g_pad, 1))
    block_n = 64 if dim <= 128 else 32
    grid = (block_tables.shape[0], kv_heads, triton.cdiv(max_q_len, block_l))
    if splits is None:
        splits = attention_splits(grid[0] * grid[1] * grid[2], block_tables.shape[1] * page,
                                  block_n, q.device)
    out = torch.empty_like(q)
    acc = m_part = l_part = out   # the partials, only with several ranges
    if splits > 1:
        acc = torch.empty(rows, heads, splits, dim, dtype=torch.float32, device=q.device)
        m_part, l_part = torch.empty(2, rows, heads, splits, dtype=torch.float32, device=q.device)
    _paged_attention_kernel[grid[:2] + (grid[2] * splits,)](
        q, k_cache, v_cache, out, acc, m_part, l_part, block_tables, q_start, q_len,
        context_lens, scale, heads, q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, G_PAD=g_pad, BLOCK_L=block_l, BLOCK_N=block_n, HEAD_DIM=dim,
        D_PAD=max(_pow2(dim), 16), PAGE=page, CAUSAL=causal, IEEE=q.dtype == torch.float32,
        SPLITS=splits, **_pdl(), num_warps=4)
    if splits > 1:
        _combine_splits_kernel[(rows, heads)](
            acc, m_part, l_part, out, heads, out.stride(0), out.stride(1), SPLITS=splits,
            HEAD_DIM=dim, D_PAD=_pow2(dim), **_pdl(), num_warps=4)
    return out


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Writes row t of k and v ([T, kv_heads, D], rows and heads may be strided) to slot
    slot_mapping[t] of one layer's pages [blocks, page, kv_heads, D], both in one launch."""
    rows, kv_heads, dim = k.shape
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride() == v_cache.stride()
    _write_kv_kernel[(rows,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), KV_HEADS=kv_heads,
        H_PAD=_pow2(kv_heads), HEAD_DIM=dim, D_PAD=_pow2(dim), PAGE=k_cache.shape[1],
        **_pdl(), num_warps=4)


def commit_states(conv: torch.Tensor, state: torch.Tensor, verify_conv: torch.Tensor,
                  verify_state: torch.Tensor, index: torch.Tensor) -> None:
    """For each column p of index [2, pairs]: every layer's conv window and recurrent state of
    verify entry index[1, p] into slot index[0, p] (the pools are [layers, slots or entries,
    ...], contiguous), both tensors in one launch. index's rows may be strided (a view of a
    wider buffer, as a captured commit reads)."""
    assert all(t.is_contiguous() for t in (conv, state, verify_conv, verify_state))
    assert index.stride(1) == 1
    pairs, (layers, slots), block = index.shape[1], conv.shape[:2], 1024
    conv_size, state_size = conv[0, 0].numel(), state[0, 0].numel()
    grid = (pairs, layers, triton.cdiv(max(conv_size, state_size), block))
    _commit_states_kernel[grid](conv, state, verify_conv, verify_state, index, index.stride(0),
                                slots, verify_conv.shape[1], conv_size, state_size, BLOCK=block,
                                **_pdl(), num_warps=4)


# Rows of at most this many columns take argmax_rows' kernel, one program a row in one pass;
# wider ones (Qwen's 151936) keep torch's argmax, not one program reading a whole row alone
ARGMAX_COLUMNS = 16384


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1) for logits [rows, V]: each row's first column holding its largest
    value, long [rows]. A NaN counts as +inf (torch's argmax takes the first NaN; the two differ
    only where a +inf comes before it). One launch where the kernels run and V <= ARGMAX_COLUMNS:
    torch's took 8.2 us on the H100 for a verify's 8 rows of the bundled model's 4096, against
    3.8 us for one row (scripts/kernelprof.py)."""
    if (logits.dim() != 2 or logits.stride(1) != 1 or logits.shape[1] > ARGMAX_COLUMNS
            or not runs_on(logits.device)):
        return logits.argmax(-1)
    rows, cols = logits.shape
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    block = _pow2(cols)
    _argmax_rows_kernel[(rows,)](logits, out, cols, logits.stride(0), BLOCK=block, **_pdl(),
                                 num_warps=4 if block <= 4096 else 8)
    return out


def ngram_lookup(history: torch.Tensor, lengths: torch.Tensor, num_drafts: int, min_n: int,
                 max_n: int) -> torch.Tensor:
    """drafting.ngram's `ngram_drafts_in_tensors` in one launch (its reference): history
    [S, W] holds each sequence's tokens in its first lengths[i] (>= 1) columns (a view of a
    wider buffer may be passed). Returns [S, num_drafts] long: the drafts, then the last
    token as filler. The tensor ops read all W columns of every sequence in some 20 launches;
    this reads a sequence's own tokens, once per n."""
    assert history.stride(1) == 1 and lengths.is_contiguous()
    rows = history.shape[0]
    out = torch.empty(rows, num_drafts, dtype=torch.long, device=history.device)
    _ngram_lookup_kernel[(rows,)](history, lengths, out, history.stride(0), history.shape[1],
                                  num_drafts, MIN_N=min_n, MAX_N=max_n, BLOCK=256,
                                  D_PAD=_pow2(num_drafts), **_pdl(), num_warps=4)
    return out


def ngram_round_inputs(history: torch.Tensor, used: torch.Tensor, context: torch.Tensor,
                       num_drafts: int, min_n: int, max_n: int, tables: torch.Tensor,
                       block_size: int, ids: torch.Tensor, positions: torch.Tensor,
                       kv_index: torch.Tensor, context_in: torch.Tensor) -> torch.Tensor:
    """ngram_lookup then round_inputs over its drafts, in one launch. Returns the drafts [S,
    num_drafts] (num_drafts >= 1)."""
    rows, length = used.shape[0], num_drafts + 1
    assert num_drafts >= 1 and history.stride(1) == 1 and tables.stride(1) == 1
    assert used.is_contiguous() and context.is_contiguous()
    drafts = torch.empty(rows, num_drafts, dtype=torch.long, device=history.device)
    _ngram_round_kernel[(rows,)](history, used, context, tables, ids, positions, kv_index,
                                 context_in, drafts, history.stride(0), tables.stride(0),
                                 history.shape[1], length, MIN_N=min_n, MAX_N=max_n, BLOCK=256,
                                 PAGE=block_size, L_PAD=_pow2(length), **_pdl(), num_warps=4)
    return drafts


def round_inputs(history: torch.Tensor, used: torch.Tensor, context: torch.Tensor,
                 drafts: torch.Tensor, tables: torch.Tensor, block_size: int, ids: torch.Tensor,
                 positions: torch.Tensor, kv_index: torch.Tensor, context_in: torch.Tensor) -> None:
    """A chained round's step inputs for S = len(used) sequences of length = drafts.shape[1] + 1
    rows each, in one launch (workers.chain.round_inputs' tensor ops are its reference): row j
    of sequence s holds its pending token (history[s, used[s] - 1]) for j = 0, else draft j - 1;
    at position context[s] + j, whose KV index goes through the block table tables[s]. Writes
    ids, positions, kv_index [S * length] and context_in [S] (context, in its dtype)."""
    rows, length = used.shape[0], drafts.shape[1] + 1
    assert history.stride(1) == 1 and tables.stride(1) == 1
    assert drafts.is_contiguous() and used.is_contiguous() and context.is_contiguous()
    _round_inputs_kernel[(rows,)](history, used, context, drafts, tables, ids, positions,
                                  kv_index, context_in, history.stride(0), tables.stride(0),
                                  length, PAGE=block_size, L_PAD=_pow2(length), **_pdl(),
                                  num_warps=1)


def round_advance(history: torch.Tensor, used: torch.Tensor, context: torch.Tensor,
                  best: torch.Tensor, accepted: torch.Tensor, landing: torch.Tensor) -> None:
    """workers.chain.advance in one launch, and the round's landing row: best [S, length] (the
    rows' argmaxes) appended to each history at used[s], used and context advanced by
    accepted[s] + 1, and landing[s] = best[s] then accepted[s]."""
    rows, length = best.shape
    assert history.stride(1) == 1 and landing.stride(1) == 1 and best.is_contiguous()
    _round_advance_kernel[(rows,)](history, used, context, best, accepted, landing,
                                   history.stride(0), landing.stride(0), length,
                                   L_PAD=_pow2(length), **_pdl(), num_warps=1)


def greedy_accept(ids: torch.Tensor, best: torch.Tensor, drafts: torch.Tensor,
                  slots: torch.Tensor, offsets: torch.Tensor, index: torch.Tensor,
                  length: int, pad: tuple[int, int], land: tuple | None = None) -> torch.Tensor:
    """Greedy verdicts on the device, for a verify of n = len(drafts) sequences of `length` rows
    each: ids, best [n * length] the rows' input tokens and argmaxes; drafts [n] the real drafts
    per sequence; slots [n] their SSM slots and offsets the pool's first entry per slot. Returns
    the drafts each accepted [n] (what greedy_verdict finds), and writes the commit's pairs
    into index [2, >= n] (slot, entry): columns n.. of it get `pad` (slot, entry). With `land`
    (history, used, context, landing) the same launch does round_advance's work with best as
    [n, length] and the counts (a chained round's verify)."""
    n, pairs = drafts.shape[0], index.shape[1]
    accepted = torch.empty(n, dtype=torch.long, device=ids.device)
    history, used, context, landing = land if land is not None else (ids,) * 4
    if land is not None:
        assert history.stride(1) == 1 and landing.stride(1) == 1 and best.is_contiguous()
    _greedy_accept_kernel[(pairs,)](ids, best, drafts, slots, offsets, index, accepted,
                                    index.stride(0), n, pad[0], pad[1], length, history, used,
                                    context, landing, history.stride(0), landing.stride(0),
                                    L_PAD=_pow2(max(length - 1, 1)), LAND=land is not None,
                                    ROWS_PAD=_pow2(length) if land is not None else 1,
                                    **_pdl(), num_warps=1)
    return accepted


# Value columns and warps per gated_delta_rule program. On the H200 (2B's heads, CUDA graphs:
# deploy/results/sweep-few-rows-2026-12-04.json, "delta") one warp took 9.5 us for a verify's 8
# rows where four took 12.9, 2.4 us against 2.6 at one row, and 40 us at 32 sequences as four did;
# 16 columns were faster still at 8 rows (8.6 us) but took 63 us at 32 sequences.
DELTA_BV, DELTA_WARPS = 32, 1
# Key heads of at most this many features read a row's output from the state before its update
# (_gated_delta_kernel's ONE_PASS). On the H100 (scripts/deltabench.py; deploy/results/HISTORY.md)
# it took a verify of 8 rows of the bundled model's heads of 32 from 6.6 to 4.8 us (1.06x at 32
# sequences); on heads of 128 it gained nothing (0.95-1.02x). 0: never, for A/B runs
DELTA_ONE_PASS_KEYS = 32
# The layer's GatedRMSNorm inside the recurrence's kernel where one program holds a whole head:
# one launch a layer fewer. False: its own kernel after it, for A/B runs
DELTA_NORM = True


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                     b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                     state: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor | None = None,
                     offsets: torch.Tensor | None = None, gate: torch.Tensor | None = None,
                     norm_weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """The recurrence over B sequences of L rows: q, k [B, L, key_heads, dk] (not yet
    normalised), v [B, L, value_heads, dv], and the gates' projections a, b [B, L, value_heads]
    with the layer's A_log and dt_bias [value_heads]; all may be views of wider rows. `state` is
    one layer's slot states [slots, value_heads, dk, dv] (float32), read at `slots` [B]; without
    `keep` they are updated in place, with it the state after row t goes to
    keep[offsets[slots[b]] + t] (a verify pool laid out per slot). With a `gate` [B, L,
    value_heads, dv] (rows may be strided) the outputs go through the layer's GatedRMSNorm
    (`norm_weight`, `eps`): in this kernel where a program holds a whole head (dv <= DELTA_BV and
    DELTA_NORM), else in gated_rms_norm after it. Returns [B, L, value_heads, dv] in v's dtype."""
    n_seq, length, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    assert dk == _pow2(dk) and dv == _pow2(dv) and hv % hk == 0, "power-of-two head dims"
    out = torch.empty(n_seq, length, hv, dv, dtype=v.dtype, device=v.device)
    if length == 0:   # no rows: the kernel would still load a first row before its loop
        return out
    q, k, v, a, b = (_flat_rows(x) for x in (q, k, v, a, b))
    bv = min(dv, DELTA_BV)
    fused = gate is not None and bv == dv and DELTA_NORM
    g = _flat_rows(gate) if fused else q
    _gated_delta_kernel[(n_seq, hv, dv // bv)](
        q, k, v, a, b, a_log, dt_bias, out, state, slots, keep if keep is not None else state,
        offsets if offsets is not None else slots, g, norm_weight if fused else a_log, length,
        dk ** -0.5, eps, q.stride(0), k.stride(0), v.stride(0), a.stride(0), b.stride(0),
        g.stride(0), HK=hk, HV=hv, DK=dk, DV=dv, BV=bv, KEEP=keep is not None,
        ONE_PASS=dk <= DELTA_ONE_PASS_KEYS, NORM=fused, **_pdl(), num_warps=DELTA_WARPS)
    if gate is None or fused:
        return out
    rows = n_seq * length
    return gated_rms_norm(out.view(rows, hv, dv), _flat_rows(gate).unflatten(1, (hv, dv)),
                          norm_weight, eps).view(n_seq, length, hv, dv)


def _flat_rows(x: torch.Tensor) -> torch.Tensor:
    """x [B, L, ...] as a [B * L, n] matrix of contiguous rows at one stride: a view where x's
    layout allows it (rows of a wider projection), else a copy."""
    rows = x.reshape(x.shape[0] * x.shape[1], -1)
    return rows if rows.stride(1) == 1 else rows.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool,
             residual: torch.Tensor | None = None):
    """RMSNorm of x's rows ([T, n], contiguous); with `residual`, of x + residual, returning
    (normed, x + residual)."""
    n = x.shape[-1]
    x = x.contiguous()
    residual = residual.contiguous() if residual is not None else None
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else None
    _rms_norm_kernel[(x.numel() // n,)](
        x, residual if residual is not None else x, weight, out,
        summed if summed is not None else out, n, eps, HAS_RES=residual is not None,
        OFFSET=offset, BLOCK=_pow2(n), **_pdl(), num_warps=8 if n >= 2048 else 4)
    return (out, summed) if residual is not None else out


def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool,
              cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Per-head RMSNorm then rotary: x [T, heads, D] (rows and heads may be strided; D is
    contiguous), cos and sin [T, 1, R]. Returns a contiguous [T, heads, D]."""
    rows, heads, dim = x.shape
    assert x.stride(2) == 1 and dim == _pow2(dim)
    out = torch.empty(rows, heads, dim, dtype=x.dtype, device=x.device)
    _norm_rope_kernel[(rows, heads)](x, weight, cos.contiguous(), sin.contiguous(), out, heads,
                                     x.stride(0), x.stride(1), eps, HEAD_DIM=dim,
                                     ROT=cos.shape[-1], OFFSET=offset, **_pdl(), num_warps=1)
    return out


def qk_norm_rope_to_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                          offset: bool, cos: torch.Tensor, sin: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> torch.Tensor:
    """What norm_rope of q and of k, then write_kv, compute, in one launch: q [T, heads, D]
    and k, v [T, kv_heads, D] (views of the fused projection: rows and heads may be strided);
    k normed and rotated, and v, go to slot slot_mapping[t] of one layer's pages. Returns the
    normed, rotated q, contiguous."""
    rows, heads, dim = q.shape
    kv_heads = k.shape[1]
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1 and dim == _pow2(dim)
    assert k_cache.stride() == v_cache.stride()
    out = torch.empty(rows, heads, dim, dtype=q.dtype, device=q.device)
    _qk_norm_rope_kernel[(rows, heads + kv_heads)](
        q, k, v, q_weight, k_weight, cos.contiguous(), sin.contiguous(), out, k_cache, v_cache,
        slot_mapping, heads, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), eps,
        HEAD_DIM=dim, ROT=cos.shape[-1], OFFSET=offset, PAGE=k_cache.shape[1], **_pdl(),
        num_warps=1)
    return out


def gemv(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
    """x [1, n_in] (features contiguous) times weight [n_out, n_in] (contiguous) transposed:
    [1, n_out] in x's dtype, what F.linear computes, rounded once from float32 sums. With
    `silu_mul`, weight is [gate | up] and the result is silu_mul of that, [1, n_out / 2]."""
    n_out, n_in = weight.shape
    n_out //= 1 + silu_mul
    out = torch.empty(1, n_out, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n_out, GEMV_ROWS),)](
        x, weight, out, n_out, n_in, BLOCK_N=GEMV_ROWS, FIRST=min(GEMV_FIRST, _pow2(n_in)),
        BLOCK_K=min(GEMV_BLOCK, _pow2(n_in)), SILU_MUL=silu_mul, **_pdl(), num_warps=4,
        num_stages=1)
    return out


FEW_ROWS = 16                         # most rows few_rows takes (a verify of 15 drafts)
# Most rows few_rows takes of a small weight (see FEW_MAX_WEIGHTS); above FEW_ROWS in tiles of
# TILE_ROWS rows, one a program: a decode step of 17 to 128 sequences, or a verify of as many
# rows, which would otherwise go to cuBLAS (2.7-3.1 us a GEMM on the bundled model at 32 and 128
# rows, H100, kernelprof-27726e5-h100.txt) and, for gate | up, silu_mul's kernel after it. In
# the bundled model's bench, n-gram at B = 8 (32 verify rows) went from 53.8k to 61.6-64.1k
# tokens/s with the tiles, plain decoding 22% faster at B = 32 and 25-27% at B = 64, where a
# round of 3 drafts (256 rows) stays on cuBLAS (ab-smallrows-*-h100.txt, one H100;
# gpubench --small-weight-rows 16 is the old routing, 256 takes those rounds too: A/B)
SMALL_ROWS = 128
TILE_ROWS = 32
FEW_BLOCK_N, FEW_BLOCK_K = 32, 256    # outputs and features per few_rows program and stretch
# Weights (elements) up to which linear() takes few_rows with one launch config for all: the
# bundled model's projections (up to 4096 x 256), where few_rows took 1.3-1.9 us and cuBLAS
# 2.6-4.7 us (H200, 8 and 16 rows, CUDA graphs: deploy/results/sweep-few-rows-2026-12-03.json).
# Larger weights take the plan few_rows_plan picks, or cuBLAS.
FEW_MAX_WEIGHTS = 1 << 21


class FewPlan(NamedTuple):
    """How few_rows launches for one weight: outputs per program, features per stretch, programs
    that split the features of each column of outputs (see _few_rows_kernel), warps, stages."""
    block_n: int
    block_k: int
    splits: int = 1
    warps: int = 4
    stages: int = 2


SMALL_PLAN = FewPlan(FEW_BLOCK_N, FEW_BLOCK_K)
SPLIT_PROGRAMS = 128   # programs a split plan aims at: about one per SM of an H200 (132)
WHOLE_K = 512          # features per program of a whole-share plan (see few_rows_plan)
WHOLE_PROGRAMS = 256   # most programs of a whole-share plan: two per SM of an H200, one wave
PLAN_ROWS = FEW_ROWS   # most rows of a large weight few_rows takes (a knob for A/B runs)


def small_weight(n_out: int, n_in: int, silu_mul: bool) -> bool:
    """Whether a weight [n_out (x2 with silu_mul), n_in] is small enough for SMALL_PLAN."""
    return (2 * n_out if silu_mul else n_out) * n_in <= FEW_MAX_WEIGHTS


def few_rows_plan(rows: int, n_out: int, n_in: int, silu_mul: bool) -> FewPlan | None:
    """How few_rows runs `rows` (2 to FEW_ROWS; of a small weight, up to SMALL_ROWS) rows of a
    weight [n_out (x2 with silu_mul), n_in], or None where cuBLAS is faster. Chosen by the
    Qwen3.5-2B-shaped target's whole verify graph replayed with each weight's plan swapped
    (scripts/verifyprof.py --plans; deploy/results/HISTORY.md, "Plans chosen in the model"),
    after a sweep of each kernel alone (scripts/fewsweep.py), which is no judge on its own: it
    ranked a plan for the 12352 x 2048 Gated DeltaNet input projection ahead of cuBLAS, and in
    the model that plan cost 0.06-0.09 ms a verify of 7.
    - small weights: SMALL_PLAN, whatever the rows;
    - [gate | up] with the SiLU fused: 32 outputs and 128 features a stretch (cuBLAS and
      silu_mul's kernel cost 0.02-0.03 ms more a verify);
    - up to 4096 outputs that fit WHOLE_PROGRAMS programs of 64 outputs and WHOLE_K features
      (the 2B's output projections): a whole-share plan, each program loading its WHOLE_K
      features in one stretch before its wait (see _pdl), so they stream while the kernel
      before runs; the programs' parts are added as _few_rows_kernel says (0.015 ms less a
      2B verify than the plan below; on the 8B's 4096 x 4096, 512 programs, 0.055 ms more);
    - other weights of up to 4096 outputs (the MLP's down projections, the 8B's attention
      output): 64 outputs a program in 256-feature stretches, 4 stages, the features split so
      there are about SPLIT_PROGRAMS programs (whole shares of 512 or 1024 features cost the
      2B 0.05-0.11 ms more);
    - more outputs (input, fused attention and vocabulary projections): cuBLAS."""
    if small_weight(n_out, n_in, silu_mul):
        return SMALL_PLAN
    if rows > PLAN_ROWS:
        return None
    if silu_mul:
        return FewPlan(32, 128, stages=4)
    if n_out > 4096:
        return None
    columns, shares = triton.cdiv(n_out, 64), triton.cdiv(n_in, WHOLE_K)
    if columns * shares <= WHOLE_PROGRAMS:
        return FewPlan(64, WHOLE_K, shares, stages=1)
    return FewPlan(64, 256, max(1, SPLIT_PROGRAMS // columns), stages=4)


def few_rows(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool = False,
             plan: FewPlan = SMALL_PLAN) -> torch.Tensor:
    """x [m, n_in] (2 <= m <= FEW_ROWS, or up to SMALL_ROWS in tiles of TILE_ROWS with an
    unsplit plan; features contiguous) times weight [n_out, n_in] (contiguous) transposed, as
    F.linear, in one kernel launched like the others here (see _pdl); with `silu_mul` as
    gemv's (on one program per column: plan.splits 1)."""
    m, n_in = x.shape
    n_out = weight.shape[0] // (1 + silu_mul)
    assert plan.splits == 1 or not silu_mul, "silu_mul sums each column in one program"
    m_pad = FEW_ROWS if m <= FEW_ROWS else TILE_ROWS
    tiles = triton.cdiv(m, m_pad)
    assert tiles == 1 or plan.splits == 1, "split sums are laid out for one tile of rows"
    out = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    columns = triton.cdiv(n_out, plan.block_n)
    k_len = triton.cdiv(triton.cdiv(n_in, plan.splits), plan.block_k) * plan.block_k
    splits = triton.cdiv(n_in, k_len)   # plan.splits or fewer, k_len being whole stretches
    part, count = (_split_space(x.device, splits * m_pad * n_out, columns)
                   if splits > 1 else (out, out))
    _few_rows_kernel[(columns, splits, tiles)](
        x, weight, out, part, count, m, n_out, n_in, x.stride(0), k_len, M_PAD=m_pad,
        BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, SPLITS=splits,
        SILU_MUL=silu_mul, IEEE=x.dtype == torch.float32, **_pdl(), num_warps=plan.warps,
        num_stages=plan.stages)
    return out


_SPLIT_SPACES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
SPLIT_PARTS, SPLIT_COUNTS = 1 << 20, 1 << 12   # the split space's float32 sums and counts


def _split_space(device: torch.device, parts: int, columns: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 parts and the zeroed int32 counts that split few_rows launches on `device`
    share: launches on one stream run one after the other (a dependent launch writes only after
    its wait, see _pdl), and each leaves its counts at 0. Allocated once, at a fixed size, so
    that no captured graph is left holding a space since freed."""
    if parts > SPLIT_PARTS or columns > SPLIT_COUNTS:
        raise ValueError(f"a split few_rows of {parts} sums over {columns} columns is larger "
                         f"than its space ({SPLIT_PARTS}, {SPLIT_COUNTS})")
    if device not in _SPLIT_SPACES:
        if device.type == "cuda":
            assert not torch.cuda.is_current_stream_capturing(), "split space made in a capture"
        _SPLIT_SPACES[device] = (torch.empty(SPLIT_PARTS, dtype=torch.float32, device=device),
                                 torch.zeros(SPLIT_COUNTS, dtype=torch.int32, device=device))
    return _SPLIT_SPACES[device]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """F.linear, except that one row (a decode step of one sequence) on a device the kernels
    run on goes through gemv: the weights stream at close to the copy bandwidth, where cuBLAS's
    kernels for one row reached 75-95% of it (and add a split-K reduction for some shapes).
    A few rows (a verify) go through few_rows, which starts under the kernel before as gemv
    does, where few_rows_plan has a plan for the weight. Outside inference (autograd on) it is
    always F.linear."""
    if _gemv_takes(x, weight, bias):
        return gemv(x, weight)
    plan = _few_rows_take(x, weight, bias, False)
    if plan is not None:
        return few_rows(x, weight, plan=plan)
    return F.linear(x, weight, bias)


def _rows_kernel_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      rows: range) -> bool:
    """Whether gemv or few_rows can compute F.linear(x, weight, bias) here: len(rows) in
    `rows`, features contiguous, no bias, inference only (no backward)."""
    return (bias is None and x.dim() == 2 and x.shape[0] in rows and x.stride(1) == 1
            and weight.is_contiguous() and weight.dtype == x.dtype and runs_on(x.device)
            and not torch.is_grad_enabled())


def _gemv_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether gemv computes F.linear(x, weight, bias) here: one row."""
    return _rows_kernel_takes(x, weight, bias, range(1, 2))


def _few_rows_take(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   silu_mul: bool) -> FewPlan | None:
    """How few_rows computes F.linear(x, weight, bias) here (None: it does not): 2 to FEW_ROWS
    rows, as few_rows_plan says for this weight, or of a small weight up to SMALL_ROWS."""
    n_out, n_in = weight.shape
    n_out = n_out // 2 if silu_mul else n_out
    most = max(SMALL_ROWS, FEW_ROWS) if small_weight(n_out, n_in, silu_mul) else FEW_ROWS
    if not (FEW and _rows_kernel_takes(x, weight, bias, range(2, most + 1))):
        return None
    return few_rows_plan(x.shape[0], n_out, n_in, silu_mul)


def linear_silu_mul(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """silu_mul(linear(x, gate_up)); one row (or a few) through one kernel that applies the SiLU
    to its sums (the same sums and roundings), so a decode step's MLP is two launches."""
    if _gemv_takes(x, gate_up, None):
        return gemv(x, gate_up, silu_mul=True)
    plan = _few_rows_take(x, gate_up, None, True)
    if plan is not None:
        return few_rows(x, gate_up, silu_mul=True, plan=plan)
    return silu_mul(linear(x, gate_up))


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2n] holding [gate | up] per row. Returns silu(gate) * up, [T, n]."""
    rows, n = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    _silu_mul_kernel[(rows, triton.cdiv(n, 1024))](x, out, n, BLOCK=1024, **_pdl(), num_warps=4)
    return out


CONV_BLOCK, CONV_ROWS = 256, 16   # channels and rows per conv program...
# ...and rows per program of a verify, which writes no slot window: each row its own program, so
# a verify's rows run side by side instead of one after another in a program
CONV_VERIFY_ROWS = 1


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor,
                         slots: torch.Tensor, keep: torch.Tensor | None = None,
                         offsets: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal conv then SiLU over B sequences of L rows, x [B, L, C] (rows may be
    strided, channels contiguous), with weight [C, 1, K]. Each sequence's inputs are its conv
    window, one layer's windows [slots, C, K-1] read at `slots` [B], then its rows. Without
    `keep` the slots' windows become their last K-1 inputs; with it the window after row t goes
    to keep[offsets[slots[b]] + t] and the slots are left alone. Returns [B, L, C] in x's dtype."""
    n_seq, length, channels = x.shape
    taps = weight.shape[-1]
    assert x.stride(2) == 1 and weight.is_contiguous() and window.is_contiguous()
    assert (keep is None or keep.is_contiguous()) and taps - 1 <= CONV_ROWS
    out = torch.empty(n_seq, length, channels, dtype=x.dtype, device=x.device)
    rows = CONV_ROWS if keep is None else CONV_VERIFY_ROWS
    grid = (n_seq, triton.cdiv(channels, CONV_BLOCK), triton.cdiv(length, rows))
    _causal_conv1d_kernel[grid](
        x, weight, window, slots, keep if keep is not None else window,
        offsets if offsets is not None else slots, out, length, channels, x.stride(0),
        x.stride(1), K=taps, BLOCK=CONV_BLOCK, ROWS=rows, KEEP=keep is not None,
        **_pdl(), num_warps=4)
    return out


# Heads of a row per gated_rms_norm program: 4 cut the bundled verify of 7 at B=32 (256 rows of 8
# heads of 32) from 2.96 to 1.17 us a call on the H100 (scripts/normbench.py and
# deploy/results/HISTORY.md); 1 for A/B
NORM_HEADS = 4


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """GatedRMSNorm: RMSNorm over each head of x [T, heads, D] times the weight, times
    SiLU(gate) [T, heads, D]; rows may be strided, each row's heads contiguous. Returns a
    contiguous [T, heads, D]."""
    rows, heads, dim = x.shape
    for t in (x, gate):
        assert t.stride(2) == 1 and t.stride(1) == dim
    out = torch.empty(rows, heads, dim, dtype=x.dtype, device=x.device)
    per = min(NORM_HEADS, _pow2(heads))
    _gated_rms_norm_kernel[(rows, triton.cdiv(heads, per))](
        x, gate, weight, out, heads, x.stride(0), gate.stride(0), eps, HEAD_DIM=dim,
        D_PAD=_pow2(dim), HEADS=per, **_pdl(), num_warps=1)
    return out

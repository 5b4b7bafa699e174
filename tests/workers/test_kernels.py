"""The Triton kernels against the torch reference: paged attention (prefill, decode, verify,
non-causal blocks, GQA groups that are not powers of two; keys in one range per program or split
into several and combined), the K/V cache write, the Gated DeltaNet recurrence with its gates and
its causal conv, with and without per-token verify states, and the fused norms. On a GPU; on CPU
only under TRITON_INTERPRET=1."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from metrale.workers.models import kernels
from metrale.workers.models.gated_deltanet import causal_conv1d_update, gated_delta_rule, gates
from metrale.workers.ssm_pool import SSMSlotPool

if not kernels.available():
    pytest.skip("triton is not installed", allow_module_level=True)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU (set TRITON_INTERPRET=1 to run the kernels on CPU)", allow_module_level=True)


def _interpreter_reads_loop_bounds():
    """Triton 3.6's interpreter turns a scalar loaded from memory (a one-element array) into a loop
    bound with int(array), which NumPy 2 refuses; this takes the element instead."""
    import numpy as np
    from triton.runtime import interpreter
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__",
                       lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))
    interpreter._patch_lang_tensor = patched


if DEVICE == "cpu":
    _interpreter_reads_loop_bounds()


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def reference_attention(q, k_cache, v_cache, tables, q_start, q_len, ctx, scale, causal):
    out = torch.full_like(q, float("nan"))
    page = k_cache.shape[1]
    for s in range(len(q_len)):
        n, c, start = int(q_len[s]), int(ctx[s]), int(q_start[s])
        total = c + n
        blocks = tables[s, : (total + page - 1) // page]
        keys = k_cache[blocks].flatten(0, 1)[:total].float()
        values = v_cache[blocks].flatten(0, 1)[:total].float()
        q_pos = torch.arange(c, total, device=q.device)
        mask = torch.arange(total, device=q.device)[None, :] <= q_pos[:, None]
        if not causal:
            mask = torch.ones_like(mask)
        out[start:start + n] = F.scaled_dot_product_attention(
            q[start:start + n].float().transpose(0, 1), keys.transpose(0, 1),
            values.transpose(0, 1), attn_mask=mask, scale=scale,
            enable_gqa=True).transpose(0, 1).to(q.dtype)
    return out


def run_attention(dtype, heads, kv_heads, dim, lengths, contexts, causal, splits=None,
                  page=16, seed=0):
    """Kernel and reference outputs for sequences of `lengths` new rows after `contexts` cached
    tokens, their pages scattered over the cache."""
    if DEVICE == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the Triton interpreter mishandles bfloat16")
    g = torch.Generator(DEVICE).manual_seed(seed)
    width = max(-(-(c + n) // page) for c, n in zip(contexts, lengths))
    num_blocks = len(lengths) * width + 3
    k_cache = torch.randn(num_blocks, page, kv_heads, dim, generator=g, device=DEVICE).to(dtype)
    v_cache = torch.randn(num_blocks, page, kv_heads, dim, generator=g, device=DEVICE).to(dtype)
    ctx = torch.tensor(contexts, device=DEVICE)
    q_len = torch.tensor(lengths, device=DEVICE)
    q_start = torch.cumsum(q_len, 0) - q_len
    perm = torch.randperm(num_blocks, generator=g, device=DEVICE)   # scattered pages
    tables = perm[: len(lengths) * width].view(len(lengths), width)
    q = torch.randn(int(q_len.sum()), heads, dim, generator=g, device=DEVICE).to(dtype)
    out = kernels.paged_attention(q, k_cache, v_cache, tables, q_start, q_len, ctx, max(lengths),
                                  dim ** -0.5, causal, splits)
    ref = reference_attention(q, k_cache, v_cache, tables, q_start, q_len, ctx, dim ** -0.5, causal)
    return out, ref


def assert_close(out, ref, dtype):
    assert not out.isnan().any()
    assert rel_err(out, ref) < (1e-5 if dtype == torch.float32 else 2e-2)   # float32: IEEE dots


@pytest.mark.parametrize("splits", [1, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 64), (8, 8, 128), (10, 2, 64), (8, 2, 256)])
@pytest.mark.parametrize("lengths,causal", [([1, 1, 1], True), ([8, 8], True), ([37, 5, 1], True),
                                            ([9, 9], False)])
def test_paged_attention(dtype, heads, kv_heads, dim, lengths, causal, splits):
    """One key range per program (splits=1) and the default, which splits these small grids."""
    out, ref = run_attention(dtype, heads, kv_heads, dim, lengths, [70, 3, 200][: len(lengths)],
                             causal, splits, seed=len(lengths) * heads + dim)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 4), (8, 2), (16, 2), (12, 2)])
@pytest.mark.parametrize("lengths,contexts,causal", [
    ([1], [1000], True),                 # decode: many ranges, context not a multiple of them
    ([8], [517], True),                  # verify blocks
    ([16], [1020], True),                # rows 1020..1023 see none of the last range's keys
    ([16], [1001], False),               # DFlash's non-causal block
    ([1, 1, 1, 4], [0, 3, 777, 2], True),  # no context; fewer keys than ranges (empty ranges)
])
def test_split_attention(dtype, heads, kv_heads, lengths, contexts, causal):
    """Batch-1-like grids: the keys are split into several ranges and combined."""
    dim, page = 64, 16
    width = max(-(-(c + n) // page) for c, n in zip(contexts, lengths))
    programs = len(lengths) * kv_heads * max(lengths)   # at least the grid: at most its splits
    assert kernels.attention_splits(programs, width * page, 64, torch.device(DEVICE)) >= 4
    out, ref = run_attention(dtype, heads, kv_heads, dim, lengths, contexts, causal,
                             seed=heads + kv_heads + len(lengths))
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("splits", [2, 32])
def test_split_attention_forced(splits):
    """A given number of ranges, from two to more ranges than a short context has keys; rows
    62, 63 of the first sequence and 120..127 of the last see no key of the range from 64 or
    128 on."""
    out, ref = run_attention(torch.float32, 8, 2, 64, [3, 1, 16], [62, 0, 120], True, splits)
    assert_close(out, ref, torch.float32)


def test_attention_splits_rule():
    """Small grids split up to MAX_SPLITS, no more than the context has key blocks; large grids
    keep one range."""
    device = torch.device(DEVICE)
    sms = kernels._sm_count(device)
    assert kernels.attention_splits(8, 1 << 20, 64, device) == kernels.MAX_SPLITS
    assert kernels.attention_splits(8, 512, 64, device) == 8
    assert kernels.attention_splits(8, 100, 64, device) == 1
    assert kernels.attention_splits(kernels.PROGRAMS_PER_SM * sms, 1 << 20, 64, device) == 1
    small = kernels.attention_splits(sms, 1 << 20, 64, device)
    assert 1 < small and sms * small >= kernels.PROGRAMS_PER_SM * sms


def test_attention_splits_keep_ranges_of_min_range_blocks(monkeypatch):
    """With MIN_RANGE_BLOCKS = 4 a range spans at least 4 blocks of the longest context."""
    device = torch.device(DEVICE)
    monkeypatch.setattr(kernels, "MIN_RANGE_BLOCKS", 4)
    assert kernels.attention_splits(8, 512, 64, device) == 2
    assert kernels.attention_splits(8, 4096, 64, device) == 16
    assert kernels.attention_splits(8, 255, 64, device) == 1


@pytest.mark.parametrize("min_range_blocks", [1, 4])
def test_tables_of_split_keys_meet_every_number_of_ranges(monkeypatch, min_range_blocks):
    """For any grid, tables of a power of two of 16-key blocks up to split_keys() take every
    number of key ranges any wider table takes (the warm-up compiles each such variant)."""
    monkeypatch.setattr(kernels, "MIN_RANGE_BLOCKS", min_range_blocks)
    device, widest = torch.device(DEVICE), kernels.split_keys()
    for block_n in (32, 64):
        for programs in range(1, 300):
            warmed = {kernels.attention_splits(programs, 16 << i, block_n, device)
                      for i in range(widest.bit_length()) if 16 << i <= widest}
            every = {kernels.attention_splits(programs, keys, block_n, device)
                     for keys in range(16, 64 * widest, 16)}
            assert warmed == every, (block_n, programs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_index_put(dtype):
    """Strided k and v rows land in their slots; every other slot keeps its value."""
    if DEVICE == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the Triton interpreter mishandles bfloat16")
    g = torch.Generator(DEVICE).manual_seed(0)
    blocks, page, kv_heads, dim, rows = 6, 4, 3, 32, 9
    k_cache = torch.randn(blocks, page, kv_heads, dim, generator=g, device=DEVICE).to(dtype)
    v_cache = torch.randn(blocks, page, kv_heads, dim, generator=g, device=DEVICE).to(dtype)
    kv = torch.randn(rows, 2 * kv_heads * dim + 8, generator=g, device=DEVICE).to(dtype)
    k = kv[:, : kv_heads * dim].view(rows, kv_heads, dim)        # views of one GEMM's output
    v = kv[:, kv_heads * dim: 2 * kv_heads * dim].view(rows, kv_heads, dim)
    slots = torch.randperm(blocks * page, generator=g, device=DEVICE)[:rows]
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref_k.view(-1, kv_heads, dim)[slots] = k
    ref_v.view(-1, kv_heads, dim)[slots] = v
    kernels.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("captured", [False, True])
def test_ssm_commit_kernel_takes_each_slots_accepted_entry(dtype, captured):
    """The pool's commit in one launch, or by replay of that launch captured for a bucket of
    slots: every layer's conv window and state of the entry each slot accepted (a state of
    several chunks); the other slots untouched but the spare one, which the captured commit's
    padding pair writes from its first entry."""
    if DEVICE == "cpu" and (dtype == torch.bfloat16 or captured):
        pytest.skip("the Triton interpreter mishandles bfloat16 and has no CUDA graphs")
    g = torch.Generator(DEVICE).manual_seed(0)
    pool = SSMSlotPool(3, 5, 40, 4, 4, 32, 24, dtype, torch.device(DEVICE), [3, 0, 2, 3, 1],
                       use_kernels=True)
    spare = 4
    if captured:
        pool.capture_commits([1, 2, 4], spare)
    for t in (pool.conv, pool.state, pool.verify_conv, pool.verify_state):
        t.copy_(torch.randn(t.shape, generator=g, device=DEVICE))
    conv, state = pool.conv.clone(), pool.state.clone()
    slots, accepted = ([3, 0, 2], [2, 3, 1]) if captured else ([3, 0, 4], [2, 3, 0])
    for slot, a in zip(slots + [spare] * captured, accepted + [0] * captured):
        conv[:, slot] = pool.verify_conv[:, pool.offset[slot] + a]
        state[:, slot] = pool.verify_state[:, pool.offset[slot] + a]
    assert pool.state[0, 0].numel() > 1024   # several chunks
    pool.commit(slots, accepted)
    assert torch.equal(pool.conv, conv) and torch.equal(pool.state, state)


@pytest.mark.parametrize("length", [2, 3, 4, 6, 8])
def test_greedy_accept_counts_what_greedy_verdict_finds(length):
    """The device's accepted counts for a greedy verify equal greedy_verdict's for each
    sequence, whatever filler follows its real drafts (here filler that matches); the commit
    pairs name each slot's entry after its accepted drafts, the padding columns the padding
    pair, and columns past the bucket stay as they were."""
    from metrale.drafting.rejection import greedy_verdict
    g = torch.Generator().manual_seed(length)
    k = length - 1
    slots = [4, 0, 3, 1, 2]
    plan = [(k, k), (0, 0), (1, 0), (k, k // 2), (k - 1, k - 1)]   # (real drafts, to accept)
    n, pairs = len(plan), 8
    best = torch.randint(0, 1000, (n * length,), generator=g)
    ids = best.roll(1)   # every row's token is the argmax of the row before: all would match
    for i, (d, a) in enumerate(plan):
        if a < d:
            ids[i * length + 1 + a] += 1   # the first rejected draft
    offsets = torch.tensor([0, 9, 18, 27, 36])
    index = torch.full((2, 16), -1, dtype=torch.long, device=DEVICE)
    accepted = kernels.greedy_accept(
        ids.to(DEVICE), best.to(DEVICE), torch.tensor([d for d, _ in plan], device=DEVICE),
        torch.tensor(slots, device=DEVICE), offsets.to(DEVICE), index[:, :pairs], length, (5, 45))
    want = [greedy_verdict(ids[i * length + 1:i * length + 1 + d].tolist(),
                           best[i * length:(i + 1) * length].tolist()).accepted
            for i, (d, _) in enumerate(plan)]
    assert want == [a for _, a in plan]
    assert accepted.tolist() == want
    assert index[0, :pairs].tolist() == slots + [5] * (pairs - n)
    assert index[1, :pairs].tolist() == [offsets[s] + a for s, a in zip(slots, want)] + \
        [45] * (pairs - n)
    assert (index[:, pairs:] == -1).all()


def _compiled(kernel):
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps its compiled kernels elsewhere (read: device_caches)")
    return caches[torch.cuda.current_device()][0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cols", [(1, 4096), (8, 4096), (5, 1000), (3, 16384)])
def test_argmax_rows_is_torchs_argmax(dtype, rows, cols):
    """The first column of each row's largest value, as torch's argmax: ties, a row of -inf,
    the last column of a partial block, rows strided as a wider buffer's view."""
    gen = torch.Generator().manual_seed(rows * cols)
    wide = torch.randn(rows, cols + 24, generator=gen).to(dtype)
    wide[:, 7] = wide[:, 700 % cols] = 50.0            # a tie: the first column wins
    wide[-1, cols - 1] = 60.0                          # the last column, in a partial block
    wide[0, :] = -float("inf")                         # a row of -inf: column 0
    logits = wide[:, :cols].to(DEVICE)
    best = kernels.argmax_rows(logits)
    expected = [0] if rows == 1 else [0] + [7] * (rows - 2) + [cols - 1]
    assert best.dtype == torch.long
    assert best.tolist() == expected == logits.argmax(-1).tolist()


def test_argmax_rows_counts_a_nan_as_largest_and_leaves_wide_rows_to_torch(monkeypatch):
    """A NaN is taken as torch takes it; rows wider than ARGMAX_COLUMNS never reach the kernel."""
    logits = torch.randn(4, 300).to(DEVICE)
    logits[2, 123] = float("nan")
    assert kernels.argmax_rows(logits)[2].item() == 123
    calls = []
    monkeypatch.setattr(kernels, "_argmax_rows_kernel", calls)   # a launch would fail on a list
    monkeypatch.setattr(kernels, "ARGMAX_COLUMNS", 256)
    assert kernels.argmax_rows(logits).tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("min_n, max_n, k", [(1, 4, 7), (2, 3, 3), (1, 1, 1), (3, 5, 15)])
def test_ngram_lookup_drafts_what_the_scan_drafts(min_n, max_n, k):
    """One program a sequence: the drafts of `ngram_drafts` (the scan, the definition) then the
    last token as filler, as the tensor ops make them, for histories of 1 token to longer than
    a block of the kernel's scan, in a wider table whose columns past each history hold junk,
    read through a view of some of its rows (as a chain reads its bucket's)."""
    from metrale.drafting.ngram import ngram_drafts, ngram_drafts_in_tensors
    gen = torch.Generator().manual_seed(min_n * 100 + max_n * 10 + k)
    lengths = [1, 2, 5, 40, 255, 256, 257, 600, 31, 3]
    histories = [torch.randint(0, 3 if i % 2 else 12, (n,), generator=gen).tolist()
                 for i, n in enumerate(lengths)]
    histories[4] = list(range(200)) + list(range(55))   # a match ending far back
    table = torch.randint(0, 12, (len(lengths) + 2, 700), generator=gen)
    for row, h in zip(table, histories):
        row[:len(h)] = torch.tensor(h)
    table = table.to(DEVICE)
    used = torch.tensor(lengths, device=DEVICE)
    got = kernels.ngram_lookup(table[:len(lengths)], used, k, min_n, max_n)
    assert got.dtype == torch.long and got.shape == (len(lengths), k)
    assert torch.equal(got, ngram_drafts_in_tensors(table[:len(lengths)], used, k, min_n, max_n))
    for drafts, h in zip(got.tolist(), histories):
        want = ngram_drafts(h, k, min_n, max_n)
        assert drafts == want + [h[-1]] * (k - len(want))
    assert any(len(ngram_drafts(h, k, min_n, max_n)) == k for h in histories)   # real drafts


@pytest.mark.parametrize("depth", [0, 1, 7])
def test_a_chained_rounds_bookkeeping_kernels_match_its_tensor_ops(depth, monkeypatch):
    """round_inputs (rows, positions, KV indices through the block tables) and land (the
    history, lengths and landing row a round leaves) in one launch each write what their
    tensor ops write, for sequences whose rows cross a block boundary, in buffers wider than
    the bucket (views, as a chain's graphs read them)."""
    from metrale.workers import chain
    gen = torch.Generator().manual_seed(depth)
    bucket, width, bs, length = 5, 64, 4, depth + 1

    def state():
        history = torch.randint(0, 50, (bucket + 2, width), generator=gen)
        used = torch.tensor([1, 3, 9, 20, 33])
        context = torch.tensor([0, 2, 7, 18, 30])
        tables = torch.randperm(40, generator=gen)[:30].view(3, 10).repeat(3, 1)[:bucket + 1]
        return [t.to(DEVICE) for t in (history, used, context, tables.int())]

    history, used, context, tables = state()
    drafts = torch.randint(0, 50, (bucket, depth), generator=gen).to(DEVICE)
    best = torch.randint(0, 50, (bucket, length), generator=gen).to(DEVICE)
    accepted = torch.randint(0, length, (bucket,), generator=gen).to(DEVICE)
    outs = []
    for kernel in (True, False):
        monkeypatch.setattr(kernels, "CHAIN", kernel)
        h, u, c = history.clone(), used.clone(), context.clone()
        wide = torch.full((3 * (bucket + 1) * length,), -7, dtype=torch.long, device=DEVICE)
        ids, pos, kv = (wide[i * bucket * length:(i + 1) * bucket * length] for i in range(3))
        ctx = torch.full((bucket + 1,), -7, dtype=torch.int32, device=DEVICE)
        chain.round_inputs(h[:bucket], u, c, drafts, tables[:bucket], bs, ids, pos, kv,
                           ctx[:bucket])
        landing = torch.full((bucket + 1, 17), -7, dtype=torch.long, device=DEVICE)
        chain.land(h[:bucket], u, c, best, accepted, landing[:bucket])
        outs.append((wide, ctx, h, u, c, landing))
    for got, want in zip(*outs):
        assert torch.equal(got, want)
    wide, ctx, h, u, c, landing = outs[1]
    assert wide[3 * bucket * length:].eq(-7).all() and ctx[bucket] == -7   # nothing past them
    assert torch.equal(u, used + accepted + 1) and torch.equal(c, context + accepted + 1)
    assert torch.equal(landing[:bucket, length], accepted)


@pytest.mark.parametrize("depth", [1, 3, 7])
def test_paired_bookkeeping_kernels_write_what_each_pair_writes(depth):
    """A chained n-gram verify's paired launches (kernels.ROUND_FUSED): the lookup that writes
    the round's rows writes the drafts, rows, positions, KV indices and cached lengths of
    ngram_lookup then round_inputs; the verdicts that land the round write the counts, commit
    pairs, histories, lengths and landing rows of greedy_accept then round_advance. Histories
    of few distinct tokens (matches and filler both occur), in buffers wider than the bucket."""
    gen = torch.Generator().manual_seed(depth)
    bucket, width, bs, length = 6, 96, 4, depth + 1
    history = torch.randint(0, 3, (bucket + 2, width), generator=gen)
    history[0, :2] = torch.tensor([5, 6])   # a history of two distinct tokens: no match
    used = torch.tensor([2, 3, 9, 20, 33, 60])
    context = torch.tensor([1, 2, 7, 18, 30, 57])
    tables = torch.randperm(60, generator=gen)[:40].view(2, 20).repeat(4, 1)[:bucket + 1].int()
    history, used, context, tables = (t.to(DEVICE) for t in (history, used, context, tables))
    outs = []
    for paired in (True, False):
        h, u, c = history.clone(), used.clone(), context.clone()
        wide = torch.full((3 * (bucket + 1) * length,), -7, dtype=torch.long, device=DEVICE)
        ids, pos, kv = (wide[i * bucket * length:(i + 1) * bucket * length] for i in range(3))
        ctx = torch.full((bucket + 1,), -7, dtype=torch.int32, device=DEVICE)
        if paired:
            drafts = kernels.ngram_round_inputs(h[:bucket], u, c, depth, 1, 4, tables[:bucket],
                                                bs, ids, pos, kv, ctx[:bucket])
        else:
            drafts = kernels.ngram_lookup(h[:bucket], u, depth, 1, 4)
            kernels.round_inputs(h[:bucket], u, c, drafts, tables[:bucket], bs, ids, pos, kv,
                                 ctx[:bucket])
        best = ids.view(bucket, length).roll(-1, 1)   # each draft the argmax of the row before
        best[1::2, depth // 2] += 1                 # but in odd sequences, one is not
        best = best.flatten().contiguous()
        slots = torch.tensor([3, 0, 5, 1, 4, 2], device=DEVICE)
        offsets = torch.arange(6, device=DEVICE) * length
        index = torch.full((2, bucket + 1), -1, dtype=torch.long, device=DEVICE)
        landing = torch.full((bucket + 1, 17), -7, dtype=torch.long, device=DEVICE)
        counts = torch.full((bucket,), depth, dtype=torch.long, device=DEVICE)
        land = (h[:bucket], u, c, landing[:bucket])
        if paired:
            accepted = kernels.greedy_accept(ids, best, counts, slots, offsets, index[:, :bucket],
                                             length, (6, 99), land)
        else:
            accepted = kernels.greedy_accept(ids, best, counts, slots, offsets, index[:, :bucket],
                                             length, (6, 99))
            kernels.round_advance(*land[:3], best.view(bucket, length), accepted, land[3])
        outs.append((drafts, wide, ctx, accepted, index, h, u, c, landing))
    for got, want in zip(*outs):
        assert torch.equal(got, want)
    drafts, wide, ctx, accepted, index, h, u, c, landing = outs[1]
    assert drafts[0].eq(6).all()   # no match: filler, the last token
    assert accepted[0::2].eq(depth).all() and accepted[1::2].eq(depth // 2).all()
    assert torch.equal(u, used + accepted + 1) and torch.equal(landing[:bucket, length], accepted)
    assert wide[3 * bucket * length:].eq(-7).all() and ctx[bucket] == -7 and index[0, -1] == -1


@pytest.mark.skipif(DEVICE != "cuda", reason="compiled kernels: CUDA only")
def test_greedy_accept_compiles_at_start_up_not_in_a_round():
    """capture_commits compiles the counting kernel for every verify length up to its
    max_length; a round then compiles nothing, whatever its k, batch or padding."""
    pool = SSMSlotPool(2, 9, 40, 4, 4, 32, 24, torch.float32, torch.device(DEVICE),
                       [8] * 8 + [1], use_kernels=True)
    pool.capture_commits([1, 2, 4, 8], spare_slot=8, max_length=9)
    compiled = _compiled(kernels._greedy_accept_kernel)
    before = len(compiled)
    assert before >= 4   # L_PAD 1, 2, 4 and 8 (and those a chained round's landing compiled)
    for length in range(2, 10):
        for n in (1, 3, 8):
            ids = torch.zeros(n * length, dtype=torch.long, device=DEVICE)
            pool.commit_greedy(ids, ids, [length - 1] * n, list(range(n)), length)
    assert len(compiled) == before


@pytest.mark.skipif(DEVICE != "cuda", reason="compiled kernels: CUDA only")
def test_prefill_layouts_compile_no_new_attention_or_conv_variant():
    """A prefill's per-sequence tensors are rows of one upload at offsets that follow the count
    of prompts, its block tables' width follows the longest context, and the conv's length and
    batch stride follow the prompts: none of these compiles the attention or conv kernel again
    (each compile took about 0.8 s inside a serving step under steady load)."""
    g = torch.Generator(DEVICE).manual_seed(0)
    page, heads, kv_heads, dim, channels = 16, 8, 2, 64, 300
    k_cache, v_cache = torch.randn(2, 400, page, kv_heads, dim, generator=g, device=DEVICE)
    conv_w = torch.randn(channels, 1, 4, generator=g, device=DEVICE)
    windows = torch.randn(40, channels, 3, generator=g, device=DEVICE)

    def prefill(lengths, contexts, skip):
        """One step's layout as the engine uploads it: `skip` values, then q_start, q_len,
        context lengths and slots back to back in one int32 copy."""
        n, width = len(lengths), max(-(-(c + m) // page) for c, m in zip(contexts, lengths))
        starts = [sum(lengths[:i]) for i in range(n)]
        upload = torch.tensor([7] * skip + starts + lengths + contexts + list(range(n)),
                              dtype=torch.int32, device=DEVICE)
        q_start, q_len, ctx, slots = upload[skip:].split(n)
        tables = torch.randperm(400, generator=g, device=DEVICE)[:n * width].view(n, width)
        q = torch.randn(sum(lengths), heads, dim, generator=g, device=DEVICE)
        kernels.paged_attention(q, k_cache, v_cache, tables.int(), q_start, q_len, ctx,
                                max(lengths), dim ** -0.5, splits=1)
        x = torch.randn(n, max(lengths), channels + 5, generator=g, device=DEVICE)
        kernels.causal_conv1d_update(x[..., :channels], conv_w, windows, slots)

    prefill([64] * 4, [0] * 4, 0)
    attention = _compiled(kernels._paged_attention_kernel)
    conv = _compiled(kernels._causal_conv1d_kernel)
    before = len(attention), len(conv)
    for lengths, contexts, skip in [([64] * 5, [0] * 5, 1), ([80, 64, 65] * 2 + [99], [0] * 7, 3),
                                    ([64] * 6, [130, 0, 17, 300, 0, 3], 5)]:
        prefill(lengths, contexts, skip)
    assert (len(attention), len(conv)) == before


def verify_offsets(slot_ids, n_slots, length, first):
    """A verify pool's per-slot offsets where slot_ids[b] owns entries first + b * length .. +
    length - 1, and those entries [B, L] (what pool.entries gives)."""
    offsets = torch.zeros(n_slots, dtype=torch.long, device=DEVICE)
    offsets[slot_ids] = first + length * torch.arange(len(slot_ids), device=DEVICE)
    return offsets, offsets[slot_ids][:, None] + torch.arange(length, device=DEVICE)[None, :]


@pytest.mark.parametrize("one_pass,normed", [(True, False), (False, False), (True, True),
                                             (False, True)])
@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("hk,hv,dim", [(2, 4, 32), (4, 4, 64)])
def test_gated_delta_rule(keep, hk, hv, dim, one_pass, normed, monkeypatch):
    """The recurrence with its gates computed from the raw projections, reading q, k, v, a, b as
    views of one wider row, as the layer passes them; each row's output read after the state's
    update, or (one_pass) from the state before it. `normed`: the outputs through the layer's
    GatedRMSNorm with a gate read as a view of wider rows, in the recurrence's kernel for heads of
    32 (one program a head) and after it for heads of 64."""
    from metrale.workers.models.layers import GatedRMSNorm
    monkeypatch.setattr(kernels, "DELTA_ONE_PASS_KEYS", dim if one_pass else 0)
    g_ = torch.Generator(DEVICE).manual_seed(hk + dim + keep)
    n_seq, length, slots = 3, 5, 6

    def rand(*shape):
        return torch.randn(*shape, generator=g_, device=DEVICE)
    widths = [hk * dim, hk * dim, hv * dim, hv, hv]
    q, k, v, a, b = rand(n_seq, length, sum(widths) + 3)[..., 3:].split(widths, -1)
    q, k, v = q.unflatten(-1, (hk, dim)), k.unflatten(-1, (hk, dim)), v.unflatten(-1, (hv, dim))
    a.mul_(4)
    a[0, 0, 0], a[1, 0, 1] = 30.0, -30.0    # softplus above its threshold, and of a tiny exp
    a_log, dt_bias = rand(hv) * 0.5, rand(hv)
    state = rand(slots, hv, dim, dim) * 0.1
    slot_ids = torch.tensor([4, 0, 2], device=DEVICE)
    g, beta = gates(a, b, a_log, dt_bias)
    rep = hv // hk
    ref_out, ref_final, ref_states = gated_delta_rule(
        q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2), v, g, beta,
        state[slot_ids].clone(), keep_states=True)
    before = state.clone()
    offsets, _ = verify_offsets(slot_ids, slots, length, 2)
    pool = (torch.full((n_seq * length + 2, hv, dim, dim), float("nan"), device=DEVICE) if keep
            else None)
    norm, gate = None, None
    if normed:
        norm = GatedRMSNorm(dim, 1e-6).to(DEVICE)
        with torch.no_grad():
            norm.weight.copy_(rand(dim))
        gate = rand(n_seq, length, hv * dim + 5)[..., 5:].unflatten(-1, (hv, dim))
        ref_out = norm(ref_out, gate)
    out = kernels.gated_delta_rule(q, k, v, a, b, a_log, dt_bias, state, slot_ids, pool,
                                   offsets if keep else None, gate,
                                   norm.weight if normed else None, 1e-6)
    assert rel_err(out, ref_out) < 1e-4
    if keep:
        assert torch.equal(state, before)
        assert rel_err(pool[2:].view(n_seq, length, hv, dim, dim), ref_states) < 1e-4
    else:
        assert rel_err(state[slot_ids], ref_final) < 1e-4
        untouched = [s for s in range(slots) if s not in slot_ids.tolist()]
        assert torch.equal(state[untouched], before[untouched])


def test_gated_delta_rule_of_no_rows_leaves_the_states():
    """Sequences of no rows: an empty output and no state changed (the wrapper returns before
    the kernel, which loads a first row ahead of its loop)."""
    q = k = torch.zeros(2, 0, 1, 32, device=DEVICE)
    v = torch.zeros(2, 0, 2, 32, device=DEVICE)
    a = b = torch.zeros(2, 0, 2, device=DEVICE)
    state = torch.randn(3, 2, 32, 32, device=DEVICE)
    before = state.clone()
    out = kernels.gated_delta_rule(q, k, v, a, b, torch.zeros(2, device=DEVICE),
                                   torch.zeros(2, device=DEVICE), state,
                                   torch.tensor([2, 0], device=DEVICE))
    assert out.shape == (2, 0, 2, 32) and torch.equal(state, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("length,verify,verify_rows", [
    (1, False, 1), (2, False, 1), (7, False, 1), (37, False, 1),
    (2, True, 1), (5, True, 1), (5, True, 16), (5, True, 2)])
def test_causal_conv1d_update(dtype, length, verify, verify_rows, monkeypatch):
    """Decode, prefill chunks shorter and longer than the window (and than one program's rows),
    and verifies (a program per row, as by default, or several rows per program), of sequences
    in scattered slots; 300 channels (not a power of two, two programs) read as a view of wider
    rows. The output and the windows written match the torch reference."""
    monkeypatch.setattr(kernels, "CONV_VERIFY_ROWS", verify_rows)
    if DEVICE == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the Triton interpreter mishandles bfloat16")
    g_ = torch.Generator(DEVICE).manual_seed(length + verify)
    n_seq, slots, channels, taps = 3, 6, 300, 4

    def rand(*shape):
        return torch.randn(*shape, generator=g_, device=DEVICE).to(dtype)
    mixed = rand(n_seq, length, channels + 20)[..., 5:5 + channels]
    weight, window = rand(channels, 1, taps), rand(slots, channels, taps - 1)
    slot_ids = torch.tensor([4, 0, 2], device=DEVICE)
    offsets, entries = verify_offsets(slot_ids, slots, length, 1)
    keep = (torch.full((n_seq * length + 1, channels, taps - 1), float("nan"), device=DEVICE,
                       dtype=dtype) if verify else None)
    ref_window, ref_keep = window.clone(), keep.clone() if verify else None
    ref = causal_conv1d_update(mixed, weight, ref_window, slot_ids, ref_keep, entries)
    out = kernels.causal_conv1d_update(mixed, weight, window, slot_ids, keep,
                                       offsets if verify else None)
    assert out.dtype == dtype and rel_err(out, ref) < (1e-6 if dtype == torch.float32 else 1e-2)
    if dtype != torch.float32:   # rounded where the reference rounds: equal but for rare ties
        assert (out != ref).float().mean() < 1e-3
    assert torch.equal(window, ref_window)   # each slot's window as the reference leaves it
    if verify:
        assert torch.equal(keep[1:], ref_keep[1:]) and keep[0].isnan().all()


GRAPHS = [False, True] if DEVICE == "cuda" else [False]


@pytest.mark.parametrize("graphs", GRAPHS)
@pytest.mark.parametrize("name,method", [("qwen3", "none"), ("qwen3_5", "none"),
                                         ("qwen3_5", "ngram"), ("qwen3_5", "mtp"),
                                         ("qwen3", "dflash"), ("qwen3_5", "dflash")])
def test_engine_on_the_kernels_matches_the_reference(checkpoint, dflash_drafter, name, method,
                                                     graphs):
    """The whole engine with attention_backend='triton' (and CUDA graphs on a GPU): greedy tokens
    equal transformers'."""
    import checkpoints
    from metrale.cluster.params import SamplingParams
    from metrale.deploy.llm import LLM
    model_dir = checkpoint(name)
    llm = LLM(model_dir, device=DEVICE, dtype="float32", block_size=4, attention_backend="triton",
              cuda_graphs=graphs, max_num_batched_tokens=16, speculative_method=method,
              num_drafts=3 if method != "none" else None,
              drafter=dflash_drafter(name) if method == "dflash" else None)
    assert llm.worker.backend == "triton" and (llm.worker.graphs is not None) == graphs
    prompts = [llm.encode(p) for p in ["def schedule(self, tokens):", "The café engine", "x"]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == checkpoints.reference_greedy(model_dir, prompt, 24)
    if graphs:
        assert llm.worker.graphs.graphs, "no step ran as a CUDA graph"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [False, True])
def test_fused_norms_and_activation_match_the_modules(dtype, offset):
    from metrale.workers.models.layers import RMSNorm, Rotary
    if DEVICE == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the Triton interpreter mishandles bfloat16")
    g = torch.Generator(DEVICE).manual_seed(int(offset))
    norm = RMSNorm(96, 1e-6, offset).to(DEVICE, dtype)
    head_norm = RMSNorm(64, 1e-6, offset).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.normal_(generator=g)
        head_norm.weight.normal_(generator=g)
    x, h = (torch.randn(5, 96, generator=g, device=DEVICE).to(dtype) for _ in range(2))
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    with torch.inference_mode():
        assert rel_err(norm.fused(x), norm(x)) < tol
        normed, summed = norm.fused(h, residual=x)
        assert torch.equal(summed, x + h) and rel_err(normed, norm(x + h)) < tol
        rotary = Rotary(16, 10000.0).to(DEVICE)
        cos, sin = rotary.cos_sin(torch.arange(3, 8, device=DEVICE), dtype)
        q = torch.randn(5, 4, 128, generator=g, device=DEVICE).to(dtype)[..., :64]   # strided heads
        assert rel_err(head_norm.fused_rope(q, cos, sin), Rotary.apply(head_norm(q), cos, sin)) < tol
        gate_up = torch.randn(5, 2 * 80, generator=g, device=DEVICE).to(dtype)
        ref = F.silu(gate_up[:, :80]) * gate_up[:, 80:]
        assert rel_err(kernels.silu_mul(gate_up), ref) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_out,n_in", [(50, 64), (37, 1500), (6, 2048), (10, 9000)])
def test_gemv_is_f_linear_for_one_row(dtype, n_out, n_in):
    """One row (a view of a wider row) through the GEMV kernel; linear() takes it only for one
    row in inference, and F.linear otherwise."""
    if DEVICE == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the Triton interpreter mishandles bfloat16")
    g = torch.Generator(DEVICE).manual_seed(n_in)
    w = torch.randn(n_out, n_in, generator=g, device=DEVICE).to(dtype)
    rows = torch.randn(2, n_in + 3, generator=g, device=DEVICE).to(dtype)[:, 3:]
    ref = F.linear(rows[:1].float(), w.float())
    with torch.inference_mode():
        out = kernels.gemv(rows[:1], w)
        assert out.shape == (1, n_out) and out.dtype == dtype
        assert rel_err(out, ref) < (1e-6 if dtype == torch.float32 else 1e-2)
        assert torch.equal(kernels.linear(rows[:1], w), out)
        # [gate | up] with the SiLU applied to the sums: the two kernels' bits, in one launch
        if n_out % 2 == 0:
            fused = kernels.linear_silu_mul(rows[:1], w)
            assert fused.shape == (1, n_out // 2)
            assert torch.equal(fused, kernels.silu_mul(out))
    with torch.enable_grad():
        assert torch.equal(kernels.linear(rows[:1], w), F.linear(rows[:1], w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n_out,n_in", [(2, 50, 64), (8, 37, 300), (16, 96, 1500), (5, 1024, 256),
                                         (17, 40, 96), (70, 96, 300), (128, 64, 256),
                                         (256, 48, 128)])
def test_few_rows_is_f_linear_for_a_verifys_rows(dtype, m, n_out, n_in, monkeypatch):
    """2 to 256 rows (views of wider rows; above 16 in tiles of TILE_ROWS, the last one part
    full) of a small weight through the few-rows kernel, and [gate | up] with the SiLU applied
    to its sums as silu_mul rounds them; one row more than SMALL_ROWS, a large weight
    few_rows_plan leaves to cuBLAS, or autograd on, go to F.linear; with SMALL_ROWS at FEW_ROWS
    (gpubench --small-weight-rows 16) so do 17. 256 rows run with SMALL_ROWS at 256, the most
    gpubench --small-weight-rows takes."""
    default = kernels.SMALL_ROWS
    assert default == 128
    if m > default:
        monkeypatch.setattr(kernels, "SMALL_ROWS", m)
    calls = []
    few_rows = kernels.few_rows
    monkeypatch.setattr(kernels, "few_rows",
                        lambda x, w, **kw: calls.append(w.shape) or few_rows(x, w, **kw))
    if DEVICE == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the Triton interpreter mishandles bfloat16")
    g = torch.Generator(DEVICE).manual_seed(m * n_in)
    w = torch.randn(n_out, n_in, generator=g, device=DEVICE).to(dtype)
    rows = torch.randn(kernels.SMALL_ROWS + 1, n_in + 3, generator=g, device=DEVICE
                       ).to(dtype)[:, 3:]
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    with torch.inference_mode():
        out = kernels.linear(rows[:m], w)
        assert out.shape == (m, n_out) and out.dtype == dtype
        assert rel_err(out, F.linear(rows[:m].float(), w.float())) < tol
        assert torch.equal(kernels.linear(rows, w), F.linear(rows, w))   # SMALL_ROWS + 1: cuBLAS
        big = torch.randn(5120, kernels.FEW_MAX_WEIGHTS // 5120 + 1, generator=g, device=DEVICE
                          ).to(dtype)   # a fused attention projection's shape: cuBLAS
        x = torch.randn(m, big.shape[1], generator=g, device=DEVICE).to(dtype)
        assert kernels.few_rows_plan(m, *big.shape, False) is None
        assert torch.equal(kernels.linear(x, big), F.linear(x, big))
        assert calls == [w.shape]
        fused = kernels.linear_silu_mul(rows[:m], w[:n_out // 2 * 2])
        half = n_out // 2
        ref = (F.silu(F.linear(rows[:m].float(), w[:half].float()))
               * F.linear(rows[:m].float(), w[half:2 * half].float()))
        assert fused.shape == (m, half) and rel_err(fused, ref) < 10 * tol
        assert calls == [w.shape, (half * 2, n_in)]
        monkeypatch.setattr(kernels, "SMALL_ROWS", kernels.FEW_ROWS)
        assert kernels._few_rows_take(rows[:kernels.FEW_ROWS + 1], w, None, False) is None
    with torch.enable_grad():
        assert torch.equal(kernels.linear(rows[:m], w), F.linear(rows[:m], w))
    assert len(calls) == 2


@pytest.mark.parametrize("n_out,n_in,silu,splits", [
    (2048, 1100, False, 3), (3000, 800, False, 2), (600, 4200, False, 9), (4096, 4096, False, 2),
    (1100, 1000, True, 1)])
def test_few_rows_plans_for_large_weights(n_out, n_in, silu, splits):
    """Up to PLAN_ROWS rows of weights over FEW_MAX_WEIGHTS take the plan few_rows_plan picks:
    up to 4096 outputs, the features split into whole shares of WHOLE_K (where that makes up
    to WHOLE_PROGRAMS programs) or over about SPLIT_PROGRAMS programs, whose parts the last
    program adds, in the same order at every launch (so the same bits), leaving the counts at
    0; [gate | up] with the SiLU one program a column. All as F.linear computes them; more
    rows, or more than 4096 outputs, go to cuBLAS."""
    if DEVICE == "cpu":   # the interpreter's float32, a few rows (its programs run one by one)
        dtype, m = torch.float32, 3
    else:
        dtype, m = torch.bfloat16, 8
    g = torch.Generator(DEVICE).manual_seed(n_out)
    w = (torch.randn((2 if silu else 1) * n_out, n_in, generator=g, device=DEVICE) / 30).to(dtype)
    x = torch.randn(m, n_in, generator=g, device=DEVICE).to(dtype)
    plan = kernels.few_rows_plan(m, n_out, n_in, silu)
    assert w.numel() > kernels.FEW_MAX_WEIGHTS and plan is not None and plan.splits == splits
    assert kernels.few_rows_plan(kernels.PLAN_ROWS + 1, n_out, n_in, silu) is None   # cuBLAS
    assert silu or kernels.few_rows_plan(m, 4097, n_in, silu) is None
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    with torch.inference_mode():
        if silu:
            out = kernels.linear_silu_mul(x, w)
            ref = F.silu(F.linear(x.float(), w[:n_out].float())) * F.linear(x.float(), w[n_out:].float())
        else:
            out = kernels.linear(x, w)
            ref = F.linear(x.float(), w.float())
            assert torch.equal(kernels.linear(x, w), out)
        assert out.shape == (m, n_out) and rel_err(out, ref) < (10 if silu else 1) * tol
    if splits > 1:
        part, count = kernels._SPLIT_SPACES[x.device]
        assert count.abs().sum().item() == 0


def test_one_sequence_decodes_through_the_gemv(checkpoint, monkeypatch):
    """Alone in the batch, a sequence's decode steps run every projection and the lm_head as
    GEMVs, and its greedy tokens stay transformers'."""
    import checkpoints
    from metrale.cluster.params import SamplingParams
    from metrale.deploy.llm import LLM
    calls = []
    gemv = kernels.gemv
    monkeypatch.setattr(kernels, "gemv",
                        lambda x, w, **kw: calls.append((w.shape, kw)) or gemv(x, w, **kw))
    model_dir = checkpoint("qwen3")
    llm = LLM(model_dir, device=DEVICE, dtype="float32", block_size=4,
              attention_backend="triton", cuda_graphs=DEVICE == "cuda")
    prompt = llm.encode("def schedule(self, tokens):")
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == checkpoints.reference_greedy(model_dir, prompt, 12)
    layer = llm.worker.model.model.layers[0]
    assert (llm.worker.model.lm_head.weight.shape, {}) in calls
    assert (layer.self_attn.qkv.shape, {}) in calls
    assert (layer.mlp.gate_up.shape, {"silu_mul": True}) in calls   # the MLP's first GEMV


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("offset,rot,gated", [(False, 64, False), (True, 16, True)])
def test_qk_norm_rope_to_cache_is_the_separate_kernels_in_one(dtype, offset, rot, gated):
    """Norm and rotary of q and k plus the K/V write in one launch: q, the key and value caches
    bit for bit what norm_rope twice and write_kv leave; slots no row names keep their values.
    Qwen3's layout (full rotary) and Qwen3.5's (gate after each query head, partial rotary)."""
    from metrale.workers.models.layers import RMSNorm, Rotary
    if DEVICE == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the Triton interpreter mishandles bfloat16")
    g = torch.Generator(DEVICE).manual_seed(rot)
    rows, heads, kv_heads, dim, blocks, page = 5, 4, 2, 64, 4, 4
    q_norm, k_norm = (RMSNorm(dim, 1e-6, offset).to(DEVICE, dtype) for _ in range(2))
    with torch.no_grad():
        q_norm.weight.normal_(generator=g)
        k_norm.weight.normal_(generator=g)
    q_width = heads * dim * (2 if gated else 1)
    qkv = torch.randn(rows, q_width + 2 * kv_heads * dim, generator=g, device=DEVICE).to(dtype)
    q = qkv[:, :q_width].view(rows, heads, -1)[..., :dim]
    k = qkv[:, q_width:q_width + kv_heads * dim].view(rows, kv_heads, dim)
    v = qkv[:, q_width + kv_heads * dim:].view(rows, kv_heads, dim)
    cos, sin = Rotary(rot, 10000.0).to(DEVICE).cos_sin(torch.arange(7, 7 + rows, device=DEVICE),
                                                       dtype)
    slots = torch.randperm(blocks * page, generator=g, device=DEVICE)[:rows]
    k_cache, v_cache = (torch.randn(blocks, page, kv_heads, dim, generator=g, device=DEVICE)
                        .to(dtype) for _ in range(2))
    ref_k, ref_v, before_k = k_cache.clone(), v_cache.clone(), k_cache.clone()
    with torch.inference_mode():
        ref_q = q_norm.fused_rope(q, cos, sin)
        kernels.write_kv(k_norm.fused_rope(k, cos, sin), v, ref_k, ref_v, slots)
        out = kernels.qk_norm_rope_to_cache(q, k, v, q_norm.weight, k_norm.weight, 1e-6, offset,
                                            cos, sin, k_cache, v_cache, slots)
        torch_q = Rotary.apply(q_norm(q), cos, sin)
    assert torch.equal(out, ref_q) and torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    assert rel_err(out, torch_q) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert not torch.equal(k_cache, before_k)   # the rows were written


@pytest.mark.parametrize("heads", [3, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gated_rms_norm_matches_the_module(dtype, heads):
    """Heads of 48 features (padded in the kernel), x and the gate read as views of wider rows;
    3 heads are one program's NORM_HEADS less one, 6 one program and part of another."""
    from metrale.workers.models.layers import GatedRMSNorm
    if DEVICE == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the Triton interpreter mishandles bfloat16")
    g = torch.Generator(DEVICE).manual_seed(3)
    norm = GatedRMSNorm(48, 1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.normal_(generator=g)
    x, gate = (torch.randn(5, heads * 48 + 56, generator=g, device=DEVICE).to(dtype)[:, 8:-48]
               .view(5, heads, 48) for _ in range(2))
    with torch.inference_mode():
        out, ref = norm.fused(x, gate), norm(x, gate)
    assert out.dtype == dtype and out.is_contiguous()
    assert rel_err(out, ref) < (1e-6 if dtype == torch.float32 else 1e-2)
    if dtype != torch.float32:   # rounded where the module rounds: equal but for rare ties
        assert (out != ref).float().mean() < 1e-2


@pytest.mark.skipif(DEVICE != "cuda", reason="flash-linear-attention runs on CUDA only")
@pytest.mark.parametrize("sequences, length, chunked",
                         [(32, 264, True), (4, 264, False), (1, 264, False)])
def test_long_prefill_through_fla_matches_the_reference_logits(checkpoint, monkeypatch,
                                                               sequences, length, chunked):
    """Prefill chunks of FLA_CHUNK_MIN_LEN rows or more, FLA_CHUNK_MIN_ROWS or more in all (or
    FLA_CHUNK_LONG, past this checkpoint's positions), go to fla's chunked kernel; the rest run
    token by token. Both match transformers' logits."""
    pytest.importorskip("fla")
    import checkpoints
    from metrale.deploy.llm import LLM
    from metrale.workers.models import gated_deltanet
    calls = []
    real = gated_deltanet._fla_chunk
    monkeypatch.setattr(gated_deltanet, "_fla_chunk", lambda: calls.append(1) or real())
    model_dir = checkpoint("qwen3_5")
    llm = LLM(model_dir, device=DEVICE, dtype="float32", attention_backend="triton",
              cuda_graphs=False, block_size=16)
    assert gated_deltanet.fla_chunked(sequences, length) == chunked
    prompts, logits = _prefill(llm, sequences, length)
    assert bool(calls) == chunked
    for i, ids in enumerate(prompts):
        rows = logits[i * length:(i + 1) * length]
        assert rel_err(rows, checkpoints.reference_logits(model_dir, ids)) < 1e-2


def _prefill(llm, sequences: int, length: int):
    """Prefills `sequences` code-like prompts of `length` tokens in one forward on llm's worker
    (from slot and block 0 on); returns the prompts and the logits of every row, on the CPU."""
    from metrale.workers.batch import ForwardBatch
    w = llm.worker
    texts = ["def schedule(self, tokens): return [t for t in tokens if t] ",
             "class Pool:\n    def take(self, n):\n        return self.free[:n] ",
             "import os\nfor name in os.listdir('.'):\n    print(name) ", "x = [i * i for i in y] "]
    prompts = [(llm.encode(texts[i % 4]) * 100)[:length] for i in range(sequences)]
    blocks = -(-length // 16)
    batch = ForwardBatch.build([(ids, 0, list(range(i * blocks, (i + 1) * blocks)), i)
                                for i, ids in enumerate(prompts)], 16, w.device, w.backend)
    return prompts, w.model.logits(w.model(batch, w.kv, w.ssm)[0]).cpu()


@pytest.mark.parametrize("n, length", [(1, 64), (2, 100), (5, 256), (7, 300)])
def test_varlen_index_is_what_fla_would_build(n, length):
    """The chunked prefill's cu_seqlens and chunk indices, made without a host sync: each
    sequence's chunks of 64 rows in order, as fla's prepare_chunk_indices builds them."""
    from metrale.workers.models.gated_deltanet import _varlen_index
    ends, index = _varlen_index(n, length, torch.device(DEVICE))
    chunks = -(-length // 64)
    assert ends.tolist() == [i * length for i in range(n + 1)]
    assert index.tolist() == [[s, c] for s in range(n) for c in range(chunks)]
    try:
        from fla.ops.utils.index import prepare_chunk_indices
    except ImportError:
        return
    assert torch.equal(index, prepare_chunk_indices(ends, 64))


@pytest.mark.skipif(DEVICE != "cuda", reason="flash-linear-attention runs on CUDA only")
def test_fla_prefill_autotunes_once_for_any_number_of_prompts(checkpoint, monkeypatch):
    """fla's autotuner keys some kernels by the batch size; the chunked prefill hands it one
    variable-length sequence, so a step with a new count of prompts (as under steady load, where
    prompts join as seats free up) benchmarks no configs again."""
    pytest.importorskip("fla")
    from triton.runtime.autotuner import Autotuner
    from metrale.deploy.llm import LLM
    from metrale.workers.models import gated_deltanet
    monkeypatch.setattr(gated_deltanet, "FLA_CHUNK_MIN_ROWS", 1024)   # 4 to 7 prompts: chunked
    llm = LLM(checkpoint("qwen3_5"), device=DEVICE, dtype="float32", attention_backend="triton",
              cuda_graphs=False, block_size=16)
    _prefill(llm, 4, 256)   # tunes (unless the test before did, in float32 as here)
    benched, bench = [], Autotuner._bench
    monkeypatch.setattr(Autotuner, "_bench",
                        lambda self, *a, **k: benched.append(self) or bench(self, *a, **k))
    for sequences in (5, 7, 6):
        _prefill(llm, sequences, 256)
    assert not benched


@pytest.mark.skipif(DEVICE != "cuda", reason="compiled kernels: CUDA only")
def test_warm_up_compiles_the_attention_of_any_prefill(checkpoint):
    """After the start-up warm-up, prefills of any count and length of prompts (each count
    spreading the keys over a different number of ranges) compile no attention variant."""
    from metrale.deploy.llm import LLM
    llm = LLM(checkpoint("qwen3_5"), device=DEVICE, dtype="bfloat16", attention_backend="triton",
              cuda_graphs=False, block_size=16, max_num_batched_tokens=2048)
    compiled = _compiled(kernels._paged_attention_kernel)
    before = len(compiled)
    for sequences, length in [(1, 500), (8, 256), (32, 64), (3, 40), (5, 17), (2, 5), (7, 3)]:
        _prefill(llm, sequences, length)
    assert len(compiled) == before


class _Replayed:
    """Stands in for a CUDA graph off the GPU: each replay reruns the step and copies its
    results into the tensors the capture returned, as a replay rewrites them."""

    def __init__(self, step, out):
        self.step, self.out = step, out

    def replay(self):
        for static, fresh in zip(self.out or (), self.step() or ()):
            static.copy_(fresh)

    def pool(self):
        return None


def test_mtp_chain_graphs_draft_what_the_eager_chain_drafts(checkpoint, monkeypatch):
    """MTP proposals from the captured chain (per batch bucket and k) equal the eager chain's,
    for sequences asking different numbers of drafts and a batch that needs padding rows."""
    from metrale.cluster.params import SamplingParams
    from metrale.deploy.llm import LLM
    from metrale.drafting import mtp
    from metrale.drafting.proposer import ProposeRequest
    if DEVICE == "cpu":
        monkeypatch.setattr(mtp, "capture", lambda step, pool: (_Replayed(step, out := step()), out))
    llm = LLM(checkpoint("qwen3_5"), device=DEVICE, dtype="float32", block_size=4,
              attention_backend="triton", cuda_graphs=False, speculative_method="mtp",
              num_drafts=3, adaptive_drafts=False)
    proposer = llm.worker.proposer
    ids = [llm.add_request(llm.encode(p), SamplingParams(max_tokens=12, temperature=0,
                                                         ignore_eos=True))
           for p in ["def schedule(self, tokens):", "The café engine", "x"]]
    seqs = [llm.scheduler.by_request[i][0] for i in ids]
    while min(len(s.output_ids) for s in seqs) < 6:
        llm.step()
    requests = [ProposeRequest(s.slot, s.num_computed, s.tokens[-1], k, list(s.block_table),
                               s.tokens) for s, k in zip(seqs, (3, 1, 2))]
    eager = proposer.propose(requests)
    # the last block, far past the three sequences' few, stands in for the spare one
    assert all(llm.worker.kv.num_blocks - 1 not in s.block_table for s in seqs)
    graphs = mtp.MTPGraphs(proposer, 4, llm.worker.kv.num_blocks - 1)
    tokens, logp = graphs.run(requests, 3)
    for i, (r, e) in enumerate(zip(requests, eager)):
        assert tokens[i, :r.num_drafts].tolist() == e.tokens
        assert logp[i, :r.num_drafts].tolist() == pytest.approx(e.confidence, abs=1e-5)
    assert set(graphs.graphs) == {(4, 3)}


def test_mtp_catch_up_graphs_write_what_the_eager_catch_up_writes(checkpoint, monkeypatch):
    """With MTP's captured catch-up (per batch bucket and rows per sequence, short sequences'
    padding rows and the padding sequences written into the spare block and stash row), the
    stash and MTP K/V equal the eager catch-up's: for rows of different lengths given directly,
    then while generating (same tokens and accepted drafts; a prompt, longer than the longest
    captured length, catches up eagerly)."""
    from metrale.cluster.params import SamplingParams
    from metrale.deploy.llm import LLM
    from metrale.drafting import mtp
    from metrale.drafting.proposer import CommittedRows
    if DEVICE == "cpu":
        monkeypatch.setattr(mtp, "capture", lambda step, pool: (_Replayed(step, out := step()), out))
    kw = dict(device=DEVICE, dtype="float32", block_size=4, attention_backend="triton",
              cuda_graphs=False, speculative_method="mtp", num_drafts=3, adaptive_drafts=False)
    eager, graphed = LLM(checkpoint("qwen3_5"), **kw), LLM(checkpoint("qwen3_5"), **kw)
    a, p = eager.worker.proposer, graphed.worker.proposer
    spare = graphed.worker.kv.num_blocks - 1
    p.graphs = mtp.MTPGraphs(p, 4, spare)
    p.graphs.capture_all(3)
    assert set(p.graphs.catch_ups) == {(b, n) for b in (1, 2, 4) for n in mtp.CATCH_UP_LENGTHS}
    replayed, catch_up = [], p.graphs.catch_up
    p.graphs.catch_up = lambda rows: replayed.append(catch_up(rows)) or replayed[-1]

    def same_state():
        assert a.stash_pos == p.stash_pos
        used = sorted({s for s, n in enumerate(p.stash_pos) if n})
        assert used and torch.allclose(a.stash[used], p.stash[used], atol=1e-5)
        assert torch.allclose(a.kv.k[:, :spare], p.kv.k[:, :spare], atol=1e-5)
        assert torch.allclose(a.kv.v[:, :spare], p.kv.v[:, :spare], atol=1e-5)

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(12, a.stash.shape[1], generator=gen).to(DEVICE)
    vocab = a.target.config.vocab_size
    for lengths, starts in (((3, 1, 2, 4), (5, 0, 9, 2)), ((2, 2, 1), (8, 1, 11))):
        rows, first = [], 0
        for slot, (n, start) in enumerate(zip(lengths, starts)):
            tokens = torch.randint(vocab, (n + 1,), generator=gen).tolist()
            rows.append(CommittedRows(slot, start, tokens[:n], tokens[1:], hidden, [],
                                      slice(first, first + n), [4 * slot + b for b in range(4)],
                                      False))
            first += n
        for proposer in (a, p):
            proposer._catch_up(rows)
        same_state()
    assert replayed == [True, True]
    prompts = ["def schedule(self, tokens):", "The café engine", "x",
               "a prompt of more rows than the longest captured catch-up takes"]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = [llm.generate(prompts, params) for llm in (eager, graphed)]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    assert [o.spec.drafts_accepted for o in outs[0]] == [o.spec.drafts_accepted for o in outs[1]]
    assert True in replayed[2:] and False in replayed[2:]   # rounds replayed, a prompt did not
    same_state()


@pytest.mark.parametrize("window", [2048, 4])
def test_dflash_fused_layers_draft_as_the_modules(checkpoint, dflash_drafter, window):
    """The drafter's fused path (q/k/v and gate/up GEMMs, norm kernels, the block's K/V written
    into the rings and attended there by the paged kernel) gives the block logits of its plain
    torch modules, over context windows filled by a few rounds; with a window of 4 the rings
    are full (the block then takes the ring's spare rows) and one has wrapped round. The block
    rows leave the context rows as they were, and a padding row on the spare slot drafts
    without touching a sequence's ring."""
    from metrale.cluster.params import SamplingParams
    from metrale.deploy.llm import LLM
    llm = LLM(checkpoint("qwen3_5"), device=DEVICE, dtype="float32", block_size=4,
              attention_backend="triton", cuda_graphs=False, speculative_method="dflash",
              drafter=dflash_drafter("qwen3_5"), num_drafts=3, adaptive_drafts=False,
              dflash_window=window)
    p = llm.worker.proposer
    assert all(hasattr(layer.self_attn, "qkv") for layer in p.drafter.layers)
    llm.generate(["def schedule(self, tokens):", "The café engine"],
                 SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    slots = [s for s, n in enumerate(p.seen) if n][:2]
    spare = p.ctx_k.shape[1] - 1
    lens = [p.window_rows(s) for s in slots]
    args = [torch.tensor(v, device=DEVICE) for v in
            (slots + [spare], [5, 7, 9], [p.seen[s] for s in slots] + [0], lens + [0])]
    context = [(p.ctx_k[:, s, :n].clone(), p.ctx_v[:, s, :n].clone()) for s, n in zip(slots, lens)]
    fused = p._block_logits(*args, p.window)
    for (k, v), s, n in zip(context, slots, lens):
        assert torch.equal(p.ctx_k[:, s, :n], k) and torch.equal(p.ctx_v[:, s, :n], v)
    for layer in p.drafter.layers:
        del layer.self_attn.qkv, layer.self_attn.kv, layer.mlp.gate_up
    plain = p._block_logits(*args, p.window)
    assert len(slots) == 2 and rel_err(fused, plain) < 1e-5
    assert (min(p.seen[s] for s in slots) > window) == (window == 4)


def _graph_path_on_cpu(monkeypatch) -> None:
    """On the CPU, workers take the graph path with each graph a _Replayed: every replay
    reruns the captured step (the Triton kernels under the interpreter)."""
    from metrale.drafting import dflash, mtp
    from metrale.workers import cuda_graphs, ssm_pool, worker
    for module in (cuda_graphs, ssm_pool, mtp, dflash):
        monkeypatch.setattr(module, "capture",
                            lambda step, pool: (_Replayed(step, out := step()), out))
    monkeypatch.setattr(worker, "graphs_replay_on", lambda device: True)


def _record_drafts(monkeypatch, method: str, drafted: dict) -> None:
    """Records each drafted block, by (slot, position of its pending token), into
    drafted["now"]: from MTP's draft chain or DFlash's block forward, which every round runs,
    chained or not."""
    from metrale.drafting import dflash, mtp
    if method == "mtp":
        owner, name, at = mtp.MTPGraphs, "draft_chain", lambda args: args[1] + 1
    else:
        owner, name, at = dflash.DFlashProposer, "_greedy", lambda args: args[2]
    real = getattr(owner, name)

    def recorded(self, *args):
        tokens, logp = real(self, *args)
        for slot, position, row in zip(args[0].tolist(), at(args).tolist(), tokens.tolist()):
            if position > 1:   # not a padding sequence's (at 0 or 1)
                drafted["now"].setdefault((slot, position), row)
        return tokens, logp
    monkeypatch.setattr(owner, name, recorded)


@pytest.mark.parametrize("method", ["mtp", "dflash"])
def test_chained_rounds_draft_what_rounds_one_by_one_draft(monkeypatch, method):
    """The bundled model's trained MTP layer or DFlash drafter on the graph path, its greedy
    rounds chained on the device (workers.chain: each round's catch-up writes what the next
    round drafts from, MTP's K/V and stash or DFlash's context window, all from device values)
    and one plan a round (chain_rounds 0): at every round of every sequence both draft the
    same tokens from the same position, and they emit the same tokens. (DFlash's window of 20
    rows fills within the prompt and rounds, so rows go into its ring in place of the oldest;
    a sequence that takes a seat another left starts its drafter state afresh.) On the CPU
    only: the drafts are read at each rerun of the step, which a CUDA graph's replay does not
    make."""
    if DEVICE != "cpu":
        pytest.skip("reads each round's drafts from the rerun step (a GPU replays graphs)")
    from metrale.cluster.params import SamplingParams
    from metrale.deploy.bundled import BUNDLED_DFLASH, BUNDLED_MODEL
    from metrale.deploy.gpubench import bundled_prompts
    from metrale.deploy.llm import LLM
    _graph_path_on_cpu(monkeypatch)
    drafted: dict = {}   # "now", and per chain_rounds: (slot, position) -> drafts
    _record_drafts(monkeypatch, method, drafted)
    # two seats for three prompts: the third takes a seat the first two leave, with a fresh
    # drafter state; its positions (from 48) are none of theirs (16.., past their ends by a
    # chain's rounds at most)
    seats = 2
    prompts = bundled_prompts(BUNDLED_MODEL, 2, 16) + bundled_prompts(BUNDLED_MODEL, 1, 48)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs, stats = {}, {}
    for rounds in (3, 0):
        drafted["now"] = drafted[rounds] = {}
        llm = LLM(str(BUNDLED_MODEL), device="cpu", dtype="float32", block_size=4,
                  attention_backend="triton", speculative_method=method, num_drafts=3,
                  drafter=str(BUNDLED_DFLASH) if method == "dflash" else None,
                  dflash_window=20, adaptive_drafts=False, max_num_seqs=seats,
                  chain_rounds=rounds, capture_at_start=False)
        assert llm.worker.graphs is not None and (llm.worker.chain is not None) == bool(rounds)
        chains, launch = [], llm.worker.chain.launch if rounds else None
        if rounds:   # (chains planned ahead go on from the one before: rows, no histories)
            llm.worker.chain.launch = lambda *a, **kw: chains.append(a[1]) or launch(*a, **kw)
        outs[rounds] = [o.token_ids for o in llm.generate(prompts, greedy)]
        stats[rounds] = llm.scheduler.stats
        assert bool(chains) == bool(rounds)
    assert outs[3] == outs[0]
    assert stats[0].drafts_accepted > 0
    # a chain runs on past a sequence's end, and near it one plan a round drafts fewer
    chained, alone = drafted[3], drafted[0]
    assert {slot for slot, at in chained if at >= 48} & {slot for slot, at in chained if at < 48}
    common = chained.keys() & alone.keys()
    assert len(common) >= len(alone) - 2 * len(prompts), (sorted(chained), sorted(alone))
    for key in common:
        n = min(len(chained[key]), len(alone[key]))
        assert chained[key][:n] == alone[key][:n], (key, chained, alone)


def test_ngram_chains_planned_ahead_go_on_from_the_device(monkeypatch, checkpoint):
    """On the graph path, a chain of greedy n-gram rounds planned before the last chain's
    result goes on from the history, cached length and pending token that chain left on the
    device (ChainRunner.resume), in the new plan's order (a sequence that ends, here at a
    shorter max_tokens, leaves a gap the others close up). The tokens are the hybrid target's
    plain greedy ones; so are those of chains of no drafts (k = 0 every other plan). On the
    CPU only, as the tests above (on a GPU, test_gpu's chained tests see chains resumed)."""
    if DEVICE != "cpu":
        pytest.skip("the graph path on the CPU (a GPU replays graphs)")
    import itertools
    from metrale.cluster.params import SamplingParams
    from metrale.deploy.llm import LLM
    _graph_path_on_cpu(monkeypatch)
    model_dir = checkpoint("qwen3_5")
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 3, 9, 3, 9], [11, 12, 13, 11, 12]]
    lengths = [10, 24, 20]   # the first (row 0) ends first, the others go on
    reference = LLM(model_dir, device="cpu", dtype="float32", block_size=4)
    expected = [reference.generate([p], SamplingParams(max_tokens=n, temperature=0,
                                                       ignore_eos=True))[0].token_ids
                for p, n in zip(prompts, lengths)]
    for ks in ([3], [0, 3]):
        llm = LLM(model_dir, device="cpu", dtype="float32", block_size=4,
                  attention_backend="triton", speculative_method="ngram", num_drafts=3,
                  max_num_seqs=4, chain_rounds=3, capture_at_start=False)
        assert llm.scheduler.plans_ahead
        cycle = itertools.cycle(ks)
        llm.scheduler.drafts.choose = lambda batch: next(cycle)
        rows, launch = [], llm.worker.chain.launch
        llm.worker.chain.launch = lambda *a, **kw: rows.append(kw.get("rows")) or launch(*a, **kw)
        outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0,
                                                     ignore_eos=True) for n in lengths])
        assert [o.token_ids for o in outs] == expected, ks
        resumed = [r for r in rows if r is not None]
        assert len(resumed) >= 2 and [1, 2] in resumed, rows   # row 0 left


def test_a_chain_launched_ahead_of_sequences_that_finished_is_read_at_the_next_launch(
        monkeypatch, checkpoint):
    """Once every request has finished, `LLM.step` does not wait for a chain launched ahead of
    sequences that the chain before it ended (here at a stop token, met while the chain after
    it was planned and launched): `generate` returns with that chain unread, and the worker
    reads it before its next launch. Each request, run one after another, still gets the
    hybrid target's plain greedy tokens up to its stop token."""
    from metrale.cluster.params import SamplingParams
    from metrale.deploy.llm import LLM
    if DEVICE == "cpu":
        _graph_path_on_cpu(monkeypatch)
    model_dir = checkpoint("qwen3_5")
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 3, 9, 3, 9], [11, 12, 13, 11, 12]]
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    reference = LLM(model_dir, device=DEVICE, dtype="float32", block_size=4)
    expected = [o.token_ids for o in reference.generate(prompts, greedy)]
    llm = LLM(model_dir, device=DEVICE, dtype="float32", block_size=4, attention_backend="triton",
              speculative_method="ngram", num_drafts=3, adaptive_drafts=False, max_num_seqs=2,
              chain_rounds=3, capture_at_start=False)
    assert llm.worker.chain is not None
    unread = []
    for prompt, tokens in zip(prompts, expected):
        stop = tokens.index(tokens[7])
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                stop_token_ids=(tokens[7],))
        out = llm.generate([prompt], params)[0]
        assert out.token_ids == tokens[:stop + 1] and out.finish_reason == "stop"
        unread.append(len(llm.worker._flying))
    assert any(unread), unread


@pytest.mark.parametrize("method", ["mtp", "dflash", "ngram"])
def test_chains_without_drafts_feed_the_drafter_as_steps_one_by_one_do(monkeypatch, method):
    """Where the draft policy chooses k = 0 (here every other plan, from the first), a graph
    worker chains plain decode steps on the device, each feeding the trained MTP layer or
    DFlash drafter from the step's own device values (`round_commit`), as the host feeds it
    after steps run one by one (`_execute_steps`). The chains of drafts after them draft the
    same tokens at every round of every sequence (n-gram: the history on the device grows by
    each step's token, and the tokens are the same). On the CPU only, as the test above."""
    if DEVICE != "cpu":
        pytest.skip("reads each round's drafts from the rerun step (a GPU replays graphs)")
    import itertools
    from metrale.cluster.params import SamplingParams
    from metrale.deploy.bundled import BUNDLED_DFLASH, BUNDLED_MODEL
    from metrale.deploy.gpubench import bundled_prompts
    from metrale.deploy.llm import LLM
    from metrale.workers.worker import Worker
    _graph_path_on_cpu(monkeypatch)
    drafted: dict = {}
    if method != "ngram":
        _record_drafts(monkeypatch, method, drafted)
    prompts = bundled_prompts(BUNDLED_MODEL, 2, 16)
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs, plain = {}, {}
    for on_device in (True, False):
        if not on_device:   # plain steps of a plan run one by one, fed from the host
            monkeypatch.setattr(Worker, "_chains", lambda self, work: any(
                w.num_drafts or w.pad_to for w in work))
        drafted["now"] = drafted[on_device] = {}
        llm = LLM(str(BUNDLED_MODEL), device="cpu", dtype="float32", block_size=4,
                  attention_backend="triton", speculative_method=method, num_drafts=3,
                  drafter=str(BUNDLED_DFLASH) if method == "dflash" else None,
                  dflash_window=20, max_num_seqs=2, chain_rounds=3, capture_at_start=False)
        ks = itertools.cycle([0, 3])
        llm.scheduler.drafts.choose = lambda batch: next(ks)
        lengths, launch = [], llm.worker.chain.launch
        llm.worker.chain.launch = lambda layout, *a, **kw: (lengths.append(layout.uniform_length)
                                                            or launch(layout, *a, **kw))
        outs[on_device] = [o.token_ids for o in llm.generate(prompts, greedy)]
        plain[on_device] = lengths.count(1)
    assert outs[True] == outs[False]
    assert plain[True] >= 2 and plain[False] == 0   # chains of plain steps ran on the device
    if method != "ngram":   # (9 rounds of drafts here for DFlash: 2 sequences, 16 tokens)
        assert len(drafted[True]) >= 8, drafted[True]
        assert drafted[True] == drafted[False]

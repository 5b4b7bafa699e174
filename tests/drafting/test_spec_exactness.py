"""Speculation is lossless: greedy output with every proposer equals greedy output without one."""

from __future__ import annotations

import functools
import itertools
import random

import pytest

import checkpoints
from conftest import (PROMPTS, assert_stats_count_what_was_kept, assert_stops_where_first_met,
                      run_with_arrivals)
from metrale.cluster.params import SamplingParams
from metrale.drafting.proposer import Proposal
from metrale.deploy.llm import LLM
from metrale.workers.ssm_pool import SSMSlotPool

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
CASES = [(m, name) for m in ("mtp", "dflash", "ngram", "self")
         for name in ("qwen3", "qwen3_5", "qwen3_5-vl") if not (m == "mtp" and name == "qwen3")]


def reference(model_dir, prompts, n=40):
    return [checkpoints.reference_greedy(model_dir, p, n) for p in prompts]


def entry_bytes(llm_kw, model_dir) -> int:
    """Bytes of one verify-pool entry (one slot's linear-attention state); 0 without SSM layers."""
    return _entry_bytes(str(model_dir), tuple(sorted(llm_kw.items())))


@functools.cache   # an engine built only to read a size: once per checkpoint and options
def _entry_bytes(model_dir: str, llm_kw: tuple) -> int:
    probe = LLM(model_dir, device="cpu", speculative_method="ngram",
                **{**dict(llm_kw), "max_num_seqs": 1})
    return probe.worker.ssm.slot_bytes if probe.worker.ssm else 0


@pytest.mark.parametrize("method, name", CASES)
@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_speculation_is_exact(checkpoint, dflash_drafter, method, name, k):
    model_dir = checkpoint(name)
    kw = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=24)
    per_entry = entry_bytes(kw, model_dir)
    # Verify pools for about 2 full-depth slots: the others get less (or no) capacity.
    pool = dict(verify_pool_bytes=per_entry * (2 * (k + 1) + 2)) if per_entry else {}
    llm = LLM(model_dir, device="cpu", speculative_method=method, num_drafts=k,
              adaptive_drafts=False,
              drafter=dflash_drafter(name, block_size=k + 1) if method == "dflash" else None,
              kv_cache_bytes=40 * _kv_block_bytes(model_dir), **kw, **pool)
    if per_entry:
        caps = llm.worker.capacity.slot_capacity
        assert max(caps) == k and min(caps) < k, caps
    prompts = [llm.encode(p) for p in PROMPTS]
    outs = run_with_arrivals(llm, {0: prompts[:2], 2: prompts[2:3], 5: prompts[3:]}, GREEDY)
    assert [o.token_ids for o in outs] == reference(model_dir, prompts)
    assert llm.scheduler.stats.rounds > 0
    assert llm.scheduler.num_preemptions > 0


@functools.cache   # once per checkpoint
def _kv_block_bytes(model_dir) -> int:
    probe = LLM(model_dir, device="cpu", block_size=4, max_num_seqs=1)
    return probe.worker.kv.k[:, 0].nbytes * 2


class OracleProposer:
    """Drafts the true greedy continuation, corrupted at a random position half of the time, so
    rounds accept every possible number of drafts."""
    method, capture_layers, fixed_drafts, keeps_row_state, max_batch = "oracle", (), None, False, 64

    def __init__(self, full_sequences: list[list[int]], seed: int = 0):
        self.full, self.rng = full_sequences, random.Random(seed)

    def propose(self, requests):
        out = []
        for r in requests:
            seq = next(s for s in self.full if s[:len(r.history)] == r.history)
            drafts = seq[len(r.history):len(r.history) + r.num_drafts]
            if self.rng.random() < 0.25:   # fewer drafts than asked for
                drafts = drafts[:self.rng.randrange(r.num_drafts)]
            if drafts and self.rng.random() < 0.5:
                i = self.rng.randrange(len(drafts))
                drafts = drafts[:i] + [(drafts[i] + 1) % 300] + drafts[i + 1:]
            out.append(Proposal(drafts))
        return out

    def commit(self, rows):
        pass


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5", "qwen3_5-vl"])
@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("pad", [False, True], ids=["ragged", "padded"])
def test_every_acceptance_length_commits_exactly(checkpoint, name, k, pad):
    """Padded: a sequence given fewer drafts than planned verifies filler rows (as on the GPU,
    where that keeps rounds on their CUDA graph); the filler is never accepted."""
    model_dir = checkpoint(name)
    llm = LLM(model_dir, device="cpu", block_size=4, speculative_method="ngram", num_drafts=k,
              adaptive_drafts=False, max_num_batched_tokens=16, pad_drafts=pad)
    prompts = [llm.encode(p) for p in PROMPTS]
    refs = reference(model_dir, prompts)
    llm.worker.proposer = OracleProposer([p + r for p, r in zip(prompts, refs)])
    depths, execute = [], llm.worker.execute

    def recorded(plan):   # the draft rows of each round where every sequence decodes (one
        # output token pends; a prompt's last token is a prefill's, and gets no drafts)
        if plan.work and all(w.decodes and w.sample for w in plan.work):
            depths.append({max(w.num_drafts, w.pad_to) for w in plan.work})
        return execute(plan)
    llm.worker.execute = recorded
    outs = run_with_arrivals(llm, {0: prompts[:3], 4: prompts[3:]}, GREEDY)
    assert [o.token_ids for o in outs] == refs
    if pad:   # rounds near max_tokens give sequences fewer drafts; filler evens them out
        assert all(len(d) == 1 for d in depths), depths
    if pad and k > 1:
        assert any(d != {k} for d in depths)
    stats = llm.scheduler.stats
    assert stats.drafts_accepted > 0 and stats.mean_acceptance_length > 1.25
    if k > 1:
        assert 0 < stats.accepted_at[-1] < stats.proposed_at[-1]


def _chained_arrivals(llm, model_dir) -> tuple[list[int], list, list]:
    """The prompts arriving over a few steps on an engine that chains 3 rounds: the greedy
    tokens are transformers', chains of 3 (and of 2 where max_tokens leaves fewer) ran, and
    blocks ran short. Returns the chains' round counts (recorded on), prompts and tokens."""
    chains, execute = [], llm.worker._execute_chain

    def recorded(plan):
        chains.append(plan.work[0].steps)
        return execute(plan)
    llm.worker._execute_chain = recorded
    prompts = [llm.encode(p) for p in PROMPTS]
    refs = reference(model_dir, prompts)
    outs = run_with_arrivals(llm, {0: prompts[:2], 2: prompts[2:3], 5: prompts[3:]}, GREEDY)
    assert [o.token_ids for o in outs] == refs
    assert_stats_count_what_was_kept(outs)
    assert chains and set(chains) <= {2, 3} and 3 in chains
    assert llm.scheduler.num_preemptions > 0
    return chains, prompts, refs


@pytest.mark.parametrize("method, name", [("ngram", "qwen3"), ("ngram", "qwen3_5"),
                                          ("mtp", "qwen3_5"), ("dflash", "qwen3_5")])
@pytest.mark.parametrize("pad", [False, True], ids=["ragged", "padded"])
def test_chained_rounds_are_exact(checkpoint, dflash_drafter, method, name, pad):
    """Greedy n-gram, MTP and DFlash rounds chained on the device (Worker._execute_chain; on
    the CPU an n-gram round reads its drafts back to lay out its forward, and MTP and DFlash
    rounds run one by one)
    emit transformers' greedy tokens: with arrivals, preemption for blocks, chains cut short by
    max_tokens, and sequences that end inside a chain on a stop token. Sampled sequences are
    never chained."""
    model_dir = checkpoint(name)
    kw = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=24)
    llm = LLM(model_dir, device="cpu", speculative_method=method, num_drafts=3,
              adaptive_drafts=False, kv_cache_bytes=40 * _kv_block_bytes(model_dir),
              chain_rounds=3, pad_drafts=pad,
              drafter=dflash_drafter(name) if method == "dflash" else None, **kw)
    assert llm.worker.capacity.chain_rounds == 3
    chains, prompts, refs = _chained_arrivals(llm, model_dir)
    stats = llm.scheduler.stats
    assert stats.rounds >= len(chains) and stats.drafts_accepted < stats.drafts_proposed
    if method == "ngram":   # (random MTP and DFlash layers draft no token the target takes)
        assert stats.drafts_accepted > 0
    assert_stops_where_first_met(llm, prompts, refs, 9)
    chains.clear()
    llm.generate(prompts[:2], SamplingParams(max_tokens=12, temperature=0.8, seed=3))
    assert not chains


@pytest.mark.parametrize("method, name", [("ngram", "qwen3_5"), ("mtp", "qwen3_5"),
                                          ("dflash", "qwen3_5")])
def test_chains_without_drafts_are_exact(checkpoint, dflash_drafter, method, name):
    """Where the draft policy chooses k = 0, the plan chains plain decode steps (depth 0),
    which feed the drafter as verifies do, so a chain of drafts after them drafts from every
    token: the policy here alternates 3 and 0 plan by plan, and the tokens are transformers'
    greedy ones."""
    model_dir = checkpoint(name)
    llm = LLM(model_dir, device="cpu", speculative_method=method, num_drafts=3,
              block_size=4, max_num_seqs=4, max_num_batched_tokens=24, chain_rounds=3,
              drafter=dflash_drafter(name) if method == "dflash" else None)
    ks = itertools.cycle([3, 0])
    llm.scheduler.drafts.choose = lambda batch: next(ks)
    chains, execute = [], llm.worker._execute_chain

    def recorded(plan):
        chains.append((max(w.num_drafts for w in plan.work), plan.work[0].steps))
        return execute(plan)
    llm.worker._execute_chain = recorded
    prompts = [llm.encode(p) for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == reference(model_dir, prompts, 20)
    assert (0, 3) in chains and (3, 3) in chains, chains


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5"])
def test_plain_decode_steps_chained_are_exact(checkpoint, name):
    """Without a proposer, `chain_rounds` chains greedy decode steps as rounds of depth 0: with
    arrivals, preemption for blocks, chains cut short by max_tokens and sequences that stop
    inside a chain, the tokens are transformers' greedy ones. A plan with a sampled sequence
    in it runs its steps one by one; and without `chain_rounds` plain decoding on the CPU (no
    CUDA graphs) chains nothing."""
    model_dir = checkpoint(name)
    kw = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=24,
              kv_cache_bytes=40 * _kv_block_bytes(model_dir))
    assert LLM(model_dir, device="cpu", **kw).worker.capacity.chain_rounds == 0
    llm = LLM(model_dir, device="cpu", chain_rounds=3, **kw)
    assert llm.worker.capacity.chain_rounds == 3
    chains, prompts, refs = _chained_arrivals(llm, model_dir)
    assert_stops_where_first_met(llm, prompts, refs, 9)
    chains.clear()
    outs = llm.generate(prompts[:2], [SamplingParams(max_tokens=12, temperature=0,
                                                     ignore_eos=True),
                                      SamplingParams(max_tokens=12, temperature=0.8, seed=3)])
    assert outs[0].token_ids == refs[0][:12] and not chains


@pytest.mark.parametrize("method", ["mtp", "dflash"])
def test_a_prompt_of_one_token_is_not_chained(checkpoint, dflash_drafter, method):
    """A prompt of one token pends one token, as a decoding sequence does, but it has no row
    before it for a drafter to draft from: its first step (the prefill) runs alone, never as
    a chain's round of depth 0 (a chain on a graph worker asserted), and the draft policy
    does not take its step's time for a decode round's. Here it arrives alone and beside
    sequences decoding, the policy choosing k = 0 throughout; tokens are greedy."""
    model_dir = checkpoint("qwen3_5")
    llm = LLM(model_dir, device="cpu", speculative_method=method, num_drafts=3, block_size=4,
              max_num_seqs=4, max_num_batched_tokens=16, chain_rounds=3,
              drafter=dflash_drafter("qwen3_5") if method == "dflash" else None)
    llm.scheduler.drafts.choose = lambda batch: 0
    chained, execute = [], llm.worker._execute_chain

    def recorded(plan):
        chained.extend((w.context_len, w.prompt_len) for w in plan.work)
        return execute(plan)
    llm.worker._execute_chain = recorded
    timed, last, run, record_cost = [], [], llm.worker.execute, llm.scheduler.drafts.record_cost
    llm.worker.execute = lambda plan: last.append(plan) or run(plan)
    llm.scheduler.drafts.record_cost = lambda *a: (
        timed.extend((w.context_len, w.prompt_len) for w in last[-1].work) or record_cost(*a))
    prompts = [llm.encode(p) for p in ["x", "def schedule(self, tokens):"]]
    assert len(prompts[0]) == 1
    for batch in ([prompts[0]], prompts, prompts[::-1]):
        outs = llm.generate(batch, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        assert [o.token_ids for o in outs] == reference(model_dir, batch, 12)
    assert chained and all(context >= prompt for context, prompt in chained), chained
    assert timed and all(context >= prompt for context, prompt in timed), timed


def test_plain_steps_chain_only_when_greedy_and_as_many_for_every_sequence(checkpoint):
    """A plan of several steps without drafts is a chain of depth 0 on a worker that chains, if
    every sequence decodes greedily for the same number of steps (a chain runs one count for
    all, and writes rows for all of them); otherwise its steps run one by one."""
    from metrale.cluster.plan import SeqWork
    from metrale.workers.sampler import SamplingSpec
    llm = LLM(checkpoint("qwen3_5"), device="cpu", speculative_method="mtp", num_drafts=3,
              chain_rounds=3)
    greedy, sampled = SamplingSpec(0.0, 1.0, 0, 0.0, 1, 0), SamplingSpec(0.8, 1.0, 0, 0.0, 1, 0)
    work = [SeqWork(i, [5], 8, [i], i, greedy, steps=3) for i in range(2)]
    chains = llm.worker._chains
    assert chains(work)
    assert not chains([work[0], SeqWork(1, [5], 8, [1], 1, greedy, steps=2)])
    assert not chains([work[0], SeqWork(1, [5], 8, [1], 1, sampled, steps=3)])
    assert chains([work[0], SeqWork(1, [5], 8, [1], 1, sampled, num_drafts=2, steps=3)])
    plain = LLM(checkpoint("qwen3_5"), device="cpu", speculative_method="mtp", num_drafts=3,
                chain_rounds=0)
    assert not plain.worker._chains(work)


def test_chains_stop_at_the_context_and_skip_logprobs(checkpoint):
    """A chain never writes past the context (its rounds are cut to what max_model_len leaves),
    and requests asking for logprobs run one round per plan; both keep the greedy tokens."""
    model_dir = checkpoint("qwen3_5")
    llm = LLM(model_dir, device="cpu", speculative_method="ngram", num_drafts=3,
              adaptive_drafts=False, block_size=4, max_model_len=48, chain_rounds=4,
              pad_drafts=True)
    chains, execute = [], llm.worker._execute_chain

    def recorded(plan):   # the end of the rows the chain may write
        depth = max(max(w.num_drafts, w.pad_to) for w in plan.work)
        chains.append(max(w.context_len for w in plan.work) + plan.work[0].steps * (depth + 1))
        return execute(plan)
    llm.worker._execute_chain = recorded
    prompt = llm.encode(PROMPTS[0])
    ref = reference(model_dir, [prompt], 48 - len(prompt))[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    assert out[0].token_ids == ref[:48 - len(prompt)]
    assert chains and max(chains) <= 48, chains
    chains.clear()
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                logprobs=1))
    assert out[0].token_ids == ref[:12] and not chains


@pytest.mark.parametrize("rounds", [-1, 65])
def test_chain_rounds_out_of_range_are_refused(checkpoint, rounds):
    with pytest.raises(ValueError, match=f"chain_rounds must be 0 to 64, not {rounds}"):
        LLM(checkpoint("qwen3"), device="cpu", speculative_method="ngram", chain_rounds=rounds)


def test_round_k_is_the_minimum_capacity_without_ragged_drafts(checkpoint):
    import dataclasses
    model_dir = checkpoint("qwen3_5")
    per_entry = entry_bytes(dict(block_size=4), model_dir)
    llm = LLM(model_dir, device="cpu", block_size=4, speculative_method="self", num_drafts=3,
              adaptive_drafts=False, max_num_seqs=3, verify_pool_bytes=per_entry * 6)
    assert llm.worker.capacity.slot_capacity == (3, 1, 0)
    llm.scheduler.capacity = dataclasses.replace(llm.scheduler.capacity, ragged_drafts=False)
    for p in PROMPTS[:3]:
        llm.add_request(llm.encode(p), GREEDY)
    seen = []
    while llm.scheduler.has_work:
        plan = llm.scheduler.schedule()
        seen.append({w.slot: w.num_drafts for w in plan.work if w.sample})
        llm.scheduler.update(plan, llm.worker.execute(plan))
    # Slots that can speculate share the smallest of their capacities; slot 2 (capacity 0) decodes
    # without drafts and does not hold the others back.
    both = [s for s in seen if s.get(0) and s.get(1)]
    assert both and all(s[0] == s[1] == 1 and s.get(2, 0) == 0 for s in both), both
    assert any(s.get(0) == 3 for s in seen)                 # alone, slot 0 gets its full depth


def test_ragged_drafts_respect_each_slot(checkpoint):
    model_dir = checkpoint("qwen3_5")
    per_entry = entry_bytes(dict(block_size=4), model_dir)
    llm = LLM(model_dir, device="cpu", block_size=4, speculative_method="self", num_drafts=3,
              adaptive_drafts=False, max_num_seqs=3, verify_pool_bytes=per_entry * 6)
    for p in PROMPTS[:3]:
        llm.add_request(llm.encode(p), GREEDY)
    caps = llm.worker.capacity.slot_capacity
    while llm.scheduler.has_work:
        plan = llm.scheduler.schedule()
        assert all(w.num_drafts <= caps[w.slot] for w in plan.work)
        llm.scheduler.update(plan, llm.worker.execute(plan))
    report = llm.worker.memory_report()
    assert report["slot_capacity"] == [3, 1, 0]
    assert report["verify_pool_bytes_per_slot"] == [4 * per_entry, 2 * per_entry, 0]


def test_drafts_above_every_capacity_are_clamped_with_a_warning(checkpoint, caplog):
    model_dir = checkpoint("qwen3_5")
    llm = LLM(model_dir, device="cpu", speculative_method="ngram", num_drafts=6, max_drafts=2)
    assert llm.scheduler.num_drafts == 2
    assert "exceeds every slot's verify capacity" in caplog.text
    out = llm.generate([PROMPTS[0]], GREEDY)[0]
    assert out.token_ids == reference(model_dir, [llm.encode(PROMPTS[0])])[0]


def test_verify_pool_capacities_from_a_budget():
    from metrale.workers.ssm_pool import verify_capacities
    assert verify_capacities(4, 3, 100) == [3, 3, 3, 3]
    assert verify_capacities(4, 3, 10) == [3, 3, 1, 0]
    assert verify_capacities(3, 3, 1) == [0, 0, 0]
    pool = SSMSlotPool(1, 3, 4, 4, 2, 2, 2, __import__("torch").float32, "cpu", [3, 1, 0])
    assert pool.offset == [0, 4, 6] and pool.verify_state.shape[1] == 6


@pytest.mark.parametrize("pad", [False, True], ids=["ragged", "padded"])
def test_drafts_left_on_the_device_verify_as_drafts_read_first(checkpoint, dflash_drafter, pad):
    """DFlash's drafts stay on the device until the verdicts (the worker writes them into the
    verify's input ids there): greedy and seeded sampled outputs, and every round's acceptance,
    equal those of the same engine reading its drafts on the host before the verify."""
    name = "qwen3_5"
    params = [GREEDY, SamplingParams(max_tokens=40, temperature=0.8, seed=5, ignore_eos=True),
              GREEDY, SamplingParams(max_tokens=40, temperature=1.0, top_k=20, seed=9,
                                     ignore_eos=True)]
    prompts = PROMPTS[:4]
    runs = {}
    for where in ("device", "host"):
        llm = LLM(checkpoint(name), device="cpu", block_size=4, max_num_seqs=4,
                  speculative_method="dflash", drafter=dflash_drafter(name), num_drafts=3,
                  adaptive_drafts=False, pad_drafts=pad)
        proposer, used = llm.worker.proposer, []
        if where == "host":
            proposer.propose_on_device = lambda requests: None
        else:
            on_device, host = proposer.propose_on_device, proposer.propose

            def counted(requests):
                used.append(len(requests))
                return on_device(requests)
            proposer.propose_on_device = counted
            proposer.propose = lambda requests: pytest.fail("drafts were read on the host")
        outs = llm.generate(prompts, params)
        stats = llm.scheduler.stats
        runs[where] = ([o.completions[0].token_ids for o in outs],
                       stats.accepted_at, stats.proposed_at, used)
        first_prompt = outs[0].prompt_token_ids
    device, host = runs["device"], runs["host"]
    assert device[0] == host[0]
    assert device[0][0] == checkpoints.reference_greedy(checkpoint(name), first_prompt, 40)
    assert device[1:3] == host[1:3] and sum(device[1]) > 0
    assert device[3] and not host[3]

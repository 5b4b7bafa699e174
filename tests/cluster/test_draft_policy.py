"""Adaptive draft length: the policy picks each round's k from acceptance and step costs it is
given (injected here, never timed), explores back after choosing 0, and only changes speed."""

from __future__ import annotations

import random

import pytest

from conftest import PROMPTS
from metrale.cluster.draft_policy import (DECAY, PROBE_EVERY, PROBE_MOST, DraftPolicy,
                                          StepCost)
from metrale.cluster.params import SamplingParams
from metrale.cluster.plan import AHEAD, SeqOutcome, StepResult, WorkerCapacity
from metrale.cluster.scheduler import Scheduler, SchedulerConfig
from metrale.deploy.llm import LLM, load_tokenizer


def cheap_verify(batch, k):
    """(propose, forward) seconds of a small batch on a GPU: extra verify rows cost little."""
    return 0.0003 * k, 0.010 + 0.0002 * k


def verify_by_rows(batch, k):
    """A large batch (or a CPU): the forward's time grows with every row it verifies."""
    return 0.0001 * batch * k, 0.0005 * batch * (k + 1)


def accepted_of(k, accept, rng):
    """Drafts accepted of k, each with probability `accept` once those before it were."""
    j = 0
    while j < k and rng.random() < accept:
        j += 1
    return j


def simulate(policy, rounds, batch, accept, cost, rng):
    """`rounds` rounds of `batch` sequences that accept each draft with probability `accept`,
    each round taking cost(batch, k); returns the ks the policy chose, each with whether it was
    a probe."""
    ks = []
    for _ in range(rounds):
        k = policy.choose(batch)
        ks.append((k, policy.probed))
        policy.record_acceptance([(k, accepted_of(k, accept, rng)) for _ in range(batch)])
        policy.record_cost(batch, batch * k, *cost(batch, k))
    return ks


def without_probes(ks):
    return [k for k, probe in ks if not probe]


def probe_rounds(ks):
    return [(i, k) for i, (k, probe) in enumerate(ks) if probe]


def test_no_drafts_when_none_are_accepted():
    policy = DraftPolicy(6)
    ks = simulate(policy, 80, 8, 0.0, cheap_verify, random.Random(0))
    assert ks[0] == (6, False)                            # nothing measured yet: the most
    assert policy.best(8) == 0
    assert set(without_probes(ks)[-40:]) == {0}
    probes = probe_rounds(ks)
    assert {k for _, k in probes[2:]} == {1}                  # still trying 1 now and then...
    gaps = [b - a for (a, _), (b, _) in zip(probes, probes[1:])]
    assert gaps[0] == PROBE_EVERY and gaps[-1] > gaps[0] and gaps == sorted(gaps)  # ...less often
    assert policy.acceptance_at()[0] < 0.05
    assert policy.costs[8][6].samples == 1     # not measured again: free drafts would not win


def test_one_slow_round_does_not_rule_a_k_out():
    """The first round of K measured (after its warm-up) stalls at five times its cost, so K
    looks worse than 0 at first: probes measure it again until its median holds, and K wins.
    At 0.9 acceptance K and K - 1 are within 1% of each other, so an unlucky draw of accepted
    drafts can make K - 1 win: of 20 draws, K must win at least 17."""
    wins = 0
    for seed in range(20):
        stalls = iter([True])

        def stalled_at_first(batch, k):
            propose, forward = cheap_verify(batch, k)
            return propose, forward * (5 if k == 6 and next(stalls, False) else 1)
        policy = DraftPolicy(6)
        first = policy.choose(1)
        policy.record_cost(1, first, *cheap_verify(1, first))   # K's warm-up, not measured
        ks = simulate(policy, 60, 1, 0.9, stalled_at_first, random.Random(seed))
        assert ks[0] == (6, False) and ks[1][0] != 6               # the stall counted at first...
        cost = policy.costs[1][6]
        assert cost.settled and cost.seconds == pytest.approx(sum(cheap_verify(1, 6)))  # ...not now
        wins += policy.best(1) == 6 and set(without_probes(ks)[-30:]) == {6}
    assert wins >= 17


def test_probes_back_off_to_the_slowest_rate_while_they_confirm_the_best_k():
    policy = DraftPolicy(4)
    ks = simulate(policy, 400, 8, 0.0, cheap_verify, random.Random(0))
    probes = probe_rounds(ks)
    assert probes[-1][0] - probes[-2][0] == PROBE_MOST
    assert len(probes) < 400 / PROBE_EVERY / 3


def test_most_drafts_when_acceptance_is_high_and_verify_cheap():
    policy = DraftPolicy(6)
    ks = simulate(policy, 80, 8, 0.9, cheap_verify, random.Random(0))
    assert policy.best(8) == 6
    assert set(without_probes(ks)[-40:]) == {6}
    assert policy.acceptance_at()[0] == pytest.approx(0.9, abs=0.1)


def test_costly_verify_at_a_large_batch_turns_speculation_off_there_only():
    policy, rng = DraftPolicy(4), random.Random(0)
    for _ in range(60):
        simulate(policy, 1, 1, 0.8, cheap_verify, rng)
        simulate(policy, 1, 64, 0.8, verify_by_rows, rng)
    # Each row verified costs as much as a decoded one, so no k beats plain decoding at 64.
    assert policy.best(64) == 0
    assert policy.best(1) == 4
    state = policy.as_dict()
    assert set(state["step_ms_by_batch"]) == {1, 64}
    assert state["step_ms_by_batch"][64][0] == {"propose": 0.0, "forward": 32.0, "rounds": 51}


def test_speculation_comes_back_when_acceptance_recovers():
    policy, rng = DraftPolicy(4), random.Random(0)
    simulate(policy, 200, 8, 0.0, cheap_verify, rng)
    assert policy.best(8) == 0
    ks = simulate(policy, 200, 8, 0.9, cheap_verify, rng)
    assert policy.best(8) == 4
    assert set(without_probes(ks)[-100:]) == {4}


def block_drafter(batch, k):
    """A drafter that proposes its block in one forward (DFlash): 1 draft costs what 7 do, so
    k = 1 loses to plain decoding at any acceptance, while k = 7 wins at a high one."""
    return (0.0006 if k else 0.0), 0.0005 + 0.00003 * k


@pytest.mark.parametrize("seed", range(5))
def test_drafting_comes_back_after_a_bad_stretch_when_only_deep_drafts_pay(seed):
    """Drafts fail for 20 rounds, then nearly all are accepted (the bench's bundled model under
    DFlash at batch 1 on the H200: k = 0 for 37 rounds of 54). Probes from k = 0 of k = 1 alone
    never win back (k = 1 costs more than it yields) and never measure the deeper positions; the
    policy was stuck at 0 for all 120 rounds. Probing the best-rated k above 0, and probing again
    while probes accept more than the estimates expect, brings k = 7 back."""
    policy, rng = DraftPolicy(7), random.Random(seed)
    simulate(policy, 20, 1, 0.3, block_drafter, rng)
    assert policy.best(1) == 0
    ks = simulate(policy, 120, 1, 0.95, block_drafter, rng)
    assert policy.best(1) == 7
    chosen = without_probes(ks)
    back = chosen.index(7)
    assert back < 60 and set(chosen[back:]) == {7}


def test_probes_from_zero_follow_each_other_only_while_they_beat_the_estimates():
    """No draft is ever accepted: a probe from 0 is never followed at once by another, and the
    wait between probes grows as before."""
    policy = DraftPolicy(7)
    ks = simulate(policy, 300, 1, 0.0, block_drafter, random.Random(0))
    probes = probe_rounds(ks)
    gaps = [b - a for (a, _), (b, _) in zip(probes, probes[1:])]
    assert min(gaps) == PROBE_EVERY and gaps[-1] == PROBE_MOST


def test_a_stalled_first_round_without_drafts_is_measured_again_far_from_k_0():
    """At batch 32 the one round of k = 0 measured stalled at five times its cost (the bench's
    DFlash run: 1.40 ms against 0.72 for plain decoding's steps), so k = 7 looked best, and
    probes, which try the best k's neighbours, never reached 0 again. A round without drafts
    at batch 8 took 0.5 ms, so k = 0 could win at 32: it is measured again, and wins."""
    policy = DraftPolicy(7)
    for _ in range(2):                       # a warm-up, then a measured round, of each
        policy.record_cost(8, 0, 0.0, 0.0005)
        policy.record_cost(32, 0, 0.0, 0.0025)
    ks = simulate(policy, 200, 32, 0.5, block_drafter, random.Random(0))
    assert policy.costs[32][0].settled
    assert policy.costs[32][0].seconds == pytest.approx(sum(block_drafter(32, 0)))
    assert policy.best(32) == 0 and set(without_probes(ks)[-100:]) == {0}


def test_the_estimates_follow_the_sequences_left_when_a_batch_ends():
    """A batch of 32 accepts most drafts; its last 2 sequences (those whose drafts fail finish
    last) accept none. The bench's DFlash run at B=32 spent 40 rounds of batch 2 and 1 at k = 7
    this way, at twice a round without drafts: the history faded per step, so 20 steps of 32
    sequences outweighed them. Faded per draft seen, it turns to k = 0 within 15 rounds."""
    policy, rng = DraftPolicy(7), random.Random(0)
    simulate(policy, 20, 32, 0.8, block_drafter, rng)
    simulate(policy, 1, 2, 0.0, block_drafter, rng)   # the first round of batch 2: k = 7's warm-up
    ks = without_probes(simulate(policy, 40, 2, 0.0, block_drafter, rng))
    assert ks[0] == 7 and 0 in ks[:15] and set(ks[-20:]) == {0}


def test_acceptance_counts_a_position_only_when_the_drafts_before_it_were_accepted():
    policy = DraftPolicy(3)
    policy.record_acceptance([(3, 0), (3, 1), (3, 3), (1, 1), (0, 0)])
    assert policy.tried == [4, 2, 1]
    assert policy.accepted == [3, 1, 1]
    policy.record_acceptance([(2, 1)])   # the history fades per draft tried at each position
    assert policy.tried == pytest.approx([DECAY * 4 + 1, DECAY * 2 + 1, 1])
    assert policy.accepted == pytest.approx([DECAY * 3 + 1, DECAY * 1, 1])


def test_expected_tokens_and_step_time_estimates():
    policy = DraftPolicy(3)
    policy.tried, policy.accepted = [1e9] * 3, [0.8e9, 0.5e9, 0.0]
    assert policy.expected_tokens(0) == 1
    assert policy.expected_tokens(3) == pytest.approx(1 + 0.8 + 0.4 + 0)
    table = {0: StepCost(0.0, 0.010), 4: StepCost(0.002, 0.016)}
    assert DraftPolicy.step_seconds(table, 2) == pytest.approx(0.014)     # between: the line
    one = {2: StepCost(0.001, 0.008)}
    assert DraftPolicy.step_seconds(one, 0) == pytest.approx(0.003)       # below: by rows
    assert DraftPolicy.step_seconds(one, 5) == pytest.approx(0.009)       # above: as if free


def test_a_ks_first_round_is_a_warm_up_and_a_stall_is_clipped_then_outvoted():
    policy = DraftPolicy(2)
    policy.record_cost(1, 2, 0.010, 0.090)        # compiling kernels, capturing graphs
    assert policy.best(1) == 2 and policy._cost_table(1) == {}
    policy.record_cost(1, 2, 0.001, 0.004)
    assert policy.costs[1][2].seconds == pytest.approx(0.005)
    policy.record_cost(1, 2, 0.010, 0.040)        # a stall: counted as 0.015
    assert policy.costs[1][2].seconds == pytest.approx((0.005 + 0.015) / 2)
    assert not policy.costs[1][2].settled
    policy.record_cost(1, 2, 0.001, 0.004)        # the median of three: the stall is outvoted
    assert policy.costs[1][2].seconds == pytest.approx(0.005) and policy.costs[1][2].settled
    stalled = DraftPolicy(2)
    for seconds in (0.5, 0.4, 0.004):             # warm-up, a second stall, then the real cost
        stalled.record_cost(1, 2, 0.0, seconds)
    assert stalled.costs[1][2].seconds == pytest.approx(0.004)


def test_fixed_mode_always_answers_num_drafts():
    policy = DraftPolicy(3, adaptive=False)
    simulate(policy, 20, 4, 0.0, verify_by_rows, random.Random(0))
    assert {policy.choose(b) for b in (1, 7, 64)} == {3}
    assert policy.costs == {}


# -- the scheduler plans with the policy's k, within each sequence's limits ---------------------

def scheduler(checkpoint, slot_capacity, chain_rounds=0, **config):
    capacity = WorkerCapacity(num_blocks=64, block_size=4, num_slots=len(slot_capacity),
                              max_model_len=256, vocab_size=384, eos_token_ids=(0,),
                              hybrid=False, proposer="ngram", slot_capacity=slot_capacity,
                              chain_rounds=chain_rounds)
    return Scheduler(SchedulerConfig(**config), capacity, load_tokenizer(checkpoint("qwen3")))


def step(s, cost=verify_by_rows):
    """Plans a step and commits it as a worker would that accepts no draft and takes
    cost(batch, k) seconds."""
    plan = s.schedule()
    outcomes = [SeqOutcome(w.seq_id, [7], w.num_drafts, 0) for w in plan.work if w.sample]
    k = max(w.num_drafts for w in plan.work)
    s.update(plan, StepResult(outcomes, *cost(len(plan.work), k)))
    return plan


def test_the_policys_k_is_capped_by_slot_capacity_and_tokens_left(checkpoint):
    s = scheduler(checkpoint, (4, 2, 4), num_drafts=4)
    for i, max_tokens in enumerate((40, 40, 3)):
        s.add_request(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    assert all(w.num_drafts == 0 for w in step(s).work)      # prefill
    plan = step(s)
    assert s.drafts.last_k == 4                               # nothing timed yet: the most
    assert {w.slot: w.num_drafts for w in plan.work} == {0: 4, 1: 2, 2: 1}


def test_the_scheduler_stops_drafting_when_the_policy_says_so(checkpoint):
    s = scheduler(checkpoint, (4, 4), num_drafts=4)
    for i in range(2):
        s.add_request(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=60, ignore_eos=True))
    step(s)
    assert s.drafts.costs == {}                   # a prefill step's time is not a decode's
    seen = []
    for _ in range(24):
        seen.append(([w.num_drafts for w in step(s).work], s.drafts.probed))
    # 4 until measured (its first round is a warm-up), then 0
    assert seen[0][0] == seen[1][0] == [4, 4] and seen[2][0] == [0, 0]
    assert all(ks == [0, 0] for ks, probe in seen[2:] if not probe)
    assert sum(probe for _, probe in seen) == 3   # one in 8: k = 1 is not settled yet
    assert s.drafts.acceptance_at()[0] < 0.2
    assert set(s.drafts.costs[2]) == {0, 1, 4}


def test_a_steps_time_runs_from_planning_to_the_end_of_its_update(checkpoint):
    """Host time around the worker's (planning, transport, detokenising) counts in the step."""
    import time
    s = scheduler(checkpoint, (4, 4), num_drafts=4)
    for i in range(2):
        s.add_request(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=60, ignore_eos=True))
    step(s)
    for _ in range(2):   # the k's warm-up round, then a measured one
        plan = s.schedule()
        time.sleep(0.05)
        s.update(plan, StepResult([SeqOutcome(w.seq_id, [7], w.num_drafts, 0) for w in plan.work],
                                  0.001, 0.002))
    cost = s.drafts.costs[2][4]
    assert cost.samples == 1 and cost.propose_s == 0.001 and cost.forward_s >= 0.049


def test_a_chain_that_refills_the_pipeline_is_not_timed(checkpoint):
    """Where chains are planned ahead, the first chain after a prefill waits for the host to lay
    it out; that wait is paid once for its sequences, so its time does not count per round
    against its k. The chain planned ahead of it is timed from the first one's update. (On an
    engine that plans nothing ahead every chain is timed:
    test_a_prompt_of_one_token_is_not_chained.)"""
    s = scheduler(checkpoint, (3, 3), chain_rounds=8, num_drafts=3)
    now = [10.0]
    s.clock = lambda: now[0]
    for i in range(2):
        s.add_request(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=100, temperature=0,
                                                         ignore_eos=True))
    step(s)                                        # prefill: each has its first token
    assert s.plans_ahead

    def chain_result(plan):
        return StepResult([SeqOutcome(w.seq_id, [7] * w.steps, w.num_drafts * w.steps, 0,
                                      rounds=[0] * w.steps) for w in plan.work])
    first = s.schedule()
    now[0] += 1.0                                  # a slow refill
    ahead = s.schedule()
    assert first.work[0].steps > 1 and first.work[0].tokens[0] != AHEAD
    assert ahead.work and all(w.tokens[0] == AHEAD for w in ahead.work)
    s.update(first, chain_result(first))
    assert not any(s.drafts.costs.values())        # the refill left no figure
    now[0] += 0.008
    s.update(ahead, chain_result(ahead))
    k = ahead.work[0].num_drafts
    (cost,) = [table[k] for table in s.drafts.costs.values() if k in table]
    assert cost.forward_s == pytest.approx(0.008 / ahead.work[0].steps)


@pytest.mark.parametrize("accepted, rounds", [(1.0, 3), (0.0, 8)])
def test_a_chain_runs_the_rounds_its_sequences_are_expected_to_need(checkpoint, accepted, rounds):
    """Greedy rounds chained on the device stop at what the longest-running sequence may still
    emit, at the tokens a round is expected to commit: with every draft accepted (4 a round
    at k = 3) 10 tokens take 3 rounds; with none, 1 a round, the chain's most (8) of 10."""
    s = scheduler(checkpoint, (3, 3), chain_rounds=8, num_drafts=3, adaptive_drafts=False)
    for i, max_tokens in enumerate((11, 6)):
        s.add_request(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                         ignore_eos=True))
    step(s)                                        # prefill: each has its first token
    s.drafts.record_acceptance([(3, 3 if accepted else 0)] * 200)
    plan = s.schedule()
    assert s.drafts.expected_tokens(3) == pytest.approx(1 + 3 * accepted, abs=0.05)
    assert [(w.num_drafts, w.steps) for w in plan.work] == [(3, rounds)] * 2


def test_fixed_drafts_switch(checkpoint):
    s = scheduler(checkpoint, (4,), num_drafts=3, adaptive_drafts=False)
    s.add_request("r", [5, 6, 7], SamplingParams(max_tokens=60, ignore_eos=True))
    step(s)
    assert all(step(s).work[0].num_drafts == 3 for _ in range(12))


# -- end to end: adaptive k only changes speed --------------------------------------------------

@pytest.mark.parametrize("method, name", [("ngram", "qwen3"), ("mtp", "qwen3_5"),
                                          ("dflash", "qwen3_5")])
def test_adaptive_greedy_output_equals_plain_decoding(checkpoint, dflash_drafter, method, name):
    model_dir = checkpoint(name)
    kw = dict(device="cpu", block_size=4, max_num_seqs=4)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    plain = LLM(model_dir, **kw).generate(PROMPTS, params)
    llm = LLM(model_dir, speculative_method=method, num_drafts=3,
              drafter=dflash_drafter(name) if method == "dflash" else None, **kw)
    assert llm.scheduler.drafts.adaptive
    ks = set()
    for p in PROMPTS:
        llm.add_request(p, params)
    while llm.scheduler.has_work:
        plan = llm.scheduler.schedule()
        ks |= {w.num_drafts for w in plan.work if w.sample and len(w.tokens) == 1}
        llm.scheduler.update(plan, llm.worker.execute(plan))
    outs = [llm.finished_output(f"req-{i}") for i in range(len(PROMPTS))]
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert {0, 3} <= ks                         # the most first, then 0 once that was timed
    costs = [c for table in llm.scheduler.drafts.costs.values() for c in table.values()]
    assert costs and all(c.forward_s > 0 for c in costs)


def test_a_k_a_small_batch_has_not_measured_is_bounded_by_a_larger_batchs_figure():
    # At the end of a batch the last sequences run at small batch sizes that few rounds
    # measured. The 33454ae bench (B = 32, n-gram@3) had k = 2 measured at batch 8 and k = 0
    # at 32, both about 0.27 ms; batch 1 and 2 then chose k = 0 from k = 2's time by rows.
    policy = DraftPolicy(3)
    policy.tried, policy.accepted = [1e3] * 3, [0.6e3] * 3
    for _ in range(3):
        policy.record_cost(8, 16, 0.0, 0.000259)
        policy.record_cost(32, 0, 0.0, 0.000274)
    table = policy._cost_table(1)
    assert table[0] is policy.costs[32][0] and table[2] is policy.costs[8][2]
    assert policy.best(1) == 3   # k = 3 as if free beyond k = 2: the optimistic estimate
    assert policy._cost_table(8)[0] is policy.costs[32][0]
    assert policy._cost_table(64) == {0: policy.costs[32][0]}   # nothing larger: the nearest
    assert policy.best(8) == 3

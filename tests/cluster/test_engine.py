"""The replica engine in one process: streamed deltas add up to `generate`'s output, requests go
to the least-loaded worker, an abort frees its slot and blocks at once, and workers never wait for
each other."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from conftest import PROMPTS
from metrale.cluster.engine import ReplicaEngine
from metrale.cluster.executor import LocalExecutor
from metrale.cluster.params import SamplingParams
from metrale.cluster.plan import AHEAD
from metrale.cluster.scheduler import SchedulerConfig
from metrale.deploy.llm import LLM, load_tokenizer
from metrale.workers.worker import Worker, WorkerConfig

SPEC = dict(speculative_method="mtp", block_size=4, max_num_seqs=8)


class GatedExecutor(LocalExecutor):
    """A real worker whose steps wait until the test opens the gate."""

    def __init__(self, worker):
        super().__init__(worker)
        self.gate, self.holding = asyncio.Event(), asyncio.Event()

    async def execute(self, plan):
        self.holding.set()
        await self.gate.wait()
        return await super().execute(plan)


def workers(model_dir, n: int) -> list[Worker]:
    return [Worker(WorkerConfig(str(model_dir), "cpu", max_drafts=3, **SPEC)) for _ in range(n)]


def engine(model_dir, executors) -> ReplicaEngine:
    # a fixed k: logprobs from verifies of different widths differ in the last bits
    return ReplicaEngine.build(executors, SchedulerConfig(max_num_seqs=8, adaptive_drafts=False),
                               3, load_tokenizer(model_dir))


async def collect(eng: ReplicaEngine, request_id: str, ids: list[int], params: SamplingParams):
    """Per completion: concatenated text, token ids, logprobs, and the last delta."""
    out: dict[int, dict] = {}
    async for d in eng.generate(request_id, ids, params):
        c = out.setdefault(d.index, {"text": "", "ids": [], "logprobs": []})
        c["text"] += d.text
        c["ids"] += d.token_ids
        c["logprobs"] += d.logprobs
        c["last"] = d
    return [out[i] for i in sorted(out)]


def test_streams_add_up_to_generate(checkpoint):
    model_dir = checkpoint("qwen3_5")
    llm = LLM(model_dir, device="cpu", num_drafts=3, adaptive_drafts=False, **SPEC)
    prompts = [llm.encode(p) for p in PROMPTS]
    full = llm.generate(prompts[:1], SamplingParams(max_tokens=24, temperature=0,
                                                    ignore_eos=True))[0].text
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=(full[8:11],)),
              SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=11, n=2,
                             ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, min_p=0.05, seed=5)]
    expected = llm.generate(prompts, params)

    async def run():
        eng = engine(model_dir, [LocalExecutor(w) for w in workers(model_dir, 2)])
        eng.start()
        outs = await asyncio.gather(*(collect(eng, f"r{i}", ids, p)
                                      for i, (ids, p) in enumerate(zip(prompts, params))))
        await eng.stop()
        return eng, outs
    eng, outs = asyncio.run(run())
    assert expected[0].finish_reason == "stop" and expected[0].text == full[:full.find(full[8:11])]
    for got, want in zip(outs, expected):
        assert [c["text"] for c in got] == [c.text for c in want.completions]
        assert [c["ids"] for c in got] == [c.token_ids for c in want.completions]
        assert [c["last"].finish_reason for c in got] == [c.finish_reason for c in want.completions]
    # a worker with two plans in flight runs each on half the batch: same tokens, logprobs equal
    # up to the last bits of a differently-sized matmul
    got_lp, want_lp = outs[2][0]["logprobs"], expected[2].completions[0].logprobs
    assert [(lp.token_id, [t for t, _ in lp.top]) for lp in got_lp] == \
        [(lp.token_id, [t for t, _ in lp.top]) for lp in want_lp]
    assert [[v for _, v in lp.top] for lp in got_lp] == \
        [pytest.approx([v for _, v in lp.top], abs=1e-5) for lp in want_lp]
    assert all(c["last"].spec.rounds > 0 for got in outs for c in got)
    assert all(load.steps > 0 and load.running == 0 for load in eng.loads())


def test_new_requests_go_to_the_least_loaded_worker(checkpoint):
    model_dir = checkpoint("qwen3_5")
    eng = engine(model_dir, [LocalExecutor(w) for w in workers(model_dir, 3)])
    params = SamplingParams(max_tokens=4, n=2)
    for i in range(4):   # n=2: each request puts two sequences on its worker
        eng.add_request(f"r{i}", [5, 6, 7], params, lambda d: None)
    assert [load.waiting for load in eng.loads()] == [4, 2, 2]
    eng.add_request("r5", [5, 6, 7], SamplingParams(max_tokens=4), lambda d: None)
    assert [load.waiting for load in eng.loads()] == [4, 3, 2]


def test_abort_frees_slot_and_blocks_while_a_step_runs(checkpoint):
    model_dir = checkpoint("qwen3_5")

    async def run():
        gated = GatedExecutor(workers(model_dir, 1)[0])
        eng = engine(model_dir, [gated])
        eng.start()
        received = []
        eng.add_request("long", [5, 6, 7, 8, 9], SamplingParams(max_tokens=400, ignore_eos=True),
                        received.append)
        await gated.holding.wait()            # the first step is on the worker
        load = eng.loads()[0]
        assert load.running == 1 and load.free_slots == load.num_slots - 1
        eng.abort("long")
        load = eng.loads()[0]
        assert (load.running, load.waiting) == (0, 0)
        assert load.free_blocks == load.num_blocks and load.free_slots == load.num_slots
        gated.gate.set()                       # the step finishes; its tokens go nowhere
        await asyncio.sleep(0.2)
        await eng.stop()
        return received, eng.loads()[0]
    received, load = asyncio.run(run())
    assert received == [] and load.steps == 1 and load.free_slots == load.num_slots


def test_closing_a_stream_aborts_its_request(checkpoint):
    model_dir = checkpoint("qwen3_5")

    async def run():
        eng = engine(model_dir, [LocalExecutor(w) for w in workers(model_dir, 1)])
        eng.start()
        stream = eng.generate("r", [5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True))
        got = [await anext(stream) for _ in range(3)]
        await stream.aclose()
        load = eng.loads()[0]
        await eng.stop()
        return got, load
    got, load = asyncio.run(run())
    assert all(d.finish_reason is None for d in got)
    assert load.running == 0 and load.free_blocks == load.num_blocks
    assert load.free_slots == load.num_slots


def test_a_worker_never_waits_for_another(checkpoint):
    model_dir = checkpoint("qwen3_5")

    async def run():
        slow, fast = (GatedExecutor(w) for w in workers(model_dir, 2))
        fast.gate.set()
        eng = engine(model_dir, [slow, fast])
        eng.start()
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        held = asyncio.create_task(collect(eng, "on-slow", [5, 6, 7], params))
        await slow.holding.wait()
        done = await asyncio.wait_for(collect(eng, "on-fast", [8, 9], params), 30)
        assert not held.done() and eng.loads()[0].steps == 0
        slow.gate.set()
        first = await held
        await eng.stop()
        return first, done
    first, done = asyncio.run(run())
    assert len(first[0]["ids"]) == 12 and len(done[0]["ids"]) == 12


@pytest.mark.parametrize("method, expected", [("none", 0), ("mtp", 3)])
def test_drafts_per_round_default(checkpoint, method, expected):
    model_dir = checkpoint("qwen3_5")
    worker = Worker(WorkerConfig(str(model_dir), "cpu", speculative_method=method))
    eng = ReplicaEngine.build([LocalExecutor(worker)], SchedulerConfig(), None,
                              load_tokenizer(model_dir))
    assert eng.lanes[0].scheduler.num_drafts == expected


# -- two plans in flight: the worker never waits for its next plan ------------------------------

class RecordingExecutor(LocalExecutor):
    """A real worker that keeps every plan it is sent, in order, and notes for each the plans
    still pending then."""

    def __init__(self, worker):
        super().__init__(worker)
        self.plans = []
        self.pending: list[set[int]] = []
        self.overlaps: list[tuple[set[int], list[set[int]]]] = []

    async def execute(self, plan):
        self.plans.append(plan)
        ids = {w.seq_id for w in plan.work}
        self.overlaps.append((ids, [set(p) for p in self.pending]))
        self.pending.append(ids)
        try:
            return await super().execute(plan)
        finally:
            self.pending.remove(ids)


@pytest.mark.parametrize("depth", [1, 2])
def test_plans_in_flight_hold_disjoint_halves_and_keep_the_output(checkpoint, depth):
    """Without planning ahead (as with drafts), two plans in flight split the sequences."""
    model_dir = checkpoint("qwen3")
    config = dict(block_size=4, max_num_seqs=8)
    llm = LLM(model_dir, device="cpu", **config)
    prompts = [llm.encode(p) for p in PROMPTS * 2]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = [o.completions[0].token_ids for o in llm.generate(prompts, params)]

    async def run():
        executor = RecordingExecutor(Worker(WorkerConfig(str(model_dir), "cpu", **config)))
        eng = ReplicaEngine.build([executor], SchedulerConfig(max_num_seqs=8,
                                                              steps_in_flight=depth,
                                                              plan_ahead=False),
                                  None, load_tokenizer(model_dir))
        assert eng.steps_in_flight(eng.lanes[0]) == depth
        eng.start()
        outs = await asyncio.gather(*(collect(eng, f"r{i}", ids, params)
                                      for i, ids in enumerate(prompts)))
        await eng.stop()
        return executor, outs
    executor, outs = asyncio.run(run())
    assert [o[0]["ids"] for o in outs] == expected
    most = max(len(pending) for _, pending in executor.overlaps)
    assert most == depth - 1   # with 2, every plan but the first found the other one queued
    for ids, pending in executor.overlaps:
        assert all(not ids & other for other in pending)
        assert len(ids) <= -(-len(prompts) // depth)


@pytest.mark.parametrize("decode_steps, chain_rounds", [(1, 0), (3, 0), (1, 3)],
                         ids=["steps", "three-steps", "chained"])
def test_plans_made_ahead_keep_the_output_and_free_everything(checkpoint, decode_steps,
                                                              chain_rounds):
    """Plain decoding with two plans in flight: the second plan carries the same sequences one
    plan ahead (the worker fills in the token it sampled). Greedy and seeded sampled outputs,
    n > 1, a stop token hit while a step ahead flies, and max_tokens all come out as `generate`
    makes them one step a plan, also with plans of three decode steps each (fewer where
    max_tokens leaves fewer), and on a worker that chains plain decode steps (chain_rounds 3:
    the greedy sequences' plans, ahead ones included, are chains of 3 steps each, or 2 where
    none has 3 left), and every block and slot is free at the end."""
    model_dir = checkpoint("qwen3_5")
    config = dict(block_size=4, max_num_seqs=8)
    llm = LLM(model_dir, device="cpu", **config)
    prompts = [llm.encode(p) for p in PROMPTS]
    greedy = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    stop_at = llm.generate(prompts[:1], greedy)[0].completions[0].token_ids[5]
    requests = [(prompts[0], SamplingParams(max_tokens=14, temperature=0, stop_token_ids=(stop_at,))),
                (prompts[1], SamplingParams(max_tokens=9, temperature=0.9, seed=7, n=2,
                                            ignore_eos=True)),
                (prompts[2], greedy),
                (prompts[3], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))]
    expected = [[c.token_ids for c in llm.generate([ids], params)[0].completions]
                for ids, params in requests]
    assert len(expected[0][0]) == 6   # it stopped at its stop token, 8 tokens before max_tokens

    async def run():
        executor = RecordingExecutor(Worker(WorkerConfig(str(model_dir), "cpu",
                                                         chain_rounds=chain_rounds, **config)))
        eng = ReplicaEngine.build([executor], SchedulerConfig(max_num_seqs=8, steps_in_flight=2,
                                                              decode_steps=decode_steps),
                                  None, load_tokenizer(model_dir))
        eng.start()
        outs = await asyncio.gather(*(collect(eng, f"r{i}", ids, params)
                                      for i, (ids, params) in enumerate(requests)))
        await eng.stop()
        return executor, eng.lanes[0].scheduler, outs
    executor, scheduler, outs = asyncio.run(run())
    assert [[c["ids"] for c in o] for o in outs] == expected
    ahead = [{w.seq_id for w in p.work if w.tokens == [AHEAD]} for p in executor.plans]
    assert sum(map(len, ahead)) > 20 // decode_steps   # most plans were planned ahead...
    for before, plan, ids in zip(executor.plans, executor.plans[1:], ahead[1:]):
        sampled = {w.seq_id for w in before.work if w.sample}
        assert ids <= sampled and len(plan.work) == len({w.seq_id for w in plan.work})
    assert max(len(p.work) for p in executor.plans) == 5   # ...over whole batches, not halves
    steps = {w.steps for p in executor.plans for w in p.work}
    assert steps == ({1} if decode_steps == chain_rounds + 1 else {1, 2, 3})   # 1: prompts...
    if chain_rounds:   # greedy plans, ahead ones included, chain; sampled ones never do
        chains = [p for p in executor.plans if all(w.steps > 1 for w in p.work)]
        assert any(w.tokens == [AHEAD] for p in chains for w in p.work)
        assert all(w.sample.greedy and len({v.steps for v in p.work}) == 1
                   for p in chains for w in p.work)
        assert all(w.steps == 1 for p in executor.plans for w in p.work if not w.sample.greedy)
    assert scheduler.blocks.num_free == scheduler.blocks.num_blocks
    assert scheduler.slots.num_free == scheduler.capacity.num_slots
    assert not scheduler.in_flight and not scheduler.running and not scheduler.by_request
    assert not scheduler.flying_steps


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5"])
def test_ngram_chains_made_ahead_keep_the_output_and_free_everything(checkpoint, name):
    """With drafts, on a worker that chains n-gram rounds (chain_rounds 3), a chain of the
    sequences of the chain in flight is planned before its result: AHEAD, their pending tokens
    and cached lengths being what that chain leaves (on the CPU the worker fills them in; on
    a GPU the chain goes on from the device). Greedy outputs (one stopping at a stop token
    inside a chain, others at max_tokens) are plain decoding's; a sampled request beside them
    is run round by round, and the greedy ones wait to be planned with it; every block and
    slot is free at the end."""
    model_dir = checkpoint(name)
    config = dict(block_size=4, max_num_seqs=8)
    llm = LLM(model_dir, device="cpu", **config)
    prompts = [llm.encode(p) for p in PROMPTS]
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    stop_at = llm.generate(prompts[:1], greedy)[0].completions[0].token_ids[12]
    requests = [(prompts[0], replace(greedy, stop_token_ids=(stop_at,), ignore_eos=False)),
                (prompts[1], greedy), (prompts[2], replace(greedy, max_tokens=11)),
                (prompts[3], replace(greedy, max_tokens=23))]
    expected = [[c.token_ids for c in llm.generate([ids], params)[0].completions]
                for ids, params in requests]
    assert len(expected[0][0]) == 13   # it stopped at its stop token

    async def run(requests):
        executor = RecordingExecutor(Worker(WorkerConfig(
            str(model_dir), "cpu", speculative_method="ngram", max_drafts=3, chain_rounds=3,
            **config)))
        eng = ReplicaEngine.build([executor], SchedulerConfig(max_num_seqs=8), 3,
                                  load_tokenizer(model_dir))
        assert eng.lanes[0].scheduler.plans_ahead and eng.steps_in_flight(eng.lanes[0]) == 2
        eng.start()
        outs = await asyncio.gather(*(collect(eng, f"r{i}", ids, params)
                                      for i, (ids, params) in enumerate(requests)))
        await eng.stop()
        return executor, eng.lanes[0].scheduler, outs
    executor, scheduler, outs = asyncio.run(run(requests))
    assert [[c["ids"] for c in o] for o in outs] == expected
    ahead = [p for p in executor.plans if p.work and p.work[0].tokens == [AHEAD]]
    assert len(ahead) >= 3
    for before, plan in zip(executor.plans, executor.plans[1:]):
        if plan in ahead:   # the chain before's sequences (some, once others end), chained
            assert {w.seq_id for w in plan.work} <= {w.seq_id for w in before.work}
            assert all(w.tokens == [AHEAD] and w.steps == plan.work[0].steps >= 2
                       for w in plan.work)
            assert all(w.steps == before.work[0].steps >= 2 for w in before.work)
    assert scheduler.blocks.num_free == scheduler.blocks.num_blocks
    assert scheduler.slots.num_free == scheduler.capacity.num_slots
    assert not scheduler.in_flight and not scheduler.running and not scheduler.flying_steps

    sampled = SamplingParams(max_tokens=8, temperature=0.9, seed=3)
    executor, scheduler, outs = asyncio.run(run(requests[1:2] + [(prompts[2], sampled)]))
    assert outs[0][0]["ids"] == expected[1][0] and len(outs[1][0]["ids"]) == 8
    for plan in executor.plans:   # while the sampled one runs, no plan chains or goes ahead
        if any(not w.sample.greedy for w in plan.work if w.sample):
            assert all(w.steps == 1 and w.tokens != [AHEAD] for w in plan.work)
    assert not scheduler.in_flight and scheduler.blocks.num_free == scheduler.blocks.num_blocks


def test_a_row_planned_ahead_runs_the_token_the_step_before_sampled(checkpoint):
    from metrale.cluster.plan import SeqWork, StepPlan
    from metrale.workers.sampler import SamplingSpec
    config = WorkerConfig(str(checkpoint("qwen3")), "cpu", block_size=4, max_num_seqs=2)
    worker, twin = Worker(config), Worker(config)
    greedy = SamplingSpec(0.0, 1.0, 0, 0.0, 1, 0, None)
    first = StepPlan([SeqWork(1, [5, 6, 7], 0, [0], 0, greedy)])
    token, = worker.execute(first).outcomes[0].tokens
    twin.execute(first)
    ahead = StepPlan([SeqWork(1, [AHEAD], 3, [0], 0, replace(greedy, draw=1))])
    spelled = StepPlan([SeqWork(1, [token], 3, [0], 0, replace(greedy, draw=1))])
    assert worker.execute(ahead).outcomes[0].tokens == twin.execute(spelled).outcomes[0].tokens
    worker.execute(StepPlan([SeqWork(2, [8, 9], 0, [1], 1, greedy)]))   # another sequence
    later = StepPlan([SeqWork(1, [AHEAD], 4, [0, 2], 0, replace(greedy, draw=2))])
    with pytest.raises(RuntimeError, match=r"sequences \[1\] were planned ahead"):
        worker.execute(later)


def test_a_plan_of_decode_steps_in_a_row_is_those_steps_one_by_one(checkpoint):
    """A plan whose sequence runs three decode steps (`SeqWork.steps`) beside one running one:
    the tokens, and those of a plan ahead of both, are what plans of one step each give."""
    from metrale.cluster.plan import SeqWork, StepPlan
    from metrale.workers.sampler import SamplingSpec
    config = WorkerConfig(str(checkpoint("qwen3_5")), "cpu", block_size=4, max_num_seqs=2)
    worker, twin = Worker(config), Worker(config)
    greedy = SamplingSpec(0.0, 1.0, 0, 0.0, 1, 0, None)
    sampled = SamplingSpec(0.9, 1.0, 0, 0.0, 5, 0)
    prompts = StepPlan([SeqWork(1, [5, 6, 7], 0, [0, 1], 0, greedy),
                        SeqWork(2, [8, 9], 0, [2, 3], 1, sampled)])
    last = {o.seq_id: o.tokens[-1] for o in worker.execute(prompts).outcomes}
    assert last == {o.seq_id: o.tokens[-1] for o in twin.execute(prompts).outcomes}
    steps = StepPlan([SeqWork(1, [AHEAD], 3, [0, 1], 0, replace(greedy, draw=1), steps=3),
                      SeqWork(2, [AHEAD], 2, [2, 3], 1, replace(sampled, draw=1))])
    ahead = StepPlan([SeqWork(1, [AHEAD], 6, [0, 1], 0, replace(greedy, draw=4)),
                      SeqWork(2, [AHEAD], 3, [2, 3], 1, replace(sampled, draw=2), steps=2)])
    got = [{o.seq_id: o.tokens for o in worker.execute(plan).outcomes} for plan in (steps, ahead)]
    one_by_one = {1: [], 2: []}   # (sequence, position, draw) per plan of one step each
    for plan in [[(1, 3, 1), (2, 2, 1)], [(1, 4, 2)], [(1, 5, 3)], [(1, 6, 4), (2, 3, 2)],
                 [(2, 4, 3)]]:
        work = [SeqWork(seq, [last[seq]], at, [0, 1] if seq == 1 else [2, 3], seq - 1,
                        replace(greedy if seq == 1 else sampled, draw=draw))
                for seq, at, draw in plan]
        for o in twin.execute(StepPlan(work)).outcomes:
            one_by_one[o.seq_id] += o.tokens
            last[o.seq_id] = o.tokens[-1]
    assert [len(got[0][1]), len(got[0][2]), len(got[1][1]), len(got[1][2])] == [3, 1, 1, 2]
    assert got[0][1] + got[1][1] == one_by_one[1] and got[0][2] + got[1][2] == one_by_one[2]


@pytest.mark.parametrize("graphs", [False, True])
def test_requests_read_only_at_their_end_decode_four_steps_a_plan_on_a_cpu_worker(checkpoint,
                                                                                   graphs):
    """By default a request that is not streamed runs 4 decode steps a plan (fewer near
    max_tokens) on a worker without CUDA graphs; a streamed one, and any on a graph worker, one."""
    from metrale.cluster.plan import SeqOutcome, StepResult, WorkerCapacity
    from metrale.cluster.scheduler import UNSTREAMED_DECODE_STEPS, Scheduler
    capacity = WorkerCapacity(num_blocks=16, block_size=4, num_slots=2, max_model_len=64,
                              vocab_size=384, eos_token_ids=(0,), hybrid=False, graphs=graphs)
    s = Scheduler(SchedulerConfig(prefix_caching=False), capacity,
                  load_tokenizer(checkpoint("qwen3")))
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    whole, = s.add_request("whole", [5, 6, 7], params, streamed=False)
    streamed, = s.add_request("streamed", [6, 7, 8], params)
    steps = {whole.seq_id: [], streamed.seq_id: []}
    while s.has_work:
        plan = s.schedule()
        for w in plan.work:
            if len(w.tokens) == 1:
                steps[w.seq_id].append(w.steps)
        s.update(plan, StepResult([SeqOutcome(w.seq_id, [9] * w.steps) for w in plan.work]))
    assert UNSTREAMED_DECODE_STEPS == 4
    assert steps[whole.seq_id] == ([1] * 9 if graphs else [4, 4, 1])   # 9 after the prompt's
    assert steps[streamed.seq_id] == [1] * 9
    assert len(whole.output_ids) == len(streamed.output_ids) == 10


def test_preemption_never_takes_a_sequence_in_flight(checkpoint):
    from metrale.cluster.plan import SeqOutcome, StepResult, WorkerCapacity
    from metrale.cluster.scheduler import Scheduler
    capacity = WorkerCapacity(num_blocks=4, block_size=4, num_slots=2, max_model_len=64,
                              vocab_size=384, eos_token_ids=(0,), hybrid=False)
    s = Scheduler(SchedulerConfig(prefix_caching=False, plan_ahead=False), capacity,
                  load_tokenizer(checkpoint("qwen3")))
    first, = s.add_request("a", [5] * 7, SamplingParams(max_tokens=8, ignore_eos=True))
    second, = s.add_request("b", [6] * 7, SamplingParams(max_tokens=8, ignore_eos=True))

    def result(plan):
        return StepResult([SeqOutcome(w.seq_id, [9]) for w in plan.work])
    a = s.schedule(s.share(2))                     # each prompt fills two of the four blocks
    b = s.schedule(s.share(2))
    assert [w.seq_id for w in a.work] == [first.seq_id]
    assert [w.seq_id for w in b.work] == [second.seq_id]
    assert s.schedule(s.share(2)).work == []       # both in flight: nothing to plan
    s.update(a, result(a))                         # first: 8 tokens, its pending one fits
    s.update(s.schedule(s.share(2)), result(a))    # first: 9 tokens, the next needs a 3rd block
    plan = s.schedule(s.share(2))                  # second is in flight: first gives way
    assert plan.work == [] and first in s.waiting and second in s.running
    s.update(b, result(b))
    assert [w.seq_id for w in s.schedule(s.share(2)).work] == [second.seq_id]


def test_a_failed_step_leaves_no_sequence_in_flight(checkpoint):
    model_dir = checkpoint("qwen3")
    llm = LLM(model_dir, device="cpu", block_size=4, max_num_seqs=8)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = llm.generate(PROMPTS[:2], params)
    execute = llm.worker.execute

    def broken(plan):
        raise RuntimeError("the step failed")
    llm.worker.execute = broken
    with pytest.raises(RuntimeError, match="the step failed"):
        llm.generate(PROMPTS[2:3], params)
    assert not llm.scheduler.in_flight   # so the sequences can be planned again
    llm.worker.execute = execute
    assert [o.text for o in llm.generate(PROMPTS[:2], params)] == [o.text for o in want]


@pytest.mark.parametrize("graphs", [True, False])
def test_a_worker_replaying_graphs_gets_prefills_in_steps_of_their_own(checkpoint, graphs):
    """A step mixing a prefill chunk into a decode round runs eagerly on a worker that replays
    CUDA graphs, so for such a worker a step is all prefill or all decoding, prefills first.
    Requests arriving while others decode keep their greedy output; without graphs steps mix."""
    model_dir = checkpoint("qwen3_5")
    kw = dict(device="cpu", block_size=4, max_num_seqs=4, speculative_method="ngram", num_drafts=3)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model_dir, **kw).generate(PROMPTS, params)]
    llm = LLM(model_dir, **kw)
    sched = llm.scheduler
    sched.capacity = replace(sched.capacity, graphs=graphs)
    kinds, arrivals = [], list(enumerate(PROMPTS))
    while arrivals or sched.has_work:
        if arrivals and len(kinds) % 3 == 0:      # one arrives every third step
            i, prompt = arrivals.pop(0)
            llm.add_request(prompt, params, request_id=f"r{i}")
        if not sched.has_work:
            kinds.append(set())
            continue
        plan = sched.schedule()
        kinds.append({"prefill" if w.context_len < w.prompt_len else "decode" for w in plan.work})
        sched.update(plan, llm.worker.execute(plan))
    outputs = [llm.finished_output(f"r{i}").token_ids for i in range(len(PROMPTS))]
    assert outputs == expected
    mixed = [k for k in kinds if len(k) == 2]
    assert not mixed if graphs else mixed
    assert {"prefill"} in kinds if graphs else True


def test_prefill_steps_never_starve_decoding_when_blocks_run_out(checkpoint):
    """On a graph worker a prompt that cannot fit beside a decoding sequence must not loop
    through prefill steps (preempting itself and starting again) while the decoding sequence
    waits: a prefill step never preempts, and when none can run the step decodes as usual."""
    from metrale.cluster.plan import SeqOutcome, StepResult, WorkerCapacity
    from metrale.cluster.scheduler import Scheduler
    capacity = WorkerCapacity(num_blocks=3, block_size=4, num_slots=2, max_model_len=64,
                              vocab_size=384, eos_token_ids=(0,), hybrid=False, graphs=True)
    s = Scheduler(SchedulerConfig(prefix_caching=False, plan_ahead=False,
                                  max_num_batched_tokens=4), capacity,
                  load_tokenizer(checkpoint("qwen3")))
    short, = s.add_request("short", [5] * 3, SamplingParams(max_tokens=5, ignore_eos=True))
    long, = s.add_request("long", [6] * 11, SamplingParams(max_tokens=1, ignore_eos=True))
    kinds = []
    for _ in range(100):
        if not s.has_work:
            break
        plan = s.schedule()
        kinds.append({"prefill" if w.context_len < w.prompt_len else "decode" for w in plan.work})
        s.update(plan, StepResult([SeqOutcome(w.seq_id, [9]) for w in plan.work if w.sample]))
    assert not s.has_work and short.finished and long.finished
    assert len(short.output_ids) == 5 and len(long.output_ids) == 1
    assert {"prefill"} in kinds and any("decode" in k for k in kinds)


def test_a_graph_worker_gathers_prompts_arriving_one_by_one_into_one_prefill_step(checkpoint):
    """While a sequence decodes, a prompt arriving alone waits for company until its wait equals
    one measured prefill step; then every prompt that arrived meanwhile prefills in one step.
    Prompts that fill a step's rows go at once."""
    from metrale.cluster.plan import SeqOutcome, StepResult, WorkerCapacity
    from metrale.cluster.scheduler import Scheduler
    capacity = WorkerCapacity(num_blocks=64, block_size=4, num_slots=4, max_model_len=64,
                              vocab_size=384, eos_token_ids=(0,), hybrid=False, graphs=True)
    s = Scheduler(SchedulerConfig(prefix_caching=False, plan_ahead=False, max_num_seqs=4,
                                  max_num_batched_tokens=16),
                  capacity, load_tokenizer(checkpoint("qwen3")))
    now = [0.0]
    s.clock = lambda: now[0]
    params = SamplingParams(max_tokens=50, ignore_eos=True)

    def step(took: float) -> set[str]:
        plan = s.schedule()
        now[0] += took
        s.update(plan, StepResult([SeqOutcome(w.seq_id, [9]) for w in plan.work if w.sample],
                                  forward_s=took))
        assert plan.prefill == (plan.work and all(w.context_len < w.prompt_len for w in plan.work))
        return {f"{'prefill' if w.context_len < w.prompt_len else 'decode'} {w.seq_id}"
                for w in plan.work}

    a, = s.add_request("a", [5] * 6, params)
    assert step(0.010) == {f"prefill {a.seq_id}"}          # nothing decodes: at once, measured
    b, = s.add_request("b", [6] * 6, params)
    assert step(0.001) == {f"decode {a.seq_id}"}           # b waits: 0 of 10 ms so far
    c, = s.add_request("c", [7] * 6, params)
    for _ in range(9):                                     # 1 to 9 ms
        assert step(0.001) == {f"decode {a.seq_id}"}
    assert step(0.001) == {f"prefill {b.seq_id}", f"prefill {c.seq_id}"}   # 10 ms: due
    assert step(0.001) == {f"decode {q.seq_id}" for q in (a, b, c)}
    d, = s.add_request("d", [8] * 16, params)              # a step's rows: at once
    assert step(0.001) == {f"prefill {d.seq_id}"}
    assert s.deferred_since is None and list(s.prefill_times) == [0.010, 0.001, 0.001]


@pytest.mark.parametrize("gather, running, arrivals, due", [
    (1, 3, 1, 10),   # one prefill step's time, whatever else runs
    (4, 3, 1, 30),   # 1 empty seat x 30 ms = 3 running x 10 ms
    (2, 3, 1, 20),   # the same, cut at 2 steps' time
    (4, 2, 2, 10),   # 2 empty seats x 10 ms = 2 running x 10 ms
])
def test_prefill_gather_waits_until_empty_seats_cost_what_a_prefill_step_stalls(
        checkpoint, gather, running, arrivals, due):
    """With prefill_gather g, prompts that find free seats wait until the seat-seconds left empty
    reach the running sequences times a prefill step's time (10 ms here), at least one step's
    time and at most g of them."""
    from metrale.cluster.plan import SeqOutcome, StepResult, WorkerCapacity
    from metrale.cluster.scheduler import Scheduler
    capacity = WorkerCapacity(num_blocks=64, block_size=4, num_slots=4, max_model_len=64,
                              vocab_size=384, eos_token_ids=(0,), hybrid=False, graphs=True)
    s = Scheduler(SchedulerConfig(prefix_caching=False, plan_ahead=False, max_num_seqs=4,
                                  max_num_batched_tokens=64, prefill_gather=gather),
                  capacity, load_tokenizer(checkpoint("qwen3")))
    ms = 1 / 1024   # a binary fraction, so the sums of step times are exact
    now = [0.0]
    s.clock = lambda: now[0]
    params = SamplingParams(max_tokens=200, ignore_eos=True)

    def step(took: float) -> bool:
        plan = s.schedule()
        now[0] += took
        s.update(plan, StepResult([SeqOutcome(w.seq_id, [9]) for w in plan.work if w.sample],
                                  forward_s=took))
        return plan.prefill

    for i in range(running):
        s.add_request(f"r{i}", [5] * 6, params)
    assert step(10 * ms)                                   # nothing decodes: at once, measured
    for i in range(arrivals):
        s.add_request(f"a{i}", [6] * 6, params)
    waited = 0
    while not step(ms):
        waited += 1
    assert waited == due and len(s.running) == running + arrivals


def test_an_admission_hashes_the_prompt_once(checkpoint):
    """The admission test and the allocation share one walk of the prompt's prefix hashes."""
    from metrale.cluster.plan import WorkerCapacity
    from metrale.cluster.scheduler import Scheduler
    capacity = WorkerCapacity(num_blocks=16, block_size=4, num_slots=2, max_model_len=64,
                              vocab_size=384, eos_token_ids=(0,), hybrid=False)
    s = Scheduler(SchedulerConfig(plan_ahead=False), capacity, load_tokenizer(checkpoint("qwen3")))
    walks = []
    walk = s.blocks.cached_prefix
    s.blocks.cached_prefix = lambda tokens: walks.append(len(tokens)) or walk(tokens)
    s.add_request("a", [5] * 13, SamplingParams(max_tokens=4, ignore_eos=True))
    plan = s.schedule()
    assert [len(w.tokens) for w in plan.work] == [13] and walks == [13]

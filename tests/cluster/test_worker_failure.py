"""A worker that dies mid-generation loses no request: its requests move to a live (or restarted)
worker, re-prefill prompt + emitted tokens, and stream on where they stopped, so the text equals an
undisturbed run's and each token arrives once. In one process, with real workers whose "death"
throws their caches away."""

from __future__ import annotations

import asyncio

import pytest

from conftest import PROMPTS
from metrale.cluster import engine as engine_module
from metrale.cluster.engine import Overloaded, ReplicaEngine, Unavailable
from metrale.cluster.executor import LocalExecutor, WorkerLost
from metrale.cluster.params import SamplingParams
from metrale.cluster.scheduler import SchedulerConfig
from metrale.deploy.llm import LLM, load_tokenizer
from metrale.workers.worker import Worker, WorkerConfig

PARAMS = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
          SamplingParams(max_tokens=32, temperature=0.8, top_k=20, seed=11, n=2, ignore_eos=True),
          SamplingParams(max_tokens=28, temperature=0, logprobs=2, ignore_eos=True),
          SamplingParams(max_tokens=36, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True)]


class MortalExecutor(LocalExecutor):
    """A real worker that dies at its `die_at`-th step; restarting builds a new Worker (empty KV
    pages, slots and pools), unless it may not restart."""

    def __init__(self, config: WorkerConfig, die_at: int | None = None, restarts: bool = True):
        super().__init__(Worker(config))
        self.config, self.die_at, self.restarts = config, die_at, restarts
        self.steps = 0
        self.dead = False

    async def execute(self, plan):
        self.steps += 1
        if self.dead or self.steps == self.die_at:
            self.dead = True
            raise WorkerLost("killed by the test")
        return await super().execute(plan)

    async def ping(self):
        if self.dead:
            raise WorkerLost("no answer")

    async def reconnect(self):
        if not self.restarts:
            raise WorkerLost("dead for good")
        await asyncio.sleep(0.05)
        self.worker, self.dead = Worker(self.config), False


def worker_config(model_dir, method: str, drafter=None) -> WorkerConfig:
    return WorkerConfig(str(model_dir), "cpu", block_size=4, max_num_seqs=8, max_drafts=3,
                        speculative_method=method, drafter=drafter and str(drafter))


def make_engine(model_dir, executors, **limits) -> ReplicaEngine:
    # a fixed k: seeded samples and logprobs are compared with an in-process run's
    return ReplicaEngine.build(executors, SchedulerConfig(max_num_seqs=8, adaptive_drafts=False),
                               3, load_tokenizer(model_dir), **limits)


async def collect(eng: ReplicaEngine, request_id: str, ids: list[int], params: SamplingParams):
    out: dict[int, dict] = {}
    async for d in eng.generate(request_id, ids, params):
        c = out.setdefault(d.index, {"text": "", "ids": [], "logprobs": [], "error": None})
        c["text"] += d.text
        c["ids"] += d.token_ids
        c["logprobs"] += d.logprobs
        c["error"] = d.error_type
    return [out[i] for i in sorted(out)]


def run_all(eng: ReplicaEngine, prompts, params):
    async def run():
        eng.start()
        outs = await asyncio.gather(*(collect(eng, f"r{i}", ids, p)
                                      for i, (ids, p) in enumerate(zip(prompts, params))))
        await eng.stop()
        return outs
    return asyncio.run(run())


@pytest.mark.parametrize("method", ["mtp", "dflash"])
@pytest.mark.parametrize("workers", [2, 1])
def test_requests_survive_a_worker_death_with_the_same_output(checkpoint, dflash_drafter,
                                                              method, workers):
    model_dir = checkpoint("qwen3_5")
    drafter = dflash_drafter("qwen3_5") if method == "dflash" else None
    config = worker_config(model_dir, method, drafter)
    llm = LLM(model_dir, device="cpu", block_size=4, speculative_method=method, drafter=drafter,
              num_drafts=3, adaptive_drafts=False)
    prompts = [llm.encode(p) for p in PROMPTS]
    expected = llm.generate(prompts, PARAMS)
    # with two workers, worker 0 dies and its requests move to worker 1 (or back, once
    # restarted); with one, the requests wait for its restart
    executors = [MortalExecutor(config, die_at=6)] + [MortalExecutor(config)
                                                       for _ in range(workers - 1)]
    eng = make_engine(model_dir, executors)
    outs = run_all(eng, prompts, PARAMS)
    for got, want in zip(outs, expected):
        assert [c["error"] for c in got] == [None] * len(got)
        assert [c["ids"] for c in got] == [c.token_ids for c in want.completions]
        assert [c["text"] for c in got] == [c.text for c in want.completions]
    assert [len(c["logprobs"]) for c in outs[2]] == [28]
    lanes = eng.loads()
    assert lanes[0].restarts == 1 and all(lane.state == "up" for lane in lanes)
    if workers == 1:
        assert executors[0].steps > 6   # the restarted worker served them


def test_with_no_worker_left_requests_fail_as_unavailable_and_new_ones_are_refused(checkpoint):
    model_dir = checkpoint("qwen3_5")
    config = worker_config(model_dir, "mtp")
    eng = make_engine(model_dir, [MortalExecutor(config, die_at=4, restarts=False)])
    llm = LLM(model_dir, device="cpu", block_size=4)
    prompts = [llm.encode(p) for p in PROMPTS[:2]]

    async def run():
        eng.start()
        outs = await asyncio.wait_for(asyncio.gather(
            *(collect(eng, f"r{i}", ids, PARAMS[0]) for i, ids in enumerate(prompts))), 30)
        with pytest.raises(Unavailable, match="no worker is available"):
            eng.add_request("late", prompts[0], PARAMS[0], lambda d: None)
        await eng.stop()
        return outs
    outs = asyncio.run(run())
    assert [c[0]["error"] for c in outs] == ["unavailable", "unavailable"]
    assert eng.loads()[0].state == "down" and not eng.streams


def test_an_idle_workers_death_is_found_by_a_ping(checkpoint, monkeypatch):
    monkeypatch.setattr(engine_module, "HEALTH_INTERVAL_S", 0.05)
    model_dir = checkpoint("qwen3_5")
    config = worker_config(model_dir, "mtp")
    executors = [MortalExecutor(config), MortalExecutor(config)]
    eng = make_engine(model_dir, executors)

    async def run():
        eng.start()
        executors[1].dead = True
        for _ in range(100):
            await asyncio.sleep(0.05)
            if eng.loads()[1].restarts:
                break
        await eng.stop()
    asyncio.run(run())
    assert eng.loads()[1].restarts == 1 and eng.loads()[1].state == "up"


def test_a_full_replica_refuses_with_overloaded(checkpoint):
    model_dir = checkpoint("qwen3_5")
    eng = make_engine(model_dir, [MortalExecutor(worker_config(model_dir, "mtp"))],
                      max_pending=2)
    eng.add_request("a", [1, 2], PARAMS[0], lambda d: None)
    eng.add_request("b", [1, 2], PARAMS[0], lambda d: None)
    with pytest.raises(Overloaded, match="over capacity"):
        eng.add_request("c", [1, 2], PARAMS[0], lambda d: None)
    eng.abort("a")
    eng.add_request("c", [1, 2], PARAMS[0], lambda d: None)

"""Failures on a real local Ray cluster: a worker actor killed with SIGKILL mid-generation, the
scheduler actor killed, and a replica whose last worker dies for good."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import replace

import pytest
import ray

from conftest import PROMPTS
from metrale.cluster.actor import ReplicaSpec, scheduler_name, start_replica, stop_replica
from metrale.cluster.client import ReplicaClient
from metrale.cluster.engine import Unavailable
from metrale.cluster.params import SamplingParams
from metrale.cluster.scheduler import SchedulerConfig
from metrale.deploy.llm import LLM
from metrale.workers.actor import NAMESPACE, worker_name
from metrale.workers.worker import WorkerConfig

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=160, temperature=0, ignore_eos=True)


def spec(name: str, model_dir, workers: int, **failure) -> ReplicaSpec:
    return ReplicaSpec(name, WorkerConfig(str(model_dir), "cpu", speculative_method="ngram",
                                          max_drafts=3, block_size=4),
                       SchedulerConfig(max_num_seqs=8), num_drafts=3, workers=workers,
                       cpus_per_worker=0.5, **failure)


@pytest.fixture(scope="module")
def expected(checkpoint):
    model_dir = checkpoint("qwen3_5")
    llm = LLM(model_dir, device="cpu", speculative_method="ngram", num_drafts=3, block_size=4)
    prompts = [llm.encode(p) for p in PROMPTS]
    return model_dir, prompts, [o.token_ids for o in llm.generate(prompts, GREEDY)]


async def stream_tokens(client: ReplicaClient, request_id: str, ids: list[int], started=None):
    tokens, error = [], None
    async for d in await client.submit(request_id, ids, GREEDY):
        tokens += d.token_ids
        error = error or d.error_type
        if started is not None and tokens:
            started.set()
    return tokens, error


async def kill_worker_after_first_tokens(client, replica, prompts, rank: int):
    started = asyncio.Event()
    tasks = [asyncio.create_task(stream_tokens(client, f"k{i}", ids, started))
             for i, ids in enumerate(prompts)]
    await started.wait()
    pids = await replica.handle.worker_pids.remote()
    os.kill(pids[rank], signal.SIGKILL)
    return await asyncio.wait_for(asyncio.gather(*tasks), 120)


@pytest.mark.parametrize("workers", [2, 1])
def test_a_killed_worker_loses_no_request(ray_cluster, expected, workers):
    model_dir, prompts, want = expected
    replica = asyncio.run(start_replica(spec(f"kill{workers}w", model_dir, workers), 0))
    try:
        async def run():
            client = ReplicaClient(replica)
            outs = await kill_worker_after_first_tokens(client, replica, prompts, 0)
            deadline = time.monotonic() + 60
            while (state := await client.state())["lanes"][0]["restarts"] < 1:
                assert time.monotonic() < deadline, state
                await asyncio.sleep(0.2)
            return outs, state
        outs, state = asyncio.run(run())
        assert outs == [(tokens, None) for tokens in want]   # each token once, none missing
        assert state["lanes"][0]["state"] == "up" and state["requests"] == 0
        # the restarted actor keeps its name and serves again
        assert ray.get_actor(worker_name(replica.name, 0), namespace=NAMESPACE)
    finally:
        stop_replica(replica)


def test_with_no_worker_left_requests_fail_fast_as_unavailable(ray_cluster, expected):
    model_dir, prompts, _ = expected
    replica = asyncio.run(start_replica(spec("last", model_dir, 1, worker_restarts=0), 0))
    try:
        async def run():
            client = ReplicaClient(replica)
            began = time.monotonic()
            outs = await kill_worker_after_first_tokens(client, replica, prompts[:2], 0)
            elapsed = time.monotonic() - began
            with pytest.raises(Unavailable, match="no worker is available"):
                await client.submit("late", prompts[0], GREEDY)
            return outs, elapsed
        outs, elapsed = asyncio.run(run())
        assert [error for _, error in outs] == ["unavailable", "unavailable"]
        assert elapsed < 30
    finally:
        stop_replica(replica)


def test_a_killed_scheduler_restarts_and_serves_new_requests(ray_cluster, expected):
    model_dir, prompts, want = expected
    replica = asyncio.run(start_replica(spec("sched", model_dir, 2), 0))
    try:
        async def run():
            client = ReplicaClient(replica)
            started = asyncio.Event()
            tasks = [asyncio.create_task(stream_tokens(client, f"s{i}", ids, started))
                     for i, ids in enumerate(prompts)]
            await started.wait()
            old = await replica.handle.worker_pids.remote()
            ray.kill(replica.handle, no_restart=False)
            began = time.monotonic()
            failed = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            failed_after = time.monotonic() - began
            deadline = time.monotonic() + 120
            while True:   # a retrying client: 503s while the replica restarts
                try:
                    again = await stream_tokens(client, "after", prompts[0])
                    break
                except Unavailable:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.5)
            return failed, failed_after, again, old, await replica.handle.worker_pids.remote()
        failed, failed_after, again, old, new = asyncio.run(run())
        assert {error for _, error in failed} == {"unavailable"} and failed_after < 10
        assert again == (want[0], None)
        assert set(old).isdisjoint(new)   # the old workers died with their scheduler
        assert ray.get_actor(scheduler_name(replica.name), namespace=NAMESPACE)
    finally:
        stop_replica(replica)


def test_a_killed_tensor_parallel_rank_restarts_its_whole_group(ray_cluster, expected):
    """The surviving rank hangs in a collective with the dead one and its process group cannot
    take a new member: both restart, form a new group, and the requests re-prefill there."""
    model_dir, prompts, want = expected
    tp = spec("tpkill", model_dir, 1)
    tp = ReplicaSpec(tp.name, replace(tp.worker, tensor_parallel_size=2), tp.scheduler,
                     tp.num_drafts, tp.workers, cpus_per_worker=0.5)
    replica = asyncio.run(start_replica(tp, 0))
    try:
        async def run():
            client = ReplicaClient(replica)
            before = await replica.handle.worker_pids.remote()
            outs = await kill_worker_after_first_tokens(client, replica, prompts[:2], 1)
            return outs, before, await replica.handle.worker_pids.remote()
        outs, before, after = asyncio.run(run())
        assert outs == [(tokens, None) for tokens in want[:2]]
        assert set(before).isdisjoint(after)   # both ranks are new processes
    finally:
        stop_replica(replica)

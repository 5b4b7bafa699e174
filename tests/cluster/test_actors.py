"""A replica on a real local Ray cluster: named worker actors in one PACK placement group, driven
by the scheduler actor over msgpack, with the same output as the in-process engine."""

from __future__ import annotations

import asyncio

import pytest
import ray
from ray.util import placement_group_table

from conftest import PROMPTS
from metrale.cluster.actor import ReplicaSpec, start_replica, stop_replica
from metrale.cluster.client import ReplicaClient
from metrale.cluster.params import SamplingParams
from metrale.cluster.scheduler import SchedulerConfig
from metrale.cluster.wire import WireError
from metrale.deploy.llm import LLM
from metrale.workers.worker import WorkerConfig

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


class EvenTokens:
    def allowed(self, generated):
        raise AssertionError("never called: the request is refused before it is sent")


@pytest.fixture(scope="module")
def replica(ray_cluster, checkpoint):
    model_dir = checkpoint("qwen3_5")
    spec = ReplicaSpec("actors", WorkerConfig(str(model_dir), "cpu", speculative_method="ngram",
                                               max_drafts=3, block_size=4),
                       SchedulerConfig(max_num_seqs=8), num_drafts=3, workers=2,
                       cpus_per_worker=0.5)
    replica = asyncio.run(start_replica(spec, 0))
    yield model_dir, replica
    stop_replica(replica)


def test_workers_are_named_actors_packed_together(replica):
    _, r = replica
    assert r.name == "actors0"
    for rank in (0, 1):
        assert ray.get_actor(f"metrale-worker-actors0-{rank}", namespace="metrale")
    assert ray.get_actor("metrale-scheduler-actors0", namespace="metrale")
    table = placement_group_table(r.placement)
    assert table["strategy"] == "PACK" and table["state"] == "CREATED"
    assert list(table["bundles"].values()) == [{"CPU": 0.5}, {"CPU": 0.5}]


def test_requests_through_the_scheduler_actor_match_in_process(replica):
    model_dir, r = replica
    llm = LLM(model_dir, device="cpu", speculative_method="ngram", num_drafts=3, block_size=4)
    prompts = [llm.encode(p) for p in PROMPTS]
    expected = llm.generate(prompts, GREEDY)

    async def run():
        client = ReplicaClient(r)

        async def one(i, ids, whole):
            text, tokens, deltas = "", [], 0
            async for d in await client.submit(f"m{i}{whole}", ids, GREEDY, whole):
                text, tokens, deltas = text + d.text, tokens + d.token_ids, deltas + 1
            return text, tokens, deltas
        outs = await asyncio.gather(*(one(i, ids, whole) for i, ids in enumerate(prompts)
                                      for whole in (False, True)))
        return outs, await client.state()
    outs, state = asyncio.run(run())
    streamed, whole = outs[::2], outs[1::2]
    assert [o[:2] for o in streamed] == [(o.text, o.token_ids) for o in expected]
    assert [o[:2] for o in whole] == [(o.text, o.token_ids) for o in expected]
    # not streamed: the first token's delta, then the other 15 tokens and the end in one
    assert all(o[2] == 2 for o in whole) and all(o[2] > 2 for o in streamed)
    assert all(lane["steps"] > 0 for lane in state["lanes"])   # both workers took requests
    assert state["requests"] == 0 and state["spec"]["rounds"] > 0


def test_refusals_reach_the_caller(replica):
    _, r = replica

    async def run():
        client = ReplicaClient(r)
        with pytest.raises(WireError, match="constraint"):
            await client.submit("g", [5, 6], SamplingParams(constraint=EvenTokens()))
        with pytest.raises(ValueError, match="max_model_len"):
            await client.submit("long", [5] * 600, GREEDY)
        return client.in_flight
    assert asyncio.run(run()) == 0

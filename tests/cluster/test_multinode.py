"""Data and tensor parallelism across nodes, on one machine: `ray.cluster_utils.Cluster` starts a
head and two worker nodes of 2 CPUs each. Two replicas of two tensor-parallel ranks land one per
node; a replica whose ranks need a node each spans both. Every layout serves the single-rank
greedy output. The cluster runs in a child process: the session's own Ray stays as it is."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import PROMPTS
from metrale.cluster.params import SamplingParams
from metrale.deploy.llm import LLM

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def run_layouts(model_dir: str, prompts: list[list[int]]) -> dict:
    """In the child: start the fake nodes, the replicas, serve `prompts`; report where it ran."""
    import ray
    from ray.cluster_utils import Cluster
    from ray.util import placement_group_table

    from metrale.cluster.actor import ReplicaSpec, start_replica, stop_replica
    from metrale.cluster.client import ReplicaClient
    from metrale.cluster.scheduler import SchedulerConfig
    from metrale.workers.worker import WorkerConfig

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    workers = [cluster.add_node(num_cpus=2) for _ in range(2)]
    ray.init(address=cluster.address, namespace="metrale", log_to_driver=False)

    async def serve(replicas):
        clients = [ReplicaClient(r) for r in replicas]

        async def one(i, ids):
            tokens = []
            async for d in await clients[i % len(clients)].submit(f"r{i}", ids, GREEDY):
                tokens += d.token_ids
            return tokens
        return await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))

    async def layout(spec, count):
        replicas = [await start_replica(spec, i) for i in range(count)]
        try:
            nodes = [list(placement_group_table(r.placement)["bundles_to_node_id"].values())
                     for r in replicas]
            return {"nodes": nodes, "outputs": await serve(replicas)}
        finally:
            for r in replicas:
                stop_replica(r)

    worker = WorkerConfig(model_dir, "cpu", block_size=4, max_num_seqs=4, tensor_parallel_size=2)
    spec = ReplicaSpec("dp", worker, SchedulerConfig(max_num_seqs=4), None, cpus_per_worker=1)
    try:
        return {"worker_nodes": sorted(n.node_id for n in workers),
                "data_parallel": asyncio.run(layout(spec, 2)),
                "spanning": asyncio.run(layout(replace(spec, name="span", cpus_per_worker=2), 1))}
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_replicas_and_tensor_parallel_ranks_across_nodes(checkpoint, tmp_path):
    model_dir = str(checkpoint("qwen3_5"))
    single = LLM(model_dir, device="cpu", block_size=4, max_num_seqs=4)
    prompts = [single.encode(p) for p in PROMPTS]
    expected = [o.token_ids for o in single.generate(prompts, GREEDY)]
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"model": model_dir, "prompts": prompts}))
    here = Path(__file__).parent
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(here), str(here.parent), env.get("PYTHONPATH", "")])
    child = subprocess.run(
        [sys.executable, "-c", "import json, sys, test_multinode as t; r = json.load(open(sys.argv[1]));"
         " print(json.dumps(t.run_layouts(r['model'], r['prompts'])))", str(request)],
        env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    dp, span = report["data_parallel"], report["spanning"]
    # two replicas of 2 x 1 CPU: PACK keeps each replica's ranks on one node, one replica a node
    assert [len(set(n)) for n in dp["nodes"]] == [1, 1]
    assert sorted(n[0] for n in dp["nodes"]) == report["worker_nodes"]
    # ranks of 2 CPUs each: the tensor-parallel group spans both nodes
    assert sorted(span["nodes"][0]) == report["worker_nodes"]
    assert dp["outputs"] == expected and span["outputs"] == expected

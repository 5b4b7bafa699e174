"""A worker as Ray actors, `metrale-worker-<replica>-<rank>` (one per tensor-parallel rank), and
the msgpack executor that drives them."""

from __future__ import annotations

import asyncio

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from metrale.cluster.plan import StepPlan, StepResult, WorkerCapacity
from metrale.cluster.wire import pack, unpack
from metrale.workers.parallel import join_group, rendezvous_address
from metrale.workers.worker import Worker, WorkerConfig

NAMESPACE = "metrale"


def worker_name(replica: str, rank: int) -> str:
    return f"metrale-worker-{replica}-{rank}"


class WorkerActor:
    """One rank of a Worker (target shard, drafter, KV pages, SSM slot and verify pools) in its own
    process. A worker of one rank loads at once; the ranks of a tensor-parallel worker load when
    they `join` their group."""

    def __init__(self, config: WorkerConfig, tp_rank: int = 0):
        self.config, self.tp_rank = config, tp_rank
        self.worker = Worker(config) if config.tensor_parallel_size == 1 else None

    def rendezvous(self) -> str:
        return rendezvous_address()

    def join(self, address: str) -> None:
        tp = join_group(self.tp_rank, self.config.tensor_parallel_size, address,
                        self.config.torch_device)
        self.worker = Worker(self.config, tp)

    def capacity(self) -> bytes:
        return pack(self.worker.capacity)

    def memory_report(self) -> dict:
        return self.worker.memory_report()

    def execute(self, plan: bytes) -> bytes:
        result = self.worker.execute(unpack(StepPlan, plan))
        return pack(result) if self.tp_rank == 0 else b""   # the ranks' results are the same


def start_worker(config: WorkerConfig, replica: str, rank: int, *, num_gpus: float,
                 num_cpus: float, placement: PlacementGroupSchedulingStrategy, tp_rank: int = 0):
    """Starts the actor in its placement-group bundle; Ray gives it its GPU (CUDA_VISIBLE_DEVICES),
    so the worker's `auto` device is that GPU, or the CPU when num_gpus is 0."""
    return ray.remote(WorkerActor).options(
        name=worker_name(replica, rank), namespace=NAMESPACE, num_gpus=num_gpus, num_cpus=num_cpus,
        scheduling_strategy=placement, max_restarts=0).remote(config, tp_rank)


class ActorExecutor:
    """Sends each step plan to every rank of a worker (one actor, or a tensor-parallel group) and
    returns rank 0's result, both msgpack-encoded."""

    def __init__(self, handles: list, capacity: WorkerCapacity):
        self.handles, self.capacity = handles, capacity

    @classmethod
    async def connect(cls, *handles) -> "ActorExecutor":
        """Sets up the ranks' process group (rank 0 picks the address), waits until they have
        loaded their shards, and learns the worker's capacity."""
        if len(handles) > 1:
            address = await handles[0].rendezvous.remote()
            await asyncio.gather(*(h.join.remote(address) for h in handles))
        return cls(list(handles), unpack(WorkerCapacity, await handles[0].capacity.remote()))

    async def execute(self, plan: StepPlan) -> StepResult:
        data = pack(plan)
        results = await asyncio.gather(*(h.execute.remote(data) for h in self.handles))
        return unpack(StepResult, results[0])

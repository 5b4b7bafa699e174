"""A worker as a Ray actor, `metrale-worker-<replica>-<rank>`, and its msgpack executor."""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from metrale.cluster.plan import StepPlan, StepResult, WorkerCapacity
from metrale.cluster.wire import pack, unpack
from metrale.workers.worker import Worker, WorkerConfig

NAMESPACE = "metrale"


def worker_name(replica: str, rank: int) -> str:
    return f"metrale-worker-{replica}-{rank}"


class WorkerActor:
    """One Worker (target, drafter, KV pages, SSM slot and verify pools) in its own process."""

    def __init__(self, config: WorkerConfig):
        self.worker = Worker(config)

    def capacity(self) -> bytes:
        return pack(self.worker.capacity)

    def memory_report(self) -> dict:
        return self.worker.memory_report()

    def execute(self, plan: bytes) -> bytes:
        return pack(self.worker.execute(unpack(StepPlan, plan)))


def start_worker(config: WorkerConfig, replica: str, rank: int, *, num_gpus: float,
                 num_cpus: float, placement: PlacementGroupSchedulingStrategy):
    """Starts the actor in its placement-group bundle; Ray gives it its GPU (CUDA_VISIBLE_DEVICES),
    so the worker's `auto` device is that GPU, or the CPU when num_gpus is 0."""
    return ray.remote(WorkerActor).options(
        name=worker_name(replica, rank), namespace=NAMESPACE, num_gpus=num_gpus, num_cpus=num_cpus,
        scheduling_strategy=placement, max_restarts=0).remote(config)


class ActorExecutor:
    """Sends each step plan to a worker actor and waits for its result, both msgpack-encoded."""

    def __init__(self, handle, capacity: WorkerCapacity):
        self.handle, self.capacity = handle, capacity

    @classmethod
    async def connect(cls, handle) -> "ActorExecutor":
        """Waits until the actor has loaded its model, and learns its capacity."""
        return cls(handle, unpack(WorkerCapacity, await handle.capacity.remote()))

    async def execute(self, plan: StepPlan) -> StepResult:
        return unpack(StepResult, await self.handle.execute.remote(pack(plan)))

"""A worker as a Ray actor, `metrale-worker-<replica>-<rank>`, and its msgpack executor."""

from __future__ import annotations

import asyncio
import os
import uuid

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from metrale.cluster.executor import WorkerLost
from metrale.cluster.plan import StepPlan, StepResult, WorkerCapacity
from metrale.cluster.wire import pack, unpack
from metrale.workers.worker import Worker, WorkerConfig

NAMESPACE = "metrale"
PING_TIMEOUT_S = 10.0        # an idle worker that does not answer a ping within this is lost
RESTART_POLL_S = 0.5


class StaleWorker(RuntimeError):
    """A step planned for a worker's previous life: the actor restarted, its caches are empty."""


def worker_name(replica: str, rank: int) -> str:
    return f"metrale-worker-{replica}-{rank}"


class WorkerActor:
    """One Worker (target, drafter, KV pages, SSM slot and verify pools) in its own process."""

    def __init__(self, config: WorkerConfig):
        self.worker = Worker(config)
        self.incarnation = uuid.uuid4().hex   # Ray restarts a dead actor with a new one

    def hello(self) -> tuple[bytes, str]:
        """Its capacity and incarnation, once the model is loaded."""
        return pack(self.worker.capacity), self.incarnation

    def ping(self) -> str:
        return self.incarnation

    def pid(self) -> int:
        return os.getpid()

    def memory_report(self) -> dict:
        return self.worker.memory_report()

    def execute(self, plan: bytes, incarnation: str) -> bytes:
        if incarnation != self.incarnation:
            raise StaleWorker("this worker restarted since the plan's scheduler last saw it")
        return pack(self.worker.execute(unpack(StepPlan, plan)))


def start_worker(config: WorkerConfig, replica: str, rank: int, *, num_gpus: float,
                 num_cpus: float, placement: PlacementGroupSchedulingStrategy,
                 max_restarts: int = -1):
    """Starts the actor in its placement-group bundle; Ray gives it its GPU (CUDA_VISIBLE_DEVICES),
    so the worker's `auto` device is that GPU, or the CPU when num_gpus is 0. Ray restarts a dead
    worker in the same bundle up to `max_restarts` times (-1: always)."""
    return ray.remote(WorkerActor).options(
        name=worker_name(replica, rank), namespace=NAMESPACE, num_gpus=num_gpus, num_cpus=num_cpus,
        scheduling_strategy=placement, max_restarts=max_restarts).remote(config)


class ActorExecutor:
    """Sends each step plan to a worker actor and waits for its result, both msgpack-encoded. Every
    call names the incarnation it expects, so a restarted worker's empty caches are never used for
    sequences planned against the old ones; a dead or restarted worker raises WorkerLost."""

    def __init__(self, handle):
        self.handle = handle
        self.capacity: WorkerCapacity | None = None
        self.incarnation = ""

    @classmethod
    async def connect(cls, handle) -> "ActorExecutor":
        """Waits until the actor has loaded its model, and learns its capacity."""
        executor = cls(handle)
        await executor._hello()
        return executor

    async def execute(self, plan: StepPlan) -> StepResult:
        try:
            data = await self.handle.execute.remote(pack(plan), self.incarnation)
        except (ray.exceptions.RayActorError, StaleWorker) as e:
            raise WorkerLost(str(e).splitlines()[0]) from None
        return unpack(StepResult, data)

    async def ping(self) -> None:
        try:
            incarnation = await asyncio.wait_for(self.handle.ping.remote(), PING_TIMEOUT_S)
        except (ray.exceptions.RayActorError, TimeoutError) as e:
            raise WorkerLost(f"no answer to a ping ({type(e).__name__})") from None
        if incarnation != self.incarnation:
            raise WorkerLost("the worker restarted")

    async def reconnect(self) -> None:
        """Waits for Ray to restart the actor and for it to load the model."""
        while True:
            try:
                return await self._hello()
            except ray.exceptions.ActorUnavailableError:   # restarting
                await asyncio.sleep(RESTART_POLL_S)
            except ray.exceptions.RayActorError as e:       # dead for good
                raise WorkerLost(str(e).splitlines()[0]) from None

    async def _hello(self) -> None:
        capacity, self.incarnation = await self.handle.hello.remote()
        self.capacity = unpack(WorkerCapacity, capacity)

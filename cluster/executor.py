"""How a replica reaches a worker: the executor interface, and the in-process executor."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from metrale.cluster.plan import StepPlan, StepResult, WorkerCapacity


class WorkerLost(RuntimeError):
    """The worker's process is gone, and its KV pages, slots and pools with it."""


class WorkerExecutor(Protocol):
    """Runs step plans on one worker: a Ray actor or an in-process worker stands behind it."""
    capacity: WorkerCapacity

    async def execute(self, plan: StepPlan) -> StepResult:
        """The step's result; WorkerLost when the worker died (or was replaced) since the last."""

    async def ping(self) -> None:
        """Returns while the worker is alive; raises WorkerLost otherwise."""

    async def reconnect(self) -> None:
        """Waits until a restarted worker has loaded its model; WorkerLost if none will come."""


class LocalExecutor:
    """A worker in this process. Steps run on the worker's own thread, so the event loop keeps
    streaming and admitting while the model computes, two workers' steps overlap, and one
    worker's plans run one at a time in the order they were sent (as an actor runs them). A
    step left in flight on the device (`Worker.launch`) is read on a second thread, so the
    worker's thread launches the next plan meanwhile."""

    def __init__(self, worker):
        self.worker = worker
        self.capacity: WorkerCapacity = worker.capacity
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="metrale-worker")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="metrale-reader")

    async def execute(self, plan: StepPlan) -> StepResult:
        loop = asyncio.get_running_loop()
        step = await loop.run_in_executor(self._thread, self.worker.launch, plan)
        if step.read:   # it ran to its end at launch
            return step.result()
        return await loop.run_in_executor(self._reader, step.result)

    async def ping(self) -> None:
        pass

    async def reconnect(self) -> None:
        raise WorkerLost("an in-process worker is not restarted")

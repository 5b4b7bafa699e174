"""How a replica reaches a worker: the executor interface, and the in-process executor."""

from __future__ import annotations

import asyncio
from typing import Protocol

from metrale.cluster.plan import StepPlan, StepResult, WorkerCapacity


class WorkerExecutor(Protocol):
    """Runs step plans on one worker: a Ray actor or an in-process worker stands behind it."""
    capacity: WorkerCapacity

    async def execute(self, plan: StepPlan) -> StepResult: ...


class LocalExecutor:
    """A worker in this process. Steps run on a thread, so the event loop keeps streaming and
    admitting while the model computes, and two workers' steps overlap."""

    def __init__(self, worker):
        self.worker = worker
        self.capacity: WorkerCapacity = worker.capacity

    async def execute(self, plan: StepPlan) -> StepResult:
        return await asyncio.to_thread(self.worker.execute, plan)

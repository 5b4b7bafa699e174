"""A model replica's serving loop: a scheduler per worker, each stepping on its own; deltas out."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Callable

from tokenizers import Tokenizer

from metrale.cluster.executor import WorkerExecutor
from metrale.cluster.params import SamplingParams
from metrale.cluster.plan import WorkerCapacity
from metrale.cluster.scheduler import Scheduler, SchedulerConfig
from metrale.cluster.stream import Delta, OutputStream
from metrale.drafting.stats import SpecStats

log = logging.getLogger(__name__)

DEFAULT_DRAFTS = 3   # drafts per round when a proposer is set and num_drafts is not


def drafts_per_round(requested: int | None, capacity: WorkerCapacity) -> int:
    """The draft-length policy's default: DFlash's block size - 1, else DEFAULT_DRAFTS; none
    without a proposer. The scheduler then clamps it per slot and per round."""
    if requested is not None:
        return requested
    return (capacity.fixed_drafts or DEFAULT_DRAFTS) if capacity.has_proposer else 0


@dataclass
class Lane:
    """One worker and the scheduler that plans for it: its own KV blocks, slots and step loop."""
    executor: WorkerExecutor
    scheduler: Scheduler
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    steps: int = 0

    @property
    def load(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    def snapshot(self) -> "LaneLoad":
        s = self.scheduler
        return LaneLoad(len(s.waiting), len(s.running), s.blocks.num_free, s.blocks.num_blocks,
                        s.slots.num_free, s.capacity.num_slots, self.steps, s.num_preemptions)


@dataclass
class LaneLoad:
    """A lane's state for metrics, routing and tests."""
    waiting: int
    running: int
    free_blocks: int
    num_blocks: int
    free_slots: int
    num_slots: int
    steps: int
    preemptions: int

    @property
    def kv_usage(self) -> float:
        return 1 - self.free_blocks / self.num_blocks

    @property
    def slot_usage(self) -> float:
        return 1 - self.free_slots / self.num_slots


class ReplicaEngine:
    """Requests in, per-request deltas out. New requests go to the least-loaded worker; each
    worker's loop plans, executes and commits without waiting for the others."""

    def __init__(self, executors: list[WorkerExecutor], config: SchedulerConfig,
                 tokenizer: Tokenizer):
        self.lanes = [Lane(e, Scheduler(config, e.capacity, tokenizer)) for e in executors]
        self.streams: dict[str, tuple[Lane, OutputStream]] = {}
        self._tasks: list[asyncio.Task] = []

    @classmethod
    def build(cls, executors: list[WorkerExecutor], config: SchedulerConfig,
              num_drafts: int | None, tokenizer: Tokenizer) -> "ReplicaEngine":
        """An engine whose drafts per round default from the workers' proposer."""
        drafts = drafts_per_round(num_drafts, executors[0].capacity)
        return cls(executors, replace(config, num_drafts=drafts), tokenizer)

    @property
    def max_model_len(self) -> int:
        return min(lane.scheduler.max_model_len for lane in self.lanes)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._serve(lane)) for lane in self.lanes]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    sink: Callable[[Delta], None]) -> None:
        """Queues a request on the least-loaded worker; raises RequestError naming the problem."""
        lane = min(self.lanes, key=lambda ln: ln.load)
        seqs = lane.scheduler.add_request(request_id, prompt_ids, params)
        self.streams[request_id] = (lane, OutputStream(request_id, seqs, sink))
        lane.wake.set()

    def abort(self, request_id: str) -> None:
        """Frees the request's slots and blocks now; a step in flight finds its sequences gone."""
        entry = self.streams.pop(request_id, None)
        if entry is not None:
            entry[0].scheduler.abort(request_id)

    async def generate(self, request_id: str, prompt_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[Delta]:
        """The request's deltas until every completion has finished; closing early aborts it."""
        queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.add_request(request_id, prompt_ids, params, queue.put_nowait)
        open_ = params.n
        try:
            while open_:
                delta = await queue.get()
                open_ -= delta.finish_reason is not None
                yield delta
        finally:
            if open_:
                self.abort(request_id)

    # -- state ------------------------------------------------------------------------------

    def loads(self) -> list[LaneLoad]:
        return [lane.snapshot() for lane in self.lanes]

    def spec_stats(self) -> SpecStats:
        total = SpecStats()
        for lane in self.lanes:
            total.merge(lane.scheduler.stats)
        return total

    # -- the step loop of one worker --------------------------------------------------------

    async def _serve(self, lane: Lane) -> None:
        while True:
            await lane.wake.wait()
            plan = lane.scheduler.schedule() if lane.scheduler.has_work else None
            if not plan or not plan.work:
                lane.wake.clear()
                continue
            try:
                result = await lane.executor.execute(plan)
            except Exception as e:  # its requests end with the error; other workers go on
                log.exception("worker step failed")
                self._fail_lane(lane, f"worker failed: {e}")
                continue
            lane.steps += 1
            for seq in lane.scheduler.update(plan, result):
                entry = self.streams.get(seq.request_id)
                if entry is None:
                    continue
                stream = entry[1]
                stream.emit(seq)
                if stream.done:
                    lane.scheduler.pop_finished(seq.request_id)
                    del self.streams[seq.request_id]

    def _fail_lane(self, lane: Lane, message: str) -> None:
        for request_id, (owner, stream) in list(self.streams.items()):
            if owner is lane:
                stream.fail(message)
                self.abort(request_id)

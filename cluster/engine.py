"""A model replica's serving loop: a scheduler per worker, each stepping on its own; deltas out."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Callable

from tokenizers import Tokenizer

from metrale.cluster.executor import WorkerExecutor, WorkerLost
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


class Overloaded(RuntimeError):
    """The replica holds as many requests as it may take; the caller retries later (HTTP 429)."""


class Unavailable(RuntimeError):
    """No worker is alive or restarting to serve the request (HTTP 503)."""


UP, REVIVING, DOWN = "up", "reviving", "down"
HEALTH_INTERVAL_S = 2.0   # how often idle workers are pinged


@dataclass
class Lane:
    """One worker and the scheduler that plans for it: its own KV blocks, slots and step loop."""
    executor: WorkerExecutor
    scheduler: Scheduler
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    steps: int = 0
    state: str = UP       # up, reviving (its worker restarts), or down for good
    restarts: int = 0
    in_flight: set = field(default_factory=set)   # its steps' tasks, sent and not yet taken
    last: asyncio.Task | None = None               # the step task sent last

    @property
    def busy(self) -> bool:
        return bool(self.in_flight)

    @property
    def load(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    def snapshot(self) -> "LaneLoad":
        s = self.scheduler
        return LaneLoad(len(s.waiting), len(s.running), s.blocks.num_free, s.blocks.num_blocks,
                        s.slots.num_free, s.capacity.num_slots, self.steps, s.num_preemptions,
                        self.state, self.restarts, s.drafts.last_k)


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
    state: str = UP
    restarts: int = 0
    draft_length: int = 0   # the draft policy's k for the latest round

    @property
    def kv_usage(self) -> float:
        return 1 - self.free_blocks / self.num_blocks

    @property
    def slot_usage(self) -> float:
        return 1 - self.free_slots / self.num_slots


class ReplicaEngine:
    """Requests in, per-request deltas out. New requests go to the least-loaded worker; each
    worker's loop plans, executes and commits without waiting for the others.

    When a worker dies, its requests move to the least-loaded live worker (or wait for it to
    restart) and re-prefill their prompt plus the tokens already emitted; their output streams go
    on where they stopped, so a client sees each token once. With no worker alive or restarting,
    requests end with an `unavailable` error."""

    def __init__(self, executors: list[WorkerExecutor], config: SchedulerConfig,
                 tokenizer: Tokenizer, max_pending: int | None = None,
                 restart_timeout_s: float = 600.0):
        self.config, self.tokenizer = config, tokenizer
        self.max_pending, self.restart_timeout_s = max_pending, restart_timeout_s
        self.lanes = [Lane(e, Scheduler(config, e.capacity, tokenizer)) for e in executors]
        self.streams: dict[str, tuple[Lane, OutputStream]] = {}
        self._tasks: list[asyncio.Task] = []

    @classmethod
    def build(cls, executors: list[WorkerExecutor], config: SchedulerConfig,
              num_drafts: int | None, tokenizer: Tokenizer, **limits) -> "ReplicaEngine":
        """An engine whose drafts per round default from the workers' proposer."""
        drafts = drafts_per_round(num_drafts, executors[0].capacity)
        return cls(executors, replace(config, num_drafts=drafts), tokenizer, **limits)

    @property
    def max_model_len(self) -> int:
        return min(lane.scheduler.max_model_len for lane in self.lanes)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._serve(lane)) for lane in self.lanes]
        self._tasks.append(asyncio.create_task(self._watch()))

    async def stop(self) -> None:
        tasks = self._tasks + [t for lane in self.lanes for t in lane.in_flight]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    sink: Callable[[Delta], None], streamed: bool = True) -> None:
        """Queues a request on the least-loaded worker. Raises RequestError naming a problem with
        the request, Overloaded when the replica is full, Unavailable when no worker is left.
        A request not `streamed` is read only when it ends (Scheduler.add_request)."""
        if self.max_pending is not None and len(self.streams) >= self.max_pending:
            raise Overloaded(f"over capacity: the replica holds {len(self.streams)} requests; "
                             f"retry later")
        lane = self._least_loaded()
        if lane is None:
            raise Unavailable("no worker is available: every worker of this replica has died")
        seqs = lane.scheduler.add_request(request_id, prompt_ids, params, streamed)
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

    def steps_in_flight(self, lane: Lane) -> int:
        """Plans a worker holds at once. Planned ahead (plain decoding), the second plan carries
        the same sequences one token on, so the worker never waits for the next plan. Otherwise
        two plans must split the sequences: on a CPU a step of half the sequences costs about
        half a step of all, so two halves alternate; on a GPU a smaller batch costs almost as
        much as a full one, so one plan at a time."""
        configured = self.config.steps_in_flight
        on_gpu = lane.executor.capacity.on_gpu
        return configured or (1 if on_gpu and not lane.scheduler.plans_ahead else 2)

    async def _serve(self, lane: Lane) -> None:
        """Keeps the worker's queue full: up to `steps_in_flight` plans of disjoint sequences are
        sent before the first result is back. A worker runs its plans one after another, in the
        order sent, so a block or slot freed while a step flies is rewritten only after it."""
        depth = self.steps_in_flight(lane)
        while True:
            await lane.wake.wait()
            lane.wake.clear()
            while lane.state == UP and len(lane.in_flight) < depth:
                scheduler = lane.scheduler
                plan = scheduler.schedule(scheduler.share(depth))
                if not plan.work:
                    break
                lane.last = asyncio.create_task(self._step(lane, scheduler, plan, lane.last))
                lane.in_flight.add(lane.last)

    async def _step(self, lane: Lane, scheduler: Scheduler, plan, before) -> None:
        """Executes one plan and streams its tokens; then the lane plans again. A result that
        arrives after the lane's requests moved elsewhere (its worker was lost) is dropped."""
        try:
            await self._execute(lane, scheduler, plan, before)
        finally:
            lane.in_flight.discard(asyncio.current_task())
            lane.wake.set()

    async def _execute(self, lane: Lane, scheduler: Scheduler, plan, before) -> None:
        try:
            result = await lane.executor.execute(plan)
            if before is not None:   # results are taken in the order sent: a plan made ahead
                await asyncio.wait([before])   # extends the sequences its predecessor did
        except WorkerLost as e:
            if lane.scheduler is scheduler:
                self._lost(lane, str(e))
            return
        except Exception as e:  # its requests end with the error; other workers go on
            log.exception("worker step failed")
            scheduler.forget(plan)
            self._fail_lane(lane, f"worker failed: {e}", "internal")
            return
        if lane.scheduler is not scheduler:
            return
        lane.steps += 1
        for seq in scheduler.update(plan, result):
            entry = self.streams.get(seq.request_id)
            if entry is None:
                continue
            stream = entry[1]
            stream.emit(seq)
            if stream.done:
                scheduler.pop_finished(seq.request_id)
                del self.streams[seq.request_id]

    def _fail_lane(self, lane: Lane, message: str, kind: str) -> None:
        for request_id, (owner, stream) in list(self.streams.items()):
            if owner is lane:
                stream.fail(message, kind)
                self.abort(request_id)

    # -- worker failure ---------------------------------------------------------------------

    async def _watch(self) -> None:
        """Pings idle workers, so a dead one is found before a request is sent its way (a busy
        one's failure surfaces in its step)."""
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            idle = [lane for lane in self.lanes if lane.state == UP and not lane.busy]
            found = await asyncio.gather(*(lane.executor.ping() for lane in idle),
                                         return_exceptions=True)
            for lane, error in zip(idle, found):
                if isinstance(error, WorkerLost) and lane.state == UP and not lane.busy:
                    self._lost(lane, str(error))

    def _lost(self, lane: Lane, reason: str) -> None:
        """Moves the lane's requests to live workers, and waits for its worker's restart."""
        index = self.lanes.index(lane)
        log.error("worker %d lost (%s); re-queueing its %d requests", index, reason,
                  len(lane.scheduler.by_request))
        lane.state = REVIVING
        orphans = lane.scheduler.evacuate()
        lane.scheduler = self._fresh_scheduler(lane)   # the worker's caches are gone
        self._place(orphans)
        self._tasks.append(asyncio.create_task(self._revive(lane, index)))

    async def _revive(self, lane: Lane, index: int) -> None:
        try:
            await asyncio.wait_for(lane.executor.reconnect(), self.restart_timeout_s)
        except Exception as e:   # WorkerLost, TimeoutError, or a restarted worker failing to load
            log.error("worker %d is not coming back (%s)", index, e or type(e).__name__)
            lane.state = DOWN
            self._place(lane.scheduler.evacuate())
            return
        lane.restarts += 1
        lane.state = UP
        log.warning("worker %d restarted; it takes requests again", index)
        lane.wake.set()

    def _place(self, orphans: list[tuple[str, list]]) -> None:
        """Gives each request to the least-loaded live (else restarting) worker; with none left,
        it ends with an `unavailable` error."""
        for request_id, seqs in orphans:
            entry = self.streams.get(request_id)
            if entry is None:
                continue
            lane = self._least_loaded()
            if lane is None:
                entry[1].fail("no worker is available: every worker of this replica has died",
                              "unavailable")
                del self.streams[request_id]
                continue
            lane.scheduler.adopt(request_id, seqs)
            self.streams[request_id] = (lane, entry[1])
            lane.wake.set()

    def _least_loaded(self) -> Lane | None:
        for state in (UP, REVIVING):
            lanes = [lane for lane in self.lanes if lane.state == state]
            if lanes:
                return min(lanes, key=lambda ln: ln.load)
        return None

    def _fresh_scheduler(self, lane: Lane) -> Scheduler:
        scheduler = Scheduler(self.config, lane.executor.capacity, self.tokenizer)
        # the restarted worker is as fast and its drafter as good: keep what was measured
        scheduler.stats, scheduler.num_preemptions, scheduler.drafts = \
            lane.scheduler.stats, lane.scheduler.num_preemptions, lane.scheduler.drafts
        return scheduler

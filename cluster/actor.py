"""A model replica on Ray: its placement group, its scheduler actor, and that actor's workers."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from tokenizers import Tokenizer

from metrale.cluster.engine import Overloaded, ReplicaEngine, Unavailable
from metrale.cluster.metrics import ReplicaMetrics
from metrale.cluster.params import RequestError, SamplingParams
from metrale.cluster.scheduler import SchedulerConfig
from metrale.cluster.stream import Delta
from metrale.cluster.wire import WireError, pack, unpack
from metrale.workers.actor import NAMESPACE, ActorExecutor, start_worker
from metrale.workers.worker import WorkerConfig

log = logging.getLogger(__name__)

POLL_TIMEOUT_S = 1.0      # a long poll returns empty after this, so a consumer notices shutdown
METRICS_INTERVAL_S = 1.0
PLACEMENT_NOTE_S = 30.0
CONSUMER_TIMEOUT_S = 30.0  # a consumer that has not polled for this long is gone: abort its requests
NAME_WAIT_S = 30.0        # a restarted scheduler waits this long for its old workers' names


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica of a deployment runs, and what each of its workers reserves."""
    name: str                    # replica i is "<name><i>" in actor names
    worker: WorkerConfig
    scheduler: SchedulerConfig
    num_drafts: int | None       # None: the proposer's default
    workers: int = 1
    gpus_per_worker: float = 0.0
    cpus_per_worker: float = 1.0
    max_pending: int | None = None    # requests the replica holds before refusing (overloaded)
    worker_restarts: int = -1         # times Ray restarts a dead worker (-1: always)
    restart_timeout_s: float = 600.0  # how long requests wait for a restarting worker

    @property
    def ranks(self) -> int:
        """Worker actors per lane: the tensor-parallel size (each actor one bundle, one GPU)."""
        return self.worker.tensor_parallel_size

    def bundles(self) -> list[dict[str, float]]:
        bundle = {"CPU": self.cpus_per_worker, "GPU": self.gpus_per_worker}
        return [{k: v for k, v in bundle.items() if v}] * (self.workers * self.ranks)


@dataclass
class Replica:
    name: str
    handle: object               # the scheduler actor
    placement: PlacementGroup
    max_model_len: int


class SchedulerActor:
    """A ReplicaEngine over this replica's worker actors. Consumers (the HTTP ingress, the batch
    driver) submit requests and long-poll their deltas: one call carries a step's worth for all.
    Everything a client sent arrives msgpack-encoded. The replica starts on its first call, so an
    actor that Ray restarted after a crash starts afresh (new workers, no requests)."""

    def __init__(self, spec: ReplicaSpec, replica: str, pg: PlacementGroup):
        self.spec, self.replica, self.pg = spec, replica, pg
        self.handles: list = []   # lane i's tensor-parallel ranks are i * ranks .. (i + 1) * ranks - 1
        self.engine: ReplicaEngine | None = None
        self._starting: asyncio.Future | None = None
        self.outboxes: dict[str, list[Delta]] = {}
        # completions not streamed: those whose first delta went out, and their deltas since
        self.started: set[tuple[str, int]] = set()
        self.held: dict[tuple[str, int], Delta] = {}
        self.arrived: dict[str, asyncio.Event] = {}
        self.owners: dict[str, str] = {}          # request id -> consumer
        self.last_poll: dict[str, float] = {}     # consumer -> when it last polled
        self.metrics = ReplicaMetrics(replica)

    async def ready(self) -> int:
        """Waits until every worker has loaded its model; returns the replica's max_model_len."""
        return (await self._started()).max_model_len

    async def submit(self, consumer: str, request_id: str, prompt_ids: bytes,
                     params: bytes, whole: bool = False) -> tuple[str, str] | None:
        """Queues a request whose deltas go to `consumer`'s outbox; returns why it was refused
        as (invalid | overloaded | unavailable, message). A `whole` request (not streamed) gets
        each completion's first delta at once and the rest merged into one, with its end."""
        engine = await self._started()
        deliver = self._deliver_whole if whole else self._deliver
        try:
            engine.add_request(request_id, unpack(list[int], prompt_ids),
                               unpack(SamplingParams, params),
                               functools.partial(deliver, consumer), streamed=not whole)
        except (RequestError, WireError) as e:
            return "invalid", str(e)
        except Overloaded as e:
            return "overloaded", str(e)
        except Unavailable as e:
            return "unavailable", str(e)
        self.owners[request_id] = consumer
        self.last_poll[consumer] = time.monotonic()
        return None

    def abort(self, request_id: str) -> None:
        if self.engine is not None:
            self.engine.abort(request_id)
        for key in [k for k in self.started if k[0] == request_id]:
            self.started.discard(key)
            self.held.pop(key, None)

    async def poll(self, consumer: str, aborts: list[str] = ()) -> bytes:
        """Aborts the consumer's requests in `aborts`, then returns its deltas since its last
        poll, as soon as there are any."""
        for request_id in aborts:
            self.abort(request_id)
        arrived = self.arrived.setdefault(consumer, asyncio.Event())
        self.last_poll[consumer] = time.monotonic()
        try:
            await asyncio.wait_for(arrived.wait(), POLL_TIMEOUT_S)
        except TimeoutError:
            pass
        arrived.clear()
        self.last_poll[consumer] = time.monotonic()
        return pack(self.outboxes.pop(consumer, []))

    async def state(self) -> dict:
        """Per-worker queues, KV blocks, slots and draft policies, and speculation totals
        (tests, operators)."""
        engine = await self._started()
        return {"lanes": [vars(load) for load in engine.loads()],
                "requests": len(engine.streams),
                "outboxes": sum(map(len, self.outboxes.values())),
                "spec": engine.spec_stats().as_dict(),
                "draft_policies": [lane.scheduler.drafts.as_dict() for lane in engine.lanes]}

    async def memory_reports(self) -> list[dict]:
        await self._started()
        return list(await asyncio.gather(*(h.memory_report.remote() for h in self.handles)))

    async def worker_pids(self) -> list[int]:
        """The worker processes' ids (tests kill them)."""
        await self._started()
        return list(await asyncio.gather(*(h.pid.remote() for h in self.handles)))

    async def _started(self) -> ReplicaEngine:
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start())
        return await asyncio.shield(self._starting)

    async def _start(self) -> ReplicaEngine:
        spec = self.spec
        self.handles = [await self._start_worker(rank)
                        for rank in range(spec.workers * spec.ranks)]
        n = spec.ranks
        executors = await asyncio.gather(*(ActorExecutor.connect(*self.handles[i:i + n])
                                           for i in range(0, len(self.handles), n)))
        tokenizer = Tokenizer.from_file(str(Path(spec.worker.model) / "tokenizer.json"))
        self.engine = ReplicaEngine.build(list(executors), spec.scheduler, spec.num_drafts,
                                          tokenizer, max_pending=spec.max_pending,
                                          restart_timeout_s=spec.restart_timeout_s)
        self.engine.start()
        asyncio.get_running_loop().create_task(self._report_metrics())
        return self.engine

    async def _start_worker(self, rank: int):
        """Starts worker `rank`; after a crash of this actor, Ray is still removing the previous
        workers (they die with their owner), so their names may be taken for a moment."""
        spec, waited = self.spec, 0.0
        while True:
            try:
                return start_worker(spec.worker, self.replica, rank, num_gpus=spec.gpus_per_worker,
                                    num_cpus=spec.cpus_per_worker, tp_rank=rank % spec.ranks,
                                    placement=PlacementGroupSchedulingStrategy(self.pg, rank),
                                    max_restarts=spec.worker_restarts)
            except ValueError:   # the name is taken
                if waited >= NAME_WAIT_S:
                    raise
                await asyncio.sleep(0.5)
                waited += 0.5

    def _deliver(self, consumer: str, delta: Delta) -> None:
        self.outboxes.setdefault(consumer, []).append(delta)
        self.arrived.setdefault(consumer, asyncio.Event()).set()

    def _deliver_whole(self, consumer: str, delta: Delta) -> None:
        """A completion that is not streamed: its first delta goes out at once (the consumer
        times the first token by it), the later ones wait here, merged, until its last, so the
        consumer is not woken every step."""
        key = (delta.request_id, delta.index)
        if key not in self.started:
            if delta.finish_reason is None:
                self.started.add(key)
            self._deliver(consumer, delta)
            return
        held = self.held.pop(key, None)
        if held is not None:
            delta = held.extend(delta)
        if delta.finish_reason is None:
            self.held[key] = delta
        else:
            self.started.discard(key)
            self._deliver(consumer, delta)

    async def _report_metrics(self) -> None:
        while True:
            self.metrics.report(self.engine.loads(), self.engine.spec_stats())
            self._drop_gone_consumers()
            await asyncio.sleep(METRICS_INTERVAL_S)

    def _drop_gone_consumers(self) -> None:
        """Aborts the requests of consumers that stopped polling (an ingress replica or batch
        driver that died), so their deltas do not pile up here."""
        now = time.monotonic()
        gone = {c for c, t in self.last_poll.items() if now - t > CONSUMER_TIMEOUT_S}
        for request_id, consumer in list(self.owners.items()):
            if consumer in gone or request_id not in self.engine.streams:
                del self.owners[request_id]
                if consumer in gone:
                    self.abort(request_id)
        for consumer in gone:
            log.warning("consumer %s stopped polling; its requests were aborted", consumer)
            for table in (self.last_poll, self.outboxes, self.arrived):
                table.pop(consumer, None)


def scheduler_name(replica: str) -> str:
    return f"metrale-scheduler-{replica}"


async def start_replica(spec: ReplicaSpec, index: int, timeout_s: float = 600) -> Replica:
    """Reserves the replica's workers together (one PACK placement group, one bundle per worker),
    starts its scheduler actor there, and waits until the workers have loaded the model."""
    name = f"{spec.name}{index}"
    pg = placement_group(spec.bundles(), strategy="PACK", name=f"metrale-{name}")
    if not await _placed(pg, name, spec, timeout_s):
        remove_placement_group(pg)
        raise RuntimeError(f"replica {name}: the cluster cannot place {len(spec.bundles())} worker(s) of "
                           f"{spec.bundles()[0]} within {timeout_s:.0f}s (it has "
                           f"{ray.cluster_resources()})")
    handle = ray.remote(SchedulerActor).options(
        name=scheduler_name(name), namespace=NAMESPACE, num_cpus=0, max_restarts=-1,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0)).remote(spec, name, pg)
    try:
        max_model_len = await handle.ready.remote()
    except Exception:
        stop_replica(Replica(name, handle, pg, 0))
        raise
    return Replica(name, handle, pg, max_model_len)


async def _placed(pg: PlacementGroup, name: str, spec: ReplicaSpec, timeout_s: float) -> bool:
    """Waits for the reservation, saying every half minute what it waits for (a cluster may be
    scaling up; a too-small one never will)."""
    ready = asyncio.ensure_future(_resolved(pg.ready()))
    waited = 0.0
    while waited < timeout_s:
        if (await asyncio.wait({ready}, timeout=PLACEMENT_NOTE_S))[0]:
            return True
        waited += PLACEMENT_NOTE_S
        log.warning("replica %s: waiting %.0fs for %d worker(s) of %s; the cluster has %s free",
                    name, waited, len(spec.bundles()), spec.bundles()[0], ray.available_resources())
    ready.cancel()
    return False


async def _resolved(ref):
    return await ref


def stop_replica(replica: Replica) -> None:
    """Kills the scheduler actor (its workers die with their owner), frees the reservation."""
    ray.kill(replica.handle)
    remove_placement_group(replica.placement)

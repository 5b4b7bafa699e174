"""A model replica on Ray: its placement group, its scheduler actor, and that actor's workers."""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from tokenizers import Tokenizer

from metrale.cluster.engine import ReplicaEngine
from metrale.cluster.metrics import ReplicaMetrics
from metrale.cluster.params import RequestError, SamplingParams
from metrale.cluster.scheduler import SchedulerConfig
from metrale.cluster.stream import Delta
from metrale.cluster.wire import pack, unpack
from metrale.workers.actor import NAMESPACE, ActorExecutor, start_worker
from metrale.workers.worker import WorkerConfig

log = logging.getLogger(__name__)

POLL_TIMEOUT_S = 1.0      # a long poll returns empty after this, so a consumer notices shutdown
METRICS_INTERVAL_S = 1.0
PLACEMENT_NOTE_S = 30.0


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
    driver) submit requests and long-poll their deltas: one call carries a step's worth for all."""

    def __init__(self, spec: ReplicaSpec, replica: str, pg: PlacementGroup):
        self.spec, self.replica = spec, replica
        # lane i's tensor-parallel ranks are actors i * ranks .. (i + 1) * ranks - 1
        self.handles = [start_worker(spec.worker, replica, rank, num_gpus=spec.gpus_per_worker,
                                     num_cpus=spec.cpus_per_worker, tp_rank=rank % spec.ranks,
                                     placement=PlacementGroupSchedulingStrategy(pg, rank))
                        for rank in range(spec.workers * spec.ranks)]
        self.engine: ReplicaEngine | None = None
        self.outboxes: dict[str, list[Delta]] = {}
        self.arrived: dict[str, asyncio.Event] = {}
        self.metrics = ReplicaMetrics(replica)

    async def ready(self) -> int:
        """Waits until every worker has loaded its model; returns the replica's max_model_len."""
        n = self.spec.ranks
        executors = await asyncio.gather(*(ActorExecutor.connect(*self.handles[i:i + n])
                                           for i in range(0, len(self.handles), n)))
        tokenizer = Tokenizer.from_file(str(Path(self.spec.worker.model) / "tokenizer.json"))
        self.engine = ReplicaEngine.build(list(executors), self.spec.scheduler,
                                          self.spec.num_drafts, tokenizer)
        self.engine.start()
        asyncio.get_running_loop().create_task(self._report_metrics())
        return self.engine.max_model_len

    def submit(self, consumer: str, request_id: str, prompt_ids: list[int],
               params: bytes) -> str | None:
        """Queues a request whose deltas go to `consumer`'s outbox; returns why it was refused."""
        try:
            self.engine.add_request(request_id, prompt_ids, unpack(SamplingParams, params),
                                    functools.partial(self._deliver, consumer))
        except RequestError as e:
            return str(e)
        return None

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def poll(self, consumer: str) -> bytes:
        """The consumer's deltas since its last poll, as soon as there are any."""
        arrived = self.arrived.setdefault(consumer, asyncio.Event())
        try:
            await asyncio.wait_for(arrived.wait(), POLL_TIMEOUT_S)
        except TimeoutError:
            pass
        arrived.clear()
        return pack(self.outboxes.pop(consumer, []))

    def state(self) -> dict:
        """Per-worker queues, KV blocks and slots, and speculation totals (tests, operators)."""
        return {"lanes": [vars(load) for load in self.engine.loads()],
                "requests": len(self.engine.streams),
                "spec": self.engine.spec_stats().as_dict()}

    async def memory_reports(self) -> list[dict]:
        return list(await asyncio.gather(*(h.memory_report.remote() for h in self.handles)))

    def _deliver(self, consumer: str, delta: Delta) -> None:
        self.outboxes.setdefault(consumer, []).append(delta)
        self.arrived.setdefault(consumer, asyncio.Event()).set()

    async def _report_metrics(self) -> None:
        while True:
            self.metrics.report(self.engine.loads(), self.engine.spec_stats())
            await asyncio.sleep(METRICS_INTERVAL_S)


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
        name=scheduler_name(name), namespace=NAMESPACE, num_cpus=0, max_restarts=0,
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

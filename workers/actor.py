"""A worker as Ray actors, `metrale-worker-<replica>-<rank>` (one per tensor-parallel rank), and
the msgpack executor that drives them."""

from __future__ import annotations

import asyncio
import os
import uuid

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from metrale.cluster.executor import WorkerLost
from metrale.cluster.plan import StepPlan, StepResult, WorkerCapacity
from metrale.cluster.wire import pack, unpack
from metrale.workers.parallel import join_group, rendezvous_address
from metrale.workers.worker import Worker, WorkerConfig

NAMESPACE = "metrale"
PING_TIMEOUT_S = 10.0        # an idle worker that does not answer a ping within this is lost
RESTART_POLL_S = 0.5
SURVIVOR_PING_S = 2.0        # a surviving rank silent this long hangs in a broken collective
PEER_DEATH_WAIT_S = 5.0      # how long a rank's error waits to learn whether a peer died


class StaleWorker(RuntimeError):
    """A step planned for a worker's previous life: the actor restarted, its caches are empty."""


def worker_name(replica: str, rank: int) -> str:
    return f"metrale-worker-{replica}-{rank}"


class WorkerActor:
    """One rank of a Worker (target shard, drafter, KV pages, SSM slot and verify pools) in its own
    process. A worker of one rank loads at once; the ranks of a tensor-parallel worker load when
    they `join` their group. Each life of the actor has its own incarnation: Ray restarts a dead
    actor with empty caches, and a plan meant for the previous life is refused."""

    def __init__(self, config: WorkerConfig, tp_rank: int = 0):
        self.config, self.tp_rank = config, tp_rank
        self.incarnation = uuid.uuid4().hex
        self.worker = Worker(config) if config.tensor_parallel_size == 1 else None

    def rendezvous(self) -> str:
        return rendezvous_address()

    def join(self, address: str) -> None:
        tp = join_group(self.tp_rank, self.config.tensor_parallel_size, address,
                        self.config.torch_device)
        self.worker = Worker(self.config, tp)

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
        result = self.worker.execute(unpack(StepPlan, plan))
        return pack(result) if self.tp_rank == 0 else b""   # the ranks' results are the same


def start_worker(config: WorkerConfig, replica: str, rank: int, *, num_gpus: float,
                 num_cpus: float, placement: PlacementGroupSchedulingStrategy, tp_rank: int = 0,
                 max_restarts: int = -1):
    """Starts the actor in its placement-group bundle; Ray gives it its GPU (CUDA_VISIBLE_DEVICES),
    so the worker's `auto` device is that GPU, or the CPU when num_gpus is 0. Ray restarts a dead
    worker in the same bundle up to `max_restarts` times (-1: always)."""
    return ray.remote(WorkerActor).options(
        name=worker_name(replica, rank), namespace=NAMESPACE, num_gpus=num_gpus, num_cpus=num_cpus,
        scheduling_strategy=placement, max_restarts=max_restarts).remote(config, tp_rank)


class ActorExecutor:
    """Sends each step plan to every rank of a worker (one actor, or a tensor-parallel group) and
    returns rank 0's result, both msgpack-encoded. Every call names the incarnation it expects, so
    a restarted rank's empty caches are never used for sequences planned against the old ones; a
    dead or restarted rank raises WorkerLost."""

    def __init__(self, handles: list):
        self.handles = handles
        self.capacity: WorkerCapacity | None = None
        self.incarnations: list[str] = []
        self.survivors: list[int] = []   # after a loss: ranks still in the old, broken group

    @classmethod
    async def connect(cls, *handles) -> "ActorExecutor":
        """Sets up the ranks' process group (rank 0 picks the address), waits until they have
        loaded their shards, and learns the worker's capacity."""
        executor = cls(list(handles))
        await executor._form()
        return executor

    async def execute(self, plan: StepPlan) -> StepResult:
        data = pack(plan)
        results = await self._on_every_rank(lambda rank, life: rank.execute.remote(data, life))
        return unpack(StepResult, results[0])

    async def ping(self) -> None:
        try:
            found = await asyncio.wait_for(
                self._on_every_rank(lambda rank, _: rank.ping.remote()), PING_TIMEOUT_S)
        except TimeoutError:
            self.survivors = list(range(len(self.handles)))
            raise WorkerLost("no answer to a ping") from None
        if found != self.incarnations:
            self.survivors = [r for r, i in enumerate(found) if i == self.incarnations[r]]
            raise WorkerLost("the worker restarted")

    async def reconnect(self) -> None:
        """Waits for Ray to restart the dead rank(s) and for the worker to load again. The other
        ranks of a tensor-parallel worker may hang in a collective with the dead one, and their
        group cannot take a new member: they are restarted too, and the group formed anew; so is
        a worker that stopped answering pings."""
        for rank in self.survivors:   # in a broken group, or not answering at all
            await self._restart(rank)
        for handle, old in zip(self.handles, self.incarnations):
            while True:   # until the rank answers from its new life
                try:
                    if await handle.ping.remote() != old:
                        break
                except ray.exceptions.ActorUnavailableError:   # restarting
                    pass
                except ray.exceptions.RayActorError as e:       # dead for good
                    raise WorkerLost(str(e).splitlines()[0]) from None
                await asyncio.sleep(RESTART_POLL_S)
        try:
            await self._form()
        except ray.exceptions.RayActorError as e:   # a rank died again while loading
            raise WorkerLost(str(e).splitlines()[0]) from None

    async def _restart(self, rank: int) -> None:
        """Has Ray restart a rank still in its old life: one that answers from it, or hangs (in a
        collective with a dead rank). One that crashed meanwhile is restarting already, and
        killing it again would kill its new life."""
        handle, old = self.handles[rank], self.incarnations[rank]
        try:
            if await asyncio.wait_for(handle.ping.remote(), SURVIVOR_PING_S) != old:
                return
        except ray.exceptions.RayActorError:   # restarting, or dead for good
            return
        except TimeoutError:
            pass
        try:
            ray.kill(handle, no_restart=False)
        except ValueError:   # dead for good
            pass

    async def _on_every_rank(self, call) -> list:
        """`call(handle, incarnation)` on every rank, each with the incarnation it should be in.
        A rank that dies raises WorkerLost at once, without waiting for the others, which may
        hang in a collective with it; they are noted as survivors of the broken group. A rank
        whose collective failed is often the first sign of a peer's death, so an error that is
        not a death waits a moment for the other ranks before it is raised as it is."""
        calls = [asyncio.ensure_future(call(h, i)) for h, i in zip(self.handles, self.incarnations)]
        _, pending = await asyncio.wait(calls, return_when=asyncio.FIRST_EXCEPTION)
        errors = self._errors(calls)
        if errors and pending and not any(map(_is_death, errors.values())):
            await asyncio.wait(pending, timeout=PEER_DEATH_WAIT_S)
            errors = self._errors(calls)
        deaths = [r for r, e in errors.items() if _is_death(e)]
        if deaths:
            self.survivors = [r for r in range(len(calls)) if r not in deaths]
            raise WorkerLost(str(errors[deaths[0]]).splitlines()[0])
        if errors:
            raise next(iter(errors.values()))
        return [c.result() for c in calls]

    async def _form(self) -> None:
        if len(self.handles) > 1:
            address = await self.handles[0].rendezvous.remote()
            await asyncio.gather(*(h.join.remote(address) for h in self.handles))
        hellos = await asyncio.gather(*(h.hello.remote() for h in self.handles))
        self.capacity = unpack(WorkerCapacity, hellos[0][0])
        self.incarnations = [incarnation for _, incarnation in hellos]

    @staticmethod
    def _errors(calls: list[asyncio.Future]) -> dict[int, BaseException]:
        return {r: c.exception() for r, c in enumerate(calls)
                if c.done() and c.exception() is not None}


def _is_death(error: BaseException) -> bool:
    """The rank's process died, or was restarted (its caches are empty)."""
    return isinstance(error, (ray.exceptions.RayActorError, StaleWorker))

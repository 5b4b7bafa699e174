"""A worker as Ray actors, `metrale-worker-<replica>-<rank>` (one per tensor-parallel rank), and
the msgpack executor that drives them."""

from __future__ import annotations

import asyncio
import itertools
import os
from dataclasses import replace

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from metrale.cluster.plan import StepPlan, StepResult, WorkerCapacity
from metrale.cluster.wire import pack, unpack
from metrale.workers.models.config import ModelConfig
from metrale.workers.models.parallel import check_divisible
from metrale.workers.parallel import join_group, rendezvous_address
from metrale.workers.worker import Worker, WorkerConfig

NAMESPACE = "metrale"
PLACEMENT_TIMEOUT_S = 600


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


class WorkerGroup:
    """A tensor-parallel worker driven from this process (`LLM`, `metrale generate`): its ranks are
    actors in one PACK placement group of the Ray cluster this process is connected to, a local one
    started here when there is none. Same `capacity` and `execute` as an in-process Worker."""

    _labels = itertools.count()

    def __init__(self, config: WorkerConfig, num_cpus: float = 1.0):
        size = config.tensor_parallel_size
        check_divisible(ModelConfig.from_dir(config.model, config.dtype), size)   # fail before Ray
        if not ray.is_initialized():   # a local Ray of at least one logical CPU per rank
            ray.init(namespace=NAMESPACE, log_to_driver=False,
                     num_cpus=None if os.environ.get("RAY_ADDRESS") else
                     max(os.cpu_count() or 1, int(size * num_cpus)))
        # a GPU per rank when asked for one, or with `auto` when the cluster has GPUs (this
        # process may have none); each rank sees only the GPU Ray gives it, and a CPU rank must
        # not pick up one it was not given
        cuda = config.device.startswith("cuda") or (
            config.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
        config, gpus = replace(config, device="cuda" if cuda else "cpu"), float(cuda)
        bundle = {"CPU": num_cpus} | ({"GPU": gpus} if cuda else {})
        self.placement = placement_group([bundle] * size, strategy="PACK")
        try:
            ray.get(self.placement.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.placement)
            raise RuntimeError(f"the Ray cluster cannot place {size} ranks of {bundle} (it has "
                               f"{ray.available_resources()} free)") from None
        label = f"local{os.getpid()}x{next(self._labels)}"
        self.handles = [start_worker(config, label, r, num_gpus=gpus, num_cpus=num_cpus, tp_rank=r,
                                     placement=PlacementGroupSchedulingStrategy(self.placement, r))
                        for r in range(size)]
        self._loop = asyncio.new_event_loop()
        try:
            self.executor = self._loop.run_until_complete(ActorExecutor.connect(*self.handles))
        except Exception:
            self.close()
            raise
        self.capacity = self.executor.capacity

    def execute(self, plan: StepPlan) -> StepResult:
        return self._loop.run_until_complete(self.executor.execute(plan))

    def memory_report(self) -> dict:
        return ray.get(self.handles[0].memory_report.remote())

    def close(self) -> None:
        """Stops the ranks and frees their reservation."""
        for handle in self.handles:
            ray.kill(handle)
        remove_placement_group(self.placement)
        self._loop.close()

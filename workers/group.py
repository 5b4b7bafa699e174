"""A tensor-parallel worker driven from this process: its ranks as Ray actors in one placement
group, behind the same `capacity` / `execute` as an in-process Worker."""

from __future__ import annotations

import asyncio
import itertools
import os
from dataclasses import replace

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from metrale.cluster.plan import StepPlan, StepResult
from metrale.workers.actor import NAMESPACE, ActorExecutor, start_worker
from metrale.workers.models.config import ModelConfig
from metrale.workers.models.parallel import check_divisible
from metrale.workers.worker import WorkerConfig

PLACEMENT_TIMEOUT_S = 600


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
                                     placement=PlacementGroupSchedulingStrategy(self.placement, r),
                                     max_restarts=0)
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
        """Stops the ranks and frees their reservation (once; later calls do nothing)."""
        if self._loop.is_closed():
            return
        for handle in self.handles:
            ray.kill(handle)
        remove_placement_group(self.placement)
        self._loop.close()

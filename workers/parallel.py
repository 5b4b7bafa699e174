"""A worker's tensor-parallel group: its rank, the torch.distributed process group, and agreement.

The ranks of one group run the same step plans in the same order, so every collective below is
entered by all of them together. Rank 0 picks the rendezvous address on its own node; the others
learn it through whoever starts them (the Ray actors' `join` calls).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# How long a rank waits in a collective for the others: longer than any step, so a rank that died
# shows up as an error rather than a hang without end.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


class ParallelError(ValueError):
    """A model that cannot be split this many ways; the message names the field."""


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in its tensor-parallel group; size 1 runs every collective as a no-op."""
    rank: int = 0
    size: int = 1
    group: object = None         # the device group (NCCL on GPUs, gloo on CPU)
    host_group: object = None    # gloo, for Python objects (drafts, verdicts)

    def split(self, n: int) -> int:
        """This rank's share of `n` heads, channels or rows (n divides by size; checked at load)."""
        return n // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's partial `x` (row-parallel outputs), on every rank."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` concatenated along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def agree(self, value):
        """Rank 0's `value` on every rank: what rank 0 decided is what every rank commits, so the
        ranks' caches stay the same even if a tie were broken differently somewhere."""
        if self.size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.host_group)
        return box[0]


def rendezvous_address() -> str:
    """`host:port` of a free port on this node, for rank 0 to hand to the other ranks."""
    import ray  # only the Ray actors that host ranks set groups up
    host = ray.util.get_node_ip_address()
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"{host}:{port}"


def join_group(rank: int, size: int, address: str, device: torch.device) -> TensorParallel:
    """Joins the group at `address` (blocks until all `size` ranks have joined)."""
    if device.type == "cuda":   # a Ray actor sees only its own GPU: plain `cuda` is GPU 0
        torch.cuda.set_device(device.index or 0)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{address}", rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT)
    world = dist.group.WORLD
    host = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT) if backend == "nccl" else world
    return TensorParallel(rank, size, world, host)

"""Which replica serves a request: power of two choices on queue length, prefix affinity."""

from __future__ import annotations

import random
from collections import OrderedDict

from metrale.cluster.block_manager import block_hash


class Router:
    """Remembers which prompt-prefix blocks each replica has seen (hashed like the KV cache's prefix
    blocks, so a match means the replica may hold those blocks). While the queues are within
    `imbalance` of each other, a request goes where the longest prefix of its prompt went before;
    otherwise to the shorter queue of two replicas drawn at random."""

    def __init__(self, num_replicas: int, block_size: int, imbalance: int = 4,
                 remembered: int = 65536, seed: int | None = None):
        self.block_size, self.imbalance, self.remembered = block_size, imbalance, remembered
        self.prefixes: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_replicas)]
        self.random = random.Random(seed)

    def choose(self, prompt_ids: list[int], queues: list[int]) -> int:
        """The replica for a prompt, given each replica's queue length; records its prefix there."""
        hashes = self._block_hashes(prompt_ids)
        if max(queues) - min(queues) <= self.imbalance:
            best = max(range(len(queues)), key=lambda r: (self._matched(r, hashes), -queues[r]))
            if self._matched(best, hashes):
                self._remember(best, hashes)
                return best
        if len(queues) == 1:
            pick = 0
        else:
            a, b = self.random.sample(range(len(queues)), 2)
            pick = a if queues[a] <= queues[b] else b
        self._remember(pick, hashes)
        return pick

    def _block_hashes(self, prompt_ids: list[int]) -> list[bytes]:
        hashes, parent = [], b""
        for start in range(0, len(prompt_ids) - self.block_size + 1, self.block_size):
            parent = block_hash(parent, prompt_ids[start:start + self.block_size])
            hashes.append(parent)
        return hashes

    def _matched(self, replica: int, hashes: list[bytes]) -> int:
        """Leading blocks of the prompt the replica has seen."""
        seen = self.prefixes[replica]
        n = 0
        while n < len(hashes) and hashes[n] in seen:
            n += 1
        return n

    def _remember(self, replica: int, hashes: list[bytes]) -> None:
        seen = self.prefixes[replica]
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.remembered:
            seen.popitem(last=False)

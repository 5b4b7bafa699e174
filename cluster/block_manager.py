"""Bookkeeping of KV blocks (reference counts, prefix cache) and SSM slots; the tensors live on the worker."""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    """Identifies a full block by its tokens and everything before it."""
    return hashlib.sha256(parent + np.asarray(tokens, dtype=np.int64).tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = prefix_caching
        self.ref_count = [0] * num_blocks
        self.hash_of: dict[int, bytes] = {}
        self.block_of: dict[bytes, int] = {}
        # Free blocks, least recently freed first; a freed block keeps its hash until it is reused,
        # so a later request with the same prefix can take it back.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_prefix(self, tokens: list[int]) -> list[int]:
        """Blocks holding a prefix of `tokens`; always leaves at least one token to compute."""
        if not self.prefix_caching:
            return []
        blocks, parent = [], b""
        for i in range((len(tokens) - 1) // self.block_size):
            parent = block_hash(parent, tokens[i * self.block_size:(i + 1) * self.block_size])
            if parent not in self.block_of:
                break
            blocks.append(self.block_of[parent])
        return blocks

    def can_allocate(self, tokens: list[int], num_tokens: int,
                     cached: list[int] | None = None) -> bool:
        """Room to admit a sequence whose first `num_tokens` tokens must be in the cache
        (`cached`: cached_prefix(tokens), when the caller has it; hashing a long prompt costs)."""
        if cached is None:
            cached = self.cached_prefix(tokens)
        revived = sum(1 for b in cached if b in self.free)
        return self.blocks_for(num_tokens) - len(cached) + revived <= self.num_free

    def allocate(self, table: list[int], tokens: list[int], num_tokens: int,
                 cached: list[int] | None = None) -> int:
        """Fills an empty block table for the first `num_tokens` tokens; returns the cached tokens
        (`cached` as for can_allocate)."""
        assert not table
        for b in self.cached_prefix(tokens) if cached is None else cached:
            self.free.pop(b, None)
            self.ref_count[b] += 1
            table.append(b)
        cached = len(table) * self.block_size
        self.append(table, num_tokens)
        return cached

    def can_append(self, table: list[int], num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(table) <= self.num_free

    def append(self, table: list[int], num_tokens: int) -> None:
        """Grows the table to hold `num_tokens` tokens."""
        while len(table) < self.blocks_for(num_tokens):
            b, _ = self.free.popitem(last=False)
            old = self.hash_of.pop(b, None)
            if old is not None and self.block_of.get(old) == b:
                del self.block_of[old]
            self.ref_count[b] = 1
            table.append(b)

    def register(self, table: list[int], first: int, tokens: list[int], parent: bytes = b"") -> bytes:
        """Publishes full, computed blocks of a sequence to the prefix cache: blocks `first`,
        `first + 1`, ... holding `tokens` (whole blocks), `parent` being the hash of the blocks
        before `first`. Returns the hash after the last, for the next call to go on from."""
        if not self.prefix_caching:
            return parent
        bs = self.block_size
        for j in range(len(tokens) // bs):
            b = table[first + j]
            parent = self.hash_of.get(b) or block_hash(parent, tokens[j * bs:(j + 1) * bs])
            if b not in self.hash_of and parent not in self.block_of:
                self.hash_of[b] = parent
                self.block_of[parent] = b
        return parent

    def free_table(self, table: list[int]) -> None:
        for b in reversed(table):  # the tail first, so shared prefix blocks are evicted last
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self.free[b] = None
        table.clear()


class SlotAllocator:
    """SSM slots: one per running sequence of a hybrid model, held from admission to finish."""

    def __init__(self, num_slots: int):
        self.free_slots = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self.free_slots)

    def allocate(self) -> int:
        return self.free_slots.pop()

    def release(self, slot: int) -> None:
        self.free_slots.append(slot)

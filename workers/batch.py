"""The flattened batch one target forward runs over: rows of many sequences, each with its cache place."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SeqRows:
    """One sequence's rows in a forward: `length` tokens starting at absolute position `context_len`."""
    start: int                # first row in the flat batch
    length: int
    context_len: int          # tokens of this sequence already in the caches
    block_table: torch.Tensor  # [num_blocks] long, on the device
    slot: int                 # SSM slot (-1 for models without linear attention)
    verify: bool = False      # keep the state after every row in the slot's verify pool instead

    @property
    def total_len(self) -> int:
        return self.context_len + self.length


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor     # [T] long
    positions: torch.Tensor     # [T] long
    slot_mapping: torch.Tensor  # [T] long: flat KV index (block * block_size + offset) of each row
    seqs: list[SeqRows]
    block_size: int

    @property
    def uniform_length(self) -> int | None:
        """The common chunk length when every sequence has the same number of rows (decode, verify)."""
        lengths = {s.length for s in self.seqs}
        return lengths.pop() if len(lengths) == 1 else None

    @classmethod
    def build(cls, chunks: list[tuple], block_size: int,
              device: torch.device) -> "ForwardBatch":
        """`chunks[i] = (token_ids, context_len, block_table, slot[, verify])` per sequence."""
        ids, pos, slots, seqs = [], [], [], []
        for tokens, ctx, table, slot, *verify in chunks:
            p = range(ctx, ctx + len(tokens))
            ids.extend(tokens)
            pos.extend(p)
            slots.extend(table[i // block_size] * block_size + i % block_size for i in p)
            seqs.append(SeqRows(len(ids) - len(tokens), len(tokens), ctx,
                                torch.tensor(table, dtype=torch.long, device=device), slot,
                                bool(verify and verify[0])))
        as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
        return cls(as_long(ids), as_long(pos), as_long(slots), seqs, block_size)

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
    block_table: torch.Tensor  # [num_blocks] on the device (long; int32 rows for the kernels)
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
    # The same per-sequence facts as device tensors, for kernels (and CUDA graphs) that must not
    # read host values: first row, row count, cached tokens, padded block tables, SSM slots.
    q_start: torch.Tensor | None = None       # [S] int32
    q_len: torch.Tensor | None = None         # [S] int32
    context_lens: torch.Tensor | None = None  # [S] int32
    block_tables: torch.Tensor | None = None  # [S, W] int32
    slots: torch.Tensor | None = None         # [S] long
    backend: str = "torch"                    # torch | triton: how attention and DeltaNet run

    @property
    def uniform_length(self) -> int | None:
        """The common chunk length when every sequence has the same number of rows (decode, verify)."""
        lengths = {s.length for s in self.seqs}
        return lengths.pop() if len(lengths) == 1 else None

    @property
    def max_q_len(self) -> int:
        return max(s.length for s in self.seqs)

    @classmethod
    def build(cls, chunks: list[tuple], block_size: int, device: torch.device,
              backend: str = "torch") -> "ForwardBatch":
        """`chunks[i] = (token_ids, context_len, block_table, slot[, verify])` per sequence. The
        rows' ids, positions and slots cross to the device in one copy; for the kernels the
        per-sequence facts in two more, and each sequence's block table is a row of theirs."""
        ids, pos, slot_mapping, spans = [], [], [], []
        for tokens, ctx, table, slot, *verify in chunks:
            p = range(ctx, ctx + len(tokens))
            ids.extend(tokens)
            pos.extend(p)
            slot_mapping.extend(table[i // block_size] * block_size + i % block_size for i in p)
            spans.append((len(ids) - len(tokens), len(tokens), ctx, slot, bool(verify and verify[0])))
        input_ids, positions, slot_mapping = torch.tensor(
            [ids, pos, slot_mapping], dtype=torch.long).to(device).unbind()
        if backend == "torch":
            tables = [torch.tensor(c[2], dtype=torch.long, device=device) for c in chunks]
        else:
            width = max(len(c[2]) for c in chunks)
            block_tables = torch.tensor([list(c[2]) + [0] * (width - len(c[2])) for c in chunks],
                                        dtype=torch.int32).to(device)
            tables = [row[:len(c[2])] for row, c in zip(block_tables, chunks)]
        seqs = [SeqRows(start, n, ctx, table, slot, verify)
                for (start, n, ctx, slot, verify), table in zip(spans, tables)]
        batch = cls(input_ids, positions, slot_mapping, seqs, block_size, backend=backend)
        if backend != "torch":
            meta = torch.tensor([[s.start for s in seqs], [s.length for s in seqs],
                                 [s.context_len for s in seqs]], dtype=torch.int32).to(device)
            batch.q_start, batch.q_len, batch.context_lens = meta.unbind()   # contiguous rows
            batch.slots = torch.tensor([s.slot for s in seqs], dtype=torch.long).to(device)
            batch.block_tables = block_tables
        return batch

"""The flattened batch one target forward runs over: rows of many sequences, each with its cache place."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch


_NUMPY = {torch.long: np.int64, torch.int32: np.int32}


class _Staging:
    """Pinned host memory that one device's small host-to-device copies leave from: a ring of
    slots, each taken again once the copy that last left from it is done (long before, as a
    rule). Pinning a new tensor per copy costs about 60 us of host time."""
    SLOTS, SLOT_BYTES = 64, 64 << 10

    def __init__(self):
        self.memory = torch.empty(self.SLOTS * self.SLOT_BYTES, dtype=torch.uint8, pin_memory=True)
        self.left = [torch.cuda.Event() for _ in range(self.SLOTS)]
        self.next = 0
        self.lock = threading.Lock()   # in-process workers each step on their own thread

    def send(self, array: np.ndarray, dtype: torch.dtype, device: torch.device,
             out: torch.Tensor | None) -> torch.Tensor:
        if array.nbytes > self.SLOT_BYTES:
            host = torch.from_numpy(array).pin_memory()
            return out.copy_(host, non_blocking=True) if out is not None else \
                host.to(device, non_blocking=True)
        with self.lock:
            i, self.next = self.next, (self.next + 1) % self.SLOTS
            self.left[i].synchronize()
            start = i * self.SLOT_BYTES
            host = self.memory[start:start + array.nbytes].view(dtype).view(array.shape)
            host.numpy()[...] = array
            if out is not None:
                out.copy_(host, non_blocking=True)
            else:
                out = host.to(device, non_blocking=True)
            self.left[i].record(torch.cuda.current_stream(device))
        return out


_staging: dict[torch.device, _Staging] = {}   # per device: an event records on one device only
_creating = threading.Lock()


def to_device(values, device: torch.device, dtype: torch.dtype = torch.long,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Host values (lists or a numpy array) as a tensor on `device`, or written into `out`
    (a tensor there of their shape, a view of a static buffer say: one op instead of a copy
    and a copy into it). On CUDA they leave from pinned memory without waiting: a copy from
    pageable memory first waits for every kernel queued before it, and the host could no
    longer run ahead of the device."""
    if device.type != "cuda":
        values = torch.as_tensor(values, dtype=dtype)
        return out.copy_(values) if out is not None else values.to(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _staging:
        with _creating:
            _staging.setdefault(device, _Staging())
    return _staging[device].send(np.asarray(values, dtype=_NUMPY[dtype]), dtype, device, out)


def uniform_length(seqs: list["SeqRows"]) -> int | None:
    """The common chunk length when every sequence has the same number of rows (decode, verify)."""
    lengths = {s.length for s in seqs}
    return lengths.pop() if len(lengths) == 1 else None


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
        return uniform_length(self.seqs)

    @property
    def max_q_len(self) -> int:
        return max(s.length for s in self.seqs)

    @classmethod
    def build(cls, chunks: list[tuple], block_size: int, device: torch.device,
              backend: str = "torch") -> "ForwardBatch":
        """`chunks[i] = (token_ids, context_len, block_table, slot[, verify])` per sequence."""
        return RowsLayout.of(chunks, block_size).to(device, backend)


@dataclass
class RowsLayout:
    """A step's rows on the host: each row's token, position and flat KV index, and each
    sequence's place. A CUDA graph's buffers are filled from it directly; `to` makes the
    ForwardBatch an eager forward reads."""
    ids: np.ndarray            # [T] int64
    positions: np.ndarray      # [T] int64
    slot_mapping: np.ndarray   # [T] int64
    seqs: list[SeqRows]        # block_table: the host list
    tables: np.ndarray         # [S, W] int32, each table padded with block 0
    block_size: int

    @classmethod
    def of(cls, chunks: list[tuple], block_size: int) -> "RowsLayout":
        lengths = np.array([len(c[0]) for c in chunks], dtype=np.int64)
        context = np.array([c[1] for c in chunks], dtype=np.int64)
        width = max(len(c[2]) for c in chunks)
        tables = np.array([list(c[2]) + [0] * (width - len(c[2])) for c in chunks],
                          dtype=np.int32).reshape(len(chunks), width)
        starts = np.cumsum(lengths) - lengths
        of_row = np.repeat(np.arange(len(chunks)), lengths)
        positions = np.repeat(context - starts, lengths) + np.arange(int(lengths.sum()))
        slot_mapping = (tables[of_row, positions // block_size].astype(np.int64) * block_size
                        + positions % block_size)
        ids = np.fromiter((t for c in chunks for t in c[0]), dtype=np.int64, count=len(of_row))
        seqs = [SeqRows(int(start), len(c[0]), c[1], c[2], c[3], bool(c[4:] and c[4]))
                for start, c in zip(starts, chunks)]
        return cls(ids, positions, slot_mapping, seqs, tables, block_size)

    @property
    def uniform_length(self) -> int | None:
        return uniform_length(self.seqs)

    def to(self, device: torch.device, backend: str = "torch") -> ForwardBatch:
        """The rows' ids, positions and slots cross to the device in one copy; for the kernels
        the per-sequence facts in three more, and each sequence's block table is a row of theirs."""
        rows = np.stack([self.ids, self.positions, self.slot_mapping])
        input_ids, positions, slot_mapping = to_device(rows, device).unbind()
        if backend == "torch":
            tables = [to_device(s.block_table, device) for s in self.seqs]
        else:
            block_tables = to_device(self.tables, device, torch.int32)
            tables = [row[:len(s.block_table)] for row, s in zip(block_tables, self.seqs)]
        seqs = [SeqRows(s.start, s.length, s.context_len, table, s.slot, s.verify)
                for s, table in zip(self.seqs, tables)]
        batch = ForwardBatch(input_ids, positions, slot_mapping, seqs, self.block_size,
                             backend=backend)
        if backend != "torch":
            meta = to_device([[s.start for s in seqs], [s.length for s in seqs],
                              [s.context_len for s in seqs]], device, torch.int32)
            batch.q_start, batch.q_len, batch.context_lens = meta.unbind()   # contiguous rows
            batch.slots = to_device([s.slot for s in seqs], device)
            batch.block_tables = block_tables
        return batch

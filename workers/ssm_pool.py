"""Per-slot state of the linear-attention layers (conv window, recurrent state) and their verify pools."""

from __future__ import annotations

import torch

from metrale.workers.batch import to_device
from metrale.workers.cuda_graphs import bucket_for, capture
from metrale.workers.models import kernels


def verify_capacities(num_slots: int, max_drafts: int, budget_entries: int) -> list[int]:
    """Draft capacity per slot from a budget of verify-pool entries (a slot of capacity c holds
    c + 1 entries). Slots get the full depth in order while the budget lasts; the slot where it runs
    short takes what is left, and the rest get capacity 0 (they decode without speculation)."""
    caps, left = [], budget_entries
    for _ in range(num_slots):
        depth = min(max_drafts + 1, left)
        caps.append(depth - 1 if depth >= 2 else 0)
        left -= depth if depth >= 2 else 0
    return caps


class SSMSlotPool:
    def __init__(self, num_layers: int, num_slots: int, conv_dim: int, conv_kernel: int,
                 num_heads: int, key_dim: int, value_dim: int, dtype: torch.dtype,
                 device: torch.device, capacities: list[int] | None = None,
                 use_kernels: bool = False):
        self.num_slots, self.use_kernels = num_slots, use_kernels   # the commit's Triton kernel
        # The conv window holds the last K-1 inputs; the recurrent state stays in float32, as the
        # reference keeps it, because it accumulates over the whole sequence.
        conv_shape, state_shape = (conv_dim, conv_kernel - 1), (num_heads, key_dim, value_dim)
        self.conv = torch.zeros(num_layers, num_slots, *conv_shape, dtype=dtype, device=device)
        self.state = torch.zeros(num_layers, num_slots, *state_shape, dtype=torch.float32,
                                 device=device)
        # Verify pool: slot s owns entries offset[s] .. offset[s] + capacity[s]; entry i holds the
        # state after the i-th token of a verify ([pending, d_1..d_k]).
        self.capacity = list(capacities or [0] * num_slots)
        self.offset, total = [], 0
        for cap in self.capacity:
            self.offset.append(total)
            total += cap + 1 if cap else 0
        self.offsets = torch.tensor(self.offset, dtype=torch.long, device=device)
        self.verify_conv = torch.zeros(num_layers, total, *conv_shape, dtype=dtype, device=device)
        self.verify_state = torch.zeros(num_layers, total, *state_shape, dtype=torch.float32,
                                        device=device)
        self.commits: dict[int, torch.cuda.CUDAGraph] = {}   # captured commits per bucket
        self.commit_buckets: list[int] = []

    def check_verify(self, seqs) -> None:
        """Refuses a verify deeper than its slot's pool (host values only: graph-safe)."""
        for s in seqs:
            if s.verify and s.length > self.capacity[s.slot] + 1:
                raise ValueError(f"verify of {s.length} rows overflows slot {s.slot} "
                                 f"(capacity {self.capacity[s.slot]} drafts)")

    def entries(self, slots: torch.Tensor, length: int) -> torch.Tensor:
        """Verify-pool entries [B, L] of the slots: entry i holds the state after row i."""
        return self.offsets[slots][:, None] + torch.arange(length, device=slots.device)[None, :]

    @staticmethod
    def bytes_per_entry(num_layers: int, conv_dim: int, conv_kernel: int, num_heads: int,
                        key_dim: int, value_dim: int, dtype: torch.dtype) -> int:
        conv = conv_dim * (conv_kernel - 1) * dtype.itemsize
        state = num_heads * key_dim * value_dim * 4
        return num_layers * (conv + state)

    @property
    def verify_bytes(self) -> int:
        return self.verify_conv.nbytes + self.verify_state.nbytes

    @property
    def slot_bytes(self) -> int:
        return (self.conv.nbytes + self.state.nbytes) // max(self.num_slots, 1)

    def reset(self, slots: list[int]) -> None:
        idx = to_device(slots, self.conv.device)
        self.conv[:, idx] = 0
        self.state[:, idx] = 0

    def capture_commits(self, buckets: list[int], spare_slot: int, max_length: int = 1) -> None:
        """Commits by replay, for up to buckets[-1] slots: the commit kernel captured per bucket
        of slots over a static index, whose padding pairs copy `spare_slot`'s first entry into
        it (the CUDA graphs' padding slot, whose state no sequence reads). On the GPU machine a
        launch with its index cost the host 104-129 us, a replay with its index 66-77 us. The
        greedy commit's counting kernel (`commit_greedy`) is compiled here too, for verifies of
        up to `max_length` rows: compiled in a round, it cost that round 60-100 ms."""
        self.commit_buckets, self.commit_pad = buckets, (spare_slot, self.offset[spare_slot])
        self.commit_index = torch.tensor([[self.commit_pad[0]], [self.commit_pad[1]]],
                                         device=self.conv.device).repeat(1, buckets[-1])
        for bucket in buckets:
            self.commits[bucket] = capture(lambda b=bucket: kernels.commit_states(
                self.conv, self.state, self.verify_conv, self.verify_state,
                self.commit_index[:, :b]), None)[0]
        one = torch.tensor([0], device=self.conv.device)
        scratch = torch.empty(2, 1, dtype=torch.long, device=self.conv.device)
        for length in range(2, max_length + 1):   # one compile per power of two of drafts
            ids = torch.zeros(length, dtype=torch.long, device=self.conv.device)
            kernels.greedy_accept(ids, ids, one, one, self.offsets, scratch, length,
                                  self.commit_pad)

    def commit(self, slots: list[int], accepted: list[int]) -> None:
        """After a verify: each slot's state is its entry `accepted` (the drafts it accepted),
        for all the slots by one replay or one kernel launch with the kernels, else in two ops
        per tensor."""
        if not slots:
            return
        entries = [self.offset[s] + a for s, a in zip(slots, accepted)]
        bucket = bucket_for(self.commit_buckets, len(slots))
        if bucket is not None:
            pad = bucket - len(slots)
            to_device([slots + [self.commit_pad[0]] * pad, entries + [self.commit_pad[1]] * pad],
                      self.conv.device, out=self.commit_index[:, :bucket])
            self.commits[bucket].replay()
            return
        index = to_device([slots, entries], self.conv.device)
        if self.use_kernels:
            kernels.commit_states(self.conv, self.state, self.verify_conv, self.verify_state,
                                  index)
            return
        self.conv.index_copy_(1, index[0], self.verify_conv.index_select(1, index[1]))
        self.state.index_copy_(1, index[0], self.verify_state.index_select(1, index[1]))

    def commit_greedy(self, ids: torch.Tensor, best: torch.Tensor, drafts: list[int],
                      slots: list[int], length: int) -> torch.Tensor | None:
        """The commit of a greedy verify, launched before the host knows its verdicts: the
        sequences' rows are `length` each (pending token, drafts, filler) in ids and best (input
        tokens and argmaxes, on the device), drafts[i] of them real. Each slot's accepted count
        is found on the device (kernels.greedy_accept) and the captured commit replays over the
        pairs it writes. Returns the counts [n] on the device, or None (nothing launched) when
        no captured commit holds n slots."""
        bucket = bucket_for(self.commit_buckets, len(slots))
        if bucket is None:
            return None
        host = to_device([drafts, slots], self.conv.device)
        accepted = kernels.greedy_accept(ids, best, host[0], host[1], self.offsets,
                                         self.commit_index[:, :bucket], length, self.commit_pad)
        self.commits[bucket].replay()
        return accepted

    def commit_greedy_captured(self, ids: torch.Tensor, best: torch.Tensor, drafts: torch.Tensor,
                               slots: torch.Tensor, length: int, land: tuple | None = None
                               ) -> torch.Tensor:
        """commit_greedy with its drafts and slots [n] already on the device, for a CUDA graph to
        hold (a chained round: workers.chain): the counting kernel, then the commit kernel over
        the pairs it wrote. With `land`, the counting kernel also lands the round (see
        kernels.greedy_accept). Returns the accepted counts [n]."""
        index = self.commit_index[:, :drafts.shape[0]]
        accepted = kernels.greedy_accept(ids, best, drafts, slots, self.offsets, index, length,
                                         self.commit_pad, land)
        kernels.commit_states(self.conv, self.state, self.verify_conv, self.verify_state, index)
        return accepted

    def scratch(self, slots: list[int], layers: int) -> "SSMSlotPool":
        """A copy of the first `layers` layers' state of `slots`, as slots 0..len(slots)-1, for a
        draft pass that must not touch the committed state."""
        view = SSMSlotPool.__new__(SSMSlotPool)
        idx = to_device(slots, self.conv.device)
        view.num_slots, view.capacity, view.offset = len(slots), [0] * len(slots), [0] * len(slots)
        view.offsets = torch.zeros(len(slots), dtype=torch.long, device=idx.device)
        view.conv, view.state = self.conv[:layers, idx].clone(), self.state[:layers, idx].clone()
        view.verify_conv, view.verify_state = self.verify_conv[:0], self.verify_state[:0]
        return view

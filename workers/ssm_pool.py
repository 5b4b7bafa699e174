"""Per-slot state of the linear-attention layers: the causal-conv window and the recurrent state."""

from __future__ import annotations

import torch


class SSMSlotPool:
    def __init__(self, num_layers: int, num_slots: int, conv_dim: int, conv_kernel: int,
                 num_heads: int, key_dim: int, value_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.num_slots = num_slots
        # The conv window holds the last K-1 inputs; the recurrent state stays in float32, as the
        # reference keeps it, because it accumulates over the whole sequence.
        self.conv = torch.zeros(num_layers, num_slots, conv_dim, conv_kernel - 1, dtype=dtype,
                                device=device)
        self.state = torch.zeros(num_layers, num_slots, num_heads, key_dim, value_dim,
                                 dtype=torch.float32, device=device)

    @staticmethod
    def bytes_per_slot(num_layers: int, conv_dim: int, conv_kernel: int, num_heads: int,
                       key_dim: int, value_dim: int, dtype: torch.dtype) -> int:
        conv = conv_dim * (conv_kernel - 1) * dtype.itemsize
        state = num_heads * key_dim * value_dim * 4
        return num_layers * (conv + state)

    def reset(self, slots: list[int]) -> None:
        idx = torch.tensor(slots, dtype=torch.long, device=self.conv.device)
        self.conv[:, idx] = 0
        self.state[:, idx] = 0

"""The paged K/V tensors of the full-attention layers (the block bookkeeping lives in cluster/)."""

from __future__ import annotations

import torch

from metrale.workers.batch import ForwardBatch, SeqRows


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    def write(self, layer: int, batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [T, kv_heads, head_dim] for every row of the batch."""
        self.k[layer].view(-1, *k.shape[1:])[batch.slot_mapping] = k
        self.v[layer].view(-1, *v.shape[1:])[batch.slot_mapping] = v

    def read(self, layer: int, seq: SeqRows) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequence's K and V for positions 0..total_len-1: [total_len, kv_heads, head_dim]."""
        n = seq.total_len
        blocks = seq.block_table[: (n + self.block_size - 1) // self.block_size]
        k = self.k[layer, blocks].flatten(0, 1)[:n]
        v = self.v[layer, blocks].flatten(0, 1)[:n]
        return k, v

    def read_padded(self, layer: int, seqs: list[SeqRows]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of several sequences padded to the longest: [B, max_len, kv_heads, head_dim]."""
        width = max((s.total_len + self.block_size - 1) // self.block_size for s in seqs)
        table = torch.zeros(len(seqs), width, dtype=torch.long, device=self.k.device)
        for i, s in enumerate(seqs):
            n = (s.total_len + self.block_size - 1) // self.block_size
            table[i, :n] = s.block_table[:n]
        return self.k[layer, table].flatten(1, 2), self.v[layer, table].flatten(1, 2)

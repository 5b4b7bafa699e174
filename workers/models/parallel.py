"""Tensor-parallel layers (column, row and vocabulary parallel) and how each rank slices its weights.

Column-parallel layers split their output features (whole heads, MLP channels) across ranks and need
no communication; row-parallel layers split their input features and sum the ranks' partial outputs
(one all-reduce), so the residual stream is whole on every rank between layers. With one rank every
layer computes exactly what `nn.Linear` / `nn.Embedding` compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from metrale.workers.models import kernels
from metrale.workers.models.config import ModelConfig
from metrale.workers.parallel import ParallelError, TensorParallel

SINGLE = TensorParallel()


@dataclass(frozen=True)
class Shard:
    """How a weight splits across ranks: along `dim`, each of `sections` (the full sizes of fused
    parts, such as q | k | v, that split separately) cut into equal rank shares. A section that does
    not divide (a vocabulary) gives the last rank a zero-padded share."""
    dim: int
    sections: tuple[int, ...]

    def full_shape(self, local: torch.Size) -> tuple[int, ...]:
        return tuple(sum(self.sections) if d == self.dim else n for d, n in enumerate(local))

    def take(self, read, tp: TensorParallel) -> torch.Tensor:
        """This rank's share; `read(index)` reads part of the full tensor (a safetensors slice)."""
        parts, offset = [], 0
        for n in self.sections:
            per = -(-n // tp.size)
            start, stop = min(tp.rank * per, n), min((tp.rank + 1) * per, n)
            index = (slice(None),) * self.dim + (slice(offset + start, offset + stop),)
            part = read(index)
            if stop - start < per:
                pad = list(part.shape)
                pad[self.dim] = per - (stop - start)
                part = torch.cat((part, part.new_zeros(pad)), dim=self.dim)
            parts.append(part)
            offset += n
        return torch.cat(parts, dim=self.dim) if len(parts) > 1 else parts[0]


def model_shards(model: nn.Module) -> dict[str, Shard]:
    """Every split parameter of `model` by state-dict name; the others are whole on every rank."""
    return {f"{prefix}.{name}" if prefix else name: shard
            for prefix, module in model.named_modules()
            for name, shard in getattr(module, "shards", {}).items()}


def check_divisible(cfg: ModelConfig, size: int) -> None:
    """Heads and MLP channels must split evenly across `size` ranks."""
    fields = ["num_attention_heads", "num_key_value_heads", "intermediate_size"]
    if cfg.is_hybrid:
        fields += ["linear_num_key_heads", "linear_num_value_heads"]
    for name in fields:
        value = getattr(cfg, name)
        if value % size:
            raise ParallelError(f"tensor_parallel_size={size} does not divide the model's "
                                f"{name}={value}; pick a size that divides every head count "
                                f"({', '.join(f'{f}={getattr(cfg, f)}' for f in fields)})")


class ColumnParallelLinear(nn.Linear):
    """Output features split: this rank computes its own heads or channels."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel,
                 sections: tuple[int, ...] | None = None):
        sections = sections or (out_features,)
        super().__init__(in_features, sum(tp.split(n) for n in sections), bias=bias)
        self.shards = {"weight": Shard(0, sections)} | ({"bias": Shard(0, sections)} if bias else {})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Linear):
    """Input features split: the ranks' partial products are summed, then the bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel):
        super().__init__(tp.split(in_features), out_features, bias=bias)
        self.tp = tp
        self.shards = {"weight": Shard(1, (in_features,))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return kernels.linear(x, self.weight, self.bias)
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rows of the vocabulary split: each rank embeds the ids in its range, zeros elsewhere, and
    the sum over ranks is the embedding (exact: one rank contributes each row)."""

    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallel):
        per_rank = -(-vocab_size // tp.size)
        super().__init__(per_rank, hidden)
        self.tp, self.start = tp, tp.rank * per_rank
        self.shards = {"weight": Shard(0, (vocab_size,))}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside[..., None], 0))


class ParallelLMHead(nn.Linear):
    """Vocabulary split like the embedding (so tied weights are the same shard); the ranks' logits
    are gathered, so every rank sees the whole row and samples the same token."""

    def __init__(self, hidden: int, vocab_size: int, tp: TensorParallel):
        super().__init__(hidden, -(-vocab_size // tp.size), bias=False)
        self.tp, self.vocab_size = tp, vocab_size
        self.shards = {"weight": Shard(0, (vocab_size,))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return kernels.linear(x, self.weight)
        return self.tp.all_gather(super().forward(x))[..., :self.vocab_size]

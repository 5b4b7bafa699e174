"""Turns logits into the target distribution and draws tokens from it, reproducibly per request."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol, Sequence

import torch


class TokenConstraint(Protocol):
    """A grammar: which tokens may follow the tokens generated so far. A function of the generated
    prefix, so rejected drafts roll back by asking again with the shorter prefix (a stateful
    matcher rolls back to the common prefix inside `allowed`)."""

    def allowed(self, generated: Sequence[int]) -> torch.Tensor:
        """Bool mask [vocab] of the tokens allowed next."""


# Temperatures below this sample greedily: dividing logits by a tinier one overflows to inf.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingSpec:
    """What the worker needs to sample one row: the request's distribution and its random stream."""
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int           # the request's seed (the scheduler picks one when the client gave none)
    draw: int           # index of this draw in the request's stream; reproducible after preemption
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def at(self, draw: int) -> "SamplingSpec":
        return replace(self, draw=draw)


def target_probs(logits: torch.Tensor, specs: list[SamplingSpec]) -> torch.Tensor:
    """The distribution each row samples from: softmax(logits / T) restricted by top-k, top-p and
    min-p (in that order) and renormalised. logits: [B, V] float32. Greedy rows get a one-hot."""
    probs = torch.empty_like(logits)
    for i, spec in enumerate(specs):
        row = logits[i]
        if spec.greedy:
            probs[i] = torch.nn.functional.one_hot(row.argmax(), row.shape[-1]).to(probs.dtype)
            continue
        row = row / spec.temperature
        if spec.top_k > 0 and spec.top_k < row.shape[-1]:
            kth = torch.topk(row, spec.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        p = torch.softmax(row, dim=-1)
        if spec.top_p < 1.0:
            sorted_p, order = p.sort(descending=True)
            # keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p
            drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= spec.top_p
            p = p.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), 0.0)
        if spec.min_p > 0.0:
            p = p.masked_fill(p < spec.min_p * p.max(), 0.0)
        probs[i] = p / p.sum()
    return probs


def generator_for(spec: SamplingSpec, device: torch.device, stream: int = 0) -> torch.Generator:
    """A generator determined by (seed, draw, stream) alone, so a re-run draws the same numbers."""
    g = torch.Generator(device=device)
    g.manual_seed((spec.seed * 1_000_003 + spec.draw * 7919 + stream) % (2**63 - 1))
    return g


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, top: int):
    """Log-probabilities under the model's raw distribution: of each chosen token, and the top `top`."""
    lp = torch.log_softmax(logits, dim=-1)
    chosen = lp.gather(-1, tokens[:, None])[:, 0]
    top_vals, top_ids = lp.topk(top, dim=-1) if top > 0 else (lp[:, :0], tokens[:, None][:, :0])
    return chosen, top_ids, top_vals

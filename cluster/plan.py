"""The records a step crosses the scheduler/worker boundary with: the plan out, the result back."""

from __future__ import annotations

from dataclasses import dataclass

from metrale.workers.sampler import SamplingSpec


@dataclass
class SeqWork:
    seq_id: int
    tokens: list[int]          # the rows to run: a prefill chunk, or the one pending token
    context_len: int           # tokens already in the caches (absolute position of tokens[0])
    block_table: list[int]
    slot: int                  # SSM slot, -1 for models without linear attention
    sample: SamplingSpec | None  # None for a prefill chunk that does not reach the end


@dataclass
class StepPlan:
    work: list[SeqWork]

    @property
    def num_tokens(self) -> int:
        return sum(len(w.tokens) for w in self.work)


@dataclass
class SampledToken:
    seq_id: int
    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


@dataclass
class StepResult:
    sampled: list[SampledToken]


@dataclass(frozen=True)
class WorkerCapacity:
    """What a worker reports at start-up; the scheduler admits against it."""
    num_blocks: int
    block_size: int
    num_slots: int             # SSM slots (0 for models without linear attention)
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    hybrid: bool

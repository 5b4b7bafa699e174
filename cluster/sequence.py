"""One sequence's life in the scheduler: tokens, cache places, output text and finish state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from metrale.cluster.detokenizer import IncrementalDetokenizer
from metrale.cluster.params import SamplingParams
from metrale.drafting.stats import SpecStats


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    index: int                    # which of the request's n completions
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    detokenizer: IncrementalDetokenizer
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_computed: int = 0         # tokens whose K/V and SSM state are in the caches
    block_table: list[int] = field(default_factory=list)
    published: int = 0            # leading full blocks offered to the prefix cache...
    published_hash: bytes = b""   # ...and the hash chain's value after them
    slot: int = -1
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_preemptions: int = 0
    spec: SpecStats = field(default_factory=SpecStats)
    streamed: bool = True         # its caller reads tokens as they come (not only at the end)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def tokens_between(self, start: int, end: int) -> list[int]:
        """tokens[start:end], without building the whole list."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p:end - p]
        return self.prompt_ids[start:] + self.output_ids[:end - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens still to run through the model before the next one can be sampled."""
        return self.num_tokens - self.num_computed

    @property
    def decoding(self) -> bool:
        """One token pends and it is an output token: the sequence's rows up to it are in the
        caches, so a drafter has a row to draft from. A prompt of one token pends one token too,
        its prefill."""
        return self.num_pending == 1 and self.num_computed >= len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

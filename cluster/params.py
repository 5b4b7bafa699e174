"""Sampling parameters of one request, validated where a request enters the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from metrale.workers.sampler import GREEDY_BELOW, TokenConstraint


class RequestError(ValueError):
    """A request the engine refuses; the message names the offending field."""


MAX_TOKEN_ID = 2**31   # beyond any vocabulary; the scheduler checks the model's own size
GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf")


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match (structured output); plain data, so it crosses process
    boundaries. Workers compile it with xgrammar against the checkpoint's tokenizer."""
    kind: str            # json_object | json_schema | regex | ebnf
    value: str = ""      # the schema (JSON text), the regular expression or the EBNF grammar
    strict: bool = True  # json_schema: reject properties the schema does not list

    def __post_init__(self):
        if self.kind not in GRAMMAR_KINDS:
            raise RequestError(f"response_format type {self.kind!r} is not one of "
                               f"{', '.join(GRAMMAR_KINDS)}")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0              # 0 (or -1) means no top-k cut
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # number of top alternatives to return per token
    grammar: GrammarSpec | None = None      # structured output (compiled by xgrammar)
    constraint: TokenConstraint | None = field(default=None, compare=False)  # an in-process mask

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def validate(self) -> None:
        def check(ok: bool, name: str, rule: str, value):
            if not ok:
                raise RequestError(f"{name} must be {rule}, got {value!r}")
        check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens",
              "an integer >= 1", self.max_tokens)
        check(self.temperature >= 0, "temperature", ">= 0", self.temperature)
        check(0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k",
              "-1, 0 (off) or a positive integer", self.top_k)
        check(0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        check(isinstance(self.n, int) and self.n >= 1, "n", "an integer >= 1", self.n)
        check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
              "logprobs", "an integer in [0, 20]", self.logprobs)
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings",
              self.stop)
        check(all(isinstance(t, int) and 0 <= t < MAX_TOKEN_ID for t in self.stop_token_ids),
              "stop_token_ids", "token ids", self.stop_token_ids)
        check(self.seed is None or (isinstance(self.seed, int) and -2**63 <= self.seed < 2**63),
              "seed", "a 64-bit integer", self.seed)

"""The records a step crosses the scheduler/worker boundary with: the plan out, the result back."""

from __future__ import annotations

from dataclasses import dataclass, field

from metrale.cluster.params import GrammarSpec
from metrale.workers.sampler import SamplingSpec, TokenConstraint


AHEAD = -1   # a row's token that the worker sampled for the sequence in the plan before this one


@dataclass
class SeqWork:
    seq_id: int
    tokens: list[int]          # the rows to run: a prefill chunk, or the one pending token
                               # ([AHEAD] when planned before the previous step's result)
    context_len: int           # tokens already in the caches (absolute position of tokens[0])
    block_table: list[int]
    slot: int                  # the sequence's slot: SSM state, verify pool, drafter state
    sample: SamplingSpec | None  # None for a prefill chunk that does not reach the end
    prompt_len: int = 0
    num_drafts: int = 0        # drafts to propose and verify after the pending token
    pad_to: int = 0            # draft rows to verify, filler after the real ones (pad_drafts)
    next_token: int | None = None  # the token after a prefill chunk that does not sample
    grammar: GrammarSpec | None = None
    constraint: TokenConstraint | None = None
    steps: int = 1             # decode steps in a row: each after the first runs the token the
                               # step before sampled (plain decoding; Worker._execute_steps);
                               # with drafts, or greedy without on a worker that chains,
                               # rounds chained on the device (Worker._execute_chain)

    @property
    def decodes(self) -> bool:
        """One output token pends (Sequence.decoding): a prompt's last token, alone, is a
        prefill's."""
        return len(self.tokens) == 1 and self.context_len >= self.prompt_len


@dataclass
class StepPlan:
    work: list[SeqWork]
    planned_at: float = 0.0    # the scheduler's clock when it began the plan
    prefill: bool = False      # prompt chunks only, on a graph worker (the scheduler times these)


@dataclass
class TokenLogprobs:
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class SeqOutcome:
    seq_id: int
    tokens: list[int]          # accepted drafts, then the sampled (bonus or replacement) token
    proposed: int = 0          # drafts verified this step
    accepted: int = 0
    logprobs: list[TokenLogprobs] | None = None
    rounds: list[int] | None = None   # a chain's accepted drafts per round, each round of
                                      # proposed / len(rounds) drafts (Worker._execute_chain)

    def verifies(self, taken: int | None = None) -> tuple[int, list[int]]:
        """The drafts each verify of the outcome carried, and the drafts each accepted. With
        `taken`, the tokens the sequence kept (a stop or its length may end it inside the
        outcome), only what it kept: the verifies that began while it ran, and of the last the
        drafts it kept. A chain's rounds after its end ran for no one."""
        per_round = [self.accepted] if self.rounds is None else self.rounds
        drafts = self.proposed // len(per_round)
        if taken is None or taken >= sum(per_round) + len(per_round):   # it kept them all
            return drafts, per_round
        kept, emitted = [], 0
        for accepted in per_round:
            if emitted >= taken:
                break
            kept.append(min(accepted, taken - emitted - 1))
            emitted += accepted + 1
        return drafts, kept


@dataclass
class StepResult:
    outcomes: list[SeqOutcome] = field(default_factory=list)
    propose_s: float = 0.0     # seconds the step spent drafting
    forward_s: float = 0.0     # seconds in the target forward, verify and commit


@dataclass(frozen=True)
class WorkerCapacity:
    """What a worker reports at start-up; the scheduler admits and plans drafts against it."""
    num_blocks: int
    block_size: int
    num_slots: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    hybrid: bool
    proposer: str = "none"                 # speculative method of the worker's proposer
    slot_capacity: tuple[int, ...] = ()    # most drafts one verify may carry, per slot
    ragged_drafts: bool = True             # sequences of one round may carry different k
    fixed_drafts: int | None = None        # DFlash: gamma - 1
    propose_batch_max: int = 64
    self_speculative: bool = False
    prefix_sharing: bool = True            # False when the proposer keeps per-row state
    on_gpu: bool = False
    pad_drafts: bool = False               # the worker verifies filler rows up to a planned depth
    graphs: bool = False                   # it replays captured decode/verify steps: a step that
                                           # mixes a prefill chunk in runs eagerly
    chain_rounds: int = 0                  # greedy rounds one plan may chain on the device

    @property
    def has_proposer(self) -> bool:
        return self.proposer != "none"

    @property
    def chains_ahead(self) -> bool:
        """Whether a chain of greedy rounds may be planned before the last one's result: it
        goes on from that one's state on the device (workers chain n-gram, MTP and DFlash
        rounds, and plain decode steps)."""
        return self.chain_rounds >= 2

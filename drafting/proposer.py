"""The proposer interface every drafter implements, the records it exchanges, and the registry."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from metrale.workers.batch import to_device

# allowed(drafts so far in this round) -> bool mask [vocab] for the next token, or None (no grammar)
MaskFn = Callable[[list[int]], "torch.Tensor | None"]


class ProposerError(ValueError):
    """A drafter that cannot serve this target; the message names the mismatch."""


@dataclass
class ProposeRequest:
    slot: int
    position: int               # absolute position of the pending token
    pending: int                # the last committed token, not yet run through the target
    num_drafts: int
    block_table: list[int]
    history: list[int]          # every committed token, the pending one last (for n-gram lookup)
    allowed: MaskFn | None = None


@dataclass
class Proposal:
    tokens: list[int]
    confidence: list[float] = field(default_factory=list)   # top-1 log-probability per draft


@dataclass
class CommittedRows:
    """Rows of the last target forward that are now part of one sequence: the drafter's input.
    Their hidden states are sliced out of the step's tensors only when read, so rows a drafter
    merely holds (HeldRows) cost no tensor operation."""
    slot: int
    start: int                  # absolute position of the first row
    tokens: list[int]           # the rows' input tokens
    next_tokens: list[int]      # the token after each row (the last one: sampled or looked ahead)
    step_hidden: torch.Tensor   # [step rows, hidden] target hidden states before the final norm
    step_captured: list[torch.Tensor]  # [step rows, hidden] per capture layer
    rows: slice                 # this sequence's rows of the step
    block_table: list[int]
    fresh: bool                 # the sequence's first rows: forget what the slot held before

    @property
    def hidden(self) -> torch.Tensor:
        return self.step_hidden[self.rows]

    @property
    def captured(self) -> list[torch.Tensor]:
        return [c[self.rows] for c in self.step_captured]


def gather_rows(rows: list[CommittedRows], parts) -> torch.Tensor:
    """[rows' total length, ...]: each CommittedRows' slice of the step tensors `parts(r)`
    (concatenated on the last dimension), stacked. Rows of one step take one index per tensor,
    not a slice per sequence."""
    every = [parts(r) for r in rows]
    first = every[0]
    if all(all(a is b for a, b in zip(p, first)) for p in every[1:]):
        total = first[0].shape[0]
        index = to_device([i for r in rows for i in range(*r.rows.indices(total))],
                          first[0].device)
        picked = [t[index] for t in first]
    else:
        picked = [torch.cat([p[j][r.rows] for r, p in zip(rows, every)]) for j in range(len(first))]
    return picked[0] if len(picked) == 1 else torch.cat(picked, -1)


# Committed rows a slot may hold back before its drafter catches up anyway. The draft policy
# charges a round's propose time to its k, and a round of drafts after a stretch of k = 0 (a
# probe) catches up on what the slot held: at 64 rows that was an eager forward (MTP's
# captured catch-ups take up to 16 rows a sequence), and such probes measured 0.53-2.5 ms of
# proposing at batch 1 on the H200 against 0.31-0.39 ms in rounds that followed rounds of
# drafts (bench-bbd40be.json, bench-f8080c6.json: `draft_policy`), which kept k = 0 chosen.
# Holding at most 15 (a catch-up of at most 16, captured) keeps a probe's catch-up the size of
# a round's; rounds of k = 0 pay a captured catch-up every 16 tokens.
HOLD_ROWS = 15


class HeldRows:
    """Committed rows a drafter has not consumed yet, per slot. A drafter with per-sequence state
    (MTP's cache and stash, DFlash's context) catches up only for the sequences it is asked to
    propose for, in one forward over all their held rows, so rounds without drafts (the draft
    policy's k = 0) cost it nothing. A slot holds at most `limit` rows."""

    def __init__(self, limit: int = HOLD_ROWS):
        self.limit = limit
        self.held: dict[int, list[CommittedRows]] = {}
        self.count: dict[int, int] = {}

    def add(self, rows: list[CommittedRows]) -> list[CommittedRows]:
        """Holds `rows`; returns, merged, those of slots now holding more than the limit."""
        for r in rows:
            if r.fresh:   # the slot's new sequence: what it held is no one's now
                self.held[r.slot], self.count[r.slot] = [], 0
            self.held.setdefault(r.slot, []).append(r)
            self.count[r.slot] = self.count.get(r.slot, 0) + len(r.tokens)
        return self.take([r.slot for r in rows if self.count[r.slot] > self.limit])

    def take(self, slots) -> list[CommittedRows]:
        """The slots' held rows, one contiguous CommittedRows per slot that holds any."""
        out = []
        for slot in dict.fromkeys(slots):
            rows = self.held.pop(slot, None)
            self.count.pop(slot, None)
            if rows:
                out.append(rows[0] if len(rows) == 1 else _joined(rows))
        return out


def _joined(rows: list[CommittedRows]) -> CommittedRows:
    for a, b in zip(rows, rows[1:]):
        assert b.start == a.start + len(a.tokens), "held rows of a slot are contiguous"
    return CommittedRows(rows[0].slot, rows[0].start, [t for r in rows for t in r.tokens],
                         [t for r in rows for t in r.next_tokens],
                         torch.cat([r.hidden for r in rows]),
                         [torch.cat(layer) for layer in zip(*(r.captured for r in rows))],
                         slice(None), rows[-1].block_table, rows[0].fresh)


class Proposer(Protocol):
    method: str
    capture_layers: tuple[int, ...]   # target layers whose outputs `commit` needs
    max_batch: int                    # widest batch one propose forward takes
    fixed_drafts: int | None          # drafts per propose fixed by the drafter (DFlash: gamma - 1)
    keeps_row_state: bool             # per-sequence state built from every row (no prefix
                                      # sharing); without it, the worker never calls commit

    def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        """Up to `num_drafts` drafts per request (fewer when the drafter stops early)."""

    def propose_on_device(self, requests: list[ProposeRequest]) -> torch.Tensor | None:
        """Optional (MTP and DFlash have it). Greedy drafts [n, >= num_drafts] left on the
        device, which the worker writes into the verify's inputs there and reads with the
        verdicts; None when the proposer cannot here (the worker then calls propose). The
        requests carry no grammar."""

    def commit(self, rows: list[CommittedRows]) -> None:
        """Newly committed rows: the drafter's per-sequence state must reflect them by the time
        it proposes for their sequence (MTP and DFlash hold them until then: HeldRows). Called
        only for a proposer that keeps_row_state."""


METHODS = ("none", "mtp", "dflash", "ngram", "self")


def build_proposer(method: str, **resources) -> Proposer | None:
    """The proposer registered under `method`, built from the worker's resources."""
    if method not in METHODS:
        raise ProposerError(f"speculative method {method!r} is not one of {', '.join(METHODS)}")
    if method == "none":
        return None
    from metrale.drafting import dflash, mtp, ngram, self_spec
    registry = {"mtp": mtp.MTPProposer.from_worker, "dflash": dflash.DFlashProposer.from_worker,
                "ngram": ngram.NgramProposer.from_worker,
                "self": self_spec.SelfSpecProposer.from_worker}
    return registry[method](**resources)


def in_batches(requests: list[ProposeRequest], width: int, propose_batch) -> list[Proposal]:
    """`propose_batch` over consecutive groups of at most `width` requests, results in order."""
    out: list[Proposal] = []
    for i in range(0, len(requests), width):
        out.extend(propose_batch(requests[i:i + width]))
    return out


def masked_argmax(logits: torch.Tensor, allowed: torch.Tensor | None) -> tuple[int, float]:
    """The best allowed token of one row of logits and its log-probability under the mask."""
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    logp = torch.log_softmax(logits.float(), dim=-1)
    token = int(logp.argmax())
    return token, float(logp[token])

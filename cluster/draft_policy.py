"""The draft-length policy: each round's k, from measured acceptance and measured step costs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PRIOR_RATE = 0.5     # acceptance assumed at a draft position not yet measured...
PRIOR_WEIGHT = 2.0   # ...worth this many observations
DECAY = 0.95         # per step that observes a position: its history's weight halves in ~14 steps
OWN_PRIOR = 2.0      # a sequence's own skill (accepted / expected by the pooled rates) starts at 1,
                     # worth this many drafts the pooled rates expected accepted...
OWN_DECAY = 0.95     # ...and its own history's weight halves in ~14 of its rounds
COST_DECAY = 0.8     # weight of the old average when a (batch bucket, k) step time is measured
COST_CLIP = 3.0      # a step time above 3x the average counts as 3x (a stall, not the k's cost);
                     # one below a third of it replaces it (the average held a stall)
PROBE_EVERY = 8      # a round in 8 runs a neighbour of the best k, so its figures stay current...
PROBE_MOST = 64      # ...a round in up to 64 while probes keep confirming the best k


def batch_bucket(batch: int) -> int:
    """Batch sizes share a cost model per power of two: 1, 2, 4, 8, ..."""
    return 1 << max(batch - 1, 0).bit_length()


@dataclass
class StepCost:
    """Decaying averages of one (batch bucket, k)'s propose and target forward + verify seconds.
    The first round of a (batch bucket, k) pays one-time costs (kernels compiled for its shapes,
    CUDA graphs captured on first use), so its figures are replaced by the second round's and
    only count from then on (`samples`). A stall that lands in the second round anyway (a kernel
    compiled for a shape seen first then) is replaced by the first round three times faster."""
    propose_s: float
    forward_s: float
    samples: int = 1

    @property
    def seconds(self) -> float:
        return self.propose_s + self.forward_s

    def add(self, propose_s: float, forward_s: float) -> None:
        over = (propose_s + forward_s) / (COST_CLIP * self.seconds) if self.seconds else 0.0
        if not self.samples or over < 1 / COST_CLIP ** 2:   # a warm-up's figures, or a stall's
            self.propose_s, self.forward_s = propose_s, forward_s
        else:
            if over > 1:
                propose_s, forward_s = propose_s / over, forward_s / over
            self.propose_s = COST_DECAY * self.propose_s + (1 - COST_DECAY) * propose_s
            self.forward_s = COST_DECAY * self.forward_s + (1 - COST_DECAY) * forward_s
        self.samples += 1


class Probes:
    """When a batch bucket's next probe is due: PROBE_EVERY rounds after a probe that changed the
    best k (or the first), twice the last wait, up to PROBE_MOST, after one that confirmed it; a
    probe of a losing k costs more than a round, so a settled choice is probed rarely."""

    def __init__(self):
        self.wait = self.left = PROBE_EVERY
        self.best: int | None = None
        self.up = False

    def due(self, best: int) -> bool:
        self.left -= 1
        if self.left > 0:
            return False
        self.wait = min(2 * self.wait, PROBE_MOST) if best == self.best else PROBE_EVERY
        self.best, self.left, self.up = best, self.wait, not self.up
        return True


class DraftPolicy:
    """Chooses the drafts per sequence of a round, 0..max_drafts, that maximise expected committed
    tokens per second: E[tokens | k] = 1 + sum_{i<=k} prod_{j<=i} a_j, a_j being the measured
    probability that draft j is accepted when drafts 1..j-1 were, over the measured step time of
    k drafts at this batch size. Not adaptive, it always answers max_drafts.

    Acceptance is pooled over every sequence. Given `slots`, each slot also keeps its sequence's
    skill: drafts it had accepted over those the pooled rates expected it to. A round's
    E[tokens | k] is then the mean over its sequences of each one's, at the pooled rates times its
    skill. Sequences differ (a prompt that repeats itself against free prose): the last few of a
    batch are often those that accept least, and rounds over them alone are better off with fewer
    drafts than the pooled rates say."""

    def __init__(self, max_drafts: int, adaptive: bool = True, slots: int = 0):
        self.max_drafts, self.adaptive = max_drafts, adaptive and max_drafts > 0
        self.tried = np.zeros(max_drafts)     # decayed counts per draft position
        self.accepted = np.zeros(max_drafts)
        self.own_accepted = np.zeros(slots)   # decayed drafts accepted, per slot...
        self.own_expected = np.zeros(slots)   # ...and accepted as the pooled rates expected
        self.costs: dict[int, dict[int, StepCost]] = {}   # batch bucket -> k -> measured cost
        self.chosen: dict[int, int] = {}                  # batch bucket -> k of its last round
        self.probes: dict[int, Probes] = {}               # batch bucket -> its probe schedule
        self.last_k = max_drafts                          # k of the latest round
        self.probed = False                               # whether the latest round was a probe

    # -- the choice ---------------------------------------------------------------------

    def choose(self, batch: int, slots: list[int] | None = None) -> int:
        """k for a round of `batch` decoding sequences, in `slots` when given (the scheduler
        then caps it per sequence). Now and then a round tries the best k's neighbour,
        alternately above and below, so a k that lost once (0 included) is measured again and can
        win back (see Probes)."""
        if not self.adaptive:
            return self.max_drafts
        bucket = batch_bucket(batch)
        k = self.best(bucket, slots)
        probes = self.probes.setdefault(bucket, Probes())
        self.probed = probes.due(k)
        if self.probed:
            k = k + 1 if (probes.up and k < self.max_drafts) or k == 0 else k - 1
        self.chosen[bucket] = self.last_k = k
        return k

    def best(self, bucket: int, slots: list[int] | None = None) -> int:
        """The k with the most expected tokens per second; max_drafts before any step is timed."""
        table = self._cost_table(bucket)
        if not table:
            return self.max_drafts
        tokens = self.expected_tokens(slots)
        rates = [tokens[k] / self.step_seconds(table, k) for k in range(self.max_drafts + 1)]
        return max(range(len(rates)), key=lambda k: (rates[k], -k))

    def expected_tokens(self, slots: list[int] | None = None) -> np.ndarray:
        """Committed tokens per sequence of a round of k drafts, for k = 0..max_drafts: the bonus
        or replacement token, plus draft i when it and every draft before it are accepted. Over
        the sequences in `slots`, the mean of each one's own; else by the pooled rates."""
        pooled = self.acceptance_at()
        if slots:
            rates = np.minimum(self.skill(slots)[:, None] * pooled, 1.0)
            reach = np.cumsum(np.cumprod(rates, axis=1), axis=1).mean(axis=0)
        else:
            reach = np.cumsum(np.cumprod(pooled))
        return np.concatenate(([1.0], 1.0 + reach))

    def skill(self, slots: list[int]) -> np.ndarray:
        """Per slot: drafts accepted / drafts the pooled rates expected accepted, 1 a priori."""
        return ((self.own_accepted[slots] + OWN_PRIOR) / (self.own_expected[slots] + OWN_PRIOR))

    def acceptance_at(self) -> np.ndarray:
        return (self.accepted + PRIOR_RATE * PRIOR_WEIGHT) / (self.tried + PRIOR_WEIGHT)

    @staticmethod
    def step_seconds(table: dict[int, StepCost], k: int) -> float:
        """A round's measured seconds at k; between measured ks, the straight line through the
        nearest ones. Beyond them the estimate is optimistic, so that an unmeasured k gets tried:
        above, more drafts as if free; below, time falling with the rows (k + 1) of the verify."""
        if k in table:
            return table[k].seconds
        below = max((m for m in table if m < k), default=None)
        above = min((m for m in table if m > k), default=None)
        if below is None:
            return table[above].seconds * (k + 1) / (above + 1)
        if above is None:
            return table[below].seconds
        lo, hi = table[below].seconds, table[above].seconds
        return lo + (hi - lo) * (k - below) / (above - below)

    def _cost_table(self, bucket: int) -> dict[int, StepCost]:
        """The bucket's measurements, or those of the nearest measured bucket until it has some
        (a k's first round, its warm-up, is not a measurement)."""
        tables = {b: {k: c for k, c in t.items() if c.samples} for b, t in self.costs.items()}
        if tables.get(bucket):
            return tables[bucket]
        measured = [b for b, t in tables.items() if t]
        if not measured:
            return {}
        return tables[min(measured, key=lambda b: abs(b.bit_length() - bucket.bit_length()))]

    # -- measurements -------------------------------------------------------------------

    def record_acceptance(self, outcomes: list[tuple[int, int]],
                          slots: list[int] | None = None) -> None:
        """One step's (drafts asked for, drafts accepted) per sequence, in `slots` when given.
        Draft i was tried when drafts 1..i-1 were accepted; positions the step did not reach
        keep their history (the pooled one, and each slot's own)."""
        if not outcomes or not self.max_drafts:
            return
        proposed, accepted = np.array(outcomes).reshape(-1, 2).T
        reached = np.minimum(np.minimum(proposed, accepted + 1), self.max_drafts)
        position = np.arange(self.max_drafts)
        tried = position < reached[:, None]                 # [sequences, positions]
        hit = position < np.minimum(accepted, reached)[:, None]
        seen = tried.any(axis=0)
        pooled = self.acceptance_at()
        self.tried = np.where(seen, DECAY * self.tried + tried.sum(axis=0), self.tried)
        self.accepted = np.where(seen, DECAY * self.accepted + hit.sum(axis=0), self.accepted)
        if slots is not None:
            expected = tried @ pooled                       # by the rates before this step
            reached_any = reached > 0
            self.own_accepted[slots] = np.where(
                reached_any, OWN_DECAY * self.own_accepted[slots] + hit.sum(axis=1),
                self.own_accepted[slots])
            self.own_expected[slots] = np.where(
                reached_any, OWN_DECAY * self.own_expected[slots] + expected,
                self.own_expected[slots])

    def reset(self, slot: int) -> None:
        """Forgets the slot's own acceptance: a new sequence holds it."""
        self.own_accepted[slot] = self.own_expected[slot] = 0.0

    def record_cost(self, batch: int, drafts: int, propose_s: float, forward_s: float) -> None:
        """A decode step's seconds: `batch` sequences carrying `drafts` drafts in all."""
        if not batch or not self.adaptive:
            return
        k = min(round(drafts / batch), self.max_drafts)
        table = self.costs.setdefault(batch_bucket(batch), {})
        if k in table:
            table[k].add(propose_s, forward_s)
        else:
            table[k] = StepCost(propose_s, forward_s, samples=0)

    # -- state --------------------------------------------------------------------------

    def as_dict(self) -> dict:
        return {"adaptive": self.adaptive, "max_drafts": self.max_drafts,
                "acceptance_at": [round(float(a), 4) for a in self.acceptance_at()],
                "k_by_batch": {b: self.chosen[b] for b in sorted(self.chosen)},
                "step_ms_by_batch": {b: {k: {"propose": round(c.propose_s * 1e3, 3),
                                             "forward": round(c.forward_s * 1e3, 3)}
                                         for k, c in sorted(t.items())}
                                     for b, t in sorted(self.costs.items())}}

"""The draft-length policy: each round's k, from measured acceptance and measured step costs."""

from __future__ import annotations

import statistics
from collections import Counter, deque

PRIOR_RATE = 0.5     # acceptance assumed at a draft position not yet measured...
PRIOR_WEIGHT = 2.0   # ...worth this many observations
DECAY = 0.95         # per draft seen at a position: its history's weight halves in ~14 drafts
COST_SAMPLES = 5     # a (batch bucket, k)'s step time is the median of its latest 5 rounds...
CONFIRMED = 3        # ...and it is settled once 3 have been measured (a stall is then outvoted)
COST_CLIP = 3.0      # a round above 3x the median counts as 3x; one below a third of it starts
                     # the rounds kept anew (those held a stall)
PROBE_EVERY = 8      # a round in 8 runs a neighbour of the best k, so its figures stay current...
PROBE_MOST = 64      # ...a round in up to 64 while probes keep confirming the best k
PROBE_GAIN = 1.1     # a probe first re-measures an unsettled k that could beat the best by 10%
SURPRISE = 1.0       # a probe from k = 0 whose sequences accepted 1 draft more than expected
                     # (on average) is followed by another, the next round


def batch_bucket(batch: int) -> int:
    """Batch sizes share a cost model per power of two: 1, 2, 4, 8, ..."""
    return 1 << max(batch - 1, 0).bit_length()


class StepCost:
    """One (batch bucket, k)'s propose and target forward + verify seconds: the medians of its
    latest COST_SAMPLES rounds. The first round of a (batch bucket, k) pays one-time costs
    (kernels compiled for its shapes, CUDA graphs captured on first use), so it is not one of
    them (`samples` is 0 until the second). A median lets one stall (a collection, a kernel
    compiled late) count for nothing once CONFIRMED rounds are measured; until then the k is
    unsettled, and the policy's probes measure it again (`DraftPolicy.choose`). Before that a
    round is clipped to COST_CLIP times the median, and one far below it (the earlier rounds
    were a stall) starts the median anew."""

    def __init__(self, propose_s: float, forward_s: float, samples: int = 1):
        self._recent: deque[tuple[float, float]] = deque(maxlen=COST_SAMPLES)
        # the warm-up's figures stand in until a round is measured
        self.propose_s, self.forward_s, self.samples = propose_s, forward_s, 0
        for _ in range(samples):
            self.add(propose_s, forward_s)

    @property
    def seconds(self) -> float:
        return self.propose_s + self.forward_s

    @property
    def settled(self) -> bool:
        return self.samples >= CONFIRMED

    def add(self, propose_s: float, forward_s: float) -> None:
        over = (propose_s + forward_s) / (COST_CLIP * self.seconds) if self.samples else 0.0
        if over > 1:
            propose_s, forward_s = propose_s / over, forward_s / over
        elif self.samples and over < 1 / COST_CLIP ** 2:
            self._recent.clear()
        self._recent.append((propose_s, forward_s))
        self.samples += 1
        self.propose_s = statistics.median(p for p, _ in self._recent)
        self.forward_s = statistics.median(f for _, f in self._recent)


class Probes:
    """When a batch bucket's next probe is due: PROBE_EVERY rounds after a probe that changed the
    best k (or the first), twice the last wait, up to PROBE_MOST, after one that confirmed it; a
    probe of a losing k costs more than a round, so a settled choice is probed rarely."""

    def __init__(self):
        self.wait = self.left = PROBE_EVERY
        self.best: int | None = None
        self.up = False
        self.again = False   # the latest probe contradicted the estimates: probe the next round

    def due(self, best: int, unsettled: bool = False) -> bool:
        """Whether this round is a probe; `unsettled`: a k worth measuring again is waiting, so
        the wait after this probe does not grow."""
        self.left -= 1
        if self.again:
            self.again, self.left, self.best = False, 0, None   # not a confirming probe
        if self.left > 0:
            return False
        settled = best == self.best and not unsettled
        self.wait = min(2 * self.wait, PROBE_MOST) if settled else PROBE_EVERY
        self.best, self.left, self.up = best, self.wait, not self.up
        return True


class DraftPolicy:
    """Chooses the drafts per sequence of a round, 0..max_drafts, that maximise expected committed
    tokens per second: E[tokens | k] = 1 + sum_{i<=k} prod_{j<=i} a_j, a_j being the measured
    probability that draft j is accepted when drafts 1..j-1 were, over the measured step time of
    k drafts at this batch size. Not adaptive, it always answers max_drafts."""

    def __init__(self, max_drafts: int, adaptive: bool = True):
        self.max_drafts, self.adaptive = max_drafts, adaptive and max_drafts > 0
        self.tried = [0.0] * max_drafts       # decayed counts per draft position
        self.accepted = [0.0] * max_drafts
        self.costs: dict[int, dict[int, StepCost]] = {}   # batch bucket -> k -> measured cost
        self.chosen: dict[int, int] = {}                  # batch bucket -> k of its last round
        self.probes: dict[int, Probes] = {}               # batch bucket -> its probe schedule
        self.last_k = max_drafts                          # k of the latest round
        self.probed = False                               # whether the latest round was a probe
        self.zero_probe: int | None = None                # bucket of a probe from k = 0 to judge

    # -- the choice ---------------------------------------------------------------------

    def choose(self, batch: int) -> int:
        """k for a round of `batch` decoding sequences (the scheduler then caps it per sequence).
        Now and then a round is a probe (see Probes). One slow round must not rule a k out for
        good, so a probe first measures again an unsettled k (fewer than CONFIRMED rounds
        measured) that could win: one that would beat the best k's rate by PROBE_GAIN if it
        cost no more than the nearest smaller k measured. Otherwise it tries the best k's
        neighbour, alternately above and below, so a k that lost (0 included) is measured
        again and can win back; from k = 0 it tries the best-rated k above 0 instead of 1. A
        probe measures acceptance only up to its k, and k = 1 can lose to 0 whatever its
        acceptance (a block drafter such as DFlash proposes 1 draft for what 7 cost), so probes
        of 1 alone would never measure the deeper positions that make a larger k win."""
        if not self.adaptive:
            return self.max_drafts
        bucket = batch_bucket(batch)
        rates = self.rates(bucket)
        k = self.best(bucket, rates)
        unsettled = self._could_win(bucket, k, rates[k]) if rates else []
        probes = self.probes.setdefault(bucket, Probes())
        self.probed = probes.due(k, bool(unsettled))
        if self.probed:
            self.zero_probe = bucket if k == 0 else None
        if self.probed and unsettled:
            k = unsettled[0]
        elif self.probed and k == 0:
            k = max(range(1, self.max_drafts + 1), key=lambda j: (rates[j], -j))
        elif self.probed:
            k = k + 1 if probes.up and k < self.max_drafts else k - 1
        self.chosen[bucket] = self.last_k = k
        return k

    def _could_win(self, bucket: int, best: int, rate: float) -> list[int]:
        """The bucket's unsettled ks other than `best` that could beat `rate`, the likeliest
        first: each at the expected tokens of its drafts over the time measured at the nearest
        smaller k, as if the drafts beyond that k were free; k = 0 over the least time measured
        without drafts at a smaller batch bucket (fewer sequences cost no more). Otherwise a
        first round of k = 0 that stalled would rule it out wherever the best k is far from 0,
        as neighbours probe it only from k = 1."""
        costs = self.costs.get(bucket, {})
        if all(c.settled for c in costs.values()):
            return []
        measured = {m: c.seconds for m, c in costs.items() if c.samples}
        tokens, rated = self._expected_tokens(), []
        for m, c in costs.items():
            below = max((j for j in measured if j < m), default=None)
            if m == best or c.settled:
                continue
            if below is not None:
                rated.append((tokens[m] / measured[below], m))
            elif m == 0 and (plain := self._least_time_without_drafts(bucket)) is not None:
                rated.append((tokens[0] / plain, m))
        return [m for r, m in sorted(rated, reverse=True) if r > PROBE_GAIN * rate]

    def _least_time_without_drafts(self, below: int) -> float | None:
        """The least step seconds measured at k = 0 at a batch bucket smaller than `below`."""
        return min((t[0].seconds for b, t in self.costs.items()
                    if b < below and 0 in t and t[0].samples), default=None)

    def rates(self, bucket: int) -> list[float] | None:
        """Expected tokens per second of each k, 0..max_drafts; None before any step of this
        bucket (or a neighbour) is timed."""
        table = self._cost_table(bucket)
        if not table:
            return None
        return [tokens / self.step_seconds(table, k)
                for k, tokens in enumerate(self._expected_tokens())]

    def best(self, bucket: int, rates: list[float] | None = None) -> int:
        """The k with the most expected tokens per second (`rates`, when the caller has them);
        max_drafts before any step is timed."""
        rates = rates or self.rates(bucket)
        if rates is None:
            return self.max_drafts
        return max(range(len(rates)), key=lambda k: (rates[k], -k))

    def expected_tokens(self, k: int) -> float:
        """Committed tokens per sequence of a round of k drafts: the bonus or replacement token,
        plus draft i when it and every draft before it are accepted."""
        return self._expected_tokens()[k]

    def _expected_tokens(self) -> list[float]:
        """expected_tokens(k) for every k, 0..max_drafts."""
        out, reach = [1.0], 1.0
        for a in self.acceptance_at():
            reach *= a
            out.append(out[-1] + reach)
        return out

    def acceptance_at(self) -> list[float]:
        return [(acc + PRIOR_RATE * PRIOR_WEIGHT) / (tried + PRIOR_WEIGHT)
                for acc, tried in zip(self.accepted, self.tried)]

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
        """The bucket's measurements (a k's first round, its warm-up, is not one). A k it has
        not measured takes the nearest larger bucket's figure for it: fewer sequences cost no
        more, so that bounds it. Left to `step_seconds`, below the bucket's least measured k
        time falls with the rows, and on a small model, whose round costs about the same
        whatever its k, that made k = 0 look three times cheaper than k = 2: at the end of a
        batch the last sequences then ran without drafts (deploy/results/HISTORY.md,
        "The end of a batch without drafts"). A bucket with neither its own nor a larger
        bucket's figures takes those of the nearest measured one."""
        measured = {b: own for b, t in self.costs.items()
                    if (own := {k: c for k, c in t.items() if c.samples})}
        table = dict(measured.get(bucket, {}))
        for larger in sorted(b for b in measured if b > bucket):
            for k, cost in measured[larger].items():
                table.setdefault(k, cost)
        if table or not measured:
            return table
        nearest = min(measured, key=lambda b: abs(b.bit_length() - bucket.bit_length()))
        return measured[nearest]

    # -- measurements -------------------------------------------------------------------

    def record_acceptance(self, outcomes: list[tuple[int, int]]) -> None:
        """One step's (drafts asked for, drafts accepted) per sequence. Draft i was tried when
        drafts 1..i-1 were accepted; positions the step did not reach keep their history. The
        history fades per draft seen, not per step: a step of 32 sequences outweighs the ones
        before it, so the estimates follow the sequences now running. When a batch ends, the last
        sequences often are those whose drafts fail (they finish last), and a decay per step kept
        the full batch's acceptance for them for some 40 rounds of a batch of 2 and of 1.
        Estimates learnt while drafts were failing outlive them when the policy stops drafting:
        only probes measure again, one round in up to PROBE_MOST. So a probe from k = 0 whose
        sequences accepted SURPRISE drafts more than the estimates expected is followed by
        another the next round, until the estimates agree or a k > 0 wins."""
        counts = Counter(outcomes)   # a step holds few distinct pairs (a chain's 8 x 32 rounds)
        if self.zero_probe is not None:   # while 0 is the best, the probe's drafts
            drafted = [(min(proposed, self.max_drafts), acc, n)
                       for (proposed, acc), n in counts.items() if proposed]
            if drafted:
                tokens = self._expected_tokens()
                surprise = (sum((acc - tokens[k] + 1) * n for k, acc, n in drafted)
                            / sum(n for _, _, n in drafted))
                self.probes[self.zero_probe].again = surprise >= SURPRISE
                self.zero_probe = None
        positions = self.max_drafts
        reached, took = [0] * (positions + 1), [0] * (positions + 1)   # by drafts tried, accepted
        for (proposed, acc), n in counts.items():
            tried = min(proposed, acc + 1, positions)
            reached[tried] += n
            took[min(acc, tried)] += n
        n = a = 0   # rounds that tried, and that accepted, position i: those reaching past it
        for i in range(positions - 1, -1, -1):
            n, a = n + reached[i + 1], a + took[i + 1]
            if n:
                self.tried[i] = DECAY ** n * self.tried[i] + n
                self.accepted[i] = DECAY ** n * self.accepted[i] + a

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
                "acceptance_at": [round(a, 4) for a in self.acceptance_at()],
                "k_by_batch": {b: self.chosen[b] for b in sorted(self.chosen)},
                "step_ms_by_batch": {b: {k: {"propose": round(c.propose_s * 1e3, 3),
                                             "forward": round(c.forward_s * 1e3, 3),
                                             "rounds": c.samples}
                                         for k, c in sorted(t.items())}
                                     for b, t in sorted(self.costs.items())}}

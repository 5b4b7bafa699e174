"""SpecStats counts a chain's rounds in one call as it counts them one by one."""

import random

import pytest

from metrale.cluster.plan import SeqOutcome
from metrale.drafting.stats import SpecStats


@pytest.mark.parametrize("seed", range(5))
def test_a_chains_rounds_recorded_at_once_count_as_each_alone(seed):
    rng = random.Random(seed)
    verifies = [(p, rng.randint(0, p)) for p in (rng.choice([0, 1, 3, 7, 15]) for _ in range(60))]
    together, alone = SpecStats(), SpecStats()
    for proposed in {p for p, _ in verifies}:
        together.record(proposed, *[a for p, a in verifies if p == proposed])
    for proposed, accepted in verifies:
        alone.record(proposed, accepted)
    drafted = [(p, a) for p, a in verifies if p]
    assert together == alone
    # and both by definition: draft i was tried by a verify of more than i drafts, and accepted
    # by one that accepted more than i
    assert together.rounds == len(drafted)
    assert together.drafts_accepted == sum(a for _, a in drafted)
    most = max(p for p, _ in drafted)
    assert together.proposed_at == [sum(p > i for p, _ in drafted) for i in range(most)]
    assert together.accepted_at == [sum(a > i for _, a in drafted) for i in range(most)]


def test_no_drafts_or_no_verifies_record_nothing():
    stats = SpecStats()
    stats.record(0, 0, 0)
    stats.record(4)
    assert stats == SpecStats()


def test_an_outcome_gives_its_verifies_drafts_and_accepted_counts():
    assert SeqOutcome(0, [5, 6], proposed=3, accepted=1).verifies() == (3, [1])
    chain = SeqOutcome(0, [5, 6, 7, 8, 9], proposed=12, accepted=2, rounds=[0, 2, 0])
    assert chain.verifies() == (4, [0, 2, 0])


def test_an_outcome_counts_only_what_its_sequence_kept():
    # 3 rounds of 4 drafts emitting 1, 3 and 1 tokens; the sequence kept `taken` of the 5
    chain = SeqOutcome(0, [5, 6, 7, 8, 9], proposed=12, accepted=2, rounds=[0, 2, 0])
    assert chain.verifies(5) == (4, [0, 2, 0])
    assert chain.verifies(4) == (4, [0, 2])      # the third round ran after its end
    assert chain.verifies(3) == (4, [0, 1])      # its last draft past the end is not its
    assert chain.verifies(1) == (4, [0])
    one = SeqOutcome(0, [5, 6, 7], proposed=3, accepted=2)
    assert one.verifies(3) == (3, [2]) and one.verifies(2) == (3, [1])

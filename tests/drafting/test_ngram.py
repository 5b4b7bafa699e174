"""The n-gram proposer's incremental index finds what the scan of the whole history finds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.drafting.ngram import NgramProposer, SuffixIndex, ngram_drafts
from metrale.drafting.proposer import ProposeRequest


@settings(max_examples=300, deadline=None, derandomize=True)
@given(tokens=st.lists(st.integers(0, 3), max_size=60),      # few symbols: many repeats
       grows=st.lists(st.integers(1, 6), min_size=1, max_size=20),
       sizes=st.tuples(st.integers(1, 3), st.integers(0, 3)), k=st.integers(1, 5))
def test_index_equals_scan_as_the_history_grows(tokens, grows, sizes, k):
    min_n, max_n = sizes[0], sizes[0] + sizes[1]
    history: list[int] = []
    index = SuffixIndex(history, min_n, max_n)
    at = 0
    for g in grows:   # the history grows by one or more tokens between lookups, as in rounds
        history.extend(tokens[at:at + g])
        at += g
        assert index.drafts(k) == ngram_drafts(history, k, min_n, max_n)


def test_proposer_rebuilds_when_a_slot_takes_a_new_sequence():
    p = NgramProposer(1, 3)
    first = [5, 6, 7, 5, 6]
    assert p.propose([ProposeRequest(0, 4, 6, 2, [], first)])[0].tokens == [7, 5]
    second = [1, 2, 1]   # a new list: the slot's next sequence
    assert p.propose([ProposeRequest(0, 2, 1, 2, [], second)])[0].tokens == [2, 1]
    first.extend([9, 5, 6])    # the index follows appends to the list it was built on
    p.propose([ProposeRequest(1, 7, 6, 3, [], first)])
    assert p.propose([ProposeRequest(1, 7, 6, 3, [], first)])[0].tokens == [9, 5, 6]

"""The worker's per-slot token histories: the rows a chain starting from the host uploads are the
lists' tokens, zero-padded, however the lists grew (prompts written through at once, a round's
few tokens later, slots reused, the array widened)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from metrale.workers.chain import SlotHistories, padded_histories


@pytest.mark.parametrize("mirrored", [True, False])
def test_rows_are_the_lists_zero_padded_through_resets_and_growth(mirrored):
    rng = random.Random(7)
    slots = 6
    histories, kept = SlotHistories(slots, mirrored), [[] for _ in range(slots)]
    for step in range(400):
        slot = rng.randrange(slots)
        if rng.random() < 0.05:
            histories.reset(slot)
            kept[slot] = []
        # mostly a round's few tokens; now and then a prompt-sized extension, past the
        # array's first width (256) too
        count = rng.choice([1, 2, 4, 8]) if rng.random() < 0.9 else rng.randrange(32, 300)
        tokens = [rng.randrange(1, 50_000) for _ in range(count)]
        histories.extend(slot, tokens)
        kept[slot].extend(tokens)
        assert histories[slot] == kept[slot]
        if step % 7 == 0:
            asked = rng.sample(range(slots), rng.randrange(1, slots + 1))
            if not any(kept[s] for s in asked):
                continue
            rows, lengths = histories.rows(asked)
            width = max(len(kept[s]) for s in asked)
            assert lengths == [len(kept[s]) for s in asked]
            assert rows.dtype == np.int64 and rows.shape == (len(asked), width)
            np.testing.assert_array_equal(rows, padded_histories([kept[s] for s in asked], width))


def test_a_reused_slot_shows_none_of_the_tokens_before_its_reset():
    histories = SlotHistories(2, mirrored=True)
    histories.extend(0, list(range(1, 101)))        # written through (a prompt)
    histories.extend(1, [5] * 40)
    histories.reset(0)
    histories.extend(0, [9, 9, 9])                  # a short extension, written when asked
    rows, lengths = histories.rows([0, 1])
    assert lengths == [3, 40]
    np.testing.assert_array_equal(rows[0], [9, 9, 9] + [0] * 37)
    np.testing.assert_array_equal(rows[1], [5] * 40)

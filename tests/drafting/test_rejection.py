"""The rejection sampler on hand-made distributions: greedy prefixes, and lossless sampling."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from metrale.drafting.rejection import Verdict, verify_drafts

V = 5


def dist(*values) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64)
    return t / t.sum()


def test_greedy_accepts_the_longest_matching_prefix():
    target = torch.eye(V)[[2, 4, 1, 0]]          # argmax per position: 2, 4, 1, 0
    assert verify_drafts([2, 4, 1], target, None, True, None, None) == Verdict(3, [2, 4, 1, 0])
    assert verify_drafts([2, 3, 1], target, None, True, None, None) == Verdict(1, [2, 4])
    assert verify_drafts([0, 4, 1], target, None, True, None, None) == Verdict(0, [2])
    assert verify_drafts([], target[:1], None, True, None, None) == Verdict(0, [2])


def wrong_replacement(drafts, target, draft_probs, greedy, uniforms, generators):
    """A deliberately wrong rule: on rejection, draw the replacement from p instead of
    norm(max(0, p - q)). It over-weights the rejected draft token."""
    for i, d in enumerate(drafts):
        q_d = draft_probs[i, d] if draft_probs is not None else 1.0
        if uniforms[i] * q_d < target[i, d]:
            continue
        return Verdict(i, drafts[:i] + [torch.multinomial(target[i], 1, generator=generators[i]).item()])
    return Verdict(len(drafts), drafts + [torch.multinomial(target[-1], 1, generator=generators[-1]).item()])


P1 = dist(0.35, 0.3, 0.2, 0.1, 0.05)
P2 = dist(0.1, 0.1, 0.5, 0.2, 0.1)
Q1 = dist(0.1, 0.6, 0.1, 0.1, 0.1)


def first_two_tokens(sampler, draft_mode: str, n: int = 6000, seed: int = 0):
    """Emitted (token 1, token 2) counts when the drafter proposes one or two tokens."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V)
    for _ in range(n):
        if draft_mode == "one-hot":          # a deterministic drafter always proposes token 1
            drafts, q = [1], None
        else:                                # a sampling drafter with distribution Q1
            drafts, q = [torch.multinomial(Q1, 1, generator=gen).item()], Q1[None]
        # the target's second distribution depends on the first token: P2 rolled by it
        target = torch.stack([P1, P2.roll(drafts[0])])
        gens = [torch.Generator().manual_seed(int(torch.randint(1 << 30, (), generator=gen)))
                for _ in range(2)]
        out = sampler(drafts, target, q, False, torch.rand(1, generator=gen, dtype=torch.float64),
                      gens)
        first = out.tokens[0]
        second = out.tokens[1] if len(out.tokens) > 1 else torch.multinomial(
            P2.roll(first), 1, generator=gen).item()
        counts[first, second] += 1
    return counts


def expected_joint() -> torch.Tensor:
    return torch.stack([P1[a] * P2.roll(a) for a in range(V)])


@pytest.mark.parametrize("draft_mode", ["one-hot", "sampled"])
def test_output_keeps_the_target_distribution(draft_mode):
    counts = first_two_tokens(verify_drafts, draft_mode)
    expected = expected_joint() * counts.sum()
    assert chisquare(counts.flatten(), expected.flatten()).pvalue > 1e-3


@pytest.mark.parametrize("draft_mode", ["one-hot", "sampled"])
def test_the_statistical_test_catches_a_wrong_replacement_rule(draft_mode):
    counts = first_two_tokens(wrong_replacement, draft_mode)
    expected = expected_joint() * counts.sum()
    assert chisquare(counts.flatten(), expected.flatten()).pvalue < 1e-6


def test_bonus_token_when_all_drafts_are_accepted():
    target = torch.stack([dist(0, 1, 0, 0, 0), dist(0, 0, 0, 1, 0), dist(0.5, 0, 0, 0, 0.5)])
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    out = verify_drafts([1, 3], target, None, False, torch.tensor([0.99, 0.99]), gens)
    assert out.accepted == 2 and out.tokens[:2] == [1, 3] and out.tokens[2] in (0, 4)


def test_a_draft_the_target_cannot_emit_is_always_replaced():
    target = torch.stack([dist(0.5, 0.5, 0, 0, 0), dist(1, 0, 0, 0, 0)])
    for s in range(50):
        out = verify_drafts([3], target, None, False, torch.tensor([0.0]),
                            [torch.Generator().manual_seed(s)] * 2)
        assert out.accepted == 0 and out.tokens[0] in (0, 1)

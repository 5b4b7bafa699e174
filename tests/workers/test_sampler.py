"""The target distribution (temperature, top-k, top-p, min-p) and seeded draws, on hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch

from metrale.drafting.rejection import verify_drafts
from metrale.workers.sampler import SamplingSpec, generator_for, target_probs

LOGITS = torch.log(torch.tensor([[0.4, 0.25, 0.15, 0.1, 0.06, 0.04]]))


def spec(**kw) -> SamplingSpec:
    base = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=7, draw=0)
    return SamplingSpec(**{**base, **kw})


def sample(logits, specs) -> torch.Tensor:
    """One token per row, as the worker draws a token when there are no drafts."""
    probs = target_probs(logits, specs)
    return torch.tensor([verify_drafts([], probs[i:i + 1], None, s.greedy, None,
                                       [generator_for(s, logits.device)]).tokens[0]
                         for i, s in enumerate(specs)])


def support(**kw) -> list[int]:
    return torch.nonzero(target_probs(LOGITS, [spec(**kw)])[0]).flatten().tolist()


def test_no_restriction_keeps_the_distribution():
    torch.testing.assert_close(target_probs(LOGITS, [spec()])[0], LOGITS.exp()[0])


@pytest.mark.parametrize("k, expected", [(1, [0]), (2, [0, 1]), (4, [0, 1, 2, 3]), (0, list(range(6)))])
def test_top_k(k, expected):
    assert support(top_k=k) == expected


@pytest.mark.parametrize("p, expected", [(0.39, [0]), (0.41, [0, 1]), (0.64, [0, 1]),
                                         (0.66, [0, 1, 2]), (1.0, list(range(6)))])
def test_top_p_keeps_smallest_prefix_reaching_p(p, expected):
    assert support(top_p=p) == expected


@pytest.mark.parametrize("m, expected", [(0.5, [0, 1]), (0.3, [0, 1, 2]), (0.2, [0, 1, 2, 3])])
def test_min_p_is_relative_to_the_top_token(m, expected):
    assert support(min_p=m) == expected


def test_restricted_distribution_is_renormalised():
    p = target_probs(LOGITS, [spec(top_k=2)])[0]
    assert math.isclose(p[0].item(), 0.4 / 0.65, rel_tol=1e-5)
    assert math.isclose(p.sum().item(), 1.0, rel_tol=1e-6)


def test_temperature_sharpens_and_zero_is_greedy():
    cold = target_probs(LOGITS, [spec(temperature=0.5)])[0]
    assert cold[0] > 0.4 and math.isclose(cold.sum().item(), 1.0, rel_tol=1e-6)
    assert target_probs(LOGITS, [spec(temperature=0.0)])[0].tolist() == [1, 0, 0, 0, 0, 0]


def test_draws_stay_in_support_and_follow_the_distribution():
    logits = LOGITS.expand(4000, -1).contiguous()
    draws = sample(logits, [spec(top_k=3, draw=i) for i in range(4000)])
    assert set(draws.tolist()) <= {0, 1, 2}
    freq = torch.bincount(draws, minlength=6)[:3].float() / 4000
    expected = torch.tensor([0.4, 0.25, 0.15]) / 0.8
    assert (freq - expected).abs().max() < 0.03


def test_seeded_draws_reproduce_and_differ_across_seeds():
    logits = LOGITS.expand(64, -1).contiguous()
    a = sample(logits, [spec(seed=1, draw=i) for i in range(64)])
    b = sample(logits, [spec(seed=1, draw=i) for i in range(64)])
    c = sample(logits, [spec(seed=2, draw=i) for i in range(64)])
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("t", [5e-324, 1e-300, 1e-6])
def test_a_vanishing_temperature_samples_greedily_instead_of_overflowing(t):
    # logits / 5e-324 would be inf, and softmax of it nan (a crash in multinomial)
    probs = target_probs(LOGITS * 40, [spec(temperature=t)])
    assert probs[0].tolist() == [1.0, 0, 0, 0, 0, 0]
    assert sample(LOGITS, [spec(temperature=t)]).tolist() == [0]

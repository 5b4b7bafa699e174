"""Sampled output keeps the target's distribution with speculation (chi-square against the exact
distribution that transformers' logits give), and the test fails a wrong replacement rule."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

import checkpoints
from metrale.cluster.params import SamplingParams
from metrale.deploy.llm import LLM
from metrale.drafting import rejection
from metrale.workers import worker as worker_module
from metrale.workers.sampler import SamplingSpec, target_probs

PROMPT = "def schedule(self, tokens):"
SAMPLES = 3000
SETTINGS = [dict(temperature=0.7, top_p=0.6), dict(temperature=1.0, top_k=3)]


def exact_joint(model_dir, prompt, settings, length=3):
    """P(first `length` tokens) from the reference logits and the same restriction rules."""
    spec = SamplingSpec(settings["temperature"], settings.get("top_p", 1.0),
                        settings.get("top_k", 0), 0.0, 0, 0)
    joint = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for path, p in joint.items():
            logits = checkpoints.reference_logits(model_dir, prompt + list(path))[-1:]
            probs = target_probs(logits, [spec])[0]
            for tok in torch.nonzero(probs).flatten().tolist():
                nxt[path + (tok,)] = p * probs[tok].item()
        joint = nxt
    return joint


def sampled_paths(model_dir, prompt, settings, **spec):
    llm = LLM(model_dir, device="cpu", block_size=4, max_num_seqs=128,
              max_num_batched_tokens=1024, **spec)
    params = SamplingParams(max_tokens=3, ignore_eos=True, seed=1234, n=SAMPLES, **settings)
    out = llm.generate([prompt], params)[0]
    return [tuple(c.token_ids) for c in out.completions], llm.scheduler.stats


def chi_square_pvalue(paths, joint) -> float:
    cells = sorted(joint, key=joint.get, reverse=True)
    observed = [sum(1 for p in paths if p == c) for c in cells]
    assert sum(observed) == len(paths), "a sample left the restricted support"
    total = sum(joint.values())                    # 1 up to float32 rounding
    expected = [joint[c] / total * len(paths) for c in cells]
    # pool the rare cells so every expected count is at least 5
    while len(expected) > 2 and expected[-1] < 5:
        e, o = expected.pop(), observed.pop()
        expected[-1] += e
        observed[-1] += o
    return chisquare(observed, expected).pvalue


# Self-speculation with all but one layer drafts well enough for many acceptances and rejections
# of tokens inside the support.
SPEC = dict(speculative_method="self", num_drafts=2, self_spec_layers=3, adaptive_drafts=False)


@pytest.mark.slow
@pytest.mark.parametrize("settings", SETTINGS, ids=["T0.7-top_p", "T1.0-top_k"])
def test_speculative_sampling_keeps_the_distribution(checkpoint, settings):
    model_dir = checkpoint("qwen3_5")
    prompt = LLM(model_dir, device="cpu").encode(PROMPT)
    joint = exact_joint(model_dir, prompt, settings)
    plain, _ = sampled_paths(model_dir, prompt, settings)
    spec, stats = sampled_paths(model_dir, prompt, settings, **SPEC)
    assert 0.1 < stats.drafts_accepted / stats.drafts_proposed < 0.95
    assert chi_square_pvalue(plain, joint) > 1e-3
    assert chi_square_pvalue(spec, joint) > 1e-3


def wrong_replacement(drafts, target, draft_probs, greedy, uniforms, generators):
    """The test's own broken copy of the sampler: a rejected draft is replaced by a draw from p
    (the draft token included) instead of norm(max(0, p - q))."""
    for i, d in enumerate(drafts):
        if uniforms[i] < target[i, d]:
            continue
        token = torch.multinomial(target[i], 1, generator=generators[i]).item()
        return rejection.Verdict(i, drafts[:i] + [token])
    return rejection.verify_drafts(drafts, target, draft_probs, greedy, uniforms, generators)


@pytest.mark.slow
def test_the_distribution_test_fails_a_wrong_replacement_rule(checkpoint, monkeypatch):
    settings = SETTINGS[1]
    model_dir = checkpoint("qwen3_5")
    prompt = LLM(model_dir, device="cpu").encode(PROMPT)
    joint = exact_joint(model_dir, prompt, settings)
    monkeypatch.setattr(worker_module, "verify_drafts", wrong_replacement)
    spec, _ = sampled_paths(model_dir, prompt, settings, **SPEC)
    assert chi_square_pvalue(spec, joint) < 1e-4

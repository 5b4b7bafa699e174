"""Lossless verification of drafts: the rejection sampler, a pure function of distributions."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Verdict:
    accepted: int         # drafts accepted, j
    tokens: list[int]     # d_1..d_j and then the replacement or bonus token


def verify_drafts(drafts: list[int], target: torch.Tensor, draft_probs: torch.Tensor | None,
                  greedy: bool, uniforms: torch.Tensor | None,
                  generators: list[torch.Generator] | None) -> Verdict:
    """Accepts a prefix of `drafts` so that the emitted tokens follow the target distribution.

    target: [k+1, V], row i is the target distribution p_{i+1} after the committed tokens and
    d_1..d_i (already restricted by temperature, top-k, top-p, min-p and any grammar mask).
    draft_probs: [k, V], the drafter's q_i, or None for a deterministic drafter (q one-hot at d_i).
    uniforms: [k] in [0, 1), one per draft; generators: k+1 streams for the final draw at each index.
    """
    if greedy:
        return greedy_verdict(drafts, target.argmax(-1).tolist())
    for i, d in enumerate(drafts):
        p_d = target[i, d]
        q_d = draft_probs[i, d] if draft_probs is not None else torch.ones_like(p_d)
        # Leviathan / Chen: accept d_i with probability min(1, p(d_i) / q(d_i)).
        if uniforms[i] * q_d < p_d:
            continue
        # First rejection: draw the replacement from norm(max(0, p - q)).
        q = draft_probs[i] if draft_probs is not None else _one_hot(d, target.shape[-1], target)
        residual = (target[i] - q).clamp_min(0)
        if residual.sum() <= 0:   # p == q exactly: the rejection had probability 0
            residual = target[i]
        token = torch.multinomial(residual / residual.sum(), 1, generator=generators[i]).item()
        return Verdict(i, drafts[:i] + [token])
    # All k accepted: the bonus token comes from p_{k+1}.
    k = len(drafts)
    bonus = torch.multinomial(target[k], 1, generator=generators[k]).item()
    return Verdict(k, drafts + [bonus])


def greedy_verdict(drafts: list[int], best: list[int]) -> Verdict:
    """Greedy: the longest prefix of drafts where d_i is the target's argmax best[i-1], then the
    argmax after it (best has k + 1 entries)."""
    j = next((i for i, d in enumerate(drafts) if d != best[i]), len(drafts))
    return Verdict(j, drafts[:j] + [best[j]])


def _one_hot(token: int, size: int, like: torch.Tensor) -> torch.Tensor:
    q = torch.zeros(size, dtype=like.dtype, device=like.device)
    q[token] = 1.0
    return q

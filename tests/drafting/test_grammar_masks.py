"""Grammar masks: drafts and emitted tokens stay inside the mask, with and without speculation."""

from __future__ import annotations

import pytest
import torch

from conftest import PROMPTS
from metrale.cluster.params import SamplingParams
from metrale.deploy.llm import LLM


class ParityGrammar:
    """A hand-made grammar: after a token t, the next token must have the parity of t + 1, and
    tokens 10..40 are never allowed. It records the prefixes it was asked about."""

    def __init__(self, vocab: int):
        self.vocab, self.asked = vocab, []

    def allowed(self, generated):
        self.asked.append(len(generated))
        ids = torch.arange(self.vocab)
        mask = (ids < 10) | (ids > 40)
        if generated:
            mask &= ids % 2 == (generated[-1] + 1) % 2
        return mask

    def follows(self, tokens) -> bool:
        return all(not 10 <= t <= 40 for t in tokens) and all(
            b % 2 == (a + 1) % 2 for a, b in zip(tokens, tokens[1:]))


@pytest.mark.parametrize("method", ["mtp", "ngram", "self"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_output_with_and_without_speculation(checkpoint, method, temperature):
    model_dir = checkpoint("qwen3_5")
    vocab = LLM(model_dir, device="cpu").worker.capacity.vocab_size
    outputs = {}
    for spec in ("none", method):
        grammar = ParityGrammar(vocab)
        llm = LLM(model_dir, device="cpu", speculative_method=spec,
                  num_drafts=3 if spec != "none" else None, adaptive_drafts=False)
        params = SamplingParams(max_tokens=24, temperature=temperature, seed=5, ignore_eos=True,
                                constraint=grammar)
        out = llm.generate(PROMPTS[:2], params)
        for o in out:
            assert grammar.follows(o.token_ids), o.token_ids
        outputs[spec] = [o.token_ids for o in out]
        if spec != "none":
            assert llm.scheduler.stats.drafts_proposed > 0
            # rejected drafts roll back: the grammar is asked again about shorter prefixes
            assert any(b < a for a, b in zip(grammar.asked, grammar.asked[1:]))
    if temperature == 0.0:
        assert outputs[method] == outputs["none"]


def test_ngram_drafts_are_cut_at_the_first_disallowed_token():
    from metrale.drafting.ngram import NgramProposer
    from metrale.drafting.proposer import ProposeRequest
    history = [1, 2, 3, 4, 5, 1, 2]
    allowed = lambda drafts: torch.tensor([t != 5 for t in range(8)])  # noqa: E731
    plain = NgramProposer(1, 2).propose([ProposeRequest(0, 7, 2, 4, [], history)])[0]
    cut = NgramProposer(1, 2).propose([ProposeRequest(0, 7, 2, 4, [], history, allowed)])[0]
    assert plain.tokens == [3, 4, 5, 1] and cut.tokens == [3, 4]

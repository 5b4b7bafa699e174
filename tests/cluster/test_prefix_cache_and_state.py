"""Prefix caching shares blocks without changing outputs; chunked prefill leaves the same SSM state."""

from __future__ import annotations

import pytest
import torch

import checkpoints
from metrale.cluster.block_manager import BlockManager
from metrale.cluster.params import SamplingParams
from metrale.deploy.llm import LLM

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def test_prefix_reuses_blocks_and_keeps_output(checkpoint):
    model_dir = checkpoint("qwen3")
    llm = LLM(model_dir, device="cpu", block_size=4)
    shared = llm.encode("The café engine serves pages and blocks before the logits are ready.")
    first, second = shared + llm.encode(" alpha"), shared + llm.encode(" def f(x):")
    a = llm.add_request(first, GREEDY)
    llm.step()
    table_a = list(llm.scheduler.by_request[a][0].block_table)
    b = llm.add_request(second, GREEDY)
    llm.step()
    seq_b = llm.scheduler.by_request[b][0]
    full = len(shared) // 4
    assert seq_b.block_table[:full] == table_a[:full], "shared prefix blocks not reused"
    assert len(set(seq_b.block_table[full:]) & set(table_a)) == 0
    while llm.scheduler.has_work:
        llm.step()
    out_b = llm.finished_output(b)
    llm.finished_output(a)
    # after both finished, a third request takes the cached blocks back from the free list
    c = llm.add_request(second, GREEDY)
    llm.step()
    assert llm.scheduler.by_request[c][0].block_table[:full] == table_a[:full]

    uncached = LLM(model_dir, device="cpu", block_size=4, prefix_caching=False)
    ref = uncached.generate([second], GREEDY)[0]
    assert out_b.token_ids == ref.token_ids
    assert ref.token_ids == checkpoints.reference_greedy(model_dir, second, 24)


@pytest.mark.parametrize("spec", [{}, dict(speculative_method="ngram", num_drafts=3),
                                  dict(speculative_method="ngram", num_drafts=3, chain_rounds=3)],
                         ids=["plain", "ngram", "chained"])
def test_blocks_filled_while_decoding_are_published_as_they_fill(checkpoint, spec):
    """Each step offers the blocks that became full once it appended its tokens (a step's
    accepted drafts, and a chain's rounds, are computed before the update appends them: a
    block offered short would break the hash chain after it); a follow-up turn whose prompt is
    the first turn's prompt and output finds every full block of both cached."""
    llm = LLM(checkpoint("qwen3"), device="cpu", block_size=4, **spec)
    prompt = llm.encode("def schedule(self, tokens):")
    rid = llm.add_request(prompt, GREEDY)
    seq = llm.scheduler.by_request[rid][0]
    table = []
    while llm.scheduler.has_work:
        llm.step()
        if seq.block_table:
            table = list(seq.block_table)
            assert seq.published == seq.num_computed // 4
    out = llm.finished_output(rid)
    follow_up = prompt + out.token_ids + llm.encode(" more")
    cached = llm.scheduler.blocks.cached_prefix(follow_up)
    full = (len(prompt) + len(out.token_ids) - 1) // 4   # the last token never ran as an input
    assert len(cached) == full and cached == table[:full]


def test_hybrid_models_do_not_share_kv_blocks(checkpoint):
    llm = LLM(checkpoint("qwen3_5"), device="cpu", block_size=4)
    assert not llm.scheduler.blocks.prefix_caching


def test_block_manager_reference_counts():
    bm = BlockManager(num_blocks=8, block_size=2, prefix_caching=True)
    tokens = [1, 2, 3, 4, 5]
    t1: list[int] = []
    assert bm.allocate(t1, tokens, 5) == 0 and len(t1) == 3 and bm.num_free == 5
    assert bm.register(t1, 0, tokens[:2]) == bm.hash_of[t1[0]]    # one block, then the next:
    bm.register(t1, 1, tokens[2:4], bm.hash_of[t1[0]])             # the same as both at once
    t2: list[int] = []
    assert bm.can_allocate(tokens, 5)
    assert bm.allocate(t2, tokens, 5) == 4          # two full blocks shared
    assert t2[:2] == t1[:2] and t2[2] != t1[2]
    assert [bm.ref_count[b] for b in t1] == [2, 2, 1]
    bm.free_table(t1)
    assert [bm.ref_count[b] for b in t2] == [1, 1, 1] and bm.num_free == 5
    bm.free_table(t2)
    assert bm.num_free == 8
    assert not bm.can_append([], 17)


def test_ssm_state_after_chunked_prefill_equals_unchunked(checkpoint):
    model_dir = checkpoint("qwen3_5")
    states = []
    for budget in (512, 5):
        llm = LLM(model_dir, device="cpu", block_size=4, max_num_batched_tokens=budget)
        prompt = llm.encode("def schedule(self, tokens): return [t for t in tokens if t]")
        rid = llm.add_request(prompt, SamplingParams(max_tokens=4, temperature=0))
        seq = llm.scheduler.by_request[rid][0]
        while not seq.output_ids:
            llm.step()
        assert seq.num_computed == len(prompt)
        states.append((llm.worker.ssm.conv[:, seq.slot].clone(),
                       llm.worker.ssm.state[:, seq.slot].clone()))
    torch.testing.assert_close(states[0][0], states[1][0], atol=2e-5, rtol=1e-4)  # matmuls of other shapes round differently
    torch.testing.assert_close(states[0][1], states[1][1], atol=2e-5, rtol=1e-4)  # matmuls of other shapes round differently

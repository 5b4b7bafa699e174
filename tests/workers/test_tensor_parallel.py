"""Tensor parallelism on CPU (gloo): a worker split over two Ray actors gives the single-rank
worker's greedy output, with and without speculation, on both architectures."""

from __future__ import annotations

import pytest
import torch

from conftest import PROMPTS
from metrale.cluster.params import SamplingParams
from metrale.deploy.llm import LLM
from metrale.workers.models.parallel import Shard
from metrale.workers.parallel import ParallelError, TensorParallel

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
ENGINE = dict(device="cpu", block_size=4, max_num_seqs=4)


def test_a_shard_that_does_not_divide_is_padded():
    full = torch.arange(10.0).view(5, 2)          # 5 vocabulary rows over 2 ranks: 3 + 2 (+ pad)
    read = full.__getitem__
    first = Shard(0, (5,)).take(read, TensorParallel(0, 2))
    last = Shard(0, (5,)).take(read, TensorParallel(1, 2))
    assert torch.equal(first, full[:3])
    assert torch.equal(last, torch.cat((full[3:], torch.zeros(1, 2))))


def test_fused_sections_split_separately():
    full = torch.arange(8.0)                      # q | k | v of sizes 2, 2, 4
    parts = [Shard(0, (2, 2, 4)).take(full.__getitem__, TensorParallel(r, 2)) for r in (0, 1)]
    assert parts[0].tolist() == [0, 2, 4, 5] and parts[1].tolist() == [1, 3, 6, 7]


def test_head_counts_that_do_not_divide_are_refused(checkpoint):
    with pytest.raises(ParallelError, match="num_key_value_heads=1"):
        LLM(checkpoint("qwen3_5-pattern"), tensor_parallel_size=2, **ENGINE)


CASES = [("qwen3", "none"), ("qwen3", "ngram"), ("qwen3", "dflash"), ("qwen3_5", "none"),
         ("qwen3_5", "mtp"), ("qwen3_5", "dflash"), ("qwen3_5", "ngram"), ("qwen3_5", "self")]


@pytest.mark.slow
@pytest.mark.parametrize("name,method", CASES)
def test_two_ranks_match_one(ray_cluster, checkpoint, dflash_drafter, name, method):
    model = checkpoint(name)
    spec = dict(speculative_method=method, num_drafts=3 if method != "none" else None,
                drafter=dflash_drafter(name) if method == "dflash" else None)
    single = LLM(model, **ENGINE)
    prompts = [single.encode(p) for p in PROMPTS]
    plain = [o.token_ids for o in single.generate(prompts, GREEDY)]
    params = [GREEDY] * len(prompts) + [SAMPLED] * (method == "mtp")
    expected = [o.token_ids for o in LLM(model, **ENGINE, **spec).generate(
        prompts + prompts[:1] * (method == "mtp"), params)]
    assert expected[:len(prompts)] == plain
    with LLM(model, tensor_parallel_size=2, **ENGINE, **spec) as split:
        # each rank holds half the KV heads, so the same KV budget holds twice the blocks
        assert split.worker.capacity.num_blocks == 2 * single.worker.capacity.num_blocks
        outs = split.generate(prompts + prompts[:1] * (method == "mtp"), params)
    assert [o.token_ids for o in outs] == expected
    if method != "none":
        assert sum(o.spec.drafts_proposed for o in outs) > 0

"""Verify pools: after accepting j of k drafts, a slot holds the state of decoding j+1 tokens serially."""

from __future__ import annotations

import pytest
import torch

from conftest import PROMPTS
from metrale.cluster.params import SamplingParams
from metrale.deploy.llm import LLM
from metrale.workers.batch import ForwardBatch


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5-pattern"])
def test_state_after_j_accepted_equals_serial_decode(checkpoint, name):
    k = 5
    llm = LLM(checkpoint(name), device="cpu", block_size=4, max_num_seqs=2,
              speculative_method="ngram", num_drafts=k, adaptive_drafts=False)
    rid = llm.add_request(llm.encode(PROMPTS[0]), SamplingParams(max_tokens=8, temperature=0))
    seq = llm.scheduler.by_request[rid][0]
    while not seq.output_ids:
        llm.step()
    worker, slot, spare = llm.worker, seq.slot, 1 - seq.slot
    ssm, bs = worker.ssm, llm.worker.config.block_size
    llm.scheduler.blocks.append(seq.block_table, seq.num_computed + k + 1)
    table, ctx = list(seq.block_table), seq.num_computed
    start = (ssm.conv[:, slot].clone(), ssm.state[:, slot].clone())
    tokens = [seq.output_ids[-1]] + torch.randint(2, 300, (k,)).tolist()
    verify = ForwardBatch.build([(tokens, ctx, table, slot, True)], bs, worker.device)
    worker.model(verify, worker.kv, ssm)
    assert torch.equal(ssm.conv[:, slot], start[0]) and torch.equal(ssm.state[:, slot], start[1])
    for j in range(k + 1):
        ssm.conv[:, spare], ssm.state[:, spare] = start
        for i in range(j + 1):    # one token at a time from the same starting state
            step = ForwardBatch.build([([tokens[i]], ctx + i, table, spare)], bs, worker.device)
            worker.model(step, worker.kv, ssm)
        entry = ssm.offset[slot] + j
        torch.testing.assert_close(ssm.verify_conv[:, entry], ssm.conv[:, spare], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(ssm.verify_state[:, entry], ssm.state[:, spare], atol=2e-5, rtol=1e-4)
    ssm.commit([slot], [3])
    assert torch.equal(ssm.state[:, slot], ssm.verify_state[:, ssm.offset[slot] + 3])


def test_a_verify_deeper_than_the_slot_is_refused(checkpoint):
    llm = LLM(checkpoint("qwen3_5"), device="cpu", block_size=4, max_num_seqs=1,
              speculative_method="ngram", num_drafts=2)
    batch = ForwardBatch.build([([5, 6, 7, 8], 0, [0], 0, True)], 4, llm.worker.device)
    with pytest.raises(ValueError, match="overflows slot 0"):
        llm.worker.model(batch, llm.worker.kv, llm.worker.ssm)

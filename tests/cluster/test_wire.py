"""The msgpack records: every record that crosses a process survives the trip; a grammar cannot."""

from __future__ import annotations

import pytest
import torch

from metrale.cluster.params import SamplingParams
from metrale.cluster.plan import (SeqOutcome, SeqWork, StepPlan, StepResult, TokenLogprobs,
                                  WorkerCapacity)
from metrale.cluster.sequence import TokenLogprob
from metrale.cluster.stream import Delta
from metrale.cluster.wire import WireError, pack, unpack
from metrale.drafting.stats import SpecStats
from metrale.workers.sampler import SamplingSpec


class EvenTokens:
    def allowed(self, generated):
        return torch.arange(8) % 2 == 0


def plan(constraint=None) -> StepPlan:
    return StepPlan([
        SeqWork(0, [5, 6, 7], 0, [3, 4], 1, None, prompt_len=9, next_token=8),
        SeqWork(1, [9], 12, [0], 0, SamplingSpec(0.7, 0.9, 5, 0.05, 2**61 + 3, 4, logprobs=2),
                prompt_len=4, num_drafts=3, pad_to=5, constraint=constraint)])


def test_records_round_trip():
    assert unpack(StepPlan, pack(plan())) == plan()
    result = StepResult([SeqOutcome(1, [4, 2, 7], proposed=3, accepted=2, logprobs=[
        TokenLogprobs(-0.25, [(4, -0.25), (3, -1.5)])] * 3), SeqOutcome(2, [1]),
        SeqOutcome(3, [5, 6, 8, 9], proposed=6, accepted=2, rounds=[0, 2])])   # a chain's
    assert unpack(StepResult, pack(result)) == result
    capacity = WorkerCapacity(100, 16, 4, 512, 384, (0, 2), True, "dflash", (3, 3, 1, 0),
                              fixed_drafts=3, chain_rounds=4)
    assert unpack(WorkerCapacity, pack(capacity)) == capacity
    params = SamplingParams(max_tokens=9, temperature=0.5, stop=("\n\n", "end"), seed=7, n=2,
                            logprobs=3, stop_token_ids=(1,))
    assert unpack(SamplingParams, pack(params)) == params
    deltas = [Delta("r", 1, "é", [5], [TokenLogprob(5, -0.1, [(5, -0.1)])], "stop",
                    SpecStats(2, 6, 3, [2, 2, 2], [2, 1, 0])), Delta("s", 0, "x", [1])]
    assert unpack(list[Delta], pack(deltas)) == deltas


def test_a_grammar_constraint_is_refused_by_name():
    with pytest.raises(WireError, match="SeqWork.constraint"):
        pack(plan(EvenTokens()))
    with pytest.raises(WireError, match="SamplingParams.constraint"):
        pack(SamplingParams(constraint=EvenTokens()))

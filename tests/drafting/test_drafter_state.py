"""MTP catch-up and the DFlash context: after rounds of partial acceptance, the drafter proposes
what it proposes after a fresh prefill of the same committed tokens."""

from __future__ import annotations

import pytest
import torch

import checkpoints
from conftest import PROMPTS
from metrale.cluster.params import SamplingParams
from metrale.deploy.llm import LLM
from metrale.drafting.proposer import ProposeRequest

GREEDY = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)


def proposal_for(llm: LLM, seq, k: int):
    # the blocks for the pending row and the drafts' rows, as the scheduler takes them for a round
    llm.scheduler.blocks.append(seq.block_table, seq.num_computed + 1 + k)
    req = ProposeRequest(seq.slot, seq.num_computed, seq.tokens[-1], k, seq.block_table,
                         seq.tokens)
    return llm.worker.proposer.propose([req])[0]


def proposal_after_prefill(model_dir, kw: dict, seq, k: int = 3):
    """The proposal of a new engine that prefilled `seq`'s tokens, its pending one left out."""
    fresh = LLM(model_dir, **kw)
    rid = fresh.add_request(seq.tokens[:-1], GREEDY)
    seq2 = fresh.scheduler.by_request[rid][0]
    while not seq2.output_ids:
        fresh.step()
    assert seq2.tokens == seq.tokens
    return proposal_for(fresh, seq2, k)


@pytest.mark.parametrize("method", ["mtp", "dflash"])
@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5-vl"])
def test_drafter_state_after_partial_acceptance_equals_fresh_prefill(
        checkpoint, dflash_drafter, method, name):
    model_dir = checkpoint(name)
    kw = dict(device="cpu", block_size=4, speculative_method=method, num_drafts=3,
              adaptive_drafts=False,
              drafter=dflash_drafter(name) if method == "dflash" else None)
    llm = LLM(model_dir, max_num_batched_tokens=6, **kw)     # chunked prefill too
    prompt = llm.encode(PROMPTS[3])
    truth = prompt + checkpoints.reference_greedy(model_dir, prompt, 30)
    real_propose = llm.worker.proposer.propose

    def one_right_then_wrong(requests):
        # The drafter runs for real (and writes its speculative state); its drafts are replaced
        # by the true continuation with the second draft wrong, so each round accepts one draft.
        proposals = real_propose(requests)
        for r, p in zip(requests, proposals):
            t = truth[len(r.history):len(r.history) + r.num_drafts]
            p.tokens = t[:1] + [(t[1] + 1) % 300] + t[2:] if len(t) > 1 else t
        return proposals

    llm.worker.proposer.propose = one_right_then_wrong
    llm.worker.proposer.propose_on_device = lambda requests: None   # so that propose drafts
    rid = llm.add_request(prompt, GREEDY)
    seq = llm.scheduler.by_request[rid][0]
    while seq.spec.rounds < 4:
        llm.step()
    assert seq.spec.drafts_accepted == seq.spec.rounds      # partial: 1 of 3 each round
    llm.worker.proposer.propose = real_propose
    after_rounds = proposal_for(llm, seq, 3)
    after_prefill = proposal_after_prefill(model_dir, kw, seq)
    assert after_rounds.tokens == after_prefill.tokens
    assert after_rounds.confidence == pytest.approx(after_prefill.confidence, abs=1e-4)


def test_dflash_window_keeps_its_last_rows_when_full(checkpoint, dflash_drafter):
    """A window of 8 rows, filled round by round past its size (each row into the ring in
    place of the oldest), holds what a prefill of the same tokens leaves (its last 8 rows):
    the same proposal."""
    model_dir = checkpoint("qwen3_5")
    kw = dict(device="cpu", block_size=4, speculative_method="dflash",
              drafter=dflash_drafter("qwen3_5"), dflash_window=8)
    llm = LLM(model_dir, **kw)
    prompt = llm.encode(PROMPTS[3])
    rid = llm.add_request(prompt, GREEDY)
    seq = llm.scheduler.by_request[rid][0]
    while len(seq.output_ids) < 12:
        llm.step()
    a = proposal_for(llm, seq, 3)   # the drafter catches up on the rows it holds
    assert llm.worker.proposer.window_rows(seq.slot) == 8
    # A fresh prefill of the same tokens keeps the same last 8 rows: the same proposal.
    b = proposal_after_prefill(model_dir, kw, seq)
    assert a.tokens == b.tokens and a.confidence == pytest.approx(b.confidence, abs=1e-4)


@pytest.mark.parametrize("method", ["mtp", "dflash"])
@pytest.mark.parametrize("limit", [64, 3])
def test_drafter_catches_up_on_rows_held_through_rounds_without_drafts(
        checkpoint, dflash_drafter, method, limit):
    """Rounds of k = 0 leave their rows held by the drafter (up to `limit` per slot); the next
    proposal catches up on all of them at once and equals the one after a fresh prefill."""
    model_dir = checkpoint("qwen3_5")
    kw = dict(device="cpu", block_size=4, speculative_method=method, num_drafts=3,
              drafter=dflash_drafter("qwen3_5") if method == "dflash" else None)
    llm = LLM(model_dir, **kw)
    held = llm.worker.proposer.held
    held.limit = limit
    rounds = iter([0] * 5 + [3] + [0] * 2 + [3] + [0] * 40)
    llm.scheduler.drafts.choose = lambda batch: next(rounds)
    rid = llm.add_request(llm.encode(PROMPTS[2]), GREEDY)
    seq = llm.scheduler.by_request[rid][0]
    while len(seq.output_ids) < 16:
        llm.step()
    assert seq.spec.rounds == 2
    assert 0 < held.count[seq.slot] <= limit
    after_rounds = proposal_for(llm, seq, 3)
    assert seq.slot not in held.held
    after_prefill = proposal_after_prefill(model_dir, kw, seq)
    assert after_rounds.tokens == after_prefill.tokens
    assert after_rounds.confidence == pytest.approx(after_prefill.confidence, abs=1e-4)


@pytest.mark.parametrize("method", ["mtp", "dflash"])
def test_a_round_of_drafts_after_many_without_catches_up_as_a_round_does(
        checkpoint, dflash_drafter, method, monkeypatch):
    """Through 40 rounds of k = 0 the drafter catches up every HOLD_ROWS + 1 rows, so the round
    of drafts after them (the draft policy's probe, which it charges with the round's propose
    time) catches up on no more rows than fit MTP's longest captured catch-up."""
    from metrale.drafting import mtp, proposer as prop
    model_dir = checkpoint("qwen3_5")
    llm = LLM(model_dir, device="cpu", block_size=4, speculative_method=method, num_drafts=3,
              drafter=dflash_drafter("qwen3_5") if method == "dflash" else None)
    drafter = llm.worker.proposer
    caught = []   # rows per sequence of each catch-up; None where the round of drafts is planned
    catch_up = drafter._catch_up
    monkeypatch.setattr(drafter, "_catch_up", lambda rows: caught.extend(
        len(r.tokens) for r in rows) or catch_up(rows))
    rounds = iter([0] * 40 + [3] * 20)

    def choose(batch, seqs=None):
        k = next(rounds)
        if k and None not in caught:
            caught.append(None)
        return k
    llm.scheduler.drafts.choose = choose
    rid = llm.add_request(llm.encode(PROMPTS[2]),
                          SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
    seq = llm.scheduler.by_request[rid][0]
    while seq.spec.rounds < 1 and not seq.finished:
        llm.step()
    assert seq.spec.rounds == 1
    planned = caught.index(None)
    during, probe = caught[1:planned], caught[planned + 1:]   # [1:]: after the prefill's
    assert prop.HOLD_ROWS + 1 <= mtp.CATCH_UP_LENGTHS[-1]
    assert len(during) >= 2 and all(n == prop.HOLD_ROWS + 1 for n in during)
    assert probe and all(n <= prop.HOLD_ROWS + 1 for n in probe)


class _Replayed:
    """A CUDA graph's stand-in off the GPU: each replay reruns the captured step and copies its
    results (if any) into the tensors the capture returned."""

    def __init__(self, step, out):
        self.step, self.out = step, out

    def replay(self):
        fresh = self.step()
        for static, new in zip(self.out or (), fresh or ()):
            static.copy_(new)

    def pool(self):
        return None


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_dflash_catch_up_graphs_write_what_the_eager_catch_up_writes(
        checkpoint, dflash_drafter, monkeypatch, device):
    """With DFlash's captured catch-up (a graph per row bucket, its padding rows written into
    the spare slot) and proposals, the context windows, the drafts and the outputs equal those
    of the eager path, for sequences of different lengths and acceptance."""
    from metrale.drafting import dflash
    if device == "cpu":
        monkeypatch.setattr(dflash, "capture", lambda step, pool: (_Replayed(step, out := step()), out))
    model_dir = checkpoint("qwen3_5")
    kw = dict(device=device, dtype="float32", block_size=4, speculative_method="dflash",
              drafter=dflash_drafter("qwen3_5"), num_drafts=3, adaptive_drafts=False,
              cuda_graphs=False)
    eager, graphed = LLM(model_dir, **kw), LLM(model_dir, **kw)
    assert eager.worker.proposer.graphs is None
    p = graphed.worker.proposer
    p.graphs = dflash.DFlashGraphs(p, 4)
    p.graphs.capture_all(3)
    wrote, write = [], p.graphs.write
    p.graphs.write = lambda *args: wrote.append(write(*args)) or wrote[-1]
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    outs = [llm.generate(PROMPTS[:3], params) for llm in (eager, graphed)]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    assert [o.spec.drafts_accepted for o in outs[0]] == [o.spec.drafts_accepted for o in outs[1]]
    assert wrote and all(wrote)   # every catch-up replayed a graph
    a, b = eager.worker.proposer, p
    assert a.seen == b.seen and any(a.seen)
    for slot in range(len(a.seen)):
        n = a.window_rows(slot)
        assert torch.allclose(a.ctx_k[:, slot, :n], b.ctx_k[:, slot, :n], atol=1e-5)
        assert torch.allclose(a.ctx_v[:, slot, :n], b.ctx_v[:, slot, :n], atol=1e-5)

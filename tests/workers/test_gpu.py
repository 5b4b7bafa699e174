"""The engine on CUDA with plain PyTorch: same greedy tokens as the float32 reference."""

from __future__ import annotations

import itertools

import pytest
import torch

import checkpoints
from conftest import assert_stops_where_first_met
from metrale.cluster.params import SamplingParams
from metrale.cluster.plan import AHEAD
from metrale.deploy.llm import LLM
from metrale.workers.worker import CHAIN_ROUNDS

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5", "qwen3_5-vl"])
def test_cuda_greedy_matches_reference(checkpoint, name):
    model_dir = checkpoint(name)
    llm = LLM(model_dir, device="cuda", dtype="float32", block_size=16, max_num_batched_tokens=9)
    prompts = [llm.encode(p) for p in ["def schedule(self, tokens):", "The café engine", "x"]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == checkpoints.reference_greedy(model_dir, prompt, 48)
    assert llm.worker.kv.k.device.type == "cuda"


def test_cuda_bfloat16_generates(checkpoint):
    llm = LLM(checkpoint("qwen3_5"), device="cuda", dtype="bfloat16")
    out = llm.generate(["def f(x):"], SamplingParams(max_tokens=32, temperature=0.7, seed=1,
                                                     ignore_eos=True))[0]
    assert len(out.token_ids) == 32 and llm.worker.model.lm_head.weight.dtype == torch.bfloat16


def test_to_device_copies_from_the_pinned_ring_arrive_intact():
    """More small copies than the ring has slots, queued behind a long kernel: each arrives with
    its own values (a slot is reused only once the copy that left from it is done)."""
    from metrale.workers.batch import _Staging, to_device
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(4096, 4096, device=device)
    for _ in range(20):   # keeps the stream busy while the host queues the copies
        x = x @ x / 64
    sent = [to_device([[i, i + 1], [i * 3, -i]], device) for i in range(3 * _Staging.SLOTS)]
    sent.append(to_device(list(range(40000)), device, torch.int32))   # above a slot: pinned anew
    torch.cuda.synchronize()
    for i, t in enumerate(sent[:-1]):
        assert t.tolist() == [[i, i + 1], [i * 3, -i]] and t.dtype == torch.long
    assert sent[-1].tolist() == list(range(40000)) and sent[-1].dtype == torch.int32


@pytest.mark.parametrize("name,decode_steps", [("qwen3", None), ("qwen3_5", None),
                                               ("qwen3_5", 4)])
def test_decode_steps_launched_ahead_keep_the_reference_tokens(checkpoint, monkeypatch, name,
                                                                decode_steps):
    """On the graph path, plain greedy decoding keeps two steps launched, the second's tokens
    taken on the device from the first's argmaxes. Prompts of different lengths (one of one
    token), different max_tokens, a stop token met while a step was planned ahead, and a sampled
    request (whose steps run to their end) give transformers' tokens, and steps did fly. Plans
    of 4 decode steps (as a served request read at its end runs) give the same tokens. Chains
    (the graph path's default) are off: they would take every greedy step."""
    from metrale.workers.worker import Worker
    flights = []
    launch = Worker._launch_decode
    monkeypatch.setattr(Worker, "_launch_decode",
                        lambda self, work: flights.append(len(work)) or launch(self, work))
    model_dir = checkpoint(name)
    llm = LLM(model_dir, device="cuda", dtype="float32", block_size=4, max_num_batched_tokens=16,
              decode_steps=decode_steps, chain_rounds=0)
    assert llm.worker.graphs is not None
    prompts = [llm.encode(p) for p in ["def schedule(self, tokens):", "The café engine"]]
    prompts.append(prompts[0][:1])
    lengths = [40, 23, 31]
    refs = [checkpoints.reference_greedy(model_dir, p, n) for p, n in zip(prompts, lengths)]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    params[1] = SamplingParams(max_tokens=23, temperature=0, ignore_eos=True,
                               stop_token_ids=(refs[1][9],))
    sampled = SamplingParams(max_tokens=6, temperature=0.9, seed=3, ignore_eos=True)
    outs = llm.generate(prompts + [prompts[1]], params + [sampled])
    assert outs[0].token_ids == refs[0] and outs[2].token_ids == refs[2]
    stop = refs[1].index(refs[1][9])
    assert outs[1].token_ids == refs[1][:stop + 1] and outs[1].finish_reason == "stop"
    assert len(outs[3].token_ids) == 6
    # plans of several steps run each to its end (their host work is once a plan)
    assert (len(flights) > 20 if decode_steps is None else not flights)
    assert not llm.worker._flying


def test_an_engine_thread_launches_while_another_reads(checkpoint):
    """Through the replica engine's in-process executor (a launch thread and a reader thread),
    requests arriving over time decode to transformers' tokens."""
    import asyncio
    from metrale.cluster.engine import ReplicaEngine
    from metrale.cluster.executor import LocalExecutor
    from metrale.cluster.scheduler import SchedulerConfig
    from metrale.deploy.llm import load_tokenizer
    from metrale.workers.worker import Worker, WorkerConfig
    model_dir = checkpoint("qwen3_5")
    worker = Worker(WorkerConfig(str(model_dir), "cuda", "float32", block_size=4))
    tokenizer = load_tokenizer(model_dir)
    prompts = [tokenizer.encode(p).ids for p in ["def schedule(self, tokens):", "The café",
                                                 "x = [1, 2", "import torch"]]
    refs = [checkpoints.reference_greedy(model_dir, p, 28) for p in prompts]

    async def run():
        eng = ReplicaEngine([LocalExecutor(worker)], SchedulerConfig(max_num_seqs=8), tokenizer)
        eng.start()

        async def one(i, ids):
            await asyncio.sleep(0.02 * i)
            tokens = []
            async for d in eng.generate(f"r{i}", ids, SamplingParams(max_tokens=28, temperature=0,
                                                                      ignore_eos=True)):
                tokens += d.token_ids
            return tokens
        outs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        await eng.stop()
        return outs
    assert asyncio.run(run()) == refs
    assert not worker._flying


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_greedy_verifies_commit_their_ssm_states_before_the_verdicts(checkpoint, monkeypatch,
                                                                     method):
    """On the graph path a greedy verify on a hybrid target commits its SSM states from accepted
    counts found on the device, before the host reads the verdicts (checked against them); a
    round with a sampled sequence commits after its verdicts as before. Both give transformers'
    greedy tokens, with n-gram and MTP drafts (n-gram rounds one at a time here: chained ones
    commit inside their graph, see the chained test below)."""
    from metrale.workers.ssm_pool import SSMSlotPool
    early, late = [], []
    commit_greedy, commit = SSMSlotPool.commit_greedy, SSMSlotPool.commit
    monkeypatch.setattr(SSMSlotPool, "commit_greedy", lambda self, *a: early.append(1)
                        or commit_greedy(self, *a))
    monkeypatch.setattr(SSMSlotPool, "commit", lambda self, slots, acc: late.append(len(slots))
                        or commit(self, slots, acc))
    model_dir = checkpoint("qwen3_5")
    llm = LLM(model_dir, device="cuda", dtype="float32", block_size=4, max_num_batched_tokens=16,
              speculative_method=method, num_drafts=3, adaptive_drafts=False, chain_rounds=0)
    assert llm.worker.graphs is not None
    prompts = [llm.encode(p) for p in ["def schedule(self, tokens):", "The café engine"]]
    refs = [checkpoints.reference_greedy(model_dir, p, 32) for p in prompts]
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs
    assert early and not any(late), "greedy rounds committed after their verdicts"
    outs = llm.generate(prompts, [SamplingParams(max_tokens=32, temperature=0, ignore_eos=True),
                                  SamplingParams(max_tokens=32, temperature=0.8, seed=1)])
    assert outs[0].token_ids == refs[0] and any(late)


@pytest.mark.parametrize("method, name", [("ngram", "qwen3"), ("ngram", "qwen3_5"),
                                          ("mtp", "qwen3_5"), ("dflash", "qwen3_5")])
def test_chained_rounds_replay_graphs_and_keep_the_reference_tokens(checkpoint, dflash_drafter,
                                                                    method, name):
    """On a graph worker greedy n-gram, MTP and DFlash rounds chain by default: each round's
    drafts, inputs, verdicts, (hybrid) SSM commit and drafter catch-up stay on the device, one
    graph replay a round, and the host reads a chain once. The tokens are transformers' greedy
    ones, also for sequences that stop inside a chain."""
    model_dir = checkpoint(name)
    llm = LLM(model_dir, device="cuda", dtype="float32", block_size=4, max_num_batched_tokens=64,
              speculative_method=method, num_drafts=3, adaptive_drafts=False,
              drafter=dflash_drafter(name) if method == "dflash" else None)
    worker = llm.worker
    assert worker.capacity.chain_rounds == CHAIN_ROUNDS and worker.graphs is not None
    # captured at start: every bucket, for 1 row (plain steps, k = 0) and 2..4 rows
    assert len(worker.chain.graphs_by_shape) == (1 + 3) * len(worker.graphs.buckets)
    chains, resumed, eager = watch_chains(worker)
    one_by_one = worker._rounds_one_by_one
    worker._rounds_one_by_one = lambda *a: eager.append(1) or one_by_one(*a)
    prompts = [llm.encode(p) for p in ["def schedule(self, tokens):", "The café engine", "x"]]
    refs = [checkpoints.reference_greedy(model_dir, p, 40) for p in prompts]
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs
    assert chains and not eager and max(chains) == CHAIN_ROUNDS
    # chains planned ahead go on from the chain before on the device, the drafter's state too
    assert any(resumed)
    assert_stops_where_first_met(llm, prompts, refs, 12)


@pytest.mark.parametrize("k", [3, 7])
def test_chained_ngram_rounds_accept_what_the_lookup_offers(k):
    """The bench's n-gram runs in miniature: the bundled model in its bfloat16, 64 prompts of
    256 tokens, a fixed k, chains on the device (the lookup's kernel, programmatic dependent
    launch, the verdicts' kernel, tiles and cuBLAS, the batch shrinking through its buckets).
    Every round accepts what the lookup's drafts from its history match of the output, at
    least, and what they match with filler, at most (see
    assert_rounds_accept_what_the_lookup_offers): a round that drafted from a stale history
    (a kernel reading the history before the last round's tokens land) would accept fewer,
    while its tokens stay the target's."""
    from conftest import assert_rounds_accept_what_the_lookup_offers
    from metrale.deploy.bundled import BUNDLED_MODEL
    from metrale.deploy.gpubench import bundled_prompts
    llm = LLM(str(BUNDLED_MODEL), device="cuda", speculative_method="ngram", num_drafts=k,
              adaptive_drafts=False, max_num_seqs=64, max_num_batched_tokens=16384)
    chains, resumed, eager = watch_chains(llm.worker)
    accepted = assert_rounds_accept_what_the_lookup_offers(
        llm, bundled_prompts(BUNDLED_MODEL, 64, 256), 128)
    assert chains and any(resumed) and not eager
    assert sum(map(sum, accepted)) > 0.1 * k * sum(map(len, accepted))   # drafts do pass
    llm.close()


def watch_chains(worker):
    """Lists filled as the worker's chain runner launches chains: their rounds, whether each
    went on from the chain before on the device, and the chains run without graphs."""
    chains, resumed, eager = [], [], []
    launch, chain_eagerly = worker.chain.launch, worker._chain_eagerly

    def launched(layout, rounds, *args, rows=None, **kw):
        chains.append(rounds)
        resumed.append(rows is not None)
        return launch(layout, rounds, *args, rows=rows, **kw)
    worker.chain.launch = launched
    worker._chain_eagerly = lambda *a: eager.append(1) or chain_eagerly(*a)
    return chains, resumed, eager


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5"])
def test_plain_decode_steps_chained_replay_graphs_and_keep_the_reference_tokens(checkpoint, name):
    """Without a proposer, greedy decode steps chain on the graph path by default: one
    graph replay a step (captured at start for every bucket), one host read a chain, the plans
    made ahead chained too (their first token taken from the chain before). The tokens are
    transformers' greedy ones, also for sequences that stop inside a chain, and a sampled
    request beside them runs its steps one by one."""
    from metrale.workers.worker import Worker
    model_dir = checkpoint(name)
    llm = LLM(model_dir, device="cuda", dtype="float32", block_size=4, max_num_batched_tokens=64)
    worker = llm.worker
    assert worker.capacity.chain_rounds == CHAIN_ROUNDS and worker.chain is not None
    assert len(worker.chain.graphs_by_shape) == len(worker.graphs.buckets)   # 1 row each
    chains, resumed, eager = watch_chains(worker)
    plans, launch = [], worker.launch
    worker.launch = lambda plan: plans.append(plan) or launch(plan)
    prompts = [llm.encode(p) for p in ["def schedule(self, tokens):", "The café engine", "x"]]
    refs = [checkpoints.reference_greedy(model_dir, p, 40) for p in prompts]
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs
    assert chains and not eager and max(chains) == CHAIN_ROUNDS and any(resumed)
    assert any(w.tokens == [AHEAD] and w.steps > 1 for p in plans for w in p.work)
    assert_stops_where_first_met(llm, prompts, refs, 12)
    plans.clear()
    outs = llm.generate(prompts[:2], [SamplingParams(max_tokens=40, temperature=0,
                                                     ignore_eos=True),
                                      SamplingParams(max_tokens=6, temperature=0.9, seed=3)])
    assert outs[0].token_ids == refs[0] and len(outs[1].token_ids) == 6
    assert all(w.sample.greedy for p in plans for w in p.work if w.steps > 1)


@pytest.mark.parametrize("ks", [[3], [3, 0]], ids=["k3", "k3-then-0"])
@pytest.mark.parametrize("method", ["mtp", "dflash"])
def test_chained_rounds_of_a_trained_drafter_accept_as_rounds_one_by_one(method, ks):
    """The bundled model's trained MTP layer or DFlash drafter, chained on the device (each
    round's catch-up writes the stash or context window the next round drafts from) and round
    by round (chain_rounds 0): the same greedy tokens, and nearly as many drafts accepted
    (float32; the catch-ups batch their rows differently). A chain that drafted from a stale
    stash or window would accept far fewer. With `ks` [3, 0] the draft policy alternates 3
    and 0 plan by plan: chains of depth 0 (plain steps) must feed the drafter as verifies do,
    so the acceptance rate after them holds."""
    from metrale.deploy.bundled import BUNDLED_DFLASH, BUNDLED_MODEL
    from metrale.deploy.gpubench import bundled_prompts
    kw = dict(device="cuda", dtype="float32", speculative_method=method, num_drafts=3,
              adaptive_drafts=False, max_num_seqs=8,
              drafter=str(BUNDLED_DFLASH) if method == "dflash" else None)
    prompts = bundled_prompts(BUNDLED_MODEL, 6, 64)
    greedy = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    runs = {}
    for rounds in (CHAIN_ROUNDS, 0):
        llm = LLM(str(BUNDLED_MODEL), chain_rounds=rounds, **kw)
        assert (llm.worker.chain is not None) == bool(rounds)
        cycle = itertools.cycle(ks)
        llm.scheduler.drafts.choose = lambda batch: next(cycle)
        runs[rounds] = ([o.token_ids for o in llm.generate(prompts, greedy)],
                        llm.scheduler.stats)
        llm.close()
    (chained, a), (alone, b) = runs[CHAIN_ROUNDS], runs[0]
    assert chained == alone
    assert b.drafts_accepted > b.drafts_proposed / 4
    if ks == [3]:
        assert a.drafts_accepted >= 0.9 * b.drafts_accepted, (a, b)
    else:   # the two alternate at other positions: their rates compare
        rate = [s.drafts_accepted / s.drafts_proposed for s in (a, b)]
        assert rate[0] >= 0.9 * rate[1], (a, b)

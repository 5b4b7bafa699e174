"""metrale's Qwen3 / Qwen3.5 against transformers: prefill logits and greedy continuations."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer

import checkpoints
from conftest import PROMPTS, VARIANTS, run_with_arrivals
from metrale.cluster.params import SamplingParams
from metrale.deploy.llm import LLM
from metrale.workers.batch import ForwardBatch
from metrale.workers.worker import Worker, WorkerConfig


def prefill_logits(worker: Worker, ids: list[int], chunk: int) -> torch.Tensor:
    """Runs the prompt through the worker's model in chunks of `chunk` tokens."""
    table = list(range(worker.kv.num_blocks))[: -(-len(ids) // worker.config.block_size)]
    out = []
    for start in range(0, len(ids), chunk):
        batch = ForwardBatch.build([(ids[start:start + chunk], start, table, 0)],
                                   worker.config.block_size, worker.device)
        out.append(worker.model.logits(worker.model(batch, worker.kv, worker.ssm)[0]))
    return torch.cat(out)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_prefill_logits_match_transformers(checkpoint, logit_report, name):
    model_dir = checkpoint(name)
    worker = Worker(WorkerConfig(str(model_dir), device="cpu", block_size=4, max_num_seqs=2))
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tokenizer.encode(PROMPTS[2] + PROMPTS[0] + PROMPTS[3]).ids
    ref = checkpoints.reference_logits(model_dir, ids)
    for chunk in (len(ids), 5):
        if worker.ssm is not None:
            worker.ssm.reset([0])
        ours = prefill_logits(worker, ids, chunk)
        diff = (ours - ref).abs().max().item()
        logit_report(name, diff)
        assert diff < 2e-4, f"{name}: max |logit diff| {diff} (chunk {chunk})"


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("mode", ["plain", "chunked", "preempt"])
def test_greedy_matches_transformers(checkpoint, name, mode):
    model_dir = checkpoint(name)
    worker_kw = dict(block_size=4, max_num_batched_tokens=512, max_num_seqs=8)
    if mode == "chunked":
        worker_kw["max_num_batched_tokens"] = 7
    if mode == "preempt":  # room for about two sequences' worth of blocks: forces recompute
        worker_kw["kv_cache_bytes"] = 44 * _block_bytes(model_dir, 4)
    llm = LLM(model_dir, device="cpu", **worker_kw)
    prompts = [llm.encode(p) for p in PROMPTS]
    arrivals = {0: prompts[:2], 3: prompts[2:3], 9: prompts[3:]}
    outputs = run_with_arrivals(llm, arrivals, SamplingParams(max_tokens=64, temperature=0,
                                                              ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        ref = checkpoints.reference_greedy(model_dir, prompt, 64)
        assert out.token_ids == ref, f"{name}/{mode}: diverged at {_first_diff(out.token_ids, ref)}"
        assert out.finish_reason == "length"
    if mode == "preempt":
        assert llm.scheduler.num_preemptions > 0


def _block_bytes(model_dir, block_size):
    w = Worker(WorkerConfig(str(model_dir), device="cpu", block_size=block_size, max_num_seqs=1))
    return w.kv.k[:, 0].nbytes * 2


def _first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_checkpoints_load_and_generate(tmp_path, dtype):
    model_dir = checkpoints.write_checkpoint(tmp_path / dtype, "qwen3_5",
                                             dtype=getattr(torch, dtype))
    llm = LLM(model_dir, device="cpu")
    assert llm.worker.model.lm_head.weight.dtype == getattr(torch, dtype)
    out = llm.generate(["def f(x):"], SamplingParams(max_tokens=16, temperature=0,
                                                     ignore_eos=True))[0]
    assert len(out.token_ids) == 16
    # Half precision is not bit-exact with the float32 reference; the first tokens agree.
    ref = checkpoints.reference_greedy(model_dir, llm.encode("def f(x):"), 16)
    assert out.token_ids[:2] == ref[:2]


def test_sharded_checkpoint_loads(checkpoint, tmp_path):
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint("qwen3_5"),
                                                              dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    (tmp_path / "tokenizer.json").write_bytes((checkpoint("qwen3_5") / "tokenizer.json").read_bytes())
    a = LLM(checkpoint("qwen3_5"), device="cpu").generate(["hello"], SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True))[0]
    b = LLM(tmp_path, device="cpu").generate(["hello"], SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert a.token_ids == b.token_ids


def test_the_start_up_prefill_leaves_no_trace(checkpoint):
    """`Worker.warm_up` (run at start on CUDA, with the step budget's rows) prefills a dummy
    prompt in slot 0 over free blocks: slot 0's SSM state is cleared after it, the rows are
    capped by the context and the cache, and the first request's greedy tokens are unchanged."""
    model_dir = checkpoint("qwen3_5")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    cold = LLM(model_dir, device="cpu", block_size=4)
    expected = [o.token_ids for o in cold.generate(PROMPTS, params)]
    llm = LLM(model_dir, device="cpu", block_size=4)
    w = llm.worker
    assert w.warm_up(40) == 40
    assert not w.ssm.state[:, 0].any() and not w.ssm.conv[:, 0].any()
    assert w.warm_up(10 ** 9) == min(w.model.config.max_position_embeddings - 1,
                                     (w.kv.num_blocks - 1) * 4)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == expected

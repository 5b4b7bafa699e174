"""The Python API: stop conditions, n, logprobs, seeds, usage, and refusals that fail alone."""

from __future__ import annotations

import json

import pytest
import torch

import checkpoints
from metrale.cluster.params import RequestError, SamplingParams
from metrale.deploy.llm import LLM
from metrale.workers.models import CheckpointError


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint("qwen3_5"), device="cpu", block_size=4)


def greedy(**kw):
    return SamplingParams(**{"max_tokens": 32, "temperature": 0, "ignore_eos": True, **kw})


def test_stop_string_cuts_text(llm):
    full = llm.generate(["The café engine"], greedy())[0]
    stop = full.text[10:13]
    assert stop and full.text.find(stop) >= 5
    out = llm.generate(["The café engine"], greedy(stop=(stop,)))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[:full.text.find(stop)]


def test_stop_token_and_eos(llm):
    full = llm.generate(["def f(x):"], greedy())[0]
    target = full.token_ids[5]
    out = llm.generate(["def f(x):"], greedy(stop_token_ids=(target,)))[0]
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[:full.token_ids.index(target) + 1]


def test_eos_stops_unless_ignored(checkpoint, tmp_path):
    d = _copy(checkpoint("qwen3"), tmp_path / "m")
    full = LLM(d, device="cpu").generate(["def f(x):"], greedy())[0]
    eos = full.token_ids[4]
    cfg = json.loads((d / "config.json").read_text())
    cfg["eos_token_id"] = eos
    (d / "config.json").write_text(json.dumps(cfg))
    llm = LLM(d, device="cpu")
    out = llm.generate(["def f(x):"], greedy(ignore_eos=False))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[:full.token_ids.index(eos) + 1]
    assert llm.generate(["def f(x):"], greedy())[0].token_ids == full.token_ids


def test_usage_and_length(llm):
    out = llm.generate(["def f(x):"], greedy(max_tokens=7))[0]
    assert out.finish_reason == "length"
    assert out.usage == {"prompt_tokens": len(llm.encode("def f(x):")), "completion_tokens": 7,
                         "total_tokens": len(llm.encode("def f(x):")) + 7}


def test_seeded_sampling_reproduces_and_n_gives_distinct_completions(llm):
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=11, n=3, ignore_eos=True)
    a = llm.generate(["The"], p)[0]
    b = llm.generate(["The"], p)[0]
    assert [c.token_ids for c in a.completions] == [c.token_ids for c in b.completions]
    assert len({tuple(c.token_ids) for c in a.completions}) == 3
    c = llm.generate(["The"], SamplingParams(max_tokens=16, temperature=1.0, seed=12,
                                             ignore_eos=True))[0]
    assert c.token_ids != a.token_ids
    assert a.usage["completion_tokens"] == 48


def test_seeded_sampling_survives_preemption(checkpoint):
    model_dir = checkpoint("qwen3")
    p = SamplingParams(max_tokens=40, temperature=0.8, seed=3, ignore_eos=True)
    prompts = ["The café engine", "def f(x):", "日本語", "# item 7"]
    roomy = LLM(model_dir, device="cpu", block_size=4).generate(prompts, p)
    tight = LLM(model_dir, device="cpu", block_size=4, kv_cache_bytes=30 * 3072)
    assert [o.token_ids for o in tight.generate(prompts, p)] == [o.token_ids for o in roomy]
    assert tight.scheduler.num_preemptions > 0


def test_logprobs_match_the_reference(llm, checkpoint):
    out = llm.generate(["def f(x):"], greedy(max_tokens=6, logprobs=3))[0]
    prompt = llm.encode("def f(x):")
    ref = torch.log_softmax(checkpoints.reference_logits(checkpoint("qwen3_5"),
                                                         prompt + out.token_ids), -1)
    lps = out.completions[0].logprobs
    assert len(lps) == 6
    for i, lp in enumerate(lps):
        row = ref[len(prompt) - 1 + i]
        assert lp.token_id == out.token_ids[i]
        assert abs(lp.logprob - row[lp.token_id].item()) < 1e-3
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()


@pytest.mark.parametrize("field, kwargs", [
    ("max_tokens", {"max_tokens": 0}), ("temperature", {"temperature": -0.1}),
    ("top_p", {"top_p": 0.0}), ("top_p", {"top_p": 1.5}), ("top_k", {"top_k": -3}),
    ("min_p", {"min_p": 2.0}), ("n", {"n": 0}), ("logprobs", {"logprobs": 99})])
def test_bad_sampling_params_name_the_field(field, kwargs):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**kwargs)


def test_bad_request_fails_alone(llm):
    too_long = list(range(1, 200)) * 3
    outs = llm.generate(["hello", too_long, "def f(x):", [10_000]], greedy(max_tokens=5))
    assert outs[0].error is None and len(outs[0].token_ids) == 5
    assert "max_model_len" in outs[1].error and not outs[1].completions
    assert outs[2].error is None and len(outs[2].token_ids) == 5
    assert "vocabulary" in outs[3].error


def test_generation_stops_at_the_context_limit(checkpoint):
    llm = LLM(checkpoint("qwen3"), device="cpu", max_model_len=20)
    out = llm.generate(["def f(x):"], greedy(max_tokens=100))[0]
    assert out.finish_reason == "length"
    assert len(out.token_ids) + len(llm.encode("def f(x):")) == 20


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_unknown_architecture_names_the_supported_ones(checkpoint, tmp_path):
    d = _copy(checkpoint("qwen3"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="LlamaForCausalLM.*Qwen3ForCausalLM.*Qwen3_5ForCausalLM"):
        LLM(d, device="cpu")


@pytest.mark.parametrize("victim, content", [
    ("model.safetensors", None), ("model.safetensors", b"\x00garbage" * 10),
    ("config.json", None), ("config.json", b"{not json"), ("tokenizer.json", None),
    ("tokenizer.json", b"[1, 2"), ("tokenizer_config.json", b"{oops"),
])
def test_missing_or_corrupt_files_are_named(checkpoint, tmp_path, victim, content):
    d = _copy(checkpoint("qwen3_5"), tmp_path / "m")
    if content is None:
        (d / victim).unlink()
    else:
        (d / victim).write_bytes(content)
    with pytest.raises(CheckpointError, match=victim.replace(".", r"\.")):
        LLM(d, device="cpu")


def test_weights_that_do_not_fit_the_config_are_refused(checkpoint, tmp_path):
    d = _copy(checkpoint("qwen3"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="mlp.*shape"):
        LLM(d, device="cpu")


def test_chat_template_is_read_when_present(checkpoint, tmp_path):
    d = _copy(checkpoint("qwen3"), tmp_path / "m")
    assert LLM(d, device="cpu").chat_template is None
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}{{ m.content }}{% endfor %}"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert LLM(d, device="cpu").chat_template == cfg["chat_template"]

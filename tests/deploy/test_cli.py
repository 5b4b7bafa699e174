"""`metrale generate` as a user runs it: the JSON-lines contract and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from metrale.cluster.params import SamplingParams
from metrale.deploy.llm import LLM


def metrale(*args):
    return subprocess.run([sys.executable, "-m", "metrale.deploy.cli", *args],
                          capture_output=True, text=True, timeout=120)


def test_generate_json_lines_in_prompt_order(checkpoint):
    model_dir = checkpoint("qwen3_5-vl")
    r = metrale("generate", "--model", str(model_dir), "--prompt", "def f(x):", "--prompt",
                "The café", "--max-tokens", "9", "--ignore-eos", "--device", "cpu", "--json")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(lines) == 2
    llm = LLM(model_dir, device="cpu")
    expected = llm.generate(["def f(x):", "The café"], SamplingParams(max_tokens=9, temperature=0,
                                                                      ignore_eos=True))
    for got, want in zip(lines, expected):
        assert got["token_ids"] == want.token_ids and got["text"] == want.text
        assert got["finish_reason"] == "length"
        assert got["usage"] == {"prompt_tokens": len(want.prompt_token_ids),
                                "completion_tokens": 9, "total_tokens": len(want.prompt_token_ids) + 9}


def test_plain_output_and_errors(checkpoint, tmp_path):
    model_dir = checkpoint("qwen3")
    r = metrale("generate", "--model", str(model_dir), "--prompt", "hello", "--max-tokens", "4")
    assert r.returncode == 0 and "[4 tokens in" in r.stderr
    r = metrale("generate", "--model", str(model_dir), "--prompt", "x", "--top-p", "2")
    assert r.returncode == 2 and "top_p" in r.stderr
    r = metrale("generate", "--model", str(model_dir), "--prompt", "hi", "--max-tokens", "2",
                "--attention-backend", "torch", "--no-cuda-graphs")
    assert r.returncode == 0 and "[2 tokens in" in r.stderr
    if not torch.cuda.is_available():
        r = metrale("generate", "--model", str(model_dir), "--prompt", "x",
                    "--attention-backend", "triton")
        assert r.returncode == 2 and "needs Triton and a CUDA device" in r.stderr
    r = metrale("generate", "--model", str(tmp_path / "nope"), "--prompt", "x")
    assert r.returncode == 2 and "no such model directory" in r.stderr
    r = metrale("generate", "--model", str(model_dir), "--prompt", "x " * 600, "--json")
    assert r.returncode == 1 and "max_model_len" in json.loads(r.stdout)["error"]


@pytest.mark.slow
def test_generate_with_tensor_parallel_ranks(checkpoint):
    """Two ranks on a local Ray started by the command: the single-rank output."""
    model_dir = checkpoint("qwen3_5")
    r = metrale("generate", "--model", str(model_dir), "--prompt", "def f(x):", "--max-tokens", "9",
                "--ignore-eos", "--device", "cpu", "--speculative-method", "mtp",
                "--tensor-parallel-size", "2", "--json")
    assert r.returncode == 0, r.stderr
    want = LLM(model_dir, device="cpu").generate(["def f(x):"], SamplingParams(
        max_tokens=9, temperature=0, ignore_eos=True))[0]
    assert json.loads(r.stdout)["token_ids"] == want.token_ids
    r = metrale("generate", "--model", str(checkpoint("qwen3_5-pattern")), "--prompt", "x",
                "--tensor-parallel-size", "2")
    assert r.returncode == 2 and "num_key_value_heads=1" in r.stderr

"""Drafters that do not fit the target, and methods the checkpoint cannot support, are refused."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import checkpoints
from metrale.deploy.llm import LLM
from metrale.drafting.proposer import ProposerError


def test_mtp_without_mtp_tensors_is_refused(checkpoint):
    with pytest.raises(ProposerError, match="no mtp.* tensors"):
        LLM(checkpoint("qwen3"), device="cpu", speculative_method="mtp")
    with pytest.raises(ProposerError, match="no mtp.* tensors"):
        LLM(checkpoint("qwen3_5-pattern"), device="cpu", speculative_method="mtp")


@pytest.mark.parametrize("override, message", [
    (dict(hidden_size=32), "hidden_size 32 does not match the target's 64"),
    (dict(vocab_size=999), "vocab_size 999 does not match"),
    (dict(num_target_layers=7), "do not fit a target of 4 layers"),
    (dict(dflash_config={"mask_token_id": 1, "target_layer_ids": [0, 9]}), r"\[0, 9\]"),
    (dict(dflash_config={"mask_token_id": 5000, "target_layer_ids": [0]}), "mask_token_id 5000"),
])
def test_dflash_drafter_that_does_not_fit_is_refused(checkpoint, tmp_path, override, message):
    drafter = checkpoints.write_dflash_drafter(tmp_path / "d", checkpoint("qwen3_5"), **override)
    with pytest.raises(ProposerError, match=message):
        LLM(checkpoint("qwen3_5"), device="cpu", speculative_method="dflash", drafter=drafter)


def test_dflash_needs_a_drafter_and_unknown_methods_are_named(checkpoint):
    with pytest.raises(ProposerError, match="needs a drafter directory"):
        LLM(checkpoint("qwen3_5"), device="cpu", speculative_method="dflash")
    with pytest.raises(ProposerError, match="'eagle' is not one of none, mtp, dflash"):
        LLM(checkpoint("qwen3_5"), device="cpu", speculative_method="eagle")
    with pytest.raises(ProposerError, match="need 1 <= L < 4"):
        LLM(checkpoint("qwen3_5"), device="cpu", speculative_method="self", self_spec_layers=4)


def test_cli_reports_speculation_statistics(checkpoint, dflash_drafter):
    args = [sys.executable, "-m", "metrale.deploy.cli", "generate", "--model",
            str(checkpoint("qwen3_5")), "--prompt", "def f(x):", "--prompt", "The café",
            "--max-tokens", "12", "--ignore-eos", "--json", "--device", "cpu"]
    plain = subprocess.run(args, capture_output=True, text=True, timeout=120)
    spec = subprocess.run(args + ["--speculative-method", "dflash", "--no-adaptive-drafts",
                                  "--drafter", str(dflash_drafter("qwen3_5"))],
                          capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    for a, b in zip(plain.stdout.splitlines(), spec.stdout.splitlines()):
        a, b = json.loads(a), json.loads(b)
        assert a["token_ids"] == b["token_ids"]
        assert a["spec"]["rounds"] == 0
        s = b["spec"]
        assert s["rounds"] > 0 and s["rounds"] < s["drafts_proposed"] <= 3 * s["rounds"]
        assert s["mean_acceptance_length"] == pytest.approx(1 + s["drafts_accepted"] / s["rounds"],
                                                            abs=1e-3)
    bad = subprocess.run(args + ["--speculative-method", "mtp", "--model", str(checkpoint("qwen3"))],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "mtp.* tensors" in bad.stderr

"""`metrale train` on a tiny configuration (the CI smoke test) and what it writes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from metrale.cluster.params import SamplingParams
from metrale.deploy.llm import LLM
from metrale.deploy.train import TrainConfig, build


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    r = subprocess.run([sys.executable, "-m", "metrale.deploy.cli", "train", "--out", str(out),
                        "--tiny"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return out


def test_training_writes_loadable_checkpoints(trained):
    target, dflash = trained / "target", trained / "dflash"
    config = json.loads((target / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text" and config["mtp_num_hidden_layers"] == 1
    assert set(json.loads((dflash / "config.json").read_text())["dflash_config"]) == {
        "mask_token_id", "target_layer_ids"}
    log = json.loads((trained / "training.json").read_text())
    # 6 rollouts in batches of 4: 2 batches
    assert log["runs"][-1]["steps"] == {"data": 1, "target": 3, "rollouts": 2, "mtp": 2,
                                        "dflash": 2}
    manifest = json.loads((target / "heldout.json").read_text())
    assert manifest["heldout"], "the smoke configuration holds out some files"
    assert (trained / "data" / "train_tokens.u16").stat().st_size == 2 * manifest["train_tokens"]


def test_trained_model_matches_transformers_and_speculation_is_exact(trained):
    import transformers
    target = trained / "target"
    ref = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    llm = LLM(target, device="cpu", dtype="float32")
    prompt = llm.encode("def read(self, path):\n    return")
    ours = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    theirs = ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24,
                          min_new_tokens=24)[0, len(prompt):].tolist()
    assert ours.token_ids == theirs
    for method, drafter in (("mtp", None), ("dflash", trained / "dflash")):
        spec = LLM(target, device="cpu", dtype="float32", speculative_method=method,
                   drafter=drafter)
        out = spec.generate([prompt], SamplingParams(max_tokens=24, temperature=0,
                                                     ignore_eos=True))[0]
        assert out.token_ids == ours.token_ids and out.spec.rounds > 0


def test_training_is_deterministic_and_stages_can_run_apart(trained, tmp_path):
    """The data stage alone, then the model stages from what it wrote (as on a GPU machine whose
    interpreter has another standard library), give the same files as one run of all stages."""
    build(TrainConfig.tiny(tmp_path), ("data",))
    build(TrainConfig.tiny(tmp_path), ("target", "mtp", "dflash"))
    for name in ("target/tokenizer.json", "target/model.safetensors",
                 "target/model-mtp.safetensors", "dflash/model.safetensors"):
        assert (tmp_path / name).read_bytes() == (trained / name).read_bytes(), name


def test_evaluation_reports_perplexity_acceptance_and_speed(trained):
    from metrale.deploy.evaluate import evaluate, format_table
    result = evaluate(trained / "target", trained / "dflash", num_prompts=2, prompt_tokens=16,
                      new_tokens=8, ks=(1, 2), ppl_tokens=500, speed_prompts=1)
    assert result["files"]["found"] > 0 and result["perplexity"] > 1
    methods = {(r["method"], r["k"]) for r in result["acceptance"]}
    assert {("mtp", 1), ("mtp", 2), ("dflash", 1), ("dflash", 3), ("ngram", 3)} <= methods
    for row in result["acceptance"]:
        for t in ("T0", "T1"):
            if row["method"] in ("mtp", "dflash"):   # n-gram may find no match in 8 tokens
                assert row[t]["rounds"] > 0
            assert row[t]["mean_acceptance_length"] <= row["k"] + 1
    assert set(result["speed_batch1_T0"]["ratios"]) == {"mtp", "dflash"}
    assert "perplexity on" in format_table(result)


def test_generate_defaults_to_the_bundled_model():
    from metrale.deploy.bundled import BUNDLED_DFLASH, BUNDLED_MODEL, bundled_paths
    assert (BUNDLED_MODEL / "config.json").is_file() and (BUNDLED_DFLASH / "config.json").is_file()
    assert bundled_paths(None, None, "dflash") == (str(BUNDLED_MODEL), str(BUNDLED_DFLASH))
    assert bundled_paths(None, None, "mtp") == (str(BUNDLED_MODEL), None)
    r = subprocess.run([sys.executable, "-m", "metrale.deploy.cli", "generate", "--prompt",
                        "def add(a, b):", "--max-tokens", "16", "--speculative-method", "dflash",
                        "--json", "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["usage"]["completion_tokens"] == 16 and out["spec"]["rounds"] > 0

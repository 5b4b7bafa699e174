"""`metrale bench` end to end on CPU with tiny shapes: every part runs and the report is complete."""

from __future__ import annotations

import importlib.util
import json
import subprocess

import pytest
import torch

from metrale.deploy.cli import main
from metrale.deploy.gpubench import arrival_times, git_commit, steady_lengths, weight_bytes
from metrale.deploy.random_checkpoint import QWEN3_5_SMALL, hf_config, write_random_checkpoint
from metrale.workers.models import kernels


@pytest.mark.slow
def test_bench_small_on_cpu(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["bench", "--small", "--device", "cpu", "--batch-sizes", "1,2", "--iters", "3",
                 "--new-tokens", "12", "--ckpt-dir", str(tmp_path / "ckpt"),
                 "--methods", "none,mtp=2,dflash=3,ngram=3,ngram@7", "--arrival-rate", "40",
                 "--steady-waves", "2",
                 "--attention-backend", "torch", "--out", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["device"] == "cpu" and report["torch"] == torch.__version__
    assert report["dtype"] == "float32" and report["date"]
    assert report["worker_options"] == {"attention_backend": "torch", "cuda_graphs": True,
                                        "few_rows": True, "small_weight_rows": 128,
                                        "chain_kernels": True}
    assert report["bandwidth_bytes_per_s"] > 0
    assert set(report["models"]) == {"bundled", "qwen3-8b", "qwen3.5-2b"}
    for name, m in report["models"].items():
        assert m["floor"]["weight_bytes"] > 0 and m["floor"]["floor_ms"] > 0
        forward = m["forward"]
        assert all(v > 0 for v in forward["decode_ms"].values())
        assert set(forward["verify_ms_batch1"]) == {"1", "3", "7", "15"}
        assert all(v > 0 for v in forward["verify_over_decode_batch1"].values())
        methods = ["none", "mtp=2", "dflash=3", "ngram=3", "ngram@7"] if name == "bundled" \
            else ["none"]
        assert list(m["engine"]) == methods
        for method, runs in m["engine"].items():
            assert set(runs) == {"1", "2"}
            for size, run in runs.items():
                assert run["tokens_per_s"] > 0 and run["ms_per_step"] > 0 and run["tokens"] > 0
                # each turn's run, in order; the median is the one kept
                assert len(run["turns_tokens_per_s"]) == 3
                assert sorted(run["turns_tokens_per_s"])[1] == run["tokens_per_s"]
                # until the first sequence finished; plain sequences all finish in one step
                assert 0 < run["full_batch_tokens"] <= run["tokens"]
                assert run["full_batch_tokens_per_s"] > 0
                assert method != "none" or run["full_batch_tokens"] == run["tokens"]
                assert 0 < run["full_batch_s"] <= run["wall_s"]
                assert 0 < run["full_batch_steps"] <= run["steps"]
                assert method != "none" or run["full_batch_steps"] == run["steps"]
                # each sequence's rounds: 11 tokens after the prefill's, 1 + k a round at most
                rounds = run["sequence_rounds"]
                assert len(rounds) == int(size) and rounds == sorted(rounds)
                k = int(method.split("=")[1]) if "=" in method else 7
                most = 0 if method == "none" else k
                assert all(-(-11 // (most + 1)) <= r <= 11 for r in rounds)
                assert method != "none" or rounds == [11] * int(size)
                # n-gram at a fixed k on the CPU (a round a plan, the host's index drafting):
                # every round accepts what the lookup's drafts match, as the text asks for
                lookup = run["sequence_rounds_lookup"]
                assert (lookup is None) == (not method.startswith("ngram"))
                assert method != "ngram=3" or lookup == rounds
                assert lookup is None or (len(lookup) == len(rounds) and lookup == sorted(lookup))
                # after each step: ms since the start, rising to the wall; sequences running
                times = [t for t, _ in run["timeline"]]
                assert len(times) == run["steps"] and times == sorted(times)
                assert 0 < times[-1] <= 1000 * run["wall_s"]
                running = [n for _, n in run["timeline"]]
                assert running[-1] == 0 and all(0 <= n <= int(size) for n in running)
                assert running == sorted(running, reverse=True)
                # steady: 2B requests of 12 +- 50% tokens, at most B sequences (so tokens) a step
                b = int(size)
                assert run["steady_requests"] == 2 * b
                assert run["steady_tokens"] == sum(steady_lengths(2 * b, 12, 0.5))
                assert run["steady_tokens_per_s"] > 0
                # until the queue emptied: B sequences ran at every step, the drain left out
                assert 0 < run["loaded_s"] < run["steady_wall_s"]
                assert run["loaded_tokens_per_s"] > 0
                assert method != "none" or run["steady_steps"] >= 2 * 12
                # the same requests arriving at random: every token, and first-token times
                assert run["arrival_tokens"] == run["steady_tokens"]
                assert 0 < run["arrival_ttft_p50_ms"] <= run["arrival_ttft_p90_ms"]
                assert run["arrival_tokens_per_s"] > 0 and run["arrival_requests_per_s"] > 0
                proposed = run["spec"]["drafts_proposed"]
                if method == "none":
                    assert run["acceptance"] is None and proposed == 0
                elif method in ("mtp=2", "dflash=3"):   # a fixed k: every round carries drafts
                    assert proposed > 0 and 0 <= run["acceptance"] <= 1
                    assert 1 <= run["mean_acceptance_length"] <= int(method[-1]) + 1
                else:   # n-gram drafts only where a suffix matched; the policy may pick k = 0
                    assert (run["acceptance"] is None) == (proposed == 0)
        assert m["hf_generate"]["1"]["tokens_per_s"] > 0
    targets = {t["target"]: t for t in report["targets"]}
    assert len(targets) == 15
    for name, m in report["models"].items():
        detail = targets[f"metrale / transformers generate tokens/s, batch 1, {name}"]["detail"]
        at_floor = m["floor"]["tokens_per_s_batch1"] / m["hf_generate"]["1"]["tokens_per_s"]
        assert detail.endswith(f"; {at_floor:.1f}x at the floor")
    for how in ("one batch", "under load"):
        assert targets[f"speculative / plain tokens/s, batch 32, bundled, {how}"]["result"] == "n/a"
    assert all(t["result"] in ("PASS", "MISS") for name, t in targets.items() if "32" not in name)
    printed = capsys.readouterr().out
    assert "PASS" in printed or "MISS" in printed
    assert "ngram@7 ttft" in printed and "(arrivals at 40.0 a second per seat" in printed
    if importlib.util.find_spec("matplotlib"):
        assert (out / "bench.png").stat().st_size > 0

    # a second call merges the first report's models into its own
    again = tmp_path / "again"
    assert main(["bench", "--small", "--device", "cpu", "--models", "qwen3-8b", "--batch-sizes",
                 "1", "--iters", "2", "--new-tokens", "4", "--skip-hf", "--skip-forward",
                 "--ckpt-dir", str(tmp_path / "ckpt"), "--merge", str(out / "bench.json"),
                 "--out", str(again)]) == 0
    merged = json.loads((again / "bench.json").read_text())["models"]
    assert set(merged) == {"bundled", "qwen3-8b", "qwen3.5-2b"}
    assert set(merged["qwen3-8b"]["engine"]["none"]) == {"1"} and "forward" not in merged["qwen3-8b"]


def test_the_transformers_target_says_what_the_floor_allows():
    """Plain decoding can not beat the bandwidth floor, so the target's detail gives the ratio a
    step at the floor would make: on the 8B shape it is below 30x when transformers is fast."""
    from metrale.deploy.gpubench import targets
    models = {"qwen3-8b": {"floor": {"floor_ms": 3.706, "tokens_per_s_batch1": 269.8},
                           "hf_generate": {1: {"tokens_per_s": 10.1}},
                           "engine": {"none": {1: {"tokens_per_s": 176.1, "ms_per_step": 5.68}}}}}
    row, = [t for t in targets(models) if "transformers" in t["target"]]
    assert row["result"] == "MISS" and abs(row["measured"] - 176.1 / 10.1) < 1e-9
    assert row["detail"] == "none 176.1 vs 10.1 tokens/s; 26.7x at the floor"


def test_a_plain_variant_is_no_proposer_in_the_targets():
    """'none/c8' (plain decode steps chained) is timed beside the proposers, and its ratio over
    'none' printed, but the proposer targets are the proposers' alone."""
    from metrale.deploy.gpubench import targets
    runs = lambda *tps: {b: {"tokens_per_s": t, "loaded_tokens_per_s": 2 * t}
                         for b, t in zip((1, 32), tps)}
    engine = {"none": runs(1000, 20000), "none/c8": runs(3000, 70000), "mtp": runs(2600, 27000)}
    rows = {t["target"]: t for t in targets({"bundled": {"engine": engine}})}
    best = rows["best proposer / plain tokens/s, bundled, T=0, batch 1"]
    assert best["detail"] == "mtp" and abs(best["measured"] - 2.6) < 1e-9
    for how in ("one batch", "under load"):
        row = rows[f"speculative / plain tokens/s, batch 32, bundled, {how}"]
        assert row["measured"] == 27000 / 20000 and row["detail"] == "mtp"


def test_the_floor_target_takes_a_token_per_decode_step_even_when_steps_chain():
    """The 8B step's time is one token's (1 / tokens/s at batch 1): a plan of chained decode
    steps reports a chain's time as `ms_per_step`."""
    from metrale.deploy.gpubench import targets
    models = {"qwen3-8b": {"floor": {"floor_ms": 5.0, "tokens_per_s_batch1": 200.0},
                           "engine": {"none": {1: {"tokens_per_s": 182.0, "ms_per_step": 43.9}}}}}
    row, = [t for t in targets(models) if "floor" in t["target"]]
    assert row["result"] == "PASS" and abs(row["measured"] - 1e3 / 182.0 / 5.0) < 1e-9
    assert row["detail"] == "5.49 ms vs 5.00 ms"


def test_random_hybrid_checkpoint_loads_in_transformers(tmp_path):
    """The Qwen3.5 shape loads in transformers with every weight from the file, and the weight
    bytes of a step leave out the embedding table only when it is not the lm_head."""
    import transformers
    path = write_random_checkpoint(tmp_path, QWEN3_5_SMALL, "cpu")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert hf_config(QWEN3_5_SMALL)["tie_word_embeddings"]
    from metrale.workers.models.loader import load_model
    ours, _ = load_model(path, "cpu", "float32")
    every = sum(p.numel() * 4 for p in ours.parameters())   # tied: the table is counted once
    assert weight_bytes(ours) == every


def test_method_specs_name_the_engine_options():
    from metrale.deploy.gpubench import method_options
    assert method_options("none") == {"speculative_method": "none", "num_drafts": None,
                                      "adaptive_drafts": True, "prefill_gather": 1.0,
                                      "chain_rounds": None, "plan_ahead": True}
    assert method_options("ngram=3") == {"speculative_method": "ngram", "num_drafts": 3,
                                         "adaptive_drafts": False, "prefill_gather": 1.0,
                                         "chain_rounds": None, "plan_ahead": True}
    assert method_options("mtp@3/g4") == {"speculative_method": "mtp", "num_drafts": 3,
                                          "adaptive_drafts": True, "prefill_gather": 4.0,
                                          "chain_rounds": None, "plan_ahead": True}
    assert method_options("dflash/g2.5")["prefill_gather"] == 2.5
    assert method_options("mtp/c0")["chain_rounds"] == 0
    assert method_options("mtp@3/g4/c2") == {"speculative_method": "mtp", "num_drafts": 3,
                                             "adaptive_drafts": True, "prefill_gather": 4.0,
                                             "chain_rounds": 2, "plan_ahead": True}
    assert method_options("ngram@7/a0")["plan_ahead"] is False
    assert method_options("none/c8/a0") == {**method_options("none/c8"), "plan_ahead": False}


def test_a_bad_method_spec_is_refused_by_name(tmp_path):
    with pytest.raises(SystemExit, match=r"--methods: 'ngram@x' is not METHOD, METHOD@K or METHOD=K"):
        main(["bench", "--small", "--device", "cpu", "--methods", "none,ngram@x",
              "--out", str(tmp_path)])


def test_steady_requests_spread_their_lengths_evenly_around_the_mean(tmp_path):
    """Steady runs' requests end at different steps, as real traffic does (with one length for
    all, plain decoding's batch ended in one step and its next prompts prefilled together,
    while speculation's, ending round by round, came in small prefill steps)."""
    lengths = steady_lengths(128, 128, 0.5)
    assert sorted(lengths) == [round(64 + 128 * i / 127) for i in range(128)]
    assert min(lengths) == 64 and max(lengths) == 192 and sum(lengths) == 128 * 128
    assert lengths != sorted(lengths)                      # shuffled...
    assert lengths == steady_lengths(128, 128, 0.5)        # ...alike for every method
    assert steady_lengths(8, 12, 0.0) == [12] * 8
    assert steady_lengths(1, 12, 0.5) == [12]
    with pytest.raises(SystemExit, match=r"--steady-spread: 1.0 is not in \[0, 1\)"):
        main(["bench", "--small", "--device", "cpu", "--steady-spread", "1", "--out", str(tmp_path)])


def test_arrivals_come_at_random_at_the_rate_asked_alike_for_every_method(tmp_path):
    times = arrival_times(4000, 50.0)
    assert times == arrival_times(4000, 50.0) and times == sorted(times) and times[0] > 0
    assert 0.95 * 4000 / 50 < times[-1] < 1.05 * 4000 / 50
    gaps = [b - a for a, b in zip([0.0] + times, times)]
    assert max(gaps) > 5 * min(gaps)   # exponential gaps, not a fixed beat
    with pytest.raises(SystemExit, match=r"--arrival-rate: -1.0 is below 0"):
        main(["bench", "--small", "--device", "cpu", "--arrival-rate", "-1",
              "--out", str(tmp_path)])


def test_a_negative_steady_waves_is_refused(tmp_path):
    with pytest.raises(SystemExit, match=r"--steady-waves: -1 is below 0"):
        main(["bench", "--small", "--device", "cpu", "--steady-waves", "-1",
              "--out", str(tmp_path)])


@pytest.mark.parametrize("rows", ["15", "257"])
def test_small_weight_rows_outside_16_to_256_are_refused(tmp_path, rows):
    with pytest.raises(SystemExit, match=rf"--small-weight-rows: {rows} is not in \[16, 256\]"):
        main(["bench", "--small", "--device", "cpu", "--small-weight-rows", rows,
              "--out", str(tmp_path)])
    assert kernels.SMALL_ROWS == 128   # refused before it was set


def test_the_commit_recorded_says_when_the_tree_is_not_heads(tmp_path, monkeypatch):
    """A run's JSON names the commit it measured: HEAD, marked dirty when tracked files differ
    from it (a copy of the tree beside a stale .git reported a commit it did not run); untracked
    files (scratch scripts) do not count; METRALE_COMMIT overrides; no git repository: None."""
    monkeypatch.delenv("METRALE_COMMIT", raising=False)
    assert git_commit(tmp_path) is None

    def git(*argv):
        return subprocess.run(["git", *argv], cwd=tmp_path, check=True, capture_output=True,
                              text=True).stdout.strip()
    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a")
    head = git("rev-parse", "HEAD")
    (tmp_path / "scratch.py").write_text("untracked\n")
    assert git_commit(tmp_path) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert git_commit(tmp_path) == head + "-dirty"
    monkeypatch.setenv("METRALE_COMMIT", "abc1234")
    assert git_commit(tmp_path) == "abc1234"

"""The batch job as users run it: `ray start --head`, then `ray job submit` of metrale.deploy.batch
on a JSONL file; results in input order, and a rerun resumes where the output stops."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import free_port, wait_for_200
from metrale.cluster.params import SamplingParams
from metrale.deploy.llm import LLM

pytestmark = pytest.mark.slow

RAY = str(Path(sys.executable).parent / "ray")
# The test cluster lives for a minute on this machine; token auth would need a token in ~/.ray.
ENV = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_AUTH_MODE": "disabled"}
LINES = [
    {"id": "greedy", "prompt": "def schedule(self, tokens):", "max_tokens": 12, "temperature": 0,
     "ignore_eos": True},
    {"prompt": "The café engine", "max_tokens": 9, "temperature": 0.8, "seed": 4, "top_k": 20},
    {"id": 7, "prompt": "x", "max_tokens": 0},
    {"id": "pair", "prompt": "# serves pages", "max_tokens": 6, "temperature": 1.0, "seed": 1,
     "n": 2, "ignore_eos": True},
] + [{"id": f"bulk-{i}", "prompt": f"The {i} engine reads", "max_tokens": 8 + i % 5,
      "temperature": 0, "ignore_eos": True} for i in range(10)]


@pytest.fixture(scope="module")
def head():
    """A head node of its own (own temp dir and ports), stopped through `ray start --block`."""
    temp = Path(tempfile.mkdtemp(prefix="mrl", dir="/tmp"))   # short: Ray's socket paths
    ports = {name: free_port() for name in (
        "port", "dashboard-port", "node-manager-port", "object-manager-port",
        "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
        "metrics-export-port", "ray-client-server-port")}
    log = (temp / "head.log").open("w")
    proc = subprocess.Popen(
        [RAY, "start", "--head", "--block", "--num-cpus=4", f"--temp-dir={temp}",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", "--disable-usage-stats",
         *[f"--{name}={port}" for name, port in ports.items()]],
        env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{ports['dashboard-port']}"
    wait_for_200(f"{address}/api/version", 120, proc, temp / "head.log")
    yield address
    proc.terminate()   # --block drains the node and stops every process it started
    proc.wait(timeout=60)
    log.close()
    shutil.rmtree(temp, ignore_errors=True)


def submit(address: str, workdir: Path, *args) -> str:
    r = subprocess.run([RAY, "job", "submit", "--address", address, "--working-dir", str(workdir),
                        "--", sys.executable, "-m", "metrale.deploy.batch", *args],
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_batch_job_writes_in_input_order_and_resumes(head, checkpoint, tmp_path):
    model_dir = checkpoint("qwen3_5")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(line) + "\n" for line in LINES) + "not json\n")
    args = ["--input", str(inp), "--output", str(out), "--model", str(model_dir),
            "--speculative-method", "ngram", "--num-drafts", "2", "--workers-per-replica", "2",
            "--no-adaptive-drafts"]   # a fixed k: seeded samples are compared below
    logs = submit(head, tmp_path, *args)
    assert "1 replica(s) of 2 worker(s) ready" in logs and "15/15 lines written" in logs
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in results] == ["greedy", 1, 7, "pair"] + \
        [f"bulk-{i}" for i in range(10)] + [14]
    assert "max_tokens" in results[2]["error"] and "not valid JSON" in results[14]["error"]

    llm = LLM(model_dir, device="cpu", speculative_method="ngram", num_drafts=2,
              adaptive_drafts=False)
    valid = [line for line in LINES if line["max_tokens"] > 0]
    expected = llm.generate([line["prompt"] for line in valid], [SamplingParams(**{
        k: v for k, v in line.items() if k not in ("id", "prompt")}) for line in valid])
    got = [r for r in results if "error" not in r]
    assert [r["text"] for r in got] == [e.text for e in expected]
    assert [r["usage"] for r in got] == [e.usage for e in expected]
    assert [c["text"] for c in got[2]["choices"]] == [c.text for c in expected[2].completions]
    assert all(set(r["spec"]) == {"rounds", "drafts_proposed", "drafts_accepted",
                                  "mean_acceptance_length"} for r in got)

    complete = out.read_text()
    kept = "".join(complete.splitlines(keepends=True)[:5])
    out.write_text(kept + '{"id": "cut sh')   # a run that died mid-line
    logs = submit(head, tmp_path, *args)
    assert "resuming: 5 of 15 lines are already in" in logs
    assert out.read_text() == complete

    again = subprocess.run([sys.executable, "-m", "metrale.deploy.batch", *args],
                           capture_output=True, text=True, timeout=60, env=ENV)
    assert again.returncode == 0 and "nothing to do: all 15 lines" in again.stderr

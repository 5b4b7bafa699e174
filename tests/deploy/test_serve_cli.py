"""`metrale serve` as users run it: a local Ray is started, the endpoint answers, and Ctrl-C
(SIGINT to the whole process group, as a terminal sends it) shuts everything down with status 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest
import yaml

from conftest import free_port, wait_for_200

pytestmark = pytest.mark.slow


def test_metrale_serve_starts_a_local_ray_serves_and_stops_on_ctrl_c(checkpoint, tmp_path):
    config = tmp_path / "metrale.yaml"
    config.write_text(yaml.safe_dump({"model": str(checkpoint("qwen3")), "device": "cpu",
                                      "speculative_method": "ngram", "port": 1,
                                      "cpus_per_worker": 0.5}))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # the model split over two worker actors (gloo on CPU)
    proc = subprocess.Popen([sys.executable, "-m", "metrale.deploy.cli", "serve", "--config",
                             str(config), "--port", str(port), "--num-drafts", "2",
                             "--tensor-parallel-size", "2"],
                            stdout=subprocess.PIPE, stderr=(tmp_path / "err").open("w"), text=True,
                            env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_200(f"{url}/health", 150, proc, tmp_path / "err")
        assert proc.stdout.readline().strip() == \
            f"metrale: serving '{checkpoint('qwen3').name}' at {url}/v1 (Ctrl-C to stop)"
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 5},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0, (tmp_path / "err").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "metrale: shutting down" in (tmp_path / "err").read_text()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=2)

"""`metrale serve` as users run it: a local Ray is started, the endpoint answers, and Ctrl-C
(SIGINT to the whole process group, as a terminal sends it) shuts everything down with status 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from conftest import free_port, wait_for_200

pytestmark = pytest.mark.slow


def metrale_serve(tmp_path, settings: dict, *flags: str) -> subprocess.Popen:
    """`metrale serve --config` with `settings` and `flags`, as a terminal starts it (its own
    process group, no RAY_ADDRESS, so it starts a local Ray); stderr goes to tmp_path/err."""
    config = tmp_path / "metrale.yaml"
    config.write_text(yaml.safe_dump(settings))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.Popen([sys.executable, "-m", "metrale.deploy.cli", "serve", "--config",
                             str(config), *flags],
                            stdout=subprocess.PIPE, stderr=(tmp_path / "err").open("w"), text=True,
                            env=env, start_new_session=True)


def test_metrale_serve_starts_a_local_ray_serves_and_stops_on_ctrl_c(checkpoint, tmp_path):
    port = free_port()
    # the model split over two worker actors (gloo on CPU)
    proc = metrale_serve(tmp_path, {"model": str(checkpoint("qwen3")), "device": "cpu",
                                    "speculative_method": "ngram", "port": 1,
                                    "cpus_per_worker": 0.5},
                         "--port", str(port), "--num-drafts", "2", "--tensor-parallel-size", "2")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_200(f"{url}/health", 150, proc, tmp_path / "err")
        assert proc.stdout.readline().strip() == \
            f"metrale: serving '{checkpoint('qwen3').name}' at {url}/v1 (Ctrl-C to stop)"
        # sampled (T=1): the random model draws EOS within 5 tokens in about 2% of requests
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 5,
                                                       "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0, (tmp_path / "err").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "metrale: shutting down" in (tmp_path / "err").read_text()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=2)


def test_direct_port_serves_the_same_endpoint_without_the_proxy(tmp_path):
    """`--direct-port`: the ingress replica answers there itself (Ray Serve's direct ingress, set
    up by `metrale serve` as it starts the local Ray): the same greedy text as through the proxy,
    SSE, OpenAI error bodies, and a client that disconnects frees its place."""
    port, direct = free_port(), free_port()
    # the bundled model: slow enough on a CPU that a long request outlives the checks below
    proc = metrale_serve(tmp_path, {"device": "cpu", "cpus_per_worker": 0.5,
                                    "max_pending_requests": 2},
                         "--port", str(port), "--direct-port", str(direct))
    proxied, url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{direct}"
    try:
        wait_for_200(f"{url}/health", 150, proc, tmp_path / "err")
        assert proc.stdout.readline().strip() == (
            f"metrale: serving 'target' at {proxied}/v1 and, without Serve's "
            f"proxy, at {url}/v1 (Ctrl-C to stop)")
        body = {"prompt": "hello there", "max_tokens": 6, "temperature": 0}
        texts = [httpx.post(f"{u}/v1/completions", json=body, timeout=60).json()["choices"][0]
                 ["text"] for u in (proxied, url)]
        assert texts[0] == texts[1] and texts[0]
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                          timeout=60) as r:
            events = [line for line in r.iter_lines() if line.startswith("data:")]
        assert events[-1] == "data: [DONE]" and len(events) >= 2
        bad = httpx.post(f"{url}/v1/completions", content='{"prompt": "x", ',
                         headers={"content-type": "application/json"})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"

        # 3000 tokens take a CPU worker over 20 s; a disconnect frees its place in a few
        long = {"prompt": "hello", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as c:
            streams = [c.send(c.build_request("POST", f"{url}/v1/completions", json=long),
                              stream=True) for _ in range(2)]
            lines = [s.iter_lines() for s in streams]   # (kept: a dropped one closes its stream)
            for s, stream_lines in zip(streams, lines):
                assert s.status_code == 200 and next(stream_lines).startswith("data:")
            assert c.post(f"{url}/v1/completions", json=body).status_code == 429
            for s in streams:
                s.close()
        deadline = time.time() + 8
        while (r := httpx.post(f"{url}/v1/completions", json=body, timeout=60)).status_code == 429:
            assert time.time() < deadline, "the disconnected streams still hold their places"
            time.sleep(0.2)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == texts[0]
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0, (tmp_path / "err").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)

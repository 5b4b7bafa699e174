"""The endpoint when things go wrong, over real HTTP on a local Ray cluster: a worker killed under a
streaming client, a flood far past capacity, a stalled replica, hostile and malformed input
(a schema-driven fuzz), API keys, and request logs without prompt text."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import ray
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ray import serve

from conftest import PROMPTS, free_port, wait_for_200
from metrale.cluster.params import SamplingParams
from metrale.deploy.config import MetraleConfig
from metrale.deploy.llm import LLM
from metrale.deploy.openai_api import ChatCompletionRequest, CompletionRequest
from metrale.deploy.serve import build_app

pytestmark = pytest.mark.slow

KEY = "sk-test-3f9a"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_PENDING = 8
TIMEOUT_S = 6.0


@pytest.fixture(scope="module")
def server(ray_cluster, checkpoint):
    model_dir = checkpoint("qwen3_5")
    port = free_port()
    config = MetraleConfig(model=str(model_dir), speculative_method="ngram", device="cpu",
                           block_size=4, max_num_seqs=8, workers_per_replica=2,
                           cpus_per_worker=0.5, max_pending_requests=MAX_PENDING,
                           request_timeout_s=TIMEOUT_S, max_request_bytes=64 << 10,
                           api_keys=[KEY], max_model_len=128, name="rel")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(config), name="metrale", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    wait_for_200(f"{url}/health", 180)
    llm = LLM(model_dir, device="cpu", block_size=4, speculative_method="ngram", num_drafts=3)
    llm.name = Path(model_dir).name
    yield url, llm
    serve.shutdown()


def scheduler():
    return ray.get_actor("metrale-scheduler-rel0", namespace="metrale")


def state() -> dict:
    return ray.get(scheduler().state.remote())


def idle() -> None:
    deadline = time.time() + 30
    while (s := state())["requests"] or any(lane["running"] for lane in s["lanes"]):
        assert time.time() < deadline, s
        time.sleep(0.1)


def test_a_streaming_client_gets_every_token_once_across_a_worker_kill(server):
    url, llm = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    prompt = PROMPTS[0]
    want = llm.generate([llm.encode(prompt)], SamplingParams(max_tokens=64, temperature=0,
                                                             ignore_eos=True))[0]
    chunks, finish = [], None
    stream = client.completions.create(model=llm.name, prompt=prompt, max_tokens=64,
                                       temperature=0, stream=True, logprobs=0,
                                       extra_body={"ignore_eos": True})
    for chunk in stream:
        choice = chunk.choices[0]
        if len(chunks) == 0 and choice.text:
            busy = [i for i, lane in enumerate(state()["lanes"]) if lane["running"]]
            pid = ray.get(scheduler().worker_pids.remote())[busy[0]]
            os.kill(pid, signal.SIGKILL)
        chunks.append(choice)
        finish = choice.finish_reason or finish
    text = "".join(c.text for c in chunks)
    tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    assert (text, finish) == (want.text, "length")
    assert len(tokens) == 64   # none repeated, none lost
    deadline = time.time() + 60
    while sum(lane["restarts"] for lane in state()["lanes"]) < 1:
        assert time.time() < deadline, state()
        time.sleep(0.2)
    idle()


def test_a_flood_is_refused_with_429_and_retry_after_and_memory_stays_bounded(server):
    url, _ = server
    body = {"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "stream": True}
    processes = [p for p in psutil.process_iter(["cmdline"])
                 if any(("SchedulerActor" in part or "OpenAIServer" in part)
                        for part in (p.info["cmdline"] or []))]
    before = sum(p.memory_info().rss for p in processes)
    peak_requests = []

    async def watch(done: asyncio.Event):
        while not done.is_set():
            peak_requests.append((await scheduler().state.remote())["requests"])
            await asyncio.sleep(0.05)

    async def one(c: httpx.AsyncClient):
        async with c.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH) as r:
            payload = (await r.aread()).decode()
            return r.status_code, r.headers.get("retry-after"), payload

    async def run():
        done = asyncio.Event()
        watcher = asyncio.create_task(watch(done))
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
        async with httpx.AsyncClient(timeout=120, limits=limits) as c:
            results = await asyncio.gather(*(one(c) for _ in range(300)))
        done.set()
        await watcher
        return results
    results = asyncio.run(run())
    statuses = [status for status, _, _ in results]
    others = [(status, payload[:300]) for status, _, payload in results if status not in (200, 429)]
    assert not others and statuses.count(200) >= MAX_PENDING, (others, statuses)
    refused = [(after, json.loads(payload)) for status, after, payload in results
               if status == 429]
    assert refused and all(after == "1" and e["error"]["type"] == "rate_limit_exceeded"
                           for after, e in refused)
    assert all(payload.endswith("data: [DONE]\n\n") for status, _, payload in results
               if status == 200)
    assert max(peak_requests) <= MAX_PENDING
    idle()
    after = state()
    assert after["requests"] == 0 and after["outboxes"] == 0
    assert sum(p.memory_info().rss for p in processes) - before < 200 << 20


def test_a_stalled_replica_times_requests_out_instead_of_hanging(server):
    url, _ = server
    pids = ray.get(scheduler().worker_pids.remote())
    body = {"prompt": PROMPTS[2], "max_tokens": 32, "temperature": 0}
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        began = time.time()
        plain = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60)
        with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True},
                          headers=AUTH, timeout=60) as r:
            events = [line for line in r.iter_lines() if line.startswith("data:")]
        waited = time.time() - began
    finally:
        for pid in pids:   # an idle worker silent for 10 s was restarted meanwhile
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    assert plain.status_code == 504 and plain.json()["error"]["type"] == "timeout"
    assert json.loads(events[-2][5:])["error"]["code"] == 504 and events[-1] == "data: [DONE]"
    assert waited < 3 * TIMEOUT_S + 5
    idle()
    ok = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_api_keys_are_required_on_v1_routes(server):
    url, _ = server
    body = {"prompt": "x", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(f"{url}/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.get(f"{url}/v1/models", headers=AUTH).status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200   # probes need no key
    assert httpx.post(f"{url}/v1/completions", json=body, headers=AUTH).status_code == 200


def test_oversized_non_json_and_invalid_utf8_bodies_get_4xx(server):
    url, _ = server
    post = lambda content, **headers: httpx.post(   # noqa: E731
        f"{url}/v1/completions", content=content, headers=AUTH | headers)
    huge = json.dumps({"prompt": "x" * (100 << 10)}).encode()
    r = post(huge, **{"Content-Type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    r = post(b"prompt=x", **{"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    r = post(b'{"prompt": "\xff\xfe"}', **{"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = post(json.dumps({"prompt": [2**40]}).encode())
    assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]
    r = post(json.dumps({"prompt": "x", "n": 10**6}).encode())
    assert r.status_code == 400 and "n must be" in r.json()["error"]["message"]


def test_request_logs_leave_out_prompt_text(server):
    url, _ = server
    secret = "zebra-quartz-9137"
    r = httpx.post(f"{url}/v1/completions", json={"prompt": secret, "max_tokens": 2},
                   headers=AUTH)
    assert r.status_code == 200
    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    deadline = time.time() + 20
    while True:
        text = "".join(p.read_text(errors="replace") for p in logs.rglob("*")
                       if p.is_file() and p.suffix in (".log", ".out", ".err"))
        if "/v1/completions -> 200" in text:
            break
        assert time.time() < deadline, "no request log line found"
        time.sleep(0.5)
    assert secret not in text


# -- fuzz: bodies drawn from the request schemas: well-typed ones (mostly valid, so generation
#    runs), ones whose fields may take any JSON value, and raw bytes ------------------------------

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                    | st.text(max_size=20), lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=8)
TYPED = {"max_tokens": st.integers(1, 6), "temperature": st.floats(0, 2),
         "top_p": st.floats(0.05, 1), "top_k": st.integers(-1, 50), "min_p": st.floats(0, 0.5),
         "n": st.integers(1, 3), "seed": st.integers(-2**63, 2**63 - 1),
         "stop": st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4),
                                                            max_size=3),
         "stop_token_ids": st.lists(st.integers(0, 300), max_size=3), "stream": st.booleans(),
         "ignore_eos": st.booleans(), "model": st.sampled_from([None, "nope"]),
         "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
         "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"},
                                             {"type": "regex", "regex": "[ab]{1,3}"}])}
ROUTES = {
    "/v1/completions": dict(TYPED, prompt=st.text(min_size=1, max_size=40)
                            | st.lists(st.integers(0, 300), min_size=1, max_size=6)
                            | st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=3),
                            logprobs=st.integers(0, 5)),
    "/v1/chat/completions": dict(TYPED, messages=st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]),
         "content": st.text(max_size=30)}), min_size=1, max_size=3),
        logprobs=st.booleans(), top_logprobs=st.integers(0, 5),
        max_completion_tokens=st.integers(1, 6))}
FIELDS = sorted(set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields))


@st.composite
def requests(draw):
    route = draw(st.sampled_from(sorted(ROUTES)))
    typed = ROUTES[route]
    kind = draw(st.sampled_from(["typed", "typed", "any", "raw"]))
    if kind == "raw":
        return route, b"\x00raw" + draw(st.binary(max_size=64))
    if kind == "typed":
        required = "prompt" if "prompt" in typed else "messages"
        body = draw(st.fixed_dictionaries(
            {required: typed[required]},
            optional={k: v for k, v in typed.items() if k != required}))
    else:
        body = draw(st.fixed_dictionaries({}, optional={
            name: typed[name] | JSON if name in typed else JSON for name in FIELDS}))
    return route, json.dumps(body).encode()


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(request=requests())
def test_fuzzed_requests_never_get_a_5xx(server, request):
    url, _ = server
    route, content = request
    with httpx.stream("POST", f"{url}{route}", content=content, timeout=60,
                      headers=AUTH | {"Content-Type": "application/json"}) as r:
        payload = r.read().decode()
    assert r.status_code < 500, (content, payload)
    if r.status_code >= 400:
        assert json.loads(payload)["error"]["message"]
    elif payload.startswith("data:"):
        assert payload.endswith("data: [DONE]\n\n"), payload[-200:]
    else:
        assert json.loads(payload)["choices"]

"""The Serve app on a real local Ray cluster, deployed from a Serve config file: two replicas of two
CPU workers each with a DFlash drafter, driven over real HTTP by the `openai` client and httpx
(structured output's `response_format` last, on the same app)."""

from __future__ import annotations

import asyncio
import importlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import ray
import yaml
from ray import serve
from ray.serve.schema import ServeDeploySchema

from conftest import PROMPTS, free_port, wait_for_200
from metrale.cluster.params import SamplingParams
from metrale.deploy.chat import ChatTemplate
from metrale.deploy.llm import LLM

pytestmark = pytest.mark.slow

MAX_PENDING = 20   # per replica: 40 requests in flight before 429


@pytest.fixture(scope="module")
def server(ray_cluster, checkpoint, dflash_drafter, tmp_path_factory):
    model_dir, drafter = checkpoint("qwen3_5"), dflash_drafter("qwen3_5")
    port = free_port()
    path = tmp_path_factory.mktemp("serve") / "serve.yaml"
    path.write_text(yaml.safe_dump({
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [{
            "name": "metrale", "route_prefix": "/", "import_path": "metrale.deploy.serve:build_app",
            "args": {"model": str(model_dir), "speculative_method": "dflash",
                     "drafter": str(drafter), "device": "cpu", "block_size": 4,
                     # a fixed k: seeded samples are compared with the in-process engine's
                     "adaptive_drafts": False,
                     "max_num_seqs": 16, "replicas": 2, "workers_per_replica": 2,
                     "cpus_per_worker": 0.5, "max_pending_requests": MAX_PENDING}}]}))
    schema = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    app = schema.applications[0]
    module, attr = app.import_path.split(":")
    serve.start(http_options={"host": "127.0.0.1", "port": schema.http_options.port})
    serve.run(getattr(importlib.import_module(module), attr)(app.args), name=app.name,
              route_prefix=app.route_prefix)
    url = f"http://127.0.0.1:{port}"
    wait_for_200(f"{url}/health", 180)
    llm = LLM(model_dir, device="cpu", block_size=4, speculative_method="dflash", drafter=drafter,
              adaptive_drafts=False)
    yield url, model_dir, drafter, llm
    serve.shutdown()


def schedulers() -> list:
    return [ray.get_actor(f"metrale-scheduler-serve{i}", namespace="metrale") for i in (0, 1)]


def lanes() -> list[dict]:
    return [lane for s in ray.get([s.state.remote() for s in schedulers()]) for lane in s["lanes"]]


def test_health_and_models(server):
    url, model_dir, _, llm = server
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    models = openai.OpenAI(base_url=f"{url}/v1", api_key="-").models.list().data
    assert [m.id for m in models] == [Path(model_dir).name]


def test_greedy_answers_equal_metrale_generate(server):
    url, model_dir, drafter, llm = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="-")
    name = Path(model_dir).name
    r = subprocess.run([sys.executable, "-m", "metrale.deploy.cli", "generate", "--model",
                        str(model_dir), "--prompt", PROMPTS[0], "--prompt", PROMPTS[1],
                        "--max-tokens", "12", "--ignore-eos", "--device", "cpu", "--json",
                        "--speculative-method", "dflash", "--drafter", str(drafter)],
                       capture_output=True, text=True, timeout=120)
    expected = [json.loads(line) for line in r.stdout.splitlines()]
    extra = {"ignore_eos": True}
    out = client.completions.create(model=name, prompt=PROMPTS[:2], max_tokens=12, temperature=0,
                                    extra_body=extra)
    assert [c.text for c in out.choices] == [e["text"] for e in expected]
    assert out.usage.completion_tokens == 24
    assert out.usage.prompt_tokens == sum(e["usage"]["prompt_tokens"] for e in expected)
    stream = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=12,
                                       temperature=0, stream=True, extra_body=extra,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected[0]["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    prompt = ChatTemplate(None).render(messages)
    assert prompt == "system: Be brief.\nuser: Hi!\nassistant:"
    want = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    chat = client.chat.completions.create(model=name, messages=messages, max_tokens=10,
                                          temperature=0, extra_body=extra)
    assert chat.choices[0].message.content == want[0].text
    assert chat.usage.prompt_tokens == len(want[0].prompt_token_ids)
    streamed = client.chat.completions.create(model=name, messages=messages, max_tokens=10,
                                              temperature=0, stream=True, extra_body=extra)
    deltas = [c.choices[0].delta for c in streamed]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == want[0].text


def test_concurrent_mixed_requests_all_complete(server):
    """36 requests at once: completions and chat, streamed and not, greedy and seeded sampling with
    top_p / top_k / min_p, stop strings, n=2, logprobs; each equals the in-process engine's."""
    url, model_dir, _, llm = server
    name = Path(model_dir).name
    chat = ChatTemplate(None)
    texts = [PROMPTS[i % 4] + f" {i}" for i in range(36)]
    prompts = [chat.render([{"role": "user", "content": t}]) if i % 2 else t
               for i, t in enumerate(texts)]
    greedy = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    kinds = [dict(temperature=0), dict(temperature=0.9, seed=1, top_p=0.9),
             dict(temperature=0.7, seed=2, top_k=12, min_p=0.02), dict(temperature=0),
             dict(temperature=1.0, seed=3, n=2), dict(temperature=0, logprobs=2)]
    requests = [dict(kinds[i % len(kinds)], max_tokens=8 + i % 3 * 6) for i in range(36)]
    for i in range(3, 36, 6):   # a stop string from the answer itself
        requests[i]["stop"] = [greedy[i].text[4:7]]
    expected = llm.generate(prompts, [SamplingParams(ignore_eos=True, **{
        k: tuple(v) if k == "stop" else v for k, v in kw.items() if k != "logprobs"})
        for kw in requests])

    async def one(client, i: int, kw: dict) -> list[str]:
        stream, n = i % 4 in (1, 2), kw.get("n", 1)
        extra = {"ignore_eos": True, **{k: kw.pop(k) for k in ("top_k", "min_p") if k in kw}}
        if i % 2:
            logprobs = kw.pop("logprobs", None)
            out = await client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": texts[i]}], stream=stream,
                extra_body=extra, logprobs=bool(logprobs), top_logprobs=logprobs, **kw)
        else:
            out = await client.completions.create(model=name, prompt=texts[i], stream=stream,
                                                  extra_body=extra, **kw)
        got = [""] * n
        if stream:
            async for chunk in out:
                for c in chunk.choices:
                    got[c.index] += (c.delta.content or "") if i % 2 else c.text
            return got
        assert out.usage.completion_tokens <= kw["max_tokens"] * n
        if i % 6 == 5:
            logprobs = out.choices[0].logprobs
            count = len(logprobs.content) if i % 2 else len(logprobs.tokens)
            assert count == out.usage.completion_tokens
        return [c.message.content if i % 2 else c.text for c in out.choices]

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
        return await asyncio.gather(*(one(client, i, dict(kw)) for i, kw in enumerate(requests)))
    before = [lane["steps"] for lane in lanes()]
    got = asyncio.run(run())
    assert got == [[c.text for c in e.completions] for e in expected]
    assert any(e.finish_reason == "stop" for e in expected)
    after = [lane["steps"] for lane in lanes()]
    assert all(a > b for a, b in zip(after, before))   # both replicas, all four workers
    assert all(lane["running"] == 0 and lane["waiting"] == 0 for lane in lanes())


def test_a_client_that_disconnects_frees_its_slot_and_blocks(server):
    url, *_ = server
    body = {"prompt": PROMPTS[2], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    before = sum(lane["steps"] for lane in lanes())
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        busy = [lane for lane in lanes() if lane["running"]]
        assert len(busy) == 1 and busy[0]["free_slots"] == busy[0]["num_slots"] - 1
    deadline = time.time() + 10
    while any(lane["running"] or lane["free_blocks"] != lane["num_blocks"]
              or lane["free_slots"] != lane["num_slots"] for lane in lanes()):
        assert time.time() < deadline, lanes()
        time.sleep(0.1)
    # 400 tokens take at least 100 steps (3 drafts per round); it was cut off long before
    assert sum(lane["steps"] for lane in lanes()) - before < 100


def test_bad_input_gets_clear_errors_and_the_server_keeps_serving(server):
    url, model_dir, *_ = server
    name = Path(model_dir).name

    def post(path, body, status, type_, words):
        r = httpx.post(f"{url}{path}", content=body if isinstance(body, str) else json.dumps(body))
        error = r.json()["error"]
        assert (r.status_code, error["type"], error["code"]) == (status, type_, status), r.text
        assert words in error["message"], error
    post("/v1/completions", '{"prompt": "x", ', 400, "invalid_request_error", "not valid JSON")
    post("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model_not_found", "gpt-4")
    post("/v1/completions", {"prompt": 5}, 400, "invalid_request_error", "prompt")
    post("/v1/completions", {"prompt": "x", "max_tokens": "3"}, 400, "invalid_request_error",
         "max_tokens")
    post("/v1/chat/completions", {"messages": "hi"}, 400, "invalid_request_error", "messages")
    post("/v1/completions", {"prompt": "x " * 600}, 400, "invalid_request_error", "max_model_len")
    post("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "invalid_request_error",
         "max_tokens")
    post("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "invalid_request_error",
         "temperature")
    ok = httpx.post(f"{url}/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 3,
                                                   "ignore_eos": True})   # sampled: EOS may come
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_over_capacity_answers_429(server):
    url, *_ = server
    body = {"prompt": PROMPTS[1], "max_tokens": 400, "ignore_eos": True, "stream": True}

    async def run():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as c:
            responses = await asyncio.gather(*(
                c.send(c.build_request("POST", f"{url}/v1/completions", json=body), stream=True)
                for _ in range(2 * MAX_PENDING + 4)))
            statuses = sorted(r.status_code for r in responses)
            refused = [json.loads(await r.aread()) for r in responses if r.status_code == 429]
            for r in responses:
                await r.aclose()
            return statuses, refused
    statuses, refused = asyncio.run(run())
    assert statuses == [200] * 2 * MAX_PENDING + [429] * 4
    assert refused[0]["error"]["type"] == "rate_limit_exceeded"
    deadline = time.time() + 10
    while any(lane["running"] for lane in lanes()):
        assert time.time() < deadline
        time.sleep(0.1)
    after = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert after.status_code == 200


def test_prometheus_metrics(server, ray_cluster):
    """Ray exports them on its metrics port, prefixed ray_; a counter appears once it counts."""
    accepted = sum(s["spec"]["drafts_accepted"]
                   for s in ray.get([s.state.remote() for s in schedulers()]))
    wanted = ["http_requests_total", "time_to_first_token_seconds",
              "time_per_output_token_seconds", "generated_tokens_total", "requests_running",
              "requests_waiting", "kv_cache_usage", "slot_usage", "drafts_proposed_total",
              "acceptance_length"] + (["drafts_accepted_total"] if accepted else [])
    deadline = time.time() + 30
    while True:   # Ray exports what was recorded about once a second
        lines = [line for line in httpx.get(f"http://127.0.0.1:{ray_cluster}/metrics")
                 .text.splitlines() if line.startswith("ray_metrale_")]
        missing = [m for m in wanted if not any(line.startswith(f"ray_metrale_{m}")
                                                for line in lines)]
        requests = [line for line in lines if line.startswith("ray_metrale_http_requests_total")]
        missing += [status for status in ("200", "400", "404", "429")
                    if not any('route="/v1/completions"' in line and f'status="{status}"' in line
                               for line in requests)]
        if not missing:
            break
        assert time.time() < deadline, missing
        time.sleep(1)


# `response_format` over HTTP, on the same app: JSON schemas, the regex extension, and 400 for a
# bad schema.
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "rank"],
          "properties": {"city": {"enum": ["Paris", "Lima", "Oslo"]},
                         "rank": {"type": "integer", "minimum": 1, "maximum": 9}}}


def test_response_format_over_http(server):
    url, model_dir, *_ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="-")
    name = Path(model_dir).name
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}
    for temperature in (0.0, 1.0):
        chat = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "A city?"}], max_tokens=40,
            temperature=temperature, seed=4, response_format=fmt)
        jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
    stream = client.completions.create(model=name, prompt="x", max_tokens=40, temperature=1.0,
                                       seed=5, stream=True, extra_body={"response_format": fmt})
    jsonschema.validate(json.loads("".join(c.choices[0].text for c in stream if c.choices)), SCHEMA)
    date = client.completions.create(
        model=name, prompt="Today:", max_tokens=20, temperature=1.0, seed=6,
        extra_body={"response_format": {"type": "regex", "regex": r"\d{4}-\d{2}-\d{2}"}})
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date.choices[0].text)


@pytest.mark.parametrize("fmt, words", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
     "invalid json schema"),
    ({"type": "regex"}, "needs a `regex` field"),
    ({"type": "yaml"}, "response_format"),
])
def test_a_bad_response_format_is_a_400(server, fmt, words):
    url, model_dir, *_ = server
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "response_format": fmt})
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]

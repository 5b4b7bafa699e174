"""The soak benchmark: many streaming requests through the HTTP endpoint while a worker is killed
(SIGKILL) every few seconds; it counts completed and failed requests, tokens duplicated or lost
against an undisturbed greedy run, and latency percentiles.

    python -m metrale.deploy.soak [--model DIR] [--requests 1000] [--concurrency 64]
                                  [--kill-every 30] [--workers 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import time
from dataclasses import asdict, dataclass, field

import httpx
import ray
from ray import serve

from metrale.cluster.actor import scheduler_name
from metrale.cluster.params import SamplingParams
from metrale.deploy.bundled import BUNDLED_MODEL
from metrale.deploy.config import MetraleConfig
from metrale.deploy.llm import LLM
from metrale.deploy.serve import APP_NAME, build_app, wait_healthy
from metrale.workers.actor import NAMESPACE

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main(", "class Stack:\n    def ",
           "    for i in range(len(", "try:\n    import json\nexcept ImportError:\n",
           "def __repr__(self):\n        return ", "# Copyright (c) ", "    if not isinstance(",
           "\"\"\"Utilities for ", "    def __init__(self, name, ", "with open(path) as f:\n",
           "raise ValueError(", "    @property\n    def ", "from collections import ",
           "    return self._", "if __name__ == '__main__':\n"]


@dataclass
class Outcome:
    status: int
    latency_s: float
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class Report:
    requests: int
    concurrency: int
    kill_every_s: float
    workers: int
    kills: int = 0
    completed: int = 0
    failed: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    duplicated_tokens: int = 0
    lost_tokens: int = 0
    wrong_texts: int = 0
    p50_latency_s: float = 0.0
    p99_latency_s: float = 0.0
    seconds: float = 0.0
    tokens_per_s: float = 0.0


async def one(http: httpx.AsyncClient, url: str, body: dict) -> Outcome:
    start = time.perf_counter()
    out = Outcome(0, 0.0)
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
            out.status = r.status_code
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}"
                await r.aread()
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        out.error = f"error event {event['error']['code']}"
                        break
                    for choice in event["choices"]:
                        out.text += choice["text"]
                        out.tokens += (choice.get("logprobs") or {}).get("tokens") or []
                        out.finish_reason = choice["finish_reason"] or out.finish_reason
    except httpx.HTTPError as e:
        out.error = type(e).__name__
    out.latency_s = time.perf_counter() - start
    return out


async def killer(every: float, replica: str, stop: asyncio.Event, report: Report) -> None:
    """SIGKILLs a random worker of the replica every `every` seconds."""
    scheduler = ray.get_actor(scheduler_name(replica), namespace=NAMESPACE)
    rng = random.Random(0)
    while True:
        try:
            await asyncio.wait_for(stop.wait(), every)
            return
        except TimeoutError:
            pass
        pids = await scheduler.worker_pids.remote()
        os.kill(rng.choice(pids), signal.SIGKILL)
        report.kills += 1
        print(f"  killed a worker ({report.kills} so far)", flush=True)


async def soak(url: str, model: str, args, report: Report) -> list[Outcome]:
    stop = asyncio.Event()
    kills = asyncio.create_task(killer(args.kill_every, f"{args.name}0", stop, report))
    window = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency)

    async def request(i: int, http: httpx.AsyncClient) -> Outcome:
        async with window:
            body = {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "stream": True,
                    "max_tokens": args.max_tokens, "temperature": 0, "logprobs": 0,
                    "ignore_eos": True}
            return await one(http, url, body)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        outcomes = await asyncio.gather(*(request(i, http) for i in range(args.requests)))
    stop.set()
    await kills
    return outcomes


def summarise(report: Report, outcomes: list[Outcome], expected, seconds: float) -> None:
    latencies = sorted(o.latency_s for o in outcomes if o.error is None)
    tokens = 0
    for i, o in enumerate(outcomes):
        if o.error is not None:
            report.failed += 1
            report.failures[o.error] = report.failures.get(o.error, 0) + 1
            continue
        report.completed += 1
        want_tokens, want_text = expected[PROMPTS[i % len(PROMPTS)]]
        report.duplicated_tokens += max(0, len(o.tokens) - len(want_tokens))
        report.lost_tokens += max(0, len(want_tokens) - len(o.tokens))
        report.wrong_texts += o.text != want_text
        tokens += len(o.tokens)
    if latencies:
        report.p50_latency_s = round(statistics.median(latencies), 3)
        report.p99_latency_s = round(latencies[min(len(latencies) - 1,
                                                   int(0.99 * len(latencies)))], 3)
    report.seconds = round(seconds, 1)
    report.tokens_per_s = round(tokens / seconds, 1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m metrale.deploy.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(BUNDLED_MODEL))
    p.add_argument("--speculative-method", default="mtp")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--kill-every", type=float, default=30.0, help="seconds between worker kills")
    p.add_argument("--workers", type=int, default=2, help="worker actors of the one replica")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", help="float32 (default) makes greedy text "
                   "independent of how requests happen to be batched, so any difference from "
                   "the reference is the failure handling's; in bf16 a near-tie can flip")
    p.add_argument("--port", type=int, default=8200)
    p.add_argument("--name", default="soak")
    p.add_argument("--json", default=None, help="also write the report here")
    args = p.parse_args(argv)

    # the undisturbed reference: greedy text per prompt, in process
    llm = LLM(args.model, device=args.device, dtype=args.dtype,
              speculative_method=args.speculative_method)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    expected = {prompt: (o.token_ids, o.text) for prompt, o in
                zip(PROMPTS, llm.generate(PROMPTS, params))}
    del llm

    config = MetraleConfig(model=args.model, speculative_method=args.speculative_method,
                           device=args.device, dtype=args.dtype,
                           workers_per_replica=args.workers,
                           cpus_per_worker=1, port=args.port, name=args.name,
                           max_pending_requests=max(256, args.concurrency))
    ray.init(namespace=NAMESPACE, log_to_driver=False, include_dashboard=False)
    serve.start(http_options={"host": config.host, "port": config.port})
    serve.run(build_app(config), name=APP_NAME, route_prefix="/", blocking=False)
    url = f"http://{config.host}:{config.port}"
    if error := wait_healthy(url):
        raise SystemExit(f"soak: {error}")
    report = Report(args.requests, args.concurrency, args.kill_every, args.workers)
    print(f"soak: {args.requests} requests at concurrency {args.concurrency}, a worker of "
          f"{args.workers} killed every {args.kill_every:.0f}s", flush=True)
    start = time.perf_counter()
    outcomes = asyncio.run(soak(url, config.model_name, args, report))
    summarise(report, outcomes, expected, time.perf_counter() - start)
    serve.shutdown()
    ray.shutdown()
    for key, value in asdict(report).items():
        print(f"{key:>18}: {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(report), f, indent=2)


if __name__ == "__main__":
    main()

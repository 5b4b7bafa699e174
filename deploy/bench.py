"""The serving-overhead benchmark: completion tokens/s through the HTTP endpoint against the
in-process engine on the same model, at each concurrency, and their ratio. HTTP is measured two
ways: through Serve's proxy (`port`) and straight to the ingress replica (`direct_port`, Ray
Serve's direct ingress), unless --direct-port 0.

The sides are measured in turn (in-process, proxy, direct, `--repeat` times), so a shared
machine's drift weighs on all alike; each ratio reported is the median of its turns' ratios."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import httpx
import ray
import torch
from ray import serve

from metrale.cluster.params import SamplingParams
from metrale.deploy.config import MetraleConfig
from metrale.deploy.llm import LLM
from metrale.deploy.serve import APP_NAME, build_app, direct_ingress_env, wait_healthy
from metrale.workers.actor import NAMESPACE

PROMPT_WORDS = ["alpha", "engine", "serves", "tokens", "before", "blocks", "are", "ready"]


def prompts(count: int, words: int) -> list[str]:
    """Distinct prompts of about `words` words, so no two requests share a cached prefix."""
    return [" ".join([str(i)] + [PROMPT_WORDS[(i + j) % len(PROMPT_WORDS)] for j in range(words)])
            for i in range(count)]


def in_process(llm: LLM, texts: list[str], concurrency: int, max_tokens: int) -> float:
    """Tokens/s with `concurrency` requests in the engine at a time (batches of that size)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(texts), concurrency):
        tokens += sum(o.usage["completion_tokens"]
                      for o in llm.generate(texts[i:i + concurrency], params))
    return tokens / (time.perf_counter() - start)


async def over_http(url: str, model: str, texts: list[str], concurrency: int, max_tokens: int,
                    stream: bool) -> float:
    """Tokens/s with `concurrency` clients, each sending its next request when one finishes."""
    pending = list(texts)
    tokens = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        while pending:
            body = {"model": model, "prompt": pending.pop(), "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": stream}
            if stream:
                async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        pass
                tokens += max_tokens   # ignore_eos: every request runs to max_tokens
            else:
                r = await http.post(f"{url}/v1/completions", json=body)
                tokens += r.json()["usage"]["completion_tokens"]
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        return tokens / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m metrale.deploy.bench", description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--rounds", type=int, default=4,
                   help="requests per client: a measurement at concurrency c sends rounds * c")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=24)
    p.add_argument("--port", type=int, default=8100, help="Serve's proxy")
    p.add_argument("--direct-port", type=int, default=8200,
                   help="the ingress replica's own port (direct ingress); 0: not measured")
    p.add_argument("--stream", action="store_true", help="stream the HTTP responses (SSE)")
    p.add_argument("--repeat", type=int, default=3,
                   help="turns (in-process, proxy, direct) per concurrency (a shared machine "
                        "is noisy)")
    p.add_argument("--steps-in-flight", type=int, default=None,
                   help="plans the serving worker holds at once (default: the config's, 2 on CPU)")
    p.add_argument("--no-plan-ahead", action="store_true",
                   help="plans in flight split the sequences instead of running them ahead")
    p.add_argument("--decode-steps", type=int, default=None,
                   help="decode steps a plan runs in a row, on both sides (the config's "
                        "decode_steps; default: its default)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where both sides run (cuda: the worker actor takes one GPU)")
    p.add_argument("--cpus", type=int, default=max(1, os.cpu_count() - 1),
                   help="torch threads of the worker in both runs (default: all cores but one, "
                        "which the serving processes need)")
    args = p.parse_args(argv)
    texts = {c: prompts(args.rounds * c, args.prompt_words) for c in args.concurrency}
    warmup = prompts(4, args.prompt_words)

    torch.set_num_threads(args.cpus)   # as many threads as the Ray worker gets
    llm = LLM(args.model, device=args.device, decode_steps=args.decode_steps)
    config = MetraleConfig(model=args.model, device=args.device, cpus_per_worker=args.cpus,
                           port=args.port, direct_port=args.direct_port or None,
                           steps_in_flight=args.steps_in_flight,
                           plan_ahead=not args.no_plan_ahead, decode_steps=args.decode_steps)
    if config.direct_port:   # inherited by the Ray processes ray.init starts
        os.environ.update(direct_ingress_env(config.direct_port))
    ray.init(namespace=NAMESPACE, num_cpus=max(args.cpus, os.cpu_count()), log_to_driver=False,
             include_dashboard=False)
    serve.start(http_options={"host": config.host, "port": config.port})
    serve.run(build_app(config), name=APP_NAME, route_prefix="/", blocking=False)
    urls = {"proxy": f"http://{config.host}:{config.port}"}
    if config.direct_port:
        urls["direct"] = f"http://{config.host}:{config.direct_port}"
    for url in urls.values():
        if error := wait_healthy(url, timeout_s=600):
            raise SystemExit(f"bench: {error}")
    in_process(llm, warmup, 4, 8)

    def http(url: str, texts: list[str], concurrency: int, max_tokens: int) -> float:
        return asyncio.run(over_http(url, config.model_name, texts, concurrency, max_tokens,
                                     args.stream))
    for url in urls.values():
        http(url, warmup, 4, 8)

    def turn(c: int, t: int) -> dict[str, float]:
        """In-process, then each HTTP way, their order swapped every other turn."""
        tok_s = {"local": in_process(llm, texts[c], c, args.max_tokens)}
        for way in (list(urls) if t % 2 == 0 else list(urls)[::-1]):
            tok_s[way] = http(urls[way], texts[c], c, args.max_tokens)
        return tok_s
    turns = {c: [turn(c, t) for t in range(args.repeat)] for c in args.concurrency}
    serve.shutdown()
    ray.shutdown()

    print(f"model {args.model} on {args.device}; {args.rounds} requests per client of "
          f"{args.max_tokens} tokens, greedy; HTTP "
          f"{'streaming' if args.stream else 'non-streaming'}; {args.cpus} torch "
          f"thread(s); steps in flight per worker: {args.steps_in_flight or 'default'}"
          f"{' (split, not ahead)' if args.no_plan_ahead else ''}; "
          f"decode steps a plan: {args.decode_steps or 'default'}; "
          f"{args.repeat} turns per concurrency")
    print(f"{'concurrency':>11} {'in-process tok/s':>17} {'HTTP via':>8} {'HTTP tok/s':>11} "
          f"{'ratio':>6}  turns' ratios")
    for c, runs in turns.items():
        local = statistics.median(r["local"] for r in runs)
        for way in urls:
            ratios = [r[way] / r["local"] for r in runs]
            tok_s = statistics.median(r[way] for r in runs)
            print(f"{c:>11} {local:>17.1f} {way:>8} {tok_s:>11.1f} "
                  f"{statistics.median(ratios):>6.3f}  " + " ".join(f"{r:.2f}" for r in ratios))

if __name__ == "__main__":
    main()

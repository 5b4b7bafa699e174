"""The batch job: a JSONL file of completion requests through every replica of the cluster,
written in input order and resumable; `ray job submit -- python -m metrale.deploy.batch ...`."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from pathlib import Path

import ray

from metrale.cluster.actor import start_replica, stop_replica
from metrale.cluster.client import ReplicaClient
from metrale.cluster.engine import Overloaded, Unavailable
from metrale.cluster.params import RequestError, SamplingParams
from metrale.deploy.config import ConfigError, MetraleConfig
from metrale.deploy.llm import load_tokenizer
from metrale.deploy.openai_api import CompletionRequest, ResponseBuilder, parse
from metrale.deploy.router import Router
from metrale.drafting.proposer import METHODS
from metrale.workers.actor import NAMESPACE
from metrale.workers.models import CheckpointError

log = logging.getLogger("metrale.batch")
PROGRESS_EVERY_S = 10.0
RETRIES = 8   # attempts per line while workers or replicas restart


def written_lines(path: Path) -> int:
    """Complete lines already in the output; a line cut short by a crash is dropped."""
    if not path.exists():
        return 0
    data = path.read_bytes()
    complete = data[:data.rfind(b"\n") + 1]
    if len(complete) < len(data):
        path.write_bytes(complete)
    return complete.count(b"\n")


class BatchRun:
    """Keeps every worker busy with a bounded window of requests; writes results in input order."""

    def __init__(self, clients: list[ReplicaClient], config: MetraleConfig, out, first: int,
                 total: int):
        self.clients, self.out, self.total = clients, out, total
        self.tokenizer = load_tokenizer(config.model_path)
        self.router = Router(len(clients), config.block_size)
        self.window = asyncio.Semaphore(
            2 * config.max_num_seqs * config.workers_per_replica * len(clients))
        self.results: dict[int, dict] = {}
        self.first = self.next_line = first
        self.started = self.last_report = time.perf_counter()
        self.model_name = config.model_name

    async def run(self, lines: list[tuple[int, str]]) -> None:
        tasks = set()
        for number, text in lines:   # a task per line only once the window has room for it
            await self.window.acquire()
            task = asyncio.create_task(self._line(number, text))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)

    async def _line(self, number: int, text: str) -> None:
        try:
            self.results[number] = await self._complete(number, text)
        finally:
            self.window.release()
        while self.next_line in self.results:   # flush the finished prefix, in input order
            self.out.write(json.dumps(self.results.pop(self.next_line), ensure_ascii=False) + "\n")
            self.next_line += 1
        self.out.flush()
        now = time.perf_counter()
        if now - self.last_report > PROGRESS_EVERY_S or self.next_line == self.total:
            self.last_report = now
            log.info("%d/%d lines written (%.1f lines/s)", self.next_line, self.total,
                     (self.next_line - self.first) / (now - self.started))

    async def _complete(self, number: int, text: str) -> dict:
        try:
            body = json.loads(text)
        except json.JSONDecodeError as e:
            return {"id": number, "error": f"line is not valid JSON ({e})"}
        record_id = body.get("id", number) if isinstance(body, dict) else number
        try:
            req = parse(CompletionRequest, text.encode())
            prompts = req.prompts(self.tokenizer)
            if len(prompts) != 1:
                raise RequestError("prompt: one prompt per line")
            params = req.sampling_params(16 if req.max_tokens is None else req.max_tokens,
                                         req.logprobs)
        except RequestError as e:
            return {"id": record_id, "error": str(e)}
        for attempt in range(RETRIES):
            try:
                return await self._attempt(number, record_id, prompts[0], params, attempt)
            except (Overloaded, Unavailable, Retry) as e:   # a worker or replica restarts
                log.warning("line %d: %s; retrying (attempt %d of %d)", number, e, attempt + 2,
                            RETRIES)
                await asyncio.sleep(min(2 ** attempt, 30))
            except RequestError as e:
                return {"id": record_id, "error": str(e)}
        return {"id": record_id, "error": f"gave up after {RETRIES} attempts"}

    async def _attempt(self, number: int, record_id, prompt: list[int], params: SamplingParams,
                       attempt: int) -> dict:
        queues = [c.in_flight for c in self.clients]
        client = self.clients[self.router.choose(prompt, queues)]
        stream = await client.submit(f"batch-{number}-{attempt}", prompt, params, whole=True)
        builder = ResponseBuilder(False, self.model_name, self.tokenizer, params.n,
                                  len(prompt), False)
        async for delta in stream:
            if delta.error_type == "unavailable":
                raise Retry(delta.error)
            if delta.error:
                return {"id": record_id, "error": delta.error}
            builder.add(delta.index, delta)
        first = builder.choices[0]
        result = {"id": record_id, "text": first.text, "finish_reason": first.finish_reason,
                  "usage": builder.usage, "spec": builder.speculation}
        if params.n > 1:
            result["choices"] = [{"text": c.text, "finish_reason": c.finish_reason}
                                 for c in builder.choices]
        return result


class Retry(Exception):
    """A line's request ended because its replica failed; it is sent again."""


async def run_batch(config: MetraleConfig, lines: list[tuple[int, str]], out, first: int,
                    total: int) -> None:
    spec = config.replica_spec(ray.cluster_resources().get("GPU", 0))
    replicas = await asyncio.gather(*(start_replica(spec, i) for i in range(config.replicas)))
    log.info("%d replica(s) of %d worker(s) ready", len(replicas), config.workers_per_replica)
    try:
        await BatchRun([ReplicaClient(r) for r in replicas], config, out, first, total).run(lines)
    finally:
        for replica in replicas:
            stop_replica(replica)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m metrale.deploy.batch", description=__doc__)
    p.add_argument("--input", required=True, help="JSONL: one completion request per line")
    p.add_argument("--output", required=True, help="JSONL results, in input order (resumed)")
    p.add_argument("--config", default=None, help="YAML file of MetraleConfig settings")
    p.add_argument("--model", default=None)
    p.add_argument("--speculative-method", default=None, choices=list(METHODS))
    p.add_argument("--num-drafts", type=int, default=None, help="most drafts per round")
    p.add_argument("--adaptive-drafts", action=argparse.BooleanOptionalAction, default=None,
                   help="measured best drafts per round, up to --num-drafts (default); "
                        "--no-adaptive-drafts: always --num-drafts")
    p.add_argument("--drafter", default=None)
    p.add_argument("--replicas", type=int, default=None)
    p.add_argument("--workers-per-replica", type=int, default=None)
    p.add_argument("--tensor-parallel-size", type=int, default=None)
    p.add_argument("--attention-backend", default=None, choices=["auto", "torch", "triton"],
                   help="GPU kernels: auto (Triton on CUDA) or torch")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay decode/verify steps as CUDA graphs (default on a GPU)")
    p.add_argument("--name", default="batch", help="label of the job's actors (default: batch)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        config = MetraleConfig.load(
            args.config, model=args.model, speculative_method=args.speculative_method,
            num_drafts=args.num_drafts, adaptive_drafts=args.adaptive_drafts,
            drafter=args.drafter, replicas=args.replicas,
            workers_per_replica=args.workers_per_replica,
            tensor_parallel_size=args.tensor_parallel_size, name=args.name,
            attention_backend=args.attention_backend, cuda_graphs=args.cuda_graphs)
        load_tokenizer(config.model_path)
        lines = Path(args.input).read_text().splitlines()
    except (ConfigError, CheckpointError, OSError) as e:
        print(f"metrale batch: {e}", file=sys.stderr)
        return 2
    out_path = Path(args.output)
    done = written_lines(out_path)
    if done:
        log.info("resuming: %d of %d lines are already in %s; skipping them", done, len(lines),
                 out_path)
    pending = [(i, text) for i, text in enumerate(lines) if i >= done]
    if not pending:
        log.info("nothing to do: all %d lines are in %s", len(lines), out_path)
        return 0
    ray.init(namespace=NAMESPACE)
    with out_path.open("a") as out:
        asyncio.run(run_batch(config, pending, out, done, len(lines)))
    log.info("done: %d lines in %s", len(lines), out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

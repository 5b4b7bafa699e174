"""Tensor and data parallelism on GPUs: TP=N against TP=1 (greedy agreement, prefill logits,
decode step time) and R replicas against one (throughput), on a random-weight model it writes
itself (Qwen3-8B-shaped by default, bfloat16).

Ranks are processes joined by torch.distributed (NCCL) running the same Worker and TensorParallel
as the Ray actors do; rank 0 drives a Scheduler and hands each plan to the other ranks, as the
actor executor does. Replicas are independent processes, one GPU each. No Ray is needed.

    python -m metrale.deploy.tpbench --dir /tmp/qwen3-8b-random --tp 2 --replicas 2
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from metrale.cluster.params import SamplingParams
from metrale.cluster.scheduler import Scheduler, SchedulerConfig
from metrale.deploy.random_checkpoint import (QWEN3_8B, QWEN3_SMALL, random_prompts,
                                              write_random_checkpoint)
from metrale.workers.batch import ForwardBatch
from metrale.workers.models.loader import load_tokenizer
from metrale.workers.parallel import join_group
from metrale.workers.worker import Worker, WorkerConfig

GREEDY_TOKENS = 64


class RankZero:
    """Rank 0 of a tensor-parallel worker: hands each plan to the other ranks, then runs it."""

    def __init__(self, worker: Worker):
        self.worker, self.capacity = worker, worker.capacity

    def execute(self, plan):
        return self.worker.execute(self.worker.tp.agree(plan))

    def stop(self) -> None:
        self.worker.tp.agree(None)


def follow(worker: Worker) -> None:
    """Ranks 1..N-1: run what rank 0 hands over until it hands over None."""
    while (plan := worker.tp.agree(None)) is not None:
        worker.execute(plan)


def prefill_logits(worker: Worker, ids: list[int]) -> torch.Tensor:
    """Float32 logits of the last prompt row (a cache-less forward; every rank calls it)."""
    bs = worker.config.block_size
    batch = ForwardBatch.build([(ids, 0, [0] * (-(-len(ids) // bs)), -1)], bs, worker.device)
    hidden, _ = worker.model(batch, None, None)
    return worker.model.logits(hidden[-1:])[0].cpu()


def drive(executor, model_dir: str, requests: list[list[int]], batch: int, new_tokens: int) -> dict:
    """Greedy completions of `requests`, `batch` at a time: their tokens, the median time of a
    step that decodes a full batch, and tokens/s over the whole run."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=8192),
                      executor.capacity, load_tokenizer(model_dir))
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for i, ids in enumerate(requests):
        sched.add_request(f"r{i}", ids, params)
    decode_steps, start = [], time.perf_counter()
    while sched.has_work:
        plan = sched.schedule()
        t = time.perf_counter()
        result = executor.execute(plan)
        if len(plan.work) == batch and all(len(w.tokens) == 1 for w in plan.work):
            decode_steps.append(time.perf_counter() - t)
        sched.update(plan, result)
    wall = time.perf_counter() - start
    outputs = [sched.pop_finished(f"r{i}")[0].output_ids for i in range(len(requests))]
    return {"outputs": outputs, "step_ms": 1000 * statistics.median(decode_steps),
            "wall_s": wall, "tokens_per_s": len(requests) * new_tokens / wall}


def device_of(args, rank: int) -> str:
    if args.device == "cpu":
        return "cpu"
    return "cuda" if args.one_gpu_per_rank else f"cuda:{rank}"


def worker_config(args, rank: int, size: int) -> WorkerConfig:
    return WorkerConfig(args.dir, device_of(args, rank), args.dtype,
                        kv_cache_bytes=args.kv_cache_gb << 30, max_num_seqs=max(args.batch),
                        tensor_parallel_size=size)


def measure(executor, worker: Worker, args, requests) -> dict:
    """Prefill logits of the first prompt, then a warm-up and a timed run per batch size."""
    out = {"logits": prefill_logits(worker, requests[0])}
    drive(executor, args.dir, requests[:2], 2, 4)
    for b in args.batch:
        out[b] = drive(executor, args.dir, requests[:b], b, args.new_tokens)
    return out


def tp_rank(rank: int, size: int, address: str, args, requests, results) -> None:
    if args.one_gpu_per_rank:   # before CUDA starts in this process
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    torch.set_num_threads(args.threads)
    tp = join_group(rank, size, address, torch.device(device_of(args, rank)))
    worker = Worker(worker_config(args, rank, size), tp)
    if rank:
        prefill_logits(worker, requests[0])
        follow(worker)
    else:
        zero = RankZero(worker)
        results.put(measure(zero, worker, args, requests))
        zero.stop()
    dist.destroy_process_group()


def replica(index: int, args, requests, ready, go, results) -> None:
    """One data-parallel replica on GPU `index`: its share of the requests, timed from `go`."""
    if args.one_gpu_per_rank:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(index)
    torch.set_num_threads(args.threads)
    worker = Worker(worker_config(args, index, 1))
    drive(worker, args.dir, requests[:2], 2, 4)
    ready.put(index)
    go.wait()
    results.put(drive(worker, args.dir, requests, max(args.batch), args.new_tokens))


def empty_cache(args) -> None:
    if args.device == "cuda":
        torch.cuda.empty_cache()


def note(what: str, since: float) -> None:
    print(f"[{time.perf_counter() - since:7.1f}s] {what}", file=sys.stderr, flush=True)


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def run_tp(args, requests) -> dict:
    ctx = mp.get_context("spawn")
    results, address = ctx.Queue(), free_address()
    procs = [ctx.Process(target=tp_rank, args=(r, args.tp, address, args, requests, results))
             for r in range(args.tp)]
    for p in procs:
        p.start()
    out = results.get(timeout=args.timeout)
    for p in procs:
        p.join(timeout=60)
    return out


def run_replicas(args, requests) -> dict:
    """`args.replicas` replicas, each given an equal share of `requests`; total tokens/s."""
    ctx = mp.get_context("spawn")
    ready, go, results = ctx.Queue(), ctx.Event(), ctx.Queue()
    share = len(requests) // args.replicas
    procs = [ctx.Process(target=replica, args=(i, args, requests[i * share:(i + 1) * share],
                                               ready, go, results))
             for i in range(args.replicas)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=args.timeout)
    start = time.perf_counter()
    go.set()
    runs = [results.get(timeout=args.timeout) for _ in procs]
    wall = time.perf_counter() - start
    for p in procs:
        p.join(timeout=60)
    return {"tokens_per_s": share * args.replicas * args.new_tokens / wall, "wall_s": wall,
            "per_replica_tokens_per_s": [r["tokens_per_s"] for r in runs]}


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Sequences that match token for token, and where the others first differ."""
    firsts = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), None) for p, q in zip(a, b)]
    return {"identical": sum(f is None for f in firsts), "of": len(a),
            "first_difference": [f for f in firsts if f is not None]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m metrale.deploy.tpbench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="where the random checkpoint is (or is written)")
    p.add_argument("--layers", type=int, default=None, help="default: the shape's (36)")
    p.add_argument("--small", action="store_true", help="a small shape (to check on CPU)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cuda: rank or replica i on GPU i (NCCL); cpu: gloo")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process on CPU")
    p.add_argument("--one-gpu-per-rank", action="store_true",
                   help="each rank sees only its own GPU, as device `cuda` (as Ray actors do)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="the workers' dtype (the checkpoint is bfloat16)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--replicas", type=int, default=2, help="replicas to compare with one (1: skip)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16],
                   help="sequences decoded together (a timed run per value)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=GREEDY_TOKENS)
    p.add_argument("--kv-cache-gb", type=int, default=8)
    p.add_argument("--timeout", type=float, default=400)
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = dict(QWEN3_SMALL if args.small else QWEN3_8B)
    shape["num_hidden_layers"] = args.layers or shape["num_hidden_layers"]
    t0 = time.perf_counter()
    write_random_checkpoint(Path(args.dir), shape, args.device)
    written = time.perf_counter() - t0
    note("checkpoint written", t0)
    requests = random_prompts(max(max(args.batch), 2) * args.replicas, args.prompt_len,
                              shape["vocab_size"])

    dp_requests = requests[:max(args.batch) * args.replicas]
    worker = Worker(worker_config(args, 0, 1))
    single = measure(worker, worker, args, requests)
    one_replica = drive(worker, args.dir, dp_requests, max(args.batch), args.new_tokens)
    note("TP=1 measured", t0)
    del worker
    empty_cache(args)
    split = run_tp(args, requests)
    note(f"TP={args.tp} measured", t0)
    many = run_replicas(args, dp_requests) if args.replicas > 1 else None
    note(f"{args.replicas} replicas measured", t0)

    diff = (single["logits"] - split["logits"]).abs().max().item()
    report = {
        "model": {**shape, "dtype": args.dtype, "weights": "random N(0, 0.02), stored in bfloat16"},
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "checkpoint_written_s": round(written, 1),
        "prefill_logits": {"max_abs_diff": diff,
                           "argmax_equal": int(single["logits"].argmax()) ==
                           int(split["logits"].argmax())},
        "tp": {b: {"tp1_step_ms": round(single[b]["step_ms"], 2),
                   f"tp{args.tp}_step_ms": round(split[b]["step_ms"], 2),
                   "greedy": agreement(single[b]["outputs"], split[b]["outputs"])}
               for b in args.batch},
        "replicas": many and {
            "requests": len(dp_requests), "batch": max(args.batch),
            "one_tokens_per_s": round(one_replica["tokens_per_s"], 1),
            f"{args.replicas}_tokens_per_s": round(many["tokens_per_s"], 1),
            "per_replica_tokens_per_s": [round(x, 1) for x in many["per_replica_tokens_per_s"]]},
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()

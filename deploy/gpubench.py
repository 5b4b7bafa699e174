"""`metrale bench`: decode speed of metrale against its targets on one device: tokens/s and ms per
step at each batch size, plain and with each proposer; the cost of a verify of k drafts against one
decode step; the bandwidth floor (weight bytes / copy bandwidth measured in the same run); and
transformers' `generate` on the same weights. Writes bench.json and bench.png, prints the targets.

    python -m metrale.deploy.gpubench --out /tmp/bench                  # the full run
    python -m metrale.deploy.gpubench --small --device cpu --out /tmp/b  # tiny shapes, to check it

Random-weight models (qwen3-8b, qwen3.5-2b: real shapes, written on first use) accept random drafts,
so on them only plain decoding, forward costs, the floor and transformers are measured; proposers
are measured on the bundled model with its trained MTP head and DFlash drafter (and n-gram).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from metrale.cluster.params import SamplingParams
from metrale.deploy.bundled import BUNDLED_DFLASH, BUNDLED_MODEL
from metrale.deploy.evaluate import heldout_texts
from metrale.deploy.llm import LLM
from metrale.deploy.random_checkpoint import (QWEN3_5_2B, QWEN3_5_SMALL, QWEN3_8B, QWEN3_SMALL,
                                              random_prompts, write_random_checkpoint)
from metrale.drafting.ngram import lookup_rounds
from metrale.drafting.stats import SpecStats
from metrale.workers.models import kernels
from metrale.workers.models.config import DTYPES, ModelConfig
from metrale.workers.ssm_pool import SSMSlotPool

SHAPES = {"qwen3-8b": QWEN3_8B, "qwen3.5-2b": QWEN3_5_2B}
SMALL_SHAPES = {"qwen3-8b": QWEN3_SMALL, "qwen3.5-2b": QWEN3_5_SMALL}
MAX_VERIFY = 15                     # the deepest verify timed (rows = k + 1)
# ngram, ngram@7 (at most 7 drafts), ngram=3 (always 3); a /gG tail: prefill_gather G (mtp/g4);
# a /cN tail: chain_rounds N (mtp/c8, dflash/c8: rounds chained on the device; ngram/c0: not;
# none/c8: plain greedy decode steps chained); a /a0 tail: nothing planned ahead (ngram@7/a0)
METHOD = re.compile(r"(\w+)(?:([@=])(\d+))?(?:/g(\d+(?:\.\d+)?))?(?:/c(\d+))?(/a0)?")


def method_options(spec: str) -> dict:
    """The LLM arguments a --methods entry names."""
    method, how, k, gather, chain, serial = METHOD.fullmatch(spec).groups()
    return {"speculative_method": method, "num_drafts": int(k) if k else None,
            "adaptive_drafts": how != "=", "prefill_gather": float(gather) if gather else 1.0,
            "chain_rounds": int(chain) if chain else None, "plan_ahead": not serial}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default="bundled,qwen3-8b,qwen3.5-2b",
                   help="comma-separated: bundled, qwen3-8b, qwen3.5-2b (random weights, real "
                        "shapes) or a checkpoint directory")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    p.add_argument("--methods", default="none,mtp,dflash,ngram",
                   help="proposers timed on the bundled model or a given directory ('none': "
                        "plain, its greedy steps chained on a graph worker; 'none/c0': one "
                        "step a plan; 'ngram@7': at most 7 drafts a round instead of the default; "
                        "'ngram=3': exactly 3 every round, no adaptive draft length; a '/g4' "
                        "tail: prefill_gather=4, as 'mtp/g4'; a '/c8' tail: chain_rounds=8, "
                        "as 'mtp/c8', 'dflash/c8' or 'mtp/g4/c8'; an '/a0' tail: no plan "
                        "made before the last one's result, as 'ngram@7/a0' or 'none/a0')")
    p.add_argument("--drafter", default=None, help="DFlash drafter of a given model directory")
    p.add_argument("--verify-ks", default="1,3,7,15", help="drafts per verify timed at batch 1")
    p.add_argument("--new-tokens", type=int, default=None, help="default 128 (--small: 16)")
    p.add_argument("--prompt-len", type=int, default=None,
                   help="prompt tokens (default 512, bundled model 256; --small: 32)")
    p.add_argument("--steady-waves", type=int, default=4,
                   help="also run this many batches' worth of requests through at most B "
                        "sequences at a time, as under steady serving load (0: not)")
    p.add_argument("--steady-spread", type=float, default=0.5,
                   help="steady runs: each request's max_tokens spread evenly over new tokens x "
                        "(1 +- this), the same for every method, so sequences finish at different "
                        "steps as in real traffic (0: all alike)")
    p.add_argument("--arrival-rate", type=float, default=0.0,
                   help="also run the steady runs' requests arriving at random (Poisson) at this "
                        "many per second per seat (x B), and time each one's first token from "
                        "its arrival (0: not)")
    p.add_argument("--iters", type=int, default=20,
                   help="timed forwards per forward-cost figure in each of its FORWARD_TURNS turns")
    p.add_argument("--repeat", type=int, default=3,
                   help="engine runs per method and batch size, taken in turns (the median counts)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--attention-backend", default=None, choices=["auto", "torch", "triton"],
                   help="worker option (default: the worker's)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="worker option cuda_graphs=False")
    p.add_argument("--no-few-rows", action="store_true",
                   help="a verify's projections through F.linear, not kernels.few_rows (A/B)")
    p.add_argument("--small-weight-rows", type=int, default=None,
                   help="most rows kernels.few_rows takes of a small weight (kernels.SMALL_ROWS; "
                        "above 16 in tiles of kernels.TILE_ROWS; 16 to 256, default 128; "
                        "16: cuBLAS above 16 rows, as before 2026-12-07; A/B)")
    p.add_argument("--no-chain-kernels", action="store_true",
                   help="a chained round's n-gram lookup and bookkeeping as tensor ops, not "
                        "kernels.ngram_lookup / round_inputs / round_advance (A/B)")
    p.add_argument("--ckpt-dir", default="/tmp/metrale-bench",
                   help="where random checkpoints are written (kept and reused)")
    p.add_argument("--skip-hf", action="store_true", help="no transformers generate")
    p.add_argument("--hf-batch-sizes", default="1")
    p.add_argument("--skip-forward", action="store_true", help="no forward costs (time_forward)")
    p.add_argument("--skip-engine", action="store_true", help="no engine tokens/s runs")
    p.add_argument("--small", action="store_true",
                   help="tiny shapes and counts (CPU check; the targets mean nothing then)")
    p.add_argument("--merge", nargs="*", default=[],
                   help="earlier bench.json files whose models this report includes too (to split "
                        "the run over several calls)")
    p.add_argument("--out", required=True, help="folder for bench.json and bench.png")


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int, iters: int = 10) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written (median). On a
    GPU the copy is timed by CUDA events around it: the host's clock around a synchronize would
    add the host's latency to the copy's time and make the floor generous by a percent or two."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    times = []
    for _ in range(iters + 3):
        sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
    del src, dst
    return 2 * nbytes / statistics.median(times[3:])


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter once, except the embedding table,
    of which a step reads only its rows (unless it is also the lm_head)."""
    embed = model.model.embed_tokens.weight
    tied = model.lm_head.weight.data_ptr() == embed.data_ptr()
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen or (p is embed and not tied):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def kv_bytes_needed(model_dir: str, dtype: str, sequences: int, tokens: int) -> int:
    """A KV budget for `sequences` of `tokens` tokens each (with room for blocks and drafters)."""
    cfg = ModelConfig.from_dir(model_dir, dtype)
    per_token = (2 * len(cfg.full_attention_layers) * cfg.num_key_value_heads * cfg.head_dim
                 * cfg.dtype.itemsize)
    return max(int(per_token * sequences * (tokens + 32) * 1.5), 32 << 20)


def verify_pool_bytes(model_dir: str, dtype: str, slots: int) -> int | None:
    """A verify-pool budget that gives `slots` slots the depth of a MAX_VERIFY-draft verify."""
    cfg = ModelConfig.from_dir(model_dir, dtype)
    if not cfg.is_hybrid:
        return None
    per_entry = SSMSlotPool.bytes_per_entry(
        len(cfg.linear_attention_layers), cfg.linear_conv_dim, cfg.linear_conv_kernel_dim,
        cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.dtype)
    return per_entry * slots * (MAX_VERIFY + 1)


@contextlib.contextmanager
def at_most(llm: LLM, batch: int):
    """The scheduler runs at most `batch` sequences at once (its max_num_seqs) meanwhile."""
    config = llm.scheduler.config
    llm.scheduler.config = replace(config, max_num_seqs=batch)
    try:
        yield
    finally:
        llm.scheduler.config = config


def greedy(max_tokens: int) -> SamplingParams:
    """What every timed run asks of a request: exactly `max_tokens` greedy tokens."""
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def decode_run(llm: LLM, prompts: list[list[int]], new_tokens: int) -> dict:
    """Greedy decoding of `prompts` together: the decode phase (after every sequence has its first
    token) is timed; tokens/s counts the tokens it emitted, ms per step is its wall / its steps.
    With speculation sequences finish at different rounds, and the last ones run in a smaller
    batch; `full_batch_tokens_per_s` counts only the steps until the first sequence finished, and
    `full_batch_s` and `full_batch_steps` say how much of the run they were (the rest is the
    tail, which plain decoding, finishing every sequence at one step, does not have). The run
    ends when the last sequence's last token is on the host: a chain launched ahead of it that
    its last rounds made needless is read before the next run's prefill (`LLM.step`).
    `timeline` has, after each step, the milliseconds since the start and the sequences running."""
    sched = llm.scheduler
    ids = [llm.add_request(p, greedy(new_tokens), streamed=False) for p in prompts]   # read at the end
    while sched.waiting or any(not s.output_ids for s in sched.running):
        llm.step()
    before = sum(len(s.output_ids) for s in sched.running)
    sched.stats = SpecStats()
    full = None   # (tokens, seconds, steps) when the batch first shrank
    timeline = []   # (ms since the start, sequences running) after each step
    steps, start = 0, time.perf_counter()
    while llm.has_work:
        llm.step()
        steps += 1
        now = time.perf_counter()
        timeline.append((round(1000 * (now - start), 3), len(sched.running)))
        if full is None and len(sched.running) < len(prompts):
            emitted = sum(len(s.output_ids) for i in ids for s in sched.by_request[i]) - before
            full = (emitted, now - start, steps)
    wall = time.perf_counter() - start
    seqs = [s for i in ids for s in sched.pop_finished(i)]
    total = sum(len(s.output_ids) for s in seqs)
    stats = sched.stats
    return {"tokens_per_s": (total - before) / wall if wall else 0.0,
            "full_batch_tokens_per_s": full[0] / full[1] if full and full[1] else None,
            "full_batch_tokens": full[0] if full else None,
            "full_batch_s": full[1] if full else None,
            "full_batch_steps": full[2] if full else None,
            "ms_per_step": 1000 * wall / max(steps, 1), "steps": steps,
            "tokens": total - before, "wall_s": wall,
            # a round (or step) emits its accepted drafts and one token; the first came from
            # the prefill: the slowest sequence's count is the run's critical path
            "sequence_rounds": sorted(len(s.output_ids) - 1 - s.spec.drafts_accepted
                                      for s in seqs),
            # the same at the method's most drafts had every round accepted what the n-gram
            # lookup's drafts match of the sequence's own text: the rounds its text asks for
            "sequence_rounds_lookup": lookup_rounds_of(llm, seqs),
            "timeline": timeline,
            "acceptance": (stats.drafts_accepted / stats.drafts_proposed
                           if stats.drafts_proposed else None),
            "mean_acceptance_length": stats.mean_acceptance_length if stats.rounds else None,
            "spec": stats.as_dict(), "draft_policy": sched.drafts.as_dict()}


def lookup_rounds_of(llm: LLM, seqs: list) -> list[int] | None:
    """`sequence_rounds_lookup` of an n-gram engine's finished sequences (None for others)."""
    proposer, k = llm.worker.proposer, llm.scheduler.num_drafts
    if proposer is None or proposer.method != "ngram":
        return None
    return sorted(lookup_rounds(s.prompt_ids, s.output_ids, k, proposer.min_n, proposer.max_n)
                  for s in seqs)


def steady_lengths(count: int, new_tokens: int, spread: float) -> list[int]:
    """max_tokens of a steady run's `count` requests: evenly spaced over new_tokens x (1 +-
    spread), so their mean is new_tokens, in an order shuffled the same way for every method."""
    lo, hi = new_tokens * (1 - spread), new_tokens * (1 + spread)
    lengths = [max(1, round(lo + (hi - lo) * i / max(count - 1, 1))) if count > 1 else new_tokens
               for i in range(count)]
    random.Random(count).shuffle(lengths)
    return lengths


def steady_run(llm: LLM, prompts: list[list[int]], batch: int, lengths: list[int]) -> dict:
    """Greedy decoding of every prompt, for its `lengths` tokens, with at most `batch` sequences
    running at once (the scheduler's max_num_seqs for this run): as one finishes, the next
    request is admitted, as in serving under steady load. Timed from the first step to the last,
    the later requests' prefills included; tokens/s counts every token emitted.
    `loaded_tokens_per_s` counts only the steps until the queue emptied (the last request
    admitted): while requests wait, `batch` sequences run at every step, so it is the
    throughput at that batch size under load, without the drain at the end, where fewer run
    (None when no request waited for a seat, all `batch` of them admitted at once)."""
    sched = llm.scheduler
    with at_most(llm, batch):
        ids = [llm.add_request(p, greedy(n)) for p, n in zip(prompts, lengths)]
        sched.stats = SpecStats()
        loaded = None   # (tokens, seconds) when the queue emptied
        steps, start = 0, time.perf_counter()
        while llm.has_work:
            llm.step()
            steps += 1
            if loaded is None and not sched.waiting:
                loaded = (sum(len(s.output_ids) for i in ids for s in sched.by_request[i]),
                          time.perf_counter() - start)
        wall = time.perf_counter() - start
    total = sum(len(s.output_ids) for i in ids for s in sched.pop_finished(i))
    waited = len(prompts) > batch and loaded and loaded[1]
    return {"steady_tokens_per_s": total / wall if wall else 0.0, "steady_tokens": total,
            "loaded_tokens_per_s": loaded[0] / loaded[1] if waited else None,
            "loaded_s": loaded[1] if waited else None,
            "steady_requests": len(prompts), "steady_steps": steps, "steady_wall_s": wall,
            "steady_mean_acceptance_length": (sched.stats.mean_acceptance_length
                                              if sched.stats.rounds else None)}


def arrival_times(count: int, rate: float) -> list[float]:
    """Seconds after the start at which `count` requests arrive, at random at `rate` a second
    (exponential gaps), the same for every method."""
    rng, now, times = random.Random(count), 0.0, []
    for _ in range(count):
        now += rng.expovariate(rate)
        times.append(now)
    return times


def arrival_run(llm: LLM, prompts: list[list[int]], batch: int, lengths: list[int],
                arrivals: list[float]) -> dict:
    """Greedy decoding of every prompt, for its `lengths` tokens, each request added when its
    arrival time has passed, with at most `batch` sequences running: a serving load below or
    near capacity, where the time to a request's first token (from its arrival) shows what the
    scheduler makes prompts wait (prefill steps gathered, `prefill_gather`). Timed from the
    start to the last token."""
    sched = llm.scheduler
    first: dict[str, float] = {}
    ids: list[str] = []
    with at_most(llm, batch):
        steps, start = 0, time.perf_counter()
        while len(ids) < len(prompts) or llm.has_work:
            now = time.perf_counter() - start
            while len(ids) < len(prompts) and arrivals[len(ids)] <= now:
                i = len(ids)
                ids.append(llm.add_request(prompts[i], greedy(lengths[i])))
            if not llm.has_work:
                time.sleep(max(0.0, arrivals[len(ids)] - now))
                continue
            for seq in llm.step():
                first.setdefault(seq.request_id, time.perf_counter() - start)
            steps += 1
        wall = time.perf_counter() - start
    total = sum(len(s.output_ids) for i in ids for s in sched.pop_finished(i))
    waits = sorted(1000 * (first[i] - arrivals[n]) for n, i in enumerate(ids))
    return {"arrival_requests_per_s": len(prompts) / arrivals[-1] if arrivals[-1] else None,
            "arrival_tokens_per_s": total / wall if wall else 0.0, "arrival_tokens": total,
            "arrival_steps": steps,
            "arrival_ttft_p50_ms": waits[len(waits) // 2],
            "arrival_ttft_p90_ms": waits[min(len(waits) - 1, len(waits) * 9 // 10)]}


def method_engine(model_dir: str, spec: str, device: str, dtype: str, batch: int,
                  prompt_len: int, new_tokens: int, drafter: str | None = None,
                  **options) -> LLM:
    """The engine the bench times for one `--methods` entry: up to `batch` sequences of
    `prompt_len` + `new_tokens` tokens (scripts/seqrounds.py builds the same one)."""
    chosen = method_options(spec)
    return LLM(model_dir, device=device, dtype=dtype, max_num_seqs=batch,
               kv_cache_bytes=kv_bytes_needed(model_dir, dtype, batch,
                                              prompt_len + new_tokens + MAX_VERIFY),
               # prefill in steps of at most 16K tokens bounds activation memory at batch 64
               max_num_batched_tokens=min(batch * (prompt_len + MAX_VERIFY + 1), 16384),
               drafter=drafter if chosen["speculative_method"] == "dflash" else None,
               **chosen, **options)


def engine_runs(model_dir: str, drafter: str | None, methods: list[str], prompts, args,
                options: dict) -> dict:
    """tokens/s per method per batch size. Every method's engine is built first; at each batch
    size each one runs once to warm up (Triton compiles kernels for shapes as they first appear,
    the draft policy settles on the batch size's k), then the methods take turns `args.repeat`
    times and each keeps its median run, so the machine's drifts hit all methods alike. With
    `args.steady_waves`, each turn also runs steady_run over that many batches' worth of prompts,
    whose median goes in beside the batch's; with `args.arrival_rate`, arrival_run over the same
    requests, the turn of the median first-token time kept."""
    top = max(args.batch_sizes)
    longest = (round(args.new_tokens * (1 + args.steady_spread))
               if args.steady_waves or args.arrival_rate else 0)
    engines = {spec: method_engine(model_dir, spec, args.device, args.dtype, top, args.prompt_len,
                                   max(args.new_tokens, longest), drafter, **options)
               for spec in methods}
    out: dict[str, dict] = {spec: {} for spec in methods}
    for b in args.batch_sizes:
        for llm in engines.values():
            decode_run(llm, prompts[:b], args.new_tokens)
        runs: dict[str, list] = {spec: [] for spec in methods}
        steady: dict[str, list] = {spec: [] for spec in methods}
        arrived: dict[str, list] = {spec: [] for spec in methods}
        count = b * max(args.steady_waves, 1)
        lengths = steady_lengths(count, args.new_tokens, args.steady_spread)
        for _ in range(args.repeat):
            for spec, llm in engines.items():
                runs[spec].append(decode_run(llm, prompts[:b], args.new_tokens))
                if args.steady_waves:
                    steady[spec].append(steady_run(llm, prompts[:count], b, lengths))
                if args.arrival_rate:
                    arrived[spec].append(arrival_run(llm, prompts[:count], b, lengths,
                                                     arrival_times(count, args.arrival_rate * b)))
        for spec, these in runs.items():
            turns = [r["tokens_per_s"] for r in these]   # in the order run: turn t of every
            these.sort(key=lambda r: r["tokens_per_s"])  # method ran back to back
            out[spec][b] = {**these[len(these) // 2], "turns_tokens_per_s": turns}
            each = ", ".join(f"{r['tokens_per_s']:.0f}" for r in these)
            note(f"  {spec} batch {b}: {out[spec][b]['tokens_per_s']:.1f} tokens/s (runs {each})")
            if steady[spec]:
                steady[spec].sort(key=lambda r: r["steady_tokens_per_s"])
                out[spec][b].update(steady[spec][len(steady[spec]) // 2])
                # under load: the turn of the median loaded rate, its seconds with it
                loaded = sorted((r for r in steady[spec] if r["loaded_tokens_per_s"]),
                                key=lambda r: r["loaded_tokens_per_s"])
                median = loaded[len(loaded) // 2] if loaded else {}
                out[spec][b]["loaded_tokens_per_s"] = median.get("loaded_tokens_per_s")
                out[spec][b]["loaded_s"] = median.get("loaded_s")
            if arrived[spec]:   # the turn of the median first-token time
                arrived[spec].sort(key=lambda r: r["arrival_ttft_p50_ms"])
                out[spec][b].update(arrived[spec][len(arrived[spec]) // 2])
    for llm in engines.values():
        release(llm)
    return out


FORWARD_TURNS = 3   # turns the forward shapes take


def forward_costs(model_dir: str, args, options: dict) -> dict:
    """Median ms of one target forward: decode (1 row) at each batch size, and a verify of k
    drafts (k + 1 rows) at batch 1, all after `prompt_len` cached tokens; with the weight bytes
    the floor uses. The shapes take FORWARD_TURNS turns, each timing `args.iters` forwards, and
    each keeps the median of its turns: a small model's forward is mostly host time, and a drift
    of the host's speed then hits decode and verify alike instead of whichever ran first."""
    top = max(args.batch_sizes)
    llm = LLM(model_dir, device=args.device, dtype=args.dtype, max_num_seqs=top,
              kv_cache_bytes=kv_bytes_needed(model_dir, args.dtype, top,
                                             args.prompt_len + MAX_VERIFY + 1),
              speculative_method="ngram",   # a verify pool without drafter weights
              verify_pool_bytes=verify_pool_bytes(model_dir, args.dtype, 1),
              **{"max_drafts": MAX_VERIFY, "capture_at_start": False, **options})
    w = llm.worker
    shapes = list(dict.fromkeys([(b, 1) for b in [1, *args.batch_sizes]]
                                + [(1, k + 1) for k in args.verify_ks]))   # (batch, rows)
    turns: dict[tuple[int, int], list[float]] = {s: [] for s in shapes}
    for _ in range(FORWARD_TURNS):
        for b, rows in shapes:
            turns[b, rows].append(w.time_forward(b, rows, args.prompt_len, args.iters))
    ms = {s: statistics.median(t) for s, t in turns.items()}
    decode = {b: ms[b, 1] for b in args.batch_sizes}
    verify = {k: ms[1, k + 1] for k in args.verify_ks}
    one = ms[1, 1]
    out = {"context_len": args.prompt_len, "decode_ms": decode, "verify_ms_batch1": verify,
           "verify_over_decode_batch1": {k: v / one for k, v in verify.items()},
           "weight_bytes": weight_bytes(w.model),
           "parameters": sum(p.numel() for p in {p.data_ptr(): p for p in w.model.parameters()}
                             .values())}
    release(llm)
    return out


@torch.inference_mode()
def hf_generate(model_dir: str, prompts: list[list[int]], new_tokens: int, batch_sizes: list[int],
                device: torch.device, dtype: torch.dtype) -> dict:
    """transformers' greedy `generate` on the same weights: decode tokens/s from the difference
    between a run of `new_tokens` and a run of 1 (the prefill), per batch size."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model = model.to(device).eval()

    def timed(ids, n):
        sync(device)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None,
                             temperature=None, top_p=None, top_k=None)
        sync(device)
        assert out.shape[1] == ids.shape[1] + n
        return time.perf_counter() - start
    out = {}
    for b in batch_sizes:
        ids = torch.tensor(prompts[:b], device=device)
        timed(ids, 4)
        prefill, total = timed(ids, 1), timed(ids, new_tokens)
        out[b] = {"tokens_per_s": b * (new_tokens - 1) / (total - prefill),
                  "ms_per_step": 1000 * (total - prefill) / (new_tokens - 1),
                  "total_s": total, "prefill_s": prefill}
        note(f"  transformers batch {b}: {out[b]['tokens_per_s']:.1f} tokens/s")
    return out


def bundled_prompts(model_dir: Path, count: int, length: int) -> list[list[int]]:
    """`count` distinct prompts of `length` tokens from the model's held-out files (as `metrale
    eval` uses): windows taken round-robin over the files, one per file before a second."""
    from metrale.workers.models.loader import load_tokenizer
    texts, _ = heldout_texts(model_dir)
    tok = load_tokenizer(model_dir)
    files = [ids for ids in (tok.encode(t).ids for t in texts) if len(ids) >= 2 * length]
    if not files:
        raise SystemExit(f"bench: no held-out file of {model_dir} has {2 * length} tokens")
    prompts, window = [], 1
    while len(prompts) < count:
        prompts += [ids[window * length:(window + 1) * length] for ids in files
                    if len(ids) >= (window + 1) * length]
        window += 1
    return prompts[:count]


def add_ab_arguments(p: argparse.ArgumentParser, models: str, batch_sizes: str) -> None:
    """The arguments the A/B scripts share (see decode_model)."""
    p.add_argument("--models", default=models)
    p.add_argument("--batch-sizes", default=batch_sizes)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--ckpt-dir", default="/tmp/metrale-bench")


def decode_model(name: str, count: int, ckpt_dir: str) -> tuple[str, list[list[int]]]:
    """A model and `count` prompts for the A/B scripts (scripts/aheadab.py, launchab.py): the
    bundled model with held-out prompts of 256 tokens, or a random-weight checkpoint of
    SHAPES[name] (written once under ckpt_dir) with random prompts of 512."""
    if name == "bundled":
        return str(BUNDLED_MODEL), bundled_prompts(BUNDLED_MODEL, count, 256)
    model_dir = str(write_random_checkpoint(Path(ckpt_dir) / name, SHAPES[name], "cuda"))
    return model_dir, random_prompts(count, 512, ModelConfig.from_dir(model_dir).vocab_size)


def decode_engine(model_dir: str, prompts: list[list[int]], new_tokens: int) -> LLM:
    """A bfloat16 CUDA engine sized for decoding `prompts` together (no speculation)."""
    batch, length = len(prompts), max(len(p) for p in prompts)
    return LLM(model_dir, device="cuda", dtype="bfloat16", max_num_seqs=batch,
               kv_cache_bytes=kv_bytes_needed(model_dir, "bfloat16", batch,
                                              length + new_tokens + 16),
               max_num_batched_tokens=min(batch * (length + 1), 16384), warmup_prefill_rows=0)


def bench_model(name: str, args, options: dict, bandwidth: float) -> dict:
    shape = None
    if name == "bundled":
        model_dir, drafter, methods = str(BUNDLED_MODEL), str(BUNDLED_DFLASH), args.methods
    elif name in SHAPES:
        shape = (SMALL_SHAPES if args.small else SHAPES)[name]
        start = time.perf_counter()
        model_dir = str(write_random_checkpoint(Path(args.ckpt_dir) / name, shape,
                                                args.device.type))
        note(f"{name}: checkpoint ready in {time.perf_counter() - start:.0f}s at {model_dir}")
        drafter, methods = None, ["none"]
    else:
        model_dir, drafter, methods = name, args.drafter, args.methods
    prompt_len = args.prompt_len or (32 if args.small else 256 if name == "bundled" else 512)
    a = argparse.Namespace(**{**vars(args), "prompt_len": prompt_len,
                              "dtype": args.dtype_name, "device": str(args.device)})
    top = max(args.batch_sizes + args.hf_batch_sizes) * max(args.steady_waves, 1)
    if shape is None and (Path(model_dir) / "heldout.json").is_file():
        prompts = bundled_prompts(Path(model_dir), top, prompt_len)
    else:
        vocab = ModelConfig.from_dir(model_dir).vocab_size
        prompts = random_prompts(top, prompt_len, vocab)
    result = {"model_dir": model_dir, "shape": shape, "prompt_len": prompt_len,
              "new_tokens": args.new_tokens, "methods": methods}
    if not args.skip_forward:
        costs = forward_costs(model_dir, a, options)
        floor_ms = 1000 * costs["weight_bytes"] / bandwidth
        result["forward"] = costs
        result["floor"] = {"weight_bytes": costs["weight_bytes"], "bandwidth_bytes_per_s": bandwidth,
                           "floor_ms": floor_ms, "tokens_per_s_batch1": 1000 / floor_ms}
        note(f"{name}: decode forward {costs['decode_ms']} ms, floor {floor_ms:.3f} ms")
    if not args.skip_engine:
        result["engine"] = engine_runs(model_dir, drafter, methods, prompts, a, options)
    if not args.skip_hf:
        result["hf_generate"] = hf_generate(model_dir, prompts, args.new_tokens,
                                            args.hf_batch_sizes, args.device, args.torch_dtype)
    gc.collect()
    return result


def release(llm: LLM) -> None:
    llm.close()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def git_commit(where: Path = Path(__file__).resolve().parent) -> str | None:
    """HEAD of the checkout at `where`, with "-dirty" when its tracked files differ from HEAD (a
    change not committed, or a copy of the tree beside a .git older than it: the GPU machine's
    copies have reported a commit they did not run); METRALE_COMMIT where the caller knows
    better, or where the tree was copied without .git."""
    if os.environ.get("METRALE_COMMIT"):
        return os.environ["METRALE_COMMIT"]

    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=where, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    try:
        head = git("rev-parse", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return head and head + ("-dirty" if changed else "") or None


def note(what: str) -> None:
    print(what, file=sys.stderr, flush=True)


# ---- the targets -----------------------------------------------------------------------------

def _engine(models: dict, name: str) -> dict | None:
    return models.get(name, {}).get("engine")


def _speedups(engine: dict, key: str = "tokens_per_s") -> dict[str, dict[int, float]]:
    """Speculative tokens/s / plain tokens/s per method per batch size (of the whole runs, or
    `full_batch_tokens_per_s`: until the first sequence finished)."""
    plain = engine["none"]
    return {m: {b: runs[b][key] / plain[b][key] for b in runs
                if b in plain and runs[b].get(key) and plain[b].get(key)}
            for m, runs in engine.items() if m != "none"}


def _proposer_speedups(engine: dict | None, key: str = "tokens_per_s") -> dict:
    """_speedups of the proposers alone: a plain variant ('none/c0') is no proposer."""
    speed = _speedups(engine, key) if engine and "none" in engine else {}
    return {m: r for m, r in speed.items() if method_options(m)["speculative_method"] != "none"}


def targets(models: dict) -> list[dict]:
    """Each target: what it measures, the measured value (None: not measured), the bound, PASS/MISS."""
    rows = []

    def add(what, value, bound, at_most, detail=""):
        ok = None if value is None else (value <= bound if at_most else value >= bound)
        rows.append({"target": what, "measured": value, "bound": f"{'<=' if at_most else '>='} "
                     f"{bound}x", "detail": detail,
                     "result": "n/a" if ok is None else "PASS" if ok else "MISS"})

    q8 = models.get("qwen3-8b", {})
    step = (q8.get("engine") or {}).get("none", {}).get(1)
    floor = q8.get("floor")
    # one sequence's decode step emits one token: its time is 1 / tokens/s, whether the engine
    # ran one step a plan or chained them (where `ms_per_step` is a chain's)
    ms = step and 1e3 / step["tokens_per_s"]
    add("plain decode step / bandwidth floor, batch 1, qwen3-8b",
        ms / floor["floor_ms"] if step and floor else None, 1.15, True,
        f"{ms:.2f} ms vs {floor['floor_ms']:.2f} ms" if step and floor else "")
    for name, m in models.items():
        f = m.get("forward")
        if not f:
            continue
        ratio = f["verify_over_decode_batch1"]
        for k, bound in ((7, 1.3), (15, 1.6)):
            add(f"verify of {k} drafts / one decode step, batch 1, {name}", ratio.get(k), bound,
                True, f"{f['verify_ms_batch1'][k]:.2f} ms" if k in ratio else "")
    engine = _engine(models, "bundled")
    speed = _proposer_speedups(engine)
    best1 = max(((r[1], m) for m, r in speed.items() if 1 in r), default=None)
    add("best proposer / plain tokens/s, bundled, T=0, batch 1", best1 and best1[0], 2.5, False,
        best1 and best1[1] or "")
    # at a batch size: one batch of B sequences, whose last ones run in a smaller batch, and
    # B running under load (steady runs until the queue emptied)
    for key, how in (("tokens_per_s", "one batch"), ("loaded_tokens_per_s", "under load")):
        speed = _proposer_speedups(engine, key)
        worst = max(((min(r.values()), m) for m, r in speed.items() if r), default=None)
        top = max((b for r in speed.values() for b in r), default=0)   # the largest batch run
        if worst and top < 64:
            worst_detail = f"{worst[1]}, batch sizes up to {top}"
        else:
            worst_detail = worst and f"{worst[1]} (its lowest over batch sizes)"
        add(f"speculative / plain tokens/s at every batch size <= 64, bundled, {how}",
            worst and worst[0], 1.0, False, worst_detail or "")
        best32 = max(((r[32], m) for m, r in speed.items() if 32 in r), default=None)
        add(f"speculative / plain tokens/s, batch 32, bundled, {how}", best32 and best32[0], 1.3,
            False, best32 and best32[1] or "")
    for name, m in models.items():
        hf, eng = m.get("hf_generate", {}).get(1), m.get("engine") or {}
        ours = max(((runs[1]["tokens_per_s"], meth) for meth, runs in eng.items() if 1 in runs),
                   default=None)
        if hf:
            ceiling = ""
            if "floor" in m:   # plain decoding can not beat it: the most its ratio can be
                at_floor = m["floor"]["tokens_per_s_batch1"] / hf["tokens_per_s"]
                ceiling = f"; {at_floor:.1f}x at the floor"
            add(f"metrale / transformers generate tokens/s, batch 1, {name}",
                ours and ours[0] / hf["tokens_per_s"], 30, False,
                ours and f"{ours[1]} {ours[0]:.1f} vs {hf['tokens_per_s']:.1f} tokens/s{ceiling}"
                or "")
    return rows


def format_report(report: dict) -> str:
    lines = [f"device {report['device']}, torch {report['torch']}, dtype {report['dtype']}, "
             f"attention_backend {report['worker_options'].get('attention_backend', 'default')}, "
             f"cuda_graphs {report['worker_options'].get('cuda_graphs', 'default')}, "
             f"copy bandwidth {report['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s", ""]
    for name, m in report["models"].items():
        if "floor" in m:
            f = m["floor"]
            lines.append(f"{name}: {f['weight_bytes'] / 1e9:.3f} GB of weights per step, floor "
                         f"{f['floor_ms']:.3f} ms ({f['tokens_per_s_batch1']:.0f} tokens/s at batch 1)")
        if "forward" in m:
            fw = m["forward"]
            lines.append("  forward ms, decode by batch: " + ", ".join(
                f"{b}: {v:.2f}" for b, v in fw["decode_ms"].items()) + "; verify / decode at "
                "batch 1 by k: " + ", ".join(f"{k}: {v:.2f}x" for k, v in
                                             fw["verify_over_decode_batch1"].items()))
        if m.get("engine"):
            eng = m["engine"]
            sizes = sorted({b for runs in eng.values() for b in runs})
            lines.append(f"  {'method':<12}" + "".join(f"{'B=' + str(b):>17}" for b in sizes)
                         + "   (tokens/s | ms per step | mean acceptance length)")
            for meth, runs in eng.items():
                lines.append(f"  {meth:<12}" + "".join(
                    f"{runs[b]['tokens_per_s']:>8.0f}|{runs[b]['ms_per_step']:>5.1f}|"
                    + (f"{a:>3.1f}" if (a := runs[b]['mean_acceptance_length']) else "  -")
                    if b in runs else " " * 17 for b in sizes))
            if "none" in eng:
                waves = m.get("steady_waves", report.get("steady_waves"))   # per model if merged
                spread = m.get("steady_spread", report.get("steady_spread")) or 0
                steady = (f"   (steady: {waves}B requests of {m.get('new_tokens')} +-"
                          f"{spread:.0%} tokens, at most B running)")
                for key, note in (("tokens_per_s", ""),
                                  ("full_batch_tokens_per_s", "   (until the first sequence finished)"),
                                  ("steady_tokens_per_s", steady),
                                  ("loaded_tokens_per_s", "   (the same, until the queue emptied: "
                                                          "B running, under load)")):
                    for meth, r in _speedups(eng, key).items():
                        lines.append(f"  {meth + ' / none':<12}" + "".join(
                            f"{r[b]:>16.2f}x" if b in r else " " * 17 for b in sizes) + note)
            if any("arrival_ttft_p50_ms" in r for runs in eng.values() for r in runs.values()):
                for meth, runs in eng.items():
                    cells = [(r["arrival_ttft_p50_ms"], r["arrival_ttft_p90_ms"])
                             if (r := runs.get(b)) and "arrival_ttft_p50_ms" in r else None
                             for b in sizes]
                    lines.append(f"  {meth + ' ttft':<12}" + "".join(
                        f"{c[0]:>7.1f}/{c[1]:<7.1f}ms" if c else " " * 17 for c in cells)
                        + f"   (arrivals at {m.get('arrival_rate')} a second per seat: "
                        "first token p50/p90 from arrival)")
        for b, h in m.get("hf_generate", {}).items():
            lines.append(f"  transformers generate batch {b}: {h['tokens_per_s']:.1f} tokens/s "
                         f"({h['ms_per_step']:.1f} ms per step)")
        lines.append("")
    lines += [f"{'target':<62} {'measured':>9} {'bound':>8}  result  detail"]
    for t in report["targets"]:
        value = "-" if t["measured"] is None else f"{t['measured']:.2f}x"
        lines.append(f"{t['target']:<62} {value:>9} {t['bound']:>8}  {t['result']:<6}  {t['detail']}")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> str | None:
    """tokens/s by batch size per model and method; verify cost by k per model. None if written,
    else why not."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'metrale[bench]'): no plot"
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for name, m in report["models"].items():
        for meth, runs in (m.get("engine") or {}).items():
            sizes = sorted(runs)
            left.plot(sizes, [runs[b]["tokens_per_s"] for b in sizes], marker="o",
                      label=f"{name} {meth}")
        hf = m.get("hf_generate") or {}
        if hf:
            left.plot(sorted(hf), [hf[b]["tokens_per_s"] for b in sorted(hf)], marker="x",
                      linestyle=":", label=f"{name} transformers")
        if m.get("forward"):
            ratio = m["forward"]["verify_over_decode_batch1"]
            right.plot([0] + sorted(ratio), [1.0] + [ratio[k] for k in sorted(ratio)], marker="o",
                       label=name)
    left.set(xscale="log", yscale="log", xlabel="batch size", ylabel="tokens/s",
             title=f"decode tokens/s ({report['device']}, {report['dtype']})")
    left.set_xscale("log", base=2)
    left.legend(fontsize=7)
    right.scatter([7, 15], [1.3, 1.6], marker="_", s=400, color="red", label="target")
    right.set(xlabel="drafts k", ylabel="verify forward / decode forward (batch 1)",
              title="verify cost per k")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def int_keys(obj):
    """JSON turns int keys (batch sizes, k) into strings; turn them back on --merge."""
    if isinstance(obj, dict):
        return {int(k) if isinstance(k, str) and k.isdigit() else k: int_keys(v)
                for k, v in obj.items()}
    return obj


def run(args) -> int:
    args.device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                               else "cpu" if args.device == "auto" else args.device)
    args.dtype_name = (args.dtype if args.dtype != "auto" else
                       "bfloat16" if args.device.type == "cuda" else "float32")
    args.torch_dtype = DTYPES[args.dtype_name]
    args.batch_sizes, args.hf_batch_sizes = ints(args.batch_sizes), ints(args.hf_batch_sizes)
    args.verify_ks = [k for k in ints(args.verify_ks) if k <= MAX_VERIFY]
    args.methods = [m for m in args.methods.split(",") if m]
    for m in args.methods:
        if not METHOD.fullmatch(m):
            raise SystemExit(f"--methods: {m!r} is not METHOD, METHOD@K or METHOD=K, each "
                             "with an optional /gG (prefill_gather G) and /cN (chain_rounds N)")
    if args.steady_waves < 0:
        raise SystemExit(f"--steady-waves: {args.steady_waves} is below 0 (0 turns steady runs off)")
    if args.arrival_rate < 0:
        raise SystemExit(f"--arrival-rate: {args.arrival_rate} is below 0 (0 turns arrivals off)")
    if not 0 <= args.steady_spread < 1:
        raise SystemExit(f"--steady-spread: {args.steady_spread} is not in [0, 1)")
    if args.small_weight_rows is not None and not kernels.FEW_ROWS <= args.small_weight_rows <= 256:
        raise SystemExit(f"--small-weight-rows: {args.small_weight_rows} is not in "
                         f"[{kernels.FEW_ROWS}, 256]")
    args.new_tokens = args.new_tokens or (16 if args.small else 128)
    options = {}
    if args.attention_backend:
        options["attention_backend"] = args.attention_backend
    if args.no_cuda_graphs:
        options["cuda_graphs"] = False
    kernels.FEW = not args.no_few_rows
    if args.small_weight_rows is not None:
        kernels.SMALL_ROWS = args.small_weight_rows
    kernels.CHAIN = not args.no_chain_kernels
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.device.type == "cuda" and args.device.index is not None:
        torch.cuda.set_device(args.device)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    commit = git_commit()   # the tree measured: read once, as the run starts
    start = time.perf_counter()
    copy_size = (64 << 20) if args.small else (2 << 30) if args.device.type == "cuda" else (256 << 20)
    bandwidth = copy_bandwidth(args.device, copy_size)
    note(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s ({copy_size >> 20} MiB copies)")
    models = {}
    for path in args.merge:   # each model keeps the commit and date it was measured at
        earlier = int_keys(json.loads(Path(path).read_text()))
        for name, m in earlier["models"].items():
            models[name] = {"commit": earlier["commit"], "date": earlier["date"],
                            "steady_waves": earlier.get("steady_waves"),
                            "steady_spread": earlier.get("steady_spread", 0.0), **m}
    for name in [m for m in args.models.split(",") if m]:
        t = time.perf_counter()
        models[name] = bench_model(name, args, options, bandwidth)
        models[name]["seconds"] = round(time.perf_counter() - t, 1)
        models[name]["commit"] = commit
        models[name]["steady_waves"] = args.steady_waves
        models[name]["steady_spread"] = args.steady_spread
        models[name]["arrival_rate"] = args.arrival_rate
        note(f"{name}: done in {models[name]['seconds']}s")
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit, "argv": sys.argv[1:],
        "device": torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "cpu",
        "torch": torch.__version__, "dtype": args.dtype_name, "small": args.small,
        "worker_options": {"attention_backend": options.get("attention_backend", "auto"),
                           "cuda_graphs": options.get("cuda_graphs", True),
                           "few_rows": kernels.FEW, "small_weight_rows": kernels.SMALL_ROWS,
                           "chain_kernels": kernels.CHAIN},
        "bandwidth_bytes_per_s": bandwidth, "copy_bytes": copy_size,
        "steady_waves": args.steady_waves, "steady_spread": args.steady_spread,
        "arrival_rate": args.arrival_rate,
        "seconds": round(time.perf_counter() - start, 1), "models": models}
    report["targets"] = targets(models)
    (out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    why = plot(report, out / "bench.png")
    print(format_report(report))
    print(f"\nwrote {out / 'bench.json'}" + (f"; {why}" if why else f" and {out / 'bench.png'}"))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m metrale.deploy.gpubench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

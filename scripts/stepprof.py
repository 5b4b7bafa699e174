"""Where an engine step's time goes on the bundled model, per phase (meant for a GPU; runs on CPU).

    python3 scripts/stepprof.py ngram:3:32 mtp:a3:1 none:0:64     # METHOD:DRAFTS:BATCH ...
    python3 scripts/stepprof.py --steady 4 ngram:a7:32 none:0:32    # steady runs, per step,
                                                                    # compiles marked

Each spec decodes BATCH held-out prompts together for 128 tokens with every round carrying
DRAFTS drafts (adaptive draft length off), or with `aK` at most K drafts chosen by the draft
policy (then the rounds' ks are printed too), twice (the first run compiles and captures). It prints
the steps' total and median milliseconds, the slowest four, the worker's phases (propose, target
forward, verdicts, SSM commit, drafter commit, and inside them MTP's and DFlash's catch-up and
draft graph; a chain of n-gram rounds and inside it its rounds' upload and replays; each timed
between device syncs, so their sum is above an unprofiled step's), and
how many forwards could not replay a CUDA graph, and per tenth of the steps the sequences running,
tokens emitted and milliseconds per step (where a batch's tail goes).
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import replace

import torch

from metrale.deploy.bundled import BUNDLED_DFLASH, BUNDLED_MODEL
from metrale.deploy.gpubench import bundled_prompts, greedy, kv_bytes_needed
from metrale.deploy.llm import LLM


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(phases: dict, name: str, fn):
    def run(*args, **kwargs):
        sync()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        sync()
        phases.setdefault(name, []).append((time.perf_counter() - start) * 1e3)
        return out
    return run


def engine(method: str, drafts: str, **options) -> LLM:
    """The bundled model's engine for METHOD with DRAFTS (`K`, or `aK` for the policy's choice);
    `options` are further LLM arguments."""
    return LLM(str(BUNDLED_MODEL), max_num_seqs=64, speculative_method=method, **options,
               kv_cache_bytes=kv_bytes_needed(str(BUNDLED_MODEL), "auto", 64, 400),
               num_drafts=int(drafts.lstrip("a")) or None, adaptive_drafts=drafts.startswith("a"),
               drafter=str(BUNDLED_DFLASH) if method == "dflash" else None)


def admit(llm: LLM, prompts) -> list[str]:
    """Queues the prompts for 128 greedy tokens each and steps until every one has its first."""
    ids = [llm.add_request(p, greedy(128)) for p in prompts]
    sched = llm.scheduler
    while sched.waiting or any(not s.output_ids for s in sched.running):
        llm.step()
    return ids


def profile(method: str, drafts: str, batch: int, prompts) -> None:
    adaptive = drafts.startswith("a")
    llm = engine(method, drafts)
    w, phases, eager = llm.worker, {}, []
    forward = w._forward

    def watched(batch_, patch=None):
        if w.graphs is not None and not w.graphs.eligible(batch_):
            eager.append(len(batch_.seqs))
        return forward(batch_, patch)
    w._forward = timed(phases, "forward", watched)
    w._propose = timed(phases, "propose", w._propose)
    w._verdicts = timed(phases, "verdicts", w._verdicts)
    if w.proposer:
        w.proposer.commit = timed(phases, "drafter commit", w.proposer.commit)
        if hasattr(w.proposer, "_catch_up"):   # MTP, DFlash: inside commit or propose
            w.proposer._catch_up = timed(phases, "  catch-up", w.proposer._catch_up)
        if getattr(w.proposer, "graphs", None) is not None:
            w.proposer.graphs.run = timed(phases, "  draft graph", w.proposer.graphs.run)
    if w.ssm is not None:
        w.ssm.commit = timed(phases, "ssm commit", w.ssm.commit)
    if w.chain is not None:   # chained n-gram rounds: the whole chain, and its rounds' graphs
        w._execute_chain = timed(phases, "chain", w._execute_chain)
        w.chain.run = timed(phases, "  rounds", w.chain.run)
    sched = llm.scheduler
    for run in range(2):
        ids = admit(llm, prompts[:batch])
        phases.clear()
        eager.clear()
        seqs = [s for i in ids for s in sched.by_request[i]]
        steps, ks, trace = [], [], []      # trace: (sequences running, tokens emitted) per step
        while llm.has_work:
            running, before = len(sched.running), sum(len(s.output_ids) for s in seqs)
            start = time.perf_counter()
            llm.step()
            sync()
            steps.append((time.perf_counter() - start) * 1e3)
            ks.append(str(sched.drafts.last_k) if adaptive else "")
            trace.append((running, sum(len(s.output_ids) for s in seqs) - before))
        for i in ids:
            sched.pop_finished(i)
        print(f"{method}:{drafts}:{batch} run {run}: {len(steps)} steps, {sum(steps):.0f} ms, "
              f"median {statistics.median(steps):.2f}, slowest {[round(x, 1) for x in sorted(steps)[-4:]]}")
        for name, ms in phases.items():
            print(f"   {name:15s} {sum(ms):7.1f} ms in {len(ms)}, median {statistics.median(ms):.3f}, "
                  f"max {max(ms):.1f}")
        print("   by tenths of the run (steps: sequences running, tokens a step, ms a step):")
        for part in range(10):
            lo, hi = len(steps) * part // 10, len(steps) * (part + 1) // 10
            if hi > lo:
                print(f"     {lo:4d}-{hi - 1:<4d} {statistics.mean(r for r, _ in trace[lo:hi]):5.1f} "
                      f"{statistics.mean(t for _, t in trace[lo:hi]):6.1f} "
                      f"{statistics.mean(steps[lo:hi]):6.2f}")
        print(f"   forwards without a graph: {len(eager)} (batch sizes {eager[:8]})")
        if adaptive:
            print(f"   ks {''.join(ks)}\n   policy {sched.drafts.as_dict()}")
    llm.close()


def watch_compiles() -> list:
    """A list that gets ("c", kernel) for each Triton kernel compiled (or loaded from the disk
    cache) from now on, ("a", kernel) for each autotune benchmark and ("g",) for each CUDA graph
    captured; the caller clears it."""
    import metrale.workers.cuda_graphs as cuda_graphs
    events: list = []

    def counted(tag, fn):
        def wrapped(*args, **kwargs):
            kernel = getattr(args[0], "fn", args[0]) if args else None
            events.append((tag, getattr(kernel, "__name__", "")))
            return fn(*args, **kwargs)
        return wrapped
    cuda_graphs.capture = counted("g", cuda_graphs.capture)
    try:
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.jit import JITFunction
        JITFunction._do_compile = counted("c", JITFunction._do_compile)
        Autotuner._bench = counted("a", Autotuner._bench)
    except (ImportError, AttributeError) as e:
        print(f"   (Triton compiles not watched: {e})")
    return events


def steady(method: str, drafts: str, batch: int, waves: int, prompts) -> None:
    """Each step of steady runs: waves x batch requests, at most `batch` running, as in
    gpubench's steady_run with its budget of 16384 rows a step. Per step: its kind (prefill;
    prompt chunks mixed with decoding, where no graphs replay; decode; speculative round; chain
    of rounds; or a step that only read one launched before), the sequences and rows planned,
    and its milliseconds between device syncs, and what it compiled, autotuned or captured
    (watch_compiles). Runs twice, the first compiling, and prints per kind the steps, total and
    median ms, the steps that compiled and the kernels, the slowest 8 steps, and per kind the
    median of the steps that did not compile."""
    llm = engine(method, drafts, max_num_batched_tokens=16384)   # gpubench's budget
    w, sched = llm.worker, llm.scheduler
    eager = []
    if w.chain is not None:   # a chain whose layout no graph holds runs op by op
        chain_eagerly = w._chain_eagerly
        w._chain_eagerly = lambda *a: eager.append(1) or chain_eagerly(*a)
    events = watch_compiles()
    config = sched.config
    sched.config = replace(config, max_num_seqs=batch)
    plans = []
    schedule = sched.schedule
    sched.schedule = lambda *a, **k: plans.append(schedule(*a, **k)) or plans[-1]
    for run in range(2):
        ids = [llm.add_request(p, greedy(128)) for p in prompts[:batch * waves]]
        steps, eager[:], named = [], [], set()
        start = time.perf_counter()
        while llm.has_work:
            plans.clear()
            events.clear()
            t = time.perf_counter()
            llm.step()
            sync()
            work = plans[0].work if plans else []   # none planned: a step launched before
            drafted = any(w_.num_drafts or w_.pad_to for w_ in work)
            chunks = sum(len(w_.tokens) > 1 for w_ in work)   # prompt chunks (the rest decode)
            kind = ("ahead" if not plans else "empty" if not work else
                    "prefill" if chunks == len(work) else "mixed" if chunks else
                    f"chain x{work[0].steps}" if drafted and work[0].steps > 1 else
                    "round" if drafted else "decode")
            steps.append((kind, len(work), sum(len(w_.tokens) for w_ in work),
                          round((time.perf_counter() - t) * 1e3, 2),
                          "".join(e[0] for e in events)))
            named.update(f"{tag} {name}" for tag, name in events if tag != "g")
        wall = time.perf_counter() - start
        tokens = sum(len(s_.output_ids) for i in ids for s_ in sched.pop_finished(i))
        print(f"{method}:{drafts}:{batch} steady x{waves} run {run}: {len(steps)} steps, "
              f"{wall * 1e3:.0f} ms, {tokens / wall:.0f} tokens/s, chains run op by op: "
              f"{len(eager)}")
        for kind in sorted({k for k, *_ in steps}):
            ms = [m for k, *_, m, _ in steps if k == kind]
            print(f"   {kind:10s} {len(ms):4d} steps {sum(ms):8.1f} ms, median "
                  f"{statistics.median(ms):.2f}, max {max(ms):.1f}")
        marked = [m for *_, m, e in steps if e]
        print(f"   steps that compiled (c), autotuned (a) or captured a graph (g): {len(marked)}, "
              f"{sum(marked):.1f} ms; kernels {sorted(named)[:12]}")
        print("   slowest (kind, sequences, rows, ms, events):",
              sorted(steps, key=lambda x: -x[3])[:8])
        print("   the rest's median by kind:", {
            k: round(statistics.median(m for k_, *_, m, e in steps if k_ == k and not e), 2)
            for k in {k_ for k_, *_, e in steps if not e}})
    sched.config = config
    llm.close()


def main() -> None:
    args = sys.argv[1:]
    waves = 0
    if args[:1] == ["--steady"]:
        waves, args = int(args[1]), args[2:]
    prompts = bundled_prompts(BUNDLED_MODEL, 64 * max(waves, 1), 256)
    for spec in args:
        method, drafts, batch = spec.split(":")
        if waves:
            steady(method, drafts, int(batch), waves, prompts)
        else:
            profile(method, drafts, int(batch), prompts)


if __name__ == "__main__":
    main()

"""Host time per engine step and per phase on the bundled model, without device syncs: the host's
critical path as a step really runs (stepprof syncs around each phase instead, to time the device).

    python3 scripts/hostprof.py none:0:1 ngram:7:1 mtp:a3:32     # METHOD:DRAFTS:BATCH ...

DRAFTS as in stepprof (`aK`: at most K, the draft policy choosing). Each spec decodes BATCH held-out
prompts for 128 tokens three times and prints the last run: its steps and wall time, and per phase
the microseconds a step spends in it (a phase that waits for the device, such as the verdicts'
host sync, counts that wait), then the same for the run's first step alone (nothing was in
flight before it) and the median of the others. Python's garbage collections count as phases
too ("gc, generation N").
"""
from __future__ import annotations

import gc
import statistics
import sys
import time

import torch

from metrale.deploy.bundled import BUNDLED_MODEL
from metrale.deploy.gpubench import bundled_prompts
from metrale.workers.batch import RowsLayout
from stepprof import admit, engine   # this script's folder is on the path


def wrap(obj, name: str, phases: dict, label: str, step: list[int]) -> None:
    """Times each call of obj.name into phases[label] as (the step it ran in, microseconds)."""
    fn = getattr(obj, name)

    def run(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        phases.setdefault(label, []).append((step[0], (time.perf_counter() - start) * 1e6))
        return out
    setattr(obj, name, run)


def watch_collections(phases: dict, step: list[int]):
    """Times each garbage collection into phases["gc, generation N"], as wrap does; returns the
    callback, to remove from gc.callbacks."""
    began = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            phases.setdefault(f"gc, generation {info['generation']}", []).append(
                (step[0], (time.perf_counter() - began[0]) * 1e6))
    gc.callbacks.append(on_gc)
    return on_gc


def profile(spec: str, prompts) -> None:
    classes = {(RowsLayout, "of"): RowsLayout.__dict__["of"],   # wrapped below; put back after
               (torch.cuda.CUDAGraph, "replay"): torch.cuda.CUDAGraph.__dict__["replay"]}
    method, drafts, batch = spec.split(":")
    llm = engine(method, drafts)
    w, s, ph, step = llm.worker, llm.scheduler, {}, [0]
    watching = watch_collections(ph, step)
    for name in ("_fill_ahead", "_track_history", "_propose", "_forward", "_verdicts"):
        wrap(w, name, ph, "worker." + name, step)
    if w.ssm is not None:
        wrap(w.ssm, "commit", ph, "ssm.commit", step)
    if w.proposer is not None:
        wrap(w.proposer, "commit", ph, "proposer.commit", step)
    if w.chain is not None:   # a chain of n-gram rounds; its runner waits for the device once
        wrap(w, "_execute_chain", ph, "worker._execute_chain", step)
        wrap(w.chain, "run", ph, "  chain.run (rounds)", step)
        # inside a chain's launch: what a chain from the host adds to one resumed on the device
        wrap(w, "_fresh_chain_inputs", ph, "  worker._fresh_chain_inputs", step)
        wrap(w.chain, "launch", ph, "  chain.launch", step)
        wrap(w.graphs, "prepare", ph, "    graphs.prepare", step)
        wrap(torch.cuda.CUDAGraph, "replay", ph, "    CUDA graph replays", step)
    for name in ("_launch_decode", "_launch_chain", "_read_flights"):   # plans that fly (launch)
        wrap(w, name, ph, "worker." + name, step)
    wrap(w, "launch", ph, "worker.launch (all)", step)
    wrap(s, "schedule", ph, "scheduler.schedule", step)
    wrap(s, "update", ph, "scheduler.update", step)
    wrap(s, "_measure", ph, "  scheduler._measure", step)
    wrap(s, "_plan", ph, "  scheduler._plan", step)
    wrap(s, "_ahead_chain", ph, "  scheduler._ahead_chain", step)
    wrap(RowsLayout, "of", ph, "RowsLayout.of", step)
    for _ in range(3):
        ids = admit(llm, prompts[:int(batch)])
        ph.clear()
        steps, ends = 0, []
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        while llm.has_work:
            step[0] = steps
            llm.step()
            steps += 1
            ends.append(time.perf_counter())
        wall = (ends[-1] - start) * 1e3
        for i in ids:
            s.pop_finished(i)
    print(f"{spec}: {steps} steps, {wall:.1f} ms, {wall / steps * 1e3:.0f} us/step, "
          f"{len(gc.get_objects())} objects tracked by the collector")
    for label, calls in ph.items():
        us = [t for _, t in calls]
        print(f"   {label:26s} {sum(us) / steps:7.0f} us/step  ({len(us)} calls, "
              f"median {statistics.median(us):.0f})")
    lasted = [(b - a) * 1e6 for a, b in zip([start] + ends, ends)]
    later = statistics.median(lasted[1:]) if steps > 1 else 0.0
    print(f"   first step {lasted[0]:.0f} us, the others' median {later:.0f} us; per phase, "
          "first step / the others' median per step:")
    for label, calls in ph.items():
        per = [sum(t for i, t in calls if i == n) for n in range(steps)]
        print(f"   {label:26s} {per[0]:7.0f} / {statistics.median(per[1:]) if steps > 1 else 0:7.0f}")
    gc.callbacks.remove(watching)
    for (cls, name), original in classes.items():
        setattr(cls, name, original)
    llm.close()


def main() -> None:
    prompts = bundled_prompts(BUNDLED_MODEL, 64, 256)
    for spec in sys.argv[1:]:
        profile(spec, prompts)


if __name__ == "__main__":
    main()


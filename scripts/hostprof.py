"""Host time per engine step and per phase on the bundled model, without device syncs: the host's
critical path as a step really runs (stepprof syncs around each phase instead, to time the device).

    python3 scripts/hostprof.py none:0:1 ngram:7:1 mtp:a3:32     # METHOD:DRAFTS:BATCH ...

DRAFTS as in stepprof (`aK`: at most K, the draft policy choosing). Each spec decodes BATCH held-out
prompts for 128 tokens three times and prints the last run: its steps and wall time, and per phase
the microseconds a step spends in it (a phase that waits for the device, such as the verdicts'
host sync, counts that wait).
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

from metrale.deploy.bundled import BUNDLED_MODEL
from metrale.deploy.gpubench import bundled_prompts
from metrale.workers.batch import RowsLayout
from stepprof import admit, engine   # this script's folder is on the path


def wrap(obj, name: str, phases: dict, label: str) -> None:
    fn = getattr(obj, name)

    def run(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        phases.setdefault(label, []).append((time.perf_counter() - start) * 1e6)
        return out
    setattr(obj, name, run)


def profile(spec: str, prompts) -> None:
    method, drafts, batch = spec.split(":")
    llm = engine(method, drafts)
    w, s, ph = llm.worker, llm.scheduler, {}
    for name in ("_fill_ahead", "_track_history", "_propose", "_forward", "_verdicts"):
        wrap(w, name, ph, "worker." + name)
    if w.ssm is not None:
        wrap(w.ssm, "commit", ph, "ssm.commit")
    if w.proposer is not None:
        wrap(w.proposer, "commit", ph, "proposer.commit")
    if w.chain is not None:   # a chain of n-gram rounds; its runner waits for the device once
        wrap(w, "_execute_chain", ph, "worker._execute_chain")
        wrap(w.chain, "run", ph, "  chain.run (rounds)")
    for name in ("_launch_decode", "_read_flights"):   # steps that fly (Worker.launch)
        wrap(w, name, ph, "worker." + name)
    wrap(w, "launch", ph, "worker.launch (all)")
    wrap(s, "schedule", ph, "scheduler.schedule")
    wrap(s, "update", ph, "scheduler.update")
    wrap(s, "_measure", ph, "  scheduler._measure")
    wrap(RowsLayout, "of", ph, "RowsLayout.of")
    for _ in range(3):
        ids = admit(llm, prompts[:int(batch)])
        ph.clear()
        steps = 0
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        while llm.has_work:
            llm.step()
            steps += 1
        wall = (time.perf_counter() - start) * 1e3
        for i in ids:
            s.pop_finished(i)
    print(f"{spec}: {steps} steps, {wall:.1f} ms, {wall / steps * 1e3:.0f} us/step")
    for label, us in ph.items():
        print(f"   {label:26s} {sum(us) / steps:7.0f} us/step  ({len(us)} calls, "
              f"median {statistics.median(us):.0f})")
    llm.close()


def main() -> None:
    prompts = bundled_prompts(BUNDLED_MODEL, 64, 256)
    for spec in sys.argv[1:]:
        profile(spec, prompts)


if __name__ == "__main__":
    main()


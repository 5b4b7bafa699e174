"""What the device does during a decode run's first steps on the bundled model: torch.profiler
around steps 0-4 of the third run of each spec (the first two compile and capture).

    python3 scripts/steptrace.py ngram:a3:32 none:0:32     # METHOD:DRAFTS:BATCH, as stepprof

Per step it prints the host's time and, inside that window, the device's busy time, when its
first work began and how many kernels and copies ran: a first step that waits for the host shows
a late first kernel and a busy time well below its wall. Then the first step's longest host
events and its CUDA runtime calls by total time. The chrome trace goes to /tmp/steptrace-SPEC.json
(chrome://tracing or Perfetto). Written for a GPU; on the CPU only the host side is there.
"""
from __future__ import annotations

import json
import sys

from torch.profiler import ProfilerActivity, profile, record_function

from metrale.deploy.bundled import BUNDLED_MODEL
from metrale.deploy.gpubench import bundled_prompts
from stepprof import admit, engine, sync   # this script's folder is on the path

TRACED = 5   # steps
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_WORK = ("cpu_op", "cuda_runtime", "user_annotation")


def trace(spec: str, prompts) -> str:
    """Runs the spec three times; returns the chrome trace of the last run's first steps."""
    method, drafts, batch = spec.split(":")
    llm = engine(method, drafts)
    path = f"/tmp/steptrace-{spec.replace(':', '_')}.json"
    for turn in range(3):
        ids = admit(llm, prompts[:int(batch)])
        sync()
        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) \
            if turn == 2 else None
        step = 0
        while llm.has_work:
            if prof is not None and step < TRACED:
                if step == 0:
                    prof.start()
                with record_function(f"STEP{step}"):
                    llm.step()
                if step == TRACED - 1 or not llm.has_work:
                    sync()
                    prof.stop()
                    prof.export_chrome_trace(path)
                    prof = None
            else:
                llm.step()
            step += 1
        for i in ids:
            llm.scheduler.pop_finished(i)
    llm.close()
    return path


def report(spec: str, path: str) -> None:
    events = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e for e in events if e["name"].startswith("STEP")
                    and e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
    device = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in DEVICE_WORK)
    print(f"{spec}:")
    for s in steps:
        start, end = s["ts"], s["ts"] + s["dur"]
        inside = [(a, b) for a, b in device if a < end and b > start]
        busy = sum(min(end, b) - max(start, a) for a, b in inside)
        first = f"{inside[0][0] - start:.0f} us in" if inside else "none"
        print(f"  {s['name']}: host {s['dur']:.0f} us, device busy {busy:.0f} us, "
              f"first device work {first}, {len(inside)} kernels and copies")
    first = steps[0]
    host = [e for e in events if e.get("cat") in HOST_WORK and e is not first
            and first["ts"] <= e["ts"] <= first["ts"] + first["dur"]]
    print("  STEP0's longest host events:")
    for e in sorted(host, key=lambda e: -e["dur"])[:15]:
        print(f"    {e['dur']:7.0f} us at +{e['ts'] - first['ts']:5.0f}  {e['cat']:14s} "
              f"{e['name'][:70]}")
    calls: dict[str, list[float]] = {}
    for e in host:
        if e["cat"] == "cuda_runtime":
            calls.setdefault(e["name"], []).append(e["dur"])
    print("  STEP0's CUDA runtime calls (count, total us):")
    for name, durations in sorted(calls.items(), key=lambda kv: -sum(kv[1]))[:8]:
        print(f"    {len(durations):4d} {sum(durations):7.0f}  {name}")


def main() -> None:
    prompts = bundled_prompts(BUNDLED_MODEL, 64, 256)
    for spec in sys.argv[1:]:
        report(spec, trace(spec, prompts))


if __name__ == "__main__":
    main()

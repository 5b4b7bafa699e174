"""Where the device waits for the host in a decode run on the bundled model: torch.profiler
around every step of each spec's third run (the first two compile and capture), then again
around a fourth with Python's calls recorded, to name what the host ran while the device idled.

    python3 scripts/steptrace.py ngram:a3:32 none:0:32     # METHOD:DRAFTS:BATCH, as stepprof

Per step of the third run it prints the host's time and, inside that window, the device's busy
time, when its first work began, the longest stretch the device idled and how many kernels and
copies ran: a step that waits for the host shows a late first kernel or a long idle stretch.
Then the third run's first step's CUDA runtime calls by total time and, from the fourth run
(its host slowed by the recording, so read it for names, not times), the device's longest idle
stretches, each with the Python calls that overlap it most. The chrome traces go to
/tmp/steptrace-SPEC.json and /tmp/steptrace-SPEC-stack.json (chrome://tracing or Perfetto).
Written for a GPU; on the CPU only the host side is there.
"""
from __future__ import annotations

import json
import sys

from torch.profiler import ProfilerActivity, profile, record_function

from metrale.deploy.bundled import BUNDLED_MODEL
from metrale.deploy.gpubench import bundled_prompts
from stepprof import admit, engine, sync   # this script's folder is on the path

DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
GAPS = 8   # idle stretches shown


def trace(spec: str, prompts) -> tuple[str, str]:
    """Runs the spec four times; returns the chrome traces of the third and fourth."""
    method, drafts, batch = spec.split(":")
    llm = engine(method, drafts)
    base = f"/tmp/steptrace-{spec.replace(':', '_')}"
    paths = (f"{base}.json", f"{base}-stack.json")
    for turn in range(4):
        ids = admit(llm, prompts[:int(batch)])
        sync()
        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                       with_stack=turn == 3) if turn >= 2 else None
        if prof is not None:
            prof.start()
        step = 0
        while llm.has_work:
            with record_function(f"STEP{step}"):
                llm.step()
            step += 1
        if prof is not None:
            sync()
            prof.stop()
            prof.export_chrome_trace(paths[turn - 2])
        for i in ids:
            llm.scheduler.pop_finished(i)
    llm.close()
    return paths


def load(path: str) -> tuple[list[dict], list[dict], list[tuple[float, float]]]:
    """The trace's complete events, its steps, and its device work as merged busy intervals."""
    events = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e for e in events if e["name"].startswith("STEP")
                    and e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
    busy: list[tuple[float, float]] = []
    for a, b in sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                       if e.get("cat") in DEVICE_WORK):
        if busy and a <= busy[-1][1]:
            busy[-1] = (busy[-1][0], max(busy[-1][1], b))
        else:
            busy.append((a, b))
    return events, steps, busy


def span_ms(steps: list[dict]) -> float:
    """Milliseconds from the first step's start to the last one's end."""
    return (steps[-1]["ts"] + steps[-1]["dur"] - steps[0]["ts"]) / 1e3


def idle(busy: list[tuple[float, float]], start: float, end: float) -> list[tuple[float, float]]:
    """The stretches of [start, end] with no device work."""
    out, at = [], start
    for a, b in busy:
        if b <= at or a >= end:
            continue
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if at < end:
        out.append((at, end))
    return out


def report(spec: str, path: str, stack_path: str) -> None:
    events, steps, busy = load(path)
    print(f"{spec}: {len(steps)} steps, {span_ms(steps):.2f} ms")
    for s in steps:
        start, end = s["ts"], s["ts"] + s["dur"]
        inside = [(a, b) for a, b in busy if a < end and b > start]
        work = sum(1 for e in events if e.get("cat") in DEVICE_WORK and start <= e["ts"] < end)
        first = f"{inside[0][0] - start:5.0f} us in" if inside else "none"
        gaps = idle(busy, start, end)
        longest = max((b - a for a, b in gaps), default=0.0)
        print(f"  {s['name']:6s} host {s['dur']:6.0f} us, device busy {max(0.0, s['dur'] - sum(b - a for a, b in gaps)):6.0f} us, "
              f"first work {first}, longest idle {longest:5.0f} us, {work} kernels and copies")
    first = steps[0]
    host: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") == "cuda_runtime" and first["ts"] <= e["ts"] <= first["ts"] + first["dur"]:
            host.setdefault(e["name"], []).append(e["dur"])
    print("  STEP0's CUDA runtime calls (count, total us):")
    for name, durations in sorted(host.items(), key=lambda kv: -sum(kv[1]))[:8]:
        print(f"    {len(durations):4d} {sum(durations):7.0f}  {name}")
    events, steps, busy = load(stack_path)
    calls = [e for e in events if e.get("cat") == "python_function"]
    gaps = idle(busy, steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"])
    print(f"  with Python's calls recorded ({span_ms(steps):.2f} ms): "
          f"the longest idle stretches and the calls overlapping them most")
    for a, b in sorted(gaps, key=lambda g: g[0] - g[1])[:GAPS]:
        step = next((s["name"] for s in steps if s["ts"] <= a < s["ts"] + s["dur"]), "?")
        print(f"    {b - a:6.0f} us idle in {step} at +{a - steps[0]['ts']:7.0f}")
        over = [(min(b, e["ts"] + e["dur"]) - max(a, e["ts"]), e) for e in calls
                if e["ts"] < b and e["ts"] + e["dur"] > a and e["dur"] < 2 * (b - a)]
        for o, e in sorted(over, key=lambda x: -x[0])[:6]:
            print(f"      {o:6.0f} of {e['dur']:6.0f} us  {e['name'][:90]}")


def main() -> None:
    prompts = bundled_prompts(BUNDLED_MODEL, 64, 256)
    for spec in sys.argv[1:]:
        report(spec, *trace(spec, prompts))


if __name__ == "__main__":
    main()

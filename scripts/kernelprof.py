"""Device time per CUDA kernel over a few engine steps on the bundled model (torch.profiler; CUDA
graph replays are traced kernel by kernel). What found the n-gram lookup's slow scan.

    python3 scripts/kernelprof.py ngram:a7:32:3 none:0:32:12     # METHOD:DRAFTS:BATCH:STEPS ...

METHOD, DRAFTS and BATCH as in stepprof. Each spec decodes BATCH held-out prompts twice to warm
up (compiles, captures, the draft policy's k), then profiles the first STEPS engine steps after
every sequence has its first token, and prints their wall time, the kernels' summed device time
and the 40 kernels that took most of it (total, calls, mean).
"""
from __future__ import annotations

import collections
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from metrale.deploy.bundled import BUNDLED_MODEL
from metrale.deploy.gpubench import bundled_prompts
from stepprof import admit, engine, sync   # this script's folder is on the path


def drain(llm, ids) -> None:
    while llm.has_work:
        llm.step()
    for i in ids:
        llm.scheduler.pop_finished(i)


def kernels(spec: str, prompts) -> None:
    method, drafts, batch, steps = spec.split(":")
    llm = engine(method, drafts)
    for _ in range(2):
        drain(llm, admit(llm, prompts[:int(batch)]))
    ids = admit(llm, prompts[:int(batch)])
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(int(steps)):
            llm.step()
        sync()
        wall = time.perf_counter() - start
    running = len(llm.scheduler.running)
    drain(llm, ids)
    llm.close()
    total = collections.defaultdict(lambda: [0.0, 0])   # name -> [device us, calls]
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name][0] += e.device_time
            total[e.name][1] += 1
    print(f"{spec}: {steps} steps in {wall * 1e3:.2f} ms (profiled), {running} sequences "
          f"running at the end; {sum(t for t, _ in total.values()) / 1e3:.2f} ms of kernels in "
          f"{sum(c for _, c in total.values())} launches")
    for name, (us, calls) in sorted(total.items(), key=lambda kv: -kv[1][0])[:40]:
        print(f"  {us / 1e3:8.3f} ms {calls:6d}x {us / calls:8.1f} us  {name[:100]}")


def main() -> None:
    prompts = bundled_prompts(BUNDLED_MODEL, 64, 256)
    for spec in sys.argv[1:]:
        kernels(spec, prompts)


if __name__ == "__main__":
    main()

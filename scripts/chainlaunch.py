"""Host time of launching a chain's rounds on the GPU: a round's graph replayed once per round
(with each round's landing copy), against the graph of `max_rounds` rounds in a row replayed
once (with one copy); and the device time of each. The bundled model, n-gram at most 3 drafts,
batch 32, each graph over padding sequences only; PDL on, then off.

    python3 scripts/chainlaunch.py
"""
import statistics
import time

import torch

from stepprof import engine
from metrale.deploy.bundled import BUNDLED_MODEL
from metrale.deploy.gpubench import bundled_prompts, greedy
from metrale.workers.models import kernels


def host_us(fn, reps: int = 40) -> float:
    """Median host microseconds of fn() called with the device idle."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def device_us(fn) -> float:
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) * 1e3


def measure(label: str, batch: int = 32) -> None:
    llm = engine("ngram", "a3")
    llm.generate(bundled_prompts(BUNDLED_MODEL, batch, 256), greedy(128))   # every graph used
    chain = llm.worker.chain
    rounds = chain.max_rounds
    for length in (1, 2, 3, 4):
        key = (batch, length, length > 1)
        if key not in chain.graphs_by_shape:
            continue
        one, many, _ = chain.graphs_by_shape[key]
        chain._reset(batch)
        chain.graphs._fill(None, batch, length)   # padding sequences only
        landed = torch.empty(rounds, batch, length + 1, dtype=torch.long, device="cuda")

        def each():
            for r in range(rounds):
                one.replay()
                landed[r].copy_(chain.landing[0, :batch, :length + 1])

        def whole():
            many.replay()
            landed.copy_(chain.landing[:, :batch, :length + 1])
        print(f"{label}, B={batch}, {length} rows a sequence: {rounds} replays of a round "
              f"{host_us(each):.0f} us host, {device_us(each):.0f} us device; one replay of "
              f"{rounds} rounds {host_us(whole):.0f} us host, {device_us(whole):.0f} us device",
              flush=True)
    del llm, chain
    torch.cuda.empty_cache()


if __name__ == "__main__":
    measure("PDL on")
    kernels.PDL = False
    measure("PDL off")

"""Where one batch's device time goes, chain by chain (meant for a GPU): the bench's B=32 batch of
bundled prompts (128 greedy tokens) per method, as gpubench's `--methods` names it.

    python3 scripts/chaintimeline.py none ngram=3 ngram@7

Each method's engine decodes the batch three times (gpubench's `decode_run`) and prints the last
run: every plan the worker ran (a prefill step, or a chain of rounds) with its rows, rounds and
drafts a round, whether it went on from the chain before on the device, its device time (CUDA
events recorded in stream order around its launch) and time a round, and the gap before it: how
long the device sat idle between the plan before and this one, waiting for the host. The events
time the device as the plans queue on it; nothing is synchronised in between.
"""
from __future__ import annotations

import sys
import time

import torch

from metrale.deploy import gpubench as g
from metrale.deploy.bundled import BUNDLED_MODEL
from metrale.workers.worker import Worker

BATCH, PROMPT_LEN, NEW_TOKENS, TURNS = 32, 256, 128, 3


def recorded(plans: list, kind: str, fn, shape):
    """fn with a CUDA event recorded before and after each call, kept in `plans` with its
    shape (rows, rounds, drafts, resumed) and host time."""
    def call(self, arg):
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        host = time.perf_counter()
        out = fn(self, arg)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        plans.append((kind, *shape(arg, out), start, end, time.perf_counter() - host))
        return out
    return call


def chain_shape(work, flight):
    return (len(work), work[0].steps, max(max(w.num_drafts, w.pad_to) for w in work),
            flight.chain[2])


def step_shape(plan, result):
    return len(plan.work), max((w.steps for w in plan.work), default=0), 0, None


def main(specs: list[str]) -> None:
    plans: list = []
    Worker._launch_chain = recorded(plans, "chain", Worker._launch_chain, chain_shape)
    Worker._execute = recorded(plans, "step", Worker._execute, step_shape)
    prompts = g.bundled_prompts(BUNDLED_MODEL, BATCH, PROMPT_LEN)
    for spec in specs:
        llm = g.method_engine(str(BUNDLED_MODEL), spec, "cuda", "auto", BATCH, PROMPT_LEN,
                              NEW_TOKENS)
        for _ in range(TURNS):
            plans.clear()
            run = g.decode_run(llm, prompts, NEW_TOKENS)
        torch.cuda.synchronize()
        first, end_before = plans[0][4], None
        print(f"{spec}: {run['tokens_per_s']:.0f} tokens/s, {1000 * run['wall_s']:.2f} ms timed, "
              f"{run['steps']} steps; slowest sequences' rounds {run['sequence_rounds'][-6:]}")
        for kind, rows, rounds, depth, resumed, start, end, host in plans:
            a, b = first.elapsed_time(start), first.elapsed_time(end)
            gap = a - end_before if end_before is not None else 0.0
            end_before = b
            print(f"  {kind:5s} rows {rows:2d} rounds {rounds} k {depth} "
                  f"resumed {'-' if resumed is None else resumed!s:5s} device {a:7.3f}-{b:7.3f} ms "
                  f"({b - a:6.3f} ms, {1000 * (b - a) / max(rounds, 1):5.0f} us a round), "
                  f"idle before {gap:6.3f} ms, host {1000 * host:6.3f} ms")
        llm.close()


if __name__ == "__main__":
    main(sys.argv[1:])

"""few_rows launch plans against cuBLAS, kernel by kernel, at the projection shapes of the
Qwen3.5-2B- and Qwen3-8B-shaped checkpoints (`gpubench`'s random ones). Each call is timed inside
a CUDA graph of 10 calls, as a step replays them (so each call's weight loads before its wait
overlap the call before), with CUDA events over 20 replays (verifyprof's timer).

    python3 scripts/fewsweep.py --rows 8 --out sweep.json          # every shape, the whole grid
    python3 scripts/fewsweep.py --shapes 2b.down,2b.o --block-n 16 --block-k 1024,2048 --stages 1

The whole grid (96 plans, each compiled once per split count it takes) is minutes of compiling;
narrow it to fit a device call.

It prints per shape and row count: cuBLAS (F.linear, plus kernels.silu_mul for [gate | up]), the
GEMV on one row, the plan few_rows_plan picks now, and the grid's fastest plan. `--out` writes
every time, and `plans.json` beside it: per shape (key "OUTxIN" or "OUTxIN silu") the fastest
plan where it beat cuBLAS at every row count timed, else null; `scripts/verifyprof.py --plans`
replays the 2B's forward with them. On the GPU machine, after `source scripts/device-env.sh`."""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from metrale.workers.cuda_graphs import capture
from metrale.workers.models import kernels
from verifyprof import plan_key, replay_ms   # this script's folder is on the path

SHAPES = {   # name: (outputs, features, [gate | up] with the SiLU fused)
    "2b.in_proj": (12352, 2048, False), "2b.out_proj": (2048, 4096, False),
    "2b.qkv": (5120, 2048, False), "2b.o": (2048, 2048, False),
    "2b.gate_up": (6144, 2048, True), "2b.down": (2048, 6144, False),
    "2b.lm_head": (151936, 2048, False),
    "8b.qkv": (6144, 4096, False), "8b.o": (4096, 4096, False),
    "8b.gate_up": (12288, 4096, True), "8b.down": (4096, 12288, False),
    "8b.lm_head": (151936, 4096, False)}


def graph_us(fn, calls: int = 10, reps: int = 20) -> float:
    """Microseconds a call of `fn`, captured `calls` times into one graph (as a step replays)."""
    graph, _ = capture(lambda: [fn() for _ in range(calls)], None)
    return replay_ms(graph, reps) * 1000 / calls


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--rows", default="8,16")
    p.add_argument("--block-n", default="16,32,64")
    p.add_argument("--block-k", default="256,1024")
    p.add_argument("--splits", default="1,2,4,8")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--stages", default="1,4")
    p.add_argument("--out", help="a JSON file for every time; plans.json goes beside it")
    args = p.parse_args()
    grid = [kernels.FewPlan(*c) for c in itertools.product(
        ints(args.block_n), ints(args.block_k), ints(args.splits), ints(args.warps),
        ints(args.stages))]
    times, plans = {}, {}
    with torch.inference_mode():
        for name in args.shapes.split(","):
            n_out, n_in, silu = SHAPES[name]
            w = torch.randn((2 if silu else 1) * n_out, n_in, device="cuda",
                            dtype=torch.bfloat16) / 30
            best_over_rows, beat_cublas = {}, True
            for m in ints(args.rows):
                x = torch.randn(m, n_in, device="cuda", dtype=torch.bfloat16)
                ref = (kernels.silu_mul(F.linear(x.float(), w.float()).to(x.dtype)) if silu
                       else F.linear(x.float(), w.float()))
                row = {"cublas": graph_us(lambda: kernels.silu_mul(F.linear(x, w)) if silu
                                          else F.linear(x, w)),
                       "gemv1": graph_us(lambda: kernels.linear_silu_mul(x[:1], w) if silu
                                         else kernels.gemv(x[:1], w))}
                now = kernels.few_rows_plan(m, n_out, n_in, silu)
                for plan in grid + ([now] if now else []):
                    if silu and plan.splits > 1:
                        continue
                    label = "/".join(map(str, plan))
                    try:
                        out = kernels.few_rows(x, w, silu_mul=silu, plan=plan)
                        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                        if err > 2e-2:
                            raise AssertionError(f"relative error {err:.3g}")
                        row[label] = graph_us(lambda: kernels.few_rows(x, w, silu_mul=silu,
                                                                       plan=plan))
                    except Exception as e:   # a plan the GPU cannot run (registers, shared memory)
                        row[label] = f"{type(e).__name__}: {str(e)[:100]}"
                timed = {k: v for k, v in row.items()
                         if isinstance(v, float) and k not in ("cublas", "gemv1")}
                best = min(timed, key=timed.get)
                best_over_rows[best] = best_over_rows.get(best, 0) + 1
                beat_cublas &= timed[best] < row["cublas"]
                times[f"{name}.m{m}"] = row
                print(f"{name} {m} rows: cuBLAS {row['cublas']:.1f} us, GEMV of 1 row "
                      f"{row['gemv1']:.1f}, now "
                      + (f"{row['/'.join(map(str, now))]:.1f}" if now else "cuBLAS")
                      + f", best {best} {timed[best]:.1f}", flush=True)
            # the plan fastest at the most row counts (ties: the first found)
            choice = max(best_over_rows, key=best_over_rows.get)
            plans[plan_key(n_out, n_in, silu)] = (list(map(int, choice.split("/")))
                                                  if beat_cublas else None)
    if args.out:
        Path(args.out).write_text(json.dumps(times, indent=1))
        (Path(args.out).parent / "plans.json").write_text(json.dumps(plans, indent=1))


if __name__ == "__main__":
    main()

"""Device time of a Qwen3.5-2B-shaped (or, with --model 8b, Qwen3-8B-shaped) target's forward as
its CUDA graph replays it, at batch 1:
a decode step (1 row) and verifies of 7 and 15 drafts (8 and 16 rows), after 512 cached tokens.
Timed with CUDA events over 100 replays of each graph alone (its buffers filled once), so the host
does not enter. Knobs for A/B runs in separate processes, one after the other:

    python3 scripts/verifyprof.py                       # as the kernels are
    python3 scripts/verifyprof.py --plan-rows 1         # large weights' verifies on cuBLAS
    python3 scripts/verifyprof.py --plan-rows 1 --delta-warps 4   # and 4 warps a recurrence
    python3 scripts/verifyprof.py --plans OUT/plans.json  # large weights' plans from fewsweep

On the GPU machine, after `source scripts/device-env.sh`."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from metrale.deploy.gpubench import kv_bytes_needed, verify_pool_bytes
from metrale.deploy.llm import LLM
from metrale.deploy.random_checkpoint import QWEN3_5_2B, QWEN3_8B, write_random_checkpoint
from metrale.workers.batch import RowsLayout
from metrale.workers.models import kernels

CONTEXT = 512
MODELS = {"2b": QWEN3_5_2B, "8b": QWEN3_8B}


def plan_key(n_out: int, n_in: int, silu_mul: bool) -> str:
    """A weight's key in a plans table (fewsweep.py writes them): "OUTxIN", " silu" added for
    [gate | up] with the SiLU fused."""
    return f"{n_out}x{n_in}" + (" silu" if silu_mul else "")


def replay_ms(graph, iters: int = 100) -> float:
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=MODELS, default="2b")
    p.add_argument("--layers", type=int, help="fewer layers than the model's")
    p.add_argument("--plan-rows", type=int, default=kernels.PLAN_ROWS,
                   help="kernels.PLAN_ROWS: most rows of a large weight few_rows takes")
    p.add_argument("--delta-warps", type=int, default=kernels.DELTA_WARPS,
                   help="kernels.DELTA_WARPS: warps a Gated DeltaNet recurrence program")
    p.add_argument("--delta-bv", type=int, default=kernels.DELTA_BV,
                   help="kernels.DELTA_BV: value columns a Gated DeltaNet recurrence program")
    p.add_argument("--plans", help="plans.json from scripts/fewsweep.py: large weights take these "
                   "(a weight it lists as null, or does not list, goes to cuBLAS)")
    p.add_argument("--dir", help="where its random checkpoint goes (default /tmp/verifyprof-MODEL)")
    args = p.parse_args()
    kernels.PLAN_ROWS, kernels.DELTA_WARPS = args.plan_rows, args.delta_warps
    kernels.DELTA_BV = args.delta_bv
    if args.plans:
        table, chosen = json.loads(Path(args.plans).read_text()), kernels.few_rows_plan

        def from_table(rows: int, n_out: int, n_in: int, silu_mul: bool):
            if kernels.small_weight(n_out, n_in, silu_mul) or rows > kernels.PLAN_ROWS:
                return chosen(rows, n_out, n_in, silu_mul)
            found = table.get(plan_key(n_out, n_in, silu_mul))
            return kernels.FewPlan(*found) if found else None
        kernels.few_rows_plan = from_table
    shape = dict(MODELS[args.model], **({"num_hidden_layers": args.layers} if args.layers else {}))
    model = str(write_random_checkpoint(Path(args.dir or f"/tmp/verifyprof-{args.model}"), shape,
                                        "cuda"))
    llm = LLM(model, device="cuda", dtype="bfloat16", max_num_seqs=1,
              kv_cache_bytes=kv_bytes_needed(model, "bfloat16", 1, CONTEXT + 16 + 16),
              speculative_method="ngram", verify_pool_bytes=verify_pool_bytes(model, "bfloat16", 1),
              max_drafts=15, capture_at_start=False)
    worker = llm.worker
    block = worker.config.block_size
    blocks = list(range(-(-(CONTEXT + 16) // block)))
    ms = {}
    for rows in (1, 8, 16):
        verify = rows > 1 and worker.ssm is not None   # per-token states into the verify pool
        layout = RowsLayout.of([([1] * rows, CONTEXT, blocks, 0, verify)], block)
        worker.graphs.run(layout)   # captures the graph and fills its buffers
        torch.cuda.synchronize()
        ms[rows] = replay_ms(worker.graphs.graphs[(1, rows, verify)][0])
    print(f"{args.model}: plan_rows={args.plan_rows} delta_warps={args.delta_warps} "
          f"delta_bv={args.delta_bv} plans={args.plans}: "
          + ", ".join(f"{r} rows {t:.3f} ms" for r, t in ms.items())
          + f"; verify 7 / decode {ms[8] / ms[1]:.3f}x, verify 15 / decode {ms[16] / ms[1]:.3f}x")


if __name__ == "__main__":
    main()

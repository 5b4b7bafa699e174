"""The Gated DeltaNet output norm (kernels.gated_rms_norm) with kernels.NORM_HEADS heads of a row a
program, 1 (one warp-sized program per head) against 2/4/8/16, timed as CUDA graphs of 50
launches (the best of 20 replays, per launch), with programmatic dependent launch as the engine
launches them.

    python3 scripts/normbench.py

Prints, per shape (8 heads of 32: the bundled model; 32 heads of 128: the Qwen3.5 shapes) and
rows (a verify of k drafts at batch B has B x (k + 1)), each setting's microseconds a call and
the share of output elements that differ from one head a program (a sum over a tile of several
heads may round otherwise). A verify of 7 drafts at B=32 runs this norm once per Gated DeltaNet
layer on 256 rows. The engine runs NORM_HEADS = 4 (deploy/results/HISTORY.md,
"Gated RMSNorm, several heads a program").
"""
from __future__ import annotations

import torch

from metrale.workers.models import kernels


def norm(x, gate, weight, per: int) -> torch.Tensor:
    kernels.NORM_HEADS = per
    return kernels.gated_rms_norm(x, gate, weight, 1e-6)


def per_launch_us(fn, launches: int = 50, replays: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / launches)
    return best


def main() -> None:
    for heads, dim in ((8, 32), (32, 128)):
        for rows in (1, 8, 32, 64, 256, 512):
            x, gate = (torch.randn(rows, heads, dim, device="cuda", dtype=torch.bfloat16)
                       for _ in range(2))
            weight = torch.randn(dim, device="cuda", dtype=torch.bfloat16)
            ref = norm(x, gate, weight, 1)
            us = per_launch_us(lambda: norm(x, gate, weight, 1))
            line = [f"{heads} heads of {dim}, {rows:3d} rows: one head a program {us:5.2f} us"]
            for per in (2, 4, 8, 16):
                if per > heads or per * dim > 2048:
                    continue
                differ = (norm(x, gate, weight, per) != ref).float().mean().item()
                us = per_launch_us(lambda: norm(x, gate, weight, per))
                line.append(f"{per} a program {us:5.2f} us ({differ:.4f} differ)")
            print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()

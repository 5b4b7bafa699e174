"""The Gated DeltaNet output norm (kernels.gated_rms_norm, one program per head of a row) against
the same arithmetic with several heads a program, timed as CUDA graphs of 50 launches (the best
of 20 replays, per launch), with programmatic dependent launch as the engine launches them.

    python3 scripts/normbench.py

Prints, per shape (8 heads of 32: the bundled model; 32 heads of 128: the Qwen3.5 shapes) and
rows (a verify of k drafts at batch B has B x (k + 1)), each variant's microseconds a call and
the share of output elements that differ from the repository's kernel (a sum over several heads'
lanes may round otherwise). A verify of 7 drafts at B=32 runs this norm once per Gated DeltaNet
layer on 256 rows. Not wired into the engine: the README's "Gated RMSNorm, several heads a
program" gives the figures and what remains before it can be.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from metrale.workers.models import kernels


@triton.jit
def _heads_together(x_ptr, gate_ptr, w_ptr, out_ptr, heads, stride_xt, stride_gt, eps,
                    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, HEADS: tl.constexpr,
                    PDL: tl.constexpr):
    """HEADS heads of one row, each rounded where kernels._gated_rms_norm_kernel rounds."""
    kernels._after_previous(PDL)
    row = tl.program_id(0)
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    d = tl.arange(0, D_PAD)
    ok = (h[:, None] < heads) & (d[None, :] < HEAD_DIM)
    at = h[:, None] * HEAD_DIM + d[None, :]
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_xt + at, mask=ok, other=0.0).to(tl.float32)
    normed = (x * tl.rsqrt(tl.sum(x * x, 1)[:, None] / HEAD_DIM + eps)).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + row * stride_gt + at, mask=ok, other=0.0).to(tl.float32)
    y = (w[None, :] * normed).to(dtype).to(tl.float32) * (gate / (1.0 + tl.exp(-gate)))
    tl.store(out_ptr + row * heads * HEAD_DIM + at, y.to(dtype), mask=ok)


def heads_together(x, gate, weight, eps, per: int) -> torch.Tensor:
    rows, heads, dim = x.shape
    out = torch.empty(rows, heads, dim, dtype=x.dtype, device=x.device)
    _heads_together[(rows, triton.cdiv(heads, per))](
        x, gate, weight, out, heads, x.stride(0), gate.stride(0), eps, HEAD_DIM=dim,
        D_PAD=triton.next_power_of_2(dim), HEADS=per, **kernels._pdl(), num_warps=1)
    return out


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
            ref = kernels.gated_rms_norm(x, gate, weight, 1e-6)
            us = per_launch_us(lambda: kernels.gated_rms_norm(x, gate, weight, 1e-6))
            line = [f"{heads} heads of {dim}, {rows:3d} rows: one head a program {us:5.2f} us"]
            for per in (2, 4, 8, 16):
                if per > heads or per * dim > 2048:
                    continue
                differ = (heads_together(x, gate, weight, 1e-6, per) != ref).float().mean().item()
                us = per_launch_us(lambda: heads_together(x, gate, weight, 1e-6, per))
                line.append(f"{per} a program {us:5.2f} us ({differ:.4f} differ)")
            print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()

"""The Gated DeltaNet recurrence (kernels.gated_delta_rule) with each row's output read after the
state's update (two sums over the keys in turn) against read from the state before it (one
pass, kernels.DELTA_ONE_PASS_KEYS), timed as CUDA graphs of 50 launches (the best of 20
replays, per launch) with programmatic dependent launch, as the engine launches them.

    python3 scripts/deltabench.py

Prints, per shape (4 key and 8 value heads of 32: the bundled model; 16 and 32 heads of 128: the
Qwen3.5-2B shapes), sequences and rows each (1: a decode step; 8: a verify of 7 drafts, whose
per-row states go to a verify pool), the microseconds a call of each and the largest relative
difference of their outputs and states. The engine reads in one pass where the key heads have
32 features or fewer (DELTA_ONE_PASS_KEYS; deploy/results/HISTORY.md, "One pass over the keys").
"""
from __future__ import annotations

import torch

from metrale.workers.models import kernels
from normbench import per_launch_us   # this script's folder is on the path


def call(inputs, state, keep, offsets, one_pass: bool):
    kernels.DELTA_ONE_PASS_KEYS = inputs[0].shape[-1] if one_pass else 0
    q, k, v, a, b, a_log, dt_bias, slots = inputs
    return kernels.gated_delta_rule(q, k, v, a, b, a_log, dt_bias, state, slots, keep, offsets)


def main() -> None:
    for hk, hv, dim in ((4, 8, 32), (16, 32, 128)):
        for seqs in (1, 8, 32):
            for rows in (1, 8):
                g = torch.Generator("cuda").manual_seed(seqs * rows)

                def rand(*shape, dtype=torch.bfloat16):
                    return torch.randn(*shape, generator=g, device="cuda").to(dtype)
                q, k = rand(seqs, rows, hk, dim), rand(seqs, rows, hk, dim)
                v, a, b = rand(seqs, rows, hv, dim), rand(seqs, rows, hv), rand(seqs, rows, hv)
                inputs = (q, k, v, a, b, rand(hv, dtype=torch.float32) * 0.5,
                          rand(hv, dtype=torch.float32), torch.arange(seqs, device="cuda"))
                start = rand(seqs, hv, dim, dim, dtype=torch.float32) * 0.1
                verify = rows > 1
                offsets = (torch.arange(seqs, device="cuda") * rows) if verify else None
                results, times = [], []
                for one_pass in (False, True):
                    state = start.clone()
                    keep = (torch.empty(seqs * rows, hv, dim, dim, device="cuda")
                            if verify else None)
                    out = call(inputs, state, keep, offsets, one_pass)
                    results.append((out.float(), keep if verify else state))
                    state = start.clone()   # timed: decode steps go on from where they leave it
                    times.append(per_launch_us(
                        lambda: call(inputs, state, keep, offsets, one_pass)))
                (o0, s0), (o1, s1) = results
                out_diff = ((o1 - o0).abs().max() / o0.abs().max()).item()
                state_diff = ((s1 - s0).abs().max() / s0.abs().max()).item()
                print(f"{hk}/{hv} heads of {dim}, {seqs:2d} sequences of {rows} rows: "
                      f"two passes {times[0]:6.2f} us, one pass {times[1]:6.2f} us "
                      f"({times[0] / times[1]:.2f}x); differ: outputs {out_diff:.1e}, "
                      f"states {state_diff:.1e}", flush=True)


if __name__ == "__main__":
    main()

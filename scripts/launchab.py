"""A/B of how a decode step launches its kernels, in one process: one engine per variant, built
and captured with the variant's settings, the variants taking turns and each keeping its median.

    python3 scripts/launchab.py [--models qwen3-8b,bundled] [--batch-sizes 1,8] [--turns 5]

Variants: `separate` (the MLP's GEMV and SiLU x up as two kernels, plain launches), `fused` (one
GEMV kernel applies the SiLU), `fused+pdl` (and every kernel launched with programmatic dependent
launch, kernels.PDL), each GEMV program loading its first 1024 weights before its wait, and
`fused+pdl+first` (its first kernels.GEMV_FIRST). Prints tokens/s and ms per step of plain greedy
decoding per variant, each variant's ratio to `separate`, at B=1 the step against the bandwidth
floor as gpubench computes it, and whether each variant decoded the tokens `separate` decoded (a
GEMV that sums another first stretch adds in another order, which can flip near-tied logits).
"""
import argparse
import statistics
import sys

import torch

from metrale.cluster.params import SamplingParams
from metrale.deploy.gpubench import (add_ab_arguments, copy_bandwidth, decode_engine,
                                     decode_model, decode_run, weight_bytes)
from metrale.workers.models import kernels

FUSED = kernels.linear_silu_mul
FIRST = kernels.GEMV_FIRST
VARIANTS = {"separate": (False, False, 1024), "fused": (True, False, 1024),
            "fused+pdl": (True, True, 1024), "fused+pdl+first": (True, True, FIRST)}


def use(variant: str) -> None:
    fused, pdl, first = VARIANTS[variant]
    kernels.PDL, kernels.GEMV_FIRST = pdl, first
    kernels.linear_silu_mul = FUSED if fused else (
        lambda x, w: kernels.silu_mul(kernels.linear(x, w)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    add_ab_arguments(p, models="qwen3-8b,bundled", batch_sizes="1,8")
    args = p.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    top = max(sizes)
    bandwidth = copy_bandwidth(torch.device("cuda"), 2 << 30)
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    for name in args.models.split(","):
        model_dir, prompts = decode_model(name, top, args.ckpt_dir)
        engines = {}
        for variant in VARIANTS:
            use(variant)
            engines[variant] = decode_engine(model_dir, prompts, args.new_tokens)
        floor_ms = weight_bytes(engines["separate"].worker.model) / bandwidth * 1e3
        outputs = {}
        for b in sizes:
            runs = {v: [] for v in VARIANTS}
            for variant, llm in engines.items():   # warm-up: kernels compile
                use(variant)
                decode_run(llm, prompts[:b], args.new_tokens)
            for _ in range(args.turns):
                for variant, llm in engines.items():
                    use(variant)
                    runs[variant].append(decode_run(llm, prompts[:b], args.new_tokens))
            base = statistics.median(r["tokens_per_s"] for r in runs["separate"])
            for variant, r in runs.items():
                tps = statistics.median(x["tokens_per_s"] for x in r)
                ms = statistics.median(x["ms_per_step"] for x in r)
                floor = f", {ms / floor_ms:.3f}x the floor ({floor_ms:.3f} ms)" if b == 1 else ""
                print(f"{name} B={b} {variant:10s} {tps:8.0f} tokens/s, {ms:.3f} ms a step, "
                      f"{tps / base:.3f}x separate{floor}", flush=True)
            params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
            for variant, llm in engines.items():   # the same tokens as separate?
                use(variant)
                outputs[variant] = [o.token_ids for o in llm.generate(prompts[:b], params)]
            same = {v: outputs[v] == outputs["separate"] for v in VARIANTS}
            print(f"{name} B={b} same tokens as separate: {same}", flush=True)
        del engines
        torch.cuda.empty_cache()
    use("fused+pdl+first")


if __name__ == "__main__":
    sys.exit(main())

"""A/B of plain decoding with and without steps launched ahead (`LLM.step` keeping a second
decode step on the device while the host reads the first), in one process on one engine per
model: the two settings take turns, and each keeps the median of its runs.

    python3 scripts/aheadab.py [--models bundled,qwen3-8b] [--batch-sizes 1,8,32] [--turns 5]
"""
import argparse
import statistics
import sys
from pathlib import Path

import torch

from metrale.deploy.bundled import BUNDLED_MODEL
from metrale.deploy.gpubench import SHAPES, bundled_prompts, decode_run, kv_bytes_needed
from metrale.deploy.llm import LLM
from metrale.deploy.random_checkpoint import random_prompts, write_random_checkpoint
from metrale.workers.models.config import ModelConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--models", default="bundled,qwen3-8b")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--ckpt-dir", default="/tmp/metrale-bench")
    args = p.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    top = max(sizes)
    for name in args.models.split(","):
        if name == "bundled":
            model_dir, length = str(BUNDLED_MODEL), 256
            prompts = bundled_prompts(Path(model_dir), top, length)
        else:
            model_dir = str(write_random_checkpoint(Path(args.ckpt_dir) / name, SHAPES[name],
                                                    "cuda"))
            length = 512
            prompts = random_prompts(top, length, ModelConfig.from_dir(model_dir).vocab_size)
        llm = LLM(model_dir, device="cuda", dtype="bfloat16", max_num_seqs=top,
                  kv_cache_bytes=kv_bytes_needed(model_dir, "bfloat16", top,
                                                 length + args.new_tokens + 16),
                  max_num_batched_tokens=min(top * (length + 1), 16384), warmup_prefill_rows=0)
        assert llm._pipelined, "the engine does not launch ahead (no CUDA graphs?)"
        for b in sizes:
            decode_run(llm, prompts[:b], args.new_tokens)   # warm-up, kernels compile
            runs = {True: [], False: []}
            for _ in range(args.turns):
                for ahead in (True, False):
                    llm._pipelined = ahead
                    runs[ahead].append(decode_run(llm, prompts[:b], args.new_tokens))
            llm._pipelined = True
            on, off = ({"tps": statistics.median(r["tokens_per_s"] for r in runs[a]),
                        "ms": statistics.median(r["ms_per_step"] for r in runs[a])}
                       for a in (True, False))
            print(f"{name} B={b}: ahead {on['tps']:.0f} tokens/s ({on['ms']:.3f} ms a step), "
                  f"one at a time {off['tps']:.0f} ({off['ms']:.3f} ms): "
                  f"{on['tps'] / off['tps']:.2f}x", flush=True)
        del llm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())

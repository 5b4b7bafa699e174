"""A/B of plain decoding with and without steps launched ahead (`LLM.step` keeping a second
decode step on the device while the host reads the first), in one process on one engine per
model: the two settings take turns, and each keeps the median of its runs.

    python3 scripts/aheadab.py [--models bundled,qwen3-8b] [--batch-sizes 1,8,32] [--turns 5]
"""
import argparse
import statistics
import sys

import torch

from metrale.deploy.gpubench import add_ab_arguments, decode_engine, decode_model, decode_run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    add_ab_arguments(p, models="bundled,qwen3-8b", batch_sizes="1,8,32")
    args = p.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    top = max(sizes)
    for name in args.models.split(","):
        model_dir, prompts = decode_model(name, top, args.ckpt_dir)
        llm = decode_engine(model_dir, prompts, args.new_tokens)
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

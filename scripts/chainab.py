"""A/B of chain lengths for greedy n-gram rounds on the bundled model (`chain_rounds`: rounds one
plan runs on the device before the host reads them), with plain decoding beside: one engine per
setting in one process, the engines taking turns at each batch size, each keeping its median.

    python3 scripts/chainab.py [--rounds 0,4,8,16] [--drafts 7] [--batch-sizes 1,8,16,32,64]
                               [--turns 5] [--steady-waves 4]

Prints per batch size and setting the median tokens/s, its ratio to plain decoding's, the median
full-batch tokens/s (until the first sequence finished), engine steps and every turn's tokens/s.
With --steady-waves N every turn also runs gpubench's steady run (N x B requests, at most B
running, prefills included), printed as a second line per setting ("steady").
"""
import argparse
import statistics

from metrale.deploy.gpubench import (MAX_VERIFY, bundled_prompts, decode_run, kv_bytes_needed,
                                      steady_run)
from metrale.deploy.bundled import BUNDLED_MODEL
from metrale.deploy.llm import LLM


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", default="4,8,16")
    p.add_argument("--drafts", type=int, default=7, help="most drafts a round (the policy picks)")
    p.add_argument("--batch-sizes", default="1,8,16,32,64")
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--steady-waves", type=int, default=0)
    args = p.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    prompts = bundled_prompts(BUNDLED_MODEL, max(sizes) * max(args.steady_waves, 1), 256)
    settings = {"none": dict(speculative_method="none")}
    for rounds in map(int, args.rounds.split(",")):
        settings[f"ngram@{args.drafts} chain {rounds}"] = dict(
            speculative_method="ngram", num_drafts=args.drafts, chain_rounds=rounds)
    model = str(BUNDLED_MODEL)
    engines = {name: LLM(model, max_num_seqs=max(sizes), max_num_batched_tokens=16384,
                         kv_cache_bytes=kv_bytes_needed(model, "auto", max(sizes),
                                                        256 + args.new_tokens + MAX_VERIFY),
                         **kw)
               for name, kw in settings.items()}
    for b in sizes:
        for llm in engines.values():
            decode_run(llm, prompts[:b], args.new_tokens)   # warm-up: the policy's k settles
        runs = {name: [] for name in engines}
        steady = {name: [] for name in engines}
        for _ in range(args.turns):
            for name, llm in engines.items():
                runs[name].append(decode_run(llm, prompts[:b], args.new_tokens))
                if args.steady_waves:
                    steady[name].append(steady_run(llm, prompts[:b * args.steady_waves], b,
                                                   args.new_tokens)["steady_tokens_per_s"])
        plain = statistics.median(r["tokens_per_s"] for r in runs["none"])
        for name, these in runs.items():
            tps = [r["tokens_per_s"] for r in these]
            full = statistics.median(r["full_batch_tokens_per_s"] or 0 for r in these)
            print(f"B={b:<3d} {name:20s} {statistics.median(tps):9.0f} tokens/s "
                  f"{statistics.median(tps) / plain:5.2f}x  full batch {full:9.0f}  steps "
                  f"{statistics.median(r['steps'] for r in these):g}  turns "
                  f"{[round(t) for t in tps]}", flush=True)
        for name, these in steady.items():
            if these:
                print(f"B={b:<3d} {name:20s} {statistics.median(these):9.0f} tokens/s "
                      f"{statistics.median(these) / statistics.median(steady['none']):5.2f}x  "
                      f"steady, turns {[round(t) for t in these]}", flush=True)


if __name__ == "__main__":
    main()

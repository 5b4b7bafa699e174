"""A/B of the draft policy's two parts added on 2026-12-05 on the bundled model, with plain
decoding beside: one engine per setting in one process, the engines taking turns at each batch
size after a warm-up run each, each keeping its median.

    python3 scripts/policyab.py [--methods dflash,mtp] [--batch-sizes 1,8,32,64] [--turns 3]
                                [--steady-waves 2] [--json out.json]

Settings per method: as built; "pooled" (each round's expected tokens at the rates pooled over
all sequences, not the mean of its sequences' own); "no-k0-chain" (a plan the policy gives
k = 0 runs one step, not a chain of plain steps); "before" (both, the policy as at 69d4067).
Prints per batch size and setting the single batch's median tokens/s and its ratio to plain
decoding's, the same for the steady run (N x B requests of 128 +-50% tokens, at most B
running), the engine steps and every turn's tokens/s.
"""
import argparse
import json
import statistics

from metrale.cluster.draft_policy import DraftPolicy
from metrale.deploy.bundled import BUNDLED_DFLASH, BUNDLED_MODEL
from metrale.deploy.gpubench import (MAX_VERIFY, bundled_prompts, decode_run, kv_bytes_needed,
                                      steady_lengths, steady_run)
from metrale.deploy.llm import LLM


def pooled(llm: LLM) -> None:
    policy = llm.scheduler.drafts
    policy.round_tokens = lambda seqs: DraftPolicy.round_tokens(policy, None)


def no_plain_chains(llm: LLM) -> None:
    sched = llm.scheduler
    chain = sched._chain_rounds
    sched._chain_rounds = lambda chosen, pad: (
        chain(chosen, pad) if max((k for _, _, k in chosen), default=0) else 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--methods", default="dflash,mtp")
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--steady-waves", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    waves = args.steady_waves
    prompts = bundled_prompts(BUNDLED_MODEL, max(sizes) * max(waves, 1), 256)
    settings = {"none": ({"speculative_method": "none"}, [])}
    for m in args.methods.split(","):
        kw = {"speculative_method": m}
        if m == "dflash":
            kw["drafter"] = str(BUNDLED_DFLASH)
        settings[m] = (kw, [])
        settings[f"{m} pooled"] = (kw, [pooled])
        settings[f"{m} no-k0-chain"] = (kw, [no_plain_chains])
        settings[f"{m} before"] = (kw, [pooled, no_plain_chains])
    model = str(BUNDLED_MODEL)
    engines = {}
    for name, (kw, patches) in settings.items():
        engines[name] = LLM(model, max_num_seqs=max(sizes), max_num_batched_tokens=16384,
                            kv_cache_bytes=kv_bytes_needed(model, "auto", max(sizes),
                                                           256 + 192 + MAX_VERIFY), **kw)
        for patch in patches:
            patch(engines[name])
    out: dict = {}
    for b in sizes:
        for llm in engines.values():
            decode_run(llm, prompts[:b], 128)   # warm-up: the policy's k settles
        runs = {name: [] for name in engines}
        steady = {name: [] for name in engines}
        lengths = steady_lengths(b * waves, 128, 0.5)
        for _ in range(args.turns):
            for name, llm in engines.items():
                runs[name].append(decode_run(llm, prompts[:b], 128))
                if waves:
                    steady[name].append(steady_run(llm, prompts[:b * waves], b, lengths)
                                        ["steady_tokens_per_s"])
        plain = statistics.median(r["tokens_per_s"] for r in runs["none"])
        plain_steady = statistics.median(steady["none"]) if waves else 1.0
        for name, these in runs.items():
            tps = [r["tokens_per_s"] for r in these]
            single = statistics.median(tps)
            held = statistics.median(steady[name]) if waves else 0.0
            out.setdefault(name, {})[b] = {"tokens_per_s": tps, "steady_tokens_per_s": steady[name],
                                           "steps": [r["steps"] for r in these],
                                           "draft_policy": these[-1].get("draft_policy")}
            print(f"B={b:<3d} {name:20s} {single:9.0f} {single / plain:5.2f}x  steady {held:9.0f} "
                  f"{held / plain_steady:5.2f}x  steps "
                  f"{statistics.median(r['steps'] for r in these):g}  turns "
                  f"{[round(t) for t in tps]}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()

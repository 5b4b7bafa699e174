"""Each sequence's rounds in one batch of the bench's prompts, against the rounds its own output
needs at a fixed k: whether a run's slowest sequence was slow by its text or by the draft policy.

    python3 scripts/seqrounds.py run OUT.json ngram@3 ngram=3    # GPU: a fresh engine per method
    python3 scripts/seqrounds.py replay OUT.json                   # anywhere: the fixed-k replay

`run` decodes the bench's 32 bundled prompts (128 greedy tokens) three times per method, as
gpubench's `--methods` names it, and keeps each sequence's output, rounds, rounds with drafts
and drafts. `replay` drafts each sequence's output again (`lookup_rounds`; the worker's
default n-gram sizes, k the method's most drafts every round) and counts the rounds it would
take: greedy tokens are the same whatever the drafts, so that is what the sequence needs by its
text at that k. A round "without drafts" is one that carried none: k = 0 chosen by the policy,
or (on the CPU, whose proposer drafts nothing without a match) no n-gram found; on a GPU the
lookup pads a missing match with filler drafts, so there it means k = 0.
"""
import json
import os
import sys

from metrale.deploy import gpubench as g
from metrale.cluster.engine import DEFAULT_DRAFTS
from metrale.deploy.bundled import BUNDLED_DFLASH, BUNDLED_MODEL
from metrale.drafting.ngram import lookup_rounds
from metrale.workers.worker import WorkerConfig

BATCH, PROMPT_LEN, NEW_TOKENS, TURNS = 32, 256, 128, 3


def run(path: str, specs: list[str]) -> None:
    prompts = g.bundled_prompts(BUNDLED_MODEL, BATCH, PROMPT_LEN)
    out = {"prompts": prompts, "runs": {}}
    for spec in specs:
        llm = g.method_engine(str(BUNDLED_MODEL), spec, os.environ.get("DEVICE", "cuda"), "auto",
                              BATCH, PROMPT_LEN, NEW_TOKENS, str(BUNDLED_DFLASH))
        for turn in range(TURNS):
            ids = [llm.add_request(p, g.greedy(NEW_TOKENS), streamed=False) for p in prompts]
            while llm.has_work:
                llm.step()
            seqs = [llm.scheduler.pop_finished(i)[0] for i in ids]
            out["runs"][f"{spec}#{turn}"] = [
                {"out": s.output_ids, "rounds": len(s.output_ids) - 1 - s.spec.drafts_accepted,
                 "spec_rounds": s.spec.rounds, "proposed": s.spec.drafts_proposed,
                 "accepted": s.spec.drafts_accepted} for s in seqs]
        llm.close()
    with open(path, "w") as f:
        json.dump(out, f)


def replay(path: str) -> None:
    with open(path) as f:
        data = json.load(f)
    for name, seqs in data["runs"].items():
        k = g.method_options(name.split("#")[0])["num_drafts"] or DEFAULT_DRAFTS
        needs = [lookup_rounds(prompt, s["out"], k, WorkerConfig.ngram_min,
                               WorkerConfig.ngram_max) for prompt, s in zip(data["prompts"], seqs)]
        rows = sorted((s["rounds"], need, s["rounds"] - s["spec_rounds"], s["proposed"], i)
                      for i, (s, need) in enumerate(zip(seqs, needs)))
        print(f"{name}: slowest {rows[-1][0]} rounds; at k = {k} every round its text needs "
              f"{max(r[1] for r in rows)}")
        for rounds, fixed, bare, drafts, i in rows[-6:]:
            print(f"   sequence {i:2d}: {rounds:3d} rounds ({bare:2d} without drafts, {drafts:3d} "
                  f"drafts), {fixed:3d} at k = {k}")


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3:])
    else:
        replay(sys.argv[2])

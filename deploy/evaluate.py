"""Evaluates a model and its drafters on held-out files: perplexity, acceptance, plain vs speculative speed."""

from __future__ import annotations

import json
import math
import sysconfig
import time
from pathlib import Path

import torch

from metrale.cluster.params import SamplingParams
from metrale.deploy.llm import LLM
from metrale.drafting.stats import SpecStats
from metrale.workers.batch import ForwardBatch


def heldout_texts(model_dir: Path) -> tuple[list[str], dict]:
    """The held-out files listed in the model's manifest, read from this interpreter's stdlib."""
    manifest = json.loads((model_dir / "heldout.json").read_text())
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = [(root / rel).read_text(encoding="utf-8", errors="replace")
             for rel in manifest["heldout"] if (root / rel).is_file()]
    info = {"listed": len(manifest["heldout"]), "found": len(texts),
            "trained_on_python": manifest["python"], "evaluated_on_python": sysconfig.get_python_version()}
    return texts, info


@torch.inference_mode()
def perplexity(llm: LLM, token_lists: list[list[int]], window: int, max_tokens: int) -> float:
    worker = llm.worker
    blocks = list(range(-(-window // worker.config.block_size)))
    nll, count = 0.0, 0
    for ids in token_lists:
        for start in range(0, len(ids) - 1, window):
            chunk = ids[start:start + window + 1]
            if len(chunk) < 2 or count >= max_tokens:
                break
            if worker.ssm is not None:
                worker.ssm.reset([0])
            batch = ForwardBatch.build([(chunk[:-1], 0, blocks, 0)], worker.config.block_size,
                                       worker.device)
            hidden, _ = worker.model(batch, worker.kv, worker.ssm)
            logits = worker.model.logits(hidden)
            target = torch.tensor(chunk[1:], device=logits.device)
            nll += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
            count += len(chunk) - 1
    return math.exp(nll / max(count, 1))


def prompts_from(token_lists: list[list[int]], count: int, length: int) -> list[list[int]]:
    """One prompt of `length` tokens from each of `count` files long enough, at a fixed offset."""
    long = [ids for ids in token_lists if len(ids) >= 3 * length]
    step = max(len(long) // count, 1)
    return [ids[length:2 * length] for ids in long[::step][:count]]


def speculative_runs(model_dir: Path, dflash_dir: Path | None, ks: list[int]):
    runs = [("mtp", k, None) for k in ks]
    if dflash_dir is not None:
        gamma = json.loads((dflash_dir / "config.json").read_text())["block_size"]
        runs += [("dflash", k, dflash_dir) for k in sorted({*[k for k in ks if k < gamma - 1],
                                                           gamma - 1})]
    runs += [("ngram", 3, None), ("self", 3, None)]
    return runs


def evaluate(model_dir: Path, dflash_dir: Path | None = None, *, num_prompts: int = 16,
             prompt_tokens: int = 128, new_tokens: int = 128, ks=(1, 3, 5),
             ppl_tokens: int = 60_000, speed_prompts: int = 4, device: str = "cpu",
             dtype: str = "float32") -> dict:
    model_dir = Path(model_dir)
    texts, files = heldout_texts(model_dir)
    plain = LLM(model_dir, device=device, dtype=dtype, max_num_seqs=num_prompts)
    token_lists = [plain.encode(t) for t in texts]
    result = {"model": str(model_dir), "files": files, "device": device, "dtype": dtype,
              "perplexity": round(perplexity(plain, token_lists, 512, ppl_tokens), 3)}
    prompts = prompts_from(token_lists, num_prompts, prompt_tokens)
    result["prompts"] = len(prompts)
    acceptance = []
    for method, k, drafter in speculative_runs(model_dir, dflash_dir, list(ks)):
        llm = LLM(model_dir, device=device, dtype=dtype, max_num_seqs=num_prompts,
                  speculative_method=method, num_drafts=k, adaptive_drafts=False,
                  drafter=drafter)   # acceptance at this k, every round
        row = {"method": method, "k": k}
        for temperature in (0.0, 1.0):
            llm.scheduler.stats = SpecStats()
            llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=temperature,
                                                 seed=0, ignore_eos=True))
            row[f"T{temperature:g}"] = llm.scheduler.stats.as_dict()
        acceptance.append(row)
    result["acceptance"] = acceptance
    result["speed_batch1_T0"] = speed(model_dir, dflash_dir, prompts[:speed_prompts], new_tokens,
                                      device, dtype)
    sample = plain.generate([texts[0][:400]], SamplingParams(max_tokens=120, temperature=0))[0]
    result["sample"] = {"prompt": texts[0][:400], "completion": sample.text}
    return result


def speed(model_dir, dflash_dir, prompts, new_tokens, device, dtype) -> dict:
    """Tokens/s at batch 1 (one prompt at a time), plain and speculative, in the same run."""
    configs = [("none", None, None), ("mtp", 3, None)]
    if dflash_dir is not None:
        configs.append(("dflash", None, dflash_dir))
    out = {}
    for method, k, drafter in configs:
        llm = LLM(model_dir, device=device, dtype=dtype, speculative_method=method, num_drafts=k,
                  drafter=drafter)
        llm.generate([prompts[0]], SamplingParams(max_tokens=8, temperature=0))   # warm up
        tokens, start = 0, time.perf_counter()
        for p in prompts:
            tokens += len(llm.generate([p], SamplingParams(max_tokens=new_tokens, temperature=0,
                                                           ignore_eos=True))[0].token_ids)
        out[method] = round(tokens / (time.perf_counter() - start), 2)
    out["ratios"] = {m: round(v / out["none"], 3) for m, v in out.items() if m != "none"}
    return out


def format_table(result: dict) -> str:
    lines = [f"perplexity on {result['files']['found']} held-out files: {result['perplexity']}",
             "", "| method | k | mean acceptance length T=0 | T=1 | acceptance per position (T=0) |",
             "| --- | --- | --- | --- | --- |"]
    for row in result["acceptance"]:
        per = ", ".join(f"{r:.2f}" for r in row["T0"]["acceptance_rate_at"])
        lines.append(f"| {row['method']} | {row['k']} | {row['T0']['mean_acceptance_length']} | "
                     f"{row['T1']['mean_acceptance_length']} | {per} |")
    s = result["speed_batch1_T0"]
    lines += ["", "tokens/s at batch 1 on " + result["device"] + ": " +
              ", ".join(f"{m} {v}" for m, v in s.items() if m != "ratios") +
              " (speculative / plain: " + ", ".join(f"{m} {r}x" for m, r in s["ratios"].items()) + ")"]
    return "\n".join(lines)

"""The `metrale` command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from metrale.cluster.params import RequestError, SamplingParams
from metrale.deploy.bundled import bundled_paths
from metrale.drafting.proposer import METHODS
from metrale.workers.models import CheckpointError


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate completions for prompts in this process")
    p.add_argument("--model", default=None,
                   help="Hugging Face checkpoint directory (default: the bundled demo model)")
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--kv-cache-mb", type=int, default=256, help="KV cache budget in MiB")
    p.add_argument("--speculative-method", default="none", choices=list(METHODS))
    p.add_argument("--num-drafts", type=int, default=None,
                   help="most drafts per round (default: the DFlash block size - 1, else 3)")
    p.add_argument("--adaptive-drafts", action=argparse.BooleanOptionalAction, default=True,
                   help="choose each round's drafts (0 to --num-drafts) from measured acceptance "
                        "and step times (default); --no-adaptive-drafts: always --num-drafts")
    p.add_argument("--drafter", default=None,
                   help="DFlash drafter directory (default with the bundled model: its drafter)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model over N worker actors (GPUs) on a local or running Ray")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="GPU kernels: auto (Triton on CUDA) or torch")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="replay decode/verify steps as CUDA graphs (default on a GPU)")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt, per line")


def cmd_generate(args) -> int:
    from metrale.deploy.llm import LLM
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                                seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    except RequestError as e:
        print(f"metrale generate: {e}", file=sys.stderr)
        return 2
    try:
        model, drafter = bundled_paths(args.model, args.drafter, args.speculative_method)
        llm = LLM(model, device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  kv_cache_bytes=args.kv_cache_mb << 20,
                  speculative_method=args.speculative_method, num_drafts=args.num_drafts,
                  adaptive_drafts=args.adaptive_drafts, drafter=drafter,
                  tensor_parallel_size=args.tensor_parallel_size,
                  attention_backend=args.attention_backend, cuda_graphs=args.cuda_graphs)
    except (CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"metrale generate: {e}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    with llm:
        outputs = llm.generate(args.prompt, params)
    elapsed = time.perf_counter() - start
    failed = 0
    for out in outputs:
        if out.error:
            failed += 1
            record = {"error": out.error}
            print(json.dumps(record) if args.json else f"error: {out.error}",
                  file=sys.stdout if args.json else sys.stderr)
            continue
        if args.json:
            spec = out.spec.as_dict()
            print(json.dumps({"text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason, "usage": out.usage,
                              "spec": {k: spec[k] for k in ("rounds", "drafts_proposed",
                                                            "drafts_accepted",
                                                            "mean_acceptance_length")}}))
        else:
            print(out.text)
    if not args.json:
        tokens = sum(o.usage["completion_tokens"] for o in outputs if not o.error)
        print(f"[{tokens} tokens in {elapsed:.2f}s]", file=sys.stderr)
    return 1 if failed else 0


def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="train the demo model (tokenizer, target, MTP, DFlash)")
    p.add_argument("--out", required=True, help="output directory (gets target/ and dflash/)")
    p.add_argument("--tiny", action="store_true", help="a few steps of a tiny configuration")
    p.add_argument("--device", default="auto")
    p.add_argument("--stages", default="data,target,mtp,dflash",
                   help="comma-separated stages; later stages alone reuse what earlier ones wrote "
                        "in --out (data: tokenizer, held-out manifest, encoded corpus)")
    p.add_argument("--stage-seconds", default=None,
                   help="time budgets, e.g. target=230,mtp=100: a stage stops early past its "
                        "budget (the log records the steps)")
    for name in ("target-steps", "mtp-steps", "dflash-steps", "rollouts", "batch", "seq-len"):
        p.add_argument(f"--{name}", type=int, default=None)


def cmd_train(args) -> int:
    from dataclasses import replace
    from pathlib import Path

    from metrale.deploy.train import TrainConfig, build
    cfg = TrainConfig.tiny(Path(args.out)) if args.tiny else TrainConfig(Path(args.out))
    overrides = {k: v for k, v in vars(args).items()
                 if k in ("target_steps", "mtp_steps", "dflash_steps", "rollouts", "batch",
                          "seq_len") and v is not None}
    budgets = None
    if args.stage_seconds:
        budgets = {stage: float(seconds) for stage, seconds in
                   (item.split("=") for item in args.stage_seconds.split(","))}
    cfg = replace(cfg, device=args.device if args.device != "auto" else cfg.device,
                  stage_seconds=budgets, **overrides)
    print(json.dumps(build(cfg, tuple(args.stages.split(","))), indent=2))
    return 0


def _eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="perplexity, acceptance and speed on the held-out files")
    p.add_argument("--model", default=None, help="target directory (default: the bundled model)")
    p.add_argument("--drafter", default=None, help="DFlash drafter (default: the bundled one)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--device", default="cpu")
    p.add_argument("--output", default=None, help="write the results as JSON here")


def cmd_eval(args) -> int:
    from pathlib import Path

    from metrale.deploy.evaluate import evaluate, format_table
    model, drafter = bundled_paths(args.model, args.drafter, "dflash")
    result = evaluate(Path(model), Path(drafter) if drafter else None, num_prompts=args.prompts,
                      new_tokens=args.new_tokens, device=args.device)
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(format_table(result))
    return 0


def _bench_parser(sub) -> None:
    from metrale.deploy.gpubench import add_arguments
    p = sub.add_parser("bench", help="decode speed against the targets: tokens/s by batch size "
                       "and proposer, verify cost, bandwidth floor, transformers generate")
    add_arguments(p)


def cmd_bench(args) -> int:
    from metrale.deploy.gpubench import run
    return run(args)


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve an OpenAI-compatible endpoint on Ray Serve")
    p.add_argument("--config", default=None, help="YAML file of MetraleConfig settings")
    p.add_argument("--model", default=None, help="Hugging Face checkpoint directory")
    p.add_argument("--speculative-method", default=None, choices=list(METHODS))
    p.add_argument("--num-drafts", type=int, default=None, help="most drafts per round")
    p.add_argument("--adaptive-drafts", action=argparse.BooleanOptionalAction, default=None,
                   help="measured best drafts per round, up to --num-drafts (default); "
                        "--no-adaptive-drafts: always --num-drafts")
    p.add_argument("--drafter", default=None, help="DFlash drafter directory")
    p.add_argument("--replicas", type=int, default=None, help="model replicas (data parallel)")
    p.add_argument("--tensor-parallel-size", type=int, default=None,
                   help="GPUs (worker actors) each replica's model is split over")
    p.add_argument("--attention-backend", default=None, choices=["auto", "torch", "triton"],
                   help="GPU kernels: auto (Triton on CUDA) or torch")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay decode/verify steps as CUDA graphs (default on a GPU)")
    p.add_argument("--host", default=None, help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="listen port (default 8000)")
    p.add_argument("--direct-port", type=int, default=None,
                   help="also serve on this port from the ingress replica itself, without "
                        "Serve's proxy (Ray Serve direct ingress; faster on few CPUs)")


def cmd_serve(args) -> int:
    from metrale.deploy.config import ConfigError, MetraleConfig
    from metrale.deploy.serve import run_server
    try:
        config = MetraleConfig.load(
            args.config, model=args.model, speculative_method=args.speculative_method,
            num_drafts=args.num_drafts, adaptive_drafts=args.adaptive_drafts,
            drafter=args.drafter, replicas=args.replicas,
            tensor_parallel_size=args.tensor_parallel_size, host=args.host, port=args.port,
            direct_port=args.direct_port,
            attention_backend=args.attention_backend, cuda_graphs=args.cuda_graphs)
        return run_server(config)
    except (ConfigError, CheckpointError) as e:
        print(f"metrale serve: {e}", file=sys.stderr)
        return 2


def _k8s_parser(sub) -> None:
    p = sub.add_parser("k8s", help="KubeRay manifests")
    k8s = p.add_subparsers(dest="k8s_command", required=True)
    v = k8s.add_parser("validate", help="check manifests against the KubeRay CRDs, strictly, and "
                       "their Serve configs against metrale's config")
    v.add_argument("--crds", default="../shared/k8s-crds",
                   help="a CRD YAML file or a folder of them, e.g. written by `kubectl get crd "
                   "rayservices.ray.io rayjobs.ray.io -o yaml` (default: %(default)s)")
    v.add_argument("paths", nargs="+", metavar="PATH",
                   help="a manifest file, a kustomization folder (rendered), a folder of those, "
                   "or - for stdin")


def cmd_k8s(args) -> int:
    from metrale.deploy.k8s import CRDs, ManifestError, validate_paths
    try:
        crds = CRDs.load(args.crds)
    except (ManifestError, OSError) as e:
        print(f"metrale k8s validate: {e}; pass --crds with the CRDs of the KubeRay you run "
              "(kubectl get crd rayservices.ray.io rayjobs.ray.io -o yaml > crds.yaml)",
              file=sys.stderr)
        return 2
    resources, problems = validate_paths(args.paths, crds)
    for problem in problems:
        print(problem)
    print(f"{len(resources)} document(s), {len(problems)} problem(s)")
    return 1 if problems or not resources else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="metrale", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _train_parser(sub)
    _eval_parser(sub)
    _bench_parser(sub)
    _serve_parser(sub)
    _k8s_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return {"generate": cmd_generate, "train": cmd_train, "eval": cmd_eval,
            "bench": cmd_bench, "serve": cmd_serve, "k8s": cmd_k8s}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())

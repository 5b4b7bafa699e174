"""The deployment's one configuration, validated by pydantic: from YAML, `metrale serve` flags,
a Serve config file's `args`, or Python."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from metrale.cluster.actor import ReplicaSpec
from metrale.deploy.bundled import BUNDLED_MODEL, bundled_paths
from metrale.cluster.scheduler import SchedulerConfig
from metrale.workers.worker import CHAIN_ROUNDS, MAX_CHAIN_ROUNDS, WorkerConfig

# The checkpoint served when none is given: the bundled demo model.
DEFAULT_MODEL: str | None = str(BUNDLED_MODEL)

SpeculativeMethod = Literal["none", "mtp", "dflash", "ngram", "self"]


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the file or field."""


class MetraleConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # -- the model and its drafter
    model: str | None = Field(DEFAULT_MODEL, description="Hugging Face checkpoint directory of the "
                              "target model (config.json, safetensors weights, tokenizer.json).")
    served_model_name: str | None = Field(None, description="The name clients pass as `model`; "
                                          "default: the checkpoint directory's name.")
    speculative_method: SpeculativeMethod = Field(
        "none", description="Proposer: mtp (the checkpoint's MTP layer), dflash (needs drafter), "
        "ngram (prompt lookup), self (layer skip), none.")
    drafter: str | None = Field(None, description="DFlash drafter directory (z-lab layout); "
                                "with the bundled model, its bundled drafter by default.")
    num_drafts: int | None = Field(None, ge=0, description="Drafts per speculative round (the "
                                   "most, with adaptive_drafts); the scheduler clamps it to each "
                                   "slot's verify capacity. Default: the DFlash block size - 1, "
                                   "else 3.")
    adaptive_drafts: bool = Field(True, description="Choose each round's drafts, 0 to num_drafts, "
                                  "for the most tokens per second from measured acceptance and "
                                  "step times; false: every round carries num_drafts.")
    verify_pool_bytes: int | None = Field(None, ge=0, description="Verify-pool budget per worker "
                                          "(hybrid models); default: every slot gets num_drafts + "
                                          "1 entries.")
    mtp_confidence_threshold: float | None = Field(None, gt=0, le=1, description="End an MTP draft "
                                                   "chain when the drafter's top-1 probability "
                                                   "falls below this.")
    self_spec_layers: int | None = Field(None, ge=1, description="Layers that draft for `self` "
                                         "speculation; default: half of the model's.")
    dflash_window: int = Field(2048, ge=1, description="Context rows a DFlash drafter keeps per "
                               "sequence (a ring: when full, a new row takes the oldest's place).")
    ngram_min: int = Field(1, ge=1, description="Shortest suffix n-gram lookup matches.")
    ngram_max: int = Field(4, ge=1, description="Longest suffix n-gram lookup matches.")
    chain_rounds: int | None = Field(None, ge=0, le=MAX_CHAIN_ROUNDS,
                                     description="Greedy n-gram, MTP or DFlash "
                                     "rounds (without speculation: plain greedy decode steps) "
                                     "one plan runs on the device before the host reads their "
                                     "tokens (a new request waits for the chain); default: "
                                     f"{CHAIN_ROUNDS} with CUDA graphs, else 0 (off); at most "
                                     f"{MAX_CHAIN_ROUNDS}.")

    # -- the engine on each worker
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Worker device; auto takes "
                                                   "the worker's GPU when it has one.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight and activation dtype; auto takes the checkpoint's.")
    attention_backend: Literal["auto", "torch", "triton"] = Field(
        "auto", description="Kernels on the GPU: auto takes Triton's paged attention, DeltaNet "
        "recurrence and fused norms on CUDA; torch: plain PyTorch (the CPU path).")
    cuda_graphs: bool = Field(True, description="Replay decode and verify steps as CUDA graphs "
                              "captured at start-up (GPU with the Triton kernels only).")
    block_size: int = Field(16, ge=1, description="Tokens per KV-cache block.")
    kv_cache_bytes: int = Field(256 << 20, ge=1, description="KV-cache budget per worker, bytes.")
    max_num_seqs: int = Field(64, ge=1, description="Running sequences (and SSM slots) per worker.")
    max_num_batched_tokens: int = Field(512, ge=1, description="Rows per step per worker: decode "
                                        "tokens, drafts and prefill chunks.")
    max_model_len: int | None = Field(None, ge=2, description="Context length (prompt + output); "
                                      "default: the model's, capped by the KV cache.")
    prefix_caching: bool = Field(True, description="Share KV blocks of common prompt prefixes "
                                 "(models without linear-attention layers or per-row drafters).")
    steps_in_flight: int | None = Field(None, ge=1, le=4, description="Plans a worker holds at "
                                        "once, so it never waits for the next: the same sequences "
                                        "planned ahead (plain decoding), else each plan for its "
                                        "share of them; default: 2, but 1 on a GPU worker that "
                                        "does not plan ahead.")
    plan_ahead: bool = Field(True, description="Without drafts, plan a sequence's next decode step "
                             "before the current one's result; the worker fills in the token it "
                             "sampled. With drafts on a worker that chains greedy rounds, the "
                             "next chain likewise goes on from the last one's on the device. "
                             "Off: plans in flight split the sequences.")
    decode_steps: int | None = Field(None, ge=1, le=16, description="Without drafts, decode "
                                     "steps a plan runs in a row, so the scheduler and the worker "
                                     "exchange a plan every that many tokens; tokens then stream "
                                     "that many at a time. Default: 4 for requests not streamed "
                                     "on a CPU worker, else 1.")
    prefill_gather: float = Field(1.0, ge=1.0, le=64.0, description="On a GPU worker, the "
                                  "longest a prompt that finds a free seat waits for others to "
                                  "prefill with, in prefill steps' times (1: one step's time). "
                                  "Above 1 it waits on until the seats left empty cost what a "
                                  "prefill step stalls the running sequences: more throughput "
                                  "under steady load, later first tokens.")

    # -- the cluster
    replicas: int = Field(1, ge=1, description="Model replicas (data parallel); each has its own "
                          "scheduler actor and placement group.")
    workers_per_replica: int = Field(1, ge=1, description="Workers per replica, each with its own "
                                     "copy of the model, KV cache and step loop (each of "
                                     "tensor_parallel_size actors).")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs (worker actors) one worker's "
                                      "model is split over: attention and linear-attention "
                                      "heads, MLP channels and the vocabulary; head counts must "
                                      "divide by it. Each actor takes one placement-group bundle.")
    gpus_per_worker: float | None = Field(None, ge=0, description="GPUs each worker takes "
                                          "(fractions share one); default: 1 when the cluster has "
                                          "GPUs, else 0 (CPU workers).")
    cpus_per_worker: float = Field(1.0, gt=0, description="CPUs each worker reserves; a CPU worker "
                                   "runs this many torch threads (at least one).")
    name: str = Field("serve", pattern=r"^[a-z][a-z0-9]*$", description="Label of this "
                      "deployment's actors: replica i is `<name><i>`, its workers "
                      "`metrale-worker-<name><i>-<rank>` in the Ray namespace `metrale`.")

    # -- the HTTP endpoint
    host: str = Field("127.0.0.1", description="Address `metrale serve` listens on.")
    port: int = Field(8000, ge=1, le=65535, description="Port `metrale serve` listens on.")
    direct_port: int | None = Field(None, ge=1, le=65535, description="A second port on which "
                                    "the ingress replica serves the same endpoint itself (Ray "
                                    "Serve's direct ingress), without the hop through Serve's "
                                    "proxy. Ray's processes must start with it: `metrale serve` "
                                    "sets it up when it starts a local Ray; for a running "
                                    "cluster see `direct_ingress_env`. Null: off.")
    max_pending_requests: int = Field(256, ge=1, description="Requests one replica may hold "
                                      "(running and queued) before the endpoint answers 429.")
    request_timeout_s: float | None = Field(600.0, gt=0, description="A request still unfinished "
                                            "after this many seconds is aborted (HTTP 504); "
                                            "null: no limit.")
    max_request_bytes: int = Field(8 << 20, ge=1024, description="Largest request body accepted "
                                   "(HTTP 413 beyond it).")
    api_keys: list[str] = Field([], description="Keys clients must send as `Authorization: "
                                "Bearer KEY` on /v1 routes; the environment variable "
                                "METRALE_API_KEYS adds more (comma-separated). Empty: open.")
    log_prompts: bool = Field(False, description="Include prompt text in request logs (off: logs "
                              "carry sizes, status and timing only).")

    # -- failures
    worker_restarts: int = Field(-1, ge=-1, description="Times Ray restarts a dead worker actor "
                                 "(-1: always); its requests move to live workers meanwhile.")
    restart_timeout_s: float = Field(600.0, gt=0, description="How long a replica with no live "
                                     "worker keeps requests waiting for a restart before failing "
                                     "them (HTTP 503).")

    @model_validator(mode="after")
    def _ports_differ(self) -> "MetraleConfig":
        if self.direct_port == self.port:
            raise ValueError(f"direct_port must differ from port ({self.port}): Serve's proxy "
                             "listens on port")
        return self

    @classmethod
    def from_yaml(cls, path: str | Path) -> "MetraleConfig":
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except OSError as e:
            raise ConfigError(f"{path}: cannot read ({e.strerror})") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML ({e})") from e
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
        return cls.validated(data, source=str(path))

    @classmethod
    def validated(cls, data: dict, source: str = "config") -> "MetraleConfig":
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'config'}: {err['msg']}"
                                 for err in e.errors())
            raise ConfigError(f"{source}: {problems}") from None

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides) -> "MetraleConfig":
        """The config file at `path` (defaults without one) with command-line flags on top."""
        return (cls.from_yaml(path) if path else cls()).with_overrides(**overrides)

    def with_overrides(self, **values) -> "MetraleConfig":
        """This config with the given settings replaced (None leaves a setting as it is)."""
        changes = {k: v for k, v in values.items() if v is not None}
        return self.validated({**self.model_dump(exclude_unset=True), **changes}, "flags")

    # -- derived settings

    @property
    def model_path(self) -> str:
        if self.model is None:
            raise ConfigError("no model to serve: pass --model DIR (or set `model:` in the config "
                              "file)")
        return self.model

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_path).name

    def worker_config(self, device: str | None = None) -> WorkerConfig:
        extra = {} if self.num_drafts is None else {"max_drafts": max(self.num_drafts, 1)}
        return WorkerConfig(
            self.model_path, device or self.device, self.dtype, self.block_size,
            self.kv_cache_bytes, self.max_num_seqs, self.speculative_method,
            bundled_paths(self.model_path, self.drafter, self.speculative_method)[1],
            verify_pool_bytes=self.verify_pool_bytes,
            mtp_confidence_threshold=self.mtp_confidence_threshold,
            self_spec_layers=self.self_spec_layers, dflash_window=self.dflash_window,
            ngram_min=self.ngram_min, ngram_max=self.ngram_max, chain_rounds=self.chain_rounds,
            tensor_parallel_size=self.tensor_parallel_size,
            attention_backend=self.attention_backend, cuda_graphs=self.cuda_graphs,
            warmup_prefill_rows=self.max_num_batched_tokens, **extra)

    def scheduler_config(self) -> SchedulerConfig:
        """Drafts per round are filled in from the workers' proposer (ReplicaEngine.build)."""
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len,
                               self.prefix_caching, adaptive_drafts=self.adaptive_drafts,
                               steps_in_flight=self.steps_in_flight,
                               plan_ahead=self.plan_ahead, decode_steps=self.decode_steps,
                               prefill_gather=self.prefill_gather)

    def replica_spec(self, cluster_gpus: float) -> ReplicaSpec:
        gpus = self.gpus_per_worker if self.gpus_per_worker is not None else float(cluster_gpus > 0)
        # a worker without a GPU must not pick up one it was not given
        device = "cpu" if gpus == 0 and self.device == "auto" else self.device
        return ReplicaSpec(self.name, self.worker_config(device), self.scheduler_config(),
                           self.num_drafts, self.workers_per_replica, gpus, self.cpus_per_worker,
                           self.max_pending_requests, self.worker_restarts,
                           self.restart_timeout_s)

"""The in-process engine: one scheduler and one worker in a loop, behind a `generate` call."""

from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path


from metrale.cluster.engine import drafts_per_round
from metrale.cluster.params import RequestError, SamplingParams
from metrale.cluster.scheduler import Scheduler, SchedulerConfig
from metrale.cluster.sequence import Sequence, TokenLogprob
from metrale.drafting.stats import SpecStats
from metrale.workers.models.config import read_json
from metrale.workers.models.loader import load_tokenizer
from metrale.workers.worker import Worker, WorkerConfig

log = logging.getLogger(__name__)


@dataclass
class Completion:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    spec: SpecStats | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    completions: list[Completion] = field(default_factory=list)
    error: str | None = None

    @property
    def text(self) -> str:
        return self.completions[0].text if self.completions else ""

    @property
    def token_ids(self) -> list[int]:
        return self.completions[0].token_ids if self.completions else []

    @property
    def finish_reason(self) -> str | None:
        return self.completions[0].finish_reason if self.completions else "error"

    @property
    def spec(self) -> SpecStats:
        """Speculation statistics summed over the request's completions."""
        total = SpecStats()
        for c in self.completions:
            total.merge(c.spec or SpecStats())
        return total

    @property
    def usage(self) -> dict:
        completion = sum(len(c.token_ids) for c in self.completions)
        return {"prompt_tokens": len(self.prompt_token_ids), "completion_tokens": completion,
                "total_tokens": len(self.prompt_token_ids) + completion}


def read_chat_template(model_dir: str | Path) -> str | None:
    """The checkpoint's chat template: `chat_template.jinja`, else `tokenizer_config.json`'s."""
    model_dir = Path(model_dir)
    if (model_dir / "chat_template.jinja").is_file():
        return (model_dir / "chat_template.jinja").read_text()
    path = model_dir / "tokenizer_config.json"
    if not path.is_file():
        return None
    template = read_json(path, "the tokenizer").get("chat_template")
    return template if isinstance(template, str) else None


class LLM:
    """`LLM(model_dir).generate(prompts, params)` runs requests to completion in this process."""

    def __init__(self, model: str | Path, *, device: str = "auto", dtype: str = "auto",
                 block_size: int = 16, kv_cache_bytes: int = 256 << 20, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, max_model_len: int | None = None,
                 prefix_caching: bool = True, speculative_method: str = "none",
                 num_drafts: int | None = None, adaptive_drafts: bool = True,
                 drafter: str | Path | None = None, tensor_parallel_size: int = 1,
                 decode_steps: int | None = None, prefill_gather: float = 1.0,
                 plan_ahead: bool = True, **worker_options):
        """`worker_options` are further WorkerConfig fields (verify_pool_bytes, max_drafts,
        mtp_confidence_threshold, self_spec_layers, dflash_window, ngram_min, ngram_max, ...).
        With `tensor_parallel_size` N > 1 the model is split over N Ray actors (a local Ray is
        started when this process is not connected to one); `close()` stops them.
        `num_drafts` is the most drafts a round carries; with `adaptive_drafts` each round takes
        the k (0 included) with the most measured tokens per second, else always `num_drafts`.
        Without drafts, each plan runs `decode_steps` decode steps in a row (None: as
        SchedulerConfig.decode_steps says). `prefill_gather`, `plan_ahead`: see SchedulerConfig."""
        self.tokenizer = load_tokenizer(model)
        self.chat_template = read_chat_template(model)
        if num_drafts is not None:
            worker_options.setdefault("max_drafts", max(num_drafts, 1))
        worker_options.setdefault("warmup_prefill_rows", max_num_batched_tokens)
        config = WorkerConfig(
            str(model), device, dtype, block_size, kv_cache_bytes, max_num_seqs,
            speculative_method, str(drafter) if drafter else None,
            tensor_parallel_size=tensor_parallel_size, **worker_options)
        if tensor_parallel_size > 1:
            from metrale.workers.group import WorkerGroup   # Ray only when it is needed
            self.worker = WorkerGroup(config)
        else:
            self.worker = Worker(config)
        capacity = self.worker.capacity
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, prefix_caching,
                            drafts_per_round(num_drafts, capacity), adaptive_drafts,
                            plan_ahead=plan_ahead, decode_steps=decode_steps,
                            prefill_gather=prefill_gather),
            capacity, self.tokenizer)
        self._ids = itertools.count()
        self._pipelined = (isinstance(self.worker, Worker) and capacity.graphs
                           and self.scheduler.plans_ahead)
        self._flying: deque = deque()   # (plan, InFlight) launched, oldest first

    def close(self) -> None:
        """Stops the tensor-parallel ranks (nothing to do for a worker in this process)."""
        if hasattr(self.worker, "close"):
            self.worker.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt).ids

    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None, streamed: bool = True) -> str:
        """Queues a prompt; `step` then advances it. A request not `streamed` is read only when
        it ends (`finished_output`): its text is decoded then, not after every step."""
        request_id = request_id or f"req-{next(self._ids)}"
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.scheduler.add_request(request_id, ids, params, streamed)
        return request_id

    @property
    def has_work(self) -> bool:
        """Requests not finished (see `step` on the steps launched for them)."""
        return self.scheduler.has_work

    def step(self) -> list[Sequence]:
        """One scheduler plan executed on the worker; returns sequences that got a token. On a
        worker that replays CUDA graphs, plain decoding keeps two steps launched: the next is
        planned ahead (its tokens are those the step before samples, taken on the device) and
        launched before the host reads the tokens of the one before, so the scheduler's work
        overlaps the device's (see `Worker.launch`). Once every request has finished, a step
        still launched holds only finished sequences (planned ahead of sequences that the step
        before then ended): it is not waited for, and the worker reads it before its next
        launch."""
        if not self._pipelined:
            plan = self.scheduler.schedule()
            try:
                result = self.worker.execute(plan)
            except BaseException:
                self.scheduler.forget(plan)   # its sequences may be planned again
                raise
            return self.scheduler.update(plan, result)
        try:
            while len(self._flying) < 2 and (plan := self.scheduler.schedule()).work:
                self._flying.append((plan, self.worker.launch(plan)))
            if not self._flying:
                return self.scheduler.update(plan, self.worker.execute(plan))   # no work
            plan, launched = self._flying[0]
            result = launched.result()
        except BaseException:
            self._drop_flying()   # their sequences may be planned again
            raise
        self._flying.popleft()
        touched = self.scheduler.update(plan, result)
        if not self.scheduler.has_work:
            self._drop_flying()
        return touched

    def _drop_flying(self) -> None:
        """Forgets the plans still launched; the worker reads them before its next launch."""
        for plan, _ in self._flying:
            self.scheduler.forget(plan)
        self._flying.clear()

    def generate(self, prompts: list[str | list[int]] | str,
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Runs all prompts together (continuous batching); a refused prompt gets an output with
        `error` set and does not stop the others."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        params = params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        outputs: dict[str, RequestOutput] = {}
        order = []
        for prompt, p in zip(prompts, per_prompt, strict=True):
            ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request_id = f"req-{next(self._ids)}"
            order.append(request_id)
            outputs[request_id] = RequestOutput(request_id, ids)
            try:
                self.scheduler.add_request(request_id, ids, p, streamed=False)
            except RequestError as e:
                outputs[request_id].error = str(e)
        while self.has_work:
            self.step()
        for request_id in order:
            if outputs[request_id].error is None:
                outputs[request_id] = self.finished_output(request_id)
        return [outputs[r] for r in order]

    def finished_output(self, request_id: str) -> RequestOutput | None:
        """The request's output once all its sequences have finished (then forgotten), else None."""
        seqs = self.scheduler.pop_finished(request_id)
        if seqs is None:
            return None
        completions = [Completion(s.index, s.text, s.output_ids, s.finish_reason,
                                  s.logprobs if s.params.logprobs is not None else None, s.spec)
                       for s in seqs]
        return RequestOutput(request_id, seqs[0].prompt_ids, completions)

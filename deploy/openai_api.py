"""The OpenAI wire format: requests validated at the HTTP boundary; responses, chunks, errors."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from tokenizers import Tokenizer

from metrale.cluster.params import MAX_TOKEN_ID, GrammarSpec, RequestError, SamplingParams
from metrale.cluster.sequence import TokenLogprob
from metrale.cluster.stream import Delta
from metrale.drafting.stats import SpecStats


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = "response"
    schema_: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`, plus metrale's `regex` and `ebnf` types:
    `{"type": "regex", "regex": "..."}` and `{"type": "ebnf", "ebnf": "root ::= ..."}`."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema", "regex", "ebnf"]
    json_schema: JsonSchemaFormat | None = None
    regex: str | None = None
    ebnf: str | None = None

    def grammar(self) -> GrammarSpec | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return GrammarSpec("json_object")
        value = {"json_schema": self.json_schema and json.dumps(self.json_schema.schema_),
                 "regex": self.regex, "ebnf": self.ebnf}[self.type]
        if value is None:
            raise RequestError(f"response_format: type {self.type!r} needs a `{self.type}` field")
        strict = self.json_schema.strict if self.type == "json_schema" else None
        return GrammarSpec(self.type, value, strict is not False)


MAX_N = 128   # completions per request, as OpenAI allows


class SamplingRequest(BaseModel):
    """Fields /v1/completions and /v1/chat/completions share; unknown fields are ignored."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0               # vLLM extension
    min_p: float = 0.0           # vLLM extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None   # vLLM extension
    ignore_eos: bool = False     # vLLM extension
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        if not 1 <= self.n <= MAX_N:
            raise RequestError(f"n must be an integer in [1, {MAX_N}], got {self.n}")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, min_p=self.min_p, seed=self.seed, stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos, n=self.n,
            logprobs=logprobs, grammar=self.response_format and self.response_format.grammar())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    max_tokens: int | None = 16   # OpenAI's default for completions

    def prompts(self, tokenizer: Tokenizer) -> list[list[int]]:
        items = [self.prompt] if isinstance(self.prompt, str) or (
            self.prompt and isinstance(self.prompt[0], int)) else self.prompt
        if not items:
            raise RequestError("prompt must not be empty")
        for p in items:
            if not isinstance(p, str) and not all(0 <= t < MAX_TOKEN_ID for t in p):
                raise RequestError("prompt: token ids must be non-negative and within the "
                                   "vocabulary")
        return [tokenizer.encode(p).ids if isinstance(p, str) else list(p) for p in items]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str = ""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[ContentPart] | None = None

    def plain(self) -> dict:
        """The message as templates expect it: content as one string (text parts joined)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content if part.type == "text")
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None


def parse(cls: type[SamplingRequest], body: bytes) -> SamplingRequest:
    """The request, or RequestError naming the first problem (malformed JSON, a wrong type, ...)."""
    try:
        return cls.model_validate_json(body, strict=True)
    except ValidationError as e:
        err = e.errors()[0]
        if err["type"] == "json_invalid":
            raise RequestError(f"request body is not valid JSON ({err['ctx']['error']})") from None
        where = ".".join(str(p) for p in err["loc"]) or "body"
        raise RequestError(f"{where}: {err['msg']}") from None


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass
class Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    spec: SpecStats | None = None


class ResponseBuilder:
    """Builds one request's response (or its stream chunks) from the deltas of its choices."""

    def __init__(self, chat: bool, model: str, tokenizer: Tokenizer, num_choices: int,
                 prompt_tokens: int, logprobs: bool):
        self.chat, self.model, self.tokenizer = chat, model, tokenizer
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.choices = [Choice() for _ in range(num_choices)]
        self.prompt_tokens, self.want_logprobs = prompt_tokens, logprobs

    def add(self, index: int, delta: Delta) -> None:
        c = self.choices[index]
        c.text += delta.text
        c.token_ids += delta.token_ids
        c.logprobs += delta.logprobs
        c.finish_reason = delta.finish_reason or c.finish_reason
        c.spec = delta.spec or c.spec

    @property
    def usage(self) -> dict:
        completion = sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    @property
    def speculation(self) -> dict:
        total = SpecStats()
        for c in self.choices:
            total.merge(c.spec or SpecStats())
        stats = total.as_dict()
        return {k: stats[k] for k in ("rounds", "drafts_proposed", "drafts_accepted",
                                      "mean_acceptance_length")}

    def response(self) -> dict:
        choices = []
        for i, c in enumerate(self.choices):
            body = ({"message": {"role": "assistant", "content": c.text}} if self.chat
                    else {"text": c.text})
            choices.append({"index": i, **body, "logprobs": self._logprobs(c.logprobs),
                            "finish_reason": c.finish_reason})
        return {**self._head(), "choices": choices, "usage": self.usage,
                "speculation": self.speculation}

    def chunk(self, index: int, delta: Delta, first: bool) -> dict:
        if self.chat:
            body = {"delta": ({"role": "assistant"} if first else {}) | {"content": delta.text}}
        else:
            body = {"text": delta.text}
        return {**self._head(chunk=True), "choices": [
            {"index": index, **body, "logprobs": self._logprobs(delta.logprobs),
             "finish_reason": delta.finish_reason}]}

    def usage_chunk(self) -> dict:
        return {**self._head(chunk=True), "choices": [], "usage": self.usage,
                "speculation": self.speculation}

    def _head(self, chunk: bool = False) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat \
            else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _logprobs(self, entries: list[TokenLogprob]) -> dict | None:
        if not self.want_logprobs:
            return None
        text = lambda token_id: self.tokenizer.decode([token_id])  # noqa: E731
        if self.chat:
            return {"content": [
                {"token": text(e.token_id), "logprob": e.logprob,
                 "bytes": list(text(e.token_id).encode()),
                 "top_logprobs": [{"token": text(t), "logprob": lp, "bytes": list(text(t).encode())}
                                  for t, lp in e.top]} for e in entries]}
        return {"tokens": [text(e.token_id) for e in entries],
                "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{text(t): lp for t, lp in e.top} for e in entries]}

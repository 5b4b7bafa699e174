"""The Ray Serve application: an OpenAI-compatible ingress over the replicas; `metrale serve`."""

import asyncio
import hmac
import json
import logging
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from typing import AsyncIterator

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from metrale.cluster.actor import start_replica, stop_replica
from metrale.cluster.client import ReplicaClient, RequestStream
from metrale.cluster.engine import Overloaded, Unavailable
from metrale.cluster.params import RequestError, SamplingParams
from metrale.cluster.stream import Delta
from metrale.deploy.chat import ChatTemplate
from metrale.deploy.config import MetraleConfig
from metrale.deploy.llm import load_tokenizer
from metrale.deploy.metrics import RequestMetrics, RequestTimer
from metrale.deploy.openai_api import (ChatCompletionRequest, CompletionRequest, ResponseBuilder,
                                       error_body, parse)
from metrale.deploy.router import Router
from metrale.workers.actor import NAMESPACE

log = logging.getLogger(__name__)
# request lines go where Serve writes its replicas' logs
access_log = logging.getLogger("ray.serve.metrale")

APP_NAME = "metrale"
DIRECT_WAIT_S = 60.0   # how long the ingress replica's own server may lag the proxy at start
app = FastAPI(title="metrale")


RETRY_AFTER_S = 1   # what 429 and 503 answers ask clients to wait


class HTTPError(Exception):
    def __init__(self, status: int, message: str, type_: str):
        super().__init__(message)
        self.status, self.type = status, type_

    @classmethod
    def of(cls, e: Exception) -> "HTTPError":
        """The answer to an exception from validation, routing or a replica."""
        if isinstance(e, HTTPError):
            return e
        if isinstance(e, RequestError):
            return cls(400, str(e), "invalid_request_error")
        if isinstance(e, Overloaded):
            return cls(429, str(e), "rate_limit_exceeded")
        if isinstance(e, Unavailable):
            return cls(503, str(e), "service_unavailable")
        if isinstance(e, ray.exceptions.RayActorError):   # a replica died under us
            return cls(503, f"a replica is unavailable: {str(e).splitlines()[0]}",
                       "service_unavailable")
        raise e

    @classmethod
    def of_delta(cls, delta: Delta) -> "HTTPError":
        if delta.error_type == "unavailable":
            return cls(503, delta.error, "service_unavailable")
        return cls(500, delta.error, "internal_error")

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.status in (429, 503) else None
        return JSONResponse(error_body(str(self), self.type, self.status), status_code=self.status,
                            headers=headers)


def api_keys(config: MetraleConfig) -> list[str]:
    """The config's keys and those in METRALE_API_KEYS (comma-separated)."""
    extra = [k.strip() for k in os.environ.get("METRALE_API_KEYS", "").split(",")]
    return [k for k in [*config.api_keys, *extra] if k]


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def merge(streams: list[RequestStream], n: int,
                timeout: float | None = None) -> AsyncIterator[tuple[int, Delta]]:
    """The deltas of a request's prompts as (choice index, delta); prompt p's completion i is
    choice p * n + i. Closing the merge closes (and so aborts) every unfinished stream; so does
    running past `timeout` seconds, which raises TimeoutError."""
    deadline = None if timeout is None else time.monotonic() + timeout
    queue: asyncio.Queue[tuple[int, Delta] | None] = asyncio.Queue()

    async def pump(p: int, stream: RequestStream) -> None:
        try:
            async for delta in stream:
                queue.put_nowait((p * n + delta.index, delta))
        finally:
            queue.put_nowait(None)
    tasks = [asyncio.create_task(pump(p, s)) for p, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            item = await asyncio.wait_for(queue.get(), wait)
            if item is None:
                left -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


class EventStream(StreamingResponse):
    """Server-sent events that abort their request as soon as the response ends, however it ends:
    a client may go away before the generator ever ran, or while an event is being sent, so the
    generator's own clean-up would come late or never."""

    def __init__(self, events: AsyncIterator[str], streams: list[RequestStream]):
        super().__init__(events, media_type="text/event-stream")
        self.events, self.streams = events, streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:   # no await before the aborts: in a cancelled scope every await raises
            for stream in self.streams:
                stream.close()
            await self.events.aclose()


class RequestNote:
    """One request's log line: route, status, sizes and time; the prompt only when enabled."""

    def __init__(self, route: str):
        self.route, self.start = route, time.perf_counter()
        self.id = uuid.uuid4().hex[:12]
        self.prompt = None
        self.prompt_tokens = 0
        self.completion_tokens: int | None = None

    def answered(self, status: int, with_prompt: bool) -> None:
        extra = f" prompt={self.prompt!r}" if with_prompt and self.prompt is not None else ""
        access_log.info("request %s %s -> %d in %.3fs, %d prompt tokens, %s completion tokens%s",
                        self.id, self.route, status, time.perf_counter() - self.start,
                        self.prompt_tokens, "streamed" if self.completion_tokens is None
                        else self.completion_tokens, extra)


# (Everything the deployment uses is defined above it: Serve captures the class when it is defined.)
@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class OpenAIServer:
    """Validates OpenAI requests, routes each prompt to a replica's scheduler actor and streams the
    deltas back. Replicas start in the background; until they are up, /health answers 503."""

    def __init__(self, config: MetraleConfig):
        self.config = config
        self.name = config.model_name
        self.tokenizer = load_tokenizer(config.model_path)
        self.template = ChatTemplate.for_checkpoint(config.model_path)
        self.router = Router(config.replicas, config.block_size)
        self.keys = [k.encode() for k in api_keys(config)]
        self.metrics = RequestMetrics(self.name)
        self.clients: list[ReplicaClient] = []
        self.max_model_len = 0
        self.startup_error: str | None = None
        # the loop keeps only a weak reference to a task: this one must not vanish mid-startup
        self._startup = asyncio.get_running_loop().create_task(self._start())

    async def _start(self) -> None:
        try:
            spec = self.config.replica_spec(ray.cluster_resources().get("GPU", 0))
        except Exception as e:   # else /health would say "loading" for ever
            self.startup_error = f"startup failed: {e!r}"
            log.exception("startup failed")
            return
        started = await asyncio.gather(
            *(start_replica(spec, i) for i in range(self.config.replicas)), return_exceptions=True)
        failed = [r for r in started if isinstance(r, BaseException)]
        if failed:
            for replica in started:
                if not isinstance(replica, BaseException):
                    stop_replica(replica)
            self.startup_error = f"startup failed: {failed[0]}"
            log.error(self.startup_error)
            return
        self.max_model_len = min(r.max_model_len for r in started)
        self.clients = [ReplicaClient(r) for r in started]

    def __del__(self):
        for client in self.clients:
            stop_replica(client.replica)

    # -- routes -----------------------------------------------------------------------------

    @app.get("/health")
    async def health(self):
        if not self.clients:
            return HTTPError(503, self.startup_error or "the model is loading",
                             "service_unavailable").response()
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self, request: Request):
        try:
            self._authorize(request)
        except HTTPError as e:
            return e.response()
        return {"object": "list", "data": [{
            "id": self.name, "object": "model", "created": int(time.time()), "owned_by": "metrale",
            "root": self.config.model_path, "max_model_len": self.max_model_len or None}]}

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._answer(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._answer(request, chat=True)

    # -- one request ------------------------------------------------------------------------

    async def _answer(self, request: Request, chat: bool):
        note = RequestNote(request.url.path)
        try:
            self._authorize(request)
            response = await self._generate(await self._body(request), chat, note)
        except Exception as e:
            response = HTTPError.of(e).response()
        self.metrics.answered(request.url.path, response.status_code)
        note.answered(response.status_code, self.config.log_prompts)
        return response

    def _authorize(self, request: Request) -> None:
        """With API keys configured, the request must carry one as a Bearer token (compared in
        constant time)."""
        if not self.keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode()
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(given, k) for k in self.keys):
            raise HTTPError(401, "missing or invalid API key: send `Authorization: Bearer KEY`",
                            "authentication_error")

    async def _body(self, request: Request) -> bytes:
        """The JSON body, refused early when too large or not JSON."""
        kind = request.headers.get("content-type", "application/json").split(";")[0].strip()
        if kind.lower() != "application/json" and not kind.lower().endswith("+json"):
            raise HTTPError(415, f"Content-Type must be application/json, not {kind!r}",
                            "invalid_request_error")
        limit = self.config.max_request_bytes
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise HTTPError(413, f"request body is {length} bytes; the limit is {limit}",
                            "invalid_request_error")
        body = await request.body()
        if len(body) > limit:
            raise HTTPError(413, f"request body is {len(body)} bytes; the limit is {limit}",
                            "invalid_request_error")
        return body

    async def _generate(self, body: bytes, chat: bool, note: "RequestNote"):
        timer = self.metrics.timer()
        if not self.clients:
            raise HTTPError(503, self.startup_error or "the model is loading; retry shortly",
                            "service_unavailable")
        req = parse(ChatCompletionRequest if chat else CompletionRequest, body)
        if req.model not in (None, self.name):
            raise HTTPError(404, f"model {req.model!r} does not exist; this server serves "
                            f"{self.name!r}", "model_not_found")
        if chat:
            rendered = self.template.render([m.plain() for m in req.messages])
            prompts = [self.tokenizer.encode(rendered).ids]
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
                else req.max_tokens
            note.prompt = rendered
        else:
            prompts, logprobs = req.prompts(self.tokenizer), req.logprobs
            max_tokens = req.max_tokens
            note.prompt = req.prompt
        note.prompt_tokens = sum(map(len, prompts))
        if max_tokens is None:   # the rest of the context
            max_tokens = max(1, self.max_model_len - max(len(p) for p in prompts))
        params = req.sampling_params(max_tokens, logprobs)
        streams: list[RequestStream] = []
        try:
            for ids in prompts:
                streams.append(await self._submit(ids, params, whole=not req.stream))
        except BaseException:
            for s in streams:
                s.close()
            raise
        builder = ResponseBuilder(chat, self.name, self.tokenizer, len(prompts) * params.n,
                                  sum(len(p) for p in prompts), logprobs is not None)
        deltas = merge(streams, params.n, self.config.request_timeout_s)
        if req.stream:
            return EventStream(self._events(builder, deltas, req.include_usage, timer), streams)
        try:
            async for index, delta in deltas:
                if delta.error:
                    raise HTTPError.of_delta(delta)
                builder.add(index, delta)
                timer.tokens(len(delta.token_ids))
        except TimeoutError:
            raise self._timed_out() from None
        finally:
            await deltas.aclose()
            timer.done()
        note.completion_tokens = timer.count
        return JSONResponse(builder.response())

    async def _submit(self, prompt_ids: list[int], params: SamplingParams,
                      whole: bool) -> RequestStream:
        queues = [c.in_flight for c in self.clients]
        if min(queues) >= self.config.max_pending_requests:
            raise Overloaded(f"over capacity: every replica holds "
                             f"{self.config.max_pending_requests} requests; retry later")
        pick = self.router.choose(prompt_ids, queues)
        if queues[pick] >= self.config.max_pending_requests:
            pick = queues.index(min(queues))
        return await self.clients[pick].submit(uuid.uuid4().hex, prompt_ids, params, whole)

    def _timed_out(self) -> HTTPError:
        return HTTPError(504, f"the request took longer than request_timeout_s="
                         f"{self.config.request_timeout_s}", "timeout")

    async def _events(self, builder: ResponseBuilder, deltas, include_usage: bool,
                      timer: RequestTimer) -> AsyncIterator[str]:
        """Server-sent events: one chunk per delta, the usage chunk if asked, then [DONE]. An
        error (a failed replica, the request timeout) ends the stream with an error event."""
        started = [False] * len(builder.choices)
        try:
            try:
                async for index, delta in deltas:
                    if delta.error:
                        e = HTTPError.of_delta(delta)
                        yield _event(error_body(str(e), e.type, e.status))
                        break
                    builder.add(index, delta)
                    timer.tokens(len(delta.token_ids))
                    if delta.text or delta.finish_reason or delta.logprobs or not started[index]:
                        yield _event(builder.chunk(index, delta, first=not started[index]))
                        started[index] = True
                else:
                    if include_usage:
                        yield _event(builder.usage_chunk())
            except TimeoutError:
                e = self._timed_out()
                yield _event(error_body(str(e), e.type, e.status))
            yield "data: [DONE]\n\n"
        finally:
            await deltas.aclose()
            timer.done()


def build_app(config: MetraleConfig | dict) -> serve.Application:
    """The Serve application; `serve run` / `serve deploy` call it with the config file's `args`
    (MetraleConfig's fields), e.g. import_path: metrale.deploy.serve:build_app."""
    if not isinstance(config, MetraleConfig):
        config = MetraleConfig.validated(config, "Serve application args")
    load_tokenizer(config.model_path)   # a missing or broken checkpoint fails here, not later
    # Room for the requests the replicas hold, and for answering 429 to more; past that, Serve
    # queues a bounded number and refuses the rest with 503, so a flood cannot grow memory.
    ongoing = config.replicas * config.max_pending_requests + 256
    return OpenAIServer.options(max_ongoing_requests=ongoing,
                                max_queued_requests=ongoing).bind(config)


def direct_ingress_env(port: int) -> dict[str, str]:
    """The environment under which Ray Serve's ingress replica also serves HTTP itself on `port`
    (direct ingress: no hop through Serve's proxy). Ray's processes read it when they start, so
    it must be set where the cluster starts: `metrale serve` sets it before starting a local
    Ray; for a cluster of your own, `ray start` with these variables. The range is that one port
    (its end is exclusive); a restarted ingress replica takes it again at once (no quarantine),
    and a stopping one drains for a second, not Serve's default 30 (meant for an external load
    balancer to notice)."""
    return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),
            "RAY_SERVE_PORT_QUARANTINE_S": "0",
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1"}


def run_server(config: MetraleConfig) -> int:
    """`metrale serve`: joins the running Ray cluster (or starts a local one), deploys the app,
    waits until it is healthy, then serves until SIGINT or SIGTERM."""
    # keys from this shell's environment travel in the config (Ray's processes may not share it)
    config = config.with_overrides(api_keys=api_keys(config) or None)
    if config.host not in ("127.0.0.1", "localhost", "::1") and not config.api_keys:
        log.warning("serving on %s without API keys: anyone who reaches it can use it (set "
                    "api_keys or METRALE_API_KEYS)", config.host)
    application = build_app(config)
    stop = threading.Event()
    if config.direct_port:   # takes effect when ray.init starts the cluster (inherited)
        os.environ.update(direct_ingress_env(config.direct_port))
    ray.init(namespace=NAMESPACE)
    # Whether this process started the cluster: a terminal's Ctrl-C reaches the local Ray's
    # processes too, so nothing is left to undeploy from, and shutting Ray down cleans up.
    local = ray._private.worker.global_worker.node.is_head()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    url = f"http://{config.host}:{config.port}"
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        serve.run(application, name=APP_NAME, route_prefix="/", blocking=False)
        error = wait_healthy(url, stop)
        direct = f"http://{config.host}:{config.direct_port}"
        if not error and config.direct_port and wait_healthy(direct, stop, DIRECT_WAIT_S):
            env = " ".join(f"{k}={v}" for k, v in direct_ingress_env(config.direct_port).items())
            error = (f"nothing answers on direct_port {config.direct_port}: the Ray cluster "
                     f"was started without direct ingress on that port (start it with {env} "
                     "ray start ...), or the port is taken")
        if error:
            print(f"metrale serve: {error}", file=sys.stderr)
            return 1
        if not stop.is_set():
            also = f" and, without Serve's proxy, at {direct}/v1" if config.direct_port else ""
            print(f"metrale: serving {config.model_name!r} at {url}/v1{also} (Ctrl-C to stop)",
                  flush=True)
        stop.wait()
        print("metrale: shutting down", file=sys.stderr, flush=True)
        return 0
    finally:
        if not local:   # leave a shared cluster as it was
            serve.delete(APP_NAME)
        ray.shutdown()


def wait_healthy(url: str, stop: threading.Event | None = None,
                 timeout_s: float | None = None) -> str | None:
    """None once /health answers 200 (or `stop` is set); else why not: the startup error if
    startup failed, or that `timeout_s` passed first."""
    stop = stop or threading.Event()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not stop.is_set():
        if deadline is not None and time.monotonic() > deadline:
            return f"{url} did not answer within {timeout_s:.0f} s"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5):
                return None
        except urllib.error.HTTPError as e:
            message = json.loads(e.read() or b"{}").get("error", {}).get("message", "")
            if message.startswith("startup failed"):
                return message
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        stop.wait(0.5)
    return None

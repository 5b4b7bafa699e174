"""The Ray Serve application: an OpenAI-compatible ingress over the replicas; `metrale serve`."""

import asyncio
import json
import logging
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

APP_NAME = "metrale"
app = FastAPI(title="metrale")


class HTTPError(Exception):
    def __init__(self, status: int, message: str, type_: str):
        super().__init__(message)
        self.status, self.type = status, type_


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def merge(streams: list[RequestStream], n: int) -> AsyncIterator[tuple[int, Delta]]:
    """The deltas of a request's prompts as (choice index, delta); prompt p's completion i is
    choice p * n + i. Closing the merge closes (and so aborts) every unfinished stream."""
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
            item = await queue.get()
            if item is None:
                left -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


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
        self.metrics = RequestMetrics(self.name)
        self.clients: list[ReplicaClient] = []
        self.max_model_len = 0
        self.startup_error: str | None = None
        # the loop keeps only a weak reference to a task: this one must not vanish mid-startup
        self._startup = asyncio.get_running_loop().create_task(self._start())

    async def _start(self) -> None:
        spec = self.config.replica_spec(ray.cluster_resources().get("GPU", 0))
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
            return self._error(HTTPError(503, self.startup_error or "the model is loading",
                                         "service_unavailable"))
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self):
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
        try:
            response = await self._generate(await request.body(), chat)
        except RequestError as e:
            response = self._error(HTTPError(400, str(e), "invalid_request_error"))
        except HTTPError as e:
            response = self._error(e)
        except ray.exceptions.RayActorError as e:   # a replica died under us
            response = self._error(HTTPError(503, f"a replica is unavailable: {e}",
                                             "service_unavailable"))
        self.metrics.answered(request.url.path, response.status_code)
        return response

    async def _generate(self, body: bytes, chat: bool):
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
        else:
            prompts, logprobs = req.prompts(self.tokenizer), req.logprobs
            max_tokens = req.max_tokens
        if max_tokens is None:   # the rest of the context
            max_tokens = max(1, self.max_model_len - max(len(p) for p in prompts))
        params = req.sampling_params(max_tokens, logprobs)
        streams: list[RequestStream] = []
        try:
            for ids in prompts:
                streams.append(await self._submit(ids, params))
        except BaseException:
            for s in streams:
                s.close()
            raise
        builder = ResponseBuilder(chat, self.name, self.tokenizer, len(prompts) * params.n,
                                  sum(len(p) for p in prompts), logprobs is not None)
        deltas = merge(streams, params.n)
        if req.stream:
            return StreamingResponse(self._events(builder, deltas, req.include_usage, timer),
                                     media_type="text/event-stream")
        try:
            async for index, delta in deltas:
                if delta.error:
                    raise HTTPError(500, delta.error, "internal_error")
                builder.add(index, delta)
                timer.tokens(len(delta.token_ids))
        finally:
            await deltas.aclose()
            timer.done()
        return JSONResponse(builder.response())

    async def _submit(self, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        queues = [c.in_flight for c in self.clients]
        if min(queues) >= self.config.max_pending_requests:
            raise HTTPError(429, f"over capacity: every replica holds "
                            f"{self.config.max_pending_requests} requests; retry later",
                            "rate_limit_exceeded")
        pick = self.router.choose(prompt_ids, queues)
        if queues[pick] >= self.config.max_pending_requests:
            pick = queues.index(min(queues))
        return await self.clients[pick].submit(uuid.uuid4().hex, prompt_ids, params)

    async def _events(self, builder: ResponseBuilder, deltas, include_usage: bool,
                      timer: RequestTimer) -> AsyncIterator[str]:
        """Server-sent events: one chunk per delta, the usage chunk if asked, then [DONE]."""
        started = [False] * len(builder.choices)
        try:
            async for index, delta in deltas:
                if delta.error:
                    yield _event(error_body(delta.error, "internal_error", 500))
                    break
                builder.add(index, delta)
                timer.tokens(len(delta.token_ids))
                if delta.text or delta.finish_reason or delta.logprobs or not started[index]:
                    yield _event(builder.chunk(index, delta, first=not started[index]))
                    started[index] = True
            else:
                if include_usage:
                    yield _event(builder.usage_chunk())
            yield "data: [DONE]\n\n"
        finally:
            await deltas.aclose()
            timer.done()

    def _error(self, e: HTTPError) -> JSONResponse:
        return JSONResponse(error_body(str(e), e.type, e.status), status_code=e.status)


def build_app(config: MetraleConfig | dict) -> serve.Application:
    """The Serve application; `serve run` / `serve deploy` call it with the config file's `args`
    (MetraleConfig's fields), e.g. import_path: metrale.deploy.serve:build_app."""
    if not isinstance(config, MetraleConfig):
        config = MetraleConfig.validated(config, "Serve application args")
    load_tokenizer(config.model_path)   # a missing or broken checkpoint fails here, not later
    ongoing = config.replicas * config.max_pending_requests + 64   # room for our own 429s
    return OpenAIServer.options(max_ongoing_requests=ongoing).bind(config)


def run_server(config: MetraleConfig) -> int:
    """`metrale serve`: joins the running Ray cluster (or starts a local one), deploys the app,
    waits until it is healthy, then serves until SIGINT or SIGTERM."""
    application = build_app(config)
    stop = threading.Event()
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
        error = _wait_healthy(url, stop)
        if error:
            print(f"metrale serve: {error}", file=sys.stderr)
            return 1
        if not stop.is_set():
            print(f"metrale: serving {config.model_name!r} at {url}/v1 (Ctrl-C to stop)",
                  flush=True)
        stop.wait()
        print("metrale: shutting down", file=sys.stderr, flush=True)
        return 0
    finally:
        if not local:   # leave a shared cluster as it was
            serve.delete(APP_NAME)
        ray.shutdown()


def _wait_healthy(url: str, stop: threading.Event) -> str | None:
    """None once /health answers 200 (or a signal arrived); the startup error if startup failed."""
    while not stop.is_set():
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

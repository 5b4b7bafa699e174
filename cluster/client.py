"""A scheduler actor as its consumers (ingress, batch driver) see it: requests in, deltas out."""

from __future__ import annotations

import asyncio
import logging
import uuid

import ray

from metrale.cluster.actor import Replica
from metrale.cluster.engine import Overloaded, Unavailable
from metrale.cluster.params import RequestError, SamplingParams
from metrale.cluster.stream import Delta
from metrale.cluster.wire import pack, unpack

log = logging.getLogger(__name__)


class ReplicaClient:
    """One long poll per replica carries every request's deltas; each request has a queue.

    Serve cancels the Ray tasks that a disconnected HTTP request started, which may include an
    abort sent while that request ends, or the shared poll. So an abort also rides on the next
    poll, and a cancelled poll is sent again with the same aborts, until one gets through."""

    def __init__(self, replica: Replica):
        self.replica = replica
        self.consumer = uuid.uuid4().hex
        self.queues: dict[str, asyncio.Queue[Delta]] = {}
        self.aborts: set[str] = set()
        self._poller: asyncio.Task | None = None

    @property
    def in_flight(self) -> int:
        """Requests this consumer has on the replica: the queue length the router balances."""
        return len(self.queues)

    async def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     whole: bool = False) -> "RequestStream":
        """Queues the request; returns its deltas: with `whole` (not streamed), each completion's
        first delta and then the rest as one. Raises RequestError, Overloaded or Unavailable
        when the replica refuses it (Unavailable too while the replica itself restarts)."""
        queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.queues[request_id] = queue
        try:
            refusal = await self.replica.handle.submit.remote(
                self.consumer, request_id, pack(prompt_ids), pack(params), whole)
        except ray.exceptions.RayActorError as e:
            del self.queues[request_id]
            raise Unavailable(f"replica {self.replica.name} is restarting; retry") from e
        except BaseException:   # e.g. the HTTP client left while the request was being queued
            del self.queues[request_id]
            self.abort(request_id)
            raise
        if refusal is not None:
            del self.queues[request_id]
            kind, message = refusal
            raise {"invalid": RequestError, "overloaded": Overloaded,
                   "unavailable": Unavailable}[kind](message)
        self._ensure_polling()
        return RequestStream(self, request_id, queue, params.n)

    def abort(self, request_id: str) -> None:
        """Aborts the request now, and again with the next poll (the direct call may be
        cancelled along with the HTTP request that made it)."""
        self.aborts.add(request_id)
        self.replica.handle.abort.remote(request_id)
        self._ensure_polling()

    def _ensure_polling(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll())

    async def state(self) -> dict:
        return await self.replica.handle.state.remote()

    async def _poll(self) -> None:
        while self.queues or self.aborts:
            aborts = sorted(self.aborts)
            try:
                data = await self.replica.handle.poll.remote(self.consumer, aborts)
            except ray.exceptions.TaskCancelledError:   # see the class's docstring
                continue
            except Exception as e:  # the replica's scheduler died: its requests end, retryable
                log.error("replica %s failed: %s", self.replica.name, e)
                for request_id, queue in list(self.queues.items()):
                    queue.put_nowait(Delta(request_id, 0, finish_reason="error",
                                           error=f"replica {self.replica.name} failed and is "
                                           "restarting; retry the request",
                                           error_type="unavailable"))
                self.queues.clear()
                self.aborts.clear()   # the restarted replica holds none of them
                return
            self.aborts.difference_update(aborts)
            for delta in unpack(list[Delta], data):
                queue = self.queues.get(delta.request_id)
                if queue is not None:
                    queue.put_nowait(delta)


class RequestStream:
    """One request's deltas, until each of its n completions has finished. Closing it earlier, or
    cancelling a read (a client that went away), aborts the request on the replica."""

    def __init__(self, client: ReplicaClient, request_id: str, queue: asyncio.Queue[Delta], n: int):
        self.client, self.request_id, self.queue, self.open = client, request_id, queue, n

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> Delta:
        if not self.open:
            raise StopAsyncIteration
        try:
            delta = await self.queue.get()
        except BaseException:
            self.close()
            raise
        # an error ends the whole request (its worker or replica failed)
        self.open = 0 if delta.error else self.open - (delta.finish_reason is not None)
        if not self.open:
            self.client.queues.pop(self.request_id, None)
        return delta

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        if self.open:
            self.open = 0
            self.client.queues.pop(self.request_id, None)
            self.client.abort(self.request_id)

"""The api server's side of the ZeroMQ ring: submit requests, receive their text, abort them.

One asyncio task reads the inbox and routes each message: replies to the queue of the HTTP
request that owns the uid, answers of calls (tokenizer calls, info queries) to their futures.
Sending is a plain non-blocking ZeroMQ send, so it is safe from a `finally` of a cancelled task
(a client that went away still gets its request aborted).

Two limits protect the server from its clients: admission (a request arriving while
max-running + max-queued requests are open is refused at once with 503 and Retry-After) and the
unread-reply bound (a stream whose client stopped reading is aborted once its queue holds
max-unread-replies, instead of buffering its tokens without end).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from minfer.core import TokenLogprobs
from minfer.ipc import messages as m
from minfer.ipc.sockets import send
from minfer.observability.events import RECEIVED
from minfer.observability.metrics import ServerMetrics
from minfer.observability.trace import NULL_TRACER, RequestTracer
from minfer.server.errors import APIError

log = logging.getLogger(__name__)

Event = m.Reply | m.RequestFailed
RETRY_AFTER_S = 1  # what a refused client is told to wait: requests of a few seconds free slots quickly


class ServerOverloaded(APIError):
    """503 with a Retry-After header: the queue is full."""

    def __init__(self, message: str):
        super().__init__(503, message, None, "server_overloaded", {"Retry-After": str(RETRY_AFTER_S)})


class ReplyQueue(asyncio.Queue):
    """The queue the engine requests of one HTTP request share; `requests` of them write to it."""

    def __init__(self):
        super().__init__()
        self.requests = 0


class EngineClient:
    def __init__(
        self,
        inbox: zmq.Socket,
        to_tokenizer: zmq.Socket,
        tracer: RequestTracer = NULL_TRACER,
        max_open_requests: int | None = None,
        max_unread_replies: int | None = None,
        metrics: ServerMetrics | None = None,
    ):
        self.inbox = inbox  # bound, synchronous; shadowed by an asyncio socket in `start`
        self.to_tokenizer = to_tokenizer
        self.tracer = tracer
        self.max_open_requests = max_open_requests  # running + queued; None: no limit
        self.max_unread_replies = max_unread_replies  # per engine request; None: no limit
        self.metrics = metrics or ServerMetrics()  # every request passes here: latencies are measured here
        self.queues: dict[int, ReplyQueue] = {}  # uid -> queue of its HTTP request
        self.calls: dict[int, asyncio.Future] = {}
        self.uids = itertools.count()
        self.call_ids = itertools.count()
        self.failure: str | None = None  # set once a worker died: every new call fails with it
        self._receiver: asyncio.Task | None = None

    def start(self) -> None:
        self._receiver = asyncio.get_running_loop().create_task(self._receive())

    async def _receive(self) -> None:
        sock = zmq.asyncio.Socket.from_socket(self.inbox)
        while True:
            self.route(m.decode(await sock.recv(), "api"))

    def route(self, msg: m.Message) -> None:
        if isinstance(msg, m.ReplyBatch):
            now = time.monotonic()
            for reply in msg.replies:
                self.metrics.reply(reply, now)
                queue = self.queues.get(reply.uid)
                if queue is not None:
                    queue.put_nowait(reply)
                    if reply.finish_reason is not None:
                        del self.queues[reply.uid]
                    limit = self.max_unread_replies
                    if limit is not None and queue.qsize() > limit * queue.requests:
                        self.abort_unread(queue, limit)
        elif isinstance(msg, m.RequestFailed):
            self.metrics.request_failed(msg.uid)
            queue = self.queues.pop(msg.uid, None)
            if queue is not None:
                queue.put_nowait(msg)
        elif isinstance(msg, (m.TokenizerResult, m.InfoReply)):
            future = self.calls.pop(msg.call_id, None)
            if future is not None and not future.done():
                future.set_result(msg)
        elif isinstance(msg, m.WorkerFailed):
            log.error("the %s worker failed: %s", msg.role, msg.message)
        else:
            log.debug("api server ignored %s", type(msg).__name__)

    def abort_unread(self, queue: ReplyQueue, limit: int) -> None:
        """The client of `queue` stopped reading: abort its requests; the error is its last event."""
        message = (
            f"request aborted: its client left more than {limit} replies unread "
            "(--max-unread-replies); read the stream as it arrives"
        )
        log.warning("%s", message)
        for uid in [uid for uid, q in self.queues.items() if q is queue]:
            self.abort(uid)
            queue.put_nowait(m.RequestFailed(uid=uid, message=message, status=400))

    # -- requests ------------------------------------------------------------------------------
    def submit(self, queue: ReplyQueue, request: m.GenerateRequest) -> None:
        if self.failure:
            raise APIError(503, self.failure)
        if self.max_open_requests is not None and len(self.queues) >= self.max_open_requests:
            raise ServerOverloaded(
                f"the server is at capacity ({len(self.queues)} requests running or waiting, "
                "--max-running-requests + --max-queued-requests); retry later"
            )
        queue.requests += 1
        self.queues[request.uid] = queue
        self.metrics.request_started(request.uid, time.monotonic())
        if self.tracer.enabled:
            self.tracer.emit(RECEIVED, request.uid)
        send(self.to_tokenizer, request)

    def abort(self, uid: int, forget: bool = True) -> None:
        """Abort in the scheduler (its KV is freed at the next step). With `forget`, replies
        still in flight are dropped; without, the request's stream ends with finish "abort"."""
        if forget:
            self.queues.pop(uid, None)
        if not self.failure:
            send(self.to_tokenizer, m.AbortRequest(uid=uid))

    async def call(self, msg: m.TokenizerCall | m.InfoQuery, timeout: float = 30.0):
        if self.failure:
            raise APIError(503, self.failure)
        future = asyncio.get_running_loop().create_future()
        self.calls[msg.call_id] = future
        send(self.to_tokenizer, msg)
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise APIError(503, f"no answer from the workers in {timeout:.0f} s") from None
        finally:
            self.calls.pop(msg.call_id, None)

    def fail_all(self, reason: str) -> None:
        """A worker died: end every open request and call with a 503."""
        self.failure = reason
        self.metrics.clear()
        for uid, queue in list(self.queues.items()):
            queue.put_nowait(m.RequestFailed(uid=uid, message=reason, status=503))
        self.queues.clear()
        for future in self.calls.values():
            if not future.done():
                future.set_exception(APIError(503, reason))
        self.calls.clear()


@dataclass
class RequestGroup:
    """The engine requests behind one HTTP request (several prompts, or n > 1), sharing a queue.

    `choice` maps each uid to its index in the answer. Leaving the group (`close`) aborts
    whatever has not finished, which is how a disconnected client frees its KV.
    """

    client: EngineClient
    rid: str
    queue: ReplyQueue = field(default_factory=ReplyQueue)
    choice: dict[int, int] = field(default_factory=dict)
    open: set[int] = field(default_factory=set)
    backlog: list[Event] = field(default_factory=list)

    def submit(self, index: int, request: m.GenerateRequest) -> None:
        self.choice[request.uid] = index
        self.open.add(request.uid)
        self.client.submit(self.queue, request)

    async def wait_started(self) -> None:
        """Wait until every request produced its first reply, so a request that fails
        validation is answered with an HTTP error instead of a stream that breaks off."""
        pending = set(self.open)
        while pending:
            event = await self.queue.get()
            self.backlog.append(event)
            if isinstance(event, m.RequestFailed):
                self.open.discard(event.uid)
                self.close()
                raise APIError(event.status, event.message, event.param, event.code)
            pending.discard(event.uid)
            if event.finish_reason is not None:
                self.open.discard(event.uid)

    async def events(self):
        """Every reply, in arrival order, until all requests finished.

        Whatever queued up while the stream was busy is taken at once and each request's
        replies in it become one (`coalesce`): a stream that falls behind (the api server's
        loop is saturated by a burst: ~256 streams x ~170 steps/s) then sends fewer, larger
        chunks instead of falling further behind and delaying everyone's new requests.
        """
        backlog, self.backlog = self.backlog, []
        for event in coalesce(backlog):
            yield event
        while self.open:
            waiting = [await self.queue.get()]
            while not self.queue.empty():
                waiting.append(self.queue.get_nowait())
            for event in coalesce(waiting):
                if isinstance(event, m.RequestFailed) or event.finish_reason is not None:
                    self.open.discard(event.uid)
                yield event

    def close(self) -> None:
        for uid in self.open:
            self.client.abort(uid)
        self.open.clear()


def coalesce(events: list[Event]) -> list[Event]:
    """`events` with each request's consecutive replies merged into one (a failure, or the
    end of a request, stays last); the order of each request's own events is kept."""
    out: list[Event] = []
    open_reply: dict[int, int] = {}  # uid -> index in out of its reply that later ones join
    for event in events:
        at = open_reply.get(event.uid)
        if isinstance(event, m.Reply) and at is not None:
            out[at] = merge_replies(out[at], event)
        else:
            out.append(event)
            at = len(out) - 1
        if isinstance(event, m.Reply) and event.finish_reason is None:
            open_reply[event.uid] = at
        else:
            open_reply.pop(event.uid, None)
    return out


def merge_replies(first: m.Reply, later: m.Reply) -> m.Reply:
    """One reply covering `first` and then `later`, two replies of one request."""
    logprobs = first.logprobs
    if later.logprobs is not None:
        logprobs = TokenLogprobs()
        for part in (first.logprobs, later.logprobs):
            if part is not None:
                logprobs.extend(part)
    return msgspec.structs.replace(
        later,
        text=first.text + later.text,
        token_ids=first.token_ids + later.token_ids,
        queue_s=first.queue_s if first.queue_s is not None else later.queue_s,
        prefill_s=first.prefill_s if first.prefill_s is not None else later.prefill_s,
        logprobs=logprobs,
        prompt_logprobs=first.prompt_logprobs if first.prompt_logprobs is not None else later.prompt_logprobs,
        prompt_text=first.prompt_text if first.prompt_text is not None else later.prompt_text,
        cached_tokens=first.cached_tokens if first.cached_tokens is not None else later.cached_tokens,
    )

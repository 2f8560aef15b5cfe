"""The one response driver of completions, chat and /generate: check -> start -> stream or collect.

An endpoint describes its request as a `Job` and its answer's JSON as a `ResponseShape`; the
driver submits the engine requests, waits until each has started (so a request the workers
refuse is an HTTP error, not a stream that breaks off), arms the request's `timeout`, and then
either streams one SSE event per reply or collects the whole answer. A client that disconnects,
streaming or not, aborts its requests (`finish` runs in a `finally`), which frees their KV at the
next step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from minfer.core import SamplingParams, TokenLogprobs
from minfer.ipc import messages as m
from minfer.server.client import RequestGroup
from minfer.server.errors import APIError
from minfer.server.state import ServerState

SSE_DONE = b"data: [DONE]\n\n"
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; nobody reads it


def sse(obj) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def json_response(obj, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


@dataclass
class Choice:
    """One choice of an answer, accumulated from its replies."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or token; for a timeout, why it was aborted
    first_token_time: float | None = None
    finish_time: float | None = None
    queue_s: float | None = None  # measured by the scheduler, sent with the first token
    prefill_s: float | None = None
    logprobs: TokenLogprobs = field(default_factory=TokenLogprobs)  # of token_ids, when asked for
    prompt_logprobs: TokenLogprobs | None = None
    prompt_text: str = ""  # with echo
    cached_tokens: int = 0  # prompt tokens the prefix cache held, sent with the first token

    def add(self, reply: m.Reply, abort_reason: str | None = None) -> None:
        if reply.logprobs is not None:
            self.logprobs.extend(reply.logprobs)
        if reply.prompt_logprobs is not None:
            self.prompt_logprobs = reply.prompt_logprobs
        if reply.prompt_text is not None:
            self.prompt_text = reply.prompt_text
        self.text += reply.text
        self.token_ids += reply.token_ids
        self.prompt_tokens = reply.prompt_tokens
        self.completion_tokens = reply.completion_tokens
        self.finish_reason = reply.finish_reason
        self.stop_reason = reply.stop_reason
        if reply.finish_reason == "abort" and abort_reason is not None:
            self.stop_reason = abort_reason
        if self.first_token_time is None and reply.token_ids:
            self.first_token_time = time.monotonic()
        if reply.cached_tokens is not None:
            self.cached_tokens = reply.cached_tokens
        if reply.queue_s is not None:
            self.queue_s, self.prefill_s = reply.queue_s, reply.prefill_s
        if reply.finish_reason is not None:
            self.finish_time = time.monotonic()


def usage(choices: dict[int, Choice], n: int) -> dict:
    """Usage over all choices; each prompt counts once although n choices share it."""
    prompt = sum(c.prompt_tokens for i, c in choices.items() if i % n == 0)
    cached = sum(c.cached_tokens for i, c in choices.items() if i % n == 0)
    completion = sum(c.completion_tokens for c in choices.values())
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},  # OpenAI's: prefix-cache hits
    }


def without_drawn_tokens(reply: m.Reply) -> m.Reply:
    """The reply of a prompt-only request (echo, max_tokens 0) as if nothing had been drawn:
    no text, tokens or logprobs of its own; it ends at its length (0), unless it was aborted."""
    finish = reply.finish_reason if reply.finish_reason in (None, "abort") else "length"
    stop_reason = reply.stop_reason if finish == "abort" else None
    return msgspec.structs.replace(
        reply,
        text="",
        token_ids=[],
        completion_tokens=0,
        logprobs=None,
        finish_reason=finish,
        stop_reason=stop_reason,
    )


@dataclass
class Job:
    """The engine requests behind one HTTP request: each prompt n times."""

    rid: str
    prompts: list  # text, token ids, or (chat) template messages
    params: SamplingParams
    max_tokens_auto: bool
    n: int = 1
    chat: bool = False
    echo: bool = False
    prompt_only: bool = False  # echo with max_tokens 0: each reply's drawn token left out
    timeout: float | None = None
    prompt_param: str = "prompt"  # the body field that holds the prompts, for errors
    tools: list[dict] | None = None  # chat: tools for the chat template
    chat_template_kwargs: dict | None = None  # chat: extra chat-template variables
    add_generation_prompt: bool = True  # chat: open the assistant's turn ...
    continue_final_message: bool = False  # ... or leave the last assistant message open


class ResponseShape(Protocol):
    """What differs between the endpoints: the JSON of a whole answer and of its stream."""

    def build(self, choices: dict[int, Choice]) -> dict | list: ...

    def opening(self, choices: dict[int, Choice]) -> Iterable[dict]: ...

    def chunk(self, index: int, reply: m.Reply, choices: dict[int, Choice]) -> dict | list[dict] | None:
        """The SSE event(s) of one reply: None for none, a list where one reply makes several."""

    def closing(self, choices: dict[int, Choice]) -> Iterable[dict]: ...


class ClientGone(Exception):
    pass


async def until_disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was read already, so the next ASGI message
    is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(work, request: Request):
    """Run `work`; raise ClientGone if the client disconnects first (and cancel `work`)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(until_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        raise ClientGone
    finally:
        watch.cancel()


class Deadline:
    """A request's `timeout`: when it passes, its open requests are aborted; their answers end
    with finish_reason "abort" and this says why."""

    def __init__(self, state: ServerState, group: RequestGroup, timeout: float | None):
        self.reason: str | None = None
        self._handle = None
        if timeout is not None:

            def expire():
                self.reason = f"the request's timeout of {timeout:g} s passed"
                for uid in list(group.open):
                    state.client.abort(uid, forget=False)

            self._handle = asyncio.get_running_loop().call_later(timeout, expire)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()


def check_batch(job: Job, limit: int) -> None:
    """--max-batch-prompts: one body may not fan out into more engine requests than this."""
    if len(job.prompts) > limit:
        raise APIError(
            400,
            f"{len(job.prompts)} prompts in one request, more than --max-batch-prompts={limit}",
            job.prompt_param,
        )
    if len(job.prompts) * job.n > limit:
        raise APIError(
            400,
            f"n={job.n} choices x {len(job.prompts)} prompts = {len(job.prompts) * job.n} "
            f"engine requests, more than --max-batch-prompts={limit}",
            "n",
        )


class Driver:
    """Runs one Job for one HTTP request and answers it with `shape`."""

    def __init__(self, state: ServerState, request: Request, job: Job):
        self.state, self.request, self.job = state, request, job
        self.group: RequestGroup | None = None
        self.deadline: Deadline | None = None

    async def respond(self, shape: ResponseShape, stream: bool) -> Response:
        try:
            await self.start()
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        if stream:
            return StreamingResponse(
                self.stream(shape),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        try:
            return json_response(shape.build(await unless_disconnected(self.collect(), self.request)))
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        finally:
            self.finish()

    async def start(self) -> None:
        state, job = self.state, self.job
        check_batch(job, state.server_config.max_batch_prompts)
        if job.rid in state.groups:
            raise APIError(400, f"request id {job.rid!r} is already in use", "rid")
        self.group = group = RequestGroup(state.client, job.rid)
        state.groups[job.rid] = group
        try:
            for i, prompt in enumerate(job.prompts):
                for j in range(job.n):
                    group.submit(i * job.n + j, self.engine_request(prompt, j))
            self.deadline = Deadline(state, group, job.timeout)
            await unless_disconnected(group.wait_started(), self.request)
        except BaseException:
            self.finish()
            raise

    def engine_request(self, prompt, j: int) -> m.GenerateRequest:
        job = self.job
        params = job.params
        if params.seed is not None and j > 0:  # choice j of n: its own sampling stream
            params = msgspec.structs.replace(params, seed=(params.seed + j) % 2**63)
        fields = {
            "uid": next(self.state.client.uids),
            "params": params,
            "max_tokens_auto": job.max_tokens_auto,
        }
        if job.chat:
            return m.GenerateRequest(
                **fields,
                messages=prompt,
                tools=job.tools,
                chat_template_kwargs=job.chat_template_kwargs,
                add_generation_prompt=job.add_generation_prompt,
                continue_final_message=job.continue_final_message,
            )
        if isinstance(prompt, str):
            return m.GenerateRequest(**fields, prompt=prompt, echo=job.echo)
        return m.GenerateRequest(**fields, prompt_ids=prompt, echo=job.echo)

    def finish(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        if self.group is not None:
            self.group.close()
            self.state.groups.pop(self.group.rid, None)

    async def replies(self, choices: dict[int, Choice]):
        """(index, reply) of every reply, each added to its choice; a worker's failure raises."""
        group = self.group
        async for event in group.events():
            if isinstance(event, m.RequestFailed):
                raise APIError(event.status, event.message, event.param, event.code)
            if self.job.prompt_only:
                event = without_drawn_tokens(event)
            index = group.choice[event.uid]
            choices[index].add(event, self.deadline.reason)
            yield index, event

    def new_choices(self) -> dict[int, Choice]:
        return {i: Choice() for i in self.group.choice.values()}

    async def collect(self) -> dict[int, Choice]:
        choices = self.new_choices()
        async for _ in self.replies(choices):
            pass
        return choices

    async def stream(self, shape: ResponseShape):
        try:
            choices = self.new_choices()
            for event in shape.opening(choices):
                yield sse(event)
            async for index, reply in self.replies(choices):
                events = shape.chunk(index, reply, choices)
                for event in events if isinstance(events, list) else [events] if events else []:
                    yield sse(event)
            for event in shape.closing(choices):
                yield sse(event)
            yield SSE_DONE
        except APIError as e:  # a worker died mid-stream
            yield sse(e.body())
            yield SSE_DONE
        finally:
            self.finish()  # also on disconnect: Starlette cancels this generator

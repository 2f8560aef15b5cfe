"""The HTTP API: OpenAI's completions and chat, SGLang's /generate, vLLM's tokenizer endpoints.

Every endpoint validates its body, hands engine requests to the EngineClient and turns the
replies into the answer's shape. A client that disconnects, streaming or not, aborts its
requests (RequestGroup.close runs in a `finally`), which frees their KV at the next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from minfer import __version__
from minfer.config import EngineConfig, ServerConfig
from minfer.core import InvalidRequestError, SamplingParams, TokenLogprobs
from minfer.ipc import messages as m
from minfer.ipc.process import dead_workers
from minfer.server.client import EngineClient, RequestGroup
from minfer.server.protocol import (
    AbortRequestBody,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequestBody,
    GenerateRequestBody,
    TokenizeRequestBody,
    describe_validation_errors,
)

log = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"
METRICS_SCRAPE_TIMEOUT_S = 2.0


def sse(obj) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def json_response(obj, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


@dataclass
class ServerState:
    """What the api server knows: its client of the workers and what they reported at start-up."""

    client: EngineClient
    model_name: str
    engine_config: EngineConfig
    server_config: ServerConfig
    scheduler_info: dict
    tokenizer_info: dict
    workers: dict[str, BaseProcess]
    healthy: bool = True
    exit_code: int = 0
    groups: dict[str, RequestGroup] = field(default_factory=dict)  # rid -> requests, for /abort_request
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def max_model_len(self) -> int:
        return self.scheduler_info["max_model_len"]

    def alive(self) -> bool:
        return self.healthy and all(p.is_alive() for p in self.workers.values())

    def why_dead(self) -> str:
        return "; ".join(dead_workers(self.workers)) or "shutting down"


@dataclass
class Choice:
    """One choice of an answer, accumulated from its replies."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    queue_s: float | None = None  # measured by the scheduler, sent with the first token
    prefill_s: float | None = None
    logprobs: TokenLogprobs = field(default_factory=TokenLogprobs)  # of token_ids, when asked for
    prompt_logprobs: TokenLogprobs | None = None
    prompt_text: str = ""  # with echo

    def add(self, reply: m.Reply) -> None:
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
        if self.first_token_time is None and reply.token_ids:
            self.first_token_time = time.monotonic()
        if reply.queue_s is not None:
            self.queue_s, self.prefill_s = reply.queue_s, reply.prefill_s
        if reply.finish_reason is not None:
            self.finish_time = time.monotonic()


def completion_logprobs(parts: list[TokenLogprobs], offset: int = 0) -> tuple[dict, int]:
    """OpenAI's completions `logprobs` object over consecutive tokens; text offsets start at
    `offset` (the characters before the first token). Returns it and the offset after it."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for part in parts:
        for i, text in enumerate(part.tokens):
            tokens.append(text)
            token_logprobs.append(part.logprobs[i])
            if part.logprobs[i] is None:  # the prompt's first token: nothing predicts it
                top_logprobs.append(None)
            else:  # the chosen token too, as vLLM does, so a sampled unlikely token is visible
                top = dict(zip(part.top_tokens[i], part.top_logprobs[i]))
                top.setdefault(text, part.logprobs[i])
                top_logprobs.append(top)
            text_offset.append(offset)
            offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}, offset


def chat_logprobs(lp: TokenLogprobs) -> dict:
    """OpenAI's chat `logprobs` object: token, logprob, UTF-8 bytes and the top alternatives."""
    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {"content": [
        {**entry(token, logprob), "top_logprobs": [entry(t, v) for t, v in zip(top_tokens, top_values)]}
        for token, logprob, top_tokens, top_values in zip(lp.tokens, lp.logprobs, lp.top_tokens, lp.top_logprobs)]}


def sglang_logprobs(lp: TokenLogprobs, start: int, with_text: bool) -> tuple[list, list]:
    """SGLang's (token logprobs, top logprobs) lists of [logprob, token id, text or None] from
    position `start` on."""
    def item(logprob, token_id, text):
        return [logprob, token_id, text if with_text else None]

    tokens, tops = [], []
    for i in range(start, len(lp.token_ids)):
        tokens.append(item(lp.logprobs[i], lp.token_ids[i], lp.tokens[i] if lp.tokens else None))
        tops.append(None if lp.logprobs[i] is None else [
            item(v, t, s) for v, t, s in zip(lp.top_logprobs[i], lp.top_ids[i], lp.top_tokens[i] or [None] * len(
                lp.top_ids[i]))])
    return tokens, tops


def usage(choices: dict[int, Choice], n: int) -> dict:
    """Usage over all choices; each prompt counts once although n choices share it."""
    prompt = sum(c.prompt_tokens for i, c in choices.items() if i % n == 0)
    completion = sum(c.completion_tokens for c in choices.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def until_disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was read already, so the next ASGI message
    is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClientGone(Exception):
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


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="minfer", version=__version__, docs_url=None, redoc_url=None)
    client = state.client

    # -- errors: always OpenAI's shape, never a traceback --------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(_request, exc: APIError):
        response = json_response(exc.body(), exc.status)
        response.headers.update(getattr(exc, "headers", {}))  # Retry-After of a full queue
        return response

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_request, exc: InvalidRequestError):
        err = APIError.invalid(exc)
        return json_response(err.body(), err.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_request, exc: RequestValidationError):
        message, param = describe_validation_errors(exc.errors())
        return json_response(APIError(400, message, param).body(), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request, exc: StarletteHTTPException):
        return json_response(APIError(exc.status_code, str(exc.detail)).body(), exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_request, exc: Exception):
        log.exception("unexpected error")
        return json_response(APIError(500, f"internal error ({type(exc).__name__})").body(), 500)

    # -- helpers -------------------------------------------------------------------------------
    def check_model(name: str | None) -> None:
        if name is not None and name != state.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {state.model_name!r}",
                           "model", "model_not_found")

    def new_request(params: SamplingParams, auto: bool, prompt: str | list[int] | None = None,
                    messages: list[dict] | None = None, echo: bool = False) -> m.GenerateRequest:
        uid = next(client.uids)
        if isinstance(prompt, str):
            return m.GenerateRequest(uid=uid, params=params, prompt=prompt, max_tokens_auto=auto, echo=echo)
        if prompt is not None:
            return m.GenerateRequest(uid=uid, params=params, prompt_ids=prompt, max_tokens_auto=auto, echo=echo)
        return m.GenerateRequest(uid=uid, params=params, messages=messages, max_tokens_auto=auto)

    def choice_params(params: SamplingParams, j: int) -> SamplingParams:
        """Choice j of n: its own sampling stream when the request fixed a seed."""
        if params.seed is None or j == 0:
            return params
        return msgspec.structs.replace(params, seed=(params.seed + j) % 2**63)

    async def start(request: Request, rid: str, prompts: list, n: int, params: SamplingParams, auto: bool,
                    chat: bool = False, echo: bool = False) -> RequestGroup:
        if rid in state.groups:
            raise APIError(400, f"request id {rid!r} is already in use", "rid")
        group = RequestGroup(client, rid)
        state.groups[rid] = group
        try:
            for i, prompt in enumerate(prompts):
                for j in range(n):
                    p = choice_params(params, j)
                    req = new_request(p, auto, messages=prompt) if chat else new_request(p, auto, prompt, echo=echo)
                    group.submit(i * n + j, req)
            await unless_disconnected(group.wait_started(), request)
        except BaseException:
            finish(group)
            raise
        return group

    def finish(group: RequestGroup) -> None:
        group.close()
        state.groups.pop(group.rid, None)

    async def collect(group: RequestGroup) -> dict[int, Choice]:
        choices: dict[int, Choice] = {i: Choice() for i in group.choice.values()}
        async for event in group.events():
            if isinstance(event, m.RequestFailed):
                raise APIError(event.status, event.message, event.param)
            choices[group.choice[event.uid]].add(event)
        return choices

    async def answer(request: Request, group: RequestGroup, build):
        """Collect a whole answer; a client that leaves meanwhile aborts the requests."""
        try:
            return json_response(build(await unless_disconnected(collect(group), request)))
        except ClientGone:
            return Response(status_code=499)
        finally:
            finish(group)

    def streaming(group: RequestGroup, chunks):
        async def body():
            try:
                async for chunk in chunks:
                    yield chunk
            except APIError as e:  # a worker died mid-stream
                yield sse(e.body())
                yield SSE_DONE
            finally:
                finish(group)  # also on disconnect: Starlette cancels this generator

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def events(group: RequestGroup):
        async for event in group.events():
            if isinstance(event, m.RequestFailed):
                raise APIError(event.status, event.message, event.param)
            yield event

    # -- OpenAI: completions ---------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        body.check_supported()
        params, auto = body.sampling_params(body.max_tokens)
        rid = f"cmpl-{uuid.uuid4().hex}"
        try:
            group = await start(request, rid, body.prompts(), body.n, params, auto, echo=body.echo)
        except ClientGone:
            return Response(status_code=499)
        created = int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": state.model_name}
        want_logprobs = body.logprobs is not None

        def choice_logprobs(c: Choice) -> dict | None:
            if not want_logprobs:
                return None
            parts = [c.prompt_logprobs, c.logprobs] if body.echo and c.prompt_logprobs else [c.logprobs]
            return completion_logprobs(parts)[0]

        def build(choices: dict[int, Choice]) -> dict:
            return {**base, "choices": [
                {"index": i, "text": c.prompt_text + c.text if body.echo else c.text, "logprobs": choice_logprobs(c),
                 "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for i, c in sorted(choices.items())],
                "usage": usage(choices, body.n)}

        if not body.stream:
            return await answer(request, group, build)

        async def chunks():
            choices = {i: Choice() for i in group.choice.values()}
            offsets = dict.fromkeys(choices, 0)  # characters streamed so far, for text_offset
            async for reply in events(group):
                index = group.choice[reply.uid]
                choices[index].add(reply)
                text = reply.text
                parts = [reply.logprobs] if reply.logprobs else []
                if body.echo and reply.prompt_text is not None:
                    text = reply.prompt_text + text
                    parts = [reply.prompt_logprobs, *parts] if reply.prompt_logprobs else parts
                if not text and reply.finish_reason is None and not parts:
                    continue
                logprobs = None
                if want_logprobs:
                    logprobs, offsets[index] = completion_logprobs(parts, offsets[index])
                chunk = {**base, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                              "finish_reason": reply.finish_reason,
                                              "stop_reason": reply.stop_reason}]}
                if body.continuous_usage:
                    chunk["usage"] = usage(choices, body.n)
                yield sse(chunk)
            if body.include_usage:
                yield sse({**base, "choices": [], "usage": usage(choices, body.n)})
            yield SSE_DONE

        return streaming(group, chunks())

    # -- OpenAI: chat completions ----------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        body.check_supported()
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params, auto = body.sampling_params(max_tokens)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            group = await start(request, rid, [body.template_messages()], body.n, params, auto, chat=True)
        except ClientGone:
            return Response(status_code=499)
        base = {"id": rid, "created": int(time.time()), "model": state.model_name}

        def build(choices: dict[int, Choice]) -> dict:
            return {**base, "object": "chat.completion", "choices": [
                {"index": i, "message": {"role": "assistant", "content": c.text},
                 "logprobs": chat_logprobs(c.logprobs) if body.logprobs else None,
                 "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                for i, c in sorted(choices.items())], "usage": usage(choices, body.n)}

        if not body.stream:
            return await answer(request, group, build)

        chunk_base = {**base, "object": "chat.completion.chunk"}

        def chunk(index: int, delta: dict, finish_reason=None, stop_reason=None, logprobs=None) -> dict:
            return {**chunk_base, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                               "finish_reason": finish_reason, "stop_reason": stop_reason}]}

        async def chunks():
            choices = {i: Choice() for i in group.choice.values()}
            for index in sorted(choices):
                yield sse(chunk(index, {"role": "assistant", "content": ""}))
            async for reply in events(group):
                index = group.choice[reply.uid]
                choices[index].add(reply)
                has_logprobs = body.logprobs and reply.logprobs is not None
                if not reply.text and reply.finish_reason is None and not has_logprobs:
                    continue
                c = chunk(index, {"content": reply.text} if reply.text else {}, reply.finish_reason,
                          reply.stop_reason, chat_logprobs(reply.logprobs) if has_logprobs else None)
                if body.continuous_usage:
                    c["usage"] = usage(choices, body.n)
                yield sse(c)
            if body.include_usage:
                yield sse({**chunk_base, "choices": [], "usage": usage(choices, body.n)})
            yield SSE_DONE

        return streaming(group, chunks())

    # -- SGLang: /generate -----------------------------------------------------------------------
    @app.post("/generate")
    async def generate(body: GenerateRequestBody, request: Request):
        prompts, batched = body.prompts()
        params, auto = body.params()
        rid = body.rid or uuid.uuid4().hex
        arrival = time.monotonic()
        try:
            group = await start(request, rid, prompts, 1, params, auto)
        except ClientGone:
            return Response(status_code=499)

        def result(index: int, c: Choice) -> dict:
            reason = None
            if c.finish_reason == "length":
                reason = {"type": "length", "length": c.completion_tokens}
            elif c.finish_reason is not None:
                reason = {"type": c.finish_reason, "matched": c.stop_reason}
            end = c.finish_time if c.finish_time is not None else time.monotonic()
            first = c.first_token_time
            timings = {"queue_s": c.queue_s, "prefill_s": c.prefill_s,
                       "first_token_s": None if first is None else first - arrival,
                       "decode_s": None if first is None else end - first, "e2e_s": end - arrival}
            meta = {"id": rid if not batched else f"{rid}-{index}", "prompt_tokens": c.prompt_tokens,
                    "completion_tokens": c.completion_tokens, "finish_reason": reason,
                    "e2e_latency": timings["e2e_s"], "timings": timings}
            if body.return_logprob:
                with_text = body.return_text_in_logprobs
                meta["output_token_logprobs"], meta["output_top_logprobs"] = sglang_logprobs(c.logprobs, 0, with_text)
                if c.prompt_logprobs is not None:
                    meta["input_token_logprobs"], meta["input_top_logprobs"] = sglang_logprobs(
                        c.prompt_logprobs, body.logprob_start_len, with_text)
            return {"text": c.text, "output_ids": c.token_ids, "meta_info": meta}

        if not body.stream:
            def build(choices: dict[int, Choice]):
                results = [result(i, c) for i, c in sorted(choices.items())]
                return results if batched else results[0]

            return await answer(request, group, build)

        async def chunks():
            choices = {i: Choice() for i in group.choice.values()}
            async for reply in events(group):
                index = group.choice[reply.uid]
                choices[index].add(reply)
                if not reply.text and reply.finish_reason is None:
                    continue
                out = result(index, choices[index])
                if batched:
                    out["index"] = index
                yield sse(out)
            yield SSE_DONE

        return streaming(group, chunks())

    @app.post("/abort_request")
    async def abort_request(body: AbortRequestBody):
        group = state.groups.get(body.rid)
        if group is None:
            return json_response({"rid": body.rid, "aborted": 0})
        uids = list(group.open)
        for uid in uids:
            client.abort(uid, forget=False)  # its stream ends with finish_reason "abort"
        return json_response({"rid": body.rid, "aborted": len(uids)})

    # -- vLLM: tokenizer endpoints ---------------------------------------------------------------
    async def tokenizer_call(**fields) -> m.TokenizerResult:
        result = await client.call(m.TokenizerCall(call_id=next(client.call_ids), **fields))
        if result.error:
            raise APIError(400, result.error)
        return result

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequestBody):
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        messages = None if body.messages is None else [msg.as_template_input() for msg in body.messages]
        result = await tokenizer_call(kind="encode", text=body.prompt, messages=messages,
                                      add_special_tokens=body.add_special_tokens,
                                      add_generation_prompt=body.add_generation_prompt,
                                      return_token_strs=body.return_token_strs)
        return json_response({"count": len(result.token_ids), "max_model_len": state.max_model_len,
                              "tokens": result.token_ids, "token_strs": result.token_strs})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequestBody):
        check_model(body.model)
        result = await tokenizer_call(kind="decode", token_ids=body.tokens)
        return json_response({"prompt": result.text})

    @app.get("/tokenizer_info")
    async def get_tokenizer_info():
        return json_response({**state.tokenizer_info, "model_max_length": state.max_model_len})

    # -- status ----------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if state.alive():
            return Response(status_code=200)
        return json_response(APIError(503, client.failure or state.why_dead()).body(), 503)

    @app.get("/metrics")
    async def metrics():
        try:  # the scheduler's gauges and totals, fresh for this scrape
            live = await client.call(m.InfoQuery(call_id=next(client.call_ids)), timeout=METRICS_SCRAPE_TIMEOUT_S)
            client.metrics.update_scheduler(live.info.get("stats", {}))
        except APIError:
            pass  # a busy or dead scheduler: serve its last snapshot (/health says which)
        return Response(client.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return json_response({"object": "list", "data": [
            {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "minfer",
             "root": state.scheduler_info["model"], "max_model_len": state.max_model_len}]})

    @app.get("/version")
    async def version():
        return json_response({"version": __version__})

    @app.get("/v1/server_info")
    async def server_info():
        live = (await client.call(m.InfoQuery(call_id=next(client.call_ids)))).info
        return json_response({
            "version": __version__, "model": state.model_name,
            "engine_config": dataclasses.asdict(state.engine_config),
            "server_config": dataclasses.asdict(state.server_config),
            **state.scheduler_info, **live,
            "workers": {role: p.pid for role, p in state.workers.items()},
        })

    return app

"""OpenAI's POST /v1/completions."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Depends, Request

from minfer.ipc import messages as m
from minfer.server.driver import Choice, Driver, Job, usage
from minfer.server.errors import ERROR_RESPONSES
from minfer.server.logprobs import TextCursor, completion_logprobs, vllm_prompt_logprobs
from minfer.server.protocol import CompletionRequest
from minfer.server.state import ServerState, server_state

router = APIRouter(responses=ERROR_RESPONSES)


class CompletionShape:
    """A `text_completion` and its chunks; with echo the text starts with the prompt."""

    def __init__(self, body: CompletionRequest, rid: str, model: str):
        self.body = body
        self.base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model}
        self.want_logprobs = body.logprobs is not None
        self.cursors: dict[int, TextCursor] = {}  # the text streamed so far per choice, for text_offset

    def build(self, choices: dict[int, Choice]) -> dict:
        body = self.body

        def logprobs(c: Choice) -> dict | None:
            if not self.want_logprobs:
                return None
            parts = [c.prompt_logprobs, c.logprobs] if body.echo and c.prompt_logprobs else [c.logprobs]
            return completion_logprobs(parts, body.logprobs)

        def prompt_logprobs(c: Choice) -> dict:
            if body.prompt_logprobs is None or c.prompt_logprobs is None:
                return {}
            return {"prompt_logprobs": vllm_prompt_logprobs(c.prompt_logprobs, body.prompt_logprobs)}

        return {
            **self.base,
            "choices": [
                {
                    "index": i,
                    "text": c.prompt_text + c.text if body.echo else c.text,
                    "logprobs": logprobs(c),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    **prompt_logprobs(c),
                }
                for i, c in sorted(choices.items())
            ],
            "usage": usage(choices, body.n),
        }

    def opening(self, choices):
        return ()

    def chunk(self, index: int, reply: m.Reply, choices: dict[int, Choice]) -> dict | None:
        body = self.body
        text = reply.text
        parts = [reply.logprobs] if reply.logprobs else []
        if body.echo and reply.prompt_text is not None:
            text = reply.prompt_text + text
            parts = [reply.prompt_logprobs, *parts] if reply.prompt_logprobs else parts
        if not text and reply.finish_reason is None and not parts:
            return None
        logprobs = None
        if self.want_logprobs:
            logprobs = completion_logprobs(parts, body.logprobs, self.cursors.setdefault(index, TextCursor()))
        chunk = {
            **self.base,
            "choices": [
                {
                    "index": index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": reply.finish_reason,
                    "stop_reason": choices[index].stop_reason,
                }
            ],
        }
        if body.continuous_usage:
            chunk["usage"] = usage(choices, body.n)
        return chunk

    def closing(self, choices: dict[int, Choice]):
        if self.body.include_usage:
            yield {**self.base, "choices": [], "usage": usage(choices, self.body.n)}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, state: ServerState = Depends(server_state)):
    state.check_model(body.model)
    body.check_supported()
    params, auto = body.sampling_params(state.sampling_defaults)
    rid = f"cmpl-{uuid.uuid4().hex}"
    job = Job(
        rid,
        body.prompts(),
        params,
        auto,
        n=body.n,
        echo=body.echo,
        prompt_only=body.prompt_only,
        timeout=body.timeout,
    )
    return await Driver(state, request, job).respond(
        CompletionShape(body, rid, state.model_name), body.stream
    )

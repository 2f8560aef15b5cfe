"""OpenAI's POST /v1/chat/completions: messages rendered with the model's chat template."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Depends, Request

from minfer.ipc import messages as m
from minfer.server.driver import Choice, Driver, Job, usage
from minfer.server.errors import ERROR_RESPONSES
from minfer.server.logprobs import chat_logprobs
from minfer.server.protocol import ChatCompletionRequest
from minfer.server.state import ServerState, server_state

router = APIRouter(responses=ERROR_RESPONSES)


class ChatShape:
    """A `chat.completion`; streamed as `delta.role`, then `delta.content`, then `finish_reason`."""

    def __init__(self, body: ChatCompletionRequest, rid: str, model: str):
        self.body = body
        self.base = {"id": rid, "created": int(time.time()), "model": model}
        self.chunk_base = {**self.base, "object": "chat.completion.chunk"}

    def build(self, choices: dict[int, Choice]) -> dict:
        return {
            **self.base,
            "object": "chat.completion",
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": chat_logprobs(c.logprobs) if self.body.logprobs else None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for i, c in sorted(choices.items())
            ],
            "usage": usage(choices, self.body.n),
        }

    def _chunk(self, index: int, delta: dict, finish_reason=None, stop_reason=None, logprobs=None) -> dict:
        return {
            **self.chunk_base,
            "choices": [
                {
                    "index": index,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                    "stop_reason": stop_reason,
                }
            ],
        }

    def opening(self, choices: dict[int, Choice]):
        for index in sorted(choices):
            yield self._chunk(index, {"role": "assistant", "content": ""})

    def chunk(self, index: int, reply: m.Reply, choices: dict[int, Choice]) -> dict | None:
        has_logprobs = self.body.logprobs and reply.logprobs is not None
        if not reply.text and reply.finish_reason is None and not has_logprobs:
            return None
        c = self._chunk(
            index,
            {"content": reply.text} if reply.text else {},
            reply.finish_reason,
            choices[index].stop_reason,
            chat_logprobs(reply.logprobs) if has_logprobs else None,
        )
        if self.body.continuous_usage:
            c["usage"] = usage(choices, self.body.n)
        return c

    def closing(self, choices: dict[int, Choice]):
        if self.body.include_usage:
            yield {**self.chunk_base, "choices": [], "usage": usage(choices, self.body.n)}


@router.post("/v1/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest, request: Request, state: ServerState = Depends(server_state)
):
    state.check_model(body.model)
    body.check_supported()
    params, auto = body.sampling_params()
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    job = Job(
        rid,
        [body.template_messages()],
        params,
        auto,
        n=body.n,
        chat=True,
        timeout=body.timeout,
        prompt_param="messages",
    )
    return await Driver(state, request, job).respond(ChatShape(body, rid, state.model_name), body.stream)

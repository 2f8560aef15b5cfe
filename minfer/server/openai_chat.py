"""OpenAI's POST /v1/chat/completions: messages rendered with the model's chat template."""

from __future__ import annotations

import time
import uuid

import msgspec
from fastapi import APIRouter, Depends, Request

from minfer.ipc import messages as m
from minfer.server.driver import Choice, Driver, Job, usage
from minfer.server.errors import ERROR_RESPONSES
from minfer.server.logprobs import chat_logprobs, vllm_prompt_logprobs
from minfer.server.protocol import ChatCompletionRequest
from minfer.server.reasoning import ReasoningStream, reasoning_tokens, split_reasoning
from minfer.server.state import ServerState, server_state
from minfer.server.tool_calls import ToolPlan, finish_reason, message, tool_plan
from minfer.server.tool_stream import ToolCallStream
from minfer.tokenizer.intake import developer_as_system

router = APIRouter(responses=ERROR_RESPONSES)


class ChatShape:
    """A `chat.completion`; streamed as `delta.role`, then `delta.content` (or `delta.tool_calls`,
    after `delta.reasoning_content` with a reasoning parser), then `finish_reason`."""

    def __init__(
        self,
        body: ChatCompletionRequest,
        rid: str,
        model: str,
        plan: ToolPlan | None = None,
        reasoning_parser: str | None = None,
        reasoning_end_id: int | None = None,
    ):
        self.body = body
        self.plan = plan
        self.reasoning_parser = reasoning_parser
        self.reasoning_end_id = reasoning_end_id  # the `</think>` token, for usage's reasoning_tokens
        self.base = {"id": rid, "created": int(time.time()), "model": model}
        self.chunk_base = {**self.base, "object": "chat.completion.chunk"}
        self.tool_streams: dict[int, ToolCallStream] = {}
        self.reasoning_streams: dict[int, ReasoningStream] = {}

    def usage(self, choices: dict[int, Choice]) -> dict:
        """usage(), and with a reasoning parser OpenAI's completion_tokens_details.reasoning_tokens."""
        out = usage(choices, self.body.n)
        if self.reasoning_parser is not None:
            counts = [
                reasoning_tokens(self.reasoning_parser, c.text, c.token_ids, self.reasoning_end_id)
                for c in choices.values()
            ]
            if None not in counts:
                out["completion_tokens_details"] = {"reasoning_tokens": sum(counts)}
        return out

    def message(self, c: Choice) -> tuple[dict, str | None]:
        reasoning, text = None, c.text
        if self.reasoning_parser is not None:
            reasoning, text = split_reasoning(self.reasoning_parser, c.text)
        if self.plan is None:
            msg, reason = {"role": "assistant", "content": text}, c.finish_reason
        else:
            msg = message(self.plan, text)
            reason = finish_reason(c.finish_reason, "tool_calls" in msg)
        if self.reasoning_parser is not None:
            msg["reasoning_content"] = reasoning
        return msg, reason

    def build(self, choices: dict[int, Choice]) -> dict:
        extra = {}
        first = choices[min(choices)].prompt_logprobs if choices else None
        if self.body.prompt_logprobs is not None and first is not None:  # one prompt: vLLM's top-level field
            extra["prompt_logprobs"] = vllm_prompt_logprobs(first, self.body.prompt_logprobs)
        return {
            **self.base,
            "object": "chat.completion",
            **extra,
            "choices": [
                {
                    "index": i,
                    "message": msg,
                    "logprobs": chat_logprobs(c.logprobs) if self.body.logprobs else None,
                    "finish_reason": reason,
                    "stop_reason": c.stop_reason,
                }
                for i, c in sorted(choices.items())
                for msg, reason in [self.message(c)]
            ],
            "usage": self.usage(choices),
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

    def chunk(self, index: int, reply: m.Reply, choices: dict[int, Choice]) -> dict | list[dict] | None:
        if self.reasoning_parser is not None or self.plan is not None:
            return self.split_chunks(index, reply, choices)
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
            c["usage"] = self.usage(choices)
        return c

    def split_chunks(self, index: int, reply: m.Reply, choices: dict[int, Choice]) -> list[dict]:
        """A reply's chunks with a reasoning parser or tools: reasoning deltas, then the answer's
        (through the tool-call stream when tools are in play), what either held back once the
        answer ends, then the finish_reason; the logprobs ride on the first chunk."""
        reasoning = None
        if self.reasoning_parser is not None:
            reasoning = self.reasoning_streams.setdefault(index, ReasoningStream(self.reasoning_parser))
        done = reply.finish_reason is not None
        tools = None if self.plan is None else self.tool_streams.setdefault(index, ToolCallStream(self.plan))
        deltas = answer_deltas(reply.text, done, reasoning, tools)
        out = [self._chunk(index, delta) for delta in deltas]
        if self.body.logprobs and reply.logprobs is not None:
            if not out:
                out.append(self._chunk(index, {}))
            out[0]["choices"][0]["logprobs"] = chat_logprobs(reply.logprobs)
        if done:
            reason = finish_reason(reply.finish_reason, tools.has_calls) if tools else reply.finish_reason
            out.append(self._chunk(index, {}, reason, choices[index].stop_reason))
        if self.body.continuous_usage and out:
            out[-1]["usage"] = self.usage(choices)
        return out

    def closing(self, choices: dict[int, Choice]):
        if self.body.include_usage:
            yield {**self.chunk_base, "choices": [], "usage": self.usage(choices)}


def answer_deltas(
    text: str, done: bool, reasoning: ReasoningStream | None, tools: ToolCallStream | None
) -> list[dict]:
    """New answer text as chat deltas: `reasoning_content` and `content` (with a reasoning
    parser), the content through the tool-call stream (with tools: `content` or `tool_calls`),
    and once the answer is `done`, what either stream held back."""
    if reasoning is None:
        pieces = [("content", text)] if text else []
    else:
        pieces = reasoning.feed(text) + (reasoning.finish() if done else [])
    deltas: list[dict] = []
    for kind, piece in pieces:
        deltas += tools.feed(piece) if tools is not None and kind == "content" else [{kind: piece}]
    if done and tools is not None:
        deltas += tools.finish()
    return deltas


def chat_job(body: ChatCompletionRequest, state: ServerState, rid: str, prompt_param: str = "messages"):
    """The Job of a chat request, and its ToolPlan (None without tools): the tools go into the
    template's input, and a forced call becomes the output's grammar."""
    body.check_supported()
    params, auto = body.sampling_params(state.sampling_defaults)
    template = state.tokenizer_info.get("chat_template")
    # before the tool plan, which merges its tools prompt into a leading system message
    messages, tools = developer_as_system(template, body.template_messages()), None
    plan = tool_plan(body, state.server_config.tool_call_parser, template)
    if plan is not None:
        messages, tools = plan.template_inputs(messages, template)
        forced = plan.structured_output()
        if forced is not None:
            params = msgspec.structs.replace(params, structured_output=forced)
    job = Job(
        rid,
        [messages],
        params,
        auto,
        n=body.n,
        chat=True,
        timeout=body.timeout,
        prompt_param=prompt_param,
        tools=tools,
        chat_template_kwargs=body.chat_template_kwargs,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
    )
    return job, plan


@router.post("/v1/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest, request: Request, state: ServerState = Depends(server_state)
):
    state.check_model(body.model)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    job, plan = chat_job(body, state, rid)
    shape = ChatShape(body, rid, state.model_name, plan, *state.reasoning)
    return await Driver(state, request, job).respond(shape, body.stream)

"""OpenAI's POST /v1/responses, stateless: text in, text out, through the chat path.

The input (a string, or messages whose content is a string or input_text / output_text parts)
and the `instructions` become chat messages, rendered with the model's chat template;
`max_output_tokens`, `temperature`, `top_p` and `text.format` (json_object, json_schema) become
the chat request's fields. The answer is a `response` whose output is a message with one
output_text part (after a reasoning item, with a --reasoning-parser); streamed, it is OpenAI's
event sequence (response.created ... response.output_text.delta ... response.completed).
Nothing is stored, so `previous_response_id` is refused, as are tools (chat completions take them).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import Field, ValidationError

from minfer.ipc import messages as m
from minfer.server.body import Body, Int, Text
from minfer.server.driver import Choice, Driver, Job
from minfer.server.errors import ERROR_RESPONSES, APIError
from minfer.server.protocol import ChatCompletionRequest
from minfer.server.reasoning import ReasoningStream, split_reasoning
from minfer.server.state import ServerState, server_state

router = APIRouter(responses=ERROR_RESPONSES)


class InputText(Body):
    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(Body):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class TextFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(Body):
    format: TextFormat | None = None


class ResponsesRequest(Body):
    model: str | None = None
    input: Text | Annotated[list[InputMessage], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: TextConfig | None = None
    previous_response_id: str | None = None
    tools: list[dict] | None = None

    def chat_request(self) -> ChatCompletionRequest:
        """The same request as a chat completion (instructions first, as a system message)."""
        if self.previous_response_id is not None:
            raise APIError(
                400, "responses are not stored: send the whole conversation as input", "previous_response_id"
            )
        if self.tools:
            raise APIError(
                400, "tools are not supported by the responses endpoint: use chat completions", "tools"
            )
        items = [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        turns = [{"role": item.role, "content": item.text()} for item in items]
        if self.instructions:
            turns.insert(0, {"role": "system", "content": self.instructions})
        fields = {"model": self.model, "messages": turns, "stream": self.stream}
        for name, value in (
            ("max_tokens", self.max_output_tokens),
            ("temperature", self.temperature),
            ("top_p", self.top_p),
        ):
            if value is not None:
                fields[name] = value
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            fields["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            schema = {"name": fmt.name or "response", "schema": fmt.json_schema or {}, "strict": fmt.strict}
            fields["response_format"] = {"type": "json_schema", "json_schema": schema}
        return ChatCompletionRequest.model_validate(fields)


class ResponsesShape:
    """A `response` object, or its stream of events. Output items appear in order: a reasoning
    item (with a reasoning parser, once the model reasons), then the message."""

    def __init__(self, body: ResponsesRequest, rid: str, model: str, reasoning_parser: str | None):
        self.body, self.rid, self.model = body, rid, model
        self.created = int(time.time())
        self.ids = {"reasoning": f"rs_{uuid.uuid4().hex}", "message": f"msg_{uuid.uuid4().hex}"}
        self.parser = reasoning_parser
        self.splitter = ReasoningStream(reasoning_parser) if reasoning_parser else None
        self.streamed: dict[str, str] = {}  # output item kind -> its text so far, in opening order
        self.sequence = 0

    def item(self, kind: str, text: str, status: str) -> dict:
        if kind == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            return {
                "type": "reasoning",
                "id": self.ids[kind],
                "summary": [],
                "content": [part],
                "status": status,
            }
        part = {"type": "output_text", "text": text, "annotations": []}
        return {
            "type": "message",
            "id": self.ids[kind],
            "status": status,
            "role": "assistant",
            "content": [part],
        }

    def response(self, status: str, output: list[dict], c: Choice | None = None) -> dict:
        usage = None
        if c is not None:
            usage = {
                "input_tokens": c.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": c.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": c.prompt_tokens + c.completion_tokens,
            }
        failed = status == "failed"
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": {"code": "server_error", "message": str(c.stop_reason or "aborted")} if failed else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": self.body.instructions,
            "max_output_tokens": self.body.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": False,
            "temperature": self.body.temperature,
            "top_p": self.body.top_p,
            "tool_choice": "none",
            "tools": [],
            "text": self.body.text.model_dump(by_alias=True)
            if self.body.text
            else {"format": {"type": "text"}},
            "store": False,
            "usage": usage,
        }

    @staticmethod
    def status(finish_reason: str | None) -> str:
        return {"length": "incomplete", "abort": "failed"}.get(finish_reason, "completed")

    def build(self, choices: dict[int, Choice]) -> dict:
        c = choices[0]
        reasoning, text = split_reasoning(self.parser, c.text) if self.parser else (None, c.text)
        status = self.status(c.finish_reason)
        item_status = "incomplete" if status != "completed" else "completed"
        output = [] if reasoning is None else [self.item("reasoning", reasoning, item_status)]
        return self.response(status, [*output, self.item("message", text, item_status)], c)

    def event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def opening(self, choices: dict[int, Choice]):
        yield self.event("response.created", response=self.response("in_progress", []))
        yield self.event("response.in_progress", response=self.response("in_progress", []))

    def chunk(self, index: int, reply: m.Reply, choices: dict[int, Choice]) -> list[dict]:
        done = reply.finish_reason is not None
        if self.splitter is None:
            pieces = [("content", reply.text)] if reply.text else []
        else:
            pieces = self.splitter.feed(reply.text) + (self.splitter.finish() if done else [])
        out: list[dict] = []
        for kind, text in pieces:
            kind = "reasoning" if kind == "reasoning_content" else "message"
            if kind not in self.streamed:
                out += self.open_item(kind)
            self.streamed[kind] += text
            where = self.where(kind)
            delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            out.append(
                self.event(delta, **where, delta=text, **({} if kind == "reasoning" else {"logprobs": []}))
            )
        if done:
            if "message" not in self.streamed:  # an empty answer is still a message
                out += self.open_item("message")
            status = self.status(reply.finish_reason)
            for kind in list(self.streamed):
                out += self.close_item(kind, "completed" if status == "completed" else "incomplete")
            output = [
                self.item(k, t, "completed" if status == "completed" else "incomplete")
                for k, t in self.streamed.items()
            ]
            final = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
                status, "response.failed"
            )
            out.append(self.event(final, response=self.response(status, output, choices[index])))
        return out

    def where(self, kind: str) -> dict:
        return {
            "item_id": self.ids[kind],
            "output_index": list(self.streamed).index(kind),
            "content_index": 0,
        }

    def open_item(self, kind: str) -> list[dict]:
        self.streamed[kind] = ""
        item = {**self.item(kind, "", "in_progress"), "content": []}
        out = [self.event("response.output_item.added", output_index=len(self.streamed) - 1, item=item)]
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": []}
            out.append(self.event("response.content_part.added", **self.where(kind), part=part))
        return out

    def close_item(self, kind: str, status: str) -> list[dict]:
        text, where = self.streamed[kind], self.where(kind)
        if kind == "reasoning":
            out = [self.event("response.reasoning_text.done", **where, text=text)]
        else:
            part = {"type": "output_text", "text": text, "annotations": []}
            out = [
                self.event("response.output_text.done", **where, text=text, logprobs=[]),
                self.event("response.content_part.done", **where, part=part),
            ]
        item = self.item(kind, text, status)
        return [*out, self.event("response.output_item.done", output_index=where["output_index"], item=item)]

    def closing(self, choices: dict[int, Choice]):
        return ()


# The chat fields an error may name, as this endpoint's body spells them.
RESPONSES_NAMES = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format"}


def responses_param(param: str | None) -> str | None:
    for chat_name, name in RESPONSES_NAMES.items():
        if param is not None and (param == chat_name or param.startswith((chat_name + ".", chat_name + "["))):
            return name + param[len(chat_name) :]
    return param


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request, state: ServerState = Depends(server_state)):
    state.check_model(body.model)
    try:
        chat = body.chat_request()
        chat.check_supported()
        params, auto = chat.sampling_params()
        rid = f"resp_{uuid.uuid4().hex}"
        job = Job(rid, [chat.template_messages()], params, auto, chat=True, prompt_param="input")
        parser = state.server_config.reasoning_parser
        shape = ResponsesShape(body, rid, state.model_name, None if parser == "none" else parser)
        return await Driver(state, request, job).respond(shape, body.stream)
    except ValidationError as e:  # a field the chat request checks further (a response format's schema)
        error = e.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise APIError(400, f"{where}: {error['msg']}", responses_param(where)) from None
    except APIError as e:  # named as this body names it
        e.param = responses_param(e.param)
        raise

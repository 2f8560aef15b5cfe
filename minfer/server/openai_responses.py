"""OpenAI's POST /v1/responses, stateless, through the chat path.

The body becomes a chat request (responses_protocol.py) and runs as one (openai_chat.chat_job:
the chat template, tools, grammars). The answer is a `response` whose output items are a
reasoning item (with a --reasoning-parser), the message (one output_text part) and function
calls (with tools); streamed, OpenAI's event sequence: response.created, response.in_progress,
then per item output_item.added, its deltas (reasoning_text, output_text or
function_call_arguments; output_text deltas carry their tokens' logprobs when `include` asks)
and done events, output_item.done, and finally response.completed
(response.incomplete at max_output_tokens, response.failed when aborted).
"""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Depends, Request
from pydantic import ValidationError

from minfer.ipc import messages as m
from minfer.server.driver import Choice, Driver
from minfer.server.errors import ERROR_RESPONSES, APIError
from minfer.server.logprobs import chat_logprobs
from minfer.server.openai_chat import answer_deltas, chat_job
from minfer.server.reasoning import ReasoningStream, reasoning_tokens, split_reasoning
from minfer.server.responses_protocol import NamedFunctionChoice, ResponsesRequest
from minfer.server.state import ServerState, server_state
from minfer.server.tool_calls import ToolPlan, message
from minfer.server.tool_stream import ToolCallStream

router = APIRouter(responses=ERROR_RESPONSES)
ITEM_ID_PREFIX = {"reasoning": "rs", "message": "msg", "function_call": "fc"}  # as OpenAI's ids start


class ResponsesShape:
    """A `response` object, or its stream of events. Output items in the order they appear: a
    reasoning item (with a reasoning parser), the message, function calls (with tools)."""

    def __init__(
        self,
        body: ResponsesRequest,
        rid: str,
        model: str,
        plan: ToolPlan | None,
        reasoning_parser: str | None,
        reasoning_end_id: int | None = None,
    ):
        self.body, self.rid, self.model, self.plan = body, rid, model, plan
        self.reasoning_end_id = reasoning_end_id  # the `</think>` token, for usage's reasoning_tokens
        self.created = int(time.time())
        self.parser = reasoning_parser
        self.splitter = ReasoningStream(reasoning_parser) if reasoning_parser else None
        self.calls = ToolCallStream(plan) if plan is not None else None
        self.items: dict[str, dict] = {}  # streamed output items by key, in the order they opened
        self.sequence = 0
        # with include message.output_text.logprobs: (position, entry) of the answer's tokens not
        # yet sent (a stream sends them on its next output_text delta), and the message's whole list
        self.pending_logprobs: list[tuple[int, dict]] = []
        self.message_logprobs: list[dict] = []

    @staticmethod
    def item(
        kind: str, text: str, status: str, item_id: str | None = None, logprobs: list | None = None, **call
    ) -> dict:
        """An output item: kind "reasoning", "message", or "function_call" (`call`: its call_id
        and name; `text` its arguments)."""
        item_id = item_id or f"{ITEM_ID_PREFIX[kind]}_{uuid.uuid4().hex}"
        if kind == "function_call":
            return {"type": kind, "id": item_id, "status": status, **call, "arguments": text}
        if kind == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            return {"type": kind, "id": item_id, "summary": [], "content": [part], "status": status}
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
        return {"type": kind, "id": item_id, "status": status, "role": "assistant", "content": [part]}

    def response(self, status: str, output: list[dict], c: Choice | None = None) -> dict:
        usage = None
        if c is not None:
            usage = {
                "input_tokens": c.prompt_tokens,
                "input_tokens_details": {"cached_tokens": c.cached_tokens},
                "output_tokens": c.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": self.reasoning_count(c)},
                "total_tokens": c.prompt_tokens + c.completion_tokens,
            }
        body = self.body
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": {"code": "server_error", "message": str(c.stop_reason or "aborted")}
            if status == "failed"
            else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tool_choice": body.tool_choice.model_dump()
            if isinstance(body.tool_choice, NamedFunctionChoice)
            else body.tool_choice or "auto",
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
            "text": body.text.model_dump(by_alias=True) if body.text else {"format": {"type": "text"}},
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
        done = "completed" if status == "completed" else "incomplete"
        msg = message(self.plan, text) if self.plan is not None else {"content": text}
        calls = msg.get("tool_calls", [])
        output = [] if reasoning is None else [self.item("reasoning", reasoning, done)]
        if msg["content"] or not calls:
            output.append(self.item("message", msg["content"] or "", done, logprobs=self.answer_logprobs(c)))
        for call in calls:
            fn = call["function"]
            output.append(
                self.item("function_call", fn["arguments"], done, call_id=call["id"], name=fn["name"])
            )
        return self.response(status, output, c)

    def reasoning_count(self, c: Choice) -> int:
        """How many of the answer's first tokens are reasoning (0 where that is not known: a
        `</think>` spelt in pieces)."""
        if self.parser is None:
            return 0
        return reasoning_tokens(self.parser, c.text, c.token_ids, self.reasoning_end_id) or 0

    def answer_logprobs(self, c: Choice) -> list[dict]:
        """The logprobs of the answer's tokens after its reasoning (with include
        message.output_text.logprobs; with function calls their tokens are among them)."""
        if not self.body.wants_logprobs:
            return []
        return chat_logprobs(c.logprobs)["content"][self.reasoning_count(c) :]

    def stream_logprobs(self, reply: m.Reply, c: Choice, events: list[dict]) -> None:
        """The reply's answer tokens' logprobs on the first output_text delta among `events`, or
        held for a later one (text the stream holds back, a marker still undecided)."""
        if not self.body.wants_logprobs:
            return
        if reply.logprobs is not None:
            first = len(c.token_ids) - len(reply.token_ids)
            self.pending_logprobs += enumerate(chat_logprobs(reply.logprobs)["content"], first)
        reasoning = self.reasoning_count(c)
        self.pending_logprobs = [(p, e) for p, e in self.pending_logprobs if p >= reasoning]
        for event in events:
            if event["type"] == "response.output_text.delta" and self.pending_logprobs:
                event["logprobs"] = [e for _, e in self.pending_logprobs]
                self.pending_logprobs = []
                break

    def event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def opening(self, choices: dict[int, Choice]):
        yield self.event("response.created", response=self.response("in_progress", []))
        yield self.event("response.in_progress", response=self.response("in_progress", []))

    def chunk(self, index: int, reply: m.Reply, choices: dict[int, Choice]) -> list[dict]:
        done = reply.finish_reason is not None
        deltas = answer_deltas(reply.text, done, self.splitter, self.calls)
        out = [event for delta in deltas for event in self.delta_events(delta)]
        self.stream_logprobs(reply, choices[index], out)
        if done:
            self.message_logprobs = self.answer_logprobs(choices[index])
            if not self.items:  # an empty answer is still a message
                out += self.open_item("message", "message")
            if self.pending_logprobs and "message" in self.items:  # tokens without text (EOS)
                where = self.where("message")
                logprobs = [e for _, e in self.pending_logprobs]
                event = self.event(
                    "response.output_text.delta", **where, content_index=0, delta="", logprobs=logprobs
                )
                out.append(event)
            status = self.status(reply.finish_reason)
            final_status = "completed" if status == "completed" else "incomplete"
            for key in list(self.items):
                out += self.close_item(key, final_status)
            output = [self.whole_item(key, final_status) for key in self.items]
            final = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
                status, "response.failed"
            )
            out.append(self.event(final, response=self.response(status, output, choices[index])))
        return out

    def delta_events(self, delta: dict) -> list[dict]:
        """The events of one chat-shaped delta: reasoning_content, content, or a tool call's
        start (its id and name) or arguments."""
        out: list[dict] = []
        if "tool_calls" in delta:
            call = delta["tool_calls"][0]
            key = f"call{call['index']}"
            if "id" in call:
                out += self.open_item(key, "function_call", call_id=call["id"], name=call["function"]["name"])
            text = call["function"].get("arguments", "")
            if text:
                self.items[key]["text"] += text
                out.append(
                    self.event("response.function_call_arguments.delta", **self.where(key), delta=text)
                )
            return out
        kind, text = next(iter(delta.items()))
        key = "reasoning" if kind == "reasoning_content" else "message"
        if key not in self.items:
            out += self.open_item(key, key)
        self.items[key]["text"] += text
        if key == "reasoning":
            out.append(
                self.event("response.reasoning_text.delta", **self.where(key), content_index=0, delta=text)
            )
        else:
            out.append(
                self.event(
                    "response.output_text.delta", **self.where(key), content_index=0, delta=text, logprobs=[]
                )
            )
        return out

    def where(self, key: str) -> dict:
        return {"item_id": self.items[key]["id"], "output_index": list(self.items).index(key)}

    def whole_item(self, key: str, status: str) -> dict:
        record = self.items[key]
        logprobs = self.message_logprobs if record["kind"] == "message" else None
        return self.item(record["kind"], record["text"], status, record["id"], logprobs, **record["call"])

    def open_item(self, key: str, kind: str, **call) -> list[dict]:
        item = self.item(kind, "", "in_progress", **call)
        self.items[key] = {"kind": kind, "id": item["id"], "text": "", "call": call}
        if kind != "function_call":
            item["content"] = []
        out = [self.event("response.output_item.added", output_index=len(self.items) - 1, item=item)]
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(
                self.event("response.content_part.added", **self.where(key), content_index=0, part=part)
            )
        return out

    def close_item(self, key: str, status: str) -> list[dict]:
        record, where = self.items[key], self.where(key)
        text = record["text"]
        if record["kind"] == "function_call":
            out = [self.event("response.function_call_arguments.done", **where, arguments=text)]
        elif record["kind"] == "reasoning":
            out = [self.event("response.reasoning_text.done", **where, content_index=0, text=text)]
        else:
            logprobs = self.message_logprobs
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
            out = [
                self.event(
                    "response.output_text.done", **where, content_index=0, text=text, logprobs=logprobs
                ),
                self.event("response.content_part.done", **where, content_index=0, part=part),
            ]
        item = self.whole_item(key, status)
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
        rid = f"resp_{uuid.uuid4().hex}"
        job, plan = chat_job(body.chat_request(), state, rid, prompt_param="input")
        shape = ResponsesShape(body, rid, state.model_name, plan, *state.reasoning)
        return await Driver(state, request, job).respond(shape, body.stream)
    except ValidationError as e:  # a field the chat request checks further (a response format's schema)
        error = e.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise APIError(400, f"{where}: {error['msg']}", responses_param(where)) from None
    except APIError as e:  # named as this body names it
        e.param = responses_param(e.param)
        raise

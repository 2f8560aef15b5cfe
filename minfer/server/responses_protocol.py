"""The body of OpenAI's POST /v1/responses, and the same request as a chat completion.

Stateless: the conversation comes whole in `input` -- messages (user / assistant / system /
developer, text or input_text / output_text parts), the function calls of earlier answers and
their outputs -- and `instructions` becomes a system message first. Function `tools`,
`tool_choice` and `parallel_tool_calls` become the chat request's; `max_output_tokens`,
`temperature`, `top_p`, `text.format` (json_object, json_schema) and the logprobs `include`
(with `top_logprobs`) likewise. Reasoning items of earlier answers are dropped (chat templates
leave earlier reasoning out). Nothing is stored, so `previous_response_id`, `conversation`,
`background` and stored `prompt` templates are refused.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from minfer.server.body import Body, Int, Text
from minfer.server.errors import APIError
from minfer.server.protocol import ChatCompletionRequest

LOGPROBS_INCLUDE = "message.output_text.logprobs"


class InputText(Body):
    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(Body):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class FunctionCallItem(Body):
    """A function call of an earlier answer, sent back with the conversation."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutput(Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningItem(Body):
    type: Literal["reasoning"]


InputItem = InputMessage | FunctionCallItem | FunctionCallOutput | ReasoningItem


class FunctionTool(Body):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedFunctionChoice(Body):
    type: Literal["function"]
    name: str


class TextFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(Body):
    format: TextFormat | None = None


class ResponsesRequest(Body):
    model: str | None = None
    input: Text | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: TextConfig | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    # "message.output_text.logprobs" asks for the message's logprobs (top_logprobs alternatives
    # each); the other values name content minfer does not make (images, tool results, encrypted
    # reasoning) and are ignored
    include: list[str] | None = None
    top_logprobs: Int | None = None
    # stateful or stored requests: refused, not ignored (below)
    background: bool | None = None
    conversation: str | dict | None = None
    prompt: dict | None = None

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])

    def chat_request(self) -> ChatCompletionRequest:
        """The same request as a chat completion."""
        if self.previous_response_id is not None:
            raise APIError(
                400, "responses are not stored: send the whole conversation as input", "previous_response_id"
            )
        if self.conversation is not None:
            raise APIError(
                400, "conversations are not stored: send the whole conversation as input", "conversation"
            )
        if self.background:
            raise APIError(
                400, "background responses need storage, which this server has none of", "background"
            )
        if self.prompt is not None:
            raise APIError(400, "stored prompt templates are not available: send the input itself", "prompt")
        fields = {
            "model": self.model,
            "messages": self.chat_messages(),
            "stream": self.stream,
            "parallel_tool_calls": self.parallel_tool_calls,
            "logprobs": self.wants_logprobs,
        }
        for name, value in (
            ("max_tokens", self.max_output_tokens),
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("top_logprobs", self.top_logprobs if self.wants_logprobs else None),
        ):
            if value is not None:
                fields[name] = value
        if self.tools:
            fields["tools"] = [
                {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                for tool in self.tools
            ]
        if isinstance(self.tool_choice, NamedFunctionChoice):
            fields["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            fields["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            schema = {"name": fmt.name or "response", "schema": fmt.json_schema or {}, "strict": fmt.strict}
            fields["response_format"] = {"type": "json_schema", "json_schema": schema}
        return ChatCompletionRequest.model_validate(fields)

    def chat_messages(self) -> list[dict]:
        """The conversation as chat messages: consecutive function calls become one assistant
        message's tool_calls, each output a tool message."""
        items = [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        turns = [{"role": "system", "content": self.instructions}] if self.instructions else []
        for item in items:
            if isinstance(item, InputMessage):
                turns.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                if not (turns and turns[-1]["role"] == "assistant" and "tool_calls" in turns[-1]):
                    turns.append({"role": "assistant", "content": "", "tool_calls": []})
                turns[-1]["tool_calls"].append(call)
            elif isinstance(item, FunctionCallOutput):
                turns.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        return turns

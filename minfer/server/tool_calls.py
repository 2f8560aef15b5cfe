"""Tool calling on /v1/chat/completions: what a request's `tools` and `tool_choice` ask of the
prompt and the sampler, and how the output becomes `tool_calls`.

`auto` lets the model choose and parses its text with the model family's parser
(tool_parsers.py). `required` and a named function are enforced with the grammar engine: the
output is constrained to JSON (a list of `{"name", <arguments key>}` objects for `required`, the
arguments object itself for a named function), which is then wrapped into calls, so the
arguments always match the function's parameters schema. `none` leaves the tools out of the
prompt, so the model answers in text. A chat template that cannot render tools (it never reads
`tools`) gets them as a system message in the parser's format instead.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

import jsonschema

from minfer.core import StructuredOutput
from minfer.server.errors import APIError
from minfer.server.protocol import ChatCompletionRequest
from minfer.server.tool_parsers import PARSERS, ParsedCall, ParsedOutput, detect_parser, plain

ANY_OBJECT = {"type": "object"}


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_start_delta(index: int, name: str) -> dict:
    """A streamed call's first `tool_calls` delta: its id, type and name, no arguments yet."""
    start = {"index": index, "id": call_id(), "type": "function", "function": {"name": name, "arguments": ""}}
    return {"tool_calls": [start]}


def arguments_delta(index: int, text: str) -> dict:
    """A piece of a streamed call's arguments."""
    return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}


@dataclass
class ToolPlan:
    """How one request uses its tools."""

    mode: str  # "auto" | "none" | "required" | "named"
    tools: list[dict]  # OpenAI's tool dicts, as chat templates take them
    parser: object  # a parser of tool_parsers.PARSERS
    parallel: bool = True
    forced_name: str | None = None

    def schema(self) -> dict | None:
        """The JSON schema the output is held to (None: free text)."""
        parameters = {
            t["function"]["name"]: t["function"].get("parameters") or ANY_OBJECT for t in self.tools
        }
        if self.mode == "named":
            return parameters[self.forced_name]
        if self.mode != "required":
            return None
        key = self.parser.arguments_key
        one_call = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, key: schema},
                    "required": ["name", key],
                    "additionalProperties": False,
                }
                for name, schema in parameters.items()
            ]
        }
        return {
            "type": "array",
            "items": one_call,
            "minItems": 1,
            **({} if self.parallel else {"maxItems": 1}),
        }

    def structured_output(self) -> StructuredOutput | None:
        schema = self.schema()
        return None if schema is None else StructuredOutput("json_schema", json.dumps(schema))

    def parse(self, text: str) -> ParsedOutput:
        """The whole output as content and calls."""
        if self.mode == "none":
            return plain(text)
        if self.mode == "named":
            return ParsedOutput(None, [ParsedCall(self.forced_name, text)])
        if self.mode == "required":
            try:
                items = json.loads(text)
                calls = [ParsedCall(c["name"], json.dumps(c[self.parser.arguments_key])) for c in items]
            except (ValueError, TypeError, KeyError):  # cut short by max_tokens
                return plain(text)
            return ParsedOutput(None, calls)
        parsed = self.parser.parse(text)
        if not self.parallel:
            parsed.calls = parsed.calls[:1]
        return parsed

    def template_inputs(self, messages: list[dict], chat_template) -> tuple[list[dict], list[dict] | None]:
        """(messages, tools) to render. A template that never reads `tools` (Llama 3.0's) gets
        them as a system message, and earlier calls as text, in the parser's own format."""
        tools = None if self.mode == "none" else self.tools
        if "tools" in str(chat_template or ""):
            return messages, tools
        messages = [
            {**msg, "content": (msg["content"] + "\n" + self.parser.render(plain_calls(msg))).strip()}
            if msg.get("tool_calls")
            else msg
            for msg in messages
        ]
        if tools is None:
            return messages, None
        prompt = tools_system_prompt(tools, self.parser)
        if messages and messages[0]["role"] == "system":
            return [{**messages[0], "content": prompt + "\n\n" + messages[0]["content"]}, *messages[1:]], None
        return [{"role": "system", "content": prompt}, *messages], None


def plain_calls(msg: dict) -> list[dict]:
    return [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in msg["tool_calls"]
    ]


def tools_system_prompt(tools: list[dict], parser) -> str:
    example = parser.render([{"name": "function_name", "arguments": {"argument": "value"}}])
    listed = "\n".join(json.dumps(t["function"]) for t in tools)
    return (
        "You can call these functions:\n"
        f"{listed}\n\n"
        f"To call a function, answer with only this, one per call:\n{example}"
    )


def parser_for(body_field_parser: str, chat_template) -> object | None:
    name = detect_parser(chat_template) if body_field_parser == "auto" else body_field_parser
    return PARSERS.get(name)


def tool_plan(body: ChatCompletionRequest, parser_name: str, chat_template) -> ToolPlan | None:
    """The request's ToolPlan (None: no tools); 400 naming the field for a bad combination."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return None
    names = [tool.function.name for tool in body.tools]
    for i, tool in enumerate(body.tools):
        if names.index(tool.function.name) != i:
            raise APIError(400, f"two tools are named {tool.function.name!r}", f"tools[{i}].function.name")
        if tool.function.parameters is not None:
            check_parameters_schema(tool.function.parameters, f"tools[{i}].function.parameters")
    mode, forced_name = (choice or "auto"), None
    if not isinstance(mode, str):
        mode, forced_name = "named", choice.function.name
        if forced_name not in names:
            raise APIError(400, f"tool_choice names {forced_name!r}, which is not in tools", "tool_choice")
    if mode in ("named", "required") and body.structured_output() is not None:
        # the forced tool call is itself an output constraint (tool_plan's structured_output)
        param = "response_format" if body.response_format is not None else "tool_choice"
        raise APIError(
            400, f"{param} cannot be combined with tool_choice {mode!r}: both constrain the output", param
        )
    parser = parser_for(parser_name, chat_template)
    if parser is None and mode != "none":
        raise APIError(
            400,
            "this model's chat template shows no known tool-call format; start the server with "
            "--tool-call-parser hermes or llama3_json",
            "tools",
        )
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    return ToolPlan(mode, tools, parser, body.parallel_tool_calls, forced_name)


def check_parameters_schema(schema: dict, param: str) -> None:
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise APIError(400, f"not a valid JSON schema: {e.message}", param) from None
    if schema.get("type", "object") != "object":
        raise APIError(400, "function parameters must be a JSON schema of an object", param)


def tool_call_json(call: ParsedCall) -> dict:
    return {"id": call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's "tool_calls" when the model stopped by itself after calling tools."""
    return "tool_calls" if has_calls and reason == "stop" else reason


def message(plan: ToolPlan, text: str) -> dict:
    """A whole answer's assistant message."""
    parsed = plan.parse(text)
    msg = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        msg["tool_calls"] = [tool_call_json(call) for call in parsed.calls]
    return msg

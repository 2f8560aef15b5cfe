"""A model's text -> tool calls, one parser per model family's tool-call format.

hermes (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
blocks, with text before or after them. llama3_json (Llama 3.1+): a JSON object
`{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`), several separated by
`;`. Output that does not parse as calls stays plain content: a model that writes half a call
must not lose its answer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass
class ParsedOutput:
    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)


def plain(text: str) -> ParsedOutput:
    return ParsedOutput(text or None, [])


def joined_content(*parts: str) -> str | None:
    text = "\n".join(part.strip() for part in parts if part.strip())
    return text or None


def as_call(obj, arguments_keys: tuple[str, ...]) -> ParsedCall | None:
    """A call from one decoded JSON object, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = next((obj[key] for key in arguments_keys if key in obj), {})
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def template_arguments(arguments: str):
    """Arguments as templates expect them: a dict (Llama 3.1's template applies `tojson`), or
    the text itself when it is not a JSON object."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


class HermesParser:
    name = "hermes"
    arguments_key = "arguments"
    start_markers = ("<tool_call>",)
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedOutput:
        calls = []
        for block in self._block.finditer(text):
            try:
                call = as_call(json.loads(block.group(1)), ("arguments", "parameters"))
            except ValueError:
                call = None
            if call is None:
                return plain(text)
            calls.append(call)
        if not calls:
            return plain(text)
        return ParsedOutput(joined_content(*self._block.split(text)[::2]), calls)

    def render(self, calls: list[dict]) -> str:
        """Calls of an earlier turn in this format, for templates that cannot render tool_calls."""
        return "\n".join(
            "<tool_call>\n" + json.dumps({"name": c["name"], "arguments": c["arguments"]}) + "\n</tool_call>"
            for c in calls
        )


class Llama3JsonParser:
    name = "llama3_json"
    arguments_key = "parameters"
    python_tag = "<|python_tag|>"
    start_markers = (python_tag, '{"name"', '{ "name"')

    def parse(self, text: str) -> ParsedOutput:
        start = first_marker(text, self.start_markers)
        if start is None:
            return plain(text)
        pos = start + len(self.python_tag) if text.startswith(self.python_tag, start) else start
        decoder = json.JSONDecoder()
        calls = []
        while True:
            while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
                pos += 1
            try:
                obj, end = decoder.raw_decode(text, pos)
            except ValueError:
                break
            call = as_call(obj, ("parameters", "arguments"))
            if call is None:
                break
            calls.append(call)
            pos = end
        if not calls:
            return plain(text)
        return ParsedOutput(joined_content(text[:start], text[pos:]), calls)

    def render(self, calls: list[dict]) -> str:
        return "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}) for c in calls)


PARSERS = {parser.name: parser for parser in (HermesParser(), Llama3JsonParser())}


def first_marker(text: str, markers: tuple[str, ...]) -> int | None:
    found = [i for i in (text.find(marker) for marker in markers) if i >= 0]
    return min(found) if found else None


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing characters of `text` could be the start of a marker (a stream must not
    send them as content until the next text decides)."""
    for size in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(marker.startswith(text[-size:]) for marker in markers):
            return size
    return 0


def detect_parser(chat_template) -> str | None:
    """The parser a chat template's own tool-call format calls for, if it shows one."""
    text = json.dumps(chat_template) if not isinstance(chat_template, str) else chat_template
    if "<tool_call>" in text:
        return "hermes"
    if "<|python_tag|>" in text or "ipython" in text:
        return "llama3_json"
    return None

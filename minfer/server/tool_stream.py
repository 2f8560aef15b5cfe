"""One streamed choice's text split into `content` deltas and `tool_calls` deltas, as OpenAI
streams them.

Text before a tool call streams as content; a few characters are held back while they could
still be the start of a call marker (`<tool_call>`). Once a call has started, the rest is held
and parsed when the choice ends: each call is then sent as a delta with its id, type and name
and one with its arguments. A named function streams its arguments as they are generated (the
grammar makes the whole output the arguments object). If held text does not parse as calls, it
is sent as content at the end, so nothing the model wrote is lost.
"""

from __future__ import annotations

from minfer.server.tool_calls import ToolPlan, call_id
from minfer.server.tool_parsers import ParsedCall, first_marker, held_back


def call_deltas(index: int, call: ParsedCall) -> list[dict]:
    return [
        {
            "tool_calls": [
                {
                    "index": index,
                    "id": call_id(),
                    "type": "function",
                    "function": {"name": call.name, "arguments": ""},
                }
            ]
        },
        {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]},
    ]


class ToolCallStream:
    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of `text` already sent as content
        self.call_start: int | None = None  # where the first call begins in `text`
        self.calls_sent = 0

    def feed(self, text: str) -> list[dict]:
        """Deltas for newly generated text."""
        if not text:
            return []
        self.text += text
        mode = self.plan.mode
        if mode == "named":
            deltas = []
            if self.calls_sent == 0:
                deltas = call_deltas(0, ParsedCall(self.plan.forced_name, ""))[:1]
                self.calls_sent = 1
            return [*deltas, {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}]
        if mode == "required" or self.call_start is not None:
            return []
        if mode == "none":
            return self._content(len(self.text))
        start = first_marker(self.text, self.plan.parser.start_markers)
        if start is not None:
            self.call_start = start
            return self._content(start)
        return self._content(len(self.text) - held_back(self.text, self.plan.parser.start_markers))

    def finish(self) -> list[dict]:
        """Deltas for what was held back, once the choice has ended."""
        if self.plan.mode == "named":
            return []
        held = self.text[self.sent :]
        parsed = self.plan.parse(held)
        if self.plan.mode != "required" and self.call_start is None:
            return self._content(len(self.text))
        deltas = [d for i, call in enumerate(parsed.calls) for d in call_deltas(i, call)]
        self.calls_sent = len(parsed.calls)
        if parsed.content:
            deltas.append({"content": parsed.content})
        self.sent = len(self.text)
        return deltas

    @property
    def has_calls(self) -> bool:
        return self.calls_sent > 0

    def _content(self, upto: int) -> list[dict]:
        if upto <= self.sent:
            return []
        delta = {"content": self.text[self.sent : upto]}
        self.sent = upto
        return [delta]

"""One streamed choice's text split into `content` deltas and `tool_calls` deltas, as OpenAI
streams them.

Text before a tool call streams as content; a few characters are held back while they could
still be the start of a call marker (`<tool_call>`). Once a call has started, the rest is held
and parsed when the choice ends: each call is then sent as a delta with its id, type and name
and one with its arguments. If held text does not parse as calls, it is sent as content at the
end, so nothing the model wrote is lost. Where a grammar holds the output to calls, they stream
as generated: a named function's arguments (the whole output is the arguments object), and
`required`'s calls (required_calls_stream.py: each call's header once its name is complete,
then its arguments as written); cut short by max_tokens, the call sent so far stands.
"""

from __future__ import annotations

from minfer.server.required_calls_stream import RequiredCallsStream
from minfer.server.tool_calls import ToolPlan, arguments_delta, call_start_delta
from minfer.server.tool_parsers import ParsedCall, first_marker, held_back


def call_deltas(index: int, call: ParsedCall) -> list[dict]:
    return [call_start_delta(index, call.name), arguments_delta(index, call.arguments)]


class ToolCallStream:
    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of `text` already sent as content
        self.call_start: int | None = None  # where the first call begins in `text`
        self.calls_sent = 0
        self.required = RequiredCallsStream(plan.parser.arguments_key) if plan.mode == "required" else None

    def feed(self, text: str) -> list[dict]:
        """Deltas for newly generated text."""
        if not text:
            return []
        self.text += text
        mode = self.plan.mode
        if mode == "named":
            deltas = []
            if self.calls_sent == 0:
                deltas = [call_start_delta(0, self.plan.forced_name)]
                self.calls_sent = 1
            return [*deltas, arguments_delta(0, text)]
        if self.required is not None:
            deltas = self.required.read(self.text)
            self.calls_sent = self.required.calls
            return deltas
        if self.call_start is not None:
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
        if self.required is not None and self.required.calls:
            # streamed already; the reader stops only where the text left the grammar's shape,
            # so any calls after that point go out whole, and a call cut short stands as sent
            streamed = self.required.calls
            deltas = [
                d for i, call in enumerate(parsed.calls[streamed:], streamed) for d in call_deltas(i, call)
            ]
            self.calls_sent = max(streamed, len(parsed.calls))
            self.sent = len(self.text)
            return deltas
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

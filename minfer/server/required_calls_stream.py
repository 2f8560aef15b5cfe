"""The calls of `tool_choice: "required"` streamed as they are generated.

The grammar holds that output to a JSON array of `{"name": ..., <arguments key>: {...}}`
objects (tool_calls.ToolPlan.schema), so it can be read as it arrives: once a call's name is
complete its header goes out (id, type, name), then its arguments object streams as written,
up to its closing brace. The reader only ever moves forward over text it has fully read; where
the text does not have the expected shape (a key order the grammar did not impose, say) it stops
and sends nothing more, and the caller parses the whole output at the end as before.
"""

from __future__ import annotations

import json

from minfer.server.tool_calls import arguments_delta, call_start_delta

WHITESPACE = " \t\n\r"


class RequiredCallsStream:
    def __init__(self, arguments_key: str):
        self.key_token = json.dumps(arguments_key)
        self.text = ""  # the output so far, as the caller holds it
        self.pos = 0  # everything before it has been read
        self.state = "array"  # array -> call -> (name read) -> arguments -> after_call -> ...
        self.depth = 0  # of the arguments object being streamed
        self.in_string = self.escaped = False
        self.calls = 0  # headers sent
        self.failed = False

    def read(self, text: str) -> list[dict]:
        """tool_calls deltas for the text generated since the last call (`text`: the whole output
        so far)."""
        self.text = text
        deltas: list[dict] = []
        while not self.failed:
            step = getattr(self, f"_{self.state}")()
            if step is None:  # needs more text
                break
            deltas += step
        return deltas

    def _skip_space(self) -> bool:
        while self.pos < len(self.text) and self.text[self.pos] in WHITESPACE:
            self.pos += 1
        return self.pos < len(self.text)

    def _expect(self, literal: str) -> bool | None:
        """True past `literal`; None for too little text; False (and failed) for other text."""
        if not self._skip_space():
            return None
        ahead = self.text[self.pos : self.pos + len(literal)]
        if not literal.startswith(ahead):
            self.failed = True
            return False
        if len(ahead) < len(literal):
            return None
        self.pos += len(literal)
        return True

    def _array(self):
        if not self._expect("["):
            return None
        self.state = "call"
        return []

    def _call(self):
        """`{"name": "<name>", "<key>":` read whole, then the header goes out."""
        start = self.pos
        name = self._read_header()
        if name is None:
            if not self.failed:
                self.pos = start  # read again with more text
            return None
        self.state = "arguments"
        self.depth, self.in_string, self.escaped = 0, False, False
        self.calls += 1
        return [call_start_delta(self.calls - 1, name)]

    def _read_header(self) -> str | None:
        """The call's name, with the reader at its arguments' `{`; None for too little text."""
        if not (self._expect("{") and self._expect('"name"') and self._expect(":") and self._skip_space()):
            return None
        try:
            name, end = json.JSONDecoder().raw_decode(self.text, self.pos)
        except ValueError:
            return None  # the string is not complete yet (the grammar makes it a string)
        if not isinstance(name, str):
            self.failed = True
            return None
        self.pos = end
        if not (
            self._expect(",") and self._expect(self.key_token) and self._expect(":") and self._skip_space()
        ):
            return None
        if self.text[self.pos] != "{":
            self.failed = True
            return None
        return name

    def _arguments(self):
        """The arguments object as written, from its `{` to its matching `}`."""
        start = end = self.pos
        while end < len(self.text):
            ch = self.text[end]
            end += 1
            if self.in_string:  # brackets inside strings do not count
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.state = "after_call"
                    break
        self.pos = end
        if end == start:
            return None
        return [arguments_delta(self.calls - 1, self.text[start:end])]

    def _after_call(self):
        """The call object's `}`, then `,` (another call) or `]` (the last)."""
        start = self.pos
        if not (self._expect("}") and self._skip_space()):
            if not self.failed:
                self.pos = start  # read again with more text
            return None
        follows = self.text[self.pos]
        if follows not in ",]":
            self.failed = True
            return None
        self.pos += 1
        self.state = "call" if follows == "," else "done"
        return []

    def _done(self):
        return None

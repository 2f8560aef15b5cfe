"""Output constraints a chat or completions body may ask for, in any engine's spelling: OpenAI's
`response_format`, vLLM's `guided_*` fields and their newer `structured_outputs`, SGLang's `regex`
and `ebnf`. They become one StructuredOutput (xgrammar compiles it in the scheduler); a body that
gives two is a 400 naming the second. Left unparsed, the others' fields would be ignored silently.
"""

from __future__ import annotations

import json
from typing import Annotated

from pydantic import ConfigDict, Field

from minfer.core import StructuredOutput
from minfer.server.body import MAX_CHOICE_STRINGS, MAX_GRAMMAR_CHARS, Body
from minfer.server.errors import APIError


class JsonSchemaSpec(Body):
    model_config = ConfigDict(populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    """OpenAI's response_format: text, json_object, or json_schema {name, schema, strict}."""

    type: str = Field(description="text, json_object or json_schema")
    json_schema: JsonSchemaSpec | None = None

    def structured_output(self) -> StructuredOutput | None:
        if self.type not in ("text", "json_object", "json_schema"):
            raise APIError(
                400,
                f"response_format type {self.type[:40]!r} is not one of text, json_object, json_schema",
                "response_format",
            )
        if self.type == "json_object":
            return StructuredOutput("json")
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.json_schema is None:
                raise APIError(
                    400,
                    "response_format.json_schema.schema must be a JSON schema object",
                    "response_format.json_schema",
                )
            return StructuredOutput("json_schema", json.dumps(self.json_schema.json_schema))
        return None


class StructuredOutputsSpec(Body):
    """vLLM's `structured_outputs` (its newer spelling of the guided_* fields): one of these."""

    model_config = ConfigDict(populate_by_name=True)
    json_spec: Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)] | dict | None = Field(None, alias="json")
    regex: Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)] | None = None
    choice: Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICE_STRINGS)] | None = None
    grammar: Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)] | None = None
    json_object: bool | None = None


def _json_schema_text(schema: str | dict, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise APIError(400, f"{param} is not JSON: {e}", param) from None
    if not isinstance(schema, dict):
        raise APIError(400, f"{param} must be a JSON schema object", param)
    return json.dumps(schema)


def choice_grammar(choices: list[str], param: str) -> str:
    """An EBNF grammar whose sentences are exactly `choices` (vLLM's guided_choice)."""
    if any(not c for c in choices):
        raise APIError(400, f"{param} holds an empty string", param)
    # JSON's string escapes are also the grammar's (quote, backslash, control characters)
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class ConstraintFields(Body):
    """The output-constraint fields of the OpenAI endpoints' bodies."""

    response_format: ResponseFormat | None = None
    # vLLM's guided_* and structured_outputs, SGLang's regex and ebnf
    guided_json: Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)] | dict | None = None
    guided_regex: Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)] | None = None
    guided_choice: Annotated[list[str], Field(min_length=1, max_length=MAX_CHOICE_STRINGS)] | None = None
    guided_grammar: Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)] | None = None
    structured_outputs: StructuredOutputsSpec | None = None
    regex: Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)] | None = None
    ebnf: Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)] | None = None

    def structured_output(self) -> StructuredOutput | None:
        """The one output constraint the body asks for, in whichever engine's spelling; two are
        a 400 naming the second."""
        so = self.structured_outputs or StructuredOutputsSpec()
        given: list[tuple[str, StructuredOutput | None]] = []
        if self.response_format is not None and self.response_format.type != "text":
            given.append(("response_format", self.response_format.structured_output()))
        if so.json_object:
            given.append(("structured_outputs.json_object", StructuredOutput("json")))
        for param, schema in (("guided_json", self.guided_json), ("structured_outputs.json", so.json_spec)):
            if schema is not None:
                given.append((param, StructuredOutput("json_schema", _json_schema_text(schema, param))))
        for param, pattern in (
            ("guided_regex", self.guided_regex),
            ("structured_outputs.regex", so.regex),
            ("regex", self.regex),
        ):
            if pattern is not None:
                given.append((param, StructuredOutput("regex", pattern)))
        for param, choices in (
            ("guided_choice", self.guided_choice),
            ("structured_outputs.choice", so.choice),
        ):
            if choices is not None:
                given.append((param, StructuredOutput("ebnf", choice_grammar(choices, param))))
        for param, grammar in (
            ("guided_grammar", self.guided_grammar),
            ("structured_outputs.grammar", so.grammar),
            ("ebnf", self.ebnf),
        ):
            if grammar is not None:
                given.append((param, StructuredOutput("ebnf", grammar)))
        if len(given) > 1:
            names = ", ".join(p for p, _ in given)
            raise APIError(400, f"give at most one output constraint, not {names}", given[1][0])
        return given[0][1] if given else None

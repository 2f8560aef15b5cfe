"""Request bodies of the HTTP API (pydantic) and the error shape every endpoint answers with.

OpenAI's shapes for /v1/completions and /v1/chat/completions, SGLang's for /generate, vLLM's
for /tokenize, /detokenize. Fields minfer does not implement are refused with a 400 that says
so, rather than silently ignored, when ignoring them would change the answer.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from minfer.core import InvalidRequestError, SamplingParams, StructuredOutput


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @classmethod
    def invalid(cls, e: InvalidRequestError) -> APIError:
        code = "context_length_exceeded" if "context length" in str(e) else None
        return cls(400, str(e), e.param, code)

    def body(self) -> dict:
        kind = {400: "invalid_request_error", 404: "invalid_request_error", 503: "service_unavailable"}
        return {"error": {"message": self.message, "type": kind.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


def describe_validation_errors(errors: list[dict]) -> tuple[str, str | None]:
    """A readable message for pydantic's errors: `messages[0].role: Input should be ...`.

    Union branches show up in pydantic's locations as type names (`str`, `list[TextPart]`); they
    are dropped, and errors that then read the same are merged.
    """
    seen, parts = set(), []
    first_param = None
    for err in errors:
        path = ""
        for item in err.get("loc", ()):
            if item == "body":
                continue
            if isinstance(item, int):
                path += f"[{item}]"
            elif "[" in item or item in ("str", "int", "float", "bool", "list", "dict"):
                continue  # a union branch, not a field
            else:
                path += f".{item}" if path else item
        if err.get("type") == "json_invalid":
            text = "the request body is not valid JSON"
        elif err.get("type") == "missing":
            text = f"{path or 'body'}: field required"
        else:
            text = f"{path or 'body'}: {err.get('msg', 'invalid value')}"
        if text not in seen:
            seen.add(text)
            parts.append(text)
            first_param = first_param or path or None
    if len(parts) > 3:
        parts = parts[:3] + [f"({len(parts) - 3} more)"]
    return "; ".join(parts) or "invalid request", first_param


def token_bias(bias: dict[str, float] | None, param: str) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as JSON object keys) with integer keys."""
    out = {}
    for key, value in (bias or {}).items():
        try:
            out[int(key)] = float(value)
        except ValueError:
            raise APIError(400, f"{param} keys must be token ids, got {key!r}", param) from None
    return out


# More choices per prompt than this is a mistake, not a workload (each holds its own KV).
MAX_CHOICES = 128
# Integers cross to the workers as msgpack int64: a larger one is a 400 here, not a 500 there.
Int = Annotated[int, Field(ge=-(2**63), lt=2**63)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's extension: usage in every chunk


class _SamplingFields(_Body):
    """Fields the completions and chat endpoints share."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    min_p: float | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None
    ignore_eos: bool = False
    min_tokens: Int = 0
    n: Int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extension
    logit_bias: dict[str, float] | None = None
    response_format: dict | None = None
    user: str | None = None

    def structured_output(self) -> StructuredOutput | None:
        """OpenAI's response_format: text, json_object, or json_schema {name, schema, strict}."""
        fmt = self.response_format or {}
        kind = fmt.get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return StructuredOutput("json")
        if kind == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise APIError(400, "response_format.json_schema.schema must be a JSON schema object",
                               "response_format")
            return StructuredOutput("json_schema", json.dumps(schema))
        raise APIError(400, f"response_format type {kind!r} is not one of text, json_object, json_schema",
                       "response_format")

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(logprobs, prompt_logprobs) of SamplingParams: top-k of each, None for none."""
        return None, None

    def sampling_params(self, max_tokens: int | None) -> tuple[SamplingParams, bool]:
        """The request's SamplingParams, and whether max_tokens is left to fill the context."""
        if not 1 <= self.n <= MAX_CHOICES:
            raise APIError(400, f"n must be in [1, {MAX_CHOICES}], got {self.n}", "n")
        auto = max_tokens is None
        logprobs, prompt_logprobs = self.logprob_counts()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        params = SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            max_tokens=max(1, self.min_tokens) if auto else max_tokens, min_tokens=self.min_tokens,
            stop=stop, stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos, seed=self.seed,
            frequency_penalty=self.frequency_penalty or 0.0, presence_penalty=self.presence_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=token_bias(self.logit_bias, "logit_bias"), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            structured_output=self.structured_output())
        try:
            params.validate()
        except InvalidRequestError as e:
            raise APIError.invalid(e) from None
        return params, auto

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = 16
    echo: bool = False
    logprobs: Int | None = None
    suffix: str | None = None

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return self.logprobs, self.logprobs if self.echo else None

    def check_supported(self) -> None:
        if self.suffix:
            raise APIError(400, "suffix is not supported", "suffix")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt must not be empty", "prompt")
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict:
        """The plain dict a chat template expects; text parts are joined with newlines."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        msg = {"role": self.role, "content": content or ""}
        if self.name:
            msg["name"] = self.name
        return msg


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: bool | None = None
    top_logprobs: Int | None = None
    tools: list[dict] | None = None

    def logprob_counts(self) -> tuple[int | None, int | None]:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs to be true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None, None

    def check_supported(self) -> None:
        if self.tools:
            raise APIError(400, "tools are not supported", "tools")

    def template_messages(self) -> list[dict]:
        return [msg.as_template_input() for msg in self.messages]


class GenerateSamplingParams(_Body):
    """SGLang's `sampling_params` (its names and defaults)."""

    max_new_tokens: Int | None = 128
    min_new_tokens: Int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Int = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None
    ignore_eos: bool = False
    sampling_seed: Int | None = None
    seed: Int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    def structured_output(self) -> StructuredOutput | None:
        given = [(kind, spec) for kind, spec in (("json_schema", self.json_schema), ("regex", self.regex),
                                                 ("ebnf", self.ebnf)) if spec is not None]
        if len(given) > 1:
            raise APIError(400, "give at most one of json_schema, regex and ebnf", "sampling_params.json_schema")
        return StructuredOutput(*given[0]) if given else None

    def to_params(self, logprobs: int | None = None, prompt_logprobs: int | None = None) -> tuple[SamplingParams, bool]:
        auto = self.max_new_tokens is None
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        params = SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                min_p=self.min_p, max_tokens=max(1, self.min_new_tokens) if auto else self.max_new_tokens,
                                min_tokens=self.min_new_tokens, stop=stop,
                                stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
                                seed=self.sampling_seed if self.sampling_seed is not None else self.seed,
                                frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
                                repetition_penalty=self.repetition_penalty,
                                logit_bias=token_bias(self.logit_bias, "sampling_params.logit_bias"),
                                logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                structured_output=self.structured_output())
        try:
            params.validate()
        except InvalidRequestError as e:
            e.param = f"sampling_params.{e.param}" if e.param else None
            raise APIError.invalid(e) from None
        return params, auto


class GenerateRequestBody(_Body):
    """SGLang's /generate body: `text` or `input_ids`, one prompt or a batch."""

    text: str | list[str] | None = None
    input_ids: list[Int] | list[list[Int]] | None = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: bool = False
    rid: str | None = None
    return_logprob: bool = False
    logprob_start_len: Int = -1  # -1: output logprobs only; p >= 0: also the prompt's from position p
    top_logprobs_num: Int = 0
    return_text_in_logprobs: bool = False

    def params(self) -> tuple[SamplingParams, bool]:
        if not self.return_logprob:
            return self.sampling_params.to_params()
        return self.sampling_params.to_params(self.top_logprobs_num,
                                              self.top_logprobs_num if self.logprob_start_len >= 0 else None)

    def prompts(self) -> tuple[list[str | list[int]], bool]:
        """The prompts, and whether the request was a batch (the answer is then a list)."""
        if (self.text is None) == (self.input_ids is None):
            raise APIError(400, "give exactly one of text and input_ids", "text")
        if self.text is not None:
            return ([self.text], False) if isinstance(self.text, str) else (list(self.text), True)
        ids = self.input_ids
        if not ids:
            raise APIError(400, "input_ids must not be empty", "input_ids")
        return ([list(ids)], False) if isinstance(ids[0], int) else ([list(x) for x in ids], True)


class TokenizeRequestBody(_Body):
    """vLLM's /tokenize: a `prompt`, or chat `messages` rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequestBody(_Body):
    model: str | None = None
    tokens: list[Int]


class AbortRequestBody(_Body):
    rid: str

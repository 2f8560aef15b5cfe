"""Request bodies of the HTTP API (pydantic, strict) and the one way a body becomes SamplingParams.

OpenAI's shapes for /v1/completions and /v1/chat/completions, vLLM's for /tokenize and
/detokenize (SGLang's /generate is in generate_protocol.py). Types are strict: `"10"` is not a
number and `1.0` is not an integer. Every size a client controls is bounded (body.py's types),
so no value can reach the workers and fail there. Fields minfer does not implement are refused
with a 400 that says so, rather than silently ignored, when ignoring them would change the answer
(body.py); output constraints in every engine's spelling are output_constraints.py's.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from minfer.core import MAX_LOGPROBS, InvalidRequestError, SamplingParams
from minfer.server.body import (
    MAX_CHOICES,
    MAX_TOOLS,
    UNSUPPORTED_FIELDS,
    AllowedTokenIds,
    BadWords,
    Body,
    Int,
    LogitBias,
    Stop,
    StopTokenIds,
    Text,
    Timeout,
    TokenIds,
    refuse_unsupported,
)
from minfer.server.errors import APIError
from minfer.server.output_constraints import ConstraintFields
from minfer.server.tool_parsers import template_arguments
from minfer.tokenizer.intake import check_template_kwargs

__all__ = ["APIError"]  # re-exported: the client of the workers raises it


def stop_list(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


_TOKEN_ID_KEY = re.compile(r"\d{1,10}")


def token_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as JSON object keys) with integer keys."""
    out = {}
    for key, value in bias.items():
        if not _TOKEN_ID_KEY.fullmatch(key) or int(key) >= 2**31:
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {key[:40]!r}", "logit_bias")
        out[int(key)] = value
    return out


def to_sampling_params(
    fields: dict, defaults: dict, param_name: Callable[[str], str] = str
) -> tuple[SamplingParams, bool]:
    """SamplingParams from `fields` in SamplingParams' own names (None keeps the model's default
    from `defaults`, else SamplingParams'), and whether max_tokens was left open (the scheduler
    then fills the context). A value out of range is a 400 naming the field as the body spells
    it (`param_name`)."""
    fields = {**defaults, **{name: value for name, value in fields.items() if value is not None}}
    auto = "max_tokens" not in fields
    if auto:  # a placeholder the scheduler replaces; it must pass validation meanwhile
        fields["max_tokens"] = max(1, fields.get("min_tokens", 0))
    try:
        if "logit_bias" in fields:
            fields["logit_bias"] = token_bias(fields["logit_bias"])
        params = SamplingParams(**fields)
        params.validate()
    except InvalidRequestError as e:
        raise APIError.invalid(e, param_name(e.param) if e.param else None) from None
    return params, auto


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's extension: usage in every chunk


class OpenAISamplingFields(ConstraintFields):
    """Fields the completions and chat endpoints share (the output constraints: ConstraintFields)."""

    # unknown fields are kept (not dropped) so that UNSUPPORTED_FIELDS can be checked
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    min_p: float | None = None
    seed: Int | None = None
    stop: Stop | None = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # vLLM's extension
    min_tokens: Int = 0
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extension
    logit_bias: LogitBias | None = None
    allowed_token_ids: AllowedTokenIds | None = None  # vLLM's extensions, as SamplingParams'
    bad_words: BadWords | None = None
    truncate_prompt_tokens: Int | None = None
    skip_special_tokens: bool | None = None
    user: str | None = None
    timeout: Timeout | None = None  # seconds; then the request is aborted (finish_reason "abort")
    # vLLM's: the prompt tokens' log-probabilities with this many alternatives each, in the
    # answer's `prompt_logprobs` (server/logprobs.vllm_prompt_logprobs); not with stream (vLLM's rule)
    prompt_logprobs: Int | None = None

    def max_new_tokens(self) -> int | None:
        return None

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(logprobs, prompt_logprobs) of SamplingParams: top-k of each, None for none."""
        return None, None

    def sampling_params(self, defaults: dict) -> tuple[SamplingParams, bool]:
        """The request's SamplingParams; `defaults`: the model's for fields it leaves unset."""
        refuse_unsupported(self.model_extra, UNSUPPORTED_FIELDS)
        if self.prompt_logprobs is not None and self.stream:
            raise APIError(400, "prompt_logprobs is not available with stream", "prompt_logprobs")
        logprobs, prompt_logprobs = self.logprob_counts()
        return to_sampling_params(
            {
                "temperature": self.temperature,
                "top_p": self.top_p,
                "top_k": self.top_k,
                "min_p": self.min_p,
                "max_tokens": self.max_new_tokens(),
                "min_tokens": self.min_tokens,
                "stop": stop_list(self.stop),
                "include_stop_str_in_output": self.include_stop_str_in_output,
                "stop_token_ids": self.stop_token_ids,
                "ignore_eos": self.ignore_eos,
                "seed": self.seed,
                "frequency_penalty": self.frequency_penalty,
                "presence_penalty": self.presence_penalty,
                "repetition_penalty": self.repetition_penalty,
                "logit_bias": self.logit_bias,
                "allowed_token_ids": self.allowed_token_ids,
                "bad_words": self.bad_words,
                "truncate_prompt_tokens": self.truncate_prompt_tokens,
                "skip_special_tokens": self.skip_special_tokens,
                "logprobs": logprobs,
                "prompt_logprobs": prompt_logprobs,
                "structured_output": self.structured_output(),
            },
            defaults,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(OpenAISamplingFields):
    prompt: (
        Text
        | Annotated[list[Text], Field(min_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    max_tokens: Int | None = 16
    echo: bool = False
    logprobs: Int | None = None
    suffix: str | None = None

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0 (OpenAI's and vLLM's): the prompt alone, with its logprobs --
        how evaluation tools score a text. The engine draws one token, which the answer leaves out."""
        return self.echo and self.max_tokens == 0

    def max_new_tokens(self) -> int | None:
        return 1 if self.prompt_only else self.max_tokens

    def logprob_counts(self) -> tuple[int | None, int | None]:
        # the prompt's alternatives serve both echo's logprobs and prompt_logprobs: the larger count
        counts = [n for n in (self.logprobs if self.echo else None, self.prompt_logprobs) if n is not None]
        return self.logprobs, max(counts, default=None)

    def check_supported(self) -> None:
        if self.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(
                400, "max_tokens must be at least 1 (0 only with echo: the prompt alone)", "max_tokens"
            )
        if self.prompt_only and self.min_tokens:
            raise APIError(400, f"min_tokens={self.min_tokens} is more than max_tokens=0", "min_tokens")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class TextPart(Body):
    type: Literal["text"]
    text: str


# OpenAI's rule for function names; it also keeps names safe to quote inside a prompt.
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]


class FunctionDefinition(Body):
    name: FunctionName
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Body):
    name: FunctionName


class NamedToolChoice(Body):
    """tool_choice {"type": "function", "function": {"name": ...}}: call exactly this function."""

    type: Literal["function"]
    function: NamedFunction


class CalledFunction(Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class AssistantToolCall(Body):
    """A tool call of an earlier assistant turn, sent back in `messages`."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # role "tool": which call this is the result of

    def as_template_input(self) -> dict:
        """The plain dict a chat template expects; text parts are joined with newlines."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        msg = {"role": self.role, "content": content or ""}
        if self.name:
            msg["name"] = self.name
        if self.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": template_arguments(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg


class ChatCompletionRequest(OpenAISamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: bool | None = None
    top_logprobs: Int | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's and SGLang's extension: extra variables for the chat template, e.g. Qwen3's
    # {"enable_thinking": false}
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: end the prompt without opening the assistant's turn, or continue the last
    # (assistant) message as given (a prefilled answer)
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprob_counts(self) -> tuple[int | None, int | None]:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs to be true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:  # named as sent
            raise APIError(
                400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}", "top_logprobs"
            )
        return (self.top_logprobs or 0) if self.logprobs else None, self.prompt_logprobs

    def check_supported(self) -> None:
        try:
            check_template_kwargs(self.chat_template_kwargs)
        except InvalidRequestError as e:
            raise APIError(400, str(e), e.param) from e
        if self.continue_final_message and (
            self.add_generation_prompt or self.messages[-1].role != "assistant"
        ):
            raise APIError(
                400,
                "continue_final_message needs add_generation_prompt false and an assistant message last",
                "continue_final_message",
            )
        for i, msg in enumerate(self.messages):
            if msg.tool_calls and msg.role != "assistant":
                raise APIError(
                    400,
                    f"only assistant messages carry tool_calls, not {msg.role!r}",
                    f"messages[{i}].tool_calls",
                )

    def template_messages(self) -> list[dict]:
        return [msg.as_template_input() for msg in self.messages]

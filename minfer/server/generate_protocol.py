"""SGLang's /generate body (its field names and defaults), strict like every other body."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from pydantic import ConfigDict, Field

from minfer.core import SamplingParams, StructuredOutput
from minfer.server.body import (
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
from minfer.server.protocol import stop_list, to_sampling_params

# SamplingParams' names that SGLang spells otherwise, for error messages.
SGLANG_NAMES = {
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "structured_output": "json_schema",
}


# SGLang's sampling parameters minfer does not implement: accepted at the value that means what
# minfer does, a 400 otherwise (see body.UNSUPPORTED_FIELDS).
UNSUPPORTED_SAMPLING_PARAMS: dict[str, Callable[[Any], bool]] = {
    "n": lambda v: v in (None, 1),
    "spaces_between_special_tokens": lambda v: v in (None, True),
    "stop_regex": lambda v: not v,
    "custom_params": lambda v: not v,
}


class GenerateSamplingParams(Body):
    """SGLang's `sampling_params`."""

    model_config = ConfigDict(extra="allow")  # kept, so UNSUPPORTED_SAMPLING_PARAMS can be checked

    max_new_tokens: Int | None = 128
    min_new_tokens: Int = 0
    # None: the model's generation_config.json default, else SGLang's (1.0, 1.0, -1, 0.0, 1.0)
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    min_p: float | None = None
    stop: Stop | None = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool = False
    no_stop_trim: bool = False  # the matched stop string stays in the text
    skip_special_tokens: bool = True
    sampling_seed: Int | None = None
    seed: Int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: LogitBias | None = None
    json_schema: str | None = None  # a JSON schema as a string
    regex: str | None = None
    ebnf: str | None = None

    def structured_output(self) -> StructuredOutput | None:
        given = [
            (kind, spec)
            for kind, spec in (("json_schema", self.json_schema), ("regex", self.regex), ("ebnf", self.ebnf))
            if spec is not None
        ]
        if len(given) > 1:
            raise APIError(
                400, "give at most one of json_schema, regex and ebnf", "sampling_params.json_schema"
            )
        return StructuredOutput(*given[0]) if given else None


class GenerateRequestBody(Body):
    """SGLang's /generate body: `text` or `input_ids`, one prompt or a batch."""

    text: Text | Annotated[list[Text], Field(min_length=1)] | None = None
    input_ids: TokenIds | Annotated[list[TokenIds], Field(min_length=1)] | None = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: bool = False
    rid: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    return_logprob: bool = False
    logprob_start_len: Int = -1  # -1: output logprobs only; p >= 0: also the prompt's from position p
    top_logprobs_num: Int = 0
    return_text_in_logprobs: bool = False
    timeout: Timeout | None = None  # seconds; then the request is aborted (finish_reason "abort")

    @property
    def prompt_only(self) -> bool:
        """max_new_tokens 0 (SGLang's): the prompt alone, with its logprobs when asked for; the
        engine draws one token, which the answer leaves out (driver.without_drawn_tokens)."""
        return self.sampling_params.max_new_tokens == 0

    def params(self, defaults: dict) -> tuple[SamplingParams, bool]:
        """The request's SamplingParams; `defaults`: the model's for fields it leaves unset."""
        sp = self.sampling_params
        refuse_unsupported(sp.model_extra, UNSUPPORTED_SAMPLING_PARAMS, "sampling_params.")
        if self.prompt_only and sp.min_new_tokens:
            raise APIError(
                400, "min_new_tokens is more than max_new_tokens=0", "sampling_params.min_new_tokens"
            )
        logprobs = self.top_logprobs_num if self.return_logprob else None
        prompt_logprobs = logprobs if self.return_logprob and self.logprob_start_len >= 0 else None
        return to_sampling_params(
            {
                "temperature": sp.temperature,
                "top_p": sp.top_p,
                "top_k": sp.top_k,
                "min_p": sp.min_p,
                "max_tokens": 1 if self.prompt_only else sp.max_new_tokens,
                "min_tokens": sp.min_new_tokens,
                "stop": stop_list(sp.stop),
                "stop_token_ids": sp.stop_token_ids,
                "include_stop_str_in_output": sp.no_stop_trim,
                "skip_special_tokens": sp.skip_special_tokens,
                "ignore_eos": sp.ignore_eos,
                "seed": sp.sampling_seed if sp.sampling_seed is not None else sp.seed,
                "frequency_penalty": sp.frequency_penalty,
                "presence_penalty": sp.presence_penalty,
                "repetition_penalty": sp.repetition_penalty,
                "logit_bias": sp.logit_bias,
                "logprobs": logprobs,
                "prompt_logprobs": prompt_logprobs,
                "structured_output": sp.structured_output(),
            },
            defaults,
            lambda name: f"sampling_params.{SGLANG_NAMES.get(name, name)}",
        )

    def prompts(self) -> tuple[list[str | list[int]], bool]:
        """The prompts, and whether the request was a batch (the answer is then a list)."""
        if (self.text is None) == (self.input_ids is None):
            raise APIError(400, "give exactly one of text and input_ids", "text")
        if self.text is not None:
            return ([self.text], False) if isinstance(self.text, str) else (list(self.text), True)
        ids = self.input_ids
        return ([list(ids)], False) if isinstance(ids[0], int) else ([list(x) for x in ids], True)

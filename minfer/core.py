"""Plain data shared by every role: sampling parameters, requests, batches.

The three numbers of a request's state (see docs/ARCHITECTURE.md):
  cached_len  positions [0, cached_len) have K/V stored in the pool
  device_len  positions [0, device_len) are known token ids on the device
  extend_len  = device_len - cached_len, what the next forward pass computes
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

import msgspec


class InvalidRequestError(ValueError):
    """A request that can never be served as asked; the message names the field and the limit.

    `code` is OpenAI's machine-readable error code where one applies (context_length_exceeded)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


# Most top logprobs one token may ask for (OpenAI's chat limit; each costs a top-k on the device).
MAX_LOGPROBS = 20


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of consecutive tokens, as parallel lists (one entry per token).

    `logprobs[i]` is the log-probability of `token_ids[i]` (None for a prompt's first token,
    which nothing predicts); `top_ids[i]` / `top_logprobs[i]` are the k most likely tokens at
    that position, most likely first. The tokenizer worker fills the token strings.
    """

    token_ids: list[int] = msgspec.field(default_factory=list)
    logprobs: list[float | None] = msgspec.field(default_factory=list)
    top_ids: list[list[int]] = msgspec.field(default_factory=list)
    top_logprobs: list[list[float]] = msgspec.field(default_factory=list)
    tokens: list[str] = msgspec.field(default_factory=list)
    top_tokens: list[list[str]] = msgspec.field(default_factory=list)
    # ranks[i]: how many tokens were at least as likely as token_ids[i] (1: the most likely one;
    # None where logprobs[i] is)
    ranks: list[int | None] = msgspec.field(default_factory=list)
    # token id -> its bytes, for the tokens (chosen or top) whose text alone is not their bytes:
    # part of a character of several bytes (tokenizer/token_bytes.py). Filled with the strings.
    raw_bytes: dict[int, list[int]] = msgspec.field(default_factory=dict)

    def extend(self, other: TokenLogprobs) -> None:
        self.token_ids += other.token_ids
        self.logprobs += other.logprobs
        self.top_ids += other.top_ids
        self.top_logprobs += other.top_logprobs
        self.tokens += other.tokens
        self.top_tokens += other.top_tokens
        self.ranks += other.ranks
        self.raw_bytes.update(other.raw_bytes)


class StructuredOutput(msgspec.Struct, array_like=True):
    """A constraint on the output text: kind "json" (any JSON), "json_schema", "regex" or "ebnf"."""

    kind: str
    spec: str = ""


# A temperature under this draws greedily (vLLM's threshold). logits / T overflows float32 for T
# near 1e-38 (every positive logit +inf, the draw then the first of them, or nothing at all), and
# above the overflow no draw at such temperatures differs from the argmax but at near-exact ties.
GREEDY_BELOW_TEMPERATURE = 1e-5


class SamplingParams(msgspec.Struct, kw_only=True):
    """How to pick tokens and when to stop. A msgspec struct so it can cross process boundaries."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) keeps the whole vocabulary
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    stop: list[str] = msgspec.field(default_factory=list)  # matched on text by the detokenizer
    include_stop_str_in_output: bool = False  # vLLM's: the matched stop string ends the text
    # vLLM's: False keeps special tokens' text in the output (not that of a special token that
    # ended the request: EOS, a special stop token; include_stop_str_in_output keeps that too)
    skip_special_tokens: bool = True
    ignore_eos: bool = False
    seed: int | None = None
    # Penalties (OpenAI's and vLLM's definitions, see sampler.apply_penalties) and additive biases.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)
    # vLLM's: the only tokens that may be drawn (None: any), and words the output may not contain.
    # A word is banned as token sequences (`bad_words_ids`, which the tokenizer fills in from
    # `bad_words`): a sequence's last token is -inf wherever the output ends with the rest of it.
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = msgspec.field(default_factory=list)
    bad_words_ids: list[list[int]] = msgspec.field(default_factory=list)
    # vLLM's: keep only the prompt's last k tokens (a BOS the tokenizer adds stays first); -1: as
    # many as the context holds. Applied by the tokenizer (tokenizer/intake.py).
    truncate_prompt_tokens: int | None = None
    # Logprobs of the raw distribution (log-softmax of the logits before temperature, penalties
    # and biases): None for none, k >= 0 for the chosen token's and the k most likely ones.
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    structured_output: StructuredOutput | None = None  # compiled with xgrammar by the scheduler

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first field outside its range."""
        self._validate_core()
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}", name)
        if not 0 < self.repetition_penalty <= 100:
            raise InvalidRequestError(
                f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}", "repetition_penalty"
            )
        for token, bias in self.logit_bias.items():
            if not -100 <= bias <= 100:
                raise InvalidRequestError(
                    f"logit_bias of token {token} must be in [-100, 100], got {bias}", "logit_bias"
                )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidRequestError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}", name)
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise InvalidRequestError("allowed_token_ids must name at least one token", "allowed_token_ids")
        if self.truncate_prompt_tokens is not None and not (
            self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1
        ):
            raise InvalidRequestError(
                f"truncate_prompt_tokens must be -1 or >= 1, got {self.truncate_prompt_tokens}",
                "truncate_prompt_tokens",
            )
        if not all(word.strip() for word in self.bad_words):
            raise InvalidRequestError("bad_words may not contain an empty word", "bad_words")

    @property
    def limits_tokens(self) -> bool:
        """Whether allowed_token_ids or bad words take tokens out of the draw."""
        return self.allowed_token_ids is not None or bool(self.bad_words_ids)

    @property
    def has_penalties(self) -> bool:
        """Whether sampling must look at the tokens seen so far (repetition/frequency/presence)."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1)

    def _validate_core(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if not self.temperature >= 0:  # NaN too
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1 (disabled) or >= 0, got {self.top_k}", "top_k")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
                "min_tokens",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1


# The draw's answer for a row with no finite logit to draw from (all -inf, NaN or +inf): a model
# that produced NaN, or bans covering the whole vocabulary (min_tokens with stop tokens, a grammar
# that allows only banned tokens). An argmax would give token 0 there, a wrong token nobody would
# notice; the scheduler ends the request with an error instead (scheduler/results.py). Only the
# host sees it: what the device keeps takes a real id (engine/sampler.py, table_token).
NO_TOKEN = -1


class FinishReason(str, Enum):
    """Why a request ended; a str, so it compares, encodes and prints as "stop" | "length" | "abort"."""

    STOP = "stop"  # an EOS or stop token, a stop string, or the grammar's end
    LENGTH = "length"  # max_tokens, or the context is full
    # the client went away, asked to abort, timed out, or the server stopped; or an internal
    # error ended this request alone (stop_reason says which: scheduler/results.py)
    ABORT = "abort"

    def __str__(self) -> str:
        return self.value


class LogprobRow(NamedTuple):
    """One scored position: the chosen token's logprob and rank, and the top-k alternatives."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]
    rank: int


class Phase(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(eq=False)
class Req:
    """One request inside the scheduler: its tokens, its state lengths and its KV row."""

    uid: int
    token_ids: list[int]  # prompt followed by the generated tokens that reached the CPU
    prompt_len: int
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    seed: int = 0  # the sampling stream; params.seed or one drawn for the request
    cached_len: int = 0
    device_len: int = 0
    table_idx: int = -1  # row of the page table (and token table) while the request holds one
    finish_reason: FinishReason | None = None
    arrival_time: float = 0.0
    # Slots of the cached prefix this request borrowed from the prefix cache (its handle).
    cache_handle: object | None = None
    # Leading positions whose pages belong to the prefix cache (locked through cache_handle):
    # a match at admission, or the prompt handed over when its pass is launched. The request
    # owns only the pages after them, and must never free these.
    shared_len: int = 0
    # Prompt tokens the prefix cache held when the request was admitted (the last admission before
    # its first token): OpenAI's usage.prompt_tokens_details.cached_tokens.
    prefix_hit: int = 0
    preempted: bool = False  # sent back to the queue; its next admission is a resume
    # Prompt logprobs by position (entry p scores token p + 1), filled chunk by chunk during
    # prefill when params.prompt_logprobs is set, sent with the first token.
    prompt_logprobs: dict[int, LogprobRow] | None = None
    grammar: object | None = None  # the xgrammar matcher of params.structured_output

    def __post_init__(self) -> None:
        if self.device_len == 0:
            self.device_len = len(self.token_ids)

    @property
    def extend_len(self) -> int:
        return self.device_len - self.cached_len

    @property
    def output_len(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        """The output's tokens, without a last NO_TOKEN (the position of a pass that had nothing
        to draw, which ended the request: scheduler/results.py)."""
        end = len(self.token_ids) - (self.token_ids[-1] == NO_TOKEN)
        return self.token_ids[self.prompt_len : end]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def state(self) -> dict:
        return {"cached_len": self.cached_len, "device_len": self.device_len, "extend_len": self.extend_len}


@dataclass(eq=False)
class Batch:
    """The requests of one forward pass and how many of each one's tokens it computes.

    `extend_lens[i]` equals `reqs[i].extend_len` except for a chunked prefill, where the
    pass computes only the first chunk of the uncached prompt.
    """

    phase: Phase
    reqs: list[Req]
    extend_lens: list[int]
    # Filled by the scheduler's prepare step.
    out_loc: list[int] | None = None  # the slot each new token's K/V goes to, in token order
    sample_mask: list[bool] = field(default_factory=list)  # which requests get a token this pass

    @property
    def size(self) -> int:
        return len(self.reqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)


@dataclass
class RequestOutput:
    """What `LLM.generate` returns for one prompt."""

    uid: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: TokenLogprobs | None = None  # of token_ids, when params.logprobs was set
    prompt_logprobs: TokenLogprobs | None = None  # of prompt_token_ids, when params.prompt_logprobs was set
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (vLLM's name)

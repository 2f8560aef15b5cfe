"""Plain data shared by every role: sampling parameters, requests, batches.

The three numbers of a request's state (see DESIGN.md):
  cached_len  positions [0, cached_len) have K/V stored in the pool
  device_len  positions [0, device_len) are known token ids on the device
  extend_len  = device_len - cached_len, what the next forward pass computes
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import msgspec


class InvalidRequestError(ValueError):
    """A request that can never be served as asked; the message names the field and the limit."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


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
    ignore_eos: bool = False
    seed: int | None = None

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first field outside its range."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1 (disabled) or >= 0, got {self.top_k}", "top_k")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}", "min_tokens")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


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
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    arrival_time: float = 0.0
    # Slots of the cached prefix this request borrowed from the prefix cache (its handle).
    cache_handle: object | None = None

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
        return self.token_ids[self.prompt_len:]

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

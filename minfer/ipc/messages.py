"""Every message that crosses a process boundary, as msgspec structs.

The four processes form a ring, so each has one inbox (a PULL socket it binds):

    api server ──▶ tokenizer ──▶ scheduler ──▶ detokenizer
        ▲                                          │
        └──────────────────────────────────────────┘

Everything the api server sends goes to the tokenizer worker, which answers tokenizer calls
itself and forwards the rest (tokenized requests, aborts, info queries) to the scheduler in the
order it received them: an abort can never overtake the request it aborts. Everything the
scheduler sends goes to the detokenizer worker, which detokenizes token outputs and forwards
the rest to the api server. Tokenizing and detokenizing live in separate processes so that a
large prompt being tokenized cannot delay the tokens of running streams.

A request's detokenizer state (its stop strings, prompt length, echoed text) travels with the
request to the scheduler (`TokenizedRequest.stream`), which passes it on before any output of
that request: one sender, one pipe, so it always arrives first. Stop strings are matched in the
detokenizer, which aborts the request in the scheduler itself (it is past the scheduler already).
Lifecycle messages (`WorkerReady`, `WorkerFailed`, `RequestFailed`) go straight to the api server
from the tokenizer and detokenizer, and through the detokenizer from the scheduler.
"""

from __future__ import annotations

from typing import Any

import msgspec

from minfer.core import InvalidRequestError, SamplingParams, TokenLogprobs


class Message(msgspec.Struct, tag=True, kw_only=True):
    """Base of all messages; the class name is the wire tag."""


# -- api server -> tokenizer -------------------------------------------------------------------
class GenerateRequest(Message):
    """A generation request; exactly one of prompt / prompt_ids / messages is set."""

    uid: int
    params: SamplingParams
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None  # chat: rendered with the model's chat template
    tools: list[dict[str, Any]] | None = None  # chat: OpenAI's tools, passed to the chat template
    chat_template_kwargs: dict[str, Any] | None = None  # chat: extra chat-template variables
    add_generation_prompt: bool = True  # chat: open the assistant's turn
    continue_final_message: bool = False  # chat: or leave the last (assistant) message open
    add_special_tokens: bool = True  # for `prompt` only; chat prompts carry their own
    max_tokens_auto: bool = False  # max_tokens not given: fill the context (the scheduler knows it)
    echo: bool = False  # send the prompt's text with the first reply


class AbortRequest(Message):
    uid: int


class TokenizerCall(Message):
    """/tokenize, /detokenize and /tokenizer_info, answered by the tokenizer worker."""

    call_id: int
    kind: str  # "encode" | "decode" | "info"
    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    token_ids: list[int] | None = None
    return_token_strs: bool = False


class InfoQuery(Message):
    """Live scheduler state for /v1/server_info."""

    call_id: int


# -- api server (launcher) -> tokenizer, once both workers are ready ---------------------------
class PromptLimits(Message):
    """The longest prompt the scheduler can take (it leaves room for one output token)."""

    max_prompt_tokens: int


# -- tokenizer -> scheduler -> detokenizer -----------------------------------------------------
class StreamStart(Message):
    """What the detokenizer needs to know of a request before its first token."""

    uid: int
    prompt_tokens: int
    stop: list[str] = msgspec.field(default_factory=list)
    keep_stop: bool = False  # include_stop_str_in_output: the matched stop string stays in the text
    skip_special_tokens: bool = True
    prompt_text: str | None = None  # sent with the first reply (echo), then forgotten


class TokenizedRequest(Message):
    uid: int
    token_ids: list[int]
    params: SamplingParams
    max_tokens_auto: bool = False
    stream: StreamStart | None = None  # forwarded to the detokenizer before the request is added


# -- scheduler -> detokenizer ------------------------------------------------------------------
class TokenOutputs(Message):
    """One scheduler step's results, as parallel lists (one entry per request that advanced)."""

    uids: list[int]
    token_ids: list[int | None]  # None: the request ended without a new token (abort)
    finish_reasons: list[str | None]
    stop_reasons: list[int | str | None]  # a stop token id; with an abort, why, when known
    # uid -> (queue_s, prefill_s) of the requests whose first token is in this message.
    first_token_timings: dict[int, tuple[float, float]] = msgspec.field(default_factory=dict)
    # uid -> logprobs of its token in this message / of its prompt (with the first token only).
    logprobs: dict[int, TokenLogprobs] = msgspec.field(default_factory=dict)
    prompt_logprobs: dict[int, TokenLogprobs] = msgspec.field(default_factory=dict)
    # uid -> prompt tokens found in the prefix cache, of the requests whose first token is here.
    cached_tokens: dict[int, int] = msgspec.field(default_factory=dict)


class RequestFailed(Message):
    """A request that cannot be served (validation); the status is the HTTP one to answer."""

    uid: int
    message: str
    param: str | None = None
    status: int = 400
    code: str | None = None  # OpenAI's error code (context_length_exceeded), from InvalidRequestError

    @classmethod
    def invalid(cls, uid: int, error: InvalidRequestError) -> RequestFailed:
        """The 400 for a request a worker found invalid: its message, field and code travel."""
        return cls(uid=uid, message=str(error), param=error.param, code=error.code)


class InfoReply(Message):
    call_id: int
    info: dict[str, Any]


class WorkerReady(Message):
    """A worker finished starting; `info` describes what it loaded."""

    role: str  # "scheduler" | "tokenizer" | "detokenizer"
    pid: int
    info: dict[str, Any]


class WorkerFailed(Message):
    """A worker could not start (bad model path, ...); it exits after sending this."""

    role: str
    message: str


# -- detokenizer (replies) and tokenizer (call results) -> api server --------------------------
class Reply(msgspec.Struct, array_like=True):
    """New text of one request. `text` is a delta: it never changes once sent."""

    uid: int
    text: str
    token_ids: list[int]  # the tokens this reply covers
    prompt_tokens: int
    completion_tokens: int  # cumulative
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    queue_s: float | None = None  # with the first token: scheduler arrival -> admission
    prefill_s: float | None = None  # with the first token: admission -> first token
    logprobs: TokenLogprobs | None = None  # of token_ids, with token strings
    prompt_logprobs: TokenLogprobs | None = None  # with the first reply, when asked for
    prompt_text: str | None = None  # with the first reply, when echo was asked for
    cached_tokens: int | None = None  # with the first reply: prompt tokens the prefix cache held


class ReplyBatch(Message):
    replies: list[Reply]


class TokenizerResult(Message):
    call_id: int
    token_ids: list[int] | None = None
    token_strs: list[str] | None = None
    text: str | None = None
    info: dict[str, Any] | None = None
    error: str | None = None


# What each process's inbox may receive. Decoding with its own union makes a message sent to the
# wrong process fail loudly (msgspec.ValidationError) instead of being silently mishandled.
INBOX_MESSAGES = {
    "tokenizer": GenerateRequest | AbortRequest | TokenizerCall | InfoQuery | PromptLimits,
    "scheduler": TokenizedRequest | AbortRequest | InfoQuery,
    "detokenizer": StreamStart | TokenOutputs | RequestFailed | InfoReply | WorkerReady | WorkerFailed,
    "api": ReplyBatch | RequestFailed | TokenizerResult | InfoReply | WorkerReady | WorkerFailed,
}

_encoder = msgspec.msgpack.Encoder()
_decoders = {inbox: msgspec.msgpack.Decoder(union) for inbox, union in INBOX_MESSAGES.items()}


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes, inbox: str) -> Message:
    """A message that arrived at `inbox` ("tokenizer", "scheduler", "detokenizer", "api")."""
    return _decoders[inbox].decode(data)

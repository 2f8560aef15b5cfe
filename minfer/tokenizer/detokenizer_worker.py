"""The detokenizer process: token ids of every running request -> text for the api server.

It has a process of its own so that nothing the tokenizer does (a 1 MB prompt, a chat template
rendered in Python) delays a running stream's next token.

Inbound (one inbox, messages from the scheduler, see ipc/messages.py):
  StreamStart   -> a new request's detokenizer state (it arrives before the request's first token)
  TokenOutputs  -> detokenize incrementally, match stop strings -> ReplyBatch to the api server
                   (a matched stop string also aborts the request in the scheduler)
  anything else -> forwarded to the api server (RequestFailed ends the request's state here)
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import zmq

from minfer.config import EngineConfig
from minfer.core import TokenLogprobs
from minfer.ipc import messages as m
from minfer.ipc.process import exit_without_teardown, parent_alive, setup_worker_process
from minfer.ipc.sockets import Endpoints, fail_start, inbox, outbox, recv_ready, send
from minfer.observability.events import DETOKENIZED
from minfer.observability.trace import NULL_TRACER, RequestTracer
from minfer.tokenizer.detokenizer import IncrementalDetokenizer
from minfer.tokenizer.intake import load_model_tokenizer
from minfer.tokenizer.token_bytes import is_byte_level, token_bytes

log = logging.getLogger(__name__)


@dataclass
class _Detok:
    detokenizer: IncrementalDetokenizer
    prompt_tokens: int
    completion_tokens: int = 0
    prompt_text: str | None = None  # sent with the first reply (echo), then forgotten


class DetokenizerWorker:
    """The worker's state and message handling, separate from its sockets so tests can drive it."""

    def __init__(self, tokenizer, send_scheduler, send_api, tracer: RequestTracer = NULL_TRACER):
        self.tokenizer = tokenizer
        self.tracer = tracer
        self.send_scheduler = send_scheduler
        self.send_api = send_api
        self.requests: dict[int, _Detok] = {}
        self.replies: list[m.Reply] = []  # collected while handling one batch of messages
        self._token_strings: dict[int, str] = {}  # token id -> its text alone, for logprobs
        self._raw_bytes: dict[int, list[int]] = {}  # ... and its bytes, where the text is not them
        self._byte_level = is_byte_level(tokenizer)

    def handle(self, msg: m.Message) -> None:
        """Handle one message; an unexpected error fails the requests it concerns, not the worker."""
        try:
            self._dispatch(msg)
        except Exception as e:
            log.exception("detokenizer worker: %s failed", type(msg).__name__)
            uids = (
                msg.uids
                if isinstance(msg, m.TokenOutputs)
                else [msg.uid]
                if isinstance(msg, m.StreamStart)
                else []
            )
            for uid in uids:
                if self.requests.pop(uid, None) is not None or isinstance(msg, m.StreamStart):
                    self.send_scheduler(m.AbortRequest(uid=uid))
                    self.send_api(m.RequestFailed(uid=uid, message=f"detokenizer error: {e}", status=500))

    def _dispatch(self, msg: m.Message) -> None:
        if isinstance(msg, m.TokenOutputs):
            self.detokenize(msg)
        elif isinstance(msg, m.StreamStart):
            self.requests[msg.uid] = _Detok(
                IncrementalDetokenizer(
                    self.tokenizer,
                    msg.stop,
                    skip_special_tokens=msg.skip_special_tokens,
                    keep_stop=msg.keep_stop,
                ),
                msg.prompt_tokens,
                prompt_text=msg.prompt_text,
            )
        else:
            if isinstance(msg, m.RequestFailed):
                self.requests.pop(msg.uid, None)
            self.send_api(msg)

    def flush(self) -> None:
        if self.replies:
            self.send_api(m.ReplyBatch(replies=self.replies))
            self.replies = []

    def detokenize(self, out: m.TokenOutputs) -> None:
        for uid, token, finish, stop_token in zip(
            out.uids, out.token_ids, out.finish_reasons, out.stop_reasons
        ):
            state = self.requests.get(uid)
            if state is None:  # finished here already (stop string) or aborted by a disconnect
                continue
            detok = state.detokenizer
            text, tokens, stop_reason = "", [], stop_token
            if token is not None:
                state.completion_tokens += 1
                tokens = [token]
                text = detok.add_final(token, finish == "stop")  # the scheduler's "stop": a stop token
                if detok.matched_stop is not None:
                    if finish is None:  # still running in the scheduler: free its KV now
                        self.send_scheduler(m.AbortRequest(uid=uid))
                    finish, stop_reason = "stop", detok.matched_stop
            if finish:
                text += detok.flush()
                del self.requests[uid]
            if text or tokens or finish:
                queue_s, prefill_s = out.first_token_timings.get(uid, (None, None))
                reply = m.Reply(
                    uid,
                    text,
                    tokens,
                    state.prompt_tokens,
                    state.completion_tokens,
                    finish,
                    stop_reason,
                    queue_s,
                    prefill_s,
                    cached_tokens=out.cached_tokens.get(uid),
                )
                if uid in out.logprobs:
                    reply.logprobs = self.with_token_strings(out.logprobs[uid])
                if uid in out.prompt_logprobs:
                    reply.prompt_logprobs = self.with_token_strings(out.prompt_logprobs[uid])
                reply.prompt_text, state.prompt_text = state.prompt_text, None
                self.replies.append(reply)
                if self.tracer.enabled:
                    self.tracer.emit(
                        DETOKENIZED,
                        uid,
                        text_len=len(text),
                        completion_tokens=state.completion_tokens,
                        finish_reason=finish,
                    )

    def token_text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""

    def with_token_strings(self, lp: TokenLogprobs) -> TokenLogprobs:
        """Fill the text of each token (each decoded alone, as OpenAI's and vLLM's logprobs show
        it), and the bytes of those whose text is not their bytes (part of a character)."""
        lp.tokens = [self._token_string(t, lp) for t in lp.token_ids]
        lp.top_tokens = [[self._token_string(t, lp) for t in ids] for ids in lp.top_ids]
        return lp

    def _token_string(self, token_id: int, lp: TokenLogprobs) -> str:
        """The token's text alone (cached); its bytes go into `lp.raw_bytes` where they differ."""
        text = self._token_strings.get(token_id)
        if text is None:
            text = self._token_strings[token_id] = self.token_text([token_id])
            if "\ufffd" in text and self.tokenizer is not None:
                raw = token_bytes(self.tokenizer, token_id, self._byte_level)
                if raw is not None and raw != list(text.encode()):
                    self._raw_bytes[token_id] = raw
        if token_id in self._raw_bytes:
            lp.raw_bytes[token_id] = self._raw_bytes[token_id]
        return text


@exit_without_teardown
def run_detokenizer_worker(config: EngineConfig, endpoints: Endpoints, parent_pid: int) -> None:
    """Entry point of the detokenizer process (started by server/launch.py)."""
    setup_worker_process("minfer-detokenizer", config.log_level)
    ctx = zmq.Context()
    sock = inbox(ctx, endpoints.detokenizer)
    to_scheduler, to_api = outbox(ctx, endpoints.scheduler), outbox(ctx, endpoints.api)
    try:
        tokenizer = load_model_tokenizer(config, without_torch=True)
    except Exception as e:
        log.exception("detokenizer failed to load the tokenizer")
        fail_start(to_api, "detokenizer", e)
    tracer = RequestTracer(config.trace_requests) if config.trace_requests else NULL_TRACER
    worker = DetokenizerWorker(
        tokenizer, lambda msg: send(to_scheduler, msg), lambda msg: send(to_api, msg), tracer
    )
    send(to_api, m.WorkerReady(role="detokenizer", pid=os.getpid(), info={}))
    while parent_alive(parent_pid):
        for msg in recv_ready(sock, "detokenizer", timeout_ms=1000):
            worker.handle(msg)
        worker.flush()

"""The tokenizer / detokenizer process.

Inbound (one inbox, messages from the api server and the scheduler, see ipc/messages.py):
  GenerateRequest  -> tokenize (or render the chat template) -> TokenizedRequest to the scheduler
  TokenOutputs     -> detokenize incrementally, match stop strings -> ReplyBatch to the api server
  TokenizerCall    -> /tokenize, /detokenize, /tokenizer_info, answered here
  anything else    -> forwarded in order (aborts and info queries to the scheduler, the
                      scheduler's answers to the api server)
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import zmq

from minfer.config import EngineConfig
from minfer.core import InvalidRequestError, TokenLogprobs
from minfer.ipc import messages as m
from minfer.ipc.process import parent_alive, setup_worker_process
from minfer.ipc.sockets import Endpoints, inbox, outbox, recv_ready, send
from minfer.observability.trace import NULL_TRACER, RequestTracer
from minfer.tokenizer.detokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)


def load_model_tokenizer(config: EngineConfig):
    from minfer.models.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(config.model, config.load_format))


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a conversation under the model's chat template (same as `LLM.chat`)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("this model has no chat template: use /v1/completions", "messages")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             tokenize=False)
    except Exception as e:  # jinja raises for conversations the template refuses (roles order, ...)
        raise InvalidRequestError(f"the chat template rejected the messages: {e}", "messages") from e
    return tokenizer.encode(text, add_special_tokens=False)


def encode_text(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    if tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer: send token ids", "prompt")
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def tokenizer_info(tokenizer) -> dict:
    """What /tokenizer_info serves: the tokenizer_config.json fields a remote client needs."""
    if tokenizer is None:
        return {"tokenizer_class": None}
    info = {"tokenizer_class": type(tokenizer).__name__, "vocab_size": len(tokenizer),
            "chat_template": getattr(tokenizer, "chat_template", None)}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        info[name] = getattr(tokenizer, name, None)
        info[name + "_id"] = getattr(tokenizer, name + "_id", None)
    info["added_special_tokens"] = list(getattr(tokenizer, "all_special_tokens", []))
    return info


@dataclass
class _Detok:
    detokenizer: IncrementalDetokenizer
    prompt_tokens: int
    completion_tokens: int = 0
    prompt_text: str | None = None  # sent with the first reply (echo), then forgotten


class TokenizerWorker:
    """The worker's state and message handling, separate from its sockets so tests can drive it."""

    def __init__(self, tokenizer, send_scheduler, send_api, tracer: RequestTracer = NULL_TRACER):
        self.tokenizer = tokenizer
        self.tracer = tracer
        self.send_scheduler = send_scheduler
        self.send_api = send_api
        self.requests: dict[int, _Detok] = {}
        self.replies: list[m.Reply] = []  # collected while handling one batch of messages
        self._token_strings: dict[int, str] = {}  # token id -> its text alone, for logprobs

    def handle(self, msg: m.Message) -> None:
        """Handle one message; an unexpected error fails that request, not the worker."""
        try:
            self._dispatch(msg)
        except Exception as e:
            log.exception("tokenizer worker: %s failed", type(msg).__name__)
            if isinstance(msg, m.GenerateRequest):
                self.requests.pop(msg.uid, None)
                self.send_api(m.RequestFailed(uid=msg.uid, message=f"tokenizer error: {e}", status=500))
            elif isinstance(msg, m.TokenizerCall):
                self.send_api(m.TokenizerResult(call_id=msg.call_id, error=f"tokenizer error: {e}"))

    def _dispatch(self, msg: m.Message) -> None:
        if isinstance(msg, m.TokenOutputs):
            self.detokenize(msg)
        elif isinstance(msg, m.GenerateRequest):
            self.tokenize(msg)
        elif isinstance(msg, m.TokenizerCall):
            self.send_api(self.answer(msg))
        elif isinstance(msg, (m.AbortRequest, m.InfoQuery)):
            self.send_scheduler(msg)
        else:
            if isinstance(msg, m.RequestFailed):
                self.requests.pop(msg.uid, None)
            self.send_api(msg)

    def flush(self) -> None:
        if self.replies:
            self.send_api(m.ReplyBatch(replies=self.replies))
            self.replies = []

    # -- requests ------------------------------------------------------------------------------
    def tokenize(self, req: m.GenerateRequest) -> None:
        try:
            if req.messages is not None:
                ids = render_chat(self.tokenizer, req.messages)
            elif req.prompt is not None:
                ids = encode_text(self.tokenizer, req.prompt, req.add_special_tokens)
            else:
                ids = list(req.prompt_ids or [])
        except InvalidRequestError as e:
            self.send_api(m.RequestFailed(uid=req.uid, message=str(e), param=e.param))
            return
        if self.tracer.enabled:
            self.tracer.emit("tokenized", req.uid, prompt_len=len(ids))
        detok = IncrementalDetokenizer(self.tokenizer, req.params.stop)
        prompt_text = None
        if req.echo:
            prompt_text = req.prompt if req.prompt is not None else self.token_text(ids)
        self.requests[req.uid] = _Detok(detok, len(ids), prompt_text=prompt_text)
        self.send_scheduler(m.TokenizedRequest(uid=req.uid, token_ids=ids, params=req.params,
                                               max_tokens_auto=req.max_tokens_auto))

    def detokenize(self, out: m.TokenOutputs) -> None:
        for uid, token, finish, stop_token in zip(out.uids, out.token_ids, out.finish_reasons, out.stop_reasons):
            state = self.requests.get(uid)
            if state is None:  # finished here already (stop string) or aborted by a disconnect
                continue
            detok = state.detokenizer
            text, tokens, stop_reason = "", [], stop_token
            if token is not None:
                state.completion_tokens += 1
                tokens = [token]
                text = detok.add(token)
                if detok.matched_stop is not None:
                    if finish is None:  # still running in the scheduler: free its KV now
                        self.send_scheduler(m.AbortRequest(uid=uid))
                    finish, stop_reason = "stop", detok.matched_stop
            if finish:
                text += detok.flush()
                del self.requests[uid]
            if text or tokens or finish:
                queue_s, prefill_s = out.first_token_timings.get(uid, (None, None))
                reply = m.Reply(uid, text, tokens, state.prompt_tokens, state.completion_tokens,
                                finish, stop_reason, queue_s, prefill_s)
                if uid in out.logprobs:
                    reply.logprobs = self.with_token_strings(out.logprobs[uid])
                if uid in out.prompt_logprobs:
                    reply.prompt_logprobs = self.with_token_strings(out.prompt_logprobs[uid])
                reply.prompt_text, state.prompt_text = state.prompt_text, None
                self.replies.append(reply)
                if self.tracer.enabled:
                    self.tracer.emit("detokenized", uid, text_len=len(text),
                                     completion_tokens=state.completion_tokens, finish_reason=finish)

    def token_text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""

    def with_token_strings(self, lp: TokenLogprobs) -> TokenLogprobs:
        """Fill the text of each token (each decoded alone, as OpenAI's and vLLM's logprobs show it)."""
        text = self._token_strings
        for t in lp.token_ids:
            if t not in text:
                text[t] = self.token_text([t])
        lp.tokens = [text[t] for t in lp.token_ids]
        lp.top_tokens = []
        for ids in lp.top_ids:
            for t in ids:
                if t not in text:
                    text[t] = self.token_text([t])
            lp.top_tokens.append([text[t] for t in ids])
        return lp

    # -- /tokenize, /detokenize, /tokenizer_info -----------------------------------------------
    def answer(self, call: m.TokenizerCall) -> m.TokenizerResult:
        result = m.TokenizerResult(call_id=call.call_id)
        try:
            if call.kind == "info":
                result.info = tokenizer_info(self.tokenizer)
            elif call.kind == "encode":
                if call.messages is not None:
                    result.token_ids = render_chat(self.tokenizer, call.messages, call.add_generation_prompt)
                else:
                    result.token_ids = encode_text(self.tokenizer, call.text or "", call.add_special_tokens)
                if call.return_token_strs:
                    result.token_strs = self.tokenizer.convert_ids_to_tokens(result.token_ids)
            elif call.kind == "decode":
                if self.tokenizer is None:
                    raise InvalidRequestError("this model has no tokenizer", "tokens")
                ids = call.token_ids or []
                if any(not 0 <= t < len(self.tokenizer) for t in ids):
                    raise InvalidRequestError(f"token ids must be in [0, {len(self.tokenizer)})", "tokens")
                result.text = self.tokenizer.decode(ids)
            else:
                raise InvalidRequestError(f"unknown tokenizer call {call.kind!r}")
        except InvalidRequestError as e:
            result.error = str(e)
        return result


def run_tokenizer_worker(config: EngineConfig, endpoints: Endpoints, parent_pid: int) -> None:
    """Entry point of the tokenizer process (started by server/launch.py)."""
    setup_worker_process("minfer-tokenizer", config.log_level)
    ctx = zmq.Context()
    sock = inbox(ctx, endpoints.tokenizer)
    to_scheduler, to_api = outbox(ctx, endpoints.scheduler), outbox(ctx, endpoints.api)
    try:
        tokenizer = load_model_tokenizer(config)
    except Exception as e:
        log.exception("tokenizer failed to load")
        send(to_api, m.WorkerFailed(role="tokenizer", message=f"{type(e).__name__}: {e}"))
        to_api.close(linger=2000)  # deliver the failure before exiting
        raise SystemExit(1)
    tracer = RequestTracer(config.trace_requests) if config.trace_requests else NULL_TRACER
    worker = TokenizerWorker(tokenizer, lambda msg: send(to_scheduler, msg), lambda msg: send(to_api, msg), tracer)
    send(to_api, m.WorkerReady(role="tokenizer", pid=os.getpid(), info=tokenizer_info(tokenizer)))
    while parent_alive(parent_pid):
        for msg in recv_ready(sock, timeout_ms=1000):
            worker.handle(msg)
        worker.flush()

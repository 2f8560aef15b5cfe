"""The tokenizer process (detokenizing is detokenizer_worker.py's, in a process of its own).

Inbound (one inbox, messages from the api server, see ipc/messages.py):
  GenerateRequest  -> tokenize (or render the chat template) -> TokenizedRequest to the scheduler;
                      too long a prompt -> RequestFailed to the api server
  TokenizerCall    -> /tokenize, /detokenize, /tokenizer_info, answered here
  PromptLimits     -> the prompt length limit, once the scheduler is ready
  AbortRequest, InfoQuery -> forwarded to the scheduler in the order they came
"""

from __future__ import annotations

import logging
import os

import zmq

from minfer.config import EngineConfig
from minfer.core import InvalidRequestError
from minfer.ipc import messages as m
from minfer.ipc.process import exit_without_teardown, parent_alive, setup_worker_process
from minfer.ipc.sockets import Endpoints, fail_start, inbox, outbox, recv_ready, send
from minfer.observability.events import TOKENIZED
from minfer.observability.trace import NULL_TRACER, RequestTracer
from minfer.tokenizer.intake import (
    PromptEncoder,
    encode_text,
    load_model_tokenizer,
    render_chat,
    with_bad_words_ids,
)

log = logging.getLogger(__name__)


def single_token_id(tokenizer, text: str) -> int | None:
    """The id of the vocabulary entry spelt `text` (an added token such as `</think>`), if any."""
    if tokenizer is None:
        return None
    return tokenizer.get_vocab().get(text)


def tokenizer_info(tokenizer) -> dict:
    """What /tokenizer_info serves: the tokenizer_config.json fields a remote client needs."""
    if tokenizer is None:
        return {"tokenizer_class": None}
    info = {
        "tokenizer_class": type(tokenizer).__name__,
        "vocab_size": len(tokenizer),
        "chat_template": getattr(tokenizer, "chat_template", None),
    }
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        info[name] = getattr(tokenizer, name, None)
        info[name + "_id"] = getattr(tokenizer, name + "_id", None)
    info["added_special_tokens"] = list(getattr(tokenizer, "all_special_tokens", []))
    return info


class TokenizerWorker:
    """The worker's state and message handling, separate from its sockets so tests can drive it."""

    def __init__(self, tokenizer, send_scheduler, send_api, tracer: RequestTracer = NULL_TRACER):
        self.tokenizer = tokenizer
        self.tracer = tracer
        self.send_scheduler = send_scheduler
        self.send_api = send_api
        self.encoder = PromptEncoder(tokenizer)  # its length limit arrives once the scheduler is ready

    def handle(self, msg: m.Message) -> None:
        """Handle one message; an unexpected error fails that request, not the worker."""
        try:
            self._dispatch(msg)
        except Exception as e:
            log.exception("tokenizer worker: %s failed", type(msg).__name__)
            if isinstance(msg, m.GenerateRequest):
                self.send_api(m.RequestFailed(uid=msg.uid, message=f"tokenizer error: {e}", status=500))
            elif isinstance(msg, m.TokenizerCall):
                self.send_api(m.TokenizerResult(call_id=msg.call_id, error=f"tokenizer error: {e}"))

    def _dispatch(self, msg: m.Message) -> None:
        if isinstance(msg, m.GenerateRequest):
            self.tokenize(msg)
        elif isinstance(msg, m.TokenizerCall):
            self.send_api(self.answer(msg))
        elif isinstance(msg, m.PromptLimits):
            self.encoder.meter.max_prompt_tokens = msg.max_prompt_tokens
        elif isinstance(msg, (m.AbortRequest, m.InfoQuery)):
            self.send_scheduler(msg)
        else:
            log.warning("tokenizer worker ignored an unexpected %s", type(msg).__name__)

    # -- requests ------------------------------------------------------------------------------
    def tokenize(self, req: m.GenerateRequest) -> None:
        try:
            ids = self.prompt_ids(req)
            params = with_bad_words_ids(self.tokenizer, req.params)
        except InvalidRequestError as e:
            self.send_api(m.RequestFailed.invalid(req.uid, e))
            return
        if self.tracer.enabled:
            self.tracer.emit(TOKENIZED, req.uid, prompt_len=len(ids))
        prompt_text = None
        if req.echo:  # the prompt as the model saw it: truncate_prompt_tokens may have cut it
            whole = req.prompt is not None and req.params.truncate_prompt_tokens is None
            prompt_text = req.prompt if whole else self.token_text(ids)
        stream = m.StreamStart(
            uid=req.uid,
            prompt_tokens=len(ids),
            stop=req.params.stop,
            keep_stop=req.params.include_stop_str_in_output,
            skip_special_tokens=req.params.skip_special_tokens,
            prompt_text=prompt_text,
        )
        self.send_scheduler(
            m.TokenizedRequest(
                uid=req.uid,
                token_ids=ids,
                params=params,
                max_tokens_auto=req.max_tokens_auto,
                stream=stream,
            )
        )

    def prompt_ids(self, req: m.GenerateRequest) -> list[int]:
        return self.encoder.encode(
            req.prompt,
            req.prompt_ids,
            req.messages,
            req.add_special_tokens,
            req.tools,
            req.chat_template_kwargs,
            req.add_generation_prompt,
            req.continue_final_message,
            self.encoder.keep_last(req.params),
        )

    def token_text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""

    # -- /tokenize, /detokenize, /tokenizer_info -----------------------------------------------
    def answer(self, call: m.TokenizerCall) -> m.TokenizerResult:
        result = m.TokenizerResult(call_id=call.call_id)
        try:
            if call.kind == "info":
                result.info = tokenizer_info(self.tokenizer)
            elif call.kind == "encode":
                if call.messages is not None:
                    result.token_ids = render_chat(
                        self.tokenizer, call.messages, call.add_generation_prompt, call.chat_template_kwargs
                    )
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


@exit_without_teardown
def run_tokenizer_worker(config: EngineConfig, endpoints: Endpoints, parent_pid: int) -> None:
    """Entry point of the tokenizer process (started by server/launch.py)."""
    setup_worker_process("minfer-tokenizer", config.log_level)
    ctx = zmq.Context()
    sock = inbox(ctx, endpoints.tokenizer)
    to_scheduler, to_api = outbox(ctx, endpoints.scheduler), outbox(ctx, endpoints.api)
    try:
        tokenizer = load_model_tokenizer(config, without_torch=True)
    except Exception as e:
        log.exception("tokenizer failed to load")
        fail_start(to_api, "tokenizer", e)
    tracer = RequestTracer(config.trace_requests) if config.trace_requests else NULL_TRACER
    worker = TokenizerWorker(
        tokenizer, lambda msg: send(to_scheduler, msg), lambda msg: send(to_api, msg), tracer
    )
    # the id of `</think>`, the reasoning parsers' end marker (server/reasoning.py), for counting
    # an answer's reasoning tokens in the api process, which has no tokenizer
    info = {**tokenizer_info(tokenizer), "reasoning_end_id": single_token_id(tokenizer, "</think>")}
    send(to_api, m.WorkerReady(role="tokenizer", pid=os.getpid(), info=info))
    while parent_alive(parent_pid):
        for msg in recv_ready(sock, "tokenizer", timeout_ms=1000):
            worker.handle(msg)

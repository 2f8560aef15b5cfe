"""The tokenizer and detokenizer workers' message handling, without sockets.

The fixture wires them as the scheduler would: what the tokenizer sends the scheduler is kept,
and a TokenizedRequest's StreamStart is handed to the detokenizer, as the scheduler forwards it.
"""

from __future__ import annotations

import pytest

from minfer.core import SamplingParams
from minfer.ipc import messages as m
from minfer.tokenizer.detokenizer_worker import DetokenizerWorker
from minfer.tokenizer.worker import TokenizerWorker


class Workers:
    """Both workers behind one `handle`: requests and calls to the tokenizer, scheduler output
    to the detokenizer."""

    def __init__(self, tokenizer, to_scheduler: list, to_api: list):
        self.detokenizer = DetokenizerWorker(tokenizer, to_scheduler.append, to_api.append)

        def to_scheduler_via_detokenizer(msg):
            to_scheduler.append(msg)
            if isinstance(msg, m.TokenizedRequest):
                self.detokenizer.handle(msg.stream)

        self.tokenizer = TokenizerWorker(tokenizer, to_scheduler_via_detokenizer, to_api.append)

    @property
    def requests(self):
        return self.detokenizer.requests

    def handle(self, msg: m.Message) -> None:
        from_scheduler = (m.TokenOutputs, m.RequestFailed, m.InfoReply)
        (self.detokenizer if isinstance(msg, from_scheduler) else self.tokenizer).handle(msg)

    def flush(self) -> None:
        self.detokenizer.flush()


@pytest.fixture
def worker(tokenizer):
    to_scheduler, to_api = [], []
    return Workers(tokenizer, to_scheduler, to_api), to_scheduler, to_api


def outputs(*rows) -> m.TokenOutputs:
    uids, tokens, finishes, stops = zip(*rows)
    return m.TokenOutputs(
        uids=list(uids), token_ids=list(tokens), finish_reasons=list(finishes), stop_reasons=list(stops)
    )


def test_messages_round_trip():
    msg = m.GenerateRequest(
        uid=3, params=SamplingParams(stop=["x"], seed=1), messages=[{"role": "user", "content": "hi"}]
    )
    assert m.decode(m.encode(msg), "tokenizer") == msg
    batch = m.ReplyBatch(replies=[m.Reply(1, "a", [5], 3, 1, "stop", "x")])
    assert m.decode(m.encode(batch), "api") == batch


def test_text_prompt_is_tokenized_and_replies_carry_text(worker, tokenizer):
    w, to_scheduler, to_api = worker
    w.handle(m.GenerateRequest(uid=7, params=SamplingParams(max_tokens=3), prompt="Hello there"))
    (req,) = to_scheduler
    assert isinstance(req, m.TokenizedRequest) and req.token_ids == tokenizer.encode("Hello there")
    ids = tokenizer.encode(" General Kenobi", add_special_tokens=False)
    w.handle(outputs(*[(7, t, None, None) for t in ids[:-1]]))
    w.handle(outputs((7, ids[-1], "length", None)))
    w.flush()
    (batch,) = to_api
    assert "".join(r.text for r in batch.replies) == " General Kenobi"
    assert batch.replies[-1].finish_reason == "length"
    assert batch.replies[-1].completion_tokens == len(ids) and batch.replies[-1].prompt_tokens == len(
        req.token_ids
    )
    assert not w.requests


def test_chat_prompt_uses_the_template(worker, tokenizer):
    w, to_scheduler, _ = worker
    messages = [{"role": "user", "content": "hi"}]
    w.handle(m.GenerateRequest(uid=1, params=SamplingParams(), messages=messages))
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert to_scheduler[0].token_ids == tokenizer.encode(text, add_special_tokens=False)


def test_stop_string_finishes_and_aborts_in_the_scheduler(worker, tokenizer):
    w, to_scheduler, to_api = worker
    w.handle(m.GenerateRequest(uid=2, params=SamplingParams(stop=["END"]), prompt="x"))
    ids = tokenizer.encode("some text END more", add_special_tokens=False)
    for t in ids:
        w.handle(outputs((2, t, None, None)))
    w.flush()
    assert to_scheduler[1:] == [m.AbortRequest(uid=2)]  # once; later tokens are dropped
    replies = to_api[0].replies
    assert "".join(r.text for r in replies) == "some text "
    assert (replies[-1].finish_reason, replies[-1].stop_reason) == ("stop", "END")


def test_abort_output_ends_the_stream(worker):
    w, to_scheduler, to_api = worker
    w.handle(m.GenerateRequest(uid=4, params=SamplingParams(), prompt="x"))
    w.handle(m.AbortRequest(uid=4))
    assert to_scheduler[-1] == m.AbortRequest(uid=4)  # forwarded in order, after the request
    w.handle(outputs((4, None, "abort", None)))
    w.flush()
    assert to_api[0].replies[-1].finish_reason == "abort"


def test_failures_are_forwarded(worker):
    w, _, to_api = worker
    w.handle(m.GenerateRequest(uid=5, params=SamplingParams(), prompt="x"))
    w.handle(m.RequestFailed(uid=5, message="too long", param="max_tokens"))
    assert to_api == [m.RequestFailed(uid=5, message="too long", param="max_tokens")] and not w.requests


def test_tokenizer_calls(worker, tokenizer):
    w, _, to_api = worker
    w.handle(
        m.TokenizerCall(
            call_id=1, kind="encode", text="hi there", add_special_tokens=False, return_token_strs=True
        )
    )
    w.handle(m.TokenizerCall(call_id=2, kind="decode", token_ids=tokenizer.encode("hi there")))
    w.handle(m.TokenizerCall(call_id=3, kind="decode", token_ids=[len(tokenizer)]))
    w.handle(m.TokenizerCall(call_id=4, kind="info"))
    enc, dec, bad, info = to_api
    assert enc.token_ids == tokenizer.encode("hi there", add_special_tokens=False)
    assert enc.token_strs == tokenizer.convert_ids_to_tokens(enc.token_ids)
    assert dec.text == "hi there" and bad.error and "[0," in bad.error
    assert info.info["eos_token"] == tokenizer.eos_token and info.info["chat_template"]


def test_a_message_sent_to_the_wrong_inbox_fails_to_decode():
    import msgspec

    request = m.GenerateRequest(uid=3, params=SamplingParams(), prompt="hi")
    with pytest.raises(msgspec.ValidationError):
        m.decode(m.encode(request), "scheduler")  # the scheduler takes tokenized requests only
    with pytest.raises(msgspec.ValidationError):
        m.decode(m.encode(m.ReplyBatch(replies=[])), "tokenizer")

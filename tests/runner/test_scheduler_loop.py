"""The scheduler worker's message handling around a real Runner (tiny model), without sockets."""

from __future__ import annotations

import pytest

from minfer.config import EngineConfig
from minfer.core import SamplingParams
from minfer.ipc import messages as m
from minfer.runner.runner import Runner
from minfer.runner.worker import SchedulerLoop


@pytest.fixture
def loop(tiny_chat_model):
    sent = []
    runner = Runner(EngineConfig(model=tiny_chat_model, kv_cache_tokens=1024, max_model_len=2048))
    return SchedulerLoop(runner, sent.append), sent


def run(loop: SchedulerLoop) -> None:
    while loop.scheduler.has_work:
        loop.step()


def tokens_of(sent, uid: int) -> list:
    return [
        (t, f)
        for msg in sent
        if isinstance(msg, m.TokenOutputs)
        for u, t, f in zip(msg.uids, msg.token_ids, msg.finish_reasons)
        if u == uid
    ]


def test_request_runs_and_reports_tokens(loop):
    loop, sent = loop
    loop.handle(
        m.TokenizedRequest(uid=10, token_ids=[1, 2, 3], params=SamplingParams(max_tokens=4, ignore_eos=True))
    )
    run(loop)
    got = tokens_of(sent, 10)
    assert len(got) == 4 and [f for _, f in got] == [None, None, None, "length"]


def test_max_tokens_auto_fills_what_fits(loop):
    loop, sent = loop
    assert (
        loop.runner.max_request_tokens == 1024 - loop.scheduler.decode_reserve_pages
    )  # the pool, smaller than the context
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    loop.handle(m.TokenizedRequest(uid=1, token_ids=[5] * 100, params=params, max_tokens_auto=True))
    assert loop.scheduler.by_uid[1].params.max_tokens == loop.runner.max_request_tokens - 100
    loop.handle(m.AbortRequest(uid=1))
    assert tokens_of(sent, 1) == [(None, "abort")]
    assert loop.live_info()["kv_pool"]["used_pages"] == 0


def test_invalid_request_fails_with_both_numbers(loop):
    loop, sent = loop
    loop.handle(m.TokenizedRequest(uid=2, token_ids=[5] * 1500, params=SamplingParams(max_tokens=600)))
    (failed,) = sent
    assert isinstance(failed, m.RequestFailed) and failed.uid == 2 and failed.param == "max_tokens"
    assert "2048" in failed.message and "1500" in failed.message


def test_info_query(loop):
    loop, sent = loop
    loop.handle(m.TokenizedRequest(uid=3, token_ids=[1, 2], params=SamplingParams(max_tokens=50)))
    loop.handle(m.InfoQuery(call_id=9))
    (reply,) = sent
    assert reply.call_id == 9 and reply.info["requests"]["waiting"] == 1
    kv = reply.info["kv_pool"]
    assert kv["total_pages"] == 1024 and kv["free_pages"] == 1024
    assert loop.startup_info()["memory_line"].startswith("memory:")

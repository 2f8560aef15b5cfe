"""A stream that falls behind sends each request's queued replies as one (server/client.py).

The api server's loop is shared by every open stream; under a burst the replies of a request
pile up in its queue between two turns of its stream. `RequestGroup.events` then merges them,
so the client gets the same text, tokens and logprobs in fewer chunks.
"""

import asyncio

from minfer.core import TokenLogprobs
from minfer.ipc import messages as m
from minfer.server.client import RequestGroup, coalesce, merge_replies


def reply(uid, text, tokens, completion, finish=None, logprobs=None, **kw):
    return m.Reply(
        uid=uid,
        text=text,
        token_ids=tokens,
        prompt_tokens=5,
        completion_tokens=completion,
        finish_reason=finish,
        logprobs=logprobs,
        **kw,
    )


def lp(tokens):
    return TokenLogprobs(
        token_ids=tokens, logprobs=[-0.5 * t for t in tokens], tokens=[str(t) for t in tokens]
    )


def test_merge_keeps_every_token_and_the_first_reply_fields():
    first = reply(
        1, "Hel", [10], 1, logprobs=lp([10]), queue_s=0.1, prefill_s=0.2, prompt_text="p", cached_tokens=4
    )
    later = reply(1, "lo", [11, 12], 3, finish="stop", logprobs=lp([11, 12]), stop_reason=12)
    merged = merge_replies(first, later)
    assert (merged.text, merged.token_ids, merged.completion_tokens) == ("Hello", [10, 11, 12], 3)
    assert (merged.finish_reason, merged.stop_reason) == ("stop", 12)
    assert (merged.queue_s, merged.prefill_s, merged.prompt_text, merged.cached_tokens) == (0.1, 0.2, "p", 4)
    assert merged.logprobs.token_ids == [10, 11, 12]
    assert merged.logprobs.logprobs == [-5.0, -5.5, -6.0]
    assert first.logprobs.token_ids == [10]  # the inputs are not changed


def test_coalesce_per_request_order_and_ends():
    events = [
        reply(1, "a", [1], 1),
        reply(2, "x", [7], 1),
        reply(1, "b", [2], 2),
        reply(2, "y", [8], 2, finish="length"),
        reply(1, "c", [3], 3),
        m.RequestFailed(uid=3, message="boom", status=500),
    ]
    out = coalesce(events)
    assert [(e.uid, getattr(e, "text", None)) for e in out] == [(1, "abc"), (2, "xy"), (3, None)]
    assert out[0].token_ids == [1, 2, 3] and out[0].completion_tokens == 3
    assert out[1].finish_reason == "length"


def test_coalesce_never_merges_past_an_end():
    # A finished request's reply stays last; a new reply with the same uid after it is its own.
    events = [reply(1, "a", [1], 1, finish="stop"), reply(1, "b", [2], 2)]
    assert [e.text for e in coalesce(events)] == ["a", "b"]
    failed = m.RequestFailed(uid=1, message="gone", status=400)
    assert coalesce([reply(1, "a", [1], 1), failed, reply(1, "b", [2], 2)]) == [
        reply(1, "a", [1], 1),
        failed,
        reply(1, "b", [2], 2),
    ]


def test_request_group_streams_queued_replies_as_one():
    async def run():
        group = RequestGroup(client=None, rid="r")  # events() reads only the queue
        group.open = {1}
        for i, piece in enumerate(["The", " cat", " sat"]):
            group.queue.put_nowait(reply(1, piece, [i], i + 1))
        seen = []

        async def consume():
            async for event in group.events():
                seen.append((event.text, event.token_ids, event.finish_reason))

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0)  # the consumer takes what queued up before it ran: one event
        await asyncio.sleep(0)
        group.queue.put_nowait(reply(1, ".", [3], 4, finish="stop"))  # arrives while it waits
        await asyncio.wait_for(task, 5)
        return seen, group.open

    seen, still_open = asyncio.run(run())
    assert seen == [("The cat sat", [0, 1, 2], None), (".", [3], "stop")]
    assert still_open == set()

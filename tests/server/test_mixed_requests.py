"""Served requests give the same answer alone and in a crowd: completions and chats, streamed
or not, n > 1, echo, stop strings, seeds, penalties, logprobs, min_tokens -- each sent alone,
then all at once beside streams that their clients leave after a few chunks, in a KV pool small
enough that requests are preempted. Texts, finish reasons and usage must be equal (a streamed
answer's text is its chunks joined). The requests are drawn from a seeded random generator."""

from __future__ import annotations

import asyncio
import random

import openai
import pytest
from server_harness import Server

WORDS = ["the", "cat", "dog", "sat", "on", "a", "mat", "and", "ran", "far", "away", "into", "rain", "snow"]
NUM_REQUESTS, NUM_LEFT = 30, 15


@pytest.fixture(scope="module")
def server(tiny_chat_model, tmp_path_factory):
    s = Server(
        [
            tiny_chat_model,
            "--served-model-name",
            "tiny",
            "--kv-cache-tokens",
            "320",  # 19 pages of 16 for one request: ~5 of the 45 requests at a time
            "--page-size",
            "16",
            "--chunked-prefill-size",
            "64",
        ],
        tmp_path_factory.mktemp("mixed") / "server.log",
        env={"OMP_NUM_THREADS": "1"},
    )
    yield s
    s.stop()


def counts(usage) -> dict:
    """The usage's token counts; not its cached_tokens, which depend on what else the prefix
    cache holds when the request arrives (alone or in the crowd)."""
    return usage.model_dump(include={"prompt_tokens", "completion_tokens", "total_tokens"})


def draw_request(rng: random.Random, heads: list[str]) -> dict:
    """Keyword arguments of one completions or chat call (`chat` says which)."""
    tail = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 50)))
    text = f"{rng.choice(heads)} {tail}" if rng.random() < 0.6 else tail
    chat = rng.random() < 0.4
    kw: dict = {"chat": chat, "model": "tiny", "max_tokens": rng.randint(1, 60), "extra_body": {}}
    if chat:
        kw["messages"] = [{"role": "user", "content": text}]
    else:
        kw["prompt"] = text
        kw["echo"] = rng.random() < 0.2
    if rng.random() < 0.5:
        kw["temperature"] = 0
    else:
        kw.update(temperature=1.0, seed=rng.randint(0, 999))
    if rng.random() < 0.3:
        kw["stop"] = [rng.choice(["e", "a", " the", "."])]
        kw["extra_body"]["include_stop_str_in_output"] = rng.random() < 0.5
    if rng.random() < 0.3:
        kw["n"] = rng.choice([2, 3])
    if rng.random() < 0.3:
        kw["presence_penalty"] = 0.5
    if rng.random() < 0.3:
        kw["extra_body"]["ignore_eos"] = True
    if rng.random() < 0.2:
        kw["extra_body"]["min_tokens"] = rng.randint(0, kw["max_tokens"])
    if rng.random() < 0.3:
        if chat:
            kw.update(logprobs=True, top_logprobs=rng.choice([0, 2]))
        else:
            kw["logprobs"] = rng.choice([0, 2])
    kw["stream"] = rng.random() < 0.5
    if kw["stream"]:
        kw["stream_options"] = {"include_usage": True}
    return kw


async def answer(client: openai.AsyncOpenAI, kw: dict, leave_after: int | None = None):
    """(text by choice, finish reason by choice, usage); None when the client left early."""
    kw = dict(kw)
    chat = kw.pop("chat")
    create = client.chat.completions.create if chat else client.completions.create
    result = await create(**kw)
    texts, finish = {}, {}
    if not kw["stream"]:
        for c in result.choices:
            texts[c.index] = c.message.content if chat else c.text
            finish[c.index] = c.finish_reason
        return texts, finish, counts(result.usage)
    usage, chunks = None, 0
    async for event in result:
        chunks += 1
        if leave_after is not None and chunks >= leave_after:
            await result.close()  # the client goes away mid-stream
            return None
        if event.usage is not None:
            usage = counts(event.usage)
        for c in event.choices:
            piece = (c.delta.content or "") if chat else c.text
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return texts, finish, usage


@pytest.mark.parametrize("seed", [2, 4])
def test_answers_alone_equal_answers_in_a_crowd(server, seed):
    rng = random.Random(seed)
    heads = [" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(2)]  # shared prefixes
    requests = [draw_request(rng, heads) for _ in range(NUM_REQUESTS)]
    left = [draw_request(rng, heads) for _ in range(NUM_LEFT)]
    for kw in left:
        kw.update(stream=True, max_tokens=120, extra_body={"ignore_eos": True})
    preempted_before = server.info()["counters"]["preemptions"]

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        alone = [await answer(client, kw) for kw in requests]
        crowd = await asyncio.gather(
            *(answer(client, kw) for kw in requests),
            *(answer(client, kw, leave_after=rng.randint(1, 20)) for kw in left),
        )
        await client.close()
        return alone, crowd[:NUM_REQUESTS]

    alone, crowd = asyncio.run(run())
    wrong = [
        f"request {i} {requests[i]}:\n  alone {a}\n  crowd {c}"
        for i, (a, c) in enumerate(zip(alone, crowd))
        if a != c
    ]
    assert not wrong, f"seed {seed}:\n" + "\n".join(wrong)
    info = server.wait_idle(pages_free=True)
    assert info["counters"]["preemptions"] > preempted_before  # the premise: the crowd did not fit

"""Soak: 600 requests from 24 concurrent clients, a tenth of them given up at random moments
(some during prefill), some with stop strings and n > 1. Every other request completes with a
finish reason and consistent usage; afterwards no request is queued, the KV pool holds only the
prefix cache, and the server's memory grew by less than a bound. The server checks the page
invariant after every step (MINFER_CHECK_KV_INVARIANTS, set by conftest), so a bookkeeping
error stops it and fails the health check below."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest
from server_harness import Server

NUM_REQUESTS = 600
CONCURRENCY = 24
CANCEL_SHARE = 0.1
WARMUP_REQUESTS = 60
# Resident memory of the server and its workers may grow (allocator arenas, caches) but not
# with the number of requests served: 600 requests may add at most this much.
RSS_GROWTH_BOUND_MB = 150
WORDS = [
    "cats",
    "dogs",
    "rain",
    "trains",
    "tea",
    "stars",
    "bread",
    "rivers",
    "clocks",
    "snow",
    "maps",
    "ants",
]


@pytest.fixture(scope="module")
def server(tiny_chat_model, tmp_path_factory):
    srv = Server(
        [tiny_chat_model, "--kv-cache-tokens", "4096", "--log-level", "warning"],
        tmp_path_factory.mktemp("soak") / "server.log",
        env={"OMP_NUM_THREADS": "1"},
    )
    yield srv
    srv.stop()


def rss_mb(pids) -> float:
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/status") as f:
            total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return total / 1024


def make_request(rng: random.Random) -> dict:
    """A random request: chat or completion, streamed or not, sometimes n > 1 or a stop string."""
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40)))
    body = {
        "max_tokens": rng.randint(1, 12),
        "temperature": rng.choice([0, 0.8]),
        "seed": rng.randrange(1000),
    }
    if rng.random() < 0.5:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": words}]
    else:
        path, body["prompt"] = "/v1/completions", words
    if rng.random() < 0.2:
        body["n"] = rng.randint(2, 3)
    if rng.random() < 0.2:
        body["stop"] = [rng.choice(WORDS)[:2], "."]
    if rng.random() < 0.5:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return {
        "path": path,
        "body": body,
        "cancel_after": rng.choice([0, 1, 3]) if rng.random() < CANCEL_SHARE else None,
    }


def check_completed(body: dict, status: int, payload) -> None:
    spec = body
    assert status == 200, (body, payload)
    n = body.get("n", 1)
    if body.get("stream"):
        chunks = payload
        usage = chunks[-1]["usage"]
        finishes = {
            c["index"]: c["finish_reason"] for ch in chunks for c in ch["choices"] if c.get("finish_reason")
        }
    else:
        usage = payload["usage"]
        finishes = {c["index"]: c["finish_reason"] for c in payload["choices"]}
    assert sorted(finishes) == list(range(n)), (spec, finishes)
    assert set(finishes.values()) <= {"stop", "length"}, (spec, finishes)
    assert 1 <= usage["completion_tokens"] <= n * body["max_tokens"], (spec, usage)
    if set(finishes.values()) == {"length"}:
        assert usage["completion_tokens"] == n * body["max_tokens"], (spec, usage)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def run_one(client: httpx.AsyncClient, spec: dict) -> str:
    body, cancel_after = spec["body"], spec["cancel_after"]
    if cancel_after == 0:  # gone before the first token: most likely during prefill
        try:
            await client.post(spec["path"], json=body, timeout=0.01)
        except httpx.TimeoutException:
            pass
        return "cancelled"
    if not body.get("stream"):
        if cancel_after is not None:
            # only a stream can be left in the middle
            body = dict(body, stream=True, stream_options={"include_usage": True})
        else:
            r = await client.post(spec["path"], json=body)
            check_completed(body, r.status_code, r.json())
            return "completed"
    chunks = []
    async with client.stream("POST", spec["path"], json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks.append(json.loads(line[len("data: ") :]))
            if cancel_after is not None and len(chunks) >= cancel_after:
                return "cancelled"  # leaving the block closes the connection mid-stream
    check_completed(body, r.status_code, chunks)
    return "completed"


async def soak(url: str, specs: list[dict]) -> list[str]:
    sem = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def limited(spec):
            async with sem:
                return await run_one(client, spec)

        return await asyncio.gather(*(limited(s) for s in specs))


def test_soak_with_cancellations(server):
    rng = random.Random(1234)
    pids = [server.proc.pid, *server.workers.values()]
    asyncio.run(soak(server.url, [make_request(rng) for _ in range(WARMUP_REQUESTS)]))
    server.wait_idle(timeout=30)
    rss_before = rss_mb(pids)
    specs = [make_request(rng) for _ in range(NUM_REQUESTS)]
    results = asyncio.run(soak(server.url, specs))
    # A request may finish before its client meant to leave (short answers): then it is checked.
    planned = sum(s["cancel_after"] is not None for s in specs)
    assert planned / 2 <= results.count("cancelled") <= planned
    info = server.wait_idle(timeout=30)
    assert httpx.get(server.url + "/health").status_code == 200, server.output()[-3000:]
    pool = info["kv_pool"]
    assert pool["used_pages"] == 0, pool  # only the prefix cache holds pages
    assert pool["free_pages"] + pool["cached_pages"] == pool["total_pages"], pool
    growth = rss_mb(pids) - rss_before
    assert growth < RSS_GROWTH_BOUND_MB, f"RSS grew by {growth:.0f} MB over {NUM_REQUESTS} requests"

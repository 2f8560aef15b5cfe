"""The load generator of `minfer bench serve`: streams requests over httpx + asyncio and times every chunk.

A run is a list of pre-encoded request bodies, each with an arrival offset (seconds after the start)
and an index. `run_shard` sends them from one process; `run_sharded` spreads them over several
processes (round-robin, so each sees the same arrival process thinned) and merges the records.
The SSE parse works on raw bytes and decodes each `data:` payload with a typed msgspec struct,
which skips every field it does not name: the client spends a few microseconds per chunk.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import msgspec

from minfer.bench.serve_metrics import RequestRecord


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None  # /v1/completions
    delta: _Delta | None = None  # /v1/chat/completions


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: dict | None = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


@dataclass
class Shard:
    """The part of a run one client process sends."""

    url: str
    bodies: list[bytes]
    arrivals: list[float]  # seconds after the shard's start
    indexes: list[int]  # each request's index in the whole run
    max_concurrency: int | None


async def stream_request(client: httpx.AsyncClient, url: str, body: bytes, index: int) -> RequestRecord:
    """Send one streaming request and time its chunks. Errors end up in the record, never raised."""
    record = RequestRecord(index=index, start=time.time())
    start = time.perf_counter()
    last = None  # perf_counter of the previous content chunk
    buffer = b""
    finished = False
    try:
        async with client.stream(
            "POST", url, content=body, headers={"content-type": "application/json"}
        ) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                record.error = f"HTTP {resp.status_code}: {text[:300]}"
                record.end = record.start + time.perf_counter() - start
                return record
            async for data in resp.aiter_raw():
                now = time.perf_counter()
                buffer += data
                if b"\r" in buffer:  # servers built on sse-starlette end lines with CRLF
                    buffer = buffer.replace(b"\r\n", b"\n")
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    if not event.startswith(b"data:"):
                        continue  # an SSE comment or keep-alive
                    payload = event[5:].lstrip()
                    if payload == b"[DONE]":
                        finished = True
                        continue
                    chunk = _decode_chunk(payload)
                    if chunk.error is not None:
                        record.error = f"error event: {chunk.error.get('message', chunk.error)}"
                    if chunk.usage is not None:
                        record.prompt_tokens = chunk.usage.prompt_tokens
                        record.output_tokens = chunk.usage.completion_tokens
                    for choice in chunk.choices:
                        text = choice.text if choice.delta is None else choice.delta.content
                        if not text:
                            continue  # the chat role chunk, or a finish-only chunk
                        record.content_chunks += 1
                        if last is None:
                            record.ttft = now - start
                        else:
                            record.itl.append(now - last)
                        last = now
    except (httpx.HTTPError, msgspec.DecodeError, OSError) as e:
        record.error = f"{type(e).__name__}: {e}"
    record.end = record.start + time.perf_counter() - start
    if not record.error and not finished:
        record.error = "the stream ended without data: [DONE]"
    if not record.error and record.content_chunks == 0 and record.output_tokens > 0:
        record.error = "no output text was streamed"
    record.ok = not record.error
    return record


async def _run(shard: Shard, on_done: Callable[[RequestRecord], None]) -> list[RequestRecord]:
    # One worker per allowed stream, each with its own single-connection client: httpcore's pool
    # rescans every connection (quadratically in idle ones) on each request it queues or closes,
    # which at 128 streams in one pool cost more than the SSE parse (a third of the CPU time).
    # No read timeout: a long generation at a low rate may wait seconds between chunks while the
    # server is saturated. One SSL context for all (each client would otherwise load the CA file),
    # and none for plain http: loading the system's CA store costs ~50 ms of CPU on the 2-core
    # development machine, as much as the client's own work for a thousand streamed tokens.
    workers = min(shard.max_concurrency or len(shard.bodies), len(shard.bodies))
    ssl_context = ssl.create_default_context() if shard.url.startswith("https:") else False
    queue: asyncio.Queue = asyncio.Queue()
    records: list[RequestRecord] = []
    start = time.perf_counter()

    async def dispatch() -> None:  # releases each request at its arrival time, in arrival order
        for item in sorted(zip(shard.arrivals, shard.indexes, shard.bodies)):
            delay = start + item[0] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            queue.put_nowait(item)
        for _ in range(workers):
            queue.put_nowait(None)

    async def worker() -> None:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with httpx.AsyncClient(
            limits=limits, timeout=httpx.Timeout(None, connect=30.0), verify=ssl_context
        ) as client:
            while (item := await queue.get()) is not None:
                record = await stream_request(client, shard.url, item[2], item[1])
                records.append(record)
                on_done(record)

    await asyncio.gather(dispatch(), *(worker() for _ in range(workers)))
    return sorted(records, key=lambda r: r.index)


def run_shard(shard: Shard, on_done: Callable[[RequestRecord], None] = lambda r: None) -> list[RequestRecord]:
    """Send one shard from this process; `on_done` is called as each request finishes."""
    return asyncio.run(_run(shard, on_done))


def _shard_process(shard: Shard, number: int, queue, go) -> None:
    queue.put(("ready", number, None))
    go.wait()
    records = run_shard(shard, lambda r: queue.put(("done", number, None)))
    queue.put(("records", number, records))


def split(shard: Shard, processes: int) -> list[Shard]:
    """Round-robin the requests over `processes` shards, dividing the concurrency limit among them."""
    out = []
    for k in range(processes):
        limit = None
        if shard.max_concurrency:
            limit = shard.max_concurrency // processes + (k < shard.max_concurrency % processes)
        out.append(
            Shard(
                shard.url,
                shard.bodies[k::processes],
                shard.arrivals[k::processes],
                shard.indexes[k::processes],
                limit,
            )
        )
    return out


def run_sharded(
    shard: Shard, processes: int, on_done: Callable[[], None] = lambda: None
) -> list[RequestRecord]:
    """Send the run from `processes` client processes started together; records in index order."""
    ctx = multiprocessing.get_context("spawn")  # a clean interpreter: no inherited event loop or threads
    queue, go = ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(target=_shard_process, args=(part, k, queue, go), daemon=True)
        for k, part in enumerate(split(shard, processes))
    ]
    for p in procs:
        p.start()
    records: list[RequestRecord] = []
    ready = reported = 0
    try:
        while reported < processes:
            try:
                kind, _, payload = queue.get(timeout=5)
            except Exception:  # queue.Empty: check that no shard died without reporting
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a client process exited with {dead[0]}") from None
                continue
            if kind == "ready":
                ready += 1
                if ready == processes:
                    go.set()  # every shard starts its clock now, within a few ms of the others
            elif kind == "done":
                on_done()
            else:
                records.extend(payload)
                reported += 1
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    return sorted(records, key=lambda r: r.index)

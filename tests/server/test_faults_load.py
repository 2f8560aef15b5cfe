"""Load and client faults against a real server: huge prompts, overload, slow readers, disconnects.

One server for the module (a tiny random model with the default model's tokenizer, 4096 context):
2 running requests, 4 more may wait, a stream may leave 512 replies unread (well above what piles
up while the api server parses a 20 MB body), and prefill runs in chunks of 256 tokens (so a long
prompt spans several steps and can be left during its prefill).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import httpx
import openai
import pytest
from server_harness import Server

MAX_RUNNING, MAX_QUEUED, MAX_UNREAD = 2, 4, 512
# The longest gap allowed between a stream's chunks while other clients misbehave: a stall (a
# stream waiting for a huge prompt's parsing or prefill, or for a blocked api server) is longer.
# The gaps are ~0.01-0.12 s here, also beside another test worker; CI's shared 2-core machine
# once held a /health probe 1.35 s, so a single gap is allowed up to 2 s.
MAX_STREAM_GAP_S = 2.0


@pytest.fixture(scope="module")
def server(tiny_chat_model, tmp_path_factory):
    s = Server(
        [
            tiny_chat_model,
            "--served-model-name",
            "tiny",
            "--kv-cache-tokens",
            "16384",
            "--max-running-requests",
            str(MAX_RUNNING),
            "--max-queued-requests",
            str(MAX_QUEUED),
            "--max-unread-replies",
            str(MAX_UNREAD),
            "--chunked-prefill-size",
            "256",
        ],
        tmp_path_factory.mktemp("faults") / "server.log",
        env={"OMP_NUM_THREADS": "1"},
    )
    yield s
    s.stop()


def stream_gaps(server, out: dict, max_tokens: int = 200) -> None:
    """Stream a completion with the openai client; record the largest gap between chunks."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    last, gaps, text = None, [], ""
    for chunk in client.completions.create(
        model="tiny",
        prompt="Once upon a time",
        max_tokens=max_tokens,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        now = time.monotonic()
        if last is not None:
            gaps.append(now - last)
        last = now
        text += chunk.choices[0].text
        out.setdefault("first", now)
        out["finish"] = chunk.choices[0].finish_reason
    out["max_gap"] = max(gaps)


def test_huge_prompts_are_refused_fast_and_do_not_stall_streams(server):
    out: dict = {}
    victim = threading.Thread(target=stream_gaps, args=(server, out, 300))
    victim.start()
    while "first" not in out:
        time.sleep(0.01)
    answers = []
    for prompt, why in (
        ("x" * 20_000_000, None),
        ("y" * 1_000_000, "bytes"),
        ("word " * 120_000, "tokens in its first"),
    ):
        start = time.monotonic()
        r = server.post("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 4})
        answers.append((r, time.monotonic() - start, why))
    victim.join(60)
    assert out["finish"] == "length" and out["max_gap"] < MAX_STREAM_GAP_S, out
    for r, seconds, why in answers:
        # 20 MB may meet the api's body size limit (413) before the prompt checks (400).
        assert r.status_code in ((400, 413) if why is None else (400,)), r.text
        error = r.json()["error"]
        assert error["message"] and seconds < 5.0
        if why:
            assert (
                error["param"] == "prompt"
                and error["code"] == "context_length_exceeded"
                and why in error["message"]
            )
    server.wait_idle(pages_free=True)


async def _burst(url: str, n: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=n)) as client:
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 32, "ignore_eos": True}
        return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(n)))


def test_overload_is_refused_with_503_and_retry_after(server):
    out: dict = {}
    running = threading.Thread(target=stream_gaps, args=(server, out, 300))
    running.start()
    while "first" not in out:
        time.sleep(0.01)
    health = []

    def watch_health():
        while running.is_alive():
            start = time.monotonic()
            r = httpx.get(server.url + "/health", timeout=5)
            health.append((r.status_code, time.monotonic() - start))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch_health)
    watcher.start()
    start = time.monotonic()
    answers = asyncio.run(_burst(server.url, 50))
    burst_s = time.monotonic() - start
    running.join(60)
    watcher.join(10)
    codes = [r.status_code for r in answers]
    assert set(codes) <= {200, 503}, codes
    # The running stream holds one of the 2 slots: 1 more runs and 4 wait, the rest are refused.
    assert codes.count(200) >= MAX_RUNNING - 1 + MAX_QUEUED and codes.count(503) >= 20, codes
    for r in answers:
        if r.status_code == 503:
            assert r.headers["retry-after"] == "1"
            assert (
                r.json()["error"]["type"] == "service_unavailable"
                and "capacity" in r.json()["error"]["message"]
            )
        else:
            assert r.json()["usage"]["completion_tokens"] == 32
    assert burst_s < 30
    assert out["finish"] == "length"  # the running request was unharmed
    # Kubernetes' liveness probe by default fails an answer slower than 1 s and restarts the pod
    # after 3 failures in a row: it must never come to that. (One slow answer alone is allowed: on
    # a 2-core CI machine shared with another test worker, a probe once took 1.35 s.)
    assert health and all(code == 200 for code, _ in health), health
    slow = [seconds >= 1.0 for _, seconds in health]
    assert not any(all(slow[i : i + 3]) for i in range(len(slow) - 2)), health
    server.wait_idle(pages_free=True)


def test_slow_reader_is_aborted_and_does_not_stall_others(server):
    # A client that sends its request and then reads nothing, with a tiny receive window. SGLang's
    # streamed /generate sends the whole text so far in every event, so the kernel's socket
    # buffers (megabytes) fill within seconds and the replies then pile up in the api server.
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    slow.connect(("127.0.0.1", server.port))
    body = json.dumps(
        {"text": "Once", "stream": True, "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
    ).encode()
    slow.sendall(
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    out: dict = {}
    stream_gaps(server, out, 200)  # another client meanwhile
    assert out["finish"] == "length" and out["max_gap"] < MAX_STREAM_GAP_S, out
    deadline = time.monotonic() + 30
    while "replies unread" not in server.output():
        assert time.monotonic() < deadline, "the slow reader was never aborted"
        time.sleep(0.1)
    info = server.wait_idle(pages_free=True)  # aborted long before its 4000 tokens
    assert info["counters"]["generation_tokens"] < 4000 + 200 * 10
    # What it is finally sent ends with the reason, in OpenAI's error shape, and [DONE].
    slow.settimeout(10)
    received = b""
    while not received.endswith(b"\r\n0\r\n\r\n"):  # the end of a chunked body
        part = slow.recv(1 << 20)
        assert part, received[-300:]
        received = received[-4096:] + part
    slow.close()
    events = [e for e in received.split(b"\n\n") if b"data: " in e]
    assert events[-1].endswith(b"data: [DONE]")
    assert b'"error"' in events[-2] and b"replies unread" in events[-2]


def _open_stream(server, prompt: str, max_tokens: int) -> tuple[httpx.Client, httpx.Response]:
    client = httpx.Client(base_url=server.url, timeout=30)
    resp = client.send(
        client.build_request(
            "POST",
            "/v1/completions",
            json={
                "model": "tiny",
                "prompt": prompt,
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "stream": True,
            },
        ),
        stream=True,
    )
    return client, resp


@pytest.mark.parametrize("when", ["before the first token", "mid-stream", "after the last token"])
def test_disconnect_frees_the_request(server, when):
    greedy = {"model": "tiny", "prompt": "The sky is", "max_tokens": 12, "temperature": 0}
    before = server.post("/v1/completions", greedy).json()["choices"][0]["text"]
    if when == "before the first token":  # the client gives up while its 3,000-token prompt prefills
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                server.url + "/v1/completions",
                timeout=httpx.Timeout(10, read=0.05),
                json={"model": "tiny", "prompt": "many words " * 1500, "max_tokens": 500, "stream": True},
            )
    else:
        client, resp = _open_stream(server, "Once", 8 if when == "after the last token" else 2000)
        lines = resp.iter_lines()
        if when == "mid-stream":
            for _ in range(3):
                next(lines)
        else:
            assert [line for line in lines if line][-1] == "data: [DONE]"
        resp.close()
        client.close()
    server.wait_idle(pages_free=True)
    assert server.post("/v1/completions", greedy).json()["choices"][0]["text"] == before


def test_a_burst_of_disconnects(server):
    # Fill the running slots with streams left mid-stream, and the queue with clients that give
    # up while they wait (a queued stream's headers come only once it runs: 2000 tokens later).
    opened = [_open_stream(server, f"Story {i}:", 2000) for i in range(MAX_RUNNING)]
    for _client, resp in opened:
        next(resp.iter_lines())
    for i in range(MAX_QUEUED):
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(
                server.url + "/v1/completions",
                json={"model": "tiny", "prompt": f"Queued {i}:", "max_tokens": 2000},
                timeout=0.2,
            )
    for client, resp in opened:
        resp.close()
        client.close()
    info = server.wait_idle(pages_free=True)
    assert info["kv_pool"]["free_pages"] + info["kv_pool"]["cached_pages"] == info["kv_pool"]["total_pages"]
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200

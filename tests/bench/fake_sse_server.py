"""A minimal OpenAI-shaped streaming server on raw asyncio sockets, to measure the bench client alone.

It is NOT a benchmark target: it generates no text, only chunks in the shape minfer's server sends
(one token per chunk, then a usage chunk, then `data: [DONE]`), each stream paced at
--token-interval seconds (0: as fast as the event loop goes). Cheap per chunk (one pre-built byte
string, one write), so on its own core it outruns the client being measured.

    python tests/bench/fake_sse_server.py --port 8999 --token-interval 0.01
"""

from __future__ import annotations

import argparse
import asyncio
import json

CHUNK = (
    b'data: {"id":"cmpl-fake","object":"text_completion","created":0,"model":"fake","choices":'
    b'[{"index":0,"text":" tok","logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
)
JSON_HEADERS = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
SSE_HEADERS = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, interval: float) -> None:
    try:
        while True:  # keep-alive: one request after another on this connection
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
            length = int({k.lower(): v for k, v in headers.items()}.get("content-length", 0))
            body = json.loads(await reader.readexactly(length)) if length else {}
            if path == "/v1/models":
                reply = {"object": "list", "data": [{"id": "fake", "object": "model"}]}
            elif path == "/tokenizer_info":
                reply = {"vocab_size": 1000, "added_special_tokens": []}
            elif not body.get("stream"):
                reply = {
                    "choices": [{"index": 0, "text": " tok", "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                }
            else:
                await stream(writer, body, interval)
                continue
            data = json.dumps(reply).encode()
            writer.write(JSON_HEADERS % len(data) + data)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def stream(writer: asyncio.StreamWriter, body: dict, interval: float) -> None:
    tokens = int(body.get("max_tokens", 16))
    prompt = body.get("prompt")
    prompt_tokens = len(prompt) if isinstance(prompt, list) else 1
    writer.write(SSE_HEADERS)
    event = http_chunk(CHUNK)
    for _ in range(tokens):
        writer.write(event)
        await writer.drain()
        await asyncio.sleep(interval)
    usage = {
        "choices": [],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": tokens,
            "total_tokens": prompt_tokens + tokens,
        },
    }
    writer.write(
        http_chunk(b"data: " + json.dumps(usage).encode() + b"\n\n")
        + http_chunk(b"data: [DONE]\n\n")
        + b"0\r\n\r\n"
    )
    await writer.drain()


async def main(port: int, interval: float) -> None:
    server = await asyncio.start_server(lambda r, w: handle(r, w, interval), "127.0.0.1", port, backlog=1024)
    print(f"fake SSE server on 127.0.0.1:{port}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8999)
    parser.add_argument("--token-interval", type=float, default=0.0, help="seconds between a stream's chunks")
    args = parser.parse_args()
    asyncio.run(main(args.port, args.token_interval))

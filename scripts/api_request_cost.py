"""The api server's fixed cost per HTTP request: N `GET /v1/models` over C keep-alive connections.

That endpoint reads only the server's state, so the time per request is FastAPI, uvicorn and
minfer's dependencies, with no engine work. Start a server, then (pin this client to another core):

    minfer serve --port 8139 &
    taskset -c 1 python3 scripts/api_request_cost.py --port 8139 --requests 3000 --connections 1
"""

from __future__ import annotations

import argparse
import asyncio
import time

REQUEST = b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n"


async def one_connection(port: int, count: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for _ in range(count):
        writer.write(REQUEST)
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
        await reader.readexactly(length)
    writer.close()


async def run(port: int, requests: int, connections: int) -> float:
    per = requests // connections
    start = time.perf_counter()
    await asyncio.gather(*(one_connection(port, per) for _ in range(connections)))
    return (time.perf_counter() - start) / (per * connections)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--connections", type=int, default=1)
    args = ap.parse_args()
    seconds = asyncio.run(run(args.port, args.requests, args.connections))
    print(
        f"{args.requests} GET /v1/models over {args.connections} connection(s): {seconds * 1e6:.0f} us per request"
    )


if __name__ == "__main__":
    main()

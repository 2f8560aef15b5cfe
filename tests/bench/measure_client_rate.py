"""How many streamed tokens per second one `minfer bench serve` client process can take in.

Starts tests/bench/fake_sse_server.py pinned to one core, runs the client pinned to another, and
prints tokens/s of wall time and tokens per CPU-second of the client (the capacity: what it could
take in on a core of its own). Paced streams (--token-interval) give one chunk per socket read,
as a real server does; unpaced ones coalesce chunks and flatter the client.

    python tests/bench/measure_client_rate.py --streams 256 --tokens 256 --token-interval 0.01
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE.parent))

from server_harness import free_port

from minfer.bench.serve_client import Shard, run_shard


def start_fake_server(interval: float, core: int | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [
        sys.executable,
        str(HERE / "fake_sse_server.py"),
        "--port",
        str(port),
        "--token-interval",
        str(interval),
    ]
    if core is not None:
        cmd = ["taskset", "-c", str(core), *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            httpx.get(url + "/v1/models", timeout=1)
            return proc, url
        except httpx.HTTPError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the fake server did not start")


def measure(url: str, streams: int, tokens: int, rounds: int = 2) -> dict:
    body = b'{"prompt": [1, 2, 3], "max_tokens": %d, "stream": true}' % tokens
    n = streams * rounds
    shard = Shard(url + "/v1/completions", [body] * n, [0.0] * n, list(range(n)), streams)
    cpu0, wall0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    records = run_shard(shard)
    wall = time.perf_counter() - wall0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    total = sum(r.output_tokens for r in records)
    assert all(r.ok and r.content_chunks == tokens for r in records), [r.error for r in records if not r.ok][
        :3
    ]
    return {
        "tokens": total,
        "wall_s": wall,
        "cpu_s": cpu,
        "tok_per_wall_s": total / wall,
        "tok_per_cpu_s": total / cpu,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--token-interval", type=float, default=0.01)
    parser.add_argument("--server-core", type=int, default=0)
    parser.add_argument("--client-core", type=int, default=1)
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.client_core})
    proc, url = start_fake_server(args.token_interval, args.server_core)
    try:
        result = measure(url, args.streams, args.tokens)
    finally:
        proc.kill()
        proc.wait()
    print(
        f"{args.streams} streams x {args.tokens} tokens, interval {args.token_interval * 1e3:g} ms: "
        f"{result['tok_per_wall_s']:,.0f} tok/s of wall time, {result['tok_per_cpu_s']:,.0f} tok per client "
        f"CPU-second ({1e6 / result['tok_per_cpu_s']:.1f} us per token), load average {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()

"""Greedy answers of a real server under load and client faults, against the same prompts alone.

Starts `minfer serve` with the flags given after `--` (the default model unless a model is
named), asks every prompt alone first (temperature 0, the reference), then sends rounds of the
same prompts concurrently, each request at random one of: a plain completion (n = 1 or 2), a
stream read to the end, a stream the client closes after a few chunks, or a request given up
during its prompt (a client timeout of 0.05-1 s). Every answer that completes must equal its
prompt's reference; after each round the server must hold no KV page for a request. Half the
prompts extend another prompt, so the prefix cache serves them; a small `--kv-cache-tokens`
adds evictions and preemptions.

    python3 scripts/serve_greedy_under_faults.py -- --kv-cache-tokens 3000 --page-size 16 \\
        --chunked-prefill-size 64 --max-running-requests 16

Exit status 1 on any mismatch or failed request. What to expect with lossy numerics
(`--kv-cache-dtype fp8_e4m3`, `--quantization`): docs/SERVING.md, "Repeatability".
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from server_harness import Server  # noqa: E402  (the tests' real-server harness)

MAX_TOKENS = 24


def make_prompts(count: int, rng: random.Random) -> list[str]:
    """`count` pairs of prompts cut from this repository's docs: a base of 20-300 words and the
    same base extended by 40 more (which finds the base in the prefix cache)."""
    words = " ".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))).split()
    prompts = []
    for i in range(count):
        start = i * 97
        base = " ".join(words[start : start + rng.randint(20, 300)])
        tail = " ".join(words[5000 + i * 13 : 5000 + i * 13 + 40])
        prompts += [base, f"{base} {tail}"]
    return prompts


async def complete(client, prompt: str, stream: bool, close_after: int | None = None, n: int = 1):
    """The answer's text; None when the client closed the stream early."""
    if not stream:
        reply = await client.completions.create(
            model="m", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, n=n
        )
        texts = {choice.text for choice in reply.choices}
        if len(texts) != 1:
            raise AssertionError(f"greedy choices differ: {texts}")
        return reply.choices[0].text
    chunks = await client.completions.create(
        model="m", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    text, count = "", 0
    async for chunk in chunks:
        text += chunk.choices[0].text
        count += 1
        if close_after is not None and count >= close_after:
            await chunks.response.aclose()
            return None
    return text


def one_request(client, prompt: str, rng: random.Random):
    """A coroutine of a random kind, and the kind's name."""
    draw = rng.random()
    if draw < 0.3:
        return complete(client, prompt, stream=True), "stream"
    if draw < 0.55:
        return complete(client, prompt, stream=True, close_after=rng.randint(1, 3)), "closed"
    if draw < 0.7:  # given up while its prompt is processed, or soon after
        return asyncio.wait_for(complete(client, prompt, stream=False), rng.uniform(0.05, 1.0)), "given up"
    return complete(client, prompt, stream=False, n=rng.choice([1, 2])), "plain"


async def run(server: Server, prompts: list[str], rounds: int, rng: random.Random) -> int:
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", timeout=600, max_retries=0)
    started = time.monotonic()
    reference = {p: await complete(client, p, stream=False) for p in prompts}
    print(f"{len(prompts)} references alone in {time.monotonic() - started:.0f} s", flush=True)
    failures = 0
    for round_ in range(rounds):
        batch = rng.sample(prompts, len(prompts)) + rng.sample(prompts, len(prompts) // 4)
        requests = [(prompt, *one_request(client, prompt, rng)) for prompt in batch]
        results = await asyncio.gather(*(coro for _, coro, _ in requests), return_exceptions=True)
        compared = 0
        for (prompt, _, kind), result in zip(requests, results):
            if isinstance(result, BaseException):
                if kind != "given up":
                    failures += 1
                    print(f"FAILED {kind}: {result!r:.300}")
            elif result is not None:
                compared += 1
                if result != reference[prompt]:
                    failures += 1
                    print(f"MISMATCH {kind} {prompt[:40]!r}: {result!r} != {reference[prompt]!r}")
        try:  # the given-up requests' aborts reach the scheduler a moment later
            server.wait_idle(timeout=10, pages_free=True)
        except AssertionError as idle_error:
            failures += 1
            print(f"round {round_ + 1}: {idle_error}")
        print(f"round {round_ + 1}: {len(batch)} requests, {compared} answers compared, "
              f"{failures} failures so far", flush=True)  # fmt: skip
    return failures


def exercised(server: Server) -> str:
    """What the run made the server do, from its /metrics: preemptions, prefix-cache hits and
    (with --host-kv-cache-gb) the host tier's traffic, so a run that was meant to stress one of
    them shows that it did."""
    wanted = ("num_preemptions", "prefix_cache_hits", "host_cache_hits", "host_cache_bytes_offloaded")
    lines = httpx.get(server.url + "/metrics", headers=server.headers, timeout=10).text.splitlines()
    found = [line for line in lines if not line.startswith("#") and any(w in line for w in wanted)]
    return "; ".join(found) or "(none of the counters it looks for)"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=24, help="prompt pairs (base, base + more)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=None, help="the draws' seed (default: the time)")
    parser.add_argument("serve_args", nargs="*", help="flags for `minfer serve`, after `--`")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else int(time.time())
    print(f"seed {seed}")
    rng = random.Random(seed)
    log = Path("/tmp") / f"serve_greedy_under_faults_{seed}.log"
    server = Server([*args.serve_args, "--served-model-name", "m"], log)
    try:
        failures = asyncio.run(run(server, make_prompts(args.pairs, rng), args.rounds, rng))
        print(f"exercised: {exercised(server)}")
    finally:
        server.stop()
    print(f"{'FAILED' if failures else 'passed'}: {failures} failures (server log {log})")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

"""`minfer bench serve`: an online benchmark of a running OpenAI-compatible server.

Requests arrive as a Poisson process at --request-rate (or all at once for `inf`), at most
--max-concurrency in flight, each streamed from /v1/completions or /v1/chat/completions. Token
counts come from the server's usage (stream_options.include_usage); the report gives throughput,
TTFT / TPOT / ITL / E2E distributions and goodput (see serve_metrics for the definitions).

A pure client: nothing here imports torch, and the server may be any OpenAI-compatible one (the
random workload also uses vLLM's /tokenize and /detokenize when it runs against chat).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from minfer.bench.serve_args import ENDPOINT_PATHS, WORKLOAD_DEFAULTS, BenchError


def run_serve_bench(args: argparse.Namespace) -> int:
    """The command: one clear error line (exit 2) for bad flags, an unreachable server or a bad dataset."""
    try:
        return _run(args)
    except BenchError as e:
        print(f"minfer bench serve: error: {e}", file=sys.stderr)
        return 2


def _resolve_workload(args: argparse.Namespace) -> str:
    from minfer.bench.workloads import WorkloadError, check_range_ratio

    if args.dataset and args.workload:
        raise BenchError("give --workload or --dataset, not both")
    workload = "dataset" if args.dataset else (args.workload or "random")
    if workload == "nano-vllm":  # its sampling is part of the workload, as in `bench offline`
        args.temperature, args.ignore_eos = 0.6, True
    for name, value in WORKLOAD_DEFAULTS[workload].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.num_warmups < 0:
        raise BenchError(f"--num-warmups must be >= 0, got {args.num_warmups}")
    if args.dataset and args.input_len is not None:
        raise BenchError("--input-len does not apply to --dataset (its prompts are given)")
    try:
        check_range_ratio(args.range_ratio)
    except WorkloadError as e:
        raise BenchError(str(e)) from None
    if args.output_json:  # fail now, not after the run
        path = Path(args.output_json)
        try:
            existed = path.exists()
            path.open("a").close()
            if not existed:
                path.unlink()
        except OSError as e:
            raise BenchError(f"cannot write --output-json {args.output_json}: {e.strerror}") from None
    if args.client_processes > 1 and args.max_concurrency and args.client_processes > args.max_concurrency:
        raise BenchError(
            f"--client-processes {args.client_processes} exceeds --max-concurrency "
            f"{args.max_concurrency}: each process needs at least one request in flight"
        )
    return workload


def _run(args: argparse.Namespace) -> int:
    import httpx
    import numpy as np

    from minfer.bench.serve_client import Shard, run_shard, run_sharded
    from minfer.bench.serve_metrics import parse_slo, summarize

    workload = _resolve_workload(args)
    try:
        slo = parse_slo(args.slo)
    except ValueError as e:
        raise BenchError(str(e)) from None
    base = args.base_url.rstrip("/")
    with httpx.Client(base_url=base, timeout=60) as http:
        # First: a bad --dataset fails without a server.
        requests = _build_requests(http, args, workload, args.num_prompts, args.seed)
        model = args.model or _first_model(http, base)
        bodies = [_encode_body(args, model, r) for r in requests]
        _probe(http, ENDPOINT_PATHS[args.endpoint], bodies[0])
        # Warm-ups: the same shapes drawn with another seed, so no timed prompt is cached by them.
        warmups = (
            []
            if not args.num_warmups
            else [
                _encode_body(args, model, r)
                for r in _build_requests(http, args, workload, args.num_warmups, args.seed + 1)
            ]
        )

    # Exponential gaps: a Poisson process; the first request goes at 0.
    rng = np.random.default_rng(args.seed)
    if math.isinf(args.request_rate):
        arrivals = [0.0] * len(bodies)
    else:
        gaps = rng.exponential(1 / args.request_rate, len(bodies))
        arrivals = np.concatenate([[0.0], np.cumsum(gaps[:-1])]).tolist()
    shard = Shard(
        base + ENDPOINT_PATHS[args.endpoint], bodies, arrivals, list(range(len(bodies))), args.max_concurrency
    )

    print(
        f"minfer bench serve: {len(bodies)} requests ({workload}) to {shard.url}, model {model}, "
        f"rate {args.request_rate:g}/s, max concurrency {args.max_concurrency or 'unlimited'}, "
        f"{args.client_processes} client process(es)",
        flush=True,
    )
    if warmups:
        print(f"{len(warmups)} warm-up requests (not timed)", flush=True)
        run_shard(
            Shard(shard.url, warmups, [0.0] * len(warmups), list(range(len(warmups))), args.max_concurrency)
        )
    bar = _progress_bar(len(bodies), disable=args.no_progress)
    if args.client_processes == 1:
        records = run_shard(shard, lambda r: bar.update())
    else:
        records = run_sharded(shard, args.client_processes, lambda: bar.update())
    bar.close()
    summary = summarize(records, slo)
    print(format_report(summary))
    errors = [r.error for r in records if not r.ok]
    if errors:
        print(f"first error: {errors[0]}")
    if args.output_json:
        config = {
            k: (None if isinstance(v, float) and math.isinf(v) else v)
            for k, v in vars(args).items()
            if k not in ("command", "bench_command")
        }
        out = {
            "config": {
                **config,
                "workload": workload,
                "model": model,
                "url": shard.url,
                "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
            },
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **summary,
            "requests": [r.as_dict() for r in records],
        }
        Path(args.output_json).write_text(json.dumps(out, indent=1))
    return 0 if summary["completed"] else 1


def _progress_bar(total: int, disable: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", disable=disable, file=sys.stderr)


def _get(http, path: str, base: str, **kwargs):
    import httpx

    try:
        resp = http.request(kwargs.pop("method", "GET"), path, **kwargs)
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach {base}{path}: {e}") from None
    if resp.status_code != 200:
        raise BenchError(f"{base}{path} answered HTTP {resp.status_code}: {resp.text[:300]}")
    return resp.json()


def _first_model(http, base: str) -> str:
    data = _get(http, "/v1/models", base).get("data") or []
    if not data:
        raise BenchError(f"{base}/v1/models lists no model: give --model")
    return data[0]["id"]


def _build_requests(
    http, args: argparse.Namespace, workload: str, num_prompts: int | None, seed: int
) -> list:
    from minfer.bench.workloads import BenchRequest, WorkloadError, load_jsonl, nano_vllm_draw, random_draw

    base = args.base_url.rstrip("/")
    chat = args.endpoint == "chat"
    try:
        if workload == "dataset":
            requests = load_jsonl(args.dataset, args.output_len, chat)
            if num_prompts:
                requests = (requests * math.ceil(num_prompts / len(requests)))[:num_prompts]
            return requests
        info = _get(http, "/tokenizer_info", base)
        vocab = info.get("vocab_size") or 10001
        if workload == "nano-vllm":
            prompts, max_tokens = nano_vllm_draw(num_prompts, args.input_len, args.output_len, seed)
            requests = [BenchRequest([t % vocab for t in p], m) for p, m in zip(prompts, max_tokens)]
        else:
            # Special tokens (end of turn, ...) would change what the prompt means; leave them out.
            specials = "".join(info.get("added_special_tokens") or [])
            special_ids = (
                set(
                    _get(
                        http,
                        "/tokenize",
                        base,
                        method="POST",
                        json={"prompt": specials, "add_special_tokens": False},
                    )["tokens"]
                )
                if specials
                else set()
            )
            vocab_ids = [t for t in range(vocab) if t not in special_ids]
            requests = random_draw(
                num_prompts, args.input_len, args.output_len, args.range_ratio, vocab_ids, seed
            )
    except WorkloadError as e:
        raise BenchError(str(e)) from None
    if chat:  # chat takes text: the ids decoded by the server's own tokenizer
        for r in requests:
            r.prompt = _get(http, "/detokenize", base, method="POST", json={"tokens": r.prompt})["prompt"]
    return requests


def _encode_body(args: argparse.Namespace, model: str, request) -> bytes:
    body = {
        "model": model,
        "max_tokens": request.max_tokens,
        "temperature": args.temperature,
        "ignore_eos": args.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.endpoint == "chat":
        body["messages"] = request.messages or [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    return json.dumps(body).encode()


def _probe(http, path: str, body: bytes) -> None:
    """One short request before the timed run: a clear error now rather than N failures later. Its
    prompt is not the first request's, which would then be a prefix-cache hit in the timed run."""
    probe = json.loads(body)
    probe.update(max_tokens=1, stream=False)
    probe.pop("stream_options")
    if "messages" in probe:
        probe["messages"] = [{"role": "user", "content": "hi"}]
    else:
        probe["prompt"] = probe["prompt"][-1:] if isinstance(probe["prompt"], list) else "hi"
    _get(http, path, str(http.base_url).rstrip("/"), method="POST", json=probe)


def format_report(s: dict) -> str:
    """The human-readable report: one metric per line."""
    rows = [
        ("Successful requests", f"{s['completed']}"),
        ("Failed requests", f"{s['failed']}"),
        ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
        ("Total input tokens", f"{s['prompt_tokens']}"),
        ("Total output tokens", f"{s['output_tokens']}"),
        ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{s['output_throughput']:.1f}"),
        ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.1f}"),
        ("Chunk/usage token mismatches", f"{s['chunk_token_mismatches']}"),
    ]
    if "goodput" in s:
        limits = ", ".join(f"{k} <= {v:g} ms" for k, v in s["slo_ms"].items())
        rows.append((f"Goodput (req/s, {limits})", f"{s['goodput']:.2f} ({s['good_requests']} requests)"))
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E latency")):
        d = s[key]
        rows.append(
            (
                f"{name} (ms) mean / p50 / p90 / p99",
                f"{d['mean']:.2f} / {d['p50']:.2f} / {d['p90']:.2f} / {d['p99']:.2f}",
            )
        )
    width = max(len(name) for name, _ in rows) + 2
    lines = ["=" * 20 + " minfer bench serve " + "=" * 20]
    lines += [f"{name + ':':<{width}}{value}" for name, value in rows]
    return "\n".join(lines)

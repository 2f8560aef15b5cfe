"""Check the host KV tier on CUDA: the paths the CPU tests cannot reach (pinned host pool, the
load and offload streams and their events, requests waiting for a load while others run), then
its figures on the issue's workload.

    PYTHONPATH=$PWD python3 scripts/gpu_hostkv_check.py --model llama-3.1-8b --dtype bfloat16

Needs minfer's run-time packages (msgspec, ...) as shared/gpu/README.md installs them. Dummy
weights of a shipped shape; multi-turn conversations whose working set is 4x the device pool
(printed at the start, in tokens and GiB). About 3 minutes on one H200 with the defaults.
  1. one request at a time (identical batches in every run), on `--check-conversations`
     conversations with `--check-answer-len`-token answers: with the host tier every round
     after the first hits its whole history, and every output (greedy and seeded) equals the
     run with a device pool big enough for everything;
  2. all conversations at once (loads overlap other requests' passes): the page invariant is
     checked after every step and the trace check passes; how many loads joined a pass queued
     after them, and how many passes requests sat out for a load still in flight, is printed;
  3. figures, from runs without checks or tracing, with and without the tier, with `--clients`
     conversations in flight at a time (clients that read an answer before they type the next
     turn: the active set fits the device pool, the whole working set does not): per round the
     history hit rate, TTFT p50 (and the ratio), prefill tokens computed; decode and end-to-end
     generation throughput; load and offload bandwidth (bytes over the copies' time measured
     with CUDA events on the tier's streams) against pinned H2D and D2H copies measured here.
`--write-policy both` runs the checks and the tiered figures under each --host-kv-write-policy
(one table each, against the same run without the tier). Before them, on CUDA, a load of pages
offloaded in the same step must round-trip bit for bit (host_tier.py rule 4). Prints PASS/FAIL
per check and exits 1 if any failed; the issue's GPU goals (hit >= 90% by
round 5, TTFT p50 >= 3x lower, generation throughput not lower, loads >= 70% of the pinned
copy) print as GOAL met/MISSED lines and do not change the exit status.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from minfer import LLM, SamplingParams  # noqa: E402
from minfer.bench.multiturn import run_round  # noqa: E402
from minfer.kvcache.prefix_cache import KVInvariantError  # noqa: E402
from minfer.observability.trace_check import check_file, format_report  # noqa: E402

FAILED: list[str] = []
START = time.perf_counter()
GiB = 1 << 30


def report(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def goal(name: str, ok: bool, detail: str) -> None:
    print(f"GOAL {'met' if ok else 'MISSED'}: {name} ({detail})", flush=True)


@dataclass
class Run:
    outputs: list[list[int]]
    hits: list[int]  # per round: prefix-cache hit tokens
    wholes: list[int]  # per round: tokens of history a round could hit
    ttfts: list[list[float]]  # per round, seconds
    prefill_computed: list[int]  # per round
    decode_tok_s: float  # decode-step tokens over decode-step wall time
    e2e_tok_s: float  # generated tokens over the rounds' wall time
    llm: LLM
    prefill_steps: int = 0
    prefill_seconds: float = 0.0  # their wall time, scheduling to tokens on the CPU

    def hit_rate(self, r: int) -> float:
        return self.hits[r] / max(1, self.wholes[r])

    def ttft_p50(self, r: int) -> float:
        return float(np.percentile(self.ttfts[r], 50))


def converse(
    args,
    params_of,
    conversations,
    pool_tokens,
    host_gb,
    max_running,
    trace=None,
    check=False,
    clients=None,
    profile=False,
    gpu_trace=False,
) -> Run:
    """All rounds of `conversations` conversations; in each round the turns are queued
    `clients` at a time (all at once by default), each group after the previous one finished."""
    llm = LLM(
        args.model,
        load_format="dummy",
        device=args.device,
        dtype=args.dtype,
        page_size=args.page_size,
        max_model_len=args.max_model_len,
        kv_cache_tokens=pool_tokens,
        host_kv_cache_gb=host_gb,
        host_kv_write_policy=args.policy,
        max_running_requests=max_running,
        check_kv_invariants=check,
        trace_requests=trace,
        log_level="warning",
    )
    sched = llm.scheduler
    rng = random.Random(0)
    vocab = min(llm.engine.vocab_size, 20000)
    # Warm-up that shares nothing with the conversations: kernels compile outside the figures.
    run_round(
        sched,
        [[vocab - 1 - i for i in range(64)]],
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
    )
    histories = [[rng.randrange(vocab) for _ in range(args.first_len)] for _ in range(conversations)]
    run = Run([], [], [], [], [], 0.0, 0.0, llm)
    cache, c = sched.kv.prefix_cache.counters, sched.counters
    decode0, generated0, started = (
        (c.decode_batch_total, c.decode_seconds),
        c.generation_tokens,
        time.perf_counter(),
    )
    steps0 = (c.prefill_steps, c.prefill_seconds)
    for r in range(args.rounds):
        profiler = None
        if profile and r == args.rounds - 1 and host_gb:  # where the last round's CPU time goes
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        hit0, computed0 = cache.hit_tokens, c.prefill_tokens_computed
        ps = args.page_size
        run.wholes.append(sum((len(h) - args.turn_len - 1) // ps * ps for h in histories) if r else 0)
        outs, ttfts, step = [], [], clients or conversations
        for i in range(0, conversations, step):
            traced = gpu_trace and host_gb and r == args.rounds - 1 and i == 0
            with gpu_timeline(sched) if traced else contextlib.nullcontext():
                group_outs, group_ttfts = run_round(sched, histories[i : i + step], params_of(r))
            outs += group_outs
            ttfts += group_ttfts
        if profiler is not None:
            import pstats

            profiler.disable()
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(
                r"minfer|synchron|pin_memory|query", 30
            )
        run.hits.append(cache.hit_tokens - hit0)
        run.prefill_computed.append(c.prefill_tokens_computed - computed0)
        run.ttfts.append(ttfts)
        run.outputs += outs
        histories = [
            h + o + [rng.randrange(vocab) for _ in range(args.turn_len)] for h, o in zip(histories, outs)
        ]
    run.prefill_steps, run.prefill_seconds = c.prefill_steps - steps0[0], c.prefill_seconds - steps0[1]
    run.e2e_tok_s = (c.generation_tokens - generated0) / (time.perf_counter() - started)
    run.decode_tok_s = (c.decode_batch_total - decode0[0]) / max(1e-9, c.decode_seconds - decode0[1])
    return run


# Device events the timeline shows one by one (by a part of their name); other kernels are
# counted per scheduler step. The pool's gathers are index_select, its scatters index_copy_.
COPY_KINDS = (("HtoD", "H2D"), ("DtoH", "D2H"), ("indexSelect", "gather"), ("ndex", "scatter"))

# CPU calls the GPU timeline marks (each a row of its "cpu" lane), by object and method name.
ANNOTATED = (
    ("scheduler", "step"),
    ("engine", "forward_batch"),
    ("cache", "match"),
    ("cache", "evict"),
    ("tier", "load"),
    ("tier", "offload"),
)


@contextlib.contextmanager
def gpu_timeline(sched):
    """torch.profiler over one group of requests; prints each CUDA stream's busy segments (copies
    by direction, gathers, scatters, other kernels merged) beside the CPU calls that issued them,
    in ms from the group's first event: which copy or pass a TTFT waits for."""
    owners = {
        "scheduler": sched,
        "engine": sched.engine,
        "cache": sched.kv.prefix_cache,
        "tier": sched.kv.host_tier,
    }
    for owner, name in ANNOTATED:
        fn = getattr(owners[owner], name)

        def marked(*a, _fn=fn, _label=f"{owner}.{name}", **k):
            with torch.profiler.record_function(_label):
                return _fn(*a, **k)

        setattr(owners[owner], name, marked)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    try:
        with torch.profiler.profile(activities=activities) as prof:
            yield
    finally:
        for owner, name in ANNOTATED:
            delattr(owners[owner], name)  # the class's method again
    labels = {f"{o}.{n}" for o, n in ANNOTATED}
    rows, kernels = [], {}
    for e in prof.profiler.kineto_results.events():
        name, cuda = e.name(), "CUDA" in str(e.device_type())
        if name in labels and not cuda:
            rows.append([e.start_ns(), e.end_ns(), "cpu", name, 1])
        elif cuda and name not in labels:
            if "Memcpy" in name and e.duration_ns() < 10_000:
                continue  # the pinned index tensors' uploads
            kind = next((k for key, k in COPY_KINDS if key in name), "kernels")
            rows.append([e.start_ns(), e.end_ns(), f"stream {e.device_resource_id()}", kind, 1])
            total = kernels.setdefault(name[:70], [0, 0])
            total[0], total[1] = total[0] + 1, total[1] + e.duration_ns()
    rows.sort()
    t0 = rows[0][0] if rows else 0
    compute = [r for r in rows if r[3] == "kernels"]
    merged: list[list] = []
    last_of: dict[str, list] = {}
    for row in rows:  # consecutive copies of one kind on one stream, < 50 us apart, are one segment
        if row[3] == "kernels":
            continue
        prev = last_of.get(row[2])
        if row[2] != "cpu" and prev and prev[3] == row[3] and row[0] - prev[1] < 50_000:
            prev[1], prev[4] = max(prev[1], row[1]), prev[4] + 1
            continue
        merged.append(row)
        last_of[row[2]] = row
    for start, end, lane, kind, n in merged[:200]:
        busy = ""
        if kind == "scheduler.step":  # how much of the step the GPU computed: CPU-bound or not
            inside = [k for k in compute if start <= k[0] < end]
            ms = sum(k[1] - k[0] for k in inside) / 1e6
            busy = f"  (compute kernels launched in it: {len(inside)}, {ms:.2f} ms of GPU time)"
        print(f"GPU {(start - t0) / 1e6:8.2f} +{(end - start) / 1e6:6.2f} ms  {lane:10s} {kind} x{n}{busy}")
    for name, (count, ns) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:15]:
        print(f"GPU kernel {ns / 1e6:7.2f} ms x{count:4d}  {name}")


def print_timeline(run: Run, path: str, last: int) -> None:
    """Each of the last `last` requests' events, in ms from its first: where a TTFT goes."""
    from minfer.observability.trace import read_trace

    run.llm.scheduler.tracer.flush()
    by_uid: dict[int, list[dict]] = {}
    for e in read_trace(path):
        by_uid.setdefault(e["uid"], []).append(e)
    for uid in sorted(by_uid)[-last:]:
        events = by_uid[uid]
        t0 = events[0]["ts"]
        steps = [f"{e['event']}@{1000 * (e['ts'] - t0):.1f}" for e in events[:14]]
        print(f"TIMELINE uid {uid}: " + " ".join(steps))


def release(run: Run, cuda: bool) -> None:
    tier = run.llm.scheduler.kv.host_tier
    if tier is not None:
        tier.synchronize()
    run.llm = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def pinned_bandwidth(device: torch.device, to_device: bool, num_bytes: int = 256 << 20) -> float:
    """Bytes/s of one big copy between pinned host memory and the device, timed with events."""
    cuda = device.type == "cuda"
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=cuda)
    dev = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    src, dst = (host, dev) if to_device else (dev, host)
    dst.copy_(src, non_blocking=cuda)  # warm-up
    if not cuda:
        start = time.perf_counter()
        for _ in range(5):
            dst.copy_(src)
        return 5 * num_bytes / (time.perf_counter() - start)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    return 5 * num_bytes / (begin.elapsed_time(end) / 1000)


def check_load_ordering(device: torch.device) -> None:
    """A load waits for the offload that wrote its host pages, and only for that one
    (kvcache/host_tier.py rule 4), on a Llama-8B-shaped pool: pages offloaded and loaded back
    in the same step round-trip bit for bit, and a load of pages offloaded long ago does not
    queue behind a big eviction's D2H still in flight."""
    from minfer.kvcache.host_pool import HostKVPool
    from minfer.kvcache.host_tier import HostTier
    from minfer.kvcache.pool import KVPool

    ps = 16
    pool = KVPool(32, 64 * ps, 8, 128, ps, torch.bfloat16, device)  # 64 pages of 2 MiB
    tier = HostTier(pool, HostKVPool(pool, 256 * ps, ps, pin=True))

    def slots(pages):
        return [p * ps + i for p in pages for i in range(ps)]

    def raw(pages):
        return [t.view(torch.uint8)[slots(pages)].clone() for t in (*pool.k, *pool.v)]

    for t in (*pool.k, *pool.v):
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))
    old, fresh, big = list(range(0, 4)), list(range(4, 8)), list(range(28, 64))  # loads land in 20-27
    want_old, want_fresh = raw(old), raw(fresh)
    tier.offload(slots(old), slots(range(0, 4)))
    tier.synchronize()  # "long ago": finished
    tier.offload(slots(fresh), slots(range(10, 14)))
    # The same step: load the pages just offloaded (must wait for that D2H) into other pages.
    fresh_load = tier.load(slots(range(10, 14)), slots(range(20, 24)))
    # A big eviction: 144 MiB of D2H (within two staging buffers, so no gather waits for a D2H,
    # rule 3), ~2.6 ms at 55 GB/s, while a load of old pages (8 MiB) is issued behind it.
    for _ in range(2):
        tier.offload(slots(big), slots(range(100, 136)))
    old_load = tier.load(slots(range(0, 4)), slots(range(24, 28)))
    old_load.end.synchronize()
    overlapped = not tier._offloads_in_flight[-1][2].query() if tier._offloads_in_flight else False
    tier.synchronize()
    torch.cuda.synchronize()
    report(
        "a load of pages offloaded in the same step round-trips bit for bit",
        fresh_load is not None and all(torch.equal(a, b) for a, b in zip(raw(range(20, 24)), want_fresh)),
    )
    report(
        "a load of pages offloaded long ago round-trips bit for bit",
        all(torch.equal(a, b) for a, b in zip(raw(range(24, 28)), want_old)),
    )
    print(
        f"FIGURE a load of long-offloaded pages finished while a later eviction's D2H was still "
        f"running: {'yes' if overlapped else 'no'} (yes: it did not wait for that D2H)"
    )


def kv_bytes_per_token(model: str, dtype: str) -> int:
    """K and V bytes of one token in every layer, from a shipped shape's config (for the sizes)."""
    import json

    from minfer.models.loader import SHIPPED_CONFIGS

    with open(SHIPPED_CONFIGS / model / "config.json") as f:
        cfg = json.load(f)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * itemsize


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument(
        "--dtype", default="float32", help="float32 keeps batched kernels' numerics out of the comparison"
    )
    p.add_argument("--conversations", type=int, default=10)
    p.add_argument("--figures-only", action="store_true", help="skip the checks (1 and 2)")
    p.add_argument("--profile", action="store_true", help="cProfile the tiered run's last round")
    p.add_argument(
        "--timeline", action="store_true", help="trace the tiered figures run; print round 5's events"
    )
    p.add_argument(
        "--gpu-timeline", action="store_true", help="torch.profiler over round 5's first group (tiered)"
    )
    p.add_argument("--clients", type=int, default=2, help="conversations in flight at a time in the figures")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--first-len", type=int, default=1024)
    p.add_argument("--turn-len", type=int, default=256)
    p.add_argument("--answer-len", type=int, default=64)
    p.add_argument("--check-conversations", type=int, default=4, help="conversations of check 1")
    p.add_argument("--check-answer-len", type=int, default=16, help="answer tokens of check 1")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--host-gb", type=float, default=8.0)
    p.add_argument("--device", default="cuda", help="cpu: a dry run of this script's logic only")
    p.add_argument(
        "--write-policy",
        default="write_back",
        choices=("write_back", "write_through", "both"),
        help="--host-kv-write-policy of the tiered runs; both: the checks and figures under each",
    )
    args = p.parse_args()
    policies = ["write_back", "write_through"] if args.write_policy == "both" else [args.write_policy]
    args.policy = policies[0]
    cuda = args.device == "cuda"
    assert not cuda or torch.cuda.is_available(), "this check needs CUDA"
    history = args.first_len + (args.rounds - 1) * args.turn_len + args.rounds * args.answer_len
    working = args.conversations * history
    small = max(working // 4, history + 2 * args.answer_len) // args.page_size * args.page_size
    per_token = kv_bytes_per_token(args.model, args.dtype)
    print(
        f"{args.model} {args.dtype}: {args.conversations} conversations x {args.rounds} rounds (first turn "
        f"{args.first_len}, turns {args.turn_len}, answers {args.answer_len} tokens); working set {working} "
        f"tokens = {working * per_token / GiB:.2f} GiB of KV, device pool {small} tokens = "
        f"{small * per_token / GiB:.2f} GiB ({working / small:.1f}x); host tier {args.host_gb} GiB"
    )
    if working * per_token > args.host_gb * GiB:
        print(f"WARNING: the working set is larger than --host-gb {args.host_gb}: the host tier drops some")

    def greedy(answer_len):
        return lambda r: SamplingParams(temperature=0, max_tokens=answer_len, ignore_eos=True)

    def seeded(answer_len):
        return lambda r: SamplingParams(
            temperature=0.8, top_p=0.95, seed=r, max_tokens=answer_len, ignore_eos=True
        )

    if not args.figures_only:  # 1 and 2: the checks
        if cuda:
            check_load_ordering(torch.device(args.device))
        for policy in policies:
            args.policy = policy
            print(f"== checks, --host-kv-write-policy {policy}", flush=True)
            # 1. one request at a time: identical batches, so outputs must be bit-identical.
            n_check = args.check_conversations
            for name, params_of in (
                ("greedy", greedy(args.check_answer_len)),
                ("seeded", seeded(args.check_answer_len)),
            ):
                want = converse(args, params_of, n_check, 2 * working, 0.0, 1)
                release(want, cuda)
                got = converse(args, params_of, n_check, small, args.host_gb, 1)
                report(
                    f"outputs equal the unconstrained pool ({name})",
                    got.outputs == want.outputs,
                    f"{sum(a == b for a, b in zip(got.outputs, want.outputs))}/{len(want.outputs)}",
                )
                short = [
                    (r, got.hits[r], got.wholes[r])
                    for r in range(1, args.rounds)
                    if got.hits[r] != got.wholes[r]
                ]
                report(
                    f"rounds >= 2 hit their whole history ({name})", not short, f"short rounds: {short[:3]}"
                )
                c = got.llm.scheduler.kv.host_tier.counters
                report(
                    f"the host tier was used ({name})",
                    c.hits > 0 and c.bytes_offloaded > 0,
                    f"{c.hits} loads",
                )
                if cuda:
                    report(f"pinned host pool ({name})", got.llm.engine.host_kv_pool.data.is_pinned())
                release(got, cuda)

            # 2. concurrent conversations: loads in flight while other requests run; every check on.
            trace = os.path.join(tempfile.mkdtemp(), "trace.jsonl")
            try:
                checked = converse(
                    args,
                    greedy(args.answer_len),
                    args.conversations,
                    small,
                    args.host_gb,
                    args.conversations,
                    trace,
                    True,
                )
            except KVInvariantError as e:
                report("page invariant after every step (concurrent)", False, str(e))
                return 1
            c = checked.llm.scheduler.kv.host_tier.counters
            report(
                "page invariant after every step (concurrent)",
                True,
                f"{c.hits} loads, {c.loads_joined} joined a pass, {c.load_waits} passes sat out",
            )
            if cuda:  # the waiting logic itself is tested on CPU (tests/deferred_load_tier.py)
                print(
                    f"FIGURE {c.hits} loads: {c.loads_joined} joined a pass queued after them on the GPU; "
                    f"requests sat out {c.load_waits} passes for a load in flight"
                )
            checked.llm.scheduler.tracer.flush()
            rep = check_file(trace)
            report(
                "minfer trace check (loaded prefixes are the offloaded ones)",
                rep.ok,
                format_report(rep).splitlines()[-1],
            )
            release(checked, cuda)

    # 3. figures: the same workload with and without the tier, no checks or tracing.
    plain = converse(
        args, greedy(args.answer_len), args.conversations, small, 0.0, args.clients, clients=args.clients
    )
    release(plain, cuda)
    for policy in policies:
        args.policy = policy
        print(f"== figures, --host-kv-write-policy {policy}", flush=True)
        timeline = os.path.join(tempfile.mkdtemp(), "timeline.jsonl") if args.timeline else None
        tiered = converse(
            args,
            greedy(args.answer_len),
            args.conversations,
            small,
            args.host_gb,
            args.clients,
            timeline,
            clients=args.clients,
            profile=args.profile,
            gpu_trace=args.gpu_timeline,
        )
        if timeline:
            print_timeline(tiered, timeline, 2 * args.clients)
        tier = tiered.llm.scheduler.kv.host_tier
        tier.synchronize()
        c = tier.counters
        release(tiered, cuda)
        device = torch.device(args.device)
        h2d, d2h = pinned_bandwidth(device, True), pinned_bandwidth(device, False)
        load_bw = c.bytes_loaded / max(c.load_seconds_sum, 1e-9)
        offload_bw = c.offload_bytes_timed / max(c.offload_seconds_sum, 1e-9)
        print("round  hit% tier  hit% plain  ttft_p50_ms tier  plain  ratio  prefill_computed tier  plain")
        for r in range(args.rounds):
            ratio = plain.ttft_p50(r) / max(1e-9, tiered.ttft_p50(r))
            print(
                f"{r + 1:5d}  {100 * tiered.hit_rate(r):9.1f}  {100 * plain.hit_rate(r):10.1f}  "
                f"{1000 * tiered.ttft_p50(r):16.1f}  {1000 * plain.ttft_p50(r):5.1f}  {ratio:5.1f}  "
                f"{tiered.prefill_computed[r]:21d}  {plain.prefill_computed[r]:5d}"
            )
        print(
            f"FIGURE round {args.rounds} TTFTs, ms, in arrival order: tier "
            f"{[round(1000 * t, 1) for t in tiered.ttfts[-1]]}, plain {[round(1000 * t, 1) for t in plain.ttfts[-1]]}"
        )
        print(
            f"FIGURE prefill steps: {tiered.prefill_steps} at {1000 * tiered.prefill_seconds / max(1, tiered.prefill_steps):.1f} ms "
            f"with the tier, {plain.prefill_steps} at {1000 * plain.prefill_seconds / max(1, plain.prefill_steps):.1f} ms without"
        )
        print(
            f"FIGURE generation throughput: decode {tiered.decode_tok_s:.0f} tok/s with the tier vs "
            f"{plain.decode_tok_s:.0f} without; end to end {tiered.e2e_tok_s:.0f} vs {plain.e2e_tok_s:.0f} tok/s"
        )
        print(
            f"FIGURE loads {c.bytes_loaded / GiB:.2f} GiB in {c.loads} loads at {load_bw / 1e9:.1f} GB/s vs pinned "
            f"H2D {h2d / 1e9:.1f} GB/s ({100 * load_bw / h2d:.0f}%); offloads {c.offload_bytes_timed / GiB:.2f} GiB "
            f"in {c.offload_copies} copies at {offload_bw / 1e9:.1f} GB/s vs pinned D2H {d2h / 1e9:.1f} GB/s "
            f"({100 * offload_bw / d2h:.0f}%); {c.tokens_written_through} tokens written through on a hit"
        )
        last = args.rounds - 1
        goal(
            f"hit rate >= 90% by round {last + 1}",
            tiered.hit_rate(last) >= 0.9,
            f"{100 * tiered.hit_rate(last):.0f}% with the tier, {100 * plain.hit_rate(last):.0f}% without",
        )
        ratio = plain.ttft_p50(last) / max(1e-9, tiered.ttft_p50(last))
        goal("TTFT p50 >= 3x lower with the tier", ratio >= 3, f"round {last + 1}: {ratio:.1f}x")
        goal(
            "generation throughput not lower",
            tiered.decode_tok_s >= 0.97 * plain.decode_tok_s,
            f"decode {tiered.decode_tok_s:.0f} vs {plain.decode_tok_s:.0f} tok/s, 3% noise allowed",
        )
        goal("loads >= 70% of the pinned H2D copy", load_bw >= 0.7 * h2d, f"{100 * load_bw / h2d:.0f}%")
    print(
        f"{'FAIL' if FAILED else 'PASS'}: {len(FAILED)} check(s) failed {FAILED} ({time.perf_counter() - START:.0f} s)"
    )
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())

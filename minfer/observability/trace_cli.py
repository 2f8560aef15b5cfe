"""`minfer trace check | show | plot FILE`: read a request trace written with --trace-requests."""

from __future__ import annotations

import argparse
import sys


def add_trace_parser(sub) -> None:
    trace = sub.add_parser("trace", help="check, show or plot a request trace (--trace-requests FILE)")
    trace_sub = trace.add_subparsers(dest="trace_command", required=True)
    check = trace_sub.add_parser(
        "check", help="verify every request's events against the KV/state invariants"
    )
    check.add_argument("file")
    check.add_argument("--errors", type=int, default=3, help="errors shown per failed request")
    show = trace_sub.add_parser(
        "show", help="per-request timeline: queue, prefill chunks, TTFT, decode, gaps"
    )
    show.add_argument("file")
    show.add_argument("--uid", type=int, default=None, help="every event of this request")
    show.add_argument(
        "--run",
        type=int,
        default=None,
        help="runs appended to one file are shown apart (uids restart in each); only run N (1 = first)",
    )
    plot = trace_sub.add_parser("plot", help="Gantt of requests with KV slots held and batch size beneath")
    plot.add_argument("file")
    plot.add_argument(
        "-o", "--output", required=True, help="out.html (self-contained) or out.png (matplotlib)"
    )
    plot.add_argument("--kv-pool-tokens", type=int, default=None, help="draw the KV pool size as a line")


def run_trace(args: argparse.Namespace) -> int:
    from minfer.observability.trace import read_trace

    try:
        events = read_trace(args.file)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.trace_command == "check":
        from minfer.observability.trace_check import check_events, format_report

        report = check_events(events)
        if not report.requests:
            print(f"FAIL: no request events in {args.file}")
            return 1
        print(format_report(report, args.errors))
        return 0 if report.ok else 1
    if args.trace_command == "show":
        from minfer.observability.timeline import build_timeline, format_request, format_summary
        from minfer.observability.trace_runs import split_runs

        runs = split_runs(events)
        chosen = range(1, len(runs) + 1) if args.run is None else [args.run]
        if args.run is not None and not 1 <= args.run <= len(runs):
            print(f"error: --run {args.run}: {args.file} holds {len(runs)} run(s)", file=sys.stderr)
            return 2
        found = False
        for number in chosen:
            timeline = build_timeline(runs[number - 1])
            if args.uid is not None and args.uid not in timeline.requests:
                continue
            if len(runs) > 1:
                requests = sum(r.queued is not None for r in timeline.requests.values())
                print(f"== run {number} of {len(runs)} ({requests} requests)")
            print(format_summary(timeline) if args.uid is None else format_request(timeline, args.uid))
            found = True
        if not found:
            print(f"error: no request with uid {args.uid} in {args.file}", file=sys.stderr)
            return 2
        return 0
    if args.trace_command == "plot":
        from minfer.observability.trace_plot import plot_trace

        try:
            plot_trace(events, args.output, args.kv_pool_tokens)
        except (ValueError, RuntimeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"wrote {args.output}")
        return 0
    return 2

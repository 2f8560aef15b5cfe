"""A server's scheduler counters over one benchmark run: steps, mean batch, seconds in steps, bands.

`bench serve` times the client's view; this says what the scheduler did meanwhile, to set beside
`bench offline` (same workload): if the steps are as fast as offline, the difference is outside
them (requests arriving late, streaming). Snapshot `/v1/server_info` before and after:

    python3 scripts/serve_step_counters.py snapshot http://127.0.0.1:8123 /tmp/before.json
    minfer bench serve --base-url http://127.0.0.1:8123 --workload nano-vllm --request-rate inf
    python3 scripts/serve_step_counters.py snapshot http://127.0.0.1:8123 /tmp/after.json
    python3 scripts/serve_step_counters.py diff /tmp/before.json /tmp/after.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx


def snapshot(base_url: str, path: str) -> None:
    info = httpx.get(base_url.rstrip("/") + "/v1/server_info", timeout=30).json()
    Path(path).write_text(json.dumps(info["counters"]))


def diff(before_path: str, after_path: str) -> str:
    a, b = (json.loads(Path(p).read_text()) for p in (before_path, after_path))
    d = {k: b[k] - a[k] for k in a if isinstance(a[k], (int, float))}
    lines = [
        f"prefill: {d['prefill_steps']} steps, {d['prefill_seconds']:.2f} s, "
        f"{d['prefill_tokens_computed']} tokens computed",
        f"decode: {d['decode_steps']} steps, {d['decode_seconds']:.2f} s, mean batch "
        f"{d['decode_batch_total'] / max(1, d['decode_steps']):.1f}; {d['generation_tokens']} tokens, "
        f"{d['preemptions']} preemptions",
    ]
    bands = []
    for band, (steps, seconds) in sorted(b["decode_by_batch"].items(), key=lambda kv: int(kv[0])):
        steps0, seconds0 = a["decode_by_batch"].get(band, [0, 0.0])
        if steps > steps0:
            bands.append(f"{band}: {(seconds - seconds0) / (steps - steps0) * 1e3:.2f} ({steps - steps0})")
    lines.append("decode ms per step by batch band (lowest size of the band): " + ", ".join(bands))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("snapshot", help="save the counters of a running server")
    s.add_argument("base_url")
    s.add_argument("path")
    d = sub.add_parser("diff", help="what happened between two snapshots")
    d.add_argument("before")
    d.add_argument("after")
    args = ap.parse_args()
    if args.command == "snapshot":
        snapshot(args.base_url, args.path)
    else:
        print(diff(args.before, args.after))


if __name__ == "__main__":
    main()

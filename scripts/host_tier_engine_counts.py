"""Counts of the host tier's bookkeeping on a real engine run (CPU): tests/kvcache/
test_host_tier.py's multi-turn conversations (6 x 4 rounds, tiny qwen2, device pool of ~25% of
the working set) with `--max-running` requests at once. Prints admission attempts and how many
failed, prefix matches, device evictions, offload transfers and the nodes they wrote back,
loads: what each admission costs in calls, which on CUDA are kernel launches.

    PYTHONPATH=$PWD python3 scripts/host_tier_engine_counts.py [--max-running 2] [--write-policy write_back]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "kvcache")]

import test_host_tier as workload  # noqa: E402
import torch  # noqa: E402
from tiny_models import save_tiny_model  # noqa: E402

from minfer.kvcache.host_tier import HostTier  # noqa: E402
from minfer.kvcache.manager import KVManager  # noqa: E402
from minfer.kvcache.tiered_radix import TieredRadixCache  # noqa: E402

calls: collections.Counter = collections.Counter()


def count(cls, name: str, key: str | None = None, failed=None) -> None:
    original = getattr(cls, name)

    def counted(self, *args, **kwargs):
        calls[key or name] += 1
        if name == "_drop_device_copy":
            calls["nodes written back"] += bool(args[0].slots and not args[0].host_slots)
        result = original(self, *args, **kwargs)
        if failed is not None and failed(result):
            calls[f"{key or name} failed"] += 1
        return result

    setattr(cls, name, counted)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-running", type=int, default=2)
    p.add_argument("--write-policy", default="write_back", choices=("write_back", "write_through"))
    args = p.parse_args()
    torch.set_num_threads(1)
    count(KVManager, "try_admit", "admission attempts", failed=lambda r: r is None)
    count(TieredRadixCache, "match", "prefix matches")
    count(TieredRadixCache, "evict", "device evictions")
    count(TieredRadixCache, "_drop_device_copy", "device copies dropped")
    count(HostTier, "offload", "offload transfers")
    path = tempfile.mkdtemp()
    save_tiny_model("qwen2", path)
    _, _, llm = workload.converse(
        path,
        workload.greedy,
        kv_cache_tokens=workload.POOL_TOKENS,
        max_running_requests=args.max_running,
        host_kv_cache_gb=0.01,
        host_kv_write_policy=args.write_policy,
    )
    c = llm.scheduler.kv.host_tier.counters
    requests = workload.CONVERSATIONS * workload.ROUNDS
    print(
        f"{requests} requests, --max-running {args.max_running}, --host-kv-write-policy {args.write_policy}"
    )
    for key, value in calls.items():
        print(f"  {key}: {value}")
    print(
        f"  loads: {c.hits}; tokens offloaded {c.tokens_offloaded}, written through {c.tokens_written_through}"
    )


if __name__ == "__main__":
    main()

"""GPU check of the whole engine, in one call: Triton path vs torch path (greedy tokens) on the
parity models, then the offline benchmark for the shipped shapes. Prints a table at the end.

    PYTHONPATH=$PWD:$PWD/tests python3 scripts/gpu_engine.py [--skip-parity] [--bench qwen3-0.6b,llama-3.1-8b]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parity(rows: list[str]) -> None:
    import torch

    from minfer import LLM, SamplingParams
    from tiny_models import ARCHS, save_tiny_model

    prompts = [[(i * 7 + j * 13) % 250 for j in range(n)] for i, n in enumerate([5, 70, 17, 1, 33, 300, 2, 129])]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for arch in ARCHS:
        path = tempfile.mkdtemp()
        save_tiny_model(arch, path)
        for dtype in ("float32", "bfloat16"):
            outs = {}
            for backend, graphs in (("torch", 0), ("triton", 0), ("triton", 64)):
                llm = LLM(path, device="cuda", dtype=dtype, attention_backend=backend, cuda_graph_max_bs=graphs,
                          kv_cache_tokens=8192, chunked_prefill_size=64, page_size=16 if arch == "llama" else 1)
                outs[(backend, graphs)] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
                del llm
                torch.cuda.empty_cache()
            ref = outs[("torch", 0)]
            for key, got in outs.items():
                same = sum(a == b for a, b in zip(ref, got))
                rows.append(f"parity {arch:8s} {dtype:9s} {key[0]:6s} graphs={key[1]:<3d} {same}/{len(ref)} "
                            f"sequences equal to torch")


def bench(model: str, rows: list[str], extra: list[str]) -> None:
    cmd = [sys.executable, "-m", "minfer", "bench", "offline", model, *extra]
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=ROOT)
    print(proc.stdout[-3000:], proc.stderr[-3000:], flush=True)
    lines = [l for l in proc.stdout.splitlines() if l.startswith(("throughput", "prefill", "floor"))]
    rows.append(f"bench {model} {' '.join(extra)} ({time.time() - start:.0f} s incl. load): " + " | ".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--bench", default="qwen3-0.6b,llama-3.1-8b")
    ap.add_argument("--bench-args", default="")
    args = ap.parse_args()
    rows: list[str] = []
    if not args.skip_parity:
        parity(rows)
    for model in filter(None, args.bench.split(",")):
        bench(model, rows, args.bench_args.split())
    print("\n==== summary ====")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

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
    from tiny_models import ARCHS, MOE_ARCHS, save_tiny_model

    from minfer import LLM, SamplingParams

    prompts = [
        [(i * 7 + j * 13) % 250 for j in range(n)] for i, n in enumerate([5, 70, 17, 1, 33, 300, 2, 129])
    ]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for arch in ARCHS + MOE_ARCHS:  # MoE: the fused Triton experts, in and out of CUDA graphs
        path = tempfile.mkdtemp()
        save_tiny_model(arch, path)
        for dtype in ("float32", "bfloat16"):
            outs = {}
            for backend, graphs in (("torch", 0), ("triton", 0), ("triton", 64)):
                llm = LLM(
                    path,
                    device="cuda",
                    dtype=dtype,
                    attention_backend=backend,
                    cuda_graph_max_bs=graphs,
                    kv_cache_tokens=8192,
                    chunked_prefill_size=64,
                    page_size=16 if arch == "llama" else 1,
                )
                outs[(backend, graphs)] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
                del llm
                torch.cuda.empty_cache()
            ref = outs[("torch", 0)]
            for key, got in outs.items():
                same = sum(a == b for a, b in zip(ref, got))
                rows.append(
                    f"parity {arch:8s} {dtype:9s} {key[0]:6s} graphs={key[1]:<3d} {same}/{len(ref)} "
                    f"sequences equal to torch"
                )


def bench(model: str, rows: list[str], extra: list[str], kind: str = "offline") -> None:
    cmd = [sys.executable, "-m", "minfer", "bench", kind, model, *extra]
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=ROOT)
    print(proc.stdout[-3000:], proc.stderr[-3000:], flush=True)
    lines = [l for l in proc.stdout.splitlines() if l.startswith(("throughput", "prefill", "floor", "wall"))]
    rows.append(
        f"bench {model} {' '.join(extra)} ({time.time() - start:.0f} s incl. load): " + " | ".join(lines)
    )


def profile(model: str, rows: list[str], decode_batches: list[int]) -> None:
    """Where a step's time goes: torch.profiler over prefill steps, then over steady decode
    steps at each batch size of `decode_batches` (the workload's first N requests)."""
    import gc

    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from minfer import LLM
    from minfer.bench.offline import make_workload

    llm = LLM(model, load_format="dummy")
    prompts, params = make_workload()
    sched = llm.scheduler
    for running in decode_batches:
        for p, sp in zip(prompts[:running], params[:running]):
            sched.add_request([t % llm.engine.vocab_size for t in p], sp)
        phases = (("prefill", 3), ("decode", 30)) if running == decode_batches[0] else (("decode", 30),)
        for phase, steps in phases:
            while phase == "decode" and (sched.waiting or sched.prefilling):
                sched.step()
            for _ in range(5):
                sched.step()
            torch.cuda.synchronize()
            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                t0 = time.perf_counter()
                for _ in range(steps):
                    sched.step()
                torch.cuda.synchronize()
                per_step = (time.perf_counter() - t0) / steps
            # kernels and copies only: an aten op's device time repeats that of its kernels
            gpu_ms = (
                sum(
                    e.self_device_time_total
                    for e in prof.key_averages()
                    if e.device_type == torch.autograd.DeviceType.CUDA
                )
                / steps
                / 1e3
            )
            print(
                f"==== {phase}: {per_step * 1e3:.2f} ms/step wall, {gpu_ms:.2f} ms/step of GPU kernels, "
                f"running {len(sched.running)}"
            )
            print(
                prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60)
            )
            rows.append(
                f"profile {model} {phase}: {per_step * 1e3:.2f} ms/step wall, {gpu_ms:.2f} ms/step GPU "
                f"(running {len(sched.running)})"
            )
        for uid in list(sched.by_uid):
            sched.abort(uid)
        while sched.has_work:
            sched.step()
    del llm, sched
    gc.collect()
    torch.cuda.empty_cache()  # the benchmarks run in child processes and need the memory


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--bench", default="qwen3-0.6b,llama-3.1-8b")
    ap.add_argument("--bench-args", default="")
    ap.add_argument("--profile", default="", help="model to profile (e.g. qwen3-0.6b)")
    ap.add_argument("--profile-batches", default="256,48,16", help="decode batch sizes to profile")
    ap.add_argument("--shared-prefix", default="", help="model for the shared-prefix bench, radix vs naive")
    args = ap.parse_args()
    rows: list[str] = []
    if not args.skip_parity:
        parity(rows)
    if args.profile:
        profile(args.profile, rows, [int(b) for b in args.profile_batches.split(",")])
    for model in filter(None, args.bench.split(",")):
        bench(model, rows, args.bench_args.split())
    if args.shared_prefix:
        for cache in ("radix", "naive"):
            bench(args.shared_prefix, rows, ["--cache", cache], kind="shared-prefix")
    print("\n==== summary ====")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

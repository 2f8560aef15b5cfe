"""Tensor parallelism on a two-GPU host, in one call (not collected by pytest):

    PYTHONPATH=$PWD:$PWD/tests python3 tests/distributed/gpu_tp_check.py allreduce
    PYTHONPATH=$PWD:$PWD/tests python3 tests/distributed/gpu_tp_check.py peer-one-gpu
    PYTHONPATH=$PWD:$PWD/tests python3 tests/distributed/gpu_tp_check.py parity
    PYTHONPATH=$PWD:$PWD/tests python3 tests/distributed/gpu_tp_check.py bench-profile llama-3.1-8b

allreduce      NCCL all-reduce of one decode step's activations ([B, hidden] bf16, 2 per layer
               + 1 for the embedding), eager and inside a CUDA graph, and the same over peer
               memory (distributed/peer_all_reduce.py: its result against NCCL's, and its time
               against the NVLink floor); bus bandwidth of large all-reduces; all-gather of the
               logits vs of sampled tokens.
peer-one-gpu   the peer path's torch ops on a group of one GPU (needs one GPU only).
parity         tiny models of every architecture: tp=2 (NCCL, Triton, CUDA graphs) generates the
               tokens of tp=1 on the same GPU; every step's tokens are also checked across ranks
               (the CRC check of runner/step_sync.py).
bench-profile  `minfer bench offline MODEL --tp 2` in this process, then torch.profiler over
               steady decode steps: time in NCCL kernels per step on rank 0.
Run parity and bench-profile with MINFER_TP_ALL_REDUCE=peer for the engine on the peer path.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

HIDDEN, VOCAB, LAYERS = 4096, 128256, 32  # Llama-3.1-8B
ALLREDUCES_PER_STEP = 2 * LAYERS + 1  # o_proj and down_proj per layer, and the vocab-parallel embedding
NVLINK_BYTES_PER_S = 478e9  # 18 links x 26.56 GB/s per direction (nvidia-smi nvlink -s)


def _timed(fn, iters: int) -> float:
    """Median seconds of `fn` over `iters` runs, by CUDA events."""
    import torch

    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _allreduce_worker(rank: int, port: int, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from minfer.distributed.peer_all_reduce import PeerAllReduce, disable_nvlink_multicast

    disable_nvlink_multicast()
    torch.manual_seed(rank)  # each rank its own partials
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        device_id=torch.device("cuda", rank),
    )
    results = {"decode_step": [], "bus_bandwidth": [], "gather": []}
    bf16 = torch.bfloat16
    peer = None
    try:
        peer = PeerAllReduce(dist.group.WORLD, torch.device("cuda", rank))
    except Exception as e:  # noqa: BLE001 - report, keep measuring NCCL
        results["errors"] = [f"peer all-reduce unavailable: {type(e).__name__}: {e}"]

    def nccl(x):
        dist.all_reduce(x)
        return x

    for batch in (1, 8, 64, 256):
        x = torch.randn(batch, HIDDEN, dtype=bf16, device="cuda")
        row = {"batch": batch, "bytes_per_allreduce": x.numel() * x.element_size()}
        # the NVLink floor of one all-reduce: each GPU receives the other's bytes (docs/TP.md)
        row["nvlink_floor_us"] = row["bytes_per_allreduce"] / NVLINK_BYTES_PER_S * 1e6
        if peer is not None:
            row["peer_equals_nccl"] = bool(torch.equal(peer(x.clone()), nccl(x.clone())))
        for name, reduce in (("nccl", nccl), ("peer", peer)):
            if reduce is None:
                continue
            for _ in range(5):
                reduce(x)
            torch.cuda.synchronize()

            def step(x=x, reduce=reduce):
                for _ in range(ALLREDUCES_PER_STEP):
                    reduce(x)

            row[f"{name}_eager_ms_per_step"] = _timed(step, 20) * 1e3
            try:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    step()
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
                graph_s = _timed(graph.replay, 20)
                row[f"{name}_graph_ms_per_step"] = graph_s * 1e3
                row[f"{name}_us_per_allreduce_graph"] = graph_s / ALLREDUCES_PER_STEP * 1e6
            except Exception as e:  # noqa: BLE001 - report, keep measuring
                results.setdefault("errors", []).append(f"{name} graph capture B={batch}: {e}")
        results["decode_step"].append(row)
    for mib in (1, 16, 256, 1024):
        x = torch.empty(mib << 19, dtype=bf16, device="cuda").normal_()
        dist.all_reduce(x)
        t = _timed(lambda x=x: dist.all_reduce(x), 10)
        nbytes = x.numel() * 2
        # nccl-tests' bus bandwidth: algbw * 2 (n - 1) / n; for n = 2 that is bytes / time, what each
        # GPU sends (and receives) over its links, comparable to the per-direction NVLink figure.
        results["bus_bandwidth"].append({"MiB": mib, "ms": t * 1e3, "busbw_GBps": nbytes / t / 1e9})
    for batch in (1, 64, 256):
        logits = torch.randn(batch, VOCAB // 2, dtype=bf16, device="cuda")
        gathered = torch.empty(2 * batch, VOCAB // 2, dtype=bf16, device="cuda")
        tokens = torch.zeros(batch, 2, dtype=torch.int64, device="cuda")  # (token, value bits) per row
        gathered_tokens = torch.empty(2 * batch, 2, dtype=torch.int64, device="cuda")
        t_logits = _timed(lambda out=gathered, x=logits: dist.all_gather_into_tensor(out, x), 20)
        t_tokens = _timed(lambda out=gathered_tokens, x=tokens: dist.all_gather_into_tensor(out, x), 20)
        results["gather"].append(
            {
                "batch": batch,
                "logits_MiB": logits.numel() * 2 / 2**20,
                "logits_us": t_logits * 1e6,
                "sampled_tokens_us": t_tokens * 1e6,
            }
        )
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    # Not destroy_process_group: this run did not finish on the H200 host when it did (see leave_tp_group).
    dist.distributed_c10d._abort_process_group()


def peer_one_gpu() -> None:
    """The peer path's torch ops on a group of one GPU (the sum is the input itself), eagerly
    and replayed from a CUDA graph: what one GPU can check before two are lent."""
    import torch
    import torch.distributed as dist

    from minfer.distributed.peer_all_reduce import PeerAllReduce, disable_nvlink_multicast
    from minfer.runner.ranks import free_local_addr

    disable_nvlink_multicast()
    dist.init_process_group("nccl", init_method=f"tcp://{free_local_addr()}", rank=0, world_size=1)
    peer = PeerAllReduce(dist.group.WORLD, torch.device("cuda", 0))
    print("copy-in op:", peer._copy_in is not None)
    for dtype in (torch.bfloat16, torch.float32):
        for rows in (1, 64, 256):
            x = torch.randn(rows, HIDDEN, dtype=dtype, device="cuda")
            assert peer.suits(x)
            eager = peer(x)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = peer(x)
            x.mul_(2)
            graph.replay()
            torch.cuda.synchronize()
            ok = torch.equal(eager, x / 2) and torch.equal(captured, x)
            print(f"{dtype} rows={rows}: {'PASS' if ok else 'FAIL'}", flush=True)
    dist.distributed_c10d._abort_process_group()


def allreduce(out_dir: str) -> None:
    import torch.multiprocessing as mp

    from minfer.runner.ranks import free_local_addr

    port = int(free_local_addr().rsplit(":", 1)[1])
    path = os.path.join(out_dir, "allreduce.json")
    mp.spawn(_allreduce_worker, args=(port, path), nprocs=2, join=True)
    with open(path) as f:
        res = json.load(f)
    print(json.dumps(res, indent=1))


@contextlib.contextmanager
def watchdog(stage: str, limit_s: float):
    """Say when `stage` starts; if it runs past `limit_s`, print where every thread of this
    process and of its child ranks is (faulthandler on SIGABRT, enabled through
    PYTHONFAULTHANDLER in the environment the ranks inherit) and exit."""
    import faulthandler
    import signal
    import subprocess
    import threading

    print(f"[{time.strftime('%H:%M:%S')}] {stage}", flush=True)
    done = threading.Event()

    def expire():
        if done.wait(limit_s):
            return
        print(f"==== {stage}: still running after {limit_s:.0f} s; stacks follow", flush=True)
        faulthandler.dump_traceback(all_threads=True)
        children = subprocess.run(
            ["pgrep", "-P", str(os.getpid())], capture_output=True, text=True
        ).stdout.split()
        for pid in children:
            os.kill(int(pid), signal.SIGABRT)
        time.sleep(3)
        os._exit(3)

    threading.Thread(target=expire, daemon=True).start()
    try:
        yield
    finally:
        done.set()


def _generate_both(path, prompts, params, device, dtype, tp, graphs, rows):
    """Tokens of every prompt under each SamplingParams, from a fresh LLM; also the number of
    steps (token-checked across ranks when tp > 1) and whether graphs could stay on."""
    import torch

    from minfer import LLM

    options = {
        "device": device,
        "dtype": dtype,
        "tp": tp,
        "kv_cache_tokens": 8192,
        "chunked_prefill_size": 64,
        "log_level": "warning",
    }
    try:
        llm = LLM(path, cuda_graph_max_bs=graphs, **options)
    except Exception as e:  # noqa: BLE001 - say so, and go on without graphs
        rows.append(f"tp={tp} with CUDA graphs failed: {type(e).__name__}: {e}; graphs off from here")
        print(rows[-1], flush=True)
        graphs = 0
        llm = LLM(path, cuda_graph_max_bs=graphs, **options)
    tokens = [o.token_ids for p in params for o in llm.generate(prompts, p, use_tqdm=False)]
    steps = llm.runner.tp_leader.steps
    llm.shutdown()
    del llm
    if device == "cuda":
        torch.cuda.empty_cache()
    return tokens, steps, graphs


def parity(out_dir: str, device: str) -> None:
    os.environ["PYTHONFAULTHANDLER"] = "1"  # follower ranks print their stacks on SIGABRT
    os.makedirs(out_dir, exist_ok=True)
    from tiny_models import ARCHS, save_tiny_model

    from minfer import SamplingParams

    prompts = [
        [(i * 7 + j * 13) % 250 for j in range(n)] for i, n in enumerate([5, 70, 17, 1, 33, 300, 2, 129])
    ]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=5)
    rows = []
    graphs = 16
    for arch, kv_heads in [(a, 2) for a in ARCHS] + [("llama", 1)]:
        path = tempfile.mkdtemp()
        save_tiny_model(arch, path, num_key_value_heads=kv_heads)
        # bf16 agreement is a rate, not a check (the shards sum in another order): one model.
        for dtype in ("float32", "bfloat16") if (arch, kv_heads) == ("llama", 2) else ("float32",):
            outs = {}
            for tp in (1, 2):
                start = time.time()
                with watchdog(f"{arch} kv_heads={kv_heads} {dtype} tp={tp}: start, generate, shut down", 150):
                    outs[tp], steps, graphs = _generate_both(
                        path, prompts, (greedy, sampled), device, dtype, tp, graphs, rows
                    )
                seconds = time.time() - start
            same = sum(a == b for a, b in zip(outs[1], outs[2]))
            rows.append(
                f"parity {arch:8s} kv_heads={kv_heads} {dtype:9s} graphs={graphs} tp2 vs tp1: {same}/{len(outs[1])} sequences "
                f"equal (greedy + seeded); {steps} tp2 steps token-checked across ranks; {seconds:.0f} s"
            )
            print(rows[-1], flush=True)
    with open(os.path.join(out_dir, "parity.txt"), "w") as f:
        f.write("\n".join(rows) + "\n")


def bench_profile(model: str, out_dir: str, running: int, extra: list[str]) -> None:
    """The offline benchmark at --tp 2 exactly as the CLI runs it, keeping the LLM to profile it."""
    import minfer.llm
    from minfer.bench.offline import WORKLOAD_ARGS, make_workload, run_offline_bench
    from minfer.cli import _engine_config, build_parser

    kept = {}

    class KeptLLM(minfer.llm.LLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            kept["llm"] = self

    minfer.llm.LLM = KeptLLM  # `from minfer import LLM` inside the bench resolves to this
    args = build_parser().parse_args(["bench", "offline", model, "--tp", "2", *extra])
    run_offline_bench(_engine_config(args, ("bench_command", *WORKLOAD_ARGS)), args)
    sys.stdout.flush()
    llm = kept["llm"]
    profile_decode(llm, make_workload, out_dir, running)
    llm.shutdown()


def profile_decode(llm, make_workload, out_dir: str, running: int, steps: int = 20) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    sched, leader = llm.scheduler, llm.runner.tp_leader
    length = 1024 if running >= 64 else 32  # small: a CPU dry run of this script
    prompts, params = make_workload(running, length, length, seed=3)
    for p, sp in zip(prompts, params):
        sp.max_tokens = length
        leader.requests_added([sched.add_request([t % llm.engine.vocab_size for t in p], sp)])
    while sched.waiting or sched.prefilling:
        leader.step(sched)
    for _ in range(5):
        leader.step(sched)
    on_cuda = llm.engine.device.type == "cuda"
    if on_cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            leader.step(sched)
        if on_cuda:
            torch.cuda.synchronize()
        per_step = (time.perf_counter() - start) / steps
    nccl_us = gpu_us = 0.0
    for evt in prof.key_averages():
        device_us = getattr(evt, "self_device_time_total", 0) or 0
        gpu_us += device_us
        if "nccl" in evt.key.lower():
            nccl_us += device_us
    line = (
        f"decode profile, tp={llm.engine.tp.size}, {len(sched.running)} running: {per_step * 1e3:.2f} ms/step wall, "
        f"GPU kernels {gpu_us / steps / 1e3:.2f} ms/step, of which NCCL {nccl_us / steps / 1e3:.2f} ms/step "
        f"({ALLREDUCES_PER_STEP} all-reduces + 1 logits all-gather per step)"
    )
    print(line)
    table = prof.key_averages().table(
        sort_by="self_device_time_total" if on_cuda else "self_cpu_time_total", row_limit=15
    )
    print(table)
    with open(os.path.join(out_dir, "profile.txt"), "w") as f:
        f.write(line + "\n" + table)
    for req in list(sched.by_uid):
        leader.request_aborted(req)
        sched.abort(req)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("allreduce", "peer-one-gpu", "parity", "bench-profile"))
    parser.add_argument("model", nargs="?", default="llama-3.1-8b")
    parser.add_argument("--out", default=os.environ.get("OUT", tempfile.mkdtemp()))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--profile-running", type=int, default=256, help="decode batch of the profile")
    args, extra = parser.parse_known_args()
    if args.what == "allreduce":
        allreduce(args.out)
    elif args.what == "peer-one-gpu":
        peer_one_gpu()
    elif args.what == "parity":
        parity(args.out, args.device)
    else:
        bench_profile(args.model, args.out, args.profile_running, extra)


if __name__ == "__main__":
    main()

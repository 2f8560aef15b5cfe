"""Is a batch-1 decode step bound by the GPU or by the host? Times both on the GPU host.

One request of the offline workload decodes alone; then, for the same steps:
- wall: scheduler steps back to back (what `bench offline --num-requests 1` reports per step);
- GPU: the captured batch-1 decode graph replayed back to back (its inputs as staged by the
  last step), timed with CUDA events: the device time of one step with no host in the way.
If wall is well above GPU, the host's per-step work (scheduling, staging inputs, sampling
bookkeeping) is the bound, and faster kernels do not show in the step time.

    PYTHONPATH=$PWD python3 scripts/gpu_batch1_split.py [MODEL] [--cprofile]

--cprofile also runs the timed steps again under cProfile and prints where the host's time goes.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch

from minfer import LLM, SamplingParams
from minfer.bench.offline import make_workload


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    model = args[0] if args else "qwen3-0.6b"
    llm = LLM(model, load_format="dummy")
    sched = llm.scheduler
    prompt = make_workload()[0][0]
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=2000)
    sched.add_request([t % llm.engine.vocab_size for t in prompt], params)
    for _ in range(60):
        sched.step()
    torch.cuda.synchronize()
    steps = 300
    t0 = time.perf_counter()
    for _ in range(steps):
        sched.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps
    graph = llm.engine.graphs.graphs[1]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(steps):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / steps)
    print(f"{model} batch 1: wall {wall * 1e3:.3f} ms/step, decode graph replay {best:.3f} ms/step (GPU)")
    if "--cprofile" in sys.argv:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(steps):
            sched.step()
        torch.cuda.synchronize()
        profiler.disable()
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(30)
    for uid in list(sched.by_uid):
        sched.abort(uid)
    while sched.has_work:
        sched.step()


if __name__ == "__main__":
    main()

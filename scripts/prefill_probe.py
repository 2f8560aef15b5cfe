"""Where does the offline bench's prefill time vary? Runs `minfer bench offline` in-process and
records every step's wall time, every garbage-collector pause and the CUDA allocator's segment
allocations during the timed run (the steps after the bench's GC freeze, which precedes it).
On a GPU also, per prefill pass, the CPU time of `Engine.forward_batch` (building the inputs
and launching every kernel) and the device's span from the pass's first to its last queued
work (CUDA events): a span close to the CPU time means the pass waited on its launches.
Usage, from the repository root: PYTHONPATH=$PWD python3 scripts/prefill_probe.py qwen3-0.6b [bench args]"""

from __future__ import annotations

import cProfile
import gc
import os
import pstats
import sys
import time

import torch

from minfer.cli import main
from minfer.engine import engine
from minfer.scheduler.scheduler import Phase, Scheduler

steps: list[tuple[str, int, float]] = []
pauses: list[tuple[int, float, int]] = []
_gc_start = [0.0]
_count_step = Scheduler._count_step


def count_step(self, batch, seconds):
    steps.append((batch.phase.value, batch.size, seconds))
    if len(steps) == stats.get("first_timed", -1) + 1 and torch.cuda.is_available():
        stats["alloc_before"] = torch.cuda.memory_stats().get("segment.all.allocated", 0)
    return _count_step(self, batch, seconds)


def on_gc(phase, info):
    if phase == "start":
        _gc_start[0] = time.perf_counter()
    else:
        pauses.append((info["generation"], time.perf_counter() - _gc_start[0], len(steps)))


stats: dict = {}
_freeze = engine.freeze_long_lived_objects
compiles: list[tuple[int, str]] = []  # (step, kernel and specialization) of every Triton JIT compile


def on_compile(**kwargs):
    """Triton's post-compile hook: a kernel specialization compiled (or loaded from the disk
    cache) after the warm-up is paid inside the timed run."""
    compiles.append((len(steps), str(kwargs.get("repr", "?"))[:400]))


try:
    import triton

    triton.knobs.runtime.jit_post_compile_hook = on_compile
except (ImportError, AttributeError):  # no Triton, or one without knobs
    pass


def freeze_and_mark():
    """The bench freezes right before its timed run: the steps after this are the timed ones."""
    _freeze()
    stats["first_timed"], stats["first_timed_pause"] = len(steps), len(pauses)


engine.freeze_long_lived_objects = freeze_and_mark
passes: list[tuple[str, float, object, object]] = []  # phase, CPU seconds, start / end events
_forward = engine.Engine.forward_batch


# MINFER_PROBE_CPROFILE=1: also profile the Python of the timed run's prefill passes (cProfile;
# it slows them, so the times above are then not the bench's; the warm-up's passes, which
# compile kernels, are left out) and print the functions that cost most.
profiler = cProfile.Profile() if os.environ.get("MINFER_PROBE_CPROFILE") == "1" else None


def timed_forward(self, batch):
    stats["engine"] = self
    if profiler is not None and batch.phase == Phase.PREFILL and "first_timed" in stats:
        profiler.enable()
        try:
            return _forward(self, batch)
        finally:
            profiler.disable()
    start = time.perf_counter()
    first = torch.cuda.Event(enable_timing=True) if torch.cuda.is_available() else None
    if first is not None:
        first.record()
    result = _forward(self, batch)
    last = None
    if first is not None:
        last = torch.cuda.Event(enable_timing=True)
        last.record()
    passes.append((batch.phase.value, time.perf_counter() - start, first, last))
    return result


engine.Engine.forward_batch = timed_forward
Scheduler._count_step = count_step
gc.callbacks.append(on_gc)
main(["bench", "offline", *sys.argv[1:]])
first_timed = stats["first_timed"]
timed = steps[first_timed:]
prefill = [(n, round(s * 1e3, 1)) for p, n, s in timed if p == Phase.PREFILL.value]
print("prefill steps (batch size, ms):", prefill)
print("first decode steps ms:", [round(s * 1e3, 1) for p, n, s in timed if p != Phase.PREFILL.value][:10])
timed_pauses = [(g, d, i - first_timed) for g, d, i in pauses[stats["first_timed_pause"] :]]
print(
    "gc pauses in the timed run (generation, ms, step) > 1 ms:",
    [(g, round(d * 1e3, 1), i) for g, d, i in timed_pauses if d > 1e-3],
    "total",
    round(sum(d for _, d, _ in timed_pauses) * 1e3, 1),
    "ms in",
    len(timed_pauses),
)
if torch.cuda.is_available():
    torch.cuda.synchronize()
    mine = [(c, a, b) for p, c, a, b in passes[-len(timed) :] if p == Phase.PREFILL.value]
    print(
        "prefill passes (CPU ms in forward_batch / device span ms):",
        [f"{c * 1e3:.1f}/{a.elapsed_time(b):.1f}" for c, a, b in mine],
    )
    print(
        "cuda segments allocated in the timed run:",
        torch.cuda.memory_stats().get("segment.all.allocated", 0) - stats.get("alloc_before", 0),
    )
runner = getattr(stats.get("engine"), "prefill_graphs", None)
print("prefill passes replayed from CUDA graphs:", runner.replays if runner is not None else "none captured")
timed_compiles = [c for c in compiles if c[0] >= stats.get("first_timed", 0)]
print(f"Triton compiles in the timed run: {len(timed_compiles)} (of {len(compiles)})")
for step, what in timed_compiles:
    print(f"  step {step}: {what}")
if profiler is not None:
    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)

"""The fused Gumbel-max sampler's logarithms (kernels/sampling.py, FAST_LOG and SERIES_LOG) on a
GPU: both libdevice's logf, the outer one MUFU lg2.approx, and the inner one too (MUFU with the
series near u = 1); microseconds per call replayed in a CUDA graph at Qwen3's vocabulary, and
how often each draws other tokens than both-libdevice. Measured on an H100 (docs/BENCHMARKS.md,
thirty-sixth session): outer MUFU 114.2 -> 87.6 us at 256 rows, 0 of 10,240 draws different.

    PYTHONPATH=$PWD python3 scripts/gpu_sampler_ab.py [--vocab 151936] [--batches 1 16 64 128 256]
"""

from __future__ import annotations

import argparse

import torch

import minfer.kernels.sampling as sampling


def _inputs(batch: int, vocab: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(batch, vocab, device="cuda", generator=gen) * 3
    temperature = torch.full((batch,), 0.6, device="cuda")
    seeds = torch.arange(batch, device="cuda", dtype=torch.int64) + seed * 1000
    positions = torch.full((batch,), 500, device="cuda", dtype=torch.int64)
    return logits, temperature, seeds, positions


# label: (FAST_LOG, SERIES_LOG)
VARIANTS = {"libdevice": (False, False), "outer MUFU": (True, False), "+ series": (True, True)}


def _use(variant: str) -> None:
    sampling.FAST_LOG, sampling.SERIES_LOG = VARIANTS[variant]


def _time_us(batch: int, vocab: int, variant: str, calls: int = 50, rounds: int = 5) -> float:
    _use(variant)
    args = _inputs(batch, vocab, 0)
    out = torch.empty(batch, dtype=torch.int64, device="cuda")
    sampling.gumbel_argmax(*args, out=out)  # compile outside the capture
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        sampling.gumbel_argmax(*args, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            sampling.gumbel_argmax(*args, out=out)
    best = float("inf")
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / calls)
    return best


def _disagreements(vocab: int, batch: int, trials: int, variant: str) -> tuple[int, int]:
    differ = 0
    for trial in range(trials):
        args = _inputs(batch, vocab, trial + 1)
        _use(variant)
        drawn = sampling.gumbel_argmax(*args)
        _use("libdevice")
        exact = sampling.gumbel_argmax(*args)
        differ += int((drawn != exact).sum())
    return differ, trials * batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128, 256])
    parser.add_argument("--trials", type=int, default=40)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}  vocab {args.vocab}  (us per call, best of 5 graph replays)")
    names = list(VARIANTS)
    print("batch  " + "  ".join(f"{n:>10}" for n in names))
    for batch in args.batches:
        # interleaved, so that a clock change during the runs does not favour one
        runs = [(n, _time_us(batch, args.vocab, n)) for _ in range(2) for n in names]
        times = {n: min(t for m, t in runs if m == n) for n in names}
        print(f"{batch:5d}  " + "  ".join(f"{times[n]:10.1f}" for n in names))
    for name in names[1:]:
        differ, draws = _disagreements(args.vocab, 256, args.trials, name)
        print(f"{name}: {differ} of {draws} draws differ from libdevice's (temperature 0.6)")


if __name__ == "__main__":
    main()

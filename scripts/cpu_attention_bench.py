"""Decode attention of the torch backend over either KV pool layout, one thread.

    OMP_NUM_THREADS=1 taskset -c 1 python3 scripts/cpu_attention_bench.py

The default model's shapes (9 query / 3 KV heads of 64, 30 layers, float32). Each layer has its
own K/V, so a step's keys do not sit in a cache, as in a real step. Slots: a lone request on one
ascending run (read in place), or a batch whose slots are shuffled (gathered). Prints ms per
decode step (30 layers) for a slot-major pool (the GPU's layout) and a head-major one (the
CPU's), and the batched decode against the per-request loop the parity tests tie to
transformers.
"""

from __future__ import annotations

import time

import torch

from minfer.attention.base import ForwardContext, build_metadata
from minfer.attention.torch_backend import TorchAttentionBackend
from minfer.kvcache.pool import KVPool

LAYERS, KV_HEADS, GROUP, HEAD_DIM = 30, 3, 3, 64


def step_ms(backend, q, ctx, forward) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for layer in range(LAYERS):
            forward(q, layer, ctx, HEAD_DIM**-0.5)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    for batch, keys in ((1, 300), (1, 1400), (4, 1400), (16, 544)):
        slots = torch.arange(batch * keys) if batch == 1 else torch.randperm(batch * keys, generator=gen)
        page_table = slots.view(batch, keys).int()
        meta = build_metadata(
            list(range(batch)), [keys - 1] * batch, [1] * batch, page_table, True, torch.device("cpu")
        )
        q = torch.randn(batch, KV_HEADS * GROUP, HEAD_DIM, generator=gen)
        data = torch.randn(LAYERS, 2, batch * keys + 1, KV_HEADS, HEAD_DIM, generator=gen)
        times, outputs = [], []
        for head_major in (False, True):
            pool = KVPool(
                LAYERS,
                batch * keys,
                KV_HEADS,
                HEAD_DIM,
                1,
                torch.float32,
                torch.device("cpu"),
                head_major=head_major,
            )
            for layer in range(LAYERS):  # the same K/V, by slot, in both layouts
                pool.k[layer].copy_(data[layer, 0])
                pool.v[layer].copy_(data[layer, 1])
            backend = TorchAttentionBackend()
            ctx = ForwardContext(attn=meta, kv_pool=pool, backend=backend, out_loc=torch.empty(0))
            times.append(step_ms(backend, q, ctx, backend.forward))
            outputs.append(backend.forward(q, 0, ctx, HEAD_DIM**-0.5))
        loop = step_ms(backend, q, ctx, backend._per_request)
        assert torch.allclose(*outputs, atol=1e-5)
        kind = "one run" if batch == 1 else "shuffled"
        print(
            f"batch {batch} x {keys} keys ({kind}): slot-major {times[0]:.1f} ms, head-major "
            f"{times[1]:.1f} ms, per-request loop {loop:.1f} ms (per step of {LAYERS} layers)"
        )


if __name__ == "__main__":
    main()

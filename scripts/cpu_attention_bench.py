"""Decode attention of the torch backend over either KV pool layout, and prefill attention of
both torch backends; one thread.

    OMP_NUM_THREADS=1 taskset -c 1 python3 scripts/cpu_attention_bench.py [--prefill]

The default model's shapes (9 query / 3 KV heads of 64, 30 layers, float32). Each layer has its
own K/V, so a step's keys do not sit in a cache, as in a real step. Slots: a lone request on one
ascending run (read in place), or a batch whose slots are shuffled (gathered). Prints ms per
decode step (30 layers) for a slot-major pool (the GPU's layout) and a head-major one (the
CPU's), and the batched decode against the per-request loop the parity tests tie to
transformers. With --prefill: ms per layer of one request's prefill (a prefix, then an extend)
through the float32 default's plain path, the `--quantization` models' SDPA path, and the
per-KV-head baddbmm/softmax/bmm that the SDPA path replaced (kept here as the baseline).
"""

from __future__ import annotations

import sys
import time

import torch

from minfer.attention.base import ForwardContext, build_metadata
from minfer.attention.torch_backend import TorchAttentionBackend
from minfer.attention.torch_fast import FastTorchAttentionBackend
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


def baddbmm_prefill(q, k, v, scale, prefix):
    """The --quantization prefill before SDPA: per KV head, its query heads against the head's
    K/V by broadcast, an additive mask. q [E, Hq, D], k/v [Hk, S, D]."""
    extend, seq = q.shape[0], k.shape[1]
    visible = torch.ones(extend, seq, dtype=torch.bool).tril(diagonal=prefix)
    mask = torch.zeros(extend, seq).masked_fill_(~visible, float("-inf"))
    out = torch.empty_like(q)
    for h in range(KV_HEADS):
        heads = slice(h * GROUP, (h + 1) * GROUP)
        kt = k[h].t().expand(GROUP, -1, -1)
        scores = torch.baddbmm(mask, q[:, heads].transpose(0, 1), kt, alpha=scale)
        out[:, heads] = torch.bmm(scores.softmax(dim=-1), v[h].expand(GROUP, -1, -1)).transpose(0, 1)
    return out


def prefill() -> None:
    gen = torch.Generator().manual_seed(0)
    scale = HEAD_DIM**-0.5
    for prefix, extend in ((0, 16), (0, 256), (0, 888), (0, 2048), (1024, 1024), (4096, 512)):
        seq = prefix + extend
        pool = KVPool(1, seq, KV_HEADS, HEAD_DIM, 1, torch.float32, torch.device("cpu"), head_major=True)
        pool.storage.normal_(generator=gen)
        page_table = torch.arange(seq, dtype=torch.int32)[None, :]
        meta = build_metadata([0], [prefix], [extend], page_table, False, torch.device("cpu"))
        q = torch.randn(extend, KV_HEADS * GROUP, HEAD_DIM, generator=gen)
        k, v = pool.heads(0)
        times = {}
        for backend in (TorchAttentionBackend(), FastTorchAttentionBackend()):
            ctx = ForwardContext(attn=meta, kv_pool=pool, backend=backend, out_loc=torch.empty(0))
            times[backend.name] = layer_ms(lambda: backend.forward(q, 0, ctx, scale))
        times["baddbmm"] = layer_ms(lambda: baddbmm_prefill(q, k, v, scale, prefix))
        print(
            f"prefill of {extend} after {prefix}: plain {times['torch']:.2f} ms, SDPA {times['sdpa']:.2f} ms, "
            f"baddbmm {times['baddbmm']:.2f} ms (per layer)"
        )


def layer_ms(run) -> float:
    run()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    torch.set_num_threads(1)
    if "--prefill" in sys.argv[1:]:
        return prefill()
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

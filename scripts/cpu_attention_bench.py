"""Decode attention of the torch backend, batched vs its per-request loop (one thread).

    PYTHONPATH=. taskset -c 1 python3 scripts/cpu_attention_bench.py
Shapes of the default model (9 query / 3 KV heads of 64), 320 cached tokens, 30 layers.
"""

import time

import torch

torch.set_num_threads(1)
from minfer.attention.base import ForwardContext, build_metadata
from minfer.attention.torch_backend import TorchAttentionBackend
from minfer.kvcache.pool import KVPool

for B in (1, 16, 64):
    S = 320
    pool = KVPool(1, B * S + 8, 3, 64, 1, torch.float32, torch.device("cpu"))
    pt = torch.arange(B * S).view(B, S).int()
    meta = build_metadata(list(range(B)), [S - 1] * B, [1] * B, pt, True, torch.device("cpu"))
    be = TorchAttentionBackend()
    ctx = ForwardContext(attn=meta, kv_pool=pool, backend=be, out_loc=torch.empty(0))
    q = torch.randn(B, 9, 64)

    def t(f):
        best = 1e9
        for _ in range(5):
            s = time.perf_counter()
            for _ in range(30):
                f()
            best = min(best, time.perf_counter() - s)
        return best * 1000  # ms per 30 layers

    print(
        f"batch {B}, 320 cached tokens, 30 layers: batched {t(lambda: be.forward(q, 0, ctx, 0.125)):.1f} ms, per-request loop {t(lambda: be._per_request(q, 0, ctx, 0.125)):.1f} ms"
    )

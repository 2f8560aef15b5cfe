"""Transfers of the host KV tier through its staging buffers: pages scattered on both sides,
in any order, in chunks smaller than the transfer, come back bit for bit (float32 and fp8; device
pools slot-major as on a GPU and head-major as on the CPU)."""

from __future__ import annotations

import pytest
import torch

from minfer.kvcache.host_pool import HostKVPool
from minfer.kvcache.host_tier import HostTier
from minfer.kvcache.pool import KVPool

PS, LAYERS, DEVICE_PAGES, HOST_PAGES = 4, 3, 12, 16


def make_tier(
    kv_cache_dtype: str, staging_pages: int | None, heads=2, head_dim=8, dtype=torch.float32, head_major=False
):
    pool = KVPool(
        LAYERS, DEVICE_PAGES * PS, heads, head_dim, PS, dtype, torch.device("cpu"), kv_cache_dtype, head_major
    )
    host = HostKVPool(pool, HOST_PAGES * PS, PS, pin=False)
    return pool, HostTier(pool, host, staging_pages)


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def page_bytes(pool: KVPool, page: int) -> list[torch.Tensor]:
    """Every layer's K and V bytes of one device page (copies)."""
    return [raw(t)[page * PS : (page + 1) * PS].clone() for t in (*pool.k, *pool.v)]


def scramble(pool: KVPool, seed: int) -> None:
    """Random bytes everywhere (through uint8: fp8 tensors take no random fill of their own)."""
    gen = torch.Generator().manual_seed(seed)
    for t in (*pool.k, *pool.v):
        raw(t).copy_(torch.randint(0, 256, raw(t).shape, generator=gen, dtype=torch.uint8))


def slots(pages: list[int]) -> list[int]:
    return [p * PS + i for p in pages for i in range(PS)]


# Device and host pages out of order, host pages in two runs once sorted (3-5, 11-12).
DEVICE_SRC, HOST = [7, 2, 9, 0, 5], [11, 4, 12, 3, 5]
DEVICE_DST = [1, 10, 3, 8, 11]


@pytest.mark.parametrize("head_major", [False, True], ids=["slot-major", "head-major"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("staging_pages", [1, 3, None], ids=["1-page", "3-page", "default"])
def test_round_trip_is_bit_exact_with_scattered_pages_and_chunks(kv_cache_dtype, staging_pages, head_major):
    round_trip(*make_tier(kv_cache_dtype, staging_pages, head_major=head_major))


# Raw rows of 6 and 5 bytes: moved as int16 words and as bytes (8-byte words do not divide them);
# a head-major pool's rows are one head's: 3 bytes of (2, 3) move as bytes too.
@pytest.mark.parametrize(
    "heads, head_dim, head_major, word",
    [
        (2, 3, False, torch.int16),
        (1, 5, False, torch.uint8),
        (2, 3, True, torch.uint8),
        (2, 4, True, torch.int32),
    ],
)
def test_round_trip_of_rows_no_wide_word_divides(heads, head_dim, head_major, word):
    pool, tier = make_tier("auto", 2, heads, head_dim, torch.uint8, head_major)
    assert tier.host.word == word and tier.dev_pages.dtype == word
    round_trip(pool, tier)


def round_trip(pool: KVPool, tier: HostTier) -> None:
    scramble(pool, seed=1)
    want = {d: page_bytes(pool, d) for d in DEVICE_SRC}
    tier.offload(slots(DEVICE_SRC), slots(HOST))
    # The host page holds the device page as one block: [layer, k|v, slot, heads, dim], typed.
    assert tier.host.pages.dtype == pool.storage_dtype
    for d, h in zip(DEVICE_SRC, HOST):
        for layer in range(LAYERS):
            assert torch.equal(raw(tier.host.pages[h, layer, 0]), want[d][layer])
            assert torch.equal(raw(tier.host.pages[h, layer, 1]), want[d][LAYERS + layer])
    scramble(pool, seed=2)  # the device pages are reused and overwritten
    untouched = {p: page_bytes(pool, p) for p in range(DEVICE_PAGES) if p not in DEVICE_DST}
    assert tier.load(slots(HOST), slots(DEVICE_DST)) is None  # CPU: synchronous
    for d_src, d_dst in zip(DEVICE_SRC, DEVICE_DST):
        assert all(torch.equal(a, b) for a, b in zip(page_bytes(pool, d_dst), want[d_src]))
    for p, before in untouched.items():  # the scatter wrote only the pages it was given
        assert all(torch.equal(a, b) for a, b in zip(page_bytes(pool, p), before))
    c = tier.counters
    assert c.tokens_loaded == c.tokens_offloaded == len(HOST) * PS
    assert c.bytes_loaded == c.bytes_offloaded == len(HOST) * PS * tier.host.bytes_per_token
    assert c.offload_bytes_timed == c.bytes_offloaded and c.loads == 1


def test_one_copy_per_run_of_consecutive_host_pages():
    _, tier = make_tier("auto", None)
    host_pages, device_pages = tier._pages(slots(HOST), slots(DEVICE_SRC))
    assert host_pages == [3, 4, 5, 11, 12] and device_pages == [0, 2, 5, 7, 9]  # paired, by host page
    assert tier._host_runs(host_pages) == [(3, 0, 3), (11, 3, 2)]  # two H2D/D2H copies


def test_staging_is_sized_and_counted():
    pool, tier = make_tier("auto", None)
    # A staging buffer never needs more than the host pool; three of them (load + 2 offload).
    assert tier.staging_pages == HOST_PAGES
    assert tier.staging_bytes == 3 * HOST_PAGES * tier.host.page_bytes
    assert tier.host.page_bytes == PS * 2 * LAYERS * 2 * 8 * 4  # float32 K and V, every layer


def test_memory_line_counts_the_staging_buffers(tmp_path):
    from tiny_models import save_tiny_model

    from minfer import LLM

    save_tiny_model("qwen2", tmp_path)
    llm = LLM(str(tmp_path), kv_cache_tokens=256, host_kv_cache_gb=0.01, log_level="warning")
    memory, tier = llm.engine.memory, llm.scheduler.kv.host_tier
    assert memory.host_staging_bytes == tier.staging_bytes > 0
    assert "transfer staging" in memory.describe(llm.engine.max_model_len)

"""Freed pages come back out in ascending runs, so a lone stream's K/V stays one slot run
(the --quantization CPU attention path reads such a run in place, without a gather)."""

from __future__ import annotations

from minfer.kvcache.allocator import PageAllocator


def test_a_freed_run_is_handed_out_ascending_again():
    allocator = PageAllocator(64, 1)
    first = allocator.alloc(20) + [allocator.alloc(1)[0] for _ in range(5)]  # prefill, then decode
    assert first == list(range(25))
    allocator.free(first)
    second = allocator.alloc(10) + [allocator.alloc(1)[0] for _ in range(3)]
    assert second == list(range(13))
    assert allocator.num_free_pages == 64 - 13

"""Physical page allocator: hands out and takes back pages of `page_size` slots."""

from __future__ import annotations


class OutOfSlotsError(RuntimeError):
    """The pool has fewer free pages than asked for (the scheduler evicts or preempts first)."""


class PageAllocator:
    """Free list of page ids. Slot s belongs to page s // page_size."""

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages = num_pages
        self.page_size = page_size
        # Pop from the end: low page ids are handed out first, which keeps traces readable.
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def free_page_ids(self) -> list[int]:
        """The free list itself (read-only use: the invariant check counts it)."""
        return self._free

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfSlotsError(f"asked for {n} pages, {len(self._free)} free")
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        pages.reverse()
        return pages

    def free(self, pages) -> None:
        # Reversed onto the stack, so that the next alloc hands a freed run back out ascending
        # (a lone stream's K/V then stays one slot run the CPU attention reads in place).
        self._free.extend(reversed(list(pages)))

    def pages_of_slots(self, slots) -> list[int]:
        """The distinct pages, in order, of a run of slots whose first slot starts a page."""
        ps = self.page_size
        return [int(s) // ps for s in slots[::ps]]

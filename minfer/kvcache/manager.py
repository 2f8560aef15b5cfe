"""KV bookkeeping for the scheduler: rows, slot allocation, prefix reuse and release.

This is the "allocate" act of docs/ARCHITECTURE.md: before a forward pass, positions
[cached_len, cached_len + n) of a request get physical slots, recorded in the page table.
The attention layers write K/V there during the pass; the backend reads through the table.
"""

from __future__ import annotations

from minfer.core import Req
from minfer.kvcache.allocator import OutOfSlotsError, PageAllocator
from minfer.kvcache.host_tier import HostTier
from minfer.kvcache.match_cost import match_cost
from minfer.kvcache.page_table import PageTable, runs_of_positions
from minfer.kvcache.prefix_cache import KVInvariantError, NaiveCache, PrefixCache
from minfer.kvcache.tiered_radix import TieredRadixCache

# A load expected to land within this joins the pass being planned instead of a later one.
# About what the CPU takes to launch a short prefill pass of an 8B model (13-15 ms for 320-640
# new tokens on Llama-3.1-8B, scripts/gpu_prefill_launch.py on an H200 host): the GPU reaches
# the pass hardly sooner than the copy lands, while a pass of its own would cost the request a
# whole launch more (docs/MEMORY.md has the measured TTFT).
LOAD_JOIN_MAX_WAIT_S = 0.015


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class KVManager:
    def __init__(
        self,
        num_slots: int,
        page_size: int,
        page_table: PageTable,
        cache: str = "naive",
        host_tier: HostTier | None = None,
        host_write_policy: str = "write_back",
    ):
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self.allocator = PageAllocator(self.num_pages, page_size)
        self.page_table = page_table
        self.host_tier = host_tier
        self.host_write_policy = host_write_policy  # kvcache/write_policy.py
        # uid -> a host-tier load into the request's prefix still in flight (CUDA only)
        self.loads: dict[int, object] = {}
        self.prefix_cache: PrefixCache = self._make_cache(cache)

    def _make_cache(self, kind: str) -> PrefixCache:
        if kind == "radix" and self.host_tier is not None:
            return TieredRadixCache(self.allocator, self.host_tier, self.host_write_policy)
        if kind == "radix":
            try:
                from minfer.kvcache.radix import RadixCache
            except ImportError:  # the radix cache arrives with its own module
                return NaiveCache(self.allocator)
            return RadixCache(self.allocator)
        return NaiveCache(self.allocator)

    # -- capacity ----------------------------------------------------------------------------
    def pages_needed(self, req: Req, num_new_tokens: int) -> int:
        """Pages to allocate so positions up to cached_len + num_new_tokens have slots."""
        ps = self.page_size
        return _ceil_div(req.cached_len + num_new_tokens, ps) - _ceil_div(req.cached_len, ps)

    @property
    def available_pages(self) -> int:
        """Free pages plus those the prefix cache would give up."""
        return self.allocator.num_free_pages + self.prefix_cache.evictable_pages

    def reserve_pages(self, n: int) -> bool:
        """Make `n` pages free, evicting cached ones if needed. False if impossible."""
        short = n - self.allocator.num_free_pages
        if short > 0:
            self.prefix_cache.evict(short)
        return self.allocator.num_free_pages >= n

    # -- request life cycle --------------------------------------------------------------------
    def admit(self, req: Req) -> None:
        """Give the request a row, its tokens on the device, and any cached prefix."""
        req.table_idx = self.page_table.take_row()
        req.device_len = len(req.token_ids)  # a resumed request continues from every known token
        self.page_table.write_tokens(req.table_idx, 0, req.token_ids[: req.device_len])
        match = self.prefix_cache.match(req.token_ids[: self._matchable_len(req)])
        req.cache_handle = match.handle
        req.cached_len = len(match.slots)
        req.shared_len = len(match.slots) if match.handle is not None else 0
        if not req.output_len:  # a resume after the first token keeps what the client was told
            req.prefix_hit = req.cached_len
        if match.load is not None:
            self.loads[req.uid] = match.load
        if match.slots:
            n = len(match.slots)
            self.page_table.write_slots([req.table_idx] * n, list(range(n)), match.slots)

    @staticmethod
    def _matchable_len(req: Req) -> int:
        # Leave at least one token to compute: its logits give the first sampled token. A request
        # that wants its prompt's logprobs computes the whole prompt (a cached prefix has no logits).
        if req.params.prompt_logprobs is not None and not req.output_len:
            return 0
        return len(req.token_ids) - 1

    def _cannot_fit(self, req: Req, max_chunk: int, free_pages: int, reserve_pages: int) -> bool:
        """A tiered match evicts and loads as it matches (kvcache/match_cost.py): price it first.
        Only while other requests hold pages, which they give back: alone, a request is admitted
        as before, with whatever part of its prefix the pool can take."""
        if not isinstance(self.prefix_cache, TieredRadixCache) or self.used_pages == 0:
            return False
        hit, taken = match_cost(self.prefix_cache, req.token_ids[: self._matchable_len(req)])
        chunk = min(len(req.token_ids) - hit, max_chunk)
        return taken + _ceil_div(chunk, self.page_size) + reserve_pages > free_pages

    def try_admit(
        self, req: Req, max_chunk: int, free_pages: int, reserve_pages: int
    ) -> tuple[int, int] | None:
        """Admit `req` if its first chunk (at most `max_chunk` tokens) fits in `free_pages` with
        `reserve_pages` more kept for it; returns (chunk length, pages this admission costs).

        The cost counts the matched prefix too: once locked, its pages can no longer be evicted
        to make room. If it does not fit, the admission is undone (row, lock, and the cache's
        query counters, so a prefix query is counted once, when the request really starts).
        """
        if self._cannot_fit(req, max_chunk, free_pages, reserve_pages):
            return None
        cache = self.prefix_cache
        # Available pages, not only evictable ones: a hit on the host tier takes free pages too.
        available_before = self.available_pages
        counted = (cache.counters.queried_tokens, cache.counters.hit_tokens)
        self.admit(req)
        chunk = min(req.extend_len, max_chunk)
        cost = available_before - self.available_pages + self.pages_needed(req, chunk) + reserve_pages
        if cost > free_pages:
            self.release(req)
            req.cached_len = 0
            cache.counters.queried_tokens, cache.counters.hit_tokens = counted
            return None
        return chunk, cost

    def load_ready(self, req: Req) -> bool:
        """Whether the request can run in the pass being planned. A host-tier load into its
        prefix still in flight keeps it out (it waits, the rest of the batch runs: the CPU never
        blocks) unless the load is expected to land within LOAD_JOIN_MAX_WAIT_S; then the
        request may run, and `claim_load` orders the pass after the copy on the GPU."""
        if self.load_allows_run(req):
            return True
        self.host_tier.counters.load_waits += 1
        return False

    def load_allows_run(self, req: Req) -> bool:
        """load_ready's answer without counting a wait (for checks beside the planning)."""
        load = self.loads.get(req.uid)
        if load is None:
            return True
        tier = self.host_tier
        return tier.done(load) or tier.expected_wait(load) <= LOAD_JOIN_MAX_WAIT_S

    def claim_load(self, req: Req) -> None:
        """`req` (load_ready) runs in the pass being planned: if its load is still in flight,
        that pass and every later one are queued after the copy on the GPU."""
        load = self.loads.pop(req.uid, None)
        if load is not None and not self.host_tier.done(load):
            self.host_tier.order_compute_after(load)

    def allocate(self, reqs: list[Req], extend_lens: list[int], write_device: bool = True) -> list[int]:
        """Allocate slots for each request's next `extend_lens[i]` positions; returns out_loc.
        Without `write_device` only the page table's host mirror records them, and the pass
        that runs them must write the device table (a decode step does, from the vectors it
        stages anyway: engine/decode_inputs.py).

        The caller has checked capacity with `reserve_pages`; running short here is a bug.
        """
        ps = self.page_size
        needs = [n if ps == 1 else self.pages_needed(r, n) for r, n in zip(reqs, extend_lens)]
        total_pages = sum(needs)
        if not self.reserve_pages(total_pages):
            raise OutOfSlotsError(f"{total_pages} pages needed, {self.allocator.num_free_pages} free")
        pages = self.allocator.alloc(total_pages)  # one call; handed out to the requests in order
        rows, positions = runs_of_positions(
            [r.table_idx for r in reqs], [r.cached_len for r in reqs], extend_lens
        )
        if ps == 1:  # a page is a slot
            slots = pages
        else:
            slots, used = [], 0
            for req, n, need in zip(reqs, extend_lens, needs):
                start = req.cached_len
                req_slots = []
                if start % ps:  # finish the request's partly filled last page first
                    last = int(self.page_table.slots_cpu[req.table_idx, start - 1]) + 1
                    req_slots.extend(range(last, last + min(ps - start % ps, n)))
                for page in pages[used : used + need]:
                    req_slots.extend(range(page * ps, page * ps + ps))
                used += need
                slots.extend(req_slots[:n])
        self.page_table.write_slots(rows, positions, slots, write_device)
        return slots

    def cache_prompt(self, req: Req) -> list[tuple[int, int, int]]:
        """Share a request's computed prompt while it keeps running: later requests with the
        same prefix hit it now, not only after this one finishes.

        Called when the pass computing the prompt's K/V is launched; any later pass that reads
        those slots runs after it on the same stream. If another request cached the same
        tokens first, the tree keeps its pages and frees ours, so the row is repointed.
        Returns (position, freed slot, tree slot) for each repointed position.
        """
        ps = self.page_size
        aligned = (req.cached_len // ps) * ps
        if aligned == 0:
            return []
        slots = self.page_table.row_slots(req.table_idx, aligned).tolist()
        match = self.prefix_cache.insert_and_lock(req.token_ids[:aligned], slots, req.cache_handle)
        if match.load is not None:  # tree pages it is repointed to may still be loading
            self.host_tier.order_compute_after(match.load)
        req.cache_handle = match.handle
        req.shared_len = aligned if match.handle is not None else 0  # the tree owns these pages now
        if match.slots == slots:
            return []
        changed = [i for i, (a, b) in enumerate(zip(slots, match.slots)) if a != b]
        self.page_table.write_slots(
            [req.table_idx] * len(changed), changed, [match.slots[i] for i in changed]
        )
        return [(i, slots[i], match.slots[i]) for i in changed]

    def release(self, req: Req) -> list[int]:
        """A request leaves (finished, aborted or preempted): the positions whose K/V and token
        are both known go to the prefix cache, every other slot goes back to the allocator.

        In overlap mode the pool may hold K/V one step ahead of the tokens the CPU has seen
        (a pass still in flight); a finished request's last sampled token never keeps a slot,
        so its final state is cached_len = prompt + output - 1 as docs/ARCHITECTURE.md defines.
        What the prefix cache already owns (`shared_len`) is kept whatever the request's state:
        a request aborted while its prompt pass is in flight has handed the whole prompt to the
        cache, although its first token never reached the CPU.
        """
        ps = self.page_size
        allocated = req.cached_len
        keep = max(req.shared_len, min(allocated, len(req.token_ids) - (1 if req.finished else 0)))
        slots = self.page_table.row_slots(req.table_idx, allocated).tolist()
        aligned = (keep // ps) * ps
        self.prefix_cache.insert(req.token_ids[:aligned], slots[:aligned], req.cache_handle)
        if aligned < allocated:  # a partly filled tail page, or K/V of tokens the CPU never saw
            self.allocator.free(self.allocator.pages_of_slots(slots[aligned:]))
        req.cached_len = keep
        req.cache_handle = None
        req.shared_len = 0
        self.loads.pop(req.uid, None)  # the nodes wait for their own load before an eviction
        self.page_table.give_back_row(req.table_idx)
        req.table_idx = -1
        return slots  # every slot the request held, for the trace: [:aligned] cached, rest freed

    def check(self, holders: list[Req]) -> None:
        """The page invariant: every page is on the free list, in the prefix cache, or in the
        private tail of exactly one request that holds a row (`holders`: every such request),
        and nothing else. Also checks rows and the cache's locks. Raises KVInvariantError.

        A request's row maps positions [0, shared_len) to the cache's pages (its lock) and
        [shared_len, cached_len) to pages of its own.
        """
        owners: dict[int, str] = {}

        def claim(pages, owner: str) -> None:
            for page in pages:
                if not 0 <= page < self.num_pages:
                    raise KVInvariantError(f"page {page} ({owner}) is outside the pool of {self.num_pages}")
                if page in owners:
                    raise KVInvariantError(f"page {page} is owned twice: by {owners[page]} and by {owner}")
                owners[page] = owner

        claim(self.allocator.free_page_ids, "the free list")
        claim(
            self.prefix_cache.audit([r.cache_handle for r in holders if r.cache_handle is not None]),
            "the prefix cache",
        )
        rows = set()
        for req in holders:
            if req.table_idx < 0 or req.table_idx in rows:
                raise KVInvariantError(f"request {req.uid} holds row {req.table_idx}, invalid or shared")
            rows.add(req.table_idx)
            if (
                not req.shared_len <= req.cached_len <= self.page_table.max_len
                or req.shared_len % self.page_size
            ):
                raise KVInvariantError(
                    f"request {req.uid}: shared_len {req.shared_len}, cached_len {req.cached_len}"
                )
            row = self.page_table.row_slots(req.table_idx, req.cached_len).tolist()
            if self.page_table.mirrored:  # the device table is what the kernels read
                device_row = self.page_table.slots[req.table_idx, : req.cached_len].tolist()
                if device_row != row:
                    raise KVInvariantError(
                        f"request {req.uid}: the device page table differs from its host mirror"
                    )
            if row[: req.shared_len] != self.prefix_cache.handle_slots(req.cache_handle):
                raise KVInvariantError(
                    f"request {req.uid}: its first {req.shared_len} slots are not the "
                    f"ones its prefix-cache lock holds"
                )
            own = row[req.shared_len :]
            pages = self.allocator.pages_of_slots(own)
            ps = self.page_size
            if ps > 1 and own != [page * ps + i for page in pages for i in range(ps)][: len(own)]:
                raise KVInvariantError(f"request {req.uid}: its slots do not fill whole pages in order")
            claim(pages, f"request {req.uid}")
        if len(owners) != self.num_pages:
            lost = sorted(set(range(self.num_pages)) - set(owners))
            raise KVInvariantError(f"{len(lost)} pages are owned by no one (first: {lost[:5]})")
        if self.page_table.num_free_rows + len(rows) != self.page_table.max_rows or rows & set(
            self.page_table.free_row_ids
        ):
            raise KVInvariantError(
                f"{len(rows)} rows held and {self.page_table.num_free_rows} free, "
                f"of {self.page_table.max_rows}"
            )

    @property
    def used_pages(self) -> int:
        return self.num_pages - self.allocator.num_free_pages - self.prefix_cache.cached_pages

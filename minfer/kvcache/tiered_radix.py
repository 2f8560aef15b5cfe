"""The radix cache with a host tier behind it: evicted prefixes move to host memory, not away.

Each node lives on the device (`slots`), on the host (`host_slots`), or on both (a node loaded
back keeps its host copy: K/V of cached tokens never change, so a later eviction from the
device frees the pages without copying again). Three rules keep this easy to reason about:
  - device nodes are closed under parent: a node on the device has its parent on the device,
    because device eviction peels device leaves and a hit loads a path from its root end;
  - a locked node is on the device (a hit loads what it locks before the request runs);
  - the host tier is evicted LRU: a node on both tiers loses its host copy, a host-only node
    with no children leaves the tree for good.
Eviction from the device writes the node back to the host (write-back on eviction), making
room there first; if even that fails (every host page is locked behind a device copy), the
node and its host-only subtree are dropped as the plain tree would drop them. Under the
write_through policy a node also gets its host copy on its second hit (write_policy.py).
"""

from __future__ import annotations

import heapq

from minfer.kvcache.allocator import PageAllocator
from minfer.kvcache.host_tier import HostTier
from minfer.kvcache.prefix_cache import KVInvariantError, PrefixMatch
from minfer.kvcache.radix import RadixCache, _Node
from minfer.kvcache.write_policy import WRITE_POLICIES, write_through


class NullTransferTrace:
    """Tracing off. The scheduler's trace replaces it (observability/scheduler_trace.py)."""

    enabled = False

    def kv_offloaded(self, device_slots, host_slots, prefix_tokens, node_len) -> None: ...
    def kv_loaded(self, device_slots, host_slots, prefix_tokens, node_len) -> None: ...


def _page_slots(pages: list[int], ps: int) -> list[int]:
    return [p * ps + i for p in pages for i in range(ps)]


class TieredRadixCache(RadixCache):
    """RadixCache whose evictions write back to a HostTier and whose hits load from it."""

    def __init__(self, allocator: PageAllocator, tier: HostTier, write_policy: str = "write_back"):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"host KV write policy {write_policy!r} is not one of {list(WRITE_POLICIES)}")
        super().__init__(allocator)
        self.write_through = write_policy == "write_through"
        # Host pages of write-through copies whose node is still on the device: the trace
        # announces a copy (kv_offloaded) when its node leaves the device, as for a write-back.
        self.written_through: set[int] = set()
        self.tier = tier
        self.host_allocator = tier.host.allocator
        self.host_pages = 0  # host pages held by nodes
        self.trace = NullTransferTrace()
        # Write-backs of one `evict` call, issued as ONE offload (one gather per layer and K/V
        # per staging chunk, where one per node cost Llama-8B 64 launches a node): (device
        # slots, host slots). The device pages are already free, so nothing may allocate them
        # before `_flush_offloads`, and their host pages may not be freed before it either.
        self._offload_batch: tuple[list[int], list[int]] = ([], [])

    # -- hits: load host-resident nodes of the matched path ---------------------------------------
    def match(self, token_ids: list[int]) -> PrefixMatch:
        token_ids = list(token_ids)
        path = self._walk(token_ids)
        self.counters.queried_tokens += len(token_ids)
        if not path:
            return PrefixMatch([], None)
        self._lock(path[-1])  # first, so making room for the loads cannot evict the path
        on_device = self._load(path)
        if on_device < len(path):  # the device pool could not take the rest of the path
            self.release(path[-1])
            path = path[:on_device]
            if path:
                self._lock(path[-1])
        slots = [s for node in path for s in node.slots]
        self.counters.hit_tokens += len(slots)
        if not path:
            return PrefixMatch([], None)
        for node in path:
            node.hits += 1
        pending = self._pending_load(path)
        if self.write_through:
            write_through(self, path)
        return PrefixMatch(slots, path[-1], pending)

    def insert_and_lock(self, token_ids: list[int], slots: list[int], handle: object | None) -> PrefixMatch:
        """RadixCache's, plus the load still in flight into the locked path: where the caller's
        pages were duplicates the tree keeps its own, and some of those may still be loading."""
        match = super().insert_and_lock(token_ids, slots, handle)
        return PrefixMatch(match.slots, match.handle, self._pending_load(self._handle_path(match.handle)))

    def _pending_load(self, path: list[_Node]) -> object | None:
        """The latest load still in flight into `path`'s nodes (one load stream: its completion
        implies every earlier one's); forgets the loads that have landed."""
        for node in path:
            if node.loading is not None and self.tier.done(node.loading):
                node.loading = None
        return max((n.loading for n in path if n.loading is not None), key=lambda ld: ld.seq, default=None)

    def _load(self, path: list[_Node]) -> int:
        """Give the host-only nodes of `path` (a suffix of it) device pages and copy them in, in
        one batch; returns how many nodes of `path` are on the device now."""
        ps = self.page_size
        # Room for the whole suffix in one eviction: each `evict` call scans the tree, and one
        # call per node made admissions take ~50 ms each on a Llama-8B multi-turn run (~800 nodes).
        wanted = sum(len(node.host_slots) // ps for node in path if not node.slots)
        if self.allocator.num_free_pages < wanted:
            self.evict(wanted - self.allocator.num_free_pages)
        on_device, loaded = 0, []
        for node in path:
            if not node.slots:
                need = len(node.host_slots) // ps
                if self.allocator.num_free_pages < need:
                    break
                node.slots = _page_slots(self.allocator.alloc(need), ps)
                self._cached_pages += need  # locked: not evictable
                loaded.append(node)
            on_device += 1
        if loaded:
            load = self.tier.load(
                [s for n in loaded for s in n.host_slots], [s for n in loaded for s in n.slots]
            )
            for node in loaded:
                node.loading = load
                if self.trace.enabled:
                    self.trace.kv_loaded(
                        node.slots, node.host_slots, self._path_tokens(node), len(node.slots)
                    )
        return on_device

    def _adopt(self, path: list[_Node], slots: list[int]) -> None:
        """The caller computed K/V for tokens the tree holds on the host only: those device pages
        join the nodes (both tiers now) instead of being freed as duplicates."""
        offset = 0
        for node in path:
            if not node.slots:
                node.slots = slots[offset : offset + len(node.token_ids)]
                pages = len(node.slots) // self.page_size
                self._cached_pages += pages
                self._evictable_pages += pages  # unlocked: a locked node is on the device
            offset += len(node.token_ids)

    # -- device eviction: write back ------------------------------------------------------------
    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` unlocked device pages, least recently used device leaves first;
        each evicted node moves to the host tier."""
        ps = self.page_size
        heap = self._device_leaves()
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            leaf = heapq.heappop(heap)
            pages = len(leaf.slots) // ps
            keep = pages - min(pages, num_pages - freed)
            if keep:  # free no more than asked: the head stays on the device, the tail moves
                self._split(leaf, keep * ps)
            freed += pages - keep
            parent = leaf.parent
            self._drop_device_copy(leaf)
            if keep:
                break
            if self._device_leaf(parent):
                heapq.heappush(heap, parent)
        self._flush_offloads()
        self.counters.evicted_pages += freed
        return freed

    def _device_leaves(self) -> list[_Node]:
        """The unlocked device leaves. Device nodes are closed under parent, so the walk goes
        down device children only and never into the (larger) host-only part of the tree."""
        stack = [c for c in self._root.children.values() if c.slots]
        leaves = []
        while stack:
            node = stack.pop()
            below = [c for c in node.children.values() if c.slots]
            if below:
                stack.extend(below)
            elif node.lock_count == 0:
                leaves.append(node)
        return leaves

    def _flush_offloads(self) -> None:
        device_slots, host_slots = self._offload_batch
        if device_slots:
            self.tier.offload(device_slots, host_slots)
            self._offload_batch = ([], [])

    def _device_leaf(self, node: _Node) -> bool:
        return (
            node is not self._root
            and bool(node.slots)
            and node.lock_count == 0
            and not any(c.slots for c in node.children.values())
        )

    def _drop_device_copy(self, node: _Node) -> None:
        self._settle(node)
        pages = len(node.slots) // self.page_size
        if node.host_slots and node.host_slots[0] // self.page_size in self.written_through:
            self.written_through.difference_update(self.host_allocator.pages_of_slots(node.host_slots))
            if self.trace.enabled:  # announced as the device copy goes, as a write-back is
                self.trace.kv_offloaded(node.slots, node.host_slots, self._path_tokens(node), len(node.slots))
        if not node.host_slots:
            host_slots = self._alloc_host(pages)
            if host_slots is not None:
                self._offload_batch[0].extend(node.slots)
                self._offload_batch[1].extend(host_slots)
                node.host_slots = host_slots
                self.host_pages += pages
                if self.trace.enabled:
                    self.trace.kv_offloaded(node.slots, host_slots, self._path_tokens(node), len(node.slots))
        self.allocator.free(self.allocator.pages_of_slots(node.slots))
        node.slots = []
        self._cached_pages -= pages
        self._evictable_pages -= pages
        if not node.host_slots:  # no room on the host either: gone, with its host-only subtree
            self._remove_subtree(node)

    # -- host eviction: LRU, for good -------------------------------------------------------------
    def _alloc_host(self, pages: int) -> list[int] | None:
        short = pages - self.host_allocator.num_free_pages
        if short > 0:
            self.evict_host(short)
        if self.host_allocator.num_free_pages < pages:
            return None
        return _page_slots(self.host_allocator.alloc(pages), self.page_size)

    def _host_evictable(self, node: _Node) -> bool:
        return (
            node is not self._root
            and bool(node.host_slots)
            and node.lock_count == 0
            and (bool(node.slots) or not node.children)
        )

    def evict_host(self, num_pages: int, may_drop=None) -> int:
        """Free at least `num_pages` host pages if unlocked nodes hold them (whole nodes: a host
        copy is dropped entire), least recently used first, of the nodes `may_drop` allows
        (default: all); returns how many were freed."""
        self._flush_offloads()  # pages freed here may be handed to the next write-back

        def evictable(n: _Node) -> bool:
            return self._host_evictable(n) and (may_drop is None or may_drop(n))

        heap = [n for n in self._nodes() if evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            node = heapq.heappop(heap)
            if not evictable(node):
                continue
            self._settle(node)
            freed += self._free_host_copy(node)
            if not node.slots:  # host-only and childless: out of the tree
                parent = node.parent
                del parent.children[tuple(node.token_ids[: self.page_size])]
                if evictable(parent) and not parent.slots:
                    heapq.heappush(heap, parent)
        return freed

    def _free_host_copy(self, node: _Node) -> int:
        pages = self.host_allocator.pages_of_slots(node.host_slots)
        self.written_through.difference_update(pages)
        self.host_allocator.free(pages)
        node.host_slots = []
        self.host_pages -= len(pages)
        return len(pages)

    def _remove_subtree(self, node: _Node) -> None:
        self._flush_offloads()
        stack = [node]
        while stack:
            n = stack.pop()
            assert n.lock_count == 0 and not n.slots, "a host-only subtree holds a lock or device pages"
            self._settle(n)
            self._free_host_copy(n)
            stack.extend(n.children.values())
        del node.parent.children[tuple(node.token_ids[: self.page_size])]

    def _settle(self, node: _Node) -> None:
        """Wait for a copy still writing this node's device pages before they change hands."""
        if node.loading is not None:
            self.tier.wait(node.loading)
            node.loading = None

    def _path_tokens(self, node: _Node) -> list[int]:
        return [t for n in self._handle_path(node) for t in n.token_ids]

    # -- the page invariant, both tiers -----------------------------------------------------------
    def audit(self, handles: list[object]) -> list[int]:
        """The device checks of RadixCache.audit, then the host tier's: every host page is free
        or held by exactly one node, device nodes are closed under parent, locked nodes are on
        the device. Returns the device pages, as RadixCache.audit does."""
        pages = super().audit(handles)
        ps = self.page_size
        owner: dict[int, str] = dict.fromkeys(self.host_allocator.free_page_ids, "the host free list")
        if len(owner) != self.host_allocator.num_free_pages:
            raise KVInvariantError("a host page is on the host free list twice")
        held = 0
        for node in self._nodes():
            if node.lock_count and not node.slots:
                raise KVInvariantError("a locked radix node is on the host tier only")
            if node.slots and node.parent is not self._root and not node.parent.slots:
                raise KVInvariantError("a radix node is on the device but its parent is not")
            if node.host_slots and len(node.host_slots) != len(node.token_ids):
                raise KVInvariantError(
                    f"a radix node holds {len(node.token_ids)} tokens and {len(node.host_slots)} host slots"
                )
            for i, page in enumerate(self.host_allocator.pages_of_slots(node.host_slots)):
                if node.host_slots[i * ps : (i + 1) * ps] != list(range(page * ps, page * ps + ps)):
                    raise KVInvariantError(f"radix node host slots are not host page {page}")
                if not 0 <= page < self.host_allocator.num_pages:
                    raise KVInvariantError(f"host page {page} is outside the host pool")
                if page in owner:
                    raise KVInvariantError(f"host page {page} is owned twice: by {owner[page]} and a node")
                owner[page] = "a radix node"
                held += 1
        if held != self.host_pages:
            raise KVInvariantError(
                f"radix nodes hold {held} host pages but the tree counts {self.host_pages}"
            )
        if len(owner) != self.host_allocator.num_pages:
            raise KVInvariantError(
                f"{self.host_allocator.num_pages - len(owner)} host pages are owned by no one"
            )
        return pages

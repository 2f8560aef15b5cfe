"""Radix-tree prefix cache: requests that share leading tokens share the pages holding their K/V.

Every edge holds a run of token ids and the slots storing their K/V, both a whole number of
pages long, so a page never straddles two nodes and eviction hands back whole pages.
`match` locks the path it returns (a count on every node up to the root). Because a lock
always covers a whole root path, an unlocked node has only unlocked descendants: every
unlocked page can be freed by peeling leaves, which is why `evictable_pages` is exact.
"""

from __future__ import annotations

import heapq

from minfer.kvcache.allocator import PageAllocator
from minfer.kvcache.prefix_cache import CacheCounters, KVInvariantError, PrefixMatch


class _Node:
    __slots__ = (
        "children",
        "hits",
        "host_slots",
        "last_access",
        "loading",
        "lock_count",
        "parent",
        "slots",
        "token_ids",
    )

    def __init__(self, parent: _Node | None, token_ids: list[int], slots: list[int], last_access: int):
        self.parent = parent
        # Keyed by the edge's first page of token ids: siblings always differ there.
        self.children: dict[tuple[int, ...], _Node] = {}
        self.token_ids = token_ids
        self.slots = slots  # device slots; empty while the node lives on the host tier only
        self.host_slots: list[int] = []  # host-tier slots (tiered_radix.py); empty: not on the host
        self.loading = None  # a host->device copy into `slots` still in flight (CUDA)
        self.hits = 0  # prefix matches through this node (the host tier's write-through policy)
        self.lock_count = 0
        self.last_access = last_access

    def __lt__(self, other: _Node) -> bool:  # heap order: least recently used first
        return self.last_access < other.last_access


class RadixCache:
    """Prefix cache as a radix tree over token ids at page granularity (see prefix_cache.py)."""

    def __init__(self, allocator: PageAllocator):
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.counters = CacheCounters()
        self._root = _Node(None, [], [], 0)
        # A logical clock, not wall time: two accesses never tie, so LRU order is exact.
        self._clock = 0
        self._cached_pages = 0
        self._evictable_pages = 0

    # -- the protocol ----------------------------------------------------------------------------
    def match(self, token_ids: list[int]) -> PrefixMatch:
        """Longest cached page-aligned prefix of `token_ids`, locked for the caller."""
        token_ids = list(token_ids)
        path = self._walk(token_ids)
        slots = [s for node in path for s in node.slots]
        self.counters.queried_tokens += len(token_ids)
        self.counters.hit_tokens += len(slots)
        if not path:
            return PrefixMatch([], None)
        self._lock(path[-1])
        return PrefixMatch(slots, path[-1])

    def release(self, handle: object | None) -> None:
        """Unlock the path a `match` or `insert_and_lock` handle holds."""
        node = handle
        while node is not None and node is not self._root:
            assert node.lock_count > 0, "prefix-cache handle released twice"
            node.lock_count -= 1
            if node.lock_count == 0:
                self._evictable_pages += len(node.slots) // self.page_size
            node = node.parent

    def insert(self, token_ids: list[int], slots: list[int], handle: object | None) -> None:
        """Hand the page-aligned sequence and its pages to the tree, then release `handle`."""
        self._insert(token_ids, slots)
        self.release(handle)

    def insert_and_lock(self, token_ids: list[int], slots: list[int], handle: object | None) -> PrefixMatch:
        """Like insert, but lock the inserted path for a request that keeps running.

        The returned slots back the whole prefix; where the caller's pages were duplicates
        of the tree's they were freed, so the caller must use these slots from now on.
        """
        node, tree_slots = self._insert(token_ids, slots)
        new_handle = None if node is self._root else node
        if new_handle is not None:
            self._lock(new_handle)  # before releasing the old lock, so the path is never unlocked
        self.release(handle)
        return PrefixMatch(tree_slots, new_handle)

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` unlocked pages, least recently used leaves first."""
        ps = self.page_size
        heap = [n for n in self._nodes() if not n.children and n.lock_count == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            leaf = heapq.heappop(heap)
            pages = self.allocator.pages_of_slots(leaf.slots)
            keep = len(pages) - min(len(pages), num_pages - freed)
            self.allocator.free(pages[keep:])
            freed += len(pages) - keep
            if keep:  # free no more than asked: drop the leaf's tail, its head stays cached
                leaf.token_ids, leaf.slots = leaf.token_ids[: keep * ps], leaf.slots[: keep * ps]
                break
            parent = leaf.parent
            del parent.children[tuple(leaf.token_ids[:ps])]
            if parent is not self._root and not parent.children and parent.lock_count == 0:
                heapq.heappush(heap, parent)
        self._cached_pages -= freed
        self._evictable_pages -= freed
        self.counters.evicted_pages += freed
        return freed

    def audit(self, handles: list[object]) -> list[int]:
        """Recount locks, cached and evictable pages from the tree itself; returns its pages."""
        ps = self.page_size
        expected_locks: dict[int, int] = {}
        for handle in handles:
            node = handle
            while node is not None and node is not self._root:
                expected_locks[id(node)] = expected_locks.get(id(node), 0) + 1
                node = node.parent
        pages, evictable, seen = [], 0, 0
        for node in self._nodes():
            seen += 1
            if not node.token_ids or len(node.token_ids) % ps or not (node.slots or node.host_slots):
                raise KVInvariantError(
                    f"a radix node holds {len(node.token_ids)} tokens, {len(node.slots)} device and "
                    f"{len(node.host_slots)} host slots (page size {ps})"
                )
            if node.lock_count != expected_locks.get(id(node), 0):
                raise KVInvariantError(
                    f"a radix node has lock count {node.lock_count} but "
                    f"{expected_locks.get(id(node), 0)} requests hold it"
                )
            if not node.slots:  # on the host tier only: tiered_radix.py audits its pages
                continue
            if len(node.slots) != len(node.token_ids):
                raise KVInvariantError(
                    f"a radix node holds {len(node.token_ids)} tokens and {len(node.slots)} slots"
                )
            node_pages = self.allocator.pages_of_slots(node.slots)
            for i, page in enumerate(node_pages):
                if node.slots[i * ps : (i + 1) * ps] != list(range(page * ps, page * ps + ps)):
                    raise KVInvariantError(
                        f"radix node slots {node.slots[i * ps : (i + 1) * ps]} are not page {page}"
                    )
            if node.lock_count == 0:
                evictable += len(node_pages)
            pages.extend(node_pages)
        if len(expected_locks) > seen:
            raise KVInvariantError("a request holds a lock on a node that is no longer in the tree")
        if (len(pages), evictable) != (self._cached_pages, self._evictable_pages):
            raise KVInvariantError(
                f"the radix tree holds {len(pages)} pages ({evictable} evictable) but "
                f"counts {self._cached_pages} ({self._evictable_pages} evictable)"
            )
        return pages

    def handle_slots(self, handle: object | None) -> list[int]:
        return [s for node in self._handle_path(handle) for s in node.slots]

    def _handle_path(self, handle: object | None) -> list[_Node]:
        """The nodes a handle locks, root end first (root excluded)."""
        path = []
        node = handle
        while node is not None and node is not self._root:
            path.append(node)
            node = node.parent
        return path[::-1]

    @property
    def evictable_pages(self) -> int:
        """Pages in unlocked nodes, all of which `evict` can free."""
        return self._evictable_pages

    @property
    def cached_pages(self) -> int:
        """Every page the tree holds, locked or not."""
        return self._cached_pages

    def prefix_length(self, token_ids: list[int]) -> int:
        """How many leading tokens `match` would return, without splitting, locking or touching
        the LRU order (the longest-prefix-match scheduling policy ranks waiting requests by it)."""
        return sum(common for _, common in self._edges(token_ids))

    def _edges(self, token_ids: list[int]):
        """(node, tokens of its edge matched) along the longest whole-page match of `token_ids`,
        root excluded; only the last edge may match in part. Reads the tree, changes nothing."""
        ps = self.page_size
        node, matched = self._root, 0
        while (child := node.children.get(tuple(token_ids[matched : matched + ps]))) is not None:
            common = ps
            limit = min(len(child.token_ids), len(token_ids) - matched)
            while common + ps <= limit and (
                child.token_ids[common : common + ps] == token_ids[matched + common : matched + common + ps]
            ):
                common += ps
            yield child, common
            if common < len(child.token_ids):
                return
            matched += common
            node = child

    # -- tree mechanics --------------------------------------------------------------------------
    def _walk(self, token_ids: list[int]) -> list[_Node]:
        """Nodes (root excluded) along the longest whole-page match of `token_ids`, marked used.

        The last edge is split where the match stops, so the returned path holds exactly the
        matched tokens and a lock on it pins nothing more.
        """
        ps = self.page_size
        now = self._tick()
        node, matched, path = self._root, 0, []
        # A key shorter than a page (the partial tail) finds no child: tails never match.
        while (child := node.children.get(tuple(token_ids[matched : matched + ps]))) is not None:
            common = ps  # the key lookup already matched the first page
            limit = min(len(child.token_ids), len(token_ids) - matched)
            while common + ps <= limit and (
                child.token_ids[common : common + ps] == token_ids[matched + common : matched + common + ps]
            ):
                common += ps
            if common < len(child.token_ids):
                child = self._split(child, common)
            child.last_access = now
            path.append(child)
            matched += common
            node = child
        return path

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut `node`'s edge after `at` tokens; returns the new upper node."""
        upper = _Node(node.parent, node.token_ids[:at], node.slots[:at], node.last_access)
        # Every lock on `node` runs through `upper` to the root, so it inherits the count;
        # the locked/unlocked split of pages is unchanged, as is evictable_pages.
        upper.lock_count = node.lock_count
        upper.loading, upper.hits = node.loading, node.hits
        upper.host_slots, node.host_slots = node.host_slots[:at], node.host_slots[at:]
        node.parent.children[tuple(upper.token_ids[: self.page_size])] = upper
        node.token_ids, node.slots = node.token_ids[at:], node.slots[at:]
        upper.children[tuple(node.token_ids[: self.page_size])] = node
        node.parent = upper
        return upper

    def _insert(self, token_ids: list[int], slots: list[int]) -> tuple[_Node, list[int]]:
        """Add the sequence; returns its last node and the tree's slots for all of it."""
        ps = self.page_size
        if len(token_ids) != len(slots) or len(token_ids) % ps:
            raise ValueError(
                f"insert needs equal, page-aligned runs (page_size={ps}); "
                f"got {len(token_ids)} token ids and {len(slots)} slots"
            )
        token_ids, slots = list(token_ids), [int(s) for s in slots]
        path = self._walk(token_ids)
        self._adopt(path, slots)
        tree_slots = [s for node in path for s in node.slots]
        matched = len(tree_slots)
        # The caller holds K/V for the part already cached. Pages it borrowed through `match`
        # are the tree's own (same page); the others it computed alongside another request
        # and are now duplicates, so they go back to the allocator.
        duplicates = [
            own // ps
            for own, cached in zip(slots[:matched:ps], tree_slots[::ps])
            if own // ps != cached // ps
        ]
        self.allocator.free(duplicates)
        node = path[-1] if path else self._root
        if matched < len(token_ids):
            leaf = _Node(node, token_ids[matched:], slots[matched:], self._clock)
            node.children[tuple(leaf.token_ids[:ps])] = leaf
            new_pages = (len(token_ids) - matched) // ps
            self._cached_pages += new_pages
            self._evictable_pages += new_pages  # a new leaf starts unlocked
            tree_slots += leaf.slots
            node = leaf
        return node, tree_slots

    def _adopt(self, path: list[_Node], slots: list[int]) -> None:
        """Hook of the host tier: give nodes on `path` that live on the host only the caller's
        device pages for the same tokens. The plain tree has no such nodes."""

    def _lock(self, node: _Node) -> None:
        while node is not self._root:
            if node.lock_count == 0:
                self._evictable_pages -= len(node.slots) // self.page_size
            node.lock_count += 1
            node = node.parent

    def _nodes(self):
        """Every node but the root."""
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

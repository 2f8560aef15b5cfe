"""Rules of the host KV tier: a loaded prefix is the one that was offloaded, slot by slot.

`kv_offloaded` records, per host page, the digest of the token prefix whose K/V it now holds;
`kv_loaded` must read host pages whose latest offload carried exactly the digests it reports
(a page rewritten by a later offload, or never written, is an error). On the device side an
offloaded slot leaves the prefix cache (it must not be borrowed by a live request) and a
loaded slot joins it (it must not be held or borrowed), which the cross-request slot replay
(slots.replay_slots) checks as `cache_evict` / `cache_load` slot events.
"""

from __future__ import annotations

from minfer.observability import events as schema
from minfer.observability.trace import expand_ranges

EVENTS = frozenset({schema.KV_OFFLOADED.name, schema.KV_LOADED.name, schema.KV_POOL.name})


class HostTierReplay:
    """The host tier of one scheduler process."""

    def __init__(self):
        self.page_size = 1
        self.host_digest: dict[int, str] = {}  # host page's first slot -> digest of its prefix
        self.slot_events: list[tuple[int, str, int, int]] = []
        self.errors: list[str] = []
        self.offloads = 0
        self.loads = 0

    def feed(self, index: int, event: dict) -> None:
        name = event.get("event")
        if name == schema.KV_POOL.name:
            self.page_size = event.get("page_size") or 1
            return
        try:
            device = expand_ranges(event.get("device") or [])
            host = expand_ranges(event.get("host") or [])
        except (TypeError, ValueError):
            self.errors.append(f"event #{index}: {name} device/host are not lists of [start, end) ranges")
            return
        digests = list(event.get("digests") or [])
        ps = self.page_size
        if len(device) != len(host) or len(host) != len(digests) * ps:
            self.errors.append(
                f"event #{index}: {name} moves {len(device)} device slots, {len(host)} host slots "
                f"and {len(digests)} page digests (page size {ps})"
            )
            return
        host_pages = host[::ps]
        if name == schema.KV_OFFLOADED.name:
            self.offloads += 1
            for page, digest in zip(host_pages, digests):
                self.host_digest[page] = digest
            self.slot_events += [(index, "cache_evict", slot, -1) for slot in device]
            return
        self.loads += 1
        for page, digest in zip(host_pages, digests):
            written = self.host_digest.get(page)
            if written is None:
                self.errors.append(f"event #{index}: kv_loaded reads host slot {page}, never offloaded")
            elif written != digest:
                self.errors.append(
                    f"event #{index}: kv_loaded reads host slot {page} as prefix {digest}, but the "
                    f"last offload there wrote prefix {written}"
                )
        self.slot_events += [(index, "cache_load", slot, -1) for slot in device]

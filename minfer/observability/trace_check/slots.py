"""Rules of KV slots: what kv_released must list, and every slot's life replayed across requests."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minfer.observability.trace import expand_ranges
from minfer.observability.trace_check.request import Replay

if TYPE_CHECKING:
    from minfer.observability.trace_check.stream import SchedulerStream


def on_kv_released(stream: SchedulerStream, index: int, event: dict, r: Replay) -> None:
    if r.stage != "resident":
        r.error(index, f"kv_released while {r.stage} (released twice?)")
        return
    res = r.residency
    allocated = r.state[0]
    try:
        cached, freed = expand_ranges(event.get("cached") or []), expand_ranges(event.get("freed") or [])
    except (TypeError, ValueError):
        cached, freed = [], []
        r.error(index, "cached/freed are not lists of [start, end) ranges")
    released = cached + freed
    keep = event.get("cached_len")
    if len(released) != allocated:
        r.error(index, f"released {len(released)} slot(s), but positions [0, {allocated}) hold KV")
    if not isinstance(keep, int) or not len(cached) <= keep <= allocated:
        r.error(index, f"cached_len {keep!r} outside [{len(cached)} cached slots, {allocated} allocated]")
        keep = min(len(cached), allocated)
    uid, shared_at = r.check.uid, res.prompt_cached_index
    add = stream.slot_events.append
    for position, slot in enumerate(released[:allocated]):
        in_cached = position < len(cached)
        own = res.slots[position] if position < len(res.slots) else None
        borrowed_at = res.match_index if position < res.hit else None
        if borrowed_at is None and own != slot:
            if shared_at is not None and position < res.target:
                # Another request cached these tokens first: the cache kept its page, freed
                # ours and repointed the row (KVManager.cache_prompt).
                add((shared_at, "dup_free", own, uid))
                borrowed_at = shared_at
            else:
                r.error(
                    index, f"position {position} released slot {slot}, but slot {own} was allocated there"
                )
                add((index, "release_freed", own, uid))
                continue
        if borrowed_at is not None:
            if not in_cached:
                r.error(
                    index, f"slot {slot} at position {position} is the cache's, but was released as freed"
                )
            add((borrowed_at, "borrow", slot, uid))
            add((index, "unborrow", slot, uid))
            continue
        if shared_at is not None and position < res.target:
            add((shared_at, "share", slot, uid))
        add((index, "release_cached" if in_cached else "release_freed", slot, uid))
    r.released_keep = keep
    r.residency = None
    if r.releasing_for_preemption:
        r.releasing_for_preemption = False
        r.stage, r.preempted = "waiting", True
        r.state = (0, r.state[1], r.state[1])
    else:
        r.stage = "released"
        r.state = (keep, r.state[1], r.state[1] - keep)


def replay_slots(slot_events: list[tuple[int, str, int, int]], requests: dict[int, Replay]) -> None:
    """Replay every slot's life in event order across requests.

    A slot is free, held by one live request (allocated, not released), or in the prefix
    cache (released as cached, or a prompt cached while its request runs), where any
    number of requests may borrow it. Allocating a cached slot means the cache evicted it,
    which is legal only while nobody borrows it. The host tier's `cache_evict` (an offload) and
    `cache_load` (uid -1) move a slot out of and into the cache under the same rules.
    """
    owner: dict[int, int] = {}  # slot -> uid holding it
    shareable: set[int] = set()  # held slots whose prompt is in the cache already
    cached: set[int] = set()  # slots in the cache that no live request holds
    borrowers: dict[int, set[int]] = {}

    def error(index: int, uid: int, message: str) -> None:
        replay = requests.get(uid)
        if replay is not None:
            replay.error(index, message)

    slot_events.sort(key=lambda e: e[0])  # stable: one index keeps its emission order
    for index, kind, slot, uid in slot_events:
        holder = owner.get(slot)
        users = borrowers.get(slot)
        if kind in ("cache_evict", "cache_load"):
            if holder is not None or users:
                who = f"uid {holder} holds it" if holder is not None else f"uid(s) {sorted(users)} borrow it"
                for u in (holder, *(users or ())):
                    error(
                        index, u, f"slot {slot} {kind.replace('cache_', '')}ed by the host tier while {who}"
                    )
            if kind == "cache_load":
                cached.add(slot)
            else:
                cached.discard(slot)
        elif kind == "alloc":
            if holder is not None:
                error(index, uid, f"slot {slot} allocated while uid {holder} holds it")
                error(index, holder, f"its slot {slot} was allocated to uid {uid}")
            if users:
                error(
                    index,
                    uid,
                    f"slot {slot} allocated while uid(s) {sorted(users)} borrow it from the prefix cache",
                )
            owner[slot] = uid
            cached.discard(slot)
            shareable.discard(slot)
        elif kind == "borrow":
            if not (slot in cached or (holder is not None and slot in shareable)):
                error(index, uid, f"prefix slot {slot} borrowed, but the cache did not hold it")
            borrowers.setdefault(slot, set()).add(uid)
        elif kind == "unborrow":
            if users:
                users.discard(uid)
        elif holder != uid:
            error(index, uid, f"slot {slot} ({kind}) but uid {holder} holds it")
        elif kind == "share":
            shareable.add(slot)
        else:  # dup_free, release_cached, release_freed
            del owner[slot]
            shareable.discard(slot)
            if kind == "release_cached":
                cached.add(slot)
            elif users:
                error(index, uid, f"slot {slot} freed while uid(s) {sorted(users)} borrow it")

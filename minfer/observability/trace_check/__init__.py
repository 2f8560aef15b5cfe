"""`minfer trace check`: replay a request trace and verify every request against DESIGN.md.

Per request (docs/TRACE.md lists the rules with the events they read):
  - events come in a legal order (queued first, one batch_scheduled -> kv_slots_allocated ->
    request_state_updated triple per pass, a token only after a pass that samples, nothing
    after the end, exactly one end);
  - a prefill allocates exactly the positions the prefix cache did not hold, chunk by chunk,
    from the hit up to the request's known tokens (again after each resume);
  - a decode pass allocates one slot and advances cached_len and device_len by one each;
  - every state a later event reports is the state the earlier events imply;
  - the final state of a finished request is cached_len = prompt_len + output_len - 1;
  - every allocated slot is released exactly once, cached or freed, by its request.
Across requests: no slot is allocated while a live request holds it, a prefix hit only
borrows slots the cache held, and a borrowed (locked) slot is not reallocated while borrowed.

Events of one scheduler process are checked in file order (one writer thread writes them in
the order they were emitted); a file holding several scheduler processes (two runs appended
to one file) is checked one process at a time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minfer.observability.trace import expand_ranges

SCHEDULER_EVENTS = frozenset({
    "queued", "prefix_matched", "resumed", "batch_scheduled", "kv_slots_allocated", "request_state_updated",
    "forward_done", "token_sampled", "preempted", "kv_released", "finished", "aborted"})
FRONTEND_EVENTS = frozenset({"received", "tokenized", "detokenized"})
# Informational: `kv_pool` (uid -1) gives the pool's geometry; `prompt_cached` lists positions
# repointed to the cache's slots, which the replay already infers from `kv_released`.
INFO_EVENTS = frozenset({"kv_pool", "prompt_cached"})
LENGTHS = ("cached_len", "device_len", "extend_len")


def _state(obj: dict) -> tuple[int, int, int] | None:
    try:
        return tuple(int(obj[k]) for k in LENGTHS)  # type: ignore[return-value]
    except (KeyError, TypeError, ValueError):
        return None


def _fmt(state) -> str:
    return "/".join(str(x) for x in state) if state else "?"


@dataclass
class _Residency:
    """One admission of a request: from prefix_matched to its kv_released."""

    match_index: int
    hit: int
    target: int  # device_len at admission: the prefill computes positions [hit, target)
    slots: list = field(default_factory=list)  # position -> slot; hit positions are None until release
    prefill_next: int = 0  # the next position a prefill chunk must start at
    prefill_slots: int = 0  # allocated by this admission's prefill chunks
    # The request_state_updated of the pass completing the prefill: from then on the prompt's
    # slots are in the prefix cache (shared while the request runs).
    prompt_cached_index: int | None = None
    table_idx: int | None = None


@dataclass
class RequestCheck:
    """What the replay found for one request."""

    uid: int
    pid: int
    prompt_len: int | None = None
    max_tokens: int | None = None
    hit_tokens: int = 0  # of the first admission
    prefill_slots: int = 0  # over all admissions
    prefill_chunks: int = 0
    decode_steps: int = 0
    output_len: int = 0
    preemptions: int = 0
    end: str | None = None  # "finished:<reason>" | "aborted"
    final_state: tuple | None = None
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


class _Replay:
    """The state of one request while its events are replayed."""

    def __init__(self, check: RequestCheck):
        self.check = check
        self.stage = "new"  # new -> waiting -> resident -> released -> ended (waiting again after preemption)
        self.state: tuple[int, int, int] | None = None
        self.preempted = False  # preempted and not yet resumed
        self.resumed: tuple | None = None  # the state a `resumed` event announced
        self.releasing_for_preemption = False
        self.pending_batch: tuple[str, int, int] | None = None  # (phase, chunk, index)
        self.pending_alloc: tuple[str, int, tuple] | None = None  # (phase, num_slots, state)
        self.in_flight: deque[tuple[str, bool]] = deque()  # launched passes: (phase, samples)
        self.awaiting_token = False
        self.residency: _Residency | None = None
        self.released_keep: int | None = None

    def error(self, index: int, message: str) -> None:
        self.check.errors.append(f"event #{index}: {message}")


class _SchedulerStream:
    """Replays the events of one scheduler process."""

    def __init__(self, pid: int):
        self.pid = pid
        self.requests: dict[int, _Replay] = {}
        # (event index, kind, slot, uid), replayed in index order by `_replay_slots`.
        self.slot_events: list[tuple[int, str, int, int]] = []
        self.errors: list[str] = []
        self.batch: list[dict] = []  # batch_scheduled events of the batch being read

    # -- driver ----------------------------------------------------------------------------------
    def feed(self, index: int, ev: dict) -> None:
        name = ev.get("event")
        if name != "batch_scheduled" and name != "kv_slots_allocated":
            self._close_batch(index)
        uid = ev.get("uid")
        r = self.requests.get(uid)
        if r is None:
            r = self.requests[uid] = _Replay(RequestCheck(uid=uid, pid=self.pid))
        if r.stage == "ended":
            r.error(index, f"{name} after the request ended")
            return
        if r.awaiting_token and name != "token_sampled":
            r.error(index, f"{name} where token_sampled was due (the last pass sampled a token)")
            r.awaiting_token = False
        if r.pending_batch and name != "kv_slots_allocated":
            r.error(index, f"{name} between batch_scheduled and kv_slots_allocated")
            r.pending_batch = None
        if r.pending_alloc and name != "request_state_updated":
            r.error(index, f"{name} between kv_slots_allocated and request_state_updated")
            r.pending_alloc = None
        if r.stage == "new" and name != "queued":
            r.error(index, f"{name} before queued")
        getattr(self, "_on_" + name)(index, ev, r)

    def finish(self, index: int) -> list[RequestCheck]:
        self._close_batch(index)
        self._replay_slots()
        for r in self.requests.values():
            if r.stage != "ended":
                r.error(index, f"the request never ended (last stage: {r.stage}; trace cut short?)")
        return [r.check for r in self.requests.values()]

    def _replay_slots(self) -> None:
        """Replay every slot's life in event order across requests.

        A slot is free, held by one live request (allocated, not released), or in the prefix
        cache (released as cached, or a prompt cached while its request runs), where any
        number of requests may borrow it. Allocating a cached slot means the cache evicted it,
        which is legal only while nobody borrows it.
        """
        owner: dict[int, int] = {}  # slot -> uid holding it
        shareable: set[int] = set()  # held slots whose prompt is in the cache already
        cached: set[int] = set()  # slots in the cache that no live request holds
        borrowers: dict[int, set[int]] = {}

        def error(index: int, uid: int, message: str) -> None:
            replay = self.requests.get(uid)
            if replay is not None:
                replay.error(index, message)

        self.slot_events.sort(key=lambda e: e[0])  # stable: one index keeps its emission order
        for index, kind, slot, uid in self.slot_events:
            holder = owner.get(slot)
            users = borrowers.get(slot)
            if kind == "alloc":
                if holder is not None:
                    error(index, uid, f"slot {slot} allocated while uid {holder} holds it")
                    error(index, holder, f"its slot {slot} was allocated to uid {uid}")
                if users:
                    error(index, uid, f"slot {slot} allocated while uid(s) {sorted(users)} borrow it from "
                                      "the prefix cache")
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

    def _close_batch(self, index: int) -> None:
        """A batch's batch_scheduled events are contiguous: their count must be the batch size."""
        if not self.batch:
            return
        sizes = {(e.get("phase"), e.get("batch_size")) for e in self.batch}
        if len(sizes) != 1 or len(self.batch) != next(iter(sizes))[1]:
            self.errors.append(f"event #{index}: a batch of {len(self.batch)} request(s) announced phase/size "
                               f"{sorted(sizes, key=str)}")
        if len({e.get("uid") for e in self.batch}) != len(self.batch):
            self.errors.append(f"event #{index}: a request appears twice in one batch")
        self.batch = []

    # -- intake ----------------------------------------------------------------------------------
    def _on_queued(self, index: int, ev: dict, r: _Replay) -> None:
        if r.stage != "new":
            r.error(index, "queued twice (two runs in one file from one process?)")
            return
        r.check.prompt_len = ev.get("prompt_len")
        r.check.max_tokens = ev.get("max_tokens")
        if not isinstance(r.check.prompt_len, int) or r.check.prompt_len < 1:
            r.error(index, f"queued with prompt_len {r.check.prompt_len!r}")
            r.check.prompt_len = 0
        r.state = (0, r.check.prompt_len, r.check.prompt_len)
        r.stage = "waiting"

    def _on_resumed(self, index: int, ev: dict, r: _Replay) -> None:
        if r.stage != "waiting" or not r.preempted:
            r.error(index, "resumed without a preemption before it")
        state = _state(ev)
        expected_device = (r.check.prompt_len or 0) + r.check.output_len
        if state is None or state[1] != expected_device or state[2] != state[1] - state[0]:
            r.error(index, f"resumed with state {_fmt(state)}; device_len should be prompt_len + output_len "
                           f"= {expected_device}")
        r.resumed = state
        r.preempted = False

    def _on_prefix_matched(self, index: int, ev: dict, r: _Replay) -> None:
        if r.stage != "waiting":
            r.error(index, f"prefix_matched while {r.stage}")
            return
        if r.preempted and r.check.output_len:
            r.error(index, "admitted again after a preemption without a resumed event")
        r.preempted = False
        device = r.resumed[1] if r.resumed else (r.check.prompt_len or 0) + r.check.output_len
        hit = ev.get("hit_tokens")
        if not isinstance(hit, int) or not 0 <= hit <= device - 1:
            r.error(index, f"hit_tokens {hit!r} outside [0, {device - 1}] (one token is always computed)")
            hit = 0
        if ev.get("queried_tokens") != device - 1:
            r.error(index, f"queried_tokens {ev.get('queried_tokens')!r}, expected device_len - 1 = {device - 1}")
        if r.resumed and r.resumed[0] != hit:
            r.error(index, f"hit_tokens {hit} but resumed reported cached_len {r.resumed[0]}")
        if r.residency is None and r.check.preemptions == 0:
            r.check.hit_tokens = hit
        r.resumed = None
        r.state = (hit, device, device - hit)
        r.residency = _Residency(match_index=index, hit=hit, target=device, slots=[None] * hit, prefill_next=hit)
        r.stage = "resident"

    # -- one pass --------------------------------------------------------------------------------
    def _on_batch_scheduled(self, index: int, ev: dict, r: _Replay) -> None:
        self.batch.append(ev)
        phase, chunk = ev.get("phase"), ev.get("chunk")
        if r.stage != "resident":
            r.error(index, f"batch_scheduled while {r.stage} (no KV row)")
            return
        res = r.residency
        if not isinstance(chunk, int) or chunk < 1:
            r.error(index, f"chunk {chunk!r}")
            return
        if phase == "prefill":
            if res.prefill_next >= res.target:
                r.error(index, "a prefill pass after the prompt was fully computed")
            elif chunk > res.target - res.prefill_next:
                r.error(index, f"prefill chunk {chunk} exceeds the {res.target - res.prefill_next} uncached "
                               "positions left")
        elif phase == "decode":
            if res.prefill_next < res.target:
                r.error(index, f"decode before the prefill finished ({res.prefill_next}/{res.target} positions)")
            if chunk != 1:
                r.error(index, f"decode chunk {chunk}, expected 1")
        else:
            r.error(index, f"phase {phase!r}")
            return
        r.pending_batch = (phase, chunk, index)

    def _on_kv_slots_allocated(self, index: int, ev: dict, r: _Replay) -> None:
        if not self.batch or self.batch[-1].get("uid") != r.check.uid:
            self.errors.append(f"event #{index}: kv_slots_allocated of uid {r.check.uid} does not follow "
                               "its batch_scheduled")
        if r.pending_batch is None:
            r.error(index, "kv_slots_allocated without batch_scheduled")
            return
        phase, chunk, _ = r.pending_batch
        r.pending_batch = None
        res = r.residency
        state = _state(ev)
        n = ev.get("num_slots")
        try:
            slots = expand_ranges(ev.get("out_loc") or [])
        except (TypeError, ValueError):
            slots = []
            r.error(index, f"out_loc {ev.get('out_loc')!r} is not a list of [start, end) ranges")
        if state != r.state:
            r.error(index, f"allocated at state {_fmt(state)}, but the request is at {_fmt(r.state)}")
        if n != chunk:
            r.error(index, f"num_slots {n!r} but batch_scheduled chunk {chunk}")
        if len(slots) != chunk:
            r.error(index, f"out_loc holds {len(slots)} slot(s), chunk is {chunk}")
        if state is not None and state[2] != state[1] - state[0]:
            r.error(index, f"extend_len {state[2]} != device_len - cached_len")
        start = r.state[0]
        if phase == "prefill" and start != res.prefill_next:
            r.error(index, f"prefill chunk starts at position {start}, expected {res.prefill_next}")
        if phase == "decode" and r.state[2] != 1:
            r.error(index, f"decode with extend_len {r.state[2]}, expected 1")
        table_idx = ev.get("table_idx")
        if not isinstance(table_idx, int) or table_idx < 0:
            r.error(index, f"table_idx {table_idx!r}")
        elif res.table_idx is None:
            res.table_idx = table_idx
        elif res.table_idx != table_idx:
            r.error(index, f"page-table row changed from {res.table_idx} to {table_idx} while resident")
        # Ownership across requests is replayed in `finish`, once releases show what was shared.
        del res.slots[start:]
        res.slots.extend([None] * (start - len(res.slots)))
        res.slots.extend(slots)
        for s in slots:
            self.slot_events.append((index, "alloc", s, r.check.uid))
        r.pending_alloc = (phase, chunk, r.state)

    def _on_request_state_updated(self, index: int, ev: dict, r: _Replay) -> None:
        if r.pending_alloc is None:
            r.error(index, "request_state_updated without kv_slots_allocated")
            return
        phase, n, at_alloc = r.pending_alloc
        r.pending_alloc = None
        before, after = _state(ev.get("before") or {}), _state(ev.get("after") or {})
        if before != at_alloc:
            r.error(index, f"before {_fmt(before)} differs from the allocation's state {_fmt(at_alloc)}")
        cached, device, _ = at_alloc
        samples = cached + n == device  # the pass reaches the last known token: its logits give a new one
        expected = (cached + n, device + samples, device + samples - cached - n)
        if phase == "decode" and expected != (cached + 1, device + 1, 1):
            r.error(index, f"decode from {_fmt(at_alloc)} does not advance 1/1")
        if after != expected:
            r.error(index, f"{phase} of {n} from {_fmt(at_alloc)} gave {_fmt(after)}, expected {_fmt(expected)}")
        r.state = expected
        res = r.residency
        if phase == "prefill":
            res.prefill_next += n
            res.prefill_slots += n
            r.check.prefill_slots += n
            r.check.prefill_chunks += 1
            if samples:
                res.prompt_cached_index = index
                if res.prefill_slots != res.target - res.hit:
                    r.error(index, f"the prefill allocated {res.prefill_slots} slot(s) for "
                                   f"{res.target - res.hit} uncached positions")
        else:
            r.check.decode_steps += 1
        r.in_flight.append((phase, samples))

    def _on_forward_done(self, index: int, ev: dict, r: _Replay) -> None:
        if not r.in_flight:
            r.error(index, "forward_done without a launched pass")
            return
        phase, samples = r.in_flight.popleft()
        if ev.get("phase") != phase:
            r.error(index, f"forward_done of a {ev.get('phase')!r} pass, but the oldest launched pass is {phase}")
        r.awaiting_token = samples

    def _on_token_sampled(self, index: int, ev: dict, r: _Replay) -> None:
        if not r.awaiting_token:
            r.error(index, "token_sampled without a forward_done of a sampling pass")
        r.awaiting_token = False
        r.check.output_len += 1
        if ev.get("output_len") != r.check.output_len:
            r.error(index, f"token_sampled output_len {ev.get('output_len')!r}, expected {r.check.output_len}")
        if not isinstance(ev.get("token_id"), int):
            r.error(index, f"token_id {ev.get('token_id')!r}")
        if r.check.max_tokens is not None and r.check.output_len > r.check.max_tokens:
            r.error(index, f"{r.check.output_len} tokens sampled, max_tokens is {r.check.max_tokens}")

    # -- leaving ---------------------------------------------------------------------------------
    def _on_preempted(self, index: int, ev: dict, r: _Replay) -> None:
        if r.stage != "resident":
            r.error(index, f"preempted while {r.stage}")
            return
        if _state(ev) != r.state:
            r.error(index, f"preempted at state {_fmt(_state(ev))}, but the request is at {_fmt(r.state)}")
        r.releasing_for_preemption = True
        r.check.preemptions += 1

    def _on_kv_released(self, index: int, ev: dict, r: _Replay) -> None:
        if r.stage != "resident":
            r.error(index, f"kv_released while {r.stage} (released twice?)")
            return
        res = r.residency
        allocated = r.state[0]
        try:
            cached, freed = expand_ranges(ev.get("cached") or []), expand_ranges(ev.get("freed") or [])
        except (TypeError, ValueError):
            cached, freed = [], []
            r.error(index, "cached/freed are not lists of [start, end) ranges")
        released = cached + freed
        keep = ev.get("cached_len")
        if len(released) != allocated:
            r.error(index, f"released {len(released)} slot(s), but positions [0, {allocated}) hold KV")
        if not isinstance(keep, int) or not len(cached) <= keep <= allocated:
            r.error(index, f"cached_len {keep!r} outside [{len(cached)} cached slots, {allocated} allocated]")
            keep = min(len(cached), allocated)
        uid, shared_at = r.check.uid, res.prompt_cached_index
        add = self.slot_events.append
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
                    r.error(index, f"position {position} released slot {slot}, but slot {own} was allocated there")
                    add((index, "release_freed", own, uid))
                    continue
            if borrowed_at is not None:
                if not in_cached:
                    r.error(index, f"slot {slot} at position {position} is the cache's, but was released as freed")
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

    def _on_finished(self, index: int, ev: dict, r: _Replay, aborted: bool = False) -> None:
        name = "aborted" if aborted else "finished"
        reason = ev.get("reason")
        r.check.end = "aborted" if aborted else f"finished:{reason}"
        stage = r.stage
        r.stage = "ended"
        if stage == "resident":
            r.error(index, f"{name} while holding KV (no kv_released)")
        if aborted != (reason == "abort") or reason not in ("stop", "length", "abort"):
            r.error(index, f"{name} with reason {reason!r}")
        p, o = r.check.prompt_len or 0, r.check.output_len
        if ev.get("prompt_len") != p:
            r.error(index, f"prompt_len {ev.get('prompt_len')!r}, queued with {p}")
        if ev.get("output_len") != o:
            r.error(index, f"output_len {ev.get('output_len')!r}, but {o} token(s) were sampled")
        state = _state(ev)
        r.check.final_state = state
        if state is None or state[1] != p + o or state[2] != state[1] - state[0]:
            r.error(index, f"final state {_fmt(state)}: device_len must be prompt_len + output_len = {p + o}")
        elif stage == "released":
            if state[0] != r.released_keep:
                r.error(index, f"final cached_len {state[0]}, but kv_released kept {r.released_keep}")
            if not aborted and state[0] != p + o - 1:
                r.error(index, f"final cached_len {state[0]}, expected prompt_len + output_len - 1 = {p + o - 1} "
                               "(the last sampled token never gets KV)")
        elif state[0] != 0:  # ended while waiting (never admitted, or preempted): holds no KV
            r.error(index, f"final cached_len {state[0]} for a request holding no KV")
        if not aborted and reason == "length" and r.check.max_tokens is not None and o > r.check.max_tokens:
            r.error(index, f"finished by length with {o} tokens > max_tokens {r.check.max_tokens}")
        if len(r.in_flight) > 1:
            r.error(index, f"{len(r.in_flight)} passes launched after the end (at most one, in overlap mode)")

    def _on_aborted(self, index: int, ev: dict, r: _Replay) -> None:
        self._on_finished(index, ev, r, aborted=True)


@dataclass
class TraceReport:
    requests: list[RequestCheck]
    errors: list[str]  # not tied to one request (batch composition, unknown events, front end)
    num_events: int = 0
    # Every slot's life, in event order: (event number, kind, slot, uid); kinds are alloc,
    # share, borrow, unborrow, dup_free, release_cached, release_freed (see _replay_slots).
    slot_events: list[tuple[int, str, int, int]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors and all(r.ok for r in self.requests)

    @property
    def failed(self) -> list[RequestCheck]:
        return [r for r in self.requests if not r.ok]


def check_events(events: list[dict]) -> TraceReport:
    """Replay a trace (events in file order) and return every violation found."""
    streams: dict[int, _SchedulerStream] = {}
    frontend: list[tuple[int, dict]] = []
    errors: list[str] = []
    for index, ev in enumerate(events, 1):
        name = ev.get("event")
        if name in INFO_EVENTS:
            continue
        if name in FRONTEND_EVENTS:
            frontend.append((index, ev))
        elif name in SCHEDULER_EVENTS:
            if not isinstance(ev.get("uid"), int):
                errors.append(f"event #{index}: {name} without an integer uid")
                continue
            pid = ev.get("pid")
            stream = streams.get(pid)
            if stream is None:
                stream = streams[pid] = _SchedulerStream(pid)
            stream.feed(index, ev)
        else:
            errors.append(f"event #{index}: unknown event {name!r}")
    requests: list[RequestCheck] = []
    slot_events: list[tuple[int, str, int, int]] = []
    for stream in streams.values():
        requests += stream.finish(len(events))
        errors += [f"scheduler pid {stream.pid}: {e}" for e in stream.errors]
        slot_events += stream.slot_events
    _check_frontend(frontend, streams, errors)
    slot_events.sort(key=lambda e: e[0])
    return TraceReport(requests, errors, len(events), slot_events)


def _check_frontend(frontend: list[tuple[int, dict]], streams: dict[int, _SchedulerStream],
                    errors: list[str]) -> None:
    """received / tokenized / detokenized come from other processes, so only their counts and
    contents are checked, not their place in the file."""
    by_uid: dict[int, list[RequestCheck]] = {}
    for stream in streams.values():
        for r in stream.requests.values():
            by_uid.setdefault(r.check.uid, []).append(r.check)
    seen: dict[tuple[int, str], int] = {}
    for index, ev in frontend:
        uid, name = ev.get("uid"), ev.get("event")
        checks = by_uid.get(uid)
        if name == "detokenized":
            continue
        key = (uid, name)
        seen[key] = seen.get(key, 0) + 1
        if checks is None:
            continue  # refused before the scheduler (tokenizer error, validation): nothing to compare
        if seen[key] > len(checks):
            checks[-1].errors.append(f"event #{index}: {name} more than once")
        if name == "tokenized" and all(c.prompt_len != ev.get("prompt_len") for c in checks):
            checks[-1].errors.append(f"event #{index}: tokenized prompt_len {ev.get('prompt_len')!r}, "
                                     f"the scheduler queued {checks[-1].prompt_len}")


def check_file(path: str) -> TraceReport:
    from minfer.observability.trace import read_trace

    return check_events(read_trace(path))


def format_report(report: TraceReport, max_errors: int = 3) -> str:
    """The pass/fail table, one line per request, then the errors of the failed ones."""
    header = ("uid", "prompt", "hit", "prefill", "chunks", "decode", "output", "preempt", "end", "final c/d/e",
              "check")
    rows = [header]
    for r in sorted(report.requests, key=lambda r: (r.pid, r.uid)):
        rows.append((str(r.uid), str(r.prompt_len), str(r.hit_tokens), str(r.prefill_slots), str(r.prefill_chunks),
                     str(r.decode_steps), str(r.output_len), str(r.preemptions), r.end or "-",
                     _fmt(r.final_state), "PASS" if r.ok else "FAIL"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    for r in report.failed:
        lines.append(f"uid {r.uid}: " + "; ".join(r.errors[:max_errors])
                     + (f"; ... {len(r.errors) - max_errors} more" if len(r.errors) > max_errors else ""))
    lines += report.errors[:20]
    n_failed = len(report.failed)
    verdict = "PASS" if report.ok else "FAIL"
    lines.append(f"{verdict}: {len(report.requests) - n_failed}/{len(report.requests)} requests pass, "
                 f"{len(report.errors)} trace-level error(s), {report.num_events} events")
    return "\n".join(lines)

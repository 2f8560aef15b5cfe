"""Rules of one pass: batch_scheduled -> kv_slots_allocated -> request_state_updated, then its
forward_done and token_sampled. Prefill chunks continue from the hit to the known tokens; a
decode pass computes one position."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minfer.observability.trace import expand_ranges
from minfer.observability.trace_check.request import Replay, fmt_state, read_state

if TYPE_CHECKING:
    from minfer.observability.trace_check.stream import SchedulerStream


def on_batch_scheduled(stream: SchedulerStream, index: int, event: dict, r: Replay) -> None:
    stream.batch.append(event)
    phase, chunk = event.get("phase"), event.get("chunk")
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
            r.error(
                index,
                f"prefill chunk {chunk} exceeds the {res.target - res.prefill_next} uncached positions left",
            )
    elif phase == "decode":
        if res.prefill_next < res.target:
            r.error(index, f"decode before the prefill finished ({res.prefill_next}/{res.target} positions)")
        if chunk != 1:
            r.error(index, f"decode chunk {chunk}, expected 1")
    else:
        r.error(index, f"phase {phase!r}")
        return
    r.pending_batch = (phase, chunk, index)


def on_kv_slots_allocated(stream: SchedulerStream, index: int, event: dict, r: Replay) -> None:
    if not stream.batch or stream.batch[-1].get("uid") != r.check.uid:
        stream.errors.append(
            f"event #{index}: kv_slots_allocated of uid {r.check.uid} does not follow its batch_scheduled"
        )
    if r.pending_batch is None:
        r.error(index, "kv_slots_allocated without batch_scheduled")
        return
    phase, chunk, _ = r.pending_batch
    r.pending_batch = None
    res = r.residency
    state = read_state(event)
    n = event.get("num_slots")
    try:
        slots = expand_ranges(event.get("out_loc") or [])
    except (TypeError, ValueError):
        slots = []
        r.error(index, f"out_loc {event.get('out_loc')!r} is not a list of [start, end) ranges")
    if state != r.state:
        r.error(index, f"allocated at state {fmt_state(state)}, but the request is at {fmt_state(r.state)}")
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
    table_idx = event.get("table_idx")
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
        stream.slot_events.append((index, "alloc", s, r.check.uid))
    r.pending_alloc = (phase, chunk, r.state)


def on_request_state_updated(stream: SchedulerStream, index: int, event: dict, r: Replay) -> None:
    if r.pending_alloc is None:
        r.error(index, "request_state_updated without kv_slots_allocated")
        return
    phase, n, at_alloc = r.pending_alloc
    r.pending_alloc = None
    before, after = read_state(event.get("before") or {}), read_state(event.get("after") or {})
    if before != at_alloc:
        r.error(
            index, f"before {fmt_state(before)} differs from the allocation's state {fmt_state(at_alloc)}"
        )
    cached, device, _ = at_alloc
    samples = cached + n == device  # the pass reaches the last known token: its logits give a new one
    expected = (cached + n, device + samples, device + samples - cached - n)
    if phase == "decode" and expected != (cached + 1, device + 1, 1):
        r.error(index, f"decode from {fmt_state(at_alloc)} does not advance 1/1")
    if after != expected:
        r.error(
            index,
            f"{phase} of {n} from {fmt_state(at_alloc)} gave {fmt_state(after)}, "
            f"expected {fmt_state(expected)}",
        )
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
                r.error(
                    index,
                    f"the prefill allocated {res.prefill_slots} slot(s) for "
                    f"{res.target - res.hit} uncached positions",
                )
    else:
        r.check.decode_steps += 1
    r.in_flight.append((phase, samples))


def on_forward_done(stream: SchedulerStream, index: int, event: dict, r: Replay) -> None:
    if not r.in_flight:
        r.error(index, "forward_done without a launched pass")
        return
    phase, samples = r.in_flight.popleft()
    if event.get("phase") != phase:
        r.error(
            index, f"forward_done of a {event.get('phase')!r} pass, but the oldest launched pass is {phase}"
        )
    r.awaiting_token = samples


def on_token_sampled(stream: SchedulerStream, index: int, event: dict, r: Replay) -> None:
    if not r.awaiting_token:
        r.error(index, "token_sampled without a forward_done of a sampling pass")
    r.awaiting_token = False
    r.check.output_len += 1
    if event.get("output_len") != r.check.output_len:
        r.error(index, f"token_sampled output_len {event.get('output_len')!r}, expected {r.check.output_len}")
    if not isinstance(event.get("token_id"), int):
        r.error(index, f"token_id {event.get('token_id')!r}")
    if r.check.max_tokens is not None and r.check.output_len > r.check.max_tokens:
        r.error(index, f"{r.check.output_len} tokens sampled, max_tokens is {r.check.max_tokens}")

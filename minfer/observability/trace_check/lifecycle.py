"""Rules of a request's admission and end: queued, resumed, prefix_matched, preempted, finished,
aborted (the order rules common to every event are in stream.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minfer.observability.trace_check.request import Replay, Residency, fmt_state, read_state

if TYPE_CHECKING:
    from minfer.observability.trace_check.stream import SchedulerStream


def on_queued(stream: SchedulerStream, index: int, event: dict, r: Replay) -> None:
    if r.stage != "new":
        r.error(index, "queued twice (two runs in one file from one process?)")
        return
    r.check.prompt_len = event.get("prompt_len")
    r.check.max_tokens = event.get("max_tokens")
    if not isinstance(r.check.prompt_len, int) or r.check.prompt_len < 1:
        r.error(index, f"queued with prompt_len {r.check.prompt_len!r}")
        r.check.prompt_len = 0
    r.state = (0, r.check.prompt_len, r.check.prompt_len)
    r.stage = "waiting"


def on_resumed(stream: SchedulerStream, index: int, event: dict, r: Replay) -> None:
    if r.stage != "waiting" or not r.preempted:
        r.error(index, "resumed without a preemption before it")
    state = read_state(event)
    expected_device = (r.check.prompt_len or 0) + r.check.output_len
    if state is None or state[1] != expected_device or state[2] != state[1] - state[0]:
        r.error(
            index,
            f"resumed with state {fmt_state(state)}; device_len should be prompt_len + output_len "
            f"= {expected_device}",
        )
    r.resumed = state
    r.preempted = False


def on_prefix_matched(stream: SchedulerStream, index: int, event: dict, r: Replay) -> None:
    if r.stage != "waiting":
        r.error(index, f"prefix_matched while {r.stage}")
        return
    if r.preempted and r.check.output_len:
        r.error(index, "admitted again after a preemption without a resumed event")
    r.preempted = False
    device = r.resumed[1] if r.resumed else (r.check.prompt_len or 0) + r.check.output_len
    hit = event.get("hit_tokens")
    if not isinstance(hit, int) or not 0 <= hit <= device - 1:
        r.error(index, f"hit_tokens {hit!r} outside [0, {device - 1}] (one token is always computed)")
        hit = 0
    if event.get("queried_tokens") != device - 1:
        r.error(
            index, f"queried_tokens {event.get('queried_tokens')!r}, expected device_len - 1 = {device - 1}"
        )
    if r.resumed and r.resumed[0] != hit:
        r.error(index, f"hit_tokens {hit} but resumed reported cached_len {r.resumed[0]}")
    if r.residency is None and r.check.preemptions == 0:
        r.check.hit_tokens = hit
    r.resumed = None
    r.state = (hit, device, device - hit)
    r.residency = Residency(match_index=index, hit=hit, target=device, slots=[None] * hit, prefill_next=hit)
    r.stage = "resident"


def on_preempted(stream: SchedulerStream, index: int, event: dict, r: Replay) -> None:
    if r.stage != "resident":
        r.error(index, f"preempted while {r.stage}")
        return
    if read_state(event) != r.state:
        r.error(
            index,
            f"preempted at state {fmt_state(read_state(event))}, but the request is at {fmt_state(r.state)}",
        )
    r.releasing_for_preemption = True
    r.check.preemptions += 1


def on_finished(stream: SchedulerStream, index: int, event: dict, r: Replay, aborted: bool = False) -> None:
    name = "aborted" if aborted else "finished"
    reason = event.get("reason")
    r.check.end = "aborted" if aborted else f"finished:{reason}"
    stage = r.stage
    r.stage = "ended"
    if stage == "resident":
        r.error(index, f"{name} while holding KV (no kv_released)")
    if aborted != (reason == "abort") or reason not in ("stop", "length", "abort"):
        r.error(index, f"{name} with reason {reason!r}")
    p, o = r.check.prompt_len or 0, r.check.output_len
    if event.get("prompt_len") != p:
        r.error(index, f"prompt_len {event.get('prompt_len')!r}, queued with {p}")
    if event.get("output_len") != o:
        r.error(index, f"output_len {event.get('output_len')!r}, but {o} token(s) were sampled")
    state = read_state(event)
    r.check.final_state = state
    if state is None or state[1] != p + o or state[2] != state[1] - state[0]:
        r.error(
            index, f"final state {fmt_state(state)}: device_len must be prompt_len + output_len = {p + o}"
        )
    elif stage == "released":
        if state[0] != r.released_keep:
            r.error(index, f"final cached_len {state[0]}, but kv_released kept {r.released_keep}")
        if not aborted and state[0] != p + o - 1:
            r.error(
                index,
                f"final cached_len {state[0]}, expected prompt_len + output_len - 1 = {p + o - 1} "
                "(the last sampled token never gets KV)",
            )
    elif state[0] != 0:  # ended while waiting (never admitted, or preempted): holds no KV
        r.error(index, f"final cached_len {state[0]} for a request holding no KV")
    if not aborted and reason == "length" and r.check.max_tokens is not None and o > r.check.max_tokens:
        r.error(index, f"finished by length with {o} tokens > max_tokens {r.check.max_tokens}")
    if len(r.in_flight) > 1:
        r.error(index, f"{len(r.in_flight)} passes launched after the end (at most one, in overlap mode)")


def on_aborted(stream: SchedulerStream, index: int, event: dict, r: Replay) -> None:
    on_finished(stream, index, event, r, aborted=True)

"""The state the checker keeps per request while its events are replayed, and what it reports."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minfer.observability.events import LENGTHS


def read_state(obj: dict) -> tuple[int, int, int] | None:
    """(cached_len, device_len, extend_len) of an event or a `before`/`after` dict; None if malformed."""
    try:
        return tuple(int(obj[k]) for k in LENGTHS)  # type: ignore[return-value]
    except (KeyError, TypeError, ValueError):
        return None


def fmt_state(state) -> str:
    return "/".join(str(x) for x in state) if state else "?"


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


@dataclass
class Residency:
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


class Replay:
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
        self.residency: Residency | None = None
        self.released_keep: int | None = None

    def error(self, index: int, message: str) -> None:
        self.check.errors.append(f"event #{index}: {message}")

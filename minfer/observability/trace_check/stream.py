"""The replay of one scheduler process's events: order rules common to every event, dispatch to
the rules of each event (lifecycle.py, passes.py, slots.py), and batch composition."""

from __future__ import annotations

from collections.abc import Callable

from minfer.observability import events as schema
from minfer.observability.trace_check import lifecycle, passes, slots
from minfer.observability.trace_check.request import Replay, RequestCheck

# The rules of every replayed scheduler event (a test checks that each one has its rules).
RULES: dict[str, Callable] = {
    schema.QUEUED.name: lifecycle.on_queued,
    schema.RESUMED.name: lifecycle.on_resumed,
    schema.PREFIX_MATCHED.name: lifecycle.on_prefix_matched,
    schema.BATCH_SCHEDULED.name: passes.on_batch_scheduled,
    schema.KV_SLOTS_ALLOCATED.name: passes.on_kv_slots_allocated,
    schema.REQUEST_STATE_UPDATED.name: passes.on_request_state_updated,
    schema.FORWARD_DONE.name: passes.on_forward_done,
    schema.TOKEN_SAMPLED.name: passes.on_token_sampled,
    schema.PREEMPTED.name: lifecycle.on_preempted,
    schema.KV_RELEASED.name: slots.on_kv_released,
    schema.FINISHED.name: lifecycle.on_finished,
    schema.ABORTED.name: lifecycle.on_aborted,
}
_IN_BATCH = frozenset({schema.BATCH_SCHEDULED.name, schema.KV_SLOTS_ALLOCATED.name})


class SchedulerStream:
    """Replays the events of one scheduler process."""

    def __init__(self, pid: int):
        self.pid = pid
        self.requests: dict[int, Replay] = {}
        # (event index, kind, slot, uid), replayed in index order by `slots.replay_slots`.
        self.slot_events: list[tuple[int, str, int, int]] = []
        self.errors: list[str] = []
        self.batch: list[dict] = []  # batch_scheduled events of the batch being read

    def feed(self, index: int, event: dict) -> None:
        name = event.get("event")
        if name not in _IN_BATCH:
            self._close_batch(index)
        uid = event.get("uid")
        r = self.requests.get(uid)
        if r is None:
            r = self.requests[uid] = Replay(RequestCheck(uid=uid, pid=self.pid))
        if r.stage == "ended":
            r.error(index, f"{name} after the request ended")
            return
        if r.awaiting_token and name != schema.TOKEN_SAMPLED.name:
            r.error(index, f"{name} where token_sampled was due (the last pass sampled a token)")
            r.awaiting_token = False
        if r.pending_batch and name != schema.KV_SLOTS_ALLOCATED.name:
            r.error(index, f"{name} between batch_scheduled and kv_slots_allocated")
            r.pending_batch = None
        if r.pending_alloc and name != schema.REQUEST_STATE_UPDATED.name:
            r.error(index, f"{name} between kv_slots_allocated and request_state_updated")
            r.pending_alloc = None
        if r.stage == "new" and name != schema.QUEUED.name:
            r.error(index, f"{name} before queued")
        RULES[name](self, index, event, r)

    def finish(self, index: int) -> list[RequestCheck]:
        self._close_batch(index)
        slots.replay_slots(self.slot_events, self.requests)
        for r in self.requests.values():
            if r.stage != "ended":
                r.error(index, f"the request never ended (last stage: {r.stage}; trace cut short?)")
        return [r.check for r in self.requests.values()]

    def _close_batch(self, index: int) -> None:
        """A batch's batch_scheduled events are contiguous: their count must be the batch size."""
        if not self.batch:
            return
        sizes = {(e.get("phase"), e.get("batch_size")) for e in self.batch}
        if len(sizes) != 1 or len(self.batch) != next(iter(sizes))[1]:
            self.errors.append(
                f"event #{index}: a batch of {len(self.batch)} request(s) announced phase/size "
                f"{sorted(sizes, key=str)}"
            )
        if len({e.get("uid") for e in self.batch}) != len(self.batch):
            self.errors.append(f"event #{index}: a request appears twice in one batch")
        self.batch = []

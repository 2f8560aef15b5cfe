"""Request timelines from a trace: what `minfer trace show` prints and `minfer trace plot` draws.

Times are seconds (time.time() of the events); a request starts when the api server received
it (`received`) or, offline, when the scheduler queued it. TTFT and inter-token gaps are
measured at `token_sampled`, when the scheduler reads the token on the CPU.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass, field

from minfer.observability import events as schema


@dataclass
class RequestTimeline:
    uid: int
    prompt_len: int = 0
    max_tokens: int | None = None
    hit_tokens: int | None = None  # of the first admission
    received: float | None = None
    queued: float | None = None
    admitted: float | None = None  # first prefix_matched
    first_token: float | None = None
    end: float | None = None
    end_reason: str | None = None  # stop | length | abort
    prefill_chunks: list[tuple[float, int]] = field(default_factory=list)  # (ts, tokens)
    decode_steps: int = 0
    token_times: list[float] = field(default_factory=list)
    preemptions: list[list] = field(default_factory=list)  # [preempted ts, re-admitted ts or None]
    events: list[dict] = field(default_factory=list)

    @property
    def start(self) -> float | None:
        return self.received if self.received is not None else self.queued

    @property
    def output_len(self) -> int:
        return len(self.token_times)

    @property
    def queue_wait(self) -> float | None:
        return None if self.admitted is None or self.queued is None else self.admitted - self.queued

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None or self.start is None else self.first_token - self.start

    @property
    def e2e(self) -> float | None:
        return None if self.end is None or self.start is None else self.end - self.start

    @property
    def gaps(self) -> list[float]:
        """Inter-token gaps: time between consecutive tokens."""
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]


@dataclass
class Step:
    """One forward pass, from its batch_scheduled events."""

    ts: float
    phase: str
    batch_size: int
    num_tokens: int


@dataclass
class Timeline:
    requests: dict[int, RequestTimeline]
    steps: list[Step]
    # (ts, slots live requests hold) after each change: allocated and not yet released or handed
    # to the prefix cache as a duplicate; borrowed prefix-cache slots are not counted.
    kv_held: list[tuple[float, int]]
    t0: float
    t1: float


def build_timeline(events: list[dict]) -> Timeline:
    requests: dict[int, RequestTimeline] = {}
    steps: list[Step] = []
    batch: list[dict] = []

    def close_batch() -> None:
        if batch:
            steps.append(
                Step(
                    batch[0]["ts"],
                    batch[0].get("phase", "?"),
                    len(batch),
                    sum(e.get("chunk", 0) for e in batch),
                )
            )
            batch.clear()

    for ev in events:
        name, ts, uid = ev.get("event"), ev.get("ts", 0.0), ev.get("uid")
        if name == schema.BATCH_SCHEDULED.name:
            batch.append(ev)
        elif name != schema.KV_SLOTS_ALLOCATED.name:
            close_batch()
        r = requests.get(uid)
        if r is None:
            r = requests[uid] = RequestTimeline(uid)
        r.events.append(ev)
        if name == schema.RECEIVED.name:
            r.received = ts
        elif name == schema.QUEUED.name:
            r.queued, r.prompt_len, r.max_tokens = ts, ev.get("prompt_len", 0), ev.get("max_tokens")
        elif name == schema.PREFIX_MATCHED.name:
            if r.admitted is None:
                r.admitted, r.hit_tokens = ts, ev.get("hit_tokens", 0)
            if r.preemptions and r.preemptions[-1][1] is None:
                r.preemptions[-1][1] = ts
        elif name == schema.BATCH_SCHEDULED.name:
            if ev.get("phase") == "prefill":
                r.prefill_chunks.append((ts, ev.get("chunk", 0)))
            else:
                r.decode_steps += 1
        elif name == schema.TOKEN_SAMPLED.name:
            r.token_times.append(ts)
            if r.first_token is None:
                r.first_token = ts
        elif name == schema.PREEMPTED.name:
            r.preemptions.append([ts, None])
        elif name in (schema.FINISHED.name, schema.ABORTED.name):
            r.end, r.end_reason = ts, ev.get("reason")
    close_batch()
    kv_held = _slots_held(events)
    stamps = [e["ts"] for e in events if "ts" in e]
    t0, t1 = (min(stamps), max(stamps)) if stamps else (0.0, 0.0)
    for r in requests.values():
        r.events.sort(key=lambda e: e.get("ts", 0.0))  # front-end events come from other processes
    return Timeline(requests, steps, kv_held, t0, t1)


def _slots_held(events: list[dict]) -> list[tuple[float, int]]:
    """Slots held over time, from the checker's replay of every slot's life (which knows which
    slots a prompt handed to the prefix cache as duplicates, something no single event says)."""
    from minfer.observability.trace_check import check_events

    held, out = 0, []
    for index, kind, _slot, _uid in check_events(events).slot_events:
        delta = {"alloc": 1, "dup_free": -1, "release_cached": -1, "release_freed": -1}.get(kind)
        if delta:
            held += delta
            ts = events[index - 1].get("ts", 0.0)
            if out and out[-1][0] == ts:
                out[-1] = (ts, held)
            else:
                out.append((ts, held))
    return out


# -- text ----------------------------------------------------------------------------------------
def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def format_summary(tl: Timeline) -> str:
    """One line per request, then distributions over all of them."""
    header = (
        "uid",
        "prompt",
        "hit",
        "queue_ms",
        "prefill",
        "ttft_ms",
        "output",
        "decode",
        "itl_mean_ms",
        "itl_max_ms",
        "e2e_ms",
        "preempt",
        "end",
    )
    rows = [header]
    reqs = sorted(
        (r for r in tl.requests.values() if r.queued is not None), key=lambda r: (r.start or 0, r.uid)
    )
    for r in reqs:
        gaps = r.gaps
        chunks = r.prefill_chunks
        prefill = f"{sum(n for _, n in chunks)}/{len(chunks)}" if chunks else "-"
        rows.append(
            (
                str(r.uid),
                str(r.prompt_len),
                "-" if r.hit_tokens is None else str(r.hit_tokens),
                _ms(r.queue_wait),
                prefill,
                _ms(r.ttft),
                str(r.output_len),
                str(r.decode_steps),
                _ms(statistics.fmean(gaps)) if gaps else "-",
                _ms(max(gaps)) if gaps else "-",
                _ms(r.e2e),
                str(len(r.preemptions)),
                r.end_reason or "(running)",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines.append(
        "prefill = tokens computed / chunks; queue = queued -> admitted; ttft and e2e from "
        "received (or queued, offline); itl = gap between tokens read by the scheduler"
    )
    ttft = [r.ttft for r in reqs if r.ttft is not None]
    e2e = [r.e2e for r in reqs if r.e2e is not None]
    gaps = [g for r in reqs for g in r.gaps]
    for name, values in (("ttft", ttft), ("itl", gaps), ("e2e", e2e)):
        if values:
            lines.append(
                f"{name:>4}: mean {_ms(statistics.fmean(values))} ms, p50 {_ms(_pct(values, 0.5))} ms, "
                f"p99 {_ms(_pct(values, 0.99))} ms, max {_ms(max(values))} ms over {len(values)}"
            )
    duration = tl.t1 - tl.t0
    tokens = sum(r.output_len for r in reqs)
    prefill_steps = sum(1 for s in tl.steps if s.phase == "prefill")
    lines.append(
        f"{len(reqs)} requests, {tokens} tokens generated in {duration:.3f} s "
        f"({tokens / duration if duration > 0 else 0:.1f} tok/s); {len(tl.steps)} passes "
        f"({prefill_steps} prefill, {len(tl.steps) - prefill_steps} decode)"
    )
    return "\n".join(lines)


def describe_event(ev: dict) -> str:
    """A short human reading of one event."""
    name = ev.get("event")

    def lens(obj: dict) -> str:
        return "/".join(str(obj.get(k)) for k in schema.LENGTHS)

    if name == schema.QUEUED.name:
        return f"prompt_len {ev.get('prompt_len')}, max_tokens {ev.get('max_tokens')}"
    if name == schema.TOKENIZED.name:
        return f"prompt_len {ev.get('prompt_len')}"
    if name == schema.PREFIX_MATCHED.name:
        return f"hit {ev.get('hit_tokens')} of {ev.get('queried_tokens')} queried tokens"
    if name == schema.BATCH_SCHEDULED.name:
        return f"{ev.get('phase')} chunk {ev.get('chunk')} in a batch of {ev.get('batch_size')}"
    if name == schema.KV_SLOTS_ALLOCATED.name:
        ranges = ", ".join(f"[{a},{b})" for a, b in ev.get("out_loc", []))
        return f"{ev.get('num_slots')} slot(s) {ranges} row {ev.get('table_idx')} at c/d/e {lens(ev)}"
    if name == schema.REQUEST_STATE_UPDATED.name:
        return f"c/d/e {lens(ev.get('before', {}))} -> {lens(ev.get('after', {}))}"
    if name == schema.FORWARD_DONE.name:
        return f"{ev.get('phase')} pass done"
    if name == schema.TOKEN_SAMPLED.name:
        return f"token #{ev.get('output_len')} = {ev.get('token_id')}"
    if name == schema.DETOKENIZED.name:
        return f"+{ev.get('text_len')} chars" + (
            f", {ev.get('finish_reason')}" if ev.get("finish_reason") else ""
        )
    if name in (schema.PREEMPTED.name, schema.RESUMED.name):
        return f"at c/d/e {lens(ev)}"
    if name == schema.KV_RELEASED.name:

        def fmt(key: str) -> str:
            return ", ".join(f"[{a},{b})" for a, b in ev.get(key, [])) or "none"

        return f"cached {fmt('cached')}; freed {fmt('freed')}; keeps {ev.get('cached_len')}"
    if name in (schema.FINISHED.name, schema.ABORTED.name):
        return f"{ev.get('reason')}: output_len {ev.get('output_len')}, final c/d/e {lens(ev)}"
    return ""


def format_request(tl: Timeline, uid: int) -> str:
    """Every event of one request with the time since its start, then its timings."""
    r = tl.requests.get(uid)
    if r is None or not r.events:
        raise KeyError(f"uid {uid} is not in the trace")
    start = r.start if r.start is not None else r.events[0].get("ts", 0.0)
    lines = [
        f"request {uid}: prompt_len {r.prompt_len}, {r.output_len} token(s), end {r.end_reason or '(running)'}"
    ]
    for ev in r.events:
        lines.append(
            f"{(ev.get('ts', start) - start) * 1000:10.3f} ms  {ev.get('event'):<22} {describe_event(ev)}"
        )
    gaps = r.gaps
    lines.append(
        f"queue {_ms(r.queue_wait)} ms, prefill {len(r.prefill_chunks)} chunk(s), ttft {_ms(r.ttft)} ms, "
        f"{r.decode_steps} decode step(s), itl mean {_ms(statistics.fmean(gaps)) if gaps else '-'} ms "
        f"max {_ms(max(gaps)) if gaps else '-'} ms, e2e {_ms(r.e2e)} ms, "
        f"{len(r.preemptions)} preemption(s)"
    )
    return "\n".join(lines)

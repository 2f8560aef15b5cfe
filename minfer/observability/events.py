"""The request trace's schema, declared once: every event, the process that emits it, its fields.

The emitters pass these specs to `RequestTracer.emit` (a bare string is refused, so a misspelt
event name fails where it is written); `minfer trace check` reports an event that is not here
or one that lacks a declared field; `minfer trace show` reads the names from here; and the event
tables of docs/TRACE.md are `render_doc_tables()` (a test keeps them equal). To change the
trace, change it here and run `python -m minfer.observability.events --write docs/TRACE.md`.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

API_SERVER, TOKENIZER, DETOKENIZER, SCHEDULER = "api server", "tokenizer", "detokenizer", "scheduler"


@dataclass(frozen=True)
class Field:
    """One field of an event line and what it means."""

    name: str
    meaning: str


@dataclass(frozen=True)
class EventSpec:
    """One event: its name, the process writing it, when, and its fields beyond the common ones.

    `replayed` is False for events the per-request replay does not read: `kv_pool` (the pool's
    geometry), `prompt_cached` (repointings the replay infers from `kv_released`), and the host
    tier's `kv_offloaded` / `kv_loaded` (uid -1, checked by trace_check/host_tier.py).
    """

    name: str
    process: str
    when: str
    fields: tuple[Field, ...] = ()
    replayed: bool = True

    @property
    def field_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)


# Every line carries these before the event's own fields.
COMMON_FIELDS = (
    Field("ts", "wall-clock seconds (`time.time()`), comparable across the processes of one host"),
    Field("pid", "the process that wrote it (the scheduler's for scheduler events)"),
    Field("uid", "the request's id: the server's request id, or the offline scheduler's counter"),
    Field("event", "one of the names below"),
)

# A request's state, in this order wherever it is reported (written c/d/e by the tools).
LENGTHS = ("cached_len", "device_len", "extend_len")


def _state(meaning: str) -> tuple[Field, ...]:
    return tuple(Field(name, meaning) for name in LENGTHS)


_END_FIELDS = (
    Field("prompt_len", "tokens in the prompt"),
    Field("output_len", "tokens generated"),
    *_state("the final state"),
)

RECEIVED = EventSpec("received", API_SERVER, "the api server submitted the request")
TOKENIZED = EventSpec(
    "tokenized",
    TOKENIZER,
    "the tokenizer turned the prompt into ids",
    (Field("prompt_len", "tokens in the prompt"),),
)
DETOKENIZED = EventSpec(
    "detokenized",
    DETOKENIZER,
    "the detokenizer sent a reply",
    (
        Field(
            "text_len",
            "characters of new text (0 while incomplete UTF-8 or a possible stop string is held back)",
        ),
        Field("completion_tokens", "tokens generated so far"),
        Field("finish_reason", "`stop`, `length` or `abort` on the last reply, else null"),
    ),
)

QUEUED = EventSpec(
    "queued",
    SCHEDULER,
    "accepted into the waiting queue",
    (Field("prompt_len", "tokens in the prompt"), Field("max_tokens", "the most tokens it may generate")),
)
KV_POOL = EventSpec(
    "kv_pool",
    SCHEDULER,
    "the scheduler started (uid -1): the pool's geometry",
    (Field("num_slots", "KV slots in the pool, one per token"), Field("page_size", "slots per page")),
    replayed=False,
)
RESUMED = EventSpec(
    "resumed", SCHEDULER, "a preempted request is admitted again", _state("the state after the prefix match")
)
PREFIX_MATCHED = EventSpec(
    "prefix_matched",
    SCHEDULER,
    "admitted: got a page-table row and a prefix-cache lookup",
    (
        Field("hit_tokens", "leading positions whose K/V the prefix cache held"),
        Field("queried_tokens", "positions looked up, `device_len - 1` (one token is always computed)"),
    ),
)
BATCH_SCHEDULED = EventSpec(
    "batch_scheduled",
    SCHEDULER,
    "the request is in the next pass; a batch's `batch_scheduled` events are consecutive",
    (
        Field("phase", "`prefill` or `decode`"),
        Field("batch_size", "requests in the pass"),
        Field("chunk", "positions this request computes in it"),
    ),
)
KV_SLOTS_ALLOCATED = EventSpec(
    "kv_slots_allocated",
    SCHEDULER,
    "right after its `batch_scheduled`: the pass's slots",
    (
        *_state("the state before the pass"),
        Field("num_slots", "slots for positions `[cached_len, cached_len + num_slots)`"),
        Field("out_loc", "those slots, in position order"),
        Field("table_idx", "the request's page-table row"),
    ),
)
REQUEST_STATE_UPDATED = EventSpec(
    "request_state_updated",
    SCHEDULER,
    "the pass was launched: the lengths advance now, not when its tokens are read",
    (
        Field("before", "`{cached_len, device_len, extend_len}` before the pass"),
        Field("after", "the same after it"),
    ),
)
PROMPT_CACHED = EventSpec(
    "prompt_cached",
    SCHEDULER,
    "right after the `request_state_updated` of the pass completing the prompt: its pages entered "
    "the prefix cache",
    (
        Field("cached_len", "the request's `cached_len` after that pass"),
        Field("repointed", "`[position, freed slot, cache slot]` per position another request cached first"),
    ),
    replayed=False,
)
FORWARD_DONE = EventSpec(
    "forward_done", SCHEDULER, "the pass's results reached the CPU", (Field("phase", "the pass's phase"),)
)
TOKEN_SAMPLED = EventSpec(
    "token_sampled",
    SCHEDULER,
    "a new token",
    (Field("token_id", "the token"), Field("output_len", "tokens generated, this one included")),
)
PREEMPTED = EventSpec(
    "preempted",
    SCHEDULER,
    "sent back to the front of the queue, tokens kept; a `kv_released` follows",
    _state("the state when preempted"),
)
KV_RELEASED = EventSpec(
    "kv_released",
    SCHEDULER,
    "the request gave back every slot it held, positions `[0, allocated)` in order",
    (
        Field("cached", "slots that went to the prefix cache"),
        Field("freed", "slots that went back to the allocator"),
        Field("cached_len", "what the request keeps as its `cached_len`"),
    ),
)
_TRANSFER_FIELDS = (
    Field("device", "device slots of the node's pages, `[start, end)` ranges in position order"),
    Field("host", "host-tier slots of the same positions, `[start, end)` ranges"),
    Field(
        "digests",
        "per page, a digest of every token id from position 0 through that page: K/V of a page "
        "depends on the whole prefix before it",
    ),
)
KV_OFFLOADED = EventSpec(
    "kv_offloaded",
    SCHEDULER,
    "(uid -1) the device pool evicted a prefix-cache node and wrote it back to the host tier "
    "(under `--host-kv-write-policy write_through`, also: evicted a node whose host copy was made on "
    "its second hit; the copy is announced when the device copy goes)",
    _TRANSFER_FIELDS,
    replayed=False,
)
KV_LOADED = EventSpec(
    "kv_loaded",
    SCHEDULER,
    "(uid -1) a prefix hit on the host tier copied a node into fresh device pages, before the "
    "`prefix_matched` of the request that hit it",
    _TRANSFER_FIELDS,
    replayed=False,
)
FINISHED = EventSpec(
    "finished", SCHEDULER, "the request ended", (Field("reason", "`stop` or `length`"), *_END_FIELDS)
)
ABORTED = EventSpec(
    "aborted",
    SCHEDULER,
    "the client went away, `/abort_request`, a stop string, or `scheduler.abort(uid)`",
    (Field("reason", "`abort`"), *_END_FIELDS),
)

# Documentation order: front end first, then the scheduler's events in a request's order.
EVENTS: tuple[EventSpec, ...] = (
    RECEIVED,
    TOKENIZED,
    DETOKENIZED,
    QUEUED,
    KV_POOL,
    RESUMED,
    PREFIX_MATCHED,
    BATCH_SCHEDULED,
    KV_SLOTS_ALLOCATED,
    REQUEST_STATE_UPDATED,
    PROMPT_CACHED,
    FORWARD_DONE,
    TOKEN_SAMPLED,
    PREEMPTED,
    KV_RELEASED,
    KV_OFFLOADED,
    KV_LOADED,
    FINISHED,
    ABORTED,
)
BY_NAME: dict[str, EventSpec] = {spec.name: spec for spec in EVENTS}


def schema_errors(ev: dict, exact: bool = False) -> list[str]:
    """What makes one trace line disagree with the schema: an unknown event or a missing field,
    and with `exact` (the tests' check of the emitters) a field the schema does not declare."""
    name = ev.get("event")
    spec = BY_NAME.get(name)
    if spec is None:
        return [f"unknown event {name!r}"]
    declared = (*(c.name for c in COMMON_FIELDS), *spec.field_names)
    errors = []
    missing = [f for f in declared if f not in ev]
    if missing:
        errors.append(f"{name} of uid {ev.get('uid')!r} lacks field(s) {', '.join(missing)}")
    extra = [f for f in ev if f not in declared] if exact else []
    if extra:
        errors.append(f"{name} of uid {ev.get('uid')!r} has undeclared field(s) {', '.join(extra)}")
    return errors


# -- docs/TRACE.md ---------------------------------------------------------------------------------
def _fields_cell(fields: tuple[Field, ...]) -> str:
    """`a`: meaning; `b`, `c`: shared meaning (consecutive fields with one meaning are joined)."""
    groups: list[tuple[list[str], str]] = []
    for f in fields:
        if groups and groups[-1][1] == f.meaning:
            groups[-1][0].append(f.name)
        else:
            groups.append(([f.name], f.meaning))
    cells = [", ".join(f"`{n}`" for n in names) + f": {meaning}" for names, meaning in groups]
    return "; ".join(cells) or "—"


def render_common_table() -> str:
    """The table of the fields every line has."""
    rows = ["| field | meaning |", "| --- | --- |"]
    rows += [f"| `{f.name}` | {f.meaning} |" for f in COMMON_FIELDS]
    return "\n".join(rows)


def render_event_table(specs: list[EventSpec]) -> str:
    """One markdown table of events; a `process` column when they come from several processes."""
    several = len({s.process for s in specs}) > 1
    header = "| event | process | fields | when |" if several else "| event | fields | when |"
    rows = [header, "| --- | --- | --- | --- |" if several else "| --- | --- | --- |"]
    for s in specs:
        process = f" {s.process} |" if several else ""
        rows.append(f"| `{s.name}` |{process} {_fields_cell(s.fields)} | {s.when} |")
    return "\n".join(rows)


def render_doc_tables() -> list[str]:
    """docs/TRACE.md's generated tables, in the page's order: common fields, front end, scheduler."""
    return [
        render_common_table(),
        render_event_table([s for s in EVENTS if s.process != SCHEDULER]),
        render_event_table([s for s in EVENTS if s.process == SCHEDULER]),
    ]


# A generated table: its header row names `field` or `event` first, and it runs to a blank line.
_TABLE = re.compile(r"^\| (?:field \| meaning|event \|)[^\n]*\n(?:\|[^\n]*\n?)*", re.MULTILINE)


def doc_tables(text: str) -> list[str]:
    """The schema tables found in a markdown page, in order."""
    return [m.group(0).rstrip("\n") for m in _TABLE.finditer(text)]


def sync_doc(text: str) -> str:
    """The page with its schema tables replaced by the rendered ones (same number, same order)."""
    rendered = render_doc_tables()
    found = list(_TABLE.finditer(text))
    if len(found) != len(rendered):
        raise ValueError(f"the page holds {len(found)} schema table(s), the schema renders {len(rendered)}")
    pieces, last = [], 0
    for match, table in zip(found, rendered):
        pieces += [text[last : match.start()], table + "\n"]
        last = match.end()
    return "".join(pieces) + text[last:]


def main(argv: list[str]) -> int:
    """`python -m minfer.observability.events [--write PAGE]`: print the tables, or rewrite them in PAGE."""
    if len(argv) == 2 and argv[0] == "--write":
        with open(argv[1]) as f:
            text = f.read()
        with open(argv[1], "w") as f:
            f.write(sync_doc(text))
        return 0
    print("\n\n".join(render_doc_tables()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The trace schema (observability/events.py) is the one declaration: the emitters write exactly
it, the checker enforces it, and docs/TRACE.md's tables are rendered from it."""

from __future__ import annotations

import copy
import inspect
from pathlib import Path

import pytest

from minfer.observability import events as schema
from minfer.observability.scheduler_trace import NullSchedulerTrace, SchedulerTrace, scheduler_trace
from minfer.observability.trace import NULL_TRACER, RequestTracer, read_trace
from minfer.observability.trace_check import REPLAYED_EVENTS, check_events, format_report
from minfer.observability.trace_check.stream import RULES

DOC = Path(__file__).resolve().parents[2] / "docs" / "TRACE.md"


def test_doc_tables_are_the_rendered_schema():
    text = DOC.read_text()
    assert schema.doc_tables(text) == schema.render_doc_tables(), (
        "docs/TRACE.md's event tables differ from observability/events.py: run "
        "`python -m minfer.observability.events --write docs/TRACE.md`"
    )
    assert schema.sync_doc(text) == text


def test_sync_doc_rewrites_a_stale_table():
    text = DOC.read_text()
    stale = text.replace(
        "| `queued` | `prompt_len`: tokens in the prompt;", "| `queued` | `prompt_len`: old;"
    )
    assert stale != text and schema.sync_doc(stale) == text
    with pytest.raises(ValueError, match="schema table"):
        schema.sync_doc("no tables here")


def test_schema_is_consistent():
    assert len(schema.BY_NAME) == len(schema.EVENTS)  # names are unique
    assert {s.process for s in schema.EVENTS} == {
        schema.API_SERVER,
        schema.TOKENIZER,
        schema.DETOKENIZER,
        schema.SCHEDULER,
    }
    for spec in schema.EVENTS:
        assert len(set(spec.field_names)) == len(spec.fields), spec.name
        assert not set(spec.field_names) & {f.name for f in schema.COMMON_FIELDS}, spec.name
        assert all(f.meaning and "|" not in f.meaning for f in spec.fields), spec.name
    # Every event the checker replays has its rules, and only those.
    assert set(RULES) == REPLAYED_EVENTS


def test_mixed_trace_writes_exactly_the_schema(mixed_trace):
    """Every scheduler event is emitted, each with exactly its declared fields."""
    events = read_trace(mixed_trace)
    errors = [e for ev in events for e in schema.schema_errors(ev, exact=True)]
    assert not errors, errors[:5]
    scheduler = {s.name for s in schema.EVENTS if s.process == schema.SCHEDULER}
    assert {ev["event"] for ev in events} == scheduler


def test_check_reports_events_outside_the_schema(mixed_trace):
    good = read_trace(mixed_trace)
    assert check_events(good).ok

    def report_of(events) -> str:
        report = check_events(events)
        assert not report.ok
        return format_report(report, max_errors=50)

    unknown = copy.deepcopy(good)
    unknown.insert(3, {**unknown[3], "event": "token_sampeld"})
    assert "unknown event 'token_sampeld'" in report_of(unknown)
    for name, field in (
        ("queued", "max_tokens"),
        ("kv_pool", "page_size"),
        ("prompt_cached", "repointed"),
        ("kv_slots_allocated", "ts"),
    ):
        events = copy.deepcopy(good)
        victim = next(ev for ev in events if ev["event"] == name)
        del victim[field]
        assert f"{name} of uid {victim['uid']} lacks field(s) {field}" in report_of(events)


def test_emit_takes_a_declared_event(tmp_path):
    tracer = RequestTracer(str(tmp_path / "t.jsonl"))
    try:
        with pytest.raises(AttributeError):
            tracer.emit("queued", 0, prompt_len=1, max_tokens=1)  # a bare name: misspellings would pass
        tracer.emit(schema.QUEUED, 0, prompt_len=1, max_tokens=1)
    finally:
        tracer.close()
    (line,) = read_trace(str(tmp_path / "t.jsonl"))
    assert line["event"] == "queued" and not schema.schema_errors(line, exact=True)


def test_untraced_scheduler_trace_is_a_no_op():
    """Tracing off, every moment is the base class's `...`: nothing is read from its arguments."""
    trace = scheduler_trace(NULL_TRACER)
    assert type(trace) is NullSchedulerTrace and not trace.enabled
    moments = [
        name
        for name, _ in inspect.getmembers(NullSchedulerTrace, inspect.isfunction)
        if not name.startswith("_")
    ]
    assert moments and set(moments) == {
        name
        for name, fn in vars(SchedulerTrace).items()
        if inspect.isfunction(fn) and not name.startswith("_")
    }
    for name in moments:
        method = getattr(trace, name)
        assert method(*[None] * len(inspect.signature(method).parameters)) is None

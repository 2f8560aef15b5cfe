"""`minfer trace check` on the host KV tier's events: a loaded prefix must be the one that was
offloaded into those host pages, and a loaded slot joins the prefix cache (the mixed trace
runs with a host tier behind a 128-token pool)."""

from __future__ import annotations

import copy

from minfer.observability.trace import read_trace
from minfer.observability.trace_check import check_events


def loads_of(events: list[dict]) -> list[int]:
    return [i for i, ev in enumerate(events) if ev["event"] == "kv_loaded"]


def test_mixed_trace_moves_pages_and_passes(mixed_trace):
    events = read_trace(mixed_trace)
    assert loads_of(events) and any(ev["event"] == "kv_offloaded" for ev in events)
    assert check_events(events).ok


def test_a_load_of_another_prefix_fails(mixed_trace):
    events = copy.deepcopy(read_trace(mixed_trace))
    load = events[loads_of(events)[0]]
    load["digests"][0] = "0" * 16  # the host page holds some other prefix's K/V
    report = check_events(events)
    assert not report.ok and any("the last offload there wrote prefix" in e for e in report.errors)


def test_a_load_from_a_never_written_host_page_fails(mixed_trace):
    events = copy.deepcopy(read_trace(mixed_trace))
    load = events[loads_of(events)[0]]
    start, end = load["host"][0]
    load["host"][0] = [start + 10**6, end + 10**6]
    report = check_events(events)
    assert not report.ok and any("never offloaded" in e for e in report.errors)


def test_a_load_without_the_event_leaves_a_borrow_unexplained(mixed_trace):
    """Drop every kv_loaded: the requests that hit loaded pages borrow slots the cache never held."""
    events = [ev for ev in read_trace(mixed_trace) if ev["event"] != "kv_loaded"]
    report = check_events(events)
    assert not report.ok
    assert any("borrowed, but the cache did not hold it" in e for r in report.failed for e in r.errors)

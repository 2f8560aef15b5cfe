"""The tracer itself, `minfer trace show` and `minfer trace plot`."""

from __future__ import annotations

import html.parser
import json
import os
import threading

import pytest

from minfer.cli import main
from minfer.observability.events import EventSpec
from minfer.observability.trace import NULL_TRACER, RequestTracer, expand_ranges, read_trace, slot_ranges

TICK = EventSpec(
    "tick", "test", "a test's event"
)  # the tracer writes any spec; the checker knows the real ones


def test_tracer_writes_every_event_in_order(tmp_path):
    path = tmp_path / "t.jsonl"
    tracer = RequestTracer(str(path))
    threads = [
        threading.Thread(target=lambda k=k: [tracer.emit(TICK, k, i=i) for i in range(500)]) for k in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tracer.close()
    tracer.close()  # idempotent
    events = read_trace(str(path))
    assert len(events) == 1500
    for k in range(3):
        assert [e["i"] for e in events if e["uid"] == k] == list(range(500))
    assert list(events[0])[:4] == ["ts", "pid", "uid", "event"] and events[0]["pid"] == os.getpid()


def test_tracer_appends_unless_truncating(tmp_path):
    path = tmp_path / "t.jsonl"
    for truncate in (False, False, True):
        tracer = RequestTracer(str(path), truncate=truncate)
        tracer.emit(TICK, 0)
        tracer.close()
    assert len(read_trace(str(path))) == 1


def test_null_tracer_is_off():
    assert not NULL_TRACER.enabled and NULL_TRACER.path is None
    NULL_TRACER.close()


def test_slot_ranges_round_trip():
    slots = [5, 6, 7, 10, 11, 3]
    assert slot_ranges(slots) == [[5, 8], [10, 12], [3, 4]]
    assert expand_ranges(slot_ranges(slots)) == slots


def test_read_trace_skips_a_torn_last_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"event": "queued", "uid": 0}) + "\n" + '{"event": "tok')
    assert len(read_trace(str(path))) == 1
    path.write_text('{"event": "tok\n' + json.dumps({"event": "queued", "uid": 0}) + "\n")
    with pytest.raises(ValueError, match=":1:"):
        read_trace(str(path))


@pytest.fixture
def trace_file(mixed_trace) -> str:
    return mixed_trace


def test_show_summary_and_one_request(trace_file, capsys):
    assert main(["trace", "show", trace_file]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["uid", "prompt", "hit", "queue_ms"]
    assert len([line for line in lines if len(line.split()) == 13 and line.split()[0].isdigit()]) == 26
    assert "ttft: mean" in out and "abort" in out and "26 requests" in out
    assert main(["trace", "show", trace_file, "--uid", "0"]) == 0
    out = capsys.readouterr().out
    assert "kv_slots_allocated" in out and "c/d/e 0/" in out and "finished" in out
    assert main(["trace", "show", trace_file, "--uid", "999"]) == 2


class _Collect(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: dict[str, int] = {}
        self.open: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags[tag] = self.tags.get(tag, 0) + 1

    def handle_startendtag(self, tag, attrs):
        self.tags[tag] = self.tags.get(tag, 0) + 1


def test_plot_html_parses(trace_file, tmp_path, capsys):
    out = tmp_path / "plot.html"
    assert main(["trace", "plot", trace_file, "-o", str(out), "--kv-pool-tokens", "128"]) == 0
    parser = _Collect()
    parser.feed(out.read_text())
    parser.close()
    assert parser.tags.get("svg") == 1 and parser.tags.get("html") == 1
    assert parser.tags.get("rect", 0) > 26 * 2  # at least waiting + decode bars for each request
    assert parser.tags.get("path", 0) >= 1  # the KV line
    assert main(["trace", "plot", trace_file, "-o", str(tmp_path / "plot.txt")]) == 2


def test_plot_png_opens(trace_file, tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    out = tmp_path / "plot.png"
    assert main(["trace", "plot", trace_file, "-o", str(out)]) == 0
    image = matplotlib.image.imread(str(out))
    assert image.shape[0] > 300 and image.shape[1] > 600

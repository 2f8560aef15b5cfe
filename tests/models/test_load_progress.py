"""The weights-loading bar: drawn on a terminal for a large model, quiet otherwise."""

from __future__ import annotations

import io
import sys

import torch

from minfer.models import loader


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def load(monkeypatch, stderr, min_bytes: int) -> list[str]:
    model = torch.nn.Linear(64, 64)
    weights = [("weight", torch.zeros(64, 64)), ("bias", torch.zeros(64))]
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.setattr(loader, "PROGRESS_MIN_BYTES", min_bytes)
    return [name for name, _ in loader.with_progress(iter(weights), model)]


def test_bar_on_a_terminal(monkeypatch):
    term = FakeTerminal()
    assert load(monkeypatch, term, min_bytes=0) == ["weight", "bias"]  # every tensor passes through
    assert "loading weights" in term.getvalue()


def test_quiet_when_not_a_terminal_or_small(monkeypatch):
    pipe = io.StringIO()
    assert load(monkeypatch, pipe, min_bytes=0) == ["weight", "bias"]
    assert pipe.getvalue() == ""
    term = FakeTerminal()
    load(monkeypatch, term, min_bytes=10**9)
    assert term.getvalue() == ""

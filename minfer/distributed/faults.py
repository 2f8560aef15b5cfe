"""Fault injection for the tensor-parallel failure tests, honoured only under pytest.

`MINFER_TEST_TP_FAULT=RANK:POINT` makes rank RANK raise at POINT: `init` (after the ranks met,
before the model loads) or `stepN` (before its N-th scheduler step, counting from 0).
"""

from __future__ import annotations

import os


def fault_point(rank: int, point: str) -> None:
    spec = os.environ.get("MINFER_TEST_TP_FAULT")
    if not spec or "PYTEST_CURRENT_TEST" not in os.environ:
        return
    want_rank, _, want_point = spec.partition(":")
    if int(want_rank) == rank and want_point == point:
        raise RuntimeError(f"injected fault on tensor-parallel rank {rank} at {point} (MINFER_TEST_TP_FAULT)")

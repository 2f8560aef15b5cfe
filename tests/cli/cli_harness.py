"""The `minfer` command in a subprocess, its one-line errors, and a Hugging Face cache laid out as
huggingface_hub lays it out (shared by the CLI tests; the fixture is in conftest.py)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HUB_REPO_ID = "tiny-org/tiny-chat"
HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def minfer(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m minfer ARGS` with this worktree's minfer; text stdout/stderr, never raises."""
    return subprocess.run(
        [sys.executable, "-m", "minfer", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})},
    )


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit code 2 and a single line on stderr that contains every fragment, no traceback."""
    lines = [line for line in result.stderr.splitlines() if not line.startswith("minfer: note:")]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def populate_hub_cache(cache_dir: Path, model_dir: Path, repo_id: str, commit: str) -> Path:
    """Put `model_dir`'s files into `cache_dir` as huggingface_hub stores a download."""
    repo = cache_dir / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for file in sorted(model_dir.iterdir()):
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot

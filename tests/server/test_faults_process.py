"""Process faults and shutdown: SIGTERM under load, kill -9 of each worker and of the server.

Every case ends with no process of the server left and no socket directory left behind (each
server gets its own TMPDIR, where its `minfer-ipc-*` directory is made).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_harness import Server, child_pids
from test_lifecycle import wait_gone


@pytest.fixture(autouse=True)
def server_tmpdir(tmp_path):
    """The server's TMPDIR, seen as tmp_path / "tmp": a directory in /tmp, since pytest's own
    paths can be too long for a unix socket's (the server would make its socket directory in
    /tmp then, out of these tests' sight: test_a_long_tmpdir_keeps_the_sockets_short)."""
    short = tempfile.mkdtemp(prefix="minfer-test-", dir="/tmp")
    (tmp_path / "tmp").symlink_to(short)
    yield short
    shutil.rmtree(short, ignore_errors=True)


def start(model: str, tmp_path, *args: str, tmpdir: str | None = None) -> Server:
    return Server(
        [model, "--served-model-name", "tiny", "--kv-cache-tokens", "16384", *args],
        tmp_path / "server.log",
        env={"OMP_NUM_THREADS": "1", "TMPDIR": tmpdir or str((tmp_path / "tmp").resolve())},
    )


def ipc_dirs(tmp_path) -> list[str]:
    return [name for name in os.listdir(tmp_path / "tmp") if name.startswith("minfer-ipc-")]


class Stream(threading.Thread):
    """A streamed completion read to its end in a thread: its events and when the last came."""

    def __init__(self, server: Server, max_tokens: int):
        super().__init__()
        self.server, self.max_tokens = server, max_tokens
        self.events: list = []
        self.started = threading.Event()
        self.ended_at: float | None = None
        self.start()

    def run(self) -> None:
        body = {
            "model": "tiny",
            "prompt": "Once upon a time",
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with httpx.stream("POST", self.server.url + "/v1/completions", json=body, timeout=60) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        payload = line[len("data: ") :]
                        self.events.append(payload if payload == "[DONE]" else json.loads(payload))
                        self.started.set()
        except httpx.HTTPError as e:
            self.events.append(e)
        self.ended_at = time.monotonic()
        self.started.set()

    @property
    def error(self) -> str | None:
        errors = [e["error"]["message"] for e in self.events if isinstance(e, dict) and "error" in e]
        return errors[0] if errors else None


def test_sigterm_under_load_drains_then_ends_streams(tiny_chat_model, tmp_path):
    server = start(tiny_chat_model, tmp_path, "--shutdown-timeout", "2")
    children = child_pids(server.proc.pid)
    long_streams = [Stream(server, 3500) for _ in range(4)]
    for s in long_streams:
        assert s.started.wait(30)
    short = Stream(server, 20)  # finishes well within the drain
    assert short.started.wait(30)
    sigterm_at = time.monotonic()
    assert server.stop(signal.SIGTERM, timeout=20) == 0
    exit_s = time.monotonic() - sigterm_at
    for s in [*long_streams, short]:
        s.join(10)
    assert short.error is None and short.events[-1] == "[DONE]"
    assert short.events[-2]["choices"][0]["finish_reason"] == "length"
    for s in long_streams:
        # Drained for 2 s, then a final error event (OpenAI's shape) and [DONE].
        assert s.events[-1] == "[DONE]" and "shutting down" in s.error, s.events[-3:]
        assert 1.5 < s.ended_at - sigterm_at < 6
    assert exit_s < 12
    assert wait_gone([server.proc.pid, *children]) == []
    assert ipc_dirs(tmp_path) == []


@pytest.mark.parametrize("role", ["tokenizer", "scheduler", "detokenizer"])
def test_kill_9_of_a_worker(tiny_chat_model, tmp_path, role):
    server = start(tiny_chat_model, tmp_path)
    children = child_pids(server.proc.pid)
    stream = Stream(server, 3500)
    assert stream.started.wait(30)
    killed_at = time.monotonic()
    os.kill(server.workers[role], signal.SIGKILL)
    saw_503 = False
    while server.proc.poll() is None and time.monotonic() - killed_at < 20:
        try:
            r = httpx.get(server.url + "/health", timeout=2)
            if r.status_code == 503:
                saw_503 = True
                assert role in r.json()["error"]["message"]
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    assert saw_503
    stream.join(10)
    assert stream.error and role in stream.error and stream.events[-1] == "[DONE]"
    assert stream.ended_at - killed_at < 3
    assert server.proc.wait(20) == 1 and time.monotonic() - killed_at < 10
    assert wait_gone([server.proc.pid, *children]) == []
    assert ipc_dirs(tmp_path) == []


def test_kill_9_of_the_server_leaves_nothing(tiny_chat_model, tmp_path):
    server = start(tiny_chat_model, tmp_path)
    children = child_pids(server.proc.pid)
    assert len(ipc_dirs(tmp_path)) == 1
    server.stop(signal.SIGKILL)
    assert wait_gone(children) == []  # the kernel ends the workers (PR_SET_PDEATHSIG)
    deadline = time.monotonic() + 5
    while ipc_dirs(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ipc_dirs(tmp_path) == []  # the janitor removed the sockets


def test_a_long_tmpdir_keeps_the_sockets_short(tiny_chat_model, tmp_path):
    """A TMPDIR so long that a socket path in it would pass the 107 bytes a unix socket address
    holds (a batch system's per-job directory): the server makes its socket directory in /tmp
    instead, serves, and removes it when it ends."""
    from minfer.ipc.ipc_dir import MAX_SOCKET_PATH_BYTES

    long_tmp = tmp_path / ("d" * 60) / ("e" * 60)
    long_tmp.mkdir(parents=True)
    assert len(str(long_tmp)) > MAX_SOCKET_PATH_BYTES
    server = start(tiny_chat_model, tmp_path, tmpdir=str(long_tmp))
    r = server.post("/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 200, r.text
    # the directory, as the server's janitor process (ipc/ipc_dir.py) names it
    commands = [Path(f"/proc/{pid}/cmdline").read_text().split("\0") for pid in child_pids(server.proc.pid)]
    (ipc,) = [args[args.index("minfer-ipc-janitor") + 1] for args in commands if "minfer-ipc-janitor" in args]
    assert os.path.dirname(ipc) == "/tmp" and sorted(os.listdir(ipc)) == [
        "api",
        "detokenizer",
        "scheduler",
        "tokenizer",
    ]
    assert not list(long_tmp.iterdir())
    assert server.stop() == 0
    assert not os.path.exists(ipc)  # removed on the way out

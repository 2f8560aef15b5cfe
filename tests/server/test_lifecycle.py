"""Start-up, shutdown and worker death of `minfer serve`: no orphan process in any case."""

from __future__ import annotations

import errno
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from server_harness import REPO, Server, child_pids, pid_alive


def wait_gone(pids, timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if pid_alive(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return alive


def worker_names(pids) -> list[str]:
    names = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return names


def test_sigterm_stops_every_process(tiny_chat_model, tmp_path):
    server = Server([tiny_chat_model, "--kv-cache-tokens", "4096"], tmp_path / "server.log")
    children = child_pids(server.proc.pid)
    workers = set(server.workers.values())
    assert workers <= set(children)
    assert sorted(worker_names(workers)) == [
        "minfer-detokeni",
        "minfer-schedule",
        "minfer-tokenize",
    ]  # 15 chars
    # A request in flight does not keep the server up.
    stream = httpx.stream(
        "POST",
        server.url + "/v1/completions",
        timeout=30,
        json={"prompt": "hi", "max_tokens": 3000, "ignore_eos": True, "stream": True},
    )
    resp = stream.__enter__()
    next(resp.iter_lines())
    assert server.stop(signal.SIGTERM, timeout=20) == 0
    stream.__exit__(None, None, None)
    assert wait_gone([server.proc.pid, *children]) == []


def test_dead_worker_makes_server_unhealthy_and_exit(tiny_chat_model, tmp_path):
    server = Server([tiny_chat_model, "--kv-cache-tokens", "4096"], tmp_path / "server.log")
    children = child_pids(server.proc.pid)
    os.kill(server.workers["scheduler"], signal.SIGKILL)
    saw_503 = False
    deadline = time.monotonic() + 20
    while server.proc.poll() is None and time.monotonic() < deadline:
        try:
            r = httpx.get(server.url + "/health", timeout=2)
            if r.status_code == 503:
                saw_503 = True
                assert "scheduler" in r.json()["error"]["message"]
                # New requests fail fast with a 503 too, not hang.
                c = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, timeout=5)
                assert c.status_code == 503 and c.json()["error"]["message"]
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    assert saw_503
    assert server.proc.wait(20) != 0
    assert "the scheduler worker" in server.output()
    assert wait_gone([server.proc.pid, *children]) == []


def test_bad_model_fails_fast(tmp_path):
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "minfer",
                "serve",
                str(tmp_path / "no-such-model"),
                "--port",
                "0",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            check=False,
        )
    # Checked in the launching process before any worker starts: one line, exit code 2.
    assert proc.returncode == 2
    text = log.read_text()
    assert "no-such-model" in text and "Traceback" not in text and "loading" not in text


def test_worker_that_fails_to_start_is_reported(tiny_chat_model, tmp_path):
    """A model that resolves but cannot load (corrupt weights): the scheduler worker reports why,
    the server prints it and exits 1 with no process left."""
    import shutil

    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_chat_model, broken)
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.run(
            [sys.executable, "-m", "minfer", "serve", str(broken), "--port", "0"],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            check=False,
        )
    assert proc.returncode == 1, log.read_text()[-2000:]
    assert "failed to start" in log.read_text()


def serve_until_loading(model: str, log, out) -> subprocess.Popen:
    """`minfer serve model --port 0`, its output into `out` (the file `log`), once it says it loads."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "minfer", "serve", model, "--port", "0"],
        stdout=out,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    deadline = time.monotonic() + 60
    while "loading" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc


def test_sigterm_while_loading(tiny_chat_model, tmp_path):
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = serve_until_loading(tiny_chat_model, log, out)
        children = child_pids(proc.pid)
        assert len(children) >= 3  # the three workers (and multiprocessing's resource tracker)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert wait_gone(children) == []


def test_port_is_held_while_loading(tiny_chat_model, tmp_path):
    """The HTTP port is taken before the model loads and kept until uvicorn serves it: no other
    process can take it during a load of minutes (a port only checked free at start-up was once
    taken in between by an outgoing connection, and the server died after the whole load). A
    client that connects during the load is answered once the server is up."""
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = serve_until_loading(tiny_chat_model, log, out)
        try:
            assert "serving" not in log.read_text()  # still loading: nobody listens yet
            port = int(re.search(r"to serve on port (\d+)", log.read_text()).group(1))
            with socket.socket() as other, pytest.raises(OSError) as taken:
                other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                other.bind(("127.0.0.1", port))
            assert taken.value.errno == errno.EADDRINUSE
            # Sent while the model loads: it waits for the server instead of being refused.
            r = httpx.post(
                f"http://127.0.0.1:{port}/v1/completions",
                json={"prompt": "hi", "max_tokens": 2},
                timeout=120,
            )
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0

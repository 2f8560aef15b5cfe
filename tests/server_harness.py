"""A real `minfer serve` in a subprocess, driven over HTTP."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
BIND_ATTEMPTS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Server:
    """`python -m minfer serve ...` on a free port; its output goes to a log file."""

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        timeout: float = 180.0,
        env: dict | None = None,
        auth: str | None = None,
    ):
        self.headers = {"Authorization": f"Bearer {auth}"} if auth else {}  # sent by info() and post()
        self.log_path = log_path
        # free_port() only says the port was free a moment ago: another process's outgoing
        # connection may take it before the server binds. That (and only that) start is retried
        # on a fresh port.
        for attempt in range(BIND_ATTEMPTS):
            self._start(args, env)
            try:
                self.wait_healthy(timeout)
                break
            except RuntimeError:
                if attempt + 1 == BIND_ATTEMPTS or not self.lost_port_race():
                    raise
                self.log.close()
        self.workers = self.info()["workers"]

    def _start(self, args: list[str], env: dict | None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(self.log_path, "w")  # noqa: SIM115 - open while the server runs
        cmd = [sys.executable, "-m", "minfer", "serve", *args, "--port", str(self.port)]
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        )

    def lost_port_race(self) -> bool:
        """Whether the server exited because its port was taken between free_port() and bind."""
        return self.proc.poll() is not None and "address already in use" in self.output().lower()

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout} s:\n{self.output()}")

    def info(self) -> dict:
        return httpx.get(self.url + "/v1/server_info", headers=self.headers, timeout=10).json()

    def wait_idle(self, timeout: float = 10.0, pages_free: bool = False) -> dict:
        """/v1/server_info once no request is left in any queue (with `pages_free`, also once no
        KV page is held by a request: the prefix cache may keep some); fails after `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.info()
            idle = not any(info["requests"].values())
            if idle and (not pages_free or info["kv_pool"]["used_pages"] == 0):
                return info
            if time.monotonic() >= deadline:
                raise AssertionError(f"not idle after {timeout} s: {info['requests']} {info['kv_pool']}")
            time.sleep(0.05)

    def post(self, path: str, body=None, **kwargs) -> httpx.Response:
        """POST `body` as JSON; bytes are sent as they are (for bodies json.dumps refuses: NaN)."""
        if isinstance(body, bytes):
            return httpx.post(
                self.url + path,
                content=body,
                timeout=60,
                headers={"content-type": "application/json", **self.headers},
                **kwargs,
            )
        return httpx.post(self.url + path, json=body, timeout=60, headers=self.headers, **kwargs)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def parse_sse(raw: str) -> list:
    """The events of an SSE body, checking OpenAI's framing: `data: <json>\\n\\n` ... `data: [DONE]\\n\\n`."""
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    events = raw.split("\n\n")
    assert events[-1] == ""
    out = []
    for event in events[:-1]:
        assert event.startswith("data: "), event
        payload = event[len("data: ") :]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    assert out[-1] == "[DONE]" and "[DONE]" not in out[:-1]
    return out[:-1]

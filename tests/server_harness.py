"""A real `minfer serve` in a subprocess, driven over HTTP."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
# What `minfer serve` prints once it listens (server/launch.py).
SERVING_LINE = re.compile(r"^minfer: serving .* on http://[^:/]+:(\d+) ", re.MULTILINE)


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
    """`python -m minfer serve ...` on a port of its choosing; its output goes to a log file."""

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
        self.log = open(log_path, "w")  # noqa: SIM115 - open while the server runs
        # --port 0: the server takes a free port when it starts and prints it once serving, so no
        # other process can take it between a choice made here and the server's bind.
        cmd = [sys.executable, "-m", "minfer", "serve", *args, "--port", "0"]
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        )
        self.wait_healthy(timeout)
        self.workers = self.info()["workers"]

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def wait_healthy(self, timeout: float) -> None:
        """Until the server prints where it serves and answers /health there."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            serving = SERVING_LINE.search(self.output())
            if serving:
                self.port = int(serving.group(1))
                self.url = f"http://127.0.0.1:{self.port}"
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

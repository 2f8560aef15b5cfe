"""`minfer serve --tp 2` on CPU: answers like tp=1, and a dead rank takes the server down."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from tiny_models import save_tiny_model

from minfer import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[2]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> str:
    """A tiny random Llama with the default model's tokenizer, so text goes through a real one."""
    from minfer.models.loader import load_tokenizer, resolve_model

    path = tmp_path_factory.mktemp("tp-serve")
    save_tiny_model("llama", path, vocab_size=49152, max_position_embeddings=1024)
    load_tokenizer(resolve_model(None)).save_pretrained(path)
    return str(path)


class Serve:
    def __init__(self, model: str, log_path: Path, **env):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.url = f"http://127.0.0.1:{s.getsockname()[1]}"
        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115 - open while the server runs
        cmd = [sys.executable, "-m", "minfer", "serve", model, "--tp", "2", "--port", self.url.rsplit(":", 1)[1]]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO,
                                     env={**os.environ, "PYTHONPATH": str(REPO), **env})
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not healthy:\n{log_path.read_text()}")

    def complete(self, max_tokens: int) -> httpx.Response:
        return httpx.post(self.url + "/v1/completions", timeout=60,
                          json={"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0})

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def test_serve_tp2_answers_like_tp1(chat_model, tmp_path):
    llm = LLM(chat_model, log_level="warning")
    expected = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].text
    server = Serve(chat_model, tmp_path / "serve.log")
    try:
        reply = server.complete(12)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == expected
    finally:
        code = server.stop()
    assert code == 0, (tmp_path / "serve.log").read_text()


def test_serve_exits_when_a_rank_dies(chat_model, tmp_path):
    server = Serve(chat_model, tmp_path / "serve.log", MINFER_TEST_TP_FAULT="1:step3")
    try:
        start = time.monotonic()
        reply = server.complete(32)
        assert reply.status_code == 503 and "tp-rank-1" in reply.json()["error"]["message"]
        assert server.proc.wait(20) == 1
        assert time.monotonic() - start < 20
    finally:
        server.stop()
    log = (tmp_path / "serve.log").read_text()
    assert "injected fault on tensor-parallel rank 1" in log
    assert "the tp-rank-1 worker" in log and "exited with code 1: shutting down" in log

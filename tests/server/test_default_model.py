"""The default model (SmolLM2-135M-Instruct) behind `minfer serve` and `minfer shell` answers."""

from __future__ import annotations

import os
import subprocess
import sys

import openai
from openai.types.chat import ChatCompletion
from server_harness import REPO

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_answers_paris(default_model_server):
    client = openai.OpenAI(base_url=default_model_server.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["SmolLM2-135M-Instruct"]
    out = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=QUESTION, temperature=0, max_tokens=24
    )
    ChatCompletion.model_validate(out.model_dump())
    assert "Paris" in out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=QUESTION, temperature=0, max_tokens=24, stream=True
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        == out.choices[0].message.content
    )


def test_shell_answers_paris():
    lines = "/temp 0\nWhat is the capital of France?\n/reset\n/exit\n"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "minfer",
            "shell",
            "--max-model-len",
            "1024",
            "--kv-cache-tokens",
            "4096",
            "--log-level",
            "warning",
        ],
        input=lines,
        text=True,
        capture_output=True,
        cwd=REPO,
        timeout=180,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "(conversation cleared)" in proc.stdout

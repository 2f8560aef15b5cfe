"""README.md's first examples, run as written against a real default-model server: the curl
command and the Python snippet both answer "Paris", each within a bounded time."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

from server_harness import REPO

README = (REPO / "README.md").read_text()
README_URL = "http://127.0.0.1:8000"
# A bounded answer of the 135M model takes about a second on CPU; the README promises seconds.
ANSWER_LIMIT_S = 30


def code_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def curl_example() -> str:
    return next(b for b in code_blocks("bash") if b.startswith("curl ")).replace("\\\n", " ")


def python_example() -> str:
    return next(b for b in code_blocks("python") if "from openai import OpenAI" in b)


def test_examples_bound_the_answer():
    """Without max_tokens and temperature 0 the default model may ramble to its context length."""
    body = json.loads(re.search(r"-d '(.*)'", curl_example()).group(1))
    assert body["temperature"] == 0 and 0 < body["max_tokens"] <= 64
    code = python_example()
    assert "temperature=0" in code and re.search(r"max_tokens=\d+", code)
    install = code_blocks("bash")[0]
    assert '".[client]"' in install or "openai" in install  # what the Python example imports


def run_timed(cmd: list[str]) -> tuple[str, float]:
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=ANSWER_LIMIT_S, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, time.monotonic() - start


def test_curl_example_answers_paris(default_model_server):
    command = curl_example().replace(README_URL, default_model_server.url)
    out, seconds = run_timed(["bash", "-c", command])
    answer = json.loads(out)["choices"][0]["message"]["content"]
    assert "Paris" in answer and seconds < ANSWER_LIMIT_S


def test_python_example_answers_paris(default_model_server):
    code = python_example().replace(README_URL, default_model_server.url)
    out, seconds = run_timed([sys.executable, "-c", code])
    assert "Paris" in out and seconds < ANSWER_LIMIT_S

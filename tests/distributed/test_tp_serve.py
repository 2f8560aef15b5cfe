"""`minfer serve --tp 2` on CPU: answers like tp=1, and a dead rank takes the server down."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from server_harness import Server
from tiny_models import save_tiny_chat_model

from minfer import LLM, SamplingParams

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> str:
    return save_tiny_chat_model(tmp_path_factory.mktemp("tp-serve"), max_position_embeddings=1024)


def serve_tp2(model: str, log_path: Path, **env) -> Server:
    return Server([model, "--tp", "2"], log_path, timeout=120, env=env)


def complete(server: Server, max_tokens: int):
    return server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0})


def test_serve_tp2_answers_like_tp1(chat_model, tmp_path):
    llm = LLM(chat_model, log_level="warning")
    expected = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].text
    server = serve_tp2(chat_model, tmp_path / "serve.log")
    try:
        reply = complete(server, 12)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == expected
    finally:
        code = server.stop()
    assert code == 0, (tmp_path / "serve.log").read_text()


def test_serve_exits_when_a_rank_dies(chat_model, tmp_path):
    server = serve_tp2(chat_model, tmp_path / "serve.log", MINFER_TEST_TP_FAULT="1:step3")
    try:
        start = time.monotonic()
        reply = complete(server, 32)
        assert reply.status_code == 503 and "tp-rank-1" in reply.json()["error"]["message"]
        assert server.proc.wait(20) == 1
        assert time.monotonic() - start < 20
    finally:
        server.stop()
    log = (tmp_path / "serve.log").read_text()
    assert "injected fault on tensor-parallel rank 1" in log
    assert "the tp-rank-1 worker" in log and "exited with code 1: shutting down" in log


def test_the_rendezvous_port_is_held_from_the_launcher_to_rank_0():
    """`serve --tp N` tells the followers rank 0's address before rank 0 exists. The launcher's
    socket listens from the start and rank 0's store serves on that very socket, so no other
    process can take the port in between (an address found free and bound seconds later could
    be: the CI failure at test_faults_load was that race on the HTTP port)."""
    import errno
    import socket
    import types

    from minfer.distributed.parallel import create_store
    from minfer.runner.ranks import rendezvous_socket

    listener = rendezvous_socket()
    port = listener.getsockname()[1]
    with socket.socket() as other, pytest.raises(OSError) as taken:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", port))
    assert taken.value.errno == errno.EADDRINUSE
    config = types.SimpleNamespace(dist_init_addr=f"127.0.0.1:{port}", tp=2)
    master = create_store(config, 0, listener)
    assert master.port == port and listener.fileno() == -1  # the store owns the socket now
    master.set("joined", "rank 0")
    assert create_store(config, 1).get("joined") == b"rank 0"

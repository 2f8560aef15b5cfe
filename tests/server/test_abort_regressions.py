"""The serving reproductions of the abort-during-prefill bug (issue 13), on the default model,
in overlap and non-overlap mode. The servers run with the KV page check after every step
(MINFER_CHECK_KV_INVARIANTS, set by conftest): a double-owned page stops the scheduler, so the
health and output checks below fail loudly instead of passing on a corrupted pool."""

from __future__ import annotations

import httpx
import pytest
from server_harness import Server

CHAT = {
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "temperature": 0,
    "max_tokens": 12,
}
LONG_PROMPT = " ".join(
    f"Item {i}: the river flows past the old mill and the stone bridge." for i in range(40)
)


@pytest.fixture(scope="module", params=["overlap", "no-overlap"])
def server(request, tmp_path_factory):
    args = ["--log-level", "warning"] + (
        ["--disable-overlap-schedule"] if request.param == "no-overlap" else []
    )
    srv = Server(args, tmp_path_factory.mktemp("abort") / "server.log", env={"OMP_NUM_THREADS": "1"})
    yield srv
    srv.stop()


def chat(server: Server) -> str:
    r = server.post("/v1/chat/completions", CHAT)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def complete(server: Server, prompt: str, max_tokens: int = 8) -> list[int]:
    r = server.post(
        "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0}
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def give_up_after(server: Server, body: dict, seconds: float) -> None:
    """Send a request and disconnect after `seconds`, as a client with a timeout does."""
    try:
        httpx.post(server.url + "/v1/completions", json=body, timeout=seconds)
    except httpx.TimeoutException:
        pass


def assert_pool_consistent(server: Server) -> None:
    health = httpx.get(server.url + "/health", timeout=5)
    assert health.status_code == 200, f"server unhealthy (a failed KV check?):\n{server.output()[-3000:]}"
    pool = server.info()["kv_pool"]
    assert 0 <= pool["free_pages"] <= pool["total_pages"], pool
    assert pool["used_pages"] >= 0, pool


def test_mass_abort_of_n_times_prompts_during_prefill(server):
    before = chat(server)
    body = {"prompt": [f"p{i}" for i in range(8)], "n": 8, "max_tokens": 1}
    for seconds in (0.05, 0.2, 0.5):
        give_up_after(server, body, seconds)
    server.wait_idle(timeout=60)
    assert_pool_consistent(server)
    assert server.info()["kv_pool"]["used_pages"] == 0
    assert chat(server) == before


def test_single_long_prompt_aborted_during_prefill(server):
    follow_up = LONG_PROMPT + " that"
    reference = complete(server, follow_up)
    for seconds in (0.05, 0.1, 0.2, 0.4):
        give_up_after(server, {"prompt": LONG_PROMPT, "max_tokens": 4}, seconds)
        server.wait_idle(timeout=60)
        for k in range(3):  # unrelated requests take the freed pages and overwrite them
            complete(server, f"Unrelated request number {k} about something else entirely.")
        assert_pool_consistent(server)
        assert complete(server, follow_up) == reference

"""One real `minfer serve` started the vLLM way: a Hugging Face id (from the offline cache),
vLLM's flag names, a --chat-template that must reach the tokenizer worker."""

from __future__ import annotations

import httpx
from cli_harness import HUB_REPO_ID
from server_harness import Server

TEMPLATE = "{{ raise_exception('refused by the --chat-template') }}"


def test_serve_a_hub_id_with_vllm_flags(tmp_path, hub_cache):
    args = [
        "--model", HUB_REPO_ID,
        "--download-dir", str(hub_cache),
        "--max-num-seqs", "4",
        "--max-model-len", "1024",
        "--kv-cache-tokens", "4096",
        "--chat-template", TEMPLATE,
    ]  # fmt: skip
    server = Server(args, tmp_path / "server.log", env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    try:
        info = server.info()
        assert info["max_running_requests"] == 4 and info["engine_config"]["max_model_len"] == 1024
        listed = httpx.get(server.url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in listed["data"]] == [HUB_REPO_ID]
        chat = server.post(
            "/v1/chat/completions", {"model": HUB_REPO_ID, "messages": [{"role": "user", "content": "hi"}]}
        )
        assert chat.status_code == 400 and "refused by the --chat-template" in chat.text
        text = server.post("/v1/completions", {"model": HUB_REPO_ID, "prompt": "hi", "max_tokens": 2})
        assert text.status_code == 200, text.text
    finally:
        server.stop()

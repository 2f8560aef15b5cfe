"""A request whose logits leave nothing to draw, through a real `minfer serve` and the openai
client: it ends with finish_reason "abort" and a stop_reason that says why, no token, its KV
freed, and requests beside it are unharmed (scheduler/results.py, core.NO_TOKEN).

The model is a tiny tokenizer-free Llama with a 256-token vocabulary, so `stop_token_ids` can
name every token (the API takes up to 1024) and `min_tokens` then bans them all: a real way to
reach a row of -inf, where an argmax used to return token 0.
"""

from __future__ import annotations

import concurrent.futures

import openai
import pytest
from server_harness import Server
from tiny_models import save_tiny_model

PROMPT = list(range(10, 30))
# through SGLang's /generate, which returns the token ids (the model has no tokenizer for text)
HEALTHY = {
    "input_ids": PROMPT,
    "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-no-tokenizer")
    save_tiny_model("llama", path)
    srv = Server([str(path), "--kv-cache-tokens", "2048"], tmp_path_factory.mktemp("logs") / "server.log")
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def banned_all(vocab: int, **extra) -> dict:
    return {"max_tokens": 8, "extra_body": {"min_tokens": 3, "stop_token_ids": list(range(vocab)), **extra}}


def test_bans_covering_the_vocabulary_end_the_request_with_abort(server, client):
    model = client.models.list().data[0].id
    alone = server.post("/generate", HEALTHY).json()["output_ids"]
    assert len(alone) == 8
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        healthy = [pool.submit(server.post, "/generate", HEALTHY) for _ in range(2)]
        broken = [
            pool.submit(client.completions.create, model=model, prompt=PROMPT, **banned_all(256, **extra))
            for extra in ({}, {"temperature": 0.8, "seed": 1})
        ]
        for future in broken:
            out = future.result()
            choice = out.choices[0]
            assert choice.finish_reason == "abort"
            assert "no finite logit" in choice.model_extra["stop_reason"]
            assert out.usage.completion_tokens == 0
        for future in healthy:
            assert future.result().json()["output_ids"] == alone
    info = server.wait_idle(pages_free=True)
    assert info["kv_pool"]["used_pages"] == 0
    assert "no finite logit" in server.output()  # the error reaches the server's log


def test_streamed(server, client):
    model = client.models.list().data[0].id
    chunks = list(client.completions.create(model=model, prompt=PROMPT, stream=True, **banned_all(256)))
    assert chunks[-1].choices[0].finish_reason == "abort"
    assert "".join(c.choices[0].text for c in chunks) == ""

"""The HTTP API against a real `minfer serve` (tiny random model, real tokenizer), through the
official openai client and raw HTTP; every response is validated with openai's own types."""

from __future__ import annotations

import asyncio
import itertools
import json

import httpx
import openai
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from server_harness import Server, parse_sse

from minfer import LLM, SamplingParams

PROMPTS = [
    f"Request number {i}: tell me about {topic}"
    for i, topic in enumerate(
        [
            "cats",
            "dogs",
            "the sea",
            "Paris",
            "numbers",
            "music",
            "rain",
            "trains",
            "tea",
            "stars",
            "bread",
            "rivers",
            "clocks",
            "snow",
            "maps",
            "ants",
        ]
    )
]


@pytest.fixture(scope="module")
def server(tiny_chat_model, tmp_path_factory):
    srv = Server(
        [tiny_chat_model, "--served-model-name", "tiny", "--kv-cache-tokens", "16384"],
        tmp_path_factory.mktemp("logs") / "server.log",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_chat_model):
    return LLM(tiny_chat_model, kv_cache_tokens=16384)


def validate_completion_chunk(chunk: dict) -> None:
    """openai's Completion type (shared by streamed chunks) requires finish_reason, which is null
    until the last chunk in OpenAI's own streams too: check everything else strictly."""
    choices = [dict(c, finish_reason=c["finish_reason"] or "length") for c in chunk["choices"]]
    Completion.model_validate({**chunk, "choices": choices})


def assert_kv_all_free(info: dict) -> None:
    kv = info["kv_pool"]
    assert kv["used_pages"] == 0, kv
    assert kv["free_pages"] + kv["cached_pages"] == kv["total_pages"], kv


# -- basics ---------------------------------------------------------------------------------------
def test_models_health_info(server, client):
    assert httpx.get(server.url + "/health").status_code == 200
    raw = httpx.get(server.url + "/v1/models").json()
    assert [Model.model_validate(m).id for m in raw["data"]] == ["tiny"]
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert client.models.retrieve("tiny").model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("org/other")
    assert missing.value.body["code"] == "model_not_found" and "'org/other'" in missing.value.body["message"]
    info = server.info()
    assert info["max_model_len"] == 4096
    assert info["memory"]["kv_pool_tokens"] == 16384
    assert info["memory_line"].startswith("memory:")
    assert info["kv_cache_dtype"] == info["dtype"] and info["engine_config"]["kv_cache_dtype"] == "auto"
    assert info["kv_pool"]["total_pages"] == 16384
    assert "minfer: serving 'tiny' on http://127.0.0.1:" in server.output()
    assert info["memory_line"] in server.output()


def test_completion(server, client, offline):
    raw = server.post(
        "/v1/completions", {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}
    ).json()
    out = Completion.model_validate(raw)
    expected = offline.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == expected.finish_reason
    assert out.usage.completion_tokens == len(expected.token_ids)
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    same = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert same.choices[0].text == expected.text


def test_completion_stream(server, client):
    body = {
        "model": "tiny",
        "prompt": PROMPTS[1],
        "max_tokens": 10,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    resp = server.post("/v1/completions", body)
    assert resp.headers["content-type"].startswith("text/event-stream")
    chunks = parse_sse(resp.text)
    for chunk in chunks:
        validate_completion_chunk(chunk)
    *content, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 10
    assert all(c["usage"] is None for c in content if "usage" in c)
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in content[:-1])
    text = "".join(c["choices"][0]["text"] for c in content)
    full = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=10, temperature=0)
    assert text == full.choices[0].text
    streamed = client.completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=10, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text


def test_continuous_usage_stats(server):
    body = {
        "prompt": PROMPTS[2],
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    chunks = parse_sse(server.post("/v1/completions", body).text)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 5
    assert all(c["usage"]["prompt_tokens"] > 0 for c in chunks)


def test_prompt_forms(server, offline):
    ids = offline.tokenizer.encode(PROMPTS[3])
    params = {"max_tokens": 6, "temperature": 0}
    by_text = Completion.model_validate(
        server.post("/v1/completions", {"prompt": PROMPTS[3], **params}).json()
    )
    by_ids = Completion.model_validate(server.post("/v1/completions", {"prompt": ids, **params}).json())
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = Completion.model_validate(
        server.post("/v1/completions", {"prompt": [PROMPTS[3], PROMPTS[4]], **params}).json()
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text
    batch_ids = Completion.model_validate(
        server.post("/v1/completions", {"prompt": [ids, ids], **params}).json()
    )
    assert [c.text for c in batch_ids.choices] == [by_text.choices[0].text] * 2
    n2 = Completion.model_validate(
        server.post("/v1/completions", {"prompt": PROMPTS[3], "n": 2, **params}).json()
    )
    assert [c.text for c in n2.choices] == [by_text.choices[0].text] * 2
    assert n2.usage.prompt_tokens == len(ids)


def test_chat(server, client, offline):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
    ]
    raw = server.post(
        "/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 12, "temperature": 0}
    ).json()
    out = ChatCompletion.model_validate(raw)
    plain = [messages[0], {"role": "user", "content": "Name a colour."}]
    expected = offline.chat(plain, SamplingParams(temperature=0, max_tokens=12))[0]
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected.text
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)

    resp = server.post(
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": messages,
            "max_completion_tokens": 12,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    chunks = [ChatCompletionChunk.model_validate(c) for c in parse_sse(resp.text)]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == expected.finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)

    via_client = client.chat.completions.create(
        model="tiny", messages=plain, max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in via_client if c.choices) == expected.text


def test_chat_without_max_tokens_runs_to_the_context(server):
    """Without max_tokens a chat request may run to the end of the context (OpenAI's default)."""
    body = {"messages": HELLO, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + CHAT, json=body, timeout=30) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
    assert_kv_all_free(server.wait_idle())


def test_concurrent_streams_match_offline(server, offline):
    """16 concurrent greedy streams give exactly the offline texts."""
    params = SamplingParams(temperature=0, max_tokens=24)
    expected = offline.generate(PROMPTS, params, use_tqdm=False)
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

    async def one(prompt: str) -> tuple[str, str]:
        stream = await aclient.completions.create(
            model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True
        )
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def all_of_them():
        try:
            return await asyncio.gather(*(one(p) for p in PROMPTS))
        finally:
            await aclient.close()

    got = asyncio.run(all_of_them())
    assert [t for t, _ in got] == [e.text for e in expected]
    assert [f for _, f in got] == [e.finish_reason for e in expected]
    assert_kv_all_free(server.wait_idle())


# -- stop strings ---------------------------------------------------------------------------------
def test_stop_string(server):
    body = {"prompt": PROMPTS[5], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    full = server.post("/v1/completions", body).json()["choices"][0]["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cut = full[: full.find(stop)]
    out = Completion.model_validate(server.post("/v1/completions", {**body, "stop": stop}).json())
    assert out.choices[0].text == cut
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop
    chunks = parse_sse(
        server.post("/v1/completions", {**body, "stop": ["\x00never", stop], "stream": True}).text
    )
    assert "".join(c["choices"][0]["text"] for c in chunks) == cut
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # vLLM's include_stop_str_in_output: the stop string ends the text, streamed or not
    kept = {**body, "stop": stop, "include_stop_str_in_output": True}
    assert server.post("/v1/completions", kept).json()["choices"][0]["text"] == cut + stop
    sglang = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True, "stop": stop, "no_stop_trim": True}
    assert (
        server.post("/generate", {"text": PROMPTS[5], "sampling_params": sglang}).json()["text"] == cut + stop
    )
    chunks = parse_sse(server.post("/v1/completions", {**kept, "stream": True}).text)
    assert "".join(c["choices"][0]["text"] for c in chunks) == cut + stop
    assert_kv_all_free(server.wait_idle())  # the scheduler aborted it


def test_stop_token_ids_and_min_tokens(server, offline):
    body = {"prompt": PROMPTS[6], "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    ids = server.post(
        "/generate",
        {"text": PROMPTS[6], "sampling_params": {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}},
    ).json()["output_ids"]
    out = server.post("/v1/completions", {**body, "stop_token_ids": [ids[4]]}).json()["choices"][0]
    first = ids.index(ids[4])
    assert out["finish_reason"] == "stop" and out["stop_reason"] == ids[4]
    assert out["text"] == offline.decode(ids[: first + 1])
    late = server.post("/v1/completions", {**body, "stop_token_ids": [ids[0]], "min_tokens": 5}).json()
    assert late["usage"]["completion_tokens"] >= 5


# -- abort ------------------------------------------------------------------------------------------
def test_stream_disconnect_frees_kv(server):
    before = server.info()["counters"]["generation_tokens"]
    body = {"prompt": PROMPTS[7], "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
        assert server.info()["requests"]["running"] == 1
    info = server.wait_idle(timeout=5)
    assert_kv_all_free(info)
    assert info["counters"]["generation_tokens"] - before < 3000


def test_non_stream_disconnect_frees_kv(server):
    before = server.info()["counters"]["generation_tokens"]
    body = {"messages": HELLO, "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + CHAT, json=body, timeout=0.5)
    info = server.wait_idle(timeout=5)
    assert_kv_all_free(info)
    assert info["counters"]["generation_tokens"] - before < 3000


def test_abort_request_by_rid(server):
    body = {
        "text": PROMPTS[9],
        "rid": "my-request",
        "stream": True,
        "sampling_params": {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True},
    }
    events = []
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=30) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
                if len(events) == 1:
                    r = server.post("/abort_request", {"rid": "my-request"})
                    assert r.status_code == 200 and r.json()["aborted"] == 1
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["meta_info"]["finish_reason"] == {"type": "abort", "matched": None}
    assert last["meta_info"]["completion_tokens"] < 3000
    assert_kv_all_free(server.wait_idle())


# -- SGLang /generate and vLLM tokenizer endpoints --------------------------------------------------
def test_generate(server, offline):
    sp = {"max_new_tokens": 8, "temperature": 0}
    one = server.post("/generate", {"text": PROMPTS[10], "sampling_params": sp}).json()
    expected = offline.generate([PROMPTS[10]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert one["text"] == expected.text and one["output_ids"] == expected.token_ids
    meta = one["meta_info"]
    assert meta["prompt_tokens"] == len(expected.prompt_token_ids) and meta["completion_tokens"] == 8
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["e2e_latency"] > 0 and meta["timings"]["first_token_s"] > 0
    batch = server.post(
        "/generate", {"input_ids": [expected.prompt_token_ids] * 2, "sampling_params": sp}
    ).json()
    assert [b["text"] for b in batch] == [expected.text] * 2
    events = parse_sse(
        server.post("/generate", {"text": PROMPTS[10], "sampling_params": sp, "stream": True}).text
    )
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts)) and texts[-1] == expected.text
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_tokenizer_endpoints(server, offline):
    tok = offline.tokenizer
    r = server.post("/tokenize", {"prompt": "Hello world", "add_special_tokens": False}).json()
    assert r["tokens"] == tok.encode("Hello world", add_special_tokens=False)
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 4096
    r2 = server.post("/tokenize", {"prompt": "Hello world", "return_token_strs": True}).json()
    assert r2["token_strs"] == tok.convert_ids_to_tokens(r2["tokens"])
    assert server.post("/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": "Hello world"}
    chat = server.post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == offline.apply_chat_template([{"role": "user", "content": "hi"}])
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    assert info["tokenizer_class"] and info["model_max_length"] == 4096
    # lm-evaluation-harness finds the eos id by tokenizing the eos token text.
    eos = server.post("/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}).json()
    assert eos["tokens"] == [tok.eos_token_id]


# -- bad input ----------------------------------------------------------------------------------------
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "hello"}]

BAD_REQUESTS = [
    ("max_tokens zero", COMPLETIONS, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", CHAT, {"messages": HELLO, "max_tokens": -5}, 400, "max_tokens"),
    ("max_completion_tokens zero", CHAT, {"messages": HELLO, "max_completion_tokens": 0}, 400, "max_tokens"),
    ("temperature negative", COMPLETIONS, {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("top_p zero", CHAT, {"messages": HELLO, "top_p": 0}, 400, "top_p"),
    ("top_p above one", COMPLETIONS, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("top_k below -1", COMPLETIONS, {"prompt": "x", "top_k": -3}, 400, "top_k"),
    ("min_p above one", COMPLETIONS, {"prompt": "x", "min_p": 2}, 400, "min_p"),
    ("n zero", COMPLETIONS, {"prompt": "x", "n": 0}, 400, "n"),
    ("n huge", COMPLETIONS, {"prompt": "x", "n": 100000}, 400, "n"),
    ("max_tokens beyond int64", COMPLETIONS, {"prompt": "x", "max_tokens": 10**30}, 400, "max_tokens"),
    ("max_tokens beyond the context", COMPLETIONS, {"prompt": "x", "max_tokens": 10**12}, 400, "max_tokens"),
    ("temperature NaN", COMPLETIONS, b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    (
        "top_p infinite",
        CHAT,
        b'{"messages": [{"role": "user", "content": "x"}], "top_p": Infinity}',
        400,
        "top_p",
    ),
    ("seed beyond int64", COMPLETIONS, {"prompt": "x", "seed": 2**70}, 400, "seed"),
    ("token id beyond int64", COMPLETIONS, {"prompt": [2**70]}, 400, "prompt"),
    ("negative token id", COMPLETIONS, {"prompt": [5, -1]}, 400, "prompt"),
    ("temperature not a number", COMPLETIONS, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("no messages", CHAT, {"messages": []}, 400, "messages"),
    ("messages not a list", CHAT, {"messages": "hello"}, 400, "messages"),
    ("unknown role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ("message without role", CHAT, {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    (
        "image part",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "messages[0].content",
    ),
    ("no prompt", COMPLETIONS, {"max_tokens": 3}, 400, "prompt"),
    ("empty prompt", COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    ("token id outside vocab", COMPLETIONS, {"prompt": [1, 2, 10**7]}, 400, "prompt"),
    ("unknown model", COMPLETIONS, {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("unknown model chat", CHAT, {"model": "gpt-9", "messages": HELLO}, 404, "model"),
    (
        "stream with bad value",
        COMPLETIONS,
        {"prompt": "x", "max_tokens": 0, "stream": True},
        400,
        "max_tokens",
    ),
    ("logprobs too many", COMPLETIONS, {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("top_logprobs without logprobs", CHAT, {"messages": HELLO, "top_logprobs": 2}, 400, "top_logprobs"),
    (
        "frequency_penalty too large",
        COMPLETIONS,
        {"prompt": "x", "frequency_penalty": 3},
        400,
        "frequency_penalty",
    ),
    (
        "repetition_penalty zero",
        COMPLETIONS,
        {"prompt": "x", "repetition_penalty": 0},
        400,
        "repetition_penalty",
    ),
    (
        "logit_bias key not a token id",
        COMPLETIONS,
        {"prompt": "x", "logit_bias": {"abc": 1}},
        400,
        "logit_bias",
    ),
    (
        "logit_bias token outside vocab",
        COMPLETIONS,
        {"prompt": "x", "logit_bias": {"99999999": 1}},
        400,
        "logit_bias",
    ),
    (
        "tools",
        CHAT,
        {"messages": HELLO, "tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        "tools",
    ),
    (
        "unknown response_format",
        CHAT,
        {"messages": HELLO, "response_format": {"type": "xml"}},
        400,
        "response_format",
    ),
    ("best_of above n", COMPLETIONS, {"prompt": "x", "best_of": 3}, 400, "best_of"),
    ("beam search", CHAT, {"messages": HELLO, "use_beam_search": True}, 400, "use_beam_search"),
    (
        "logits processors",
        CHAT,
        {"messages": HELLO, "logits_processors": ["my.module:Processor"]},
        400,
        "logits_processors",
    ),
    (
        "special tokens spaced differently",
        COMPLETIONS,
        {"prompt": "x", "spaces_between_special_tokens": False},
        400,
        "spaces_between_special_tokens",
    ),
    (
        "functions (deprecated tools)",
        CHAT,
        {"messages": HELLO, "functions": [{"name": "f"}]},
        400,
        "functions",
    ),
    (
        "generate stop regex",
        "/generate",
        {"text": "x", "sampling_params": {"stop_regex": ["a+"]}},
        400,
        "sampling_params.stop_regex",
    ),
    ("generate n > 1", "/generate", {"text": "x", "sampling_params": {"n": 2}}, 400, "sampling_params.n"),
    ("generate without prompt", "/generate", {"sampling_params": {}}, 400, "text"),
    (
        "generate bad temperature",
        "/generate",
        {"text": "x", "sampling_params": {"temperature": -1}},
        400,
        "sampling_params.temperature",
    ),
    ("tokenize nothing", "/tokenize", {}, 400, "prompt"),
    ("detokenize outside vocab", "/detokenize", {"tokens": [-1]}, 400, None),
]


def check_error(resp: httpx.Response, status: int, param: str | None) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert (
        "Traceback" not in resp.text
        and "pydantic" not in resp.text
        and "errors.pydantic.dev" not in resp.text
    )
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("name,path,body,status,param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input(server, name, path, body, status, param):
    check_error(server.post(path, body), status, param)


def test_other_engines_defaults_and_openai_metadata_are_accepted(server):
    """Fields minfer does not implement, sent at the value that means what it does anyway (as
    vLLM's clients send them), and OpenAI's fields of no one's behaviour, are not errors."""
    defaults = {"best_of": 1, "use_beam_search": False, "skip_special_tokens": True, "length_penalty": 1.0}
    metadata = {"store": False, "metadata": {"k": "v"}, "service_tier": "auto", "user": "u"}
    for path, body in ((COMPLETIONS, {"prompt": "x"}), (CHAT, {"messages": HELLO})):
        resp = server.post(path, {**body, "max_tokens": 2, **defaults, **metadata})
        assert resp.status_code == 200, resp.text
    sglang = {"max_new_tokens": 2, "n": 1, "skip_special_tokens": True, "no_stop_trim": False}
    resp = server.post("/generate", {"text": "x", "sampling_params": sglang})
    assert resp.status_code == 200, resp.text


def test_context_overflow(server):
    prompt = "word " * 4000
    err = check_error(server.post(COMPLETIONS, {"prompt": prompt, "max_tokens": 500}), 400, "max_tokens")
    n = len(server.post("/tokenize", {"prompt": prompt}).json()["tokens"])
    assert "4096" in err["message"] and str(n) in err["message"], err["message"]
    assert err["code"] == "context_length_exceeded"
    chat = check_error(
        server.post(
            CHAT, {"messages": [{"role": "user", "content": prompt}], "max_tokens": 500, "stream": True}
        ),
        400,
        "max_tokens",
    )
    assert "4096" in chat["message"]


def test_malformed_bodies(server):
    bad_json = httpx.post(
        server.url + COMPLETIONS,
        content=b"{not json",
        timeout=10,
        headers={"content-type": "application/json"},
    )
    err = check_error(bad_json, 400, None)
    # where the JSON breaks, and no field named: pydantic's location is a character offset
    assert "not valid JSON (at character 1)" in err["message"] and err["param"] is None, err
    check_error(httpx.get(server.url + "/v1/nothing-here"), 404, None)
    check_error(httpx.get(server.url + COMPLETIONS), 405, None)


def test_openai_client_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=0)
    assert "max_tokens" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=HELLO)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], top_p=7, stream=True
        )


def test_still_healthy_after_everything(server, client):
    assert httpx.get(server.url + "/health").status_code == 200
    out = client.completions.create(model="tiny", prompt="still there?", max_tokens=3)
    assert out.usage.completion_tokens == 3
    assert_kv_all_free(server.wait_idle())


def test_usage_counts_the_prompt_tokens_the_prefix_cache_held(server, client, offline):
    """usage.prompt_tokens_details.cached_tokens (Responses: input_tokens_details; /generate:
    meta_info.cached_tokens; offline: num_cached_tokens): 0 for a prompt never seen, then all
    but the one token a pass must compute (pages of one token on the CPU)."""
    prompt = "The cache test: " + " ".join(f"w{i}" for i in range(40))
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=3)
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=3)
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == n - 1
    # the chat form's prompt: at most the template's head (its system prompt) from earlier chats
    messages = [{"role": "user", "content": prompt + " (chat)"}]
    chats = [client.chat.completions.create(model="tiny", messages=messages, max_tokens=2) for _ in range(2)]
    n_chat = chats[0].usage.prompt_tokens
    assert chats[0].usage.prompt_tokens_details.cached_tokens < n - 1
    assert chats[1].usage.prompt_tokens_details.cached_tokens == n_chat - 1
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=2, stream=True, stream_options={"include_usage": True}
    )
    assert list(stream)[-1].usage.prompt_tokens_details.cached_tokens == n_chat - 1
    response = client.responses.create(model="tiny", input=messages, max_output_tokens=2)
    assert response.usage.input_tokens_details.cached_tokens == n_chat - 1
    ids = server.post("/tokenize", {"prompt": prompt}).json()["tokens"]
    generated = server.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}).json()
    assert generated["meta_info"]["cached_tokens"] == len(ids) - 1
    outs = offline.generate([prompt + " (offline)"] * 2, SamplingParams(max_tokens=2), use_tqdm=False)
    assert outs[0].num_cached_tokens == 0  # the first admitted; its twin may or may not hit it
    again = offline.generate([prompt + " (offline)"], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert again.num_cached_tokens == len(again.prompt_token_ids) - 1

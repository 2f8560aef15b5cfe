"""Logprobs (completions with echo, chat, /generate), penalties and logit_bias, min_tokens,
allowed_token_ids, bad_words, truncate_prompt_tokens and skip_special_tokens, n > 1 and structured output against a real `minfer serve` (tiny random model, real tokenizer).

The reference for logprobs is transformers' own forward pass of the same checkpoint: the server
reports the raw distribution, log-softmax of the logits (docs/SERVING.md)."""

from __future__ import annotations

import itertools
import math

import openai
import pytest
import torch
from openai.types import Completion
from openai.types.chat import ChatCompletion
from server_harness import Server, parse_sse

PROMPT = "The quick brown fox jumps over the lazy dog because it wants to"
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_chat_model, tmp_path_factory):
    srv = Server(
        [
            tiny_chat_model,
            "--served-model-name",
            "tiny",
            "--kv-cache-tokens",
            "16384",
            "--chunked-prefill-size",
            "8",
        ],  # prompt logprobs gathered over several chunks
        tmp_path_factory.mktemp("logs") / "server.log",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(tiny_chat_model):
    """log-softmax of transformers' logits over a token sequence, [len, vocab]."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_chat_model, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return logprobs


def prompt_ids(server: Server, text: str) -> list[int]:
    return server.post("/tokenize", {"prompt": text}).json()["tokens"]


def assert_sorted(values: list[float]) -> None:
    assert values == sorted(values, reverse=True)


def test_completion_echo_logprobs_equal_transformers(server, reference):
    ids = prompt_ids(server, PROMPT)
    body = {"prompt": PROMPT, "max_tokens": 3, "echo": True, "logprobs": 3, **GREEDY}
    resp = server.post("/v1/completions", body).json()
    choice = resp["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3
    assert choice["text"].startswith(PROMPT)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    # The generated tokens, from /generate with the same prompt ids.
    out = server.post(
        "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 3, **GREEDY}}
    ).json()
    full = ids + out["output_ids"]
    ref = reference(full)
    expected = ref[torch.arange(len(full) - 1), torch.tensor(full[1:])]
    assert torch.allclose(torch.tensor(lp["token_logprobs"][1:]), expected, atol=2e-4)
    for i, top in enumerate(lp["top_logprobs"][1:]):
        assert_sorted(list(top.values()))
        assert len(top) >= 3 and math.isclose(max(top.values()), ref[i].max().item(), abs_tol=2e-4)
    for i in range(len(ids), len(full)):  # greedy: the chosen token is the most likely one
        assert lp["token_logprobs"][i] == max(lp["top_logprobs"][i].values())
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    # Without echo: only the generated tokens, with the same numbers. (openai's type has no room
    # for the null logprob of the first prompt token, which OpenAI and vLLM return with echo.)
    plain = Completion.model_validate(server.post("/v1/completions", {**body, "echo": False}).json())
    plain = plain.model_dump()["choices"][0]
    assert plain["logprobs"]["token_logprobs"] == lp["token_logprobs"][len(ids) :]
    assert plain["text"] == choice["text"][len(PROMPT) :]


def test_echo_with_max_tokens_0_scores_the_prompt_alone(server, reference):
    """OpenAI's and vLLM's way to score a text (evaluation tools' loglikelihood): echo with
    max_tokens 0 answers the prompt and its logprobs, nothing generated, through the openai client."""
    ids = prompt_ids(server, PROMPT)
    ref = reference(ids)
    expected = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    for prompt in (PROMPT, ids):  # text and token ids
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=2)
        choice = out.choices[0]
        assert choice.text == PROMPT and choice.finish_reason == "length"
        assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 0
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
        assert torch.allclose(torch.tensor(lp.token_logprobs[1:]), expected, atol=2e-4)
        assert all(len(top) in (2, 3) for top in lp.top_logprobs[1:])  # 2 + the prompt's token
    events = parse_sse(
        server.post(
            "/v1/completions",
            {
                "prompt": PROMPT,
                "max_tokens": 0,
                "echo": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ).text
    )
    assert "".join(c["text"] for e in events for c in e["choices"]) == PROMPT
    assert [c["finish_reason"] for e in events for c in e["choices"]][-1] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 0
    # max_tokens 0 without echo would answer nothing: refused, as min_tokens above it is
    for body, param in (
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens"),
    ):
        r = server.post("/v1/completions", {"prompt": PROMPT, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def check_prompt_logprobs(entries: list, ids: list[int], ref: torch.Tensor, k: int) -> None:
    """vLLM's prompt_logprobs of prompt `ids` against transformers' log-softmax rows `ref`: the
    prompt token's logprob and rank (tokens within float noise of it may count either way), then
    the k most likely with ranks 1..k."""
    tol = 2e-4
    assert len(entries) == len(ids) and entries[0] is None
    for i, entry in enumerate(entries[1:]):
        row, token = ref[i], ids[i + 1]
        first = next(iter(entry))
        assert first == str(token)  # the prompt's token first, as vLLM puts it
        value = entry[first]["logprob"]
        assert math.isclose(value, row[token].item(), abs_tol=tol)
        # the rank counts tokens at least as likely; the two float32 paths agree to ~1e-6 here
        near = 1e-5
        assert int((row > value + near).sum()) + 1 <= entry[first]["rank"] <= int((row >= value - near).sum())
        assert isinstance(entry[first]["decoded_token"], str)
        others = {t: e for t, e in entry.items() if t != first}
        top = row.topk(k)
        assert len(entry) in (k, k + 1)
        for rank, (v, t) in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1):
            if str(t) in others:
                assert others[str(t)]["rank"] == rank and math.isclose(
                    others[str(t)]["logprob"], v, abs_tol=tol
                )


def test_vllm_prompt_logprobs_equal_transformers(server, reference):
    """vLLM's prompt_logprobs through the real openai client (an extra body field), completions
    with and without echo (the prompt's alternatives serve both counts) and chat."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    ids = prompt_ids(server, PROMPT)
    ref = reference(ids)
    for extra in ({}, {"echo": True, "logprobs": 1}):
        resp = client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=2,
            temperature=0,
            extra_body={"prompt_logprobs": 3, **extra},
        )
        choice = resp.choices[0].model_dump()
        check_prompt_logprobs(choice["prompt_logprobs"], ids, ref, 3)
        if extra:  # echo's own lists keep their count of alternatives
            assert all(len(top) <= 2 for top in choice["logprobs"]["top_logprobs"][1 : len(ids)])
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=2,
        extra_body={"prompt_logprobs": 0},
    )
    chat_ids = server.post(
        "/tokenize", {"messages": [{"role": "user", "content": "Hello"}], "add_generation_prompt": True}
    ).json()["tokens"]
    check_prompt_logprobs(chat.model_dump()["prompt_logprobs"], chat_ids, reference(chat_ids), 0)
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    assert "prompt_logprobs" not in plain.model_dump()


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"prompt_logprobs": 2, "stream": True}, "not available with stream"),
        ({"prompt_logprobs": 21}, "prompt_logprobs must be in"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be in"),
        ({"echo": True, "logprobs": 30, "prompt_logprobs": 1}, "must be in"),
    ],
)
def test_vllm_prompt_logprobs_refusals(server, extra, message):
    resp = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 1, **extra})
    assert resp.status_code == 400 and message in resp.json()["error"]["message"], resp.text


def test_completion_logprobs_stream(server):
    body = {"prompt": PROMPT, "max_tokens": 6, "logprobs": 2, "stream": True, **GREEDY}
    resp = server.post("/v1/completions", body)
    tokens = []
    for event in parse_sse(resp.text):
        lp = event["choices"][0]["logprobs"]
        tokens += lp["tokens"] if lp else []
    whole = server.post("/v1/completions", {**body, "stream": False}).json()["choices"][0]
    assert tokens == whole["logprobs"]["tokens"] and len(tokens) == 6


def test_chat_logprobs(server):
    body = {
        "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": 5,
        "logprobs": True,
        "top_logprobs": 4,
        **GREEDY,
    }
    resp = server.post("/v1/chat/completions", body).json()
    ChatCompletion.model_validate(resp)
    content = resp["choices"][0]["logprobs"]["content"]
    assert len(content) == resp["usage"]["completion_tokens"] == 5
    for entry in content:
        top = entry["top_logprobs"]
        assert len(top) == 4 and entry["token"] == top[0]["token"] and entry["logprob"] == top[0]["logprob"]
        assert_sorted([t["logprob"] for t in top])
        assert bytes(entry["bytes"]).decode() == entry["token"]
    none = server.post("/v1/chat/completions", {**body, "logprobs": False, "top_logprobs": None}).json()
    assert none["choices"][0]["logprobs"] is None


def test_chat_logprobs_bytes_join_into_a_split_character(server):
    """A character of several UTF-8 bytes split over tokens (each part's text alone is U+FFFD):
    each token's `bytes` are its own, so the bytes joined are the answer's text, as OpenAI
    documents them. The grammar makes the tiny model write emoji."""
    body = {
        "messages": [{"role": "user", "content": "Smile"}],
        "max_tokens": 12,
        "logprobs": True,
        "top_logprobs": 3,
        "guided_regex": "(😀|🙂)(😀|🙂)+",
        **GREEDY,
    }
    resp = server.post("/v1/chat/completions", body).json()
    ChatCompletion.model_validate(resp)
    content = resp["choices"][0]["logprobs"]["content"]
    text = resp["choices"][0]["message"]["content"]
    assert text and set(text) <= {"😀", "🙂"}, text
    assert any(entry["token"] == "\ufffd" for entry in content)  # the premise: split characters
    if resp["choices"][0]["finish_reason"] == "stop":  # the grammar's end: the end-of-turn token
        content = content[:-1]
    assert bytes(b for entry in content for b in entry["bytes"]).decode() == text
    for entry in content:
        for alternative in (entry, *entry["top_logprobs"]):
            if "\ufffd" not in alternative["token"]:
                assert bytes(alternative["bytes"]).decode() == alternative["token"]


def assert_offsets_index_the_text(lp: dict, text: str) -> None:
    """Each whole token's text stands at its text_offset; a character split over tokens counts
    once, its parts (U+FFFD alone) standing where it does."""
    for token, offset in zip(lp["tokens"], lp["text_offset"]):
        if "\ufffd" not in token:
            assert text[offset : offset + len(token)] == token, (token, offset, text)
    assert lp["text_offset"][-1] <= len(text)  # an end token adds no text


def test_completion_text_offsets_count_split_characters_once(server):
    prompt = "Hi 😀 ok, 你好 there 🙂!"
    whole = server.post(
        "/v1/completions", {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0}
    ).json()
    lp = whole["choices"][0]["logprobs"]
    assert any(t == "\ufffd" for t in lp["tokens"])  # the premise: characters split over tokens
    assert_offsets_index_the_text(lp, whole["choices"][0]["text"])
    body = {
        "prompt": prompt,
        "max_tokens": 8,
        "echo": True,
        "logprobs": 1,
        "guided_regex": "( 😀| ok)+",
        **GREEDY,
    }
    events = parse_sse(server.post("/v1/completions", {**body, "stream": True}).text)
    streamed = {"tokens": [], "text_offset": []}
    text = ""
    for event in events:
        for choice in event["choices"]:
            text += choice["text"]
            if choice["logprobs"]:
                streamed["tokens"] += choice["logprobs"]["tokens"]
                streamed["text_offset"] += choice["logprobs"]["text_offset"]
    assert text.startswith(prompt) and "😀" in text[len(prompt) :]
    assert_offsets_index_the_text(streamed, text)
    assert (
        streamed["text_offset"]
        == server.post("/v1/completions", body).json()["choices"][0]["logprobs"]["text_offset"]
    )


def test_generate_logprobs(server, reference):
    ids = prompt_ids(server, PROMPT)
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 4, **GREEDY},
        "return_logprob": True,
        "logprob_start_len": 2,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
    }
    meta = server.post("/generate", body).json()["meta_info"]
    inputs, outputs = meta["input_token_logprobs"], meta["output_token_logprobs"]
    assert [t[1] for t in inputs] == ids[2:] and len(outputs) == 4
    full = ids + [t[1] for t in outputs]
    ref = reference(full)
    got = [t[0] for t in inputs + outputs]
    expected = ref[torch.arange(1, len(full) - 1), torch.tensor(full[2:])]
    assert torch.allclose(torch.tensor(got), expected, atol=2e-4)
    for top in meta["output_top_logprobs"]:
        assert len(top) == 2 and isinstance(top[0][2], str)
    assert (
        "input_token_logprobs"
        not in server.post("/generate", {**body, "logprob_start_len": -1}).json()["meta_info"]
    )
    # SGLang's max_new_tokens 0: the prompt scored alone, nothing generated
    alone = server.post("/generate", {**body, "sampling_params": {"max_new_tokens": 0}}).json()
    assert (
        alone["text"] == ""
        and alone["output_ids"] == []
        and alone["meta_info"]["output_token_logprobs"] == []
    )
    assert alone["meta_info"]["completion_tokens"] == 0
    assert alone["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    scored = alone["meta_info"]["input_token_logprobs"]
    assert [t[1] for t in scored] == ids[2:]
    assert torch.allclose(
        torch.tensor([t[0] for t in scored]), torch.tensor([t[0] for t in inputs]), atol=1e-5
    )


def generate_ids(server: Server, **sampling) -> list[int]:
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 16, **GREEDY, **sampling}}
    return server.post("/generate", body).json()["output_ids"]


@pytest.mark.parametrize("penalty", ["frequency_penalty", "presence_penalty"])
def test_penalty_prevents_repeats(server, penalty):
    # The tiny model's logits differ by tenths: a penalty of 2 outweighs any preference.
    out = generate_ids(server, **{penalty: 2.0})
    assert len(set(out)) == len(out) == 16


def test_repetition_penalty_changes_output(server):
    ids = prompt_ids(server, PROMPT)
    out = generate_ids(server, repetition_penalty=50.0)
    assert out != generate_ids(server) or not set(out) & set(ids)


def test_logit_bias_forces_tokens(server):
    forced = generate_ids(server, logit_bias={"1234": 100})
    assert forced == [1234] * 16
    # Two forced tokens and a frequency penalty: they alternate.
    both = generate_ids(server, logit_bias={"1234": 100, "4321": 100}, frequency_penalty=1.0)
    assert set(both) == {1234, 4321} and all(a != b for a, b in itertools.pairwise(both))


def test_min_tokens_suppresses_eos_in_the_logits(server):
    eos = server.info()["eos_token_ids"][0]
    sampling = {"temperature": 0, "logit_bias": {str(eos): 100}, "max_new_tokens": 8}
    body = {"text": PROMPT, "sampling_params": sampling}
    first = server.post("/generate", body).json()
    assert first["output_ids"] == [eos] and first["meta_info"]["finish_reason"]["type"] == "stop"
    late = server.post("/generate", {**body, "sampling_params": {**sampling, "min_new_tokens": 5}}).json()
    assert late["output_ids"][5:] == [eos] and eos not in late["output_ids"][:5]


def detokenized(server: Server, token_ids: list[int]) -> str:
    return server.post("/detokenize", {"tokens": token_ids}).json()["prompt"]


def openai_completion(server: Server, **extra) -> str:
    """The text of a greedy 16-token completion of PROMPT through the openai client, with vLLM's
    fields in `extra`."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    body = {"ignore_eos": True, **extra}
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, extra_body=body
    )
    return out.choices[0].text


def test_bad_words_ban_their_token_sequences(server):
    """vLLM's bad_words: a word's last token is banned where the output ends with the rest of it.
    The greedy answer's first token, banned as a word, is not drawn first; its first two tokens'
    text, banned as one word, leaves the first token and changes the second."""
    base = generate_ids(server)
    first, second = detokenized(server, base[:1]), detokenized(server, base[1:2])
    plain = openai_completion(server)
    assert plain == detokenized(server, base)  # the same greedy answer on both endpoints
    without_first = openai_completion(server, bad_words=[first])
    assert not without_first.startswith(first)
    without_pair = openai_completion(server, bad_words=[first + second])
    assert without_pair.startswith(first) and not without_pair.startswith(first + second)


def test_allowed_token_ids_are_the_only_ones_drawn(server):
    allowed = prompt_ids(server, " yes no maybe")
    words = {detokenized(server, [t]).strip() for t in allowed}
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    out = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=24,
        temperature=1.0,
        seed=7,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True},
    )
    drawn = out.choices[0].text.split()
    assert len(drawn) == 24 and set(drawn) <= words, (drawn, words)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(server):
    """vLLM's truncate_prompt_tokens: the prompt is its last k tokens (usage, echo and the answer
    say so, the answer equal to that of those k tokens sent as ids); -1 fits a prompt far over
    the context, which is refused without it."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    ids = prompt_ids(server, PROMPT)
    greedy = {"model": "tiny", "max_tokens": 6, "temperature": 0}
    cut = client.completions.create(
        prompt=PROMPT, echo=True, extra_body={"truncate_prompt_tokens": 5}, **greedy
    )
    assert cut.usage.prompt_tokens == 5
    as_ids = client.completions.create(prompt=ids[-5:], echo=True, **greedy)
    assert cut.choices[0].text == as_ids.choices[0].text  # the echoed last 5 tokens, then the answer
    assert cut.choices[0].text.startswith(detokenized(server, ids[-5:]))
    context = server.info()["max_model_len"]
    huge = PROMPT + " and so on" * context
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(prompt=huge, **greedy)
    fitted = client.completions.create(prompt=huge, extra_body={"truncate_prompt_tokens": -1}, **greedy)
    assert fitted.usage.prompt_tokens == context - 6 and fitted.usage.completion_tokens == 6


def test_skip_special_tokens_false_shows_them_but_not_the_ending_one(server):
    """vLLM's skip_special_tokens: false keeps special tokens' text, except that of the special
    token that ended the request (EOS), which include_stop_str_in_output keeps too; /generate
    takes SGLang's spelling of the same field."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    special = prompt_ids(server, "<|im_start|>")
    assert len(special) == 1
    forced = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "logit_bias": {str(special[0]): 100}}
    assert client.completions.create(**forced).choices[0].text == ""
    shown = client.completions.create(**forced, extra_body={"skip_special_tokens": False})
    assert shown.choices[0].text == "<|im_start|>" * 3
    eos = server.info()["eos_token_ids"][0]
    ending = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "logit_bias": {str(eos): 100}}
    ended = client.completions.create(**ending, extra_body={"skip_special_tokens": False})
    assert ended.choices[0].text == "" and ended.choices[0].finish_reason == "stop"
    kept = client.completions.create(
        **ending, extra_body={"skip_special_tokens": False, "include_stop_str_in_output": True}
    )
    assert kept.choices[0].text == detokenized(server, [eos]) != ""
    body = {
        "text": PROMPT,
        "sampling_params": {
            "max_new_tokens": 3,
            "skip_special_tokens": False,
            "logit_bias": {str(special[0]): 100},
        },
    }
    assert server.post("/generate", body).json()["text"] == "<|im_start|>" * 3


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [10**9]}, "outside the vocabulary"),
        ({"bad_words": [" "]}, "empty word"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be -1 or >= 1"),
    ],
)
def test_allowed_and_bad_words_refusals(server, extra, message):
    reply = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, **extra})
    assert reply.status_code == 400 and message in reply.json()["error"]["message"], reply.text


@pytest.mark.parametrize("prompt_len", [12, 48])
def test_n_choices_prefill_the_prompt_once(server, prompt_len):
    ids = [100 + (7 * i + prompt_len) % 5000 for i in range(prompt_len)]
    before = server.info()["counters"]["prefill_tokens_computed"]
    resp = server.post(
        "/v1/completions", {"prompt": ids, "n": 3, "max_tokens": 4, "temperature": 1.0, "ignore_eos": True}
    ).json()
    assert sorted(c["index"] for c in resp["choices"]) == [0, 1, 2]
    computed = server.info()["counters"]["prefill_tokens_computed"] - before
    # The first copy computes the prompt; the others only its last token (it has no logits cached).
    assert computed == prompt_len + 2


# Enums, booleans and bounded integers: a random model cannot talk forever inside them.
SCHEMAS = [
    {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["colour", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "inner": {
                "type": "object",
                "properties": {
                    "n": {"type": "integer", "minimum": 0, "maximum": 9},
                    "kind": {"enum": ["a", "b"]},
                },
                "required": ["n", "kind"],
                "additionalProperties": False,
            },
            "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
        },
        "required": ["inner", "flags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"level": {"enum": [1, 2, 3]}, "empty": {"type": "null"}},
        "required": ["level", "empty"],
        "additionalProperties": False,
    },
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["enum+bool", "nested", "numbers+null"])
def test_json_schema_responses_validate(server, schema):
    import json

    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    body = {
        "messages": [{"role": "user", "content": "Answer in JSON"}],
        "max_tokens": 80,
        "n": 3,
        "temperature": 1.0,
        "seed": 7,
        "response_format": fmt,
    }
    resp = server.post("/v1/chat/completions", body).json()
    assert len(resp["choices"]) == 3
    for choice in resp["choices"]:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    completion = server.post(
        "/v1/completions", {"prompt": "JSON:", "max_tokens": 80, "response_format": fmt, "temperature": 0}
    ).json()["choices"][0]
    jsonschema.validate(json.loads(completion["text"]), schema)


def test_json_object_regex_and_invalid_grammars(server):
    import re

    out = server.post(
        "/generate",
        {"text": "Answer:", "sampling_params": {"max_new_tokens": 10, "regex": "(yes|no)-[0-9]{3}"}},
    ).json()
    assert re.fullmatch("(yes|no)-[0-9]{3}", out["text"]), out["text"]
    ebnf = 'root ::= "A" ("B" | "C") "."'
    assert server.post(
        "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 5, "ebnf": ebnf}}
    ).json()["text"] in ("AB.", "AC.")
    bad = [
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                },
            },
        ),
        ("/v1/completions", {"prompt": "x", "response_format": {"type": "yaml"}}),
        ("/generate", {"text": "x", "sampling_params": {"regex": "("}}),
    ]
    for path, body in bad:
        resp = server.post(path, body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] is not None, resp.text
    assert server.info()["requests"]["running"] == 0


def test_other_engines_structured_output_fields(server):
    """vLLM's guided_json / guided_regex / guided_choice / guided_grammar and structured_outputs,
    and SGLang's regex / ebnf, on both OpenAI endpoints: each constrains the output (they used to
    be ignored silently); two constraints at once are a 400 naming the second."""
    import json
    import re

    import jsonschema

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    choices = ['yes "sure"', "no\\way", "maybe"]
    chat = {
        "messages": [{"role": "user", "content": "Answer"}],
        "max_tokens": 30,
        "temperature": 1.0,
        "seed": 3,
    }
    cases = [
        ({"guided_json": schema}, lambda t: jsonschema.validate(json.loads(t), schema)),
        ({"guided_json": json.dumps(schema)}, lambda t: jsonschema.validate(json.loads(t), schema)),
        ({"structured_outputs": {"json": schema}}, lambda t: jsonschema.validate(json.loads(t), schema)),
        ({"guided_regex": "(yes|no)-[0-9]{3}"}, lambda t: re.fullmatch("(yes|no)-[0-9]{3}", t) or 1 / 0),
        ({"regex": "[a-c]{4}"}, lambda t: re.fullmatch("[a-c]{4}", t) or 1 / 0),
        ({"guided_choice": choices}, lambda t: choices.index(t)),
        ({"structured_outputs": {"choice": choices}}, lambda t: choices.index(t)),
        ({"guided_grammar": 'root ::= "A" ("B" | "C")'}, lambda t: ["AB", "AC"].index(t)),
        ({"ebnf": 'root ::= "x" "y"?'}, lambda t: ["x", "xy"].index(t)),
    ]
    for fields, check in cases:
        for path, body, text_of in (
            ("/v1/chat/completions", chat, lambda r: r["choices"][0]["message"]["content"]),
            (
                "/v1/completions",
                {"prompt": "Answer:", "max_tokens": 30, "seed": 3},
                lambda r: r["choices"][0]["text"],
            ),
        ):
            resp = server.post(path, {**body, **fields})
            assert resp.status_code == 200, (fields, resp.text)
            assert resp.json()["choices"][0]["finish_reason"] == "stop", (fields, resp.text)
            check(text_of(resp.json()))
    # any JSON (no schema) may run past max_tokens with a random model: accepted is the check
    anything = server.post("/v1/chat/completions", {**chat, "structured_outputs": {"json_object": True}})
    assert anything.status_code == 200, anything.text
    bad = [
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "regex": "a"}, "regex"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": "[1]"}, "guided_json"),
        ({"guided_choice": ["a", ""]}, "guided_choice"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "("}, None),
    ]
    for fields, param in bad:
        resp = server.post("/v1/chat/completions", {**chat, **fields})
        assert resp.status_code == 400, (fields, resp.text)
        if param is not None:
            assert param in resp.json()["error"]["param"], resp.text
    assert server.info()["requests"]["running"] == 0


MC_TASK = """task: minfer_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""

GEN_TASK = """task: minfer_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


def test_lm_evaluation_harness_runs_offline(server, tmp_path):
    """lm-evaluation-harness's local-completions (loglikelihood with echo logprobs, and
    generate_until) with the server's own tokenizer endpoints and task files written here."""
    pytest.importorskip("lm_eval")
    import json
    import os
    import subprocess
    import sys

    mc = [
        {
            "question": f"Question {i}: the colour of the sky is",
            "choices": [" blue", " green", " red"],
            "label": 0,
        }
        for i in range(4)
    ]
    gen = [{"question": f"Say a word number {i}:", "answer": "word"} for i in range(3)]
    for name, rows, template in (("mc", mc, MC_TASK), ("gen", gen, GEN_TASK)):
        data = tmp_path / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tmp_path / f"{name}.yaml").write_text(template.format(data=data))
    model_args = (
        f"model=tiny,base_url={server.url}/v1/completions,tokenizer_backend=remote,"
        "num_concurrent=2,max_retries=1"
    )
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "datasets"),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lm_eval",
            "--model",
            "local-completions",
            "--model_args",
            model_args,
            "--tasks",
            "minfer_mc,minfer_gen",
            "--include_path",
            str(tmp_path),
            "--output_path",
            str(tmp_path / "out"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = json.loads(next((tmp_path / "out").rglob("results*.json")).read_text())["results"]
    assert 0 <= results["minfer_mc"]["acc,none"] <= 1
    assert 0 <= results["minfer_gen"]["exact_match,none"] <= 1

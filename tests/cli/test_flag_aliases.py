"""vLLM's and SGLang's flags reach minfer's options (config.FLAG_ALIASES). A value no run can use
makes the command name minfer's own flag, which shows where the alias went without a model load."""

from __future__ import annotations

import pytest
from cli_harness import assert_one_line_error, minfer

from minfer.config import FLAG_ALIASES

# A refused value per option, and the message naming minfer's flag.
BAD_VALUE = {
    "tp": ("0", "--tp=0 must be >= 1"),
    "mem_fraction": ("1.5", "--mem-fraction=1.5 must be in"),
    "max_running_requests": ("0", "--max-running-requests=0 must be >= 1"),
    "chunked_prefill_size": ("0", "--chunked-prefill-size=0 must be >= 1"),
    "max_model_len": ("0", "--max-model-len=0 must be >= 1"),
    "tokenizer": ("/no/such/tokenizer", "--tokenizer '/no/such/tokenizer' is not a directory"),
    "model": ("/no/such/model", "'/no/such/model' not found"),
    "seed": ("x", "invalid int value"),
}


@pytest.mark.parametrize("alias", [a for a, (name, _) in FLAG_ALIASES.items() if name in BAD_VALUE])
def test_an_alias_sets_minfers_option(alias):
    value, message = BAD_VALUE[FLAG_ALIASES[alias][0]]
    result = minfer("generate", "--prompt", "hi", alias, value)
    if message.startswith("invalid"):  # argparse's own check: the alias has the option's type
        assert result.returncode == 2 and message in result.stderr
    else:
        assert_one_line_error(result, message)


def test_model_twice_is_refused():
    result = minfer("generate", "/a/model", "--model", "/another/model", "--prompt", "hi")
    assert_one_line_error(result, "two models given")


def test_served_model_name_does_not_swallow_the_model_path():
    result = minfer("serve", "--served-model-name", "a", "/no/such/model")
    assert_one_line_error(result, "--served-model-name a /no/such/model", "give one")


def test_trust_remote_code_is_accepted_with_a_note():
    result = minfer("generate", "/no/such/model", "--prompt", "hi", "--trust-remote-code")
    assert "runs no code from model repositories" in result.stderr
    assert_one_line_error(result, "not found")


def test_the_chat_template_reaches_the_offline_engine(tiny_chat_model):
    template = "{{ raise_exception('refused by the --chat-template') }}"
    result = minfer("generate", tiny_chat_model, "--chat", "--prompt", "hi", "--chat-template", template)
    assert result.returncode == 2
    assert "refused by the --chat-template" in result.stderr


def test_a_tokenizer_from_another_folder(tmp_path, tiny_chat_model):
    from tiny_models import save_tiny_model

    save_tiny_model("llama", tmp_path, vocab_size=49152)  # weights and config, no tokenizer
    without = minfer("generate", str(tmp_path), "--prompt", "hi", "--max-tokens", "2")
    assert without.returncode == 2 and "no tokenizer" in without.stderr
    result = minfer(
        "generate", str(tmp_path), "--tokenizer", tiny_chat_model, "--prompt", "hi", "--max-tokens", "2"
    )
    assert result.returncode == 0, result.stderr

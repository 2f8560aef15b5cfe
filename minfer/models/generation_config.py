"""The model maker's generation settings: generation_config.json beside config.json.

Two things in it change what a user gets:
- `eos_token_id`: the tokens that end a turn. Often more than config.json names: Llama 3.0
  Instruct's config.json has only <|end_of_text|>, and its chat turns end in <|eot_id|>, which
  only generation_config.json lists; without it an answer runs on past its turn.
- the sampling settings the maker recommends (Qwen3: temperature 0.6, top_p 0.95, top_k 20).
  A request that leaves a field unset gets the maker's value, as vLLM (`--generation-config
  auto`) and SGLang (`--sampling-defaults model`) do; `--generation-config none` keeps minfer's
  own defaults (OpenAI's: temperature 1, no truncation). With `do_sample: false` the file's
  sampling values do not apply (transformers ignores them too), so none are taken.
"""

from __future__ import annotations

import json
import logging
import math
import os

log = logging.getLogger(__name__)

FILE_NAME = "generation_config.json"
OWN_DEFAULTS = ("none", "vllm")  # --generation-config values that keep minfer's own defaults
# The fields a request may leave unset that the file can fill, in SamplingParams' names.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def read_generation_config(folder: str | None) -> dict:
    """The folder's generation_config.json as a dict; {} where there is none (a .gguf file, a
    shipped config) or it cannot be read (said once in the log: the model still serves)."""
    if folder is None or not os.path.isdir(folder):
        return {}
    path = os.path.join(folder, FILE_NAME)
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        log.warning("ignoring %s: %s", path, e)
        return {}
    if not isinstance(raw, dict):
        log.warning("ignoring %s: not a JSON object", path)
        return {}
    return raw


def generation_eos_ids(generation: dict) -> set[int]:
    """The end-of-turn token ids the file names (an id or a list of them)."""
    eos = generation.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [eos]
    return {i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0}


def sampling_defaults(generation: dict) -> dict:
    """The file's sampling values for requests that leave them unset, in SamplingParams' names;
    a value outside SamplingParams' range is left out (and said in the log)."""
    from minfer.core import InvalidRequestError, SamplingParams

    if generation.get("do_sample") is False:
        return {}
    defaults = {}
    for name in SAMPLING_FIELDS:
        value = generation.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        value = int(value) if name == "top_k" else float(value)
        try:
            SamplingParams(**{name: value}).validate()
        except InvalidRequestError as e:
            log.warning("ignoring %s's %s=%r: %s", FILE_NAME, name, value, e)
            continue
        defaults[name] = value
    return defaults


def describe_defaults(defaults: dict) -> str:
    """`temperature=0.6, top_p=0.95` for the startup line."""
    return ", ".join(f"{name}={value:g}" for name, value in defaults.items())


def generation_settings(model_folder: str | None, choice: str) -> tuple[set[int], dict]:
    """(end-of-turn ids, sampling defaults) for `--generation-config choice`: the end-of-turn ids
    of the model folder's file always (they are how the model ends a turn, not a preference),
    and of a folder given instead; the sampling defaults of the model folder's file (auto), of
    the given folder's, or none."""
    own = read_generation_config(model_folder)
    # "vllm" is vLLM's spelling of none (its own defaults), so its command lines run unchanged
    chosen = own if choice == "auto" else {} if choice in OWN_DEFAULTS else read_generation_config(choice)
    return generation_eos_ids(own) | generation_eos_ids(chosen), sampling_defaults(chosen)

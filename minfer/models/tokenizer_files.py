"""A model's tokenizer: from its directory (or --tokenizer's), or converted from a GGUF file and
cached beside its other conversions. Without torch, so the tokenizer and detokenizer workers,
which need only this of the model, start without importing it (~1 s of CPU each)."""

from __future__ import annotations

import logging
import os
import time

from minfer.models.gguf_cache import cache_dir, publish
from minfer.models.source import SHIPPED_CONFIGS, ModelSource

log = logging.getLogger(__name__)


def load_tokenizer(source: ModelSource):
    """The model's tokenizer (or `source.tokenizer_path`'s) with `source.chat_template` in place
    of its own when given; None for shipped dummy shapes and directories without one."""
    tokenizer = _read_tokenizer(source.tokenizer_path or source.path, source)
    if tokenizer is not None and source.chat_template is not None:
        tokenizer.chat_template = source.chat_template
    return tokenizer


def tokenizer_needs_torch(source: ModelSource) -> bool:
    """Whether reading this source's tokenizer needs torch: only to convert a GGUF file's
    (transformers' GGUF reader imports it); once converted it is read from the cache."""
    path = source.tokenizer_path or source.path
    return path.endswith(".gguf") and not (cache_dir(path) / "tokenizer").exists()


def _read_tokenizer(path: str, source: ModelSource):
    if source.tokenizer_path is None and source.load_format == "dummy" and str(SHIPPED_CONFIGS) in path:
        return None
    from transformers import AutoTokenizer

    if path.endswith(".gguf"):
        return gguf_tokenizer(path)
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if not any(os.path.exists(os.path.join(path, f)) for f in tokenizer_files):
        log.warning("%s has no tokenizer files: prompts must be token ids", path)
        return None
    return AutoTokenizer.from_pretrained(path)


def gguf_tokenizer(path: str):
    """The file's tokenizer, with its chat template, as a transformers tokenizer."""
    from transformers import AutoTokenizer

    cache = cache_dir(path)
    if not (cache / "tokenizer").exists():
        start = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(
            os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path)
        )
        tokenizer.name_or_path = path
        if not publish(cache, "tokenizer", tokenizer.save_pretrained):
            return tokenizer
        log.info(
            "built the tokenizer of %s in %.1f s and cached it at %s",
            path,
            time.perf_counter() - start,
            cache / "tokenizer",
        )
    tokenizer = AutoTokenizer.from_pretrained(cache / "tokenizer")
    tokenizer.name_or_path = path
    return tokenizer

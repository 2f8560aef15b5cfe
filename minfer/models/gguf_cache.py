"""Where converted copies of a GGUF file live (its config, tokenizer, weights), and how an entry
is published so that a concurrent reader sees all of it or nothing. Without torch: the
tokenizer workers read a GGUF model's tokenizer from here."""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_VERSION = 1  # bump when the conversion changes, so stale copies are not reused


def cache_dir(path: str) -> Path:
    """Where the converted copy of this GGUF file lives (it may not exist yet)."""
    stat = os.stat(path)
    # A newer transformers or gguf may convert differently (tokenizers above all): start afresh.
    versions = [CACHE_VERSION, importlib.metadata.version("transformers"), importlib.metadata.version("gguf")]
    key = "\0".join(map(str, [*versions, os.path.abspath(path), stat.st_size, stat.st_mtime_ns]))
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "minfer" / "gguf" / hashlib.sha256(key.encode()).hexdigest()[:16]


def publish(cache: Path, entry: str, write: Callable[[Path], None]) -> bool:
    """Write `cache/entry/` through a temporary sibling and one rename, so a concurrent reader
    (another TP rank) sees all of it or nothing. False when the cache cannot be written."""
    tmp = None
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cache, prefix=f".{entry}-"))
        write(tmp)
        os.rename(tmp, cache / entry)
        return True
    except OSError as e:
        if (cache / entry).exists():  # another process published it first
            return True
        log.warning("cannot cache converted GGUF %s at %s: %s", entry, cache, e)
        return False
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)

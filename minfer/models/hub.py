"""Hugging Face model ids (`Qwen/Qwen2.5-0.5B-Instruct`) -> a local snapshot directory.

Only what minfer reads is downloaded: the config, the tokenizer files and the safetensors
weights (never PyTorch .bin duplicates, ONNX or GGUF variants). Offline (`HF_HUB_OFFLINE=1`, or
when the download fails) the hub library's local cache answers instead.
"""

from __future__ import annotations

import logging
import os
import re

from minfer.config import ModelNotFoundError

log = logging.getLogger(__name__)

# config.json, generation_config.json, tokenizer.json / tokenizer_config.json /
# special_tokens_map.json, the safetensors index; sentencepiece models, BPE merges and vocab
# lists; a chat template shipped as its own file.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja"]

# `name` or `org/name`: letters, digits, `-`, `_`, `.`; not a path that starts with `.` or `/`.
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def looks_like_repo_id(model: str) -> bool:
    return bool(_REPO_ID.match(model)) and not model.endswith(".gguf")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def download_model(repo_id: str, revision: str | None = None, cache_dir: str | None = None) -> str:
    """The local directory of `repo_id` at `revision`, downloading what is missing unless
    offline. Raises ModelNotFoundError with one line saying why when there is none."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f"{repo_id}@{revision}" if revision else repo_id
    kwargs = dict(
        repo_id=repo_id,
        revision=revision,
        cache_dir=cache_dir,
        allow_patterns=ALLOW_PATTERNS,
        token=os.environ.get("HF_TOKEN") or None,
    )
    cache = cache_dir or "the Hugging Face cache"
    try:
        if _offline():
            return snapshot_download(**kwargs, local_files_only=True)
        try:
            return snapshot_download(**kwargs)
        except (RepositoryNotFoundError, RevisionNotFoundError, GatedRepoError):
            raise
        except Exception as e:  # no network, a proxy, a timeout: the cache may still have it
            log.warning("downloading %s failed (%s); looking in the local cache", at, type(e).__name__)
            return snapshot_download(**kwargs, local_files_only=True)
    except GatedRepoError:
        raise ModelNotFoundError(
            f"model {at!r} is gated on the Hugging Face Hub: accept its terms there and set HF_TOKEN"
        ) from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"model {at!r} is neither a local path nor a Hugging Face repository (a private one "
            "needs HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(f"model {repo_id!r} has no revision {revision!r}") from None
    except LocalEntryNotFoundError:
        raise ModelNotFoundError(
            f"model {at!r} is neither a local path nor cached in {cache}, and cannot be "
            "downloaded now (HF_HUB_OFFLINE=1 or no network); --download-dir names another cache"
        ) from None

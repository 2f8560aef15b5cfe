"""The request intake: a prompt (text, token ids or chat messages) becomes token ids, the same
way for the server's tokenizer worker, the offline `LLM` and `minfer shell`.

Too long a text is refused before it is all tokenized (prompt_limits.py); a conversation is
rendered with the model's chat template. Errors are InvalidRequestError naming the field, with
OpenAI's code where one applies, so every front end reports them alike. Outputs go the other
way through detokenizer.IncrementalDetokenizer (incremental text and stop strings), which the
same three front ends share.
"""

from __future__ import annotations

import functools
import os
import sys

import msgspec

from minfer.config import EngineConfig
from minfer.core import InvalidRequestError, SamplingParams
from minfer.tokenizer.prompt_limits import PromptMeter, text_bytes


def load_model_tokenizer(config: EngineConfig, without_torch: bool = False):
    """The model's tokenizer. `without_torch`, for the tokenizer and detokenizer processes,
    which never run a model: torch is made to look absent to transformers, which otherwise
    imports it with any tokenizer (transformers 5: configuration_utils -> modeling_rope_utils),
    ~0.9 s of CPU at each start of each process. Not where torch is imported already, nor where
    a GGUF file's tokenizer is still to be converted (transformers' GGUF reader needs torch)."""
    # not through models/loader, which imports torch
    from minfer.models.source import model_source
    from minfer.models.tokenizer_files import load_tokenizer, tokenizer_needs_torch

    source = model_source(config)
    if without_torch and "torch" not in sys.modules and not tokenizer_needs_torch(source):
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # its "PyTorch was not found"
        sys.modules["torch"] = None  # an import of torch now fails at once, loudly
    return load_tokenizer(source)


# apply_chat_template's own arguments: chat_template_kwargs may not set them (they would clash
# with the ones minfer passes, or change what the call returns).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
     "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
     "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip


def check_template_kwargs(template_kwargs: dict | None) -> None:
    """chat_template_kwargs: extra variables for the chat template (Qwen3's `enable_thinking`)."""
    clash = sorted(RESERVED_TEMPLATE_KWARGS & set(template_kwargs or {}))
    if clash:
        raise InvalidRequestError(
            f"chat_template_kwargs may not set {', '.join(clash)}: minfer passes them itself",
            "chat_template_kwargs",
        )


def developer_as_system(template, messages: list[dict]) -> list[dict]:
    """`messages` with OpenAI's `developer` role (its newer name for the system message) written
    as `system` where the chat template does not name that role: Qwen3's template silently drops
    a message of a role it does not know, Llama 3's writes a header its model never saw, and
    stricter templates raise. A template that names `developer` gets the messages as they are."""
    if "developer" in str(template) or not any(m.get("role") == "developer" for m in messages):
        return messages
    return [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]


def render_chat_text(
    tokenizer,
    messages: list[dict],
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
    continue_final_message: bool = False,
) -> str:
    """A conversation as text under the model's chat template (with the tools it may call, and
    the request's extra template variables). `continue_final_message`: the last (assistant)
    message is left open, for the model to go on writing it (vLLM's option)."""
    check_template_kwargs(template_kwargs)
    if continue_final_message and (add_generation_prompt or messages[-1].get("role") != "assistant"):
        raise InvalidRequestError(
            "continue_final_message needs add_generation_prompt false and an assistant message last",
            "continue_final_message",
        )
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(
            "this model has no chat template: send a plain prompt (/v1/completions)", "messages"
        )
    try:
        return tokenizer.apply_chat_template(
            developer_as_system(tokenizer.chat_template, messages),
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **(template_kwargs or {}),
        )
    except Exception as e:  # jinja raises for conversations the template refuses (roles order, ...)
        raise InvalidRequestError(f"the chat template rejected the messages: {e}", "messages") from e


def render_chat(
    tokenizer, messages: list[dict], add_generation_prompt: bool = True, template_kwargs: dict | None = None
) -> list[int]:
    """Token ids of a conversation under the model's chat template."""
    text = render_chat_text(tokenizer, messages, add_generation_prompt, template_kwargs=template_kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def encode_text(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    if tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer: send token ids", "prompt")
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def with_bad_words_ids(tokenizer, params: SamplingParams) -> SamplingParams:
    """`params` with its bad_words as token sequences (SamplingParams.bad_words_ids): each word
    as it tokenizes at the start of a text and after a space, each distinct sequence once."""
    if not params.bad_words:
        return params
    if tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer to spell bad_words with", "bad_words")
    sequences = []
    for word in params.bad_words:
        for spelling in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(spelling, add_special_tokens=False)
            if ids and ids not in sequences:
                sequences.append(ids)
    return msgspec.structs.replace(params, bad_words_ids=sequences)


class PromptEncoder:
    """Prompt -> token ids, refusing prompts longer than `max_prompt_tokens` (None: no limit yet)
    as early as their bytes allow."""

    def __init__(self, tokenizer, max_prompt_tokens: int | None = None):
        self.tokenizer = tokenizer
        self.meter = PromptMeter(tokenizer, max_prompt_tokens)

    def encode(
        self,
        prompt: str | None = None,
        prompt_ids: list[int] | None = None,
        messages: list[dict] | None = None,
        add_special_tokens: bool = True,
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        keep_last: int | None = None,
    ) -> list[int]:
        """Exactly one of `prompt` (text), `prompt_ids` or `messages` (chat, with `tools` and
        extra chat-template variables) is given. `keep_last`: keep only the last that many tokens
        (`keep_last(params)`)."""
        truncating = keep_last is not None
        if messages is not None:
            size = text_bytes(messages) + text_bytes(tools or []) + text_bytes(template_kwargs or {})
            self.meter.check_bytes(size, "messages")
            text = render_chat_text(
                self.tokenizer,
                messages,
                add_generation_prompt,
                tools,
                template_kwargs,
                continue_final_message,
            )
            ids = self.meter.encode(text, add_special_tokens=False, param="messages", truncating=truncating)
        elif prompt is not None:
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: send token ids", "prompt")
            ids = self.meter.encode(prompt, add_special_tokens, truncating=truncating)
        else:
            ids = list(prompt_ids or [])
        if keep_last is None or len(ids) <= keep_last:
            return ids
        # A BOS the tokenizer put first stays first, as a tokenizer truncating from the left keeps it.
        kept = self.bos_prefix if prompt is not None and add_special_tokens else []
        kept = kept if ids[: len(kept)] == kept and len(kept) < keep_last else []
        return kept + ids[len(ids) - keep_last + len(kept) :]

    def keep_last(self, params: SamplingParams) -> int | None:
        """The prompt tokens `params.truncate_prompt_tokens` keeps: its count, or for -1 as many as
        the context holds beside max_tokens (None: no truncation, or no limit known yet)."""
        count = params.truncate_prompt_tokens
        if count == -1:
            limit = self.meter.max_prompt_tokens  # the context less one token
            return None if limit is None else max(1, limit + 1 - params.max_tokens)
        return count

    @functools.cached_property
    def bos_prefix(self) -> list[int]:
        """The tokens the tokenizer puts before any text (a BOS, or none)."""
        return self.tokenizer.encode("", add_special_tokens=True) if self.tokenizer is not None else []

"""What every request body shares: the strict pydantic base, the size-bounded field types, and
the refusal of other engines' fields that minfer does not implement.

Every size a client controls is bounded here (list lengths, string lengths, integers that cross
to the workers as msgpack int64), so no value can reach the workers and fail there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from minfer.server.errors import APIError

# More choices per prompt than this is a mistake, not a workload (each holds its own KV).
MAX_CHOICES = 128
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1024
MAX_LISTED_TOKEN_IDS = 1024  # stop_token_ids, logit_bias entries
MAX_TIMEOUT_S = 24 * 3600.0
MAX_TOOLS = 128  # OpenAI's own limit on `tools`
MAX_GRAMMAR_CHARS = 100_000  # a regex or grammar of an output constraint
MAX_CHOICE_STRINGS = 1024  # guided_choice entries

# Integers cross to the workers as msgpack int64: a larger one is a 400 here, not a 500 there.
Int = Annotated[int, Field(ge=-(2**63), lt=2**63)]
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Text = Annotated[str, Field(min_length=1)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
StopTokenIds = Annotated[list[TokenId], Field(max_length=MAX_LISTED_TOKEN_IDS)]
LogitBias = Annotated[dict[str, float], Field(max_length=MAX_LISTED_TOKEN_IDS)]
AllowedTokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_LISTED_TOKEN_IDS)]
BadWords = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]  # words, bounded as stop strings
Timeout = Annotated[float, Field(gt=0, le=MAX_TIMEOUT_S)]


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


# Other engines' request fields that minfer does not implement. A body may carry one at the value
# that means what minfer does anyway (vLLM clients send some by default); any other value is a
# 400 naming it, where ignoring it would silently answer another question. Fields of no one's
# behaviour (OpenAI's store, metadata, service_tier, ...) are ignored.
UNSUPPORTED_FIELDS: dict[str, Callable[[Any], bool]] = {
    "best_of": lambda v: v in (None, 1),
    "use_beam_search": lambda v: not v,
    "length_penalty": lambda v: v in (None, 1, 1.0),
    "spaces_between_special_tokens": lambda v: v in (None, True),
    "logits_processors": lambda v: not v,
    "functions": lambda v: not v,  # OpenAI's deprecated form of tools
    "function_call": lambda v: v in (None, "none"),
}


def refuse_unsupported(
    extra: dict[str, Any] | None, table: dict[str, Callable[[Any], bool]], prefix: str = ""
) -> None:
    """A 400 naming the first field of `extra` (a body's unknown fields) that `table` refuses at
    its value."""
    for name, value in (extra or {}).items():
        accepts = table.get(name)
        if accepts is not None and not accepts(value):
            raise APIError(400, f"{prefix}{name}={str(value)[:80]} is not supported by minfer", prefix + name)

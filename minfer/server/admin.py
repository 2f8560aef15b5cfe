"""Status, model and tokenizer endpoints: /health, /metrics, /v1/models, /version,
/v1/server_info, /abort_request (SGLang), /tokenize, /detokenize, /tokenizer_info (vLLM)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from minfer import __version__
from minfer.ipc import messages as m
from minfer.server.body import Body, Int
from minfer.server.driver import json_response
from minfer.server.errors import ERROR_RESPONSES, APIError, ErrorResponse, error_response
from minfer.server.protocol import ChatMessage
from minfer.server.state import ServerState, server_state

METRICS_SCRAPE_TIMEOUT_S = 2.0

router = APIRouter(responses=ERROR_RESPONSES)


class TokenizeRequestBody(Body):
    """vLLM's /tokenize: a `prompt`, or chat `messages` rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # with messages, as on /v1/chat/completions
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequestBody(Body):
    model: str | None = None
    tokens: list[Int]


class AbortRequestBody(Body):
    rid: str


class Health(BaseModel):
    status: Literal["ok"]


class AbortResult(BaseModel):
    rid: str
    aborted: int


class TokenizeResult(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResult(BaseModel):
    prompt: str


class Version(BaseModel):
    version: str


@router.get("/health", response_model=Health, responses={503: {"model": ErrorResponse}})
async def health(state: ServerState = Depends(server_state)):
    if state.alive():
        return json_response({"status": "ok"})
    return error_response(503, state.client.failure or state.why_dead())


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
async def metrics(state: ServerState = Depends(server_state)):
    client = state.client
    try:  # the scheduler's gauges and totals, fresh for this scrape
        live = await client.call(m.InfoQuery(call_id=next(client.call_ids)), timeout=METRICS_SCRAPE_TIMEOUT_S)
        client.metrics.update_scheduler(live.info.get("stats", {}))
    except APIError:
        pass  # a busy or dead scheduler: serve its last snapshot (/health says which)
    return Response(client.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def model_card(state: ServerState) -> dict:
    """OpenAI's Model object of the served model, with vLLM's `root` and `max_model_len`."""
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "minfer",
        "root": state.scheduler_info["model"],
        "max_model_len": state.max_model_len,
    }


@router.get("/v1/models")
async def models(state: ServerState = Depends(server_state)):
    return json_response({"object": "list", "data": [model_card(state)]})


@router.get("/v1/models/{model:path}")  # a name may hold slashes: Qwen/Qwen3-0.6B
async def model(model: str, state: ServerState = Depends(server_state)):
    state.check_model(model)  # another name: 404 model_not_found
    return json_response(model_card(state))


@router.get("/version", response_model=Version)
async def version():
    return json_response({"version": __version__})


@router.get("/v1/server_info")
async def server_info(state: ServerState = Depends(server_state)):
    client = state.client
    live = (await client.call(m.InfoQuery(call_id=next(client.call_ids)))).info
    return json_response(
        {
            "version": __version__,
            "model": state.model_name,
            "engine_config": dataclasses.asdict(state.engine_config),
            "server_config": {
                **dataclasses.asdict(state.server_config),
                "api_key": None,
            },  # never echo the key
            **state.scheduler_info,
            **live,
            "workers": {role: p.pid for role, p in state.workers.items()},
        }
    )


@router.post("/abort_request", response_model=AbortResult)
async def abort_request(body: AbortRequestBody, state: ServerState = Depends(server_state)):
    group = state.groups.get(body.rid)
    if group is None:
        return json_response({"rid": body.rid, "aborted": 0})
    uids = list(group.open)
    for uid in uids:
        state.client.abort(uid, forget=False)  # its stream ends with finish_reason "abort"
    return json_response({"rid": body.rid, "aborted": len(uids)})


async def tokenizer_call(state: ServerState, **fields) -> m.TokenizerResult:
    client = state.client
    result = await client.call(m.TokenizerCall(call_id=next(client.call_ids), **fields))
    if result.error:
        raise APIError(400, result.error)
    return result


@router.post("/tokenize", response_model=TokenizeResult)
async def tokenize(body: TokenizeRequestBody, state: ServerState = Depends(server_state)):
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", "prompt")
    messages = None if body.messages is None else [msg.as_template_input() for msg in body.messages]
    result = await tokenizer_call(
        state,
        kind="encode",
        text=body.prompt,
        messages=messages,
        chat_template_kwargs=body.chat_template_kwargs,
        add_special_tokens=body.add_special_tokens,
        add_generation_prompt=body.add_generation_prompt,
        return_token_strs=body.return_token_strs,
    )
    return json_response(
        {
            "count": len(result.token_ids),
            "max_model_len": state.max_model_len,
            "tokens": result.token_ids,
            "token_strs": result.token_strs,
        }
    )


@router.post("/detokenize", response_model=DetokenizeResult)
async def detokenize(body: DetokenizeRequestBody, state: ServerState = Depends(server_state)):
    state.check_model(body.model)
    result = await tokenizer_call(state, kind="decode", token_ids=body.tokens)
    return json_response({"prompt": result.text})


@router.get("/tokenizer_info")
async def tokenizer_info(state: ServerState = Depends(server_state)):
    return json_response({**state.tokenizer_info, "model_max_length": state.max_model_len})

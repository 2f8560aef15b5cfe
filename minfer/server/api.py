"""The HTTP API: OpenAI's completions, chat and responses, SGLang's /generate, vLLM's tokenizer
endpoints.

`build_app` assembles the routers (one module per API: openai_completions, openai_chat,
openai_responses, sglang_generate, admin), the error handlers (errors.py) and the guards in front of them
(guards.py: API key, body size). Each endpoint validates its body (protocol.py), hands its
engine requests to the response driver (driver.py) and shapes the answer.
"""

from __future__ import annotations

import os

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from minfer import __version__
from minfer.server import admin, openai_chat, openai_completions, openai_responses, sglang_generate
from minfer.server.connection import uvicorn_options
from minfer.server.errors import install_error_handlers
from minfer.server.guards import APIKeyGuard, BodySizeLimit
from minfer.server.state import ServerState

__all__ = ["ServerState", "build_app", "uvicorn_options"]

API_KEY_ENV = "MINFER_API_KEY"


def api_key(state: ServerState) -> str | None:
    """--api-key, else $MINFER_API_KEY (which, unlike a flag, `ps` does not show); None: no key."""
    return state.server_config.api_key or os.environ.get(API_KEY_ENV) or None


def openapi_schema(app: FastAPI) -> dict:
    """FastAPI's document, less the 422 it adds to every operation: a body that fails validation
    is a 400 here (OpenAI's status), which each operation lists with the error's schema."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in schema["paths"].values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for unused in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(unused, None)
        app.openapi_schema = schema
    return app.openapi_schema


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="minfer", version=__version__, docs_url=None, redoc_url=None)
    app.state.minfer = state
    install_error_handlers(app)
    for module in (openai_completions, openai_chat, openai_responses, sglang_generate, admin):
        app.include_router(module.router)
    app.openapi = lambda: openapi_schema(app)
    cfg = state.server_config
    # Added last runs first: the key is checked before a byte of the body is read.
    app.add_middleware(BodySizeLimit, max_bytes=cfg.max_request_bytes)
    key = api_key(state)
    if key:
        open_paths = {"/health"} if cfg.metrics_require_key else {"/health", "/metrics"}
        app.add_middleware(APIKeyGuard, api_key=key, open_paths=frozenset(open_paths))
    return app

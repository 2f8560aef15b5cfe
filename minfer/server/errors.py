"""The one error shape every endpoint answers with, and the handlers that produce it.

OpenAI's `{"error": {"message", "type", "param", "code"}}`. The HTTP status always comes from the
type of the error (APIError's status; an InvalidRequestError is a 400 with the `code` it carries),
never from its text. Messages pass `public_message` first: no file path (xgrammar quotes its C++ source
files), no traceback, no internal repr reaches a client.
"""

from __future__ import annotations

import logging
import re

import msgspec
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from minfer.core import InvalidRequestError

log = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable",
}

# `[09:43:11] ` (dmlc's log prefix) and absolute paths of two or more parts (`/project/cpp/x.cc:94:`).
_LOG_TIME = re.compile(r"\[\d\d:\d\d:\d\d\]\s*")
_PATH = re.compile(r"(?<![\w.])/(?:[\w.+-]+/)+[\w.+-]+(?::\d+)*:?\s*")


def public_message(message: str) -> str:
    """The message without timestamps and file paths; what a client may read."""
    cleaned = _PATH.sub("", _LOG_TIME.sub("", message)).strip()
    return cleaned or "invalid request"


class APIError(Exception):
    """An error answered as OpenAI's error JSON with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers  # e.g. Retry-After of a 503 when the queue is full

    @classmethod
    def invalid(cls, e: InvalidRequestError, param: str | None = None) -> APIError:
        """The 400 for an InvalidRequestError (its code, e.g. context_length_exceeded, travels with
        it); `param` overrides the error's own field name."""
        return cls(400, str(e), param or e.param, e.code)

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {
        "error": {
            "message": public_message(message),
            "type": ERROR_TYPES.get(status, "server_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, headers: dict | None = None
) -> Response:
    return Response(
        msgspec.json.encode(error_body(status, message, param, code)),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error JSON (the schema every non-2xx answer of this server has)."""

    error: ErrorDetail


# What every operation may answer besides its success, for the OpenAPI document.
ERROR_RESPONSES = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 503)}


def describe_validation_errors(errors: list[dict]) -> tuple[str, str | None]:
    """A readable message for pydantic's errors: `messages[0].role: Input should be ...`.

    Union branches show up in pydantic's locations as type names (`str`, `list[TextPart]`); they
    are dropped, and errors that then read the same are merged.
    """
    seen, parts = set(), []
    first_param = None
    for err in errors:
        path = ""
        for item in err.get("loc", ()):
            if item == "body":
                continue
            if isinstance(item, int):
                path += f"[{item}]"
            elif "[" in item or "-" in item or item in ("str", "int", "float", "bool", "list", "dict"):
                continue  # a union branch (`str`, `list[int]`, `function-after[...]`), not a field
            else:
                path += f".{item}" if path else item
        if err.get("type") == "json_invalid":  # its location is a character offset, not a field
            text, path = f"the request body is not valid JSON (at character {path.strip('[]') or 0})", ""
        elif err.get("type") == "missing":
            text = f"{path or 'body'}: field required"
        else:
            text = f"{path or 'body'}: {err.get('msg', 'invalid value')}"
        if text not in seen:
            seen.add(text)
            parts.append(text)
            first_param = first_param or path or None
    if len(parts) > 3:
        parts = parts[:3] + [f"({len(parts) - 3} more)"]
    return "; ".join(parts) or "invalid request", first_param


def install_error_handlers(app: FastAPI) -> None:
    """Every exception an endpoint raises becomes OpenAI's error JSON, never a traceback."""

    @app.exception_handler(APIError)
    async def _api_error(_request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_request, exc: InvalidRequestError):
        err = APIError.invalid(exc)
        return error_response(err.status, err.message, err.param, err.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_request, exc: RequestValidationError):
        message, param = describe_validation_errors(exc.errors())
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(_request, exc: Exception):
        log.exception("unexpected error")  # the details go to the log, not to the client
        return error_response(500, "internal server error; the server log has the details")

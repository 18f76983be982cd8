"""OpenAI-style JSON errors: `{"error": {"message", "type", "param", "code"}}` for every 4xx and
5xx the server answers, including unknown routes (404) and wrong methods (405)."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

RETRY_AFTER_S = 1  # what a 503 (the engine's waiting queue is full) asks a client to wait

_KINDS = {
    400: ("invalid_request_error", None),
    401: ("authentication_error", "invalid_api_key"),
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
    503: ("service_unavailable", "engine_unavailable"),
}


class APIError(Exception):
    """Raised by a handler; answered as an OpenAI-style error."""

    def __init__(self, message: str, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def error_response(message: str, status: int, code: str | None = None) -> JSONResponse:
    kind, default_code = _KINDS.get(status, ("server_error" if status >= 500 else "error", None))
    body = {
        "error": {"message": message, "type": kind, "param": None, "code": code or default_code}
    }
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return JSONResponse(body, status_code=status, headers=headers)


async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(str(exc), exc.status, exc.code)


async def on_http_exception(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own 404 (no route) and 405 (wrong method)."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    elif exc.status_code == 404:
        message = f"no route {request.url.path}"
    else:
        message = str(exc.detail)
    response = error_response(message, exc.status_code)
    response.headers.update(exc.headers or {})
    return response

"""Reading a JSON request body within the server's limits, before anything is decoded:
Content-Type (415), size (413), nesting depth and then the typed decode (400)."""

from __future__ import annotations

import re
from typing import TypeVar

import msgspec
import numpy as np
from starlette.requests import Request

from pagedserve.api.errors import APIError
from pagedserve.config import ServerConfig

T = TypeVar("T", bound=msgspec.Struct)

_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_OPENING = np.frombuffer(b"[{", dtype=np.uint8)


async def read_json(request: Request, kind: type[T], limits: ServerConfig) -> T:
    check_content_type(request)
    body = await read_body(request, limits.max_request_body_bytes)
    if json_depth(body) > limits.max_json_depth:
        raise APIError(f"the JSON body nests deeper than {limits.max_json_depth} levels", 400)
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise APIError(f"invalid request: {exc}", 400) from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise APIError(f"malformed JSON body: {exc}", 400) from None


def check_content_type(request: Request) -> None:
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise APIError("the request body must be JSON (Content-Type: application/json)", 415)


async def read_body(request: Request, limit: int) -> bytes:
    too_large = APIError(f"the request body is larger than {limit} bytes", 413)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def json_depth(body: bytes) -> int:
    """How deeply arrays and objects nest in `body` (brackets inside strings do not count);
    linear time, so a hostile body costs no more than its size."""
    brackets = _JSON_STRING.sub(b"", body).translate(None, delete=_NOT_BRACKETS)
    if not brackets:
        return 0
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where(np.isin(codes, _OPENING), 1, -1)
    return int(np.cumsum(steps).max())

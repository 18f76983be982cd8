"""Reading a JSON request body within the server's limits, before anything is decoded:
Content-Type (415), size (413), nesting depth and then the typed decode (400)."""

from __future__ import annotations

import re
from typing import TypeVar

import anyio
import msgspec
import numpy as np
from starlette.requests import ClientDisconnect, Request

from pagedserve.api.errors import APIError
from pagedserve.config import ServerConfig

T = TypeVar("T", bound=msgspec.Struct)

_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)  # possessive: no backtracking
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_OPENING = np.frombuffer(b"[{", dtype=np.uint8)
IN_LOOP_BYTES = 1 << 20  # larger bodies are decoded in a worker thread: the loop keeps serving


async def read_json(request: Request, kind: type[T], limits: ServerConfig) -> T:
    check_content_type(request)
    body = await read_body(request, limits.max_request_body_bytes)
    if len(body) <= IN_LOOP_BYTES:
        return decode(body, kind, limits.max_json_depth)
    return await anyio.to_thread.run_sync(decode, body, kind, limits.max_json_depth)


def decode(body: bytes, kind: type[T], max_depth: int) -> T:
    """The typed request; APIError 400 for malformed JSON, wrong types or deep nesting."""
    too_deep = APIError(f"the JSON body nests deeper than {max_depth} levels", 400)
    try:
        value = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise APIError(f"invalid request: {exc}", 400) from None
    except msgspec.DecodeError as exc:
        raise APIError(f"malformed JSON body: {exc}", 400) from None
    except RecursionError:  # deeper than the interpreter's limit, met while skipping a field
        raise too_deep from None
    num_opening = body.count(b"[") + body.count(b"{")  # bounds the depth, at C speed
    if num_opening > max_depth and json_depth(body) > max_depth:
        raise too_deep
    return value


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
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:  # nobody will read the answer; this ends the request quietly
        raise APIError("the client left before sending its request body", 400) from None
    return b"".join(chunks)


def json_depth(body: bytes) -> int:
    """How deeply arrays and objects nest in `body`, valid JSON (brackets inside strings do
    not count); linear time, as the string pattern never backtracks."""
    brackets = _JSON_STRING.sub(b"", body).translate(None, delete=_NOT_BRACKETS)
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where(np.isin(codes, _OPENING), 1, -1).astype(np.int32)
    return int(np.cumsum(steps, dtype=np.int32).max())

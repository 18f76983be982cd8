"""`--api-key`: every route but the open ones needs `Authorization: Bearer KEY`, checked before
the request's body is read, in constant time."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from pagedserve.api.errors import error_response

OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})  # as vLLM: probes and scrapers


class APIKeyGuard:
    """Pure ASGI middleware, so an unauthenticated request costs no body read or decode."""

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.expected = None if api_key is None else b"Bearer " + api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.expected is not None and scope["type"] == "http":
            if scope["path"] not in OPEN_PATHS and not self.authorized(scope):
                await error_response("invalid API key", 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def authorized(self, scope: Scope) -> bool:
        assert self.expected is not None
        given = [value for name, value in scope["headers"] if name.lower() == b"authorization"]
        return len(given) == 1 and hmac.compare_digest(given[0], self.expected)

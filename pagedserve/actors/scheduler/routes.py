"""Who asked for which request: a client's (identity, seq) to the request the scheduler holds.

A client that resubmits its unfinished requests after an engine restart (see api/client.py) is
answered from here: a live request re-sends its route (the detokenizer may be new and not know
it), and a request that finished meanwhile re-sends its final result, so that no resubmission
starts a second copy of a request.

A finished request is kept as that final result only: its `Route` (prompt, output tokens, how
it ended) encoded as one msgpack frame, ~3 bytes a token and no objects, not the `Request`
(which held an int object and a list slot per token: ~4-5 KB at the soak's sizes). The newest
are kept, as many as fit both bounds (and always the newest one), so that the table's memory
stays under 2.5 MiB whatever the requests' lengths (tests/test_route_table.py; a resubmission
comes within seconds of the restart that causes it).
"""

from __future__ import annotations

from collections import OrderedDict

import msgspec

from pagedserve.actors.messages import Route
from pagedserve.actors.scheduler.request import Request

RouteKey = tuple[bytes, int]

NUM_FINISHED_KEPT = 4096
FINISHED_BYTES_KEPT = 1 << 20  # of encoded routes

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Route)


class RouteTable:
    def __init__(
        self, num_finished_kept: int = NUM_FINISHED_KEPT, bytes_kept: int = FINISHED_BYTES_KEPT
    ) -> None:
        self.live: dict[RouteKey, Request] = {}
        self.finished: OrderedDict[RouteKey, bytes] = OrderedDict()  # encoded final routes
        self.num_finished_kept = num_finished_kept
        self.bytes_kept = bytes_kept
        self.finished_bytes = 0

    def find(self, key: RouteKey) -> Route | None:
        """The route of the request with this key, live or finished (with its final result)."""
        request = self.live.get(key)
        if request is not None:
            return request.route()
        frame = self.finished.get(key)
        return None if frame is None else _decoder.decode(frame)

    def add(self, request: Request) -> None:
        self.live[request.route_key] = request

    def finish(self, request: Request) -> None:
        """Keep a request's final route, forgetting the oldest beyond the bounds."""
        key = request.route_key
        self.live.pop(key, None)
        frame = _encoder.encode(request.route())
        self.finished_bytes += len(frame) - len(self.finished.pop(key, b""))
        self.finished[key] = frame
        while len(self.finished) > 1 and (  # the newest is kept, whatever its size
            len(self.finished) > self.num_finished_kept or self.finished_bytes > self.bytes_kept
        ):
            self.finished_bytes -= len(self.finished.popitem(last=False)[1])

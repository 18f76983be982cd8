"""Who asked for which request: a client's (identity, seq) to the request the scheduler holds.

A client that resubmits its unfinished requests after an engine restart (see api/client.py) is
answered from here: a live request re-sends its route (the detokenizer may be new and not know
it), and a request that finished meanwhile re-sends its final result, so that no resubmission
starts a second copy of a request.
"""

from __future__ import annotations

from collections import OrderedDict

from pagedserve.actors.scheduler.request import Request

RouteKey = tuple[bytes, int]

NUM_FINISHED_KEPT = 4096


class RouteTable:
    def __init__(self, num_finished_kept: int = NUM_FINISHED_KEPT) -> None:
        self.live: dict[RouteKey, Request] = {}
        self.finished: OrderedDict[RouteKey, Request] = OrderedDict()
        self.num_finished_kept = num_finished_kept

    def find(self, key: RouteKey) -> Request | None:
        return self.live.get(key) or self.finished.get(key)

    def add(self, request: Request) -> None:
        self.live[request.route_key] = request

    def finish(self, request: Request) -> None:
        """Move a request to the finished ones, forgetting the oldest beyond the bound."""
        self.live.pop(request.route_key, None)
        self.finished[request.route_key] = request
        request.block_hashes = []  # nothing but its tokens and result is needed any more
        while len(self.finished) > self.num_finished_kept:
            self.finished.popitem(last=False)

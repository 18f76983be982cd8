"""`pagedserve top ADDRESS`: every actor of a running engine, refreshed each second.

It reads the supervisor's status socket (api/actor_status.py) with the run's credentials: for
an ipc:// engine started without an API key, the credentials file in its run directory;
otherwise `--api-key` (or `--credentials FILE`).
"""

from __future__ import annotations

import argparse
import sys
import time

CLEAR_SCREEN = "\x1b[H\x1b[2J"


def add_top_parser(sub: argparse._SubParsersAction) -> None:
    top = sub.add_parser("top", help="a live table of a running engine's actors")
    top.add_argument("address", help="the engine address `pagedserve serve` printed")
    top.add_argument("--api-key", default=None, help="the engine's API key, if it has one")
    top.add_argument("--credentials", default=None, help="a credentials file")
    top.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    top.add_argument("--iterations", type=int, default=0, help="stop after N tables (0: never)")
    top.set_defaults(func=cmd_top)


def cmd_top(args: argparse.Namespace) -> int:
    from pagedserve.actors.security import Credentials
    from pagedserve.api.actor_status import StatusClient, render_table

    credentials: Credentials | str | None = args.api_key
    if args.credentials is not None:
        credentials = Credentials.read(args.credentials)
    client = StatusClient(args.address, credentials)
    previous = None
    shown = 0
    try:
        while args.iterations == 0 or shown < args.iterations:
            status = client.fetch()
            clear = CLEAR_SCREEN if sys.stdout.isatty() else ""
            print(clear + render_table(status, previous), flush=True)
            previous, shown = status, shown + 1
            if args.iterations == 0 or shown < args.iterations:
                time.sleep(args.interval)
    except TimeoutError as exc:
        print(f"pagedserve top: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0

"""Typed ZeroMQ channels: the only module that creates sockets.

A channel is a socket plus the one message type (usually a tagged union from messages.py) it
carries. Every frame is msgpack produced by msgspec; a frame that does not decode as the
channel's type is logged and dropped, and the receiver keeps going. No pickle anywhere.

Topology (same host: ipc:// sockets in a private run directory; `tcp://` works the same):
  clients  --DEALER/ROUTER-->  tokenizer      (requests in; the ROUTER names each sender)
  clients  <-DEALER/ROUTER-->  detokenizer    (deltas out by the client's identity; Hello/Ping)
  senders  --PUSH/PULL----->   each actor's inbox (bound by the inbox owner)
  anyone      --DEALER/ROUTER-->  supervisor's status socket (the table of actors)
A client reaches the engine by one *engine address* (addresses.py: where each socket lives).

Every socket is made from an engine context (`async_context` / `sync_context`), which carries
the run's credentials (security.py: PLAIN on ipc sockets, whose files are 0600; CURVE on tcp)
and counts the frames its channels move (`Traffic`, reported in heartbeats).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio
import zmq.auth.thread

from pagedserve.actors.security import Credentials, secure, start_authenticator

logger = logging.getLogger(__name__)

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()

# How long an inbox polls for its next frame before it waits on the loop (`poll_first_s`): a
# frame within it is taken without the loop's wake-up (~50-100 µs a side). It covers a step's
# reply (an 8B model's lone prefill, ~6 ms, outlasted 5 ms); the loop's housekeeping needs a
# turn only every 0.25 s; frames for its other tasks are served during it (`meanwhile`).
POLL_FIRST_S = 0.05


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


@dataclass
class Traffic:
    """Frames moved by one process's channels."""

    messages_in: int = 0
    messages_out: int = 0
    rejected: int = 0


@dataclass
class _Security:
    credentials: Credentials | None = None
    authenticator: zmq.auth.thread.ThreadAuthenticator | None = None
    traffic: Traffic = field(default_factory=Traffic)


class EngineContext(zmq.asyncio.Context):
    """An asyncio context whose sockets use the run's credentials and count their traffic."""

    security: _Security

    def destroy(self, linger: int | None = None) -> None:
        _stop_authenticator(self)
        super().destroy(linger)


class SyncEngineContext(zmq.Context):
    """The same for synchronous sockets (the supervisor, heartbeats, the sync client)."""

    security: _Security

    def destroy(self, linger: int | None = None) -> None:
        _stop_authenticator(self)
        super().destroy(linger)


def _stop_authenticator(ctx: EngineContext | SyncEngineContext) -> None:
    security = getattr(ctx, "security", None)
    if security is not None and security.authenticator is not None:
        security.authenticator.stop()
        security.authenticator = None


def async_context(credentials: Credentials | None) -> EngineContext:
    """An asyncio engine context; one that holds the server key checks who connects."""
    ctx = EngineContext()
    ctx.security = _Security(credentials)
    if credentials is not None and credentials.server_secret:
        ctx.security.authenticator = start_authenticator(
            zmq.Context.shadow(ctx.underlying), credentials
        )
    return ctx


def sync_context(credentials: Credentials | None) -> SyncEngineContext:
    ctx = SyncEngineContext()
    ctx.security = _Security(credentials)
    if credentials is not None and credentials.server_secret:
        ctx.security.authenticator = start_authenticator(ctx, credentials)
    return ctx


def traffic_of(ctx: zmq.Context) -> Traffic:
    security = ctx.__dict__.get("security")
    return security.traffic if security is not None else Traffic()


class Codec(Generic[T]):
    """Decodes frames of one channel type; rejects (and logs) what does not decode."""

    def __init__(self, message_type: Any, channel: str, traffic: Traffic | None = None) -> None:
        self._decoder = msgspec.msgpack.Decoder(message_type)
        self.channel = channel
        self.num_rejected = 0
        self.traffic = traffic if traffic is not None else Traffic()

    def decode(self, frame: bytes) -> T | None:
        try:
            message = self._decoder.decode(frame)
            self.traffic.messages_in += 1
            return message
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.num_rejected += 1
            self.traffic.rejected += 1
            logger.error(
                "%s: rejected a malformed frame (%d bytes): %s", self.channel, len(frame), exc
            )
            return None


def _socket(ctx: zmq.Context, kind: int, address: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    security = ctx.__dict__.get("security")
    if security is not None and security.credentials is not None:
        secure(sock, security.credentials, server=bind, address=address)
    if bind:
        sock.bind(address)
        if address.startswith("ipc://"):  # only this user, whatever the umask
            os.chmod(address.removeprefix("ipc://"), 0o600)
    else:
        sock.connect(address)
    return sock


class Sender(Generic[T]):
    """Async PUSH end of a channel. A frame is handed to ZeroMQ at once when it can take it
    (a peer is connected: the usual case), without a future or a round of the loop; else it
    waits on the loop, and later frames queue behind it, in order."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, bind: bool = False) -> None:
        self.socket = _socket(ctx, zmq.PUSH, address, bind)
        self._now = zmq.Socket.shadow(self.socket.underlying)  # the same socket, called directly
        self._num_waiting = 0  # frames waiting on the loop for a peer
        self.traffic = traffic_of(ctx)

    async def send(self, message: T) -> None:
        await self.send_frame(encode(message))

    async def send_frame(self, frame: bytes) -> None:
        """An encoded message (`encode`: encode once, send to several channels)."""
        self.traffic.messages_out += 1
        if not self._num_waiting:
            try:
                self._now.send(frame, zmq.NOBLOCK)
                return
            except zmq.Again:  # no peer yet
                pass
        self._num_waiting += 1
        try:
            await self.socket.send(frame)
        finally:
            self._num_waiting -= 1

    def close(self) -> None:
        self.socket.close(linger=0)


class Receiver(Generic[T]):
    """Async PULL end of a channel; `recv` skips (and logs) malformed frames.

    A queued frame is taken at once, without a future or a round of the loop. With
    `poll_first_s`, `recv` then waits for the next frame in a blocking poll of up to that long
    (in the kernel, the GIL released) before it waits on the loop, for an actor whose loop has
    little else to do (scheduler, workers). `meanwhile`: another socket of the loop and what
    serves its queued frames, called as they come during the poll (the detokenizer's client
    handshakes): the poll takes that socket's wake-up too, so its task would not see them.
    `spin_s`: before that poll, check for a frame in a loop for up to this long (an actor whose
    thread would otherwise sleep and wait for the CPU to wake it: EngineConfig.bus_spin_us)."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        address: str,
        message_type: Any,
        bind: bool = True,
        poll_first_s: float = 0.0,
        meanwhile: tuple[zmq.Socket, Callable[[], Awaitable[None]]] | None = None,
        spin_s: float = 0.0,
    ) -> None:
        self.socket = _socket(ctx, zmq.PULL, address, bind)
        self._now = zmq.Socket.shadow(self.socket.underlying)  # the same socket, called directly
        self._poll_in = [(self._now, zmq.POLLIN)]  # for zmq_poll: no Poller object per call
        self._poll_all = self._poll_in + ([(meanwhile[0], zmq.POLLIN)] if meanwhile else [])
        self._serve_meanwhile = meanwhile[1] if meanwhile else None
        self._poll_first_s = poll_first_s
        self._spin_s = spin_s
        self.codec: Codec[T] = Codec(message_type, address, traffic_of(ctx))

    async def recv(self) -> T:
        while True:
            # a queued frame, or one within the poll (0 ms: only one already queued)
            if await self._ready_within_poll():
                try:
                    frame = self._now.recv(zmq.NOBLOCK)
                except zmq.Again:  # the poll's event was not a frame for us after all
                    continue
            else:
                frame = await self.socket.recv()
            message = self.codec.decode(frame)
            if message is not None:
                return message

    async def _ready_within_poll(self) -> bool:
        """Whether a frame of ours is queued or comes within the poll."""
        if self._spin_s and self._spin_for_frame():
            return True
        if not self._poll_first_s:
            return bool(zmq.zmq_poll(self._poll_in, 0))
        deadline = time.monotonic() + self._poll_first_s
        while True:
            wait_ms = max(0, math.ceil((deadline - time.monotonic()) * 1000))
            ready = zmq.zmq_poll(self._poll_all, wait_ms)
            if any(socket is self._now for socket, _ in ready):
                return True
            if not ready or self._serve_meanwhile is None:
                return False
            await self._serve_meanwhile()

    def _spin_for_frame(self) -> bool:
        """Whether a frame of ours comes while checking in a loop for up to spin_s."""
        deadline = time.perf_counter() + self._spin_s
        while not zmq.zmq_poll(self._poll_in, 0):
            if time.perf_counter() > deadline:
                return False
        return True

    def has_ready(self) -> bool:
        """Whether a frame is queued (recv would not wait)."""
        return bool(self._now.get(zmq.EVENTS) & zmq.POLLIN)

    def recv_ready(self) -> list[T]:
        """Every message already queued, without waiting."""
        messages: list[T] = []
        while self.has_ready():
            message = self.codec.decode(self._now.recv(zmq.NOBLOCK))
            if message is not None:
                messages.append(message)
        return messages

    def close(self) -> None:
        self.socket.close(linger=0)


class Router(Generic[T]):
    """A client-facing ROUTER: receives (identity, message), replies by identity (a reply to
    an identity that is not connected is dropped). `recv` polls first as Receiver's, unless
    told not to (the tokenizer while off-loop encodes wait for the loop)."""

    def __init__(
        self, ctx: zmq.asyncio.Context, address: str, message_type: Any, poll_first_s: float = 0.0
    ) -> None:
        self.socket = _socket(ctx, zmq.ROUTER, address, bind=True)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._now = zmq.Socket.shadow(self.socket.underlying)  # the same socket, called directly
        self._poll_in = [(self._now, zmq.POLLIN)]
        self._poll_first_ms = int(poll_first_s * 1000)
        self.codec: Codec[T] = Codec(message_type, address, traffic_of(ctx))

    async def recv(self, poll_first: bool = True) -> tuple[bytes, T]:
        while True:
            poll_ms = self._poll_first_ms if poll_first else 0
            if poll_ms and zmq.zmq_poll(self._poll_in, poll_ms):
                try:
                    frames = self._now.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:  # the poll's event was not a frame for us after all
                    continue
            else:
                frames = await self.socket.recv_multipart(copy=True)
            if len(frames) != 2:
                logger.error("%s: dropped a message of %d frames", self.codec.channel, len(frames))
                continue
            message = self.codec.decode(frames[1])
            if message is not None:
                return frames[0], message

    def recv_ready(self) -> list[tuple[bytes, T]]:
        """Every (identity, message) already queued, without waiting."""
        messages: list[tuple[bytes, T]] = []
        while True:
            try:
                frames = self.socket.recv_multipart(flags=zmq.NOBLOCK, copy=True)
                if not isinstance(frames, list):  # an asyncio socket hands back a done future
                    frames = frames.result()
            except zmq.Again:
                return messages
            message = self.codec.decode(frames[1]) if len(frames) == 2 else None
            if message is not None:
                messages.append((frames[0], message))

    async def send(self, identity: bytes, message: msgspec.Struct) -> None:
        self.codec.traffic.messages_out += 1
        await self.socket.send_multipart([identity, encode(message)], copy=False)

    def close(self) -> None:
        self.socket.close(linger=0)


def dealer_socket(ctx: zmq.Context, address: str, identity: bytes) -> zmq.Socket:
    """A client's end of an engine ROUTER (sync or asyncio context)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    security = ctx.__dict__.get("security")
    if security is not None and security.credentials is not None:
        secure(sock, security.credentials, server=False, address=address)
    sock.connect(address)
    return sock


def router_socket(ctx: zmq.Context, address: str) -> zmq.Socket:
    """A synchronous bound ROUTER (the supervisor's status socket)."""
    sock = _socket(ctx, zmq.ROUTER, address, bind=True)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
    return sock


def pull_socket(ctx: zmq.Context, address: str) -> zmq.Socket:
    """A synchronous bound PULL socket (the supervisor's inbox)."""
    return _socket(ctx, zmq.PULL, address, bind=True)


def push_socket(ctx: zmq.Context, address: str) -> zmq.Socket:
    """A synchronous connecting PUSH socket (an actor's line to the supervisor)."""
    return _socket(ctx, zmq.PUSH, address, bind=False)

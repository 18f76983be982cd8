"""Typed ZeroMQ channels: the only module that creates sockets.

A channel is a socket plus the one message type (usually a tagged union from messages.py) it
carries. Every frame is msgpack produced by msgspec; a frame that does not decode as the
channel's type is logged and dropped, and the receiver keeps going. No pickle anywhere.

Topology (same host: ipc:// sockets in a private run directory; `tcp://` works the same):
  clients  --DEALER/ROUTER-->  tokenizer      (requests in; the ROUTER names each sender)
  clients  <-DEALER/ROUTER-->  detokenizer    (deltas out by the client's identity; Hello/Ping)
  senders  --PUSH/PULL----->   each actor's inbox (bound by the inbox owner)
  anyone      --DEALER/ROUTER-->  supervisor's status socket (the table of actors)
A client reaches the engine by one *engine address*: `ipc://<run_dir>` or `tcp://host:port0`.

Every socket is made from an engine context (`async_context` / `sync_context`), which carries
the run's credentials (security.py: CURVE on every socket, ipc socket files 0600) and counts the
frames its channels move (`Traffic`, reported in heartbeats).
"""

from __future__ import annotations

import logging
import os
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

# How long an inbox whose actor has little else to do while it waits (the scheduler, a worker;
# the tokenizer and the detokenizer, which give their loop's other tasks a turn after each
# message) polls for the next frame before it waits on the loop (Receiver's and Router's
# `poll_first_s`): a frame that comes within it is taken without the loop's wake-up.
POLL_FIRST_S = 0.005


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


@dataclass(frozen=True)
class Addresses:
    """Where every actor's sockets live: ipc:// files in `run_dir`, or consecutive tcp ports
    from `tcp_base_port` on `tcp_host`."""

    run_dir: str
    tcp_host: str | None = None
    tcp_base_port: int = 0

    @classmethod
    def from_engine_address(cls, address: str) -> Addresses:
        """The addresses behind an engine address (what `pagedserve serve` prints)."""
        if address.startswith("ipc://"):
            return cls(address.removeprefix("ipc://"))
        if address.startswith("tcp://"):
            host, _, port = address.removeprefix("tcp://").rpartition(":")
            if host and port.isdigit():
                return cls("", host, int(port))
        raise ValueError(f"not an engine address: {address!r} (ipc://DIR or tcp://HOST:PORT)")

    @property
    def engine_address(self) -> str:
        if self.tcp_host is not None:
            return f"tcp://{self.tcp_host}:{self.tcp_base_port}"
        return f"ipc://{self.run_dir}"

    def _address(self, name: str, index: int) -> str:
        if self.tcp_host is not None:
            return f"tcp://{self.tcp_host}:{self.tcp_base_port + index}"
        return f"ipc://{os.path.join(self.run_dir, name)}"

    @property
    def supervisor(self) -> str:
        return self._address("supervisor.sock", 0)

    @property
    def status(self) -> str:
        """The supervisor's ROUTER: the table of actors (`pagedserve top`, /metrics)."""
        return self._address("status.sock", 5)

    @property
    def requests(self) -> str:
        """The tokenizer's ROUTER: clients send their requests here."""
        return self._address("requests.sock", 1)

    @property
    def outputs(self) -> str:
        """The detokenizer's ROUTER: clients receive their deltas from here."""
        return self._address("outputs.sock", 2)

    @property
    def detokenizer_inbox(self) -> str:
        return self._address("detokenizer-inbox.sock", 3)

    @property
    def scheduler_inbox(self) -> str:
        return self._address("scheduler-inbox.sock", 4)

    def worker_inbox(self, rank: int) -> str:
        """Step plans to worker `rank`: bound by the scheduler (a worker may run on another
        machine, so it connects), unlike the other inboxes."""
        return self._address(f"worker-{rank}-inbox.sock", 16 + rank)


def _socket(ctx: zmq.Context, kind: int, address: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    security = ctx.__dict__.get("security")
    if security is not None and security.credentials is not None:
        secure(sock, security.credentials, server=bind)
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
    (the thread sleeps in the kernel, the GIL released) before it waits on the loop: a frame
    that comes within it is taken without the loop's wake-up, about a third of a round trip
    here. Only for an actor whose loop has little else to do meanwhile (the scheduler and the
    workers: their loops' other tasks are housekeeping that a few milliseconds do not hurt; the
    detokenizer, whose client handshakes get a turn of the loop after each message)."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        address: str,
        message_type: Any,
        bind: bool = True,
        poll_first_s: float = 0.0,
    ) -> None:
        self.socket = _socket(ctx, zmq.PULL, address, bind)
        self._now = zmq.Socket.shadow(self.socket.underlying)  # the same socket, called directly
        self._poll_in = [(self._now, zmq.POLLIN)]  # for zmq_poll: no Poller object per call
        self._poll_first_ms = int(poll_first_s * 1000)
        self.codec: Codec[T] = Codec(message_type, address, traffic_of(ctx))

    async def recv(self) -> T:
        while True:
            # a queued frame, or one within the poll (0 ms: only one already queued)
            if zmq.zmq_poll(self._poll_in, self._poll_first_ms):
                try:
                    frame = self._now.recv(zmq.NOBLOCK)
                except zmq.Again:  # the poll's event was not a frame for us after all
                    continue
            else:
                frame = await self.socket.recv()
            message = self.codec.decode(frame)
            if message is not None:
                return message

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
    an identity that is not connected is dropped). With `poll_first_s`, `recv` first waits in
    a blocking poll, as Receiver's (the tokenizer: its loop's other tasks are off-loop encodes,
    which a few milliseconds do not hurt)."""

    def __init__(
        self, ctx: zmq.asyncio.Context, address: str, message_type: Any, poll_first_s: float = 0.0
    ) -> None:
        self.socket = _socket(ctx, zmq.ROUTER, address, bind=True)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._now = zmq.Socket.shadow(self.socket.underlying)  # the same socket, called directly
        self._poll_in = [(self._now, zmq.POLLIN)]
        self._poll_first_ms = int(poll_first_s * 1000)
        self.codec: Codec[T] = Codec(message_type, address, traffic_of(ctx))

    async def recv(self) -> tuple[bytes, T]:
        while True:
            if self._poll_first_ms and zmq.zmq_poll(self._poll_in, self._poll_first_ms):
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
        secure(sock, security.credentials, server=False)
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

"""Who may talk to the engine: per-run CURVE keys, checked on every connection.

Every engine socket speaks ZeroMQ CURVE (encrypted, authenticated). The binding side of a
channel is the CURVE server and holds the run's *server* key pair; the connecting side is a
CURVE client and must know the server's public key and hold the run's *client* key pair, whose
public key a ZAP handler in every binding process checks. A process without the run's
credentials cannot complete the handshake, so nothing it sends reaches an actor.

Where the keys come from:
- by default, random keys made for each run; the supervisor writes the client's part to
  `<run_dir>/credentials` (mode 0600, in the 0700 run directory) for external ZeroMQ clients,
  which read it from there (`Client("ipc://<run_dir>")`) or from a path they are given;
- with an API key (`pagedserve serve --api-key KEY`), keys derived from it: no file is
  written, and a ZeroMQ client needs the key (`Client(address, credentials=KEY)`), like an
  HTTP client.
Internal actors receive the server keys on their standard input, never in argv or the
environment.
"""

from __future__ import annotations

import hashlib
import hmac
import os

import msgspec
import zmq
import zmq.auth.thread

CREDENTIALS_FILE = "credentials"
ZAP_DOMAIN = b"pagedserve"


class Credentials(msgspec.Struct, kw_only=True):
    """The run's keys (Z85 text): the server's public key and the client key pair for
    everyone; the server's secret key for the engine's own processes only."""

    server_public: bytes
    client_public: bytes
    client_secret: bytes
    server_secret: bytes = b""

    @classmethod
    def generate(cls) -> Credentials:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(
            server_public=server_public, server_secret=server_secret,
            client_public=client_public, client_secret=client_secret,
        )  # fmt: skip

    @classmethod
    def from_api_key(cls, api_key: str) -> Credentials:
        """Keys derived from an API key: whoever holds the key can talk to the engine."""
        server_secret = _derived_secret(api_key, b"server")
        client_secret = _derived_secret(api_key, b"client")
        return cls(
            server_public=zmq.curve_public(server_secret), server_secret=server_secret,
            client_public=zmq.curve_public(client_secret), client_secret=client_secret,
        )  # fmt: skip

    def for_clients(self) -> Credentials:
        return msgspec.structs.replace(self, server_secret=b"")

    def write(self, path: str) -> None:
        """Save the clients' part, readable by this user only."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(msgspec.json.encode(self.for_clients()))

    @classmethod
    def read(cls, path: str) -> Credentials:
        with open(path, "rb") as f:
            return msgspec.json.decode(f.read(), type=cls)


def _derived_secret(api_key: str, role: bytes) -> bytes:
    """A CURVE secret key from the API key (a slow KDF: a weak key is costly to guess)."""
    seed = hashlib.pbkdf2_hmac("sha256", api_key.encode(), b"pagedserve-curve-" + role, 100_000)
    return zmq.utils.z85.encode(seed)


def client_credentials(address: str, credentials: Credentials | str | None) -> Credentials:
    """A client's credentials: given (an object, or an API key), or, for an ipc:// engine,
    the file its supervisor wrote in the run directory."""
    if isinstance(credentials, Credentials):
        return credentials
    if isinstance(credentials, str):
        return Credentials.from_api_key(credentials)
    if address.startswith("ipc://"):
        path = os.path.join(address.removeprefix("ipc://"), CREDENTIALS_FILE)
        if os.path.exists(path):
            return Credentials.read(path)
        raise PermissionError(
            f"no credentials for {address}: {path} does not exist (an engine started with "
            "an API key needs `credentials=API_KEY`)"
        )
    raise PermissionError(f"{address}: a tcp:// engine needs credentials (its API key)")


def secure(sock: zmq.Socket, credentials: Credentials, server: bool) -> None:
    """Make `sock` a CURVE server (it binds) or client (it connects) with the run's keys."""
    if server:
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, credentials.server_secret)
    else:
        sock.setsockopt(zmq.CURVE_SERVERKEY, credentials.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, credentials.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, credentials.client_secret)


class _KnownClient:
    """The ZAP check: the connecting key (Z85) is the run's client key."""

    def __init__(self, client_public: bytes) -> None:
        self.client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.client_public)


def start_authenticator(
    ctx: zmq.Context, credentials: Credentials
) -> zmq.auth.thread.ThreadAuthenticator:
    """A ZAP handler (a thread) for `ctx`: only the run's client key may connect."""
    authenticator = zmq.auth.thread.ThreadAuthenticator(ctx)
    authenticator.start()
    authenticator.configure_curve_callback(
        ZAP_DOMAIN.decode(), credentials_provider=_KnownClient(credentials.client_public)
    )
    return authenticator

"""Who may talk to the engine: per-run credentials, checked on every connection.

Every engine socket authenticates the process at its other end when they connect; a ZAP handler
(a thread) in every binding process admits only the run's credentials. A process without them
cannot complete the handshake, so nothing it sends reaches an actor. Two mechanisms, by the
socket's transport:
- ipc:// (one machine): ZeroMQ PLAIN, the run's password in the handshake frame. The socket
  files are 0600 in the 0700 run directory, so only this user's processes can connect at all,
  and the frames never leave the kernel. After the handshake a frame costs nothing more: CURVE
  encrypted and authenticated every frame, ~15-35 µs of each step plan's round trip
  (scripts/results/session34.md).
- tcp:// (across machines): ZeroMQ CURVE (encrypted, authenticated). The binding side is the
  CURVE server and holds the run's *server* key pair; the connecting side is a CURVE client and
  must know the server's public key and hold the run's *client* key pair, whose public key the
  ZAP handler checks.

Where the credentials come from:
- by default, random ones made for each run; the supervisor writes the clients' part to
  `<run_dir>/credentials` (mode 0600, in the 0700 run directory) for external ZeroMQ clients,
  which read it from there (`Client("ipc://<run_dir>")`) or from a path they are given;
- with an API key (`pagedserve serve --api-key KEY`), credentials derived from it: no file is
  written, and a ZeroMQ client needs the key (`Client(address, credentials=KEY)`), like an
  HTTP client.
Internal actors receive them on their standard input, never in argv or the environment.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

import msgspec
import zmq
import zmq.auth.thread

CREDENTIALS_FILE = "credentials"
ZAP_DOMAIN = b"pagedserve"
PLAIN_USERNAME = b"pagedserve"


class Credentials(msgspec.Struct, kw_only=True):
    """The run's credentials (Z85 text): the ipc password, the server's public key and the
    client key pair for everyone; the server's secret key for the engine's own processes
    only."""

    password: bytes
    server_public: bytes
    client_public: bytes
    client_secret: bytes
    server_secret: bytes = b""

    @classmethod
    def generate(cls) -> Credentials:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(
            password=zmq.utils.z85.encode(secrets.token_bytes(32)),
            server_public=server_public, server_secret=server_secret,
            client_public=client_public, client_secret=client_secret,
        )  # fmt: skip

    @classmethod
    def from_api_key(cls, api_key: str) -> Credentials:
        """Credentials derived from an API key: whoever holds the key can talk to the engine."""
        server_secret = _derived_secret(api_key, b"server")
        client_secret = _derived_secret(api_key, b"client")
        return cls(
            password=_derived_secret(api_key, b"password"),
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
    """A CURVE secret key (or the password) from the API key (a slow KDF: a weak key is
    costly to guess)."""
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


def uses_plain(address: str) -> bool:
    """Whether a socket at `address` speaks PLAIN (ipc://) rather than CURVE (module doc)."""
    return address.startswith("ipc://")


def secure(sock: zmq.Socket, credentials: Credentials, server: bool, address: str) -> None:
    """Make `sock` the server (it binds) or the client (it connects) of its transport's
    mechanism: PLAIN for an ipc:// address, CURVE for any other. A server needs the server's
    secret (an engine process, whose context runs the ZAP handler; ZAP is enforced, so a
    server without a handler refuses every peer instead of admitting it)."""
    if server:
        if not credentials.server_secret:
            raise PermissionError(f"{address}: only the engine's own processes bind sockets")
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        if uses_plain(address):
            sock.setsockopt(zmq.PLAIN_SERVER, 1)
        else:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, credentials.server_secret)
    elif uses_plain(address):
        sock.setsockopt(zmq.PLAIN_USERNAME, PLAIN_USERNAME)
        sock.setsockopt(zmq.PLAIN_PASSWORD, credentials.password)
    else:
        sock.setsockopt(zmq.CURVE_SERVERKEY, credentials.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, credentials.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, credentials.client_secret)


class _KnownClient:
    """The ZAP check of CURVE: the connecting key (Z85) is the run's client key."""

    def __init__(self, client_public: bytes) -> None:
        self.client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.client_public)


class _Authenticator(zmq.auth.thread.ThreadAuthenticator):
    """pyzmq's ZAP handler thread, with a PLAIN check that compares the password in constant
    time against the run's and never logs it."""

    def __init__(self, ctx: zmq.Context, password: bytes) -> None:
        super().__init__(ctx)
        self._password = password

    def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
        known = domain == ZAP_DOMAIN.decode() and username == PLAIN_USERNAME.decode()
        if known and hmac.compare_digest(password.encode(), self._password):
            return True, b"OK"
        return False, b"Invalid credentials"


def start_authenticator(ctx: zmq.Context, credentials: Credentials) -> _Authenticator:
    """A ZAP handler (a thread) for `ctx`: only the run's password (PLAIN) or client key
    (CURVE) may connect."""
    authenticator = _Authenticator(ctx, credentials.password)
    authenticator.start()
    authenticator.configure_curve_callback(
        ZAP_DOMAIN.decode(), credentials_provider=_KnownClient(credentials.client_public)
    )
    return authenticator

"""CurveZMQ on the event plane: key files, socket roles, the ZAP authorizer, handshake counting.

Why: whoever can publish on a consumer's SUB can forge ``BlockStored``/``BlockRemoved`` events, and
the ledger's projections decide what the connector may promise (DESIGN §2 rule 3). Off by default;
without it every endpoint should stay on loopback (:func:`exposure_warning`).

Roles (the ZMQ convention: **the side that binds is the CURVE server**):

* engine PUB binds (the default) and the replay ROUTER always binds: the engine's publisher is the
  server, with its own key pair and a set of *authorized subscriber* public keys (ZAP); the
  consumer is a client that pins the engine's public key. A publisher without the secret key of
  that public key cannot complete the handshake (the consumer counts ``no_detail``, the impostor
  counts ``cryptographic``); a subscriber whose key is not authorized is refused by ZAP (both
  sides count ``auth``); a peer without CURVE fails with ``mechanism_mismatch``.
* a consumer source with ``bind = true`` (vLLM-style engines whose PUB connects): the consumer's
  SUB is the server and authorizes the engine's public key (ZAP); the publisher pins the
  consumer's public key. Replay still goes consumer DEALER (client) -> engine ROUTER (server).

Key files are those of ``zmq.auth.create_certificates`` (``NAME.key`` public,
``NAME.key_secret`` public + secret; Z85 text), written by ``semkv-ledger keygen DIR --name NAME``.

Counting: every secured socket gets a ZMQ socket monitor; ``EVENT_HANDSHAKE_FAILED_*`` events
are refusals (:func:`classify`), ``EVENT_HANDSHAKE_SUCCEEDED`` successes. ZMQ reconnects every
~100 ms, so a misconfigured peer is counted once per attempt.
"""

from __future__ import annotations

import ipaddress
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import structlog
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

__all__ = [
    "CurveError", "CurveKeys", "HandshakeEvent", "HandshakeMonitor", "InsecureEndpointWarning",
    "RefusalLogGate", "ZapAuthorizer", "classify", "exposure_warning", "is_loopback", "keygen", "load_key_pair",
    "load_public_keys", "warn_if_exposed",
]  # fmt: skip

log = structlog.get_logger(__name__)

Reason = Literal["auth", "cryptographic", "mechanism_mismatch", "protocol", "no_detail"]
RISK = ("anyone who can reach it can publish forged BlockStored/BlockRemoved events, which change what "
        "the ledger says is live and so what the connector may promise (or read the prompt tokens in "
        "the event stream)")
_MONITORED = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
              | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_KEY_SUFFIXES = (".key", ".key_secret")


class CurveError(ValueError):
    """A key file is missing or unusable, or the CURVE settings contradict each other."""


class InsecureEndpointWarning(UserWarning):
    """A socket binds a non-loopback address without CURVE (see :func:`exposure_warning`)."""


# --- key files -----------------------------------------------------------------------------------


def keygen(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write ``DIR/NAME.key`` (public, share it) and ``DIR/NAME.key_secret`` (mode 0600, keep it).

    Raises:
        CurveError: a file of that name exists (never overwritten) or ``name`` is not a plain name.
    """
    if not name or "/" in name or name.startswith("."):
        raise CurveError(f"key name {name!r} must be a plain file name")
    folder = Path(directory)
    public, secret = folder / f"{name}.key", folder / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists():
            raise CurveError(f"{path} exists; keys are never overwritten (remove it first)")
    folder.mkdir(parents=True, exist_ok=True)
    old_umask = os.umask(0o077)  # the secret file is never readable by others, not even briefly
    try:
        zmq.auth.create_certificates(str(folder), name)
    finally:
        os.umask(old_umask)
    public.chmod(0o644)
    secret.chmod(0o600)
    return public, secret


def load_key_pair(path: str | Path) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys from a ``NAME.key_secret`` file.

    Raises:
        CurveError: missing or unreadable file, or a public-only ``.key`` file.
    """
    public, secret = _load(Path(path))
    if secret is None:
        raise CurveError(f"{path} holds no secret key: pass the NAME.key_secret file written by "
                         "`semkv-ledger keygen`")
    return public, secret


def load_public_keys(path: str | Path) -> tuple[bytes, ...]:
    """Public keys from one key file (``.key`` or ``.key_secret``) or every ``*.key`` in a directory.

    Raises:
        CurveError: missing path, unreadable file, or a directory without any ``*.key`` file.
    """
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix == ".key")
        if not files:
            raise CurveError(f"no *.key public key file in {path}")
        return tuple(_load(p)[0] for p in files)
    return (_load(path)[0],)


def _load(path: Path) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise CurveError(f"CURVE key file {path} not found (create keys with `semkv-ledger keygen DIR --name NAME`)")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveError(f"CURVE key file {path} is unreadable: {exc}") from exc
    for key in (public, secret):
        if key is not None and len(key) != 40:
            raise CurveError(f"CURVE key file {path} does not hold a 40-character Z85 key")
    return public, secret


@dataclass(frozen=True)
class CurveKeys:
    """One side's CURVE material: its own key pair and the public keys of its peers.

    As a server (the side that binds), ``peers`` are the clients it authorizes; as a client,
    ``peers`` must hold exactly one key: the server's.
    """

    public: bytes
    secret: bytes
    peers: tuple[bytes, ...]

    @classmethod
    def from_files(cls, secret_key_file: str | Path, peer_keys: str | Path) -> CurveKeys:
        """``secret_key_file``: own ``NAME.key_secret``; ``peer_keys``: a key file or a directory."""
        public, secret = load_key_pair(secret_key_file)
        return cls(public, secret, load_public_keys(peer_keys))

    def server_key(self) -> bytes:
        if len(self.peers) != 1:
            raise CurveError(f"a CURVE client pins exactly one server key; {len(self.peers)} were given "
                             "(pass one NAME.key file, not a directory)")
        return self.peers[0]

    def configure(self, sock: zmq.Socket, *, server: bool, domain: str = "semkv") -> None:
        """Set the CURVE options on ``sock`` (before bind/connect). A server's ``domain`` selects
        the authorized keys in :class:`ZapAuthorizer`."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        if server:
            sock.curve_server = True
            sock.zap_domain = domain.encode()
        else:
            sock.curve_serverkey = self.server_key()


# --- ZAP ---------------------------------------------------------------------------------------


class _AllowedKeys:
    """ZAP credentials provider of one domain (called on the authenticator's thread)."""

    def __init__(self, domain: str, keys: Iterable[bytes]) -> None:
        self.domain = domain
        self.keys = frozenset(keys)
        self.denied = 0

    def callback(self, domain: str, z85_key: bytes) -> bool:
        if z85_key in self.keys:
            return True
        self.denied += 1
        log.warning("curve.client_refused", domain=domain, client_key=z85_key.decode("ascii", "replace"),
                    hint="this public key is not among the authorized keys")
        return False


class ZapAuthorizer:
    """pyzmq's ``ThreadAuthenticator`` on ``ctx`` (one per ZMQ context), one key set per domain.

    Without a ZAP handler a CURVE server admits any client that knows its (public) key, so every
    CURVE server socket here runs under one. Works for ``zmq.asyncio`` contexts too (the
    authenticator runs on a shadow context, on its own thread).
    """

    def __init__(self, ctx: zmq.Context) -> None:
        self._auth = ThreadAuthenticator(zmq.Context.shadow(ctx.underlying), log=_quiet_logger())
        self._auth.start()
        self._domains: dict[str, _AllowedKeys] = {}
        self._lock = threading.Lock()

    def authorize(self, domain: str, keys: Iterable[bytes]) -> None:
        keys = tuple(keys)
        provider = _AllowedKeys(domain, (z85.encode(k) if len(k) == 32 else k for k in keys))
        with self._lock:
            self._domains[domain] = provider
            self._auth.configure_curve_callback(domain=domain, credentials_provider=provider)

    def denied(self, domain: str | None = None) -> int:
        """Clients refused by ZAP (in ``domain``, or in all)."""
        with self._lock:
            return sum(p.denied for d, p in self._domains.items() if domain in (None, d))

    def stop(self) -> None:
        self._auth.stop()


def _quiet_logger():  # noqa: ANN202 - a logging.Logger; pyzmq logs every ZAP request at DEBUG
    import logging

    logger = logging.getLogger("semkv.zap")
    logger.setLevel(logging.WARNING)
    return logger


# --- handshake monitoring ------------------------------------------------------------------------


@dataclass(frozen=True)
class HandshakeEvent:
    ok: bool
    reason: Reason | None
    endpoint: str


def _protocol_reason(code: int) -> Reason:
    if code == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        return "cryptographic"
    if code == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return "mechanism_mismatch"
    return "protocol"


def classify(frames: list[bytes]) -> HandshakeEvent | None:
    """A socket-monitor message -> a handshake outcome (None: not a handshake event).

    ``auth``: the server's ZAP refused the client's key; ``cryptographic``: the peer does not hold
    the secret of the key pinned for it (seen by the server); ``no_detail``: the peer closed the
    handshake (seen by a client whose server could not decrypt it, i.e. a wrong server key);
    ``mechanism_mismatch``: one side uses CURVE, the other not.
    """
    message = parse_monitor_message(frames)
    event, value = int(message["event"]), int(message["value"])
    endpoint = message["endpoint"].decode(errors="replace") if isinstance(message["endpoint"], bytes) else ""
    if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
        return HandshakeEvent(True, None, endpoint)
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return HandshakeEvent(False, "auth", endpoint)
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return HandshakeEvent(False, _protocol_reason(value), endpoint)
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return HandshakeEvent(False, "no_detail", endpoint)
    return None


def monitor(sock: zmq.Socket) -> zmq.Socket:
    """A PAIR socket receiving ``sock``'s handshake events (same socket class as ``sock``)."""
    return sock.get_monitor_socket(_MONITORED)


class RefusalLogGate:
    """Rate limit of ``*.handshake_refused`` log lines: a refused peer retries every ~100 ms, so each
    socket logs its first refusal, then at most one line per ``every_s`` (with the count so far)."""

    def __init__(self, every_s: float = 10.0) -> None:
        self._every_s = every_s
        self._last: dict[str, float] = {}

    def allow(self, label: str) -> bool:
        now = time.monotonic()
        last = self._last.get(label)
        if last is not None and now - last < self._every_s:
            return False
        self._last[label] = now
        return True


class HandshakeMonitor:
    """Handshake counts of a few sockets owned by one thread (the publishers'); call :meth:`drain`
    from that thread, e.g. once per loop turn. Counts are readable from any thread."""

    def __init__(self, who: str) -> None:
        self._who = who
        self._monitors: list[tuple[str, zmq.Socket, zmq.Socket]] = []
        self._lock = threading.Lock()  # refused_by_reason is copied by other threads
        self.succeeded = 0
        self.refused = 0
        self.refused_by_reason: dict[str, int] = {}
        self._gate = RefusalLogGate()

    def watch(self, label: str, sock: zmq.Socket) -> None:
        self._monitors.append((label, sock, monitor(sock)))

    def drain(self) -> None:
        for label, _, mon in self._monitors:
            while True:
                try:
                    frames = mon.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                event = classify(frames)
                if event is not None:
                    self._count(label, event)

    def snapshot(self) -> tuple[int, int, dict[str, int]]:
        """(succeeded, refused, refused by reason), consistent, from any thread."""
        with self._lock:
            return self.succeeded, self.refused, dict(self.refused_by_reason)

    def _count(self, label: str, event: HandshakeEvent) -> None:
        with self._lock:
            if event.ok:
                self.succeeded += 1
                return
            self.refused += 1
            assert event.reason is not None
            self.refused_by_reason[event.reason] = self.refused_by_reason.get(event.reason, 0) + 1
        if self._gate.allow(label):  # a peer retries every ~100 ms: rate-limited per socket
            log.warning(f"{self._who}.handshake_refused", socket=label, reason=event.reason,
                        endpoint=event.endpoint, refused_total=self.refused, hint=HINTS[event.reason])

    def close(self) -> None:
        """Detach and close the monitors (before closing the watched sockets)."""
        for _, sock, mon in self._monitors:
            if not sock.closed:
                sock.disable_monitor()
            mon.close(linger=0)
        self._monitors.clear()


HINTS: dict[str, str] = {
    "auth": "the server does not authorize this client's public key: copy the client's NAME.key into "
            "the server's authorized keys",
    "cryptographic": "the client pinned another server key: the peer is not who it claims, or uses an "
                     "old key",
    "no_detail": "the server closed the handshake: it does not hold the secret key of the public key "
                 "pinned for it (wrong or forged publisher), or refused us",
    "mechanism_mismatch": "one side uses CURVE and the other does not",
    "protocol": "ZMTP protocol error during the handshake",
}
"""What a refused handshake means on a CURVE socket, by reason."""

PLAIN_HINTS: dict[str, str] = {
    "no_detail": "the peer closed the connection during the handshake: it is not a ZMQ publisher (a wrong "
                 "host or port?), or it requires CURVE",
    "protocol": "the peer does not speak ZMTP: not a ZMQ socket (a wrong host or port?)",
    "mechanism_mismatch": "the peer uses CURVE: give this source curve_publisher_key and the consumer "
                          "curve_secret_key",
}
"""The same on a socket without CURVE, where no key can be wrong (other reasons: :data:`HINTS`)."""


def hint(reason: str, *, curve: bool) -> str:
    """The operator's hint for a refused handshake of ``reason`` on a socket with or without CURVE."""
    return HINTS[reason] if curve else PLAIN_HINTS.get(reason, HINTS[reason])


# --- exposure --------------------------------------------------------------------------------------


def is_loopback(endpoint: str) -> bool:
    """True for ``tcp://`` endpoints on 127.0.0.0/8, ::1 or ``localhost``, and for ``ipc://`` /
    ``inproc://`` (not reachable from the network). ``*``, ``0.0.0.0``, ``::``, other addresses and
    interface names are not loopback."""
    if not endpoint.startswith("tcp://"):
        return endpoint.startswith(("ipc://", "inproc://"))
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0]
    if ";" in host:  # "source;destination" form: the part after ';' is the peer
        host = host.split(";", 1)[1]
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_NETWORK_TRANSPORTS = ("tcp://", "ws://", "wss://", "udp://", "pgm://", "epgm://", "vmci://")
"""libzmq's transports that reach other hosts (zmq_bind(3)); any other scheme is not reachable
from the network, or not one ZMQ knows (its bind then fails with "Protocol not supported")."""


def exposure_warning(endpoint: str | None, *, curve: bool, what: str) -> str | None:
    """The warning for ``what`` binding ``endpoint`` off loopback without CURVE, else None (also for
    a scheme no network transport has, e.g. ``http://``: the bind's own error says what is wrong)."""
    if curve or endpoint is None or is_loopback(endpoint) or not endpoint.startswith(_NETWORK_TRANSPORTS):
        return None
    return (f"{what} binds {endpoint} (not loopback) without CURVE: {RISK}. "
            "Bind 127.0.0.1, or turn CURVE on (docs/security.md).")


def metrics_exposure_warning(host: str, port: int) -> str | None:
    """The warning for the consumer's metrics server (``metrics_host``) listening off loopback,
    else None. It serves plain HTTP without authentication (consumer/metrics.py), and CURVE does
    not apply to it."""
    if is_loopback(f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"):
        return None
    return (f"the metrics server listens on {host}:{port} (not loopback) without authentication or TLS: anyone "
            "who can reach it reads /metrics and /healthz (engine and source ids, endpoints, ledger counts and "
            "errors). Bind 127.0.0.1, or let only Prometheus reach the port (docs/security.md).")


def warn_if_exposed(endpoint: str | None, *, curve: bool, what: str, stacklevel: int = 3) -> str | None:
    """:func:`exposure_warning` as an :class:`InsecureEndpointWarning` (library callers: the bridge,
    ``CapturePublisher``); returns the message, or None when there is nothing to warn about."""
    message = exposure_warning(endpoint, curve=curve, what=what)
    if message is not None:
        import warnings

        warnings.warn(message, InsecureEndpointWarning, stacklevel=stacklevel)
    return message

"""CurveZMQ on the event plane, over real sockets on 127.0.0.1 (consumer/curve.py, docs/security.md).

Right keys: events flow live and by replay. A publisher without the engine's secret key, a
subscriber without CURVE and a subscriber whose key is not authorized are refused: nothing reaches
the ledger, and the refusal is counted on the consumer (``semkv_consumer_curve_refused_total``) and
on the publisher (``stats().handshakes_refused``). Both directions: engine binds (consumer is the
CURVE client) and consumer binds (consumer is the CURVE server with a ZAP handler).

"Nothing arrived" is judged after the consumer has provably tried: refusals counted on both sockets
and a second replay probe (after ``idle_replay_s``) refused as well.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import subprocess
import sys
import warnings
from asyncio.subprocess import PIPE
from pathlib import Path

import msgspec
import pytest
import structlog
import typer
from typer.testing import CliRunner

from consumer.bridge import KvEventPublisher
from consumer.cli import register
from consumer.curve import CurveKeys, InsecureEndpointWarning, exposure_warning, is_loopback, keygen
from consumer.settings import load_settings
from tests.integration.consumer.daemon_support import (
    EVENTS_PER_BATCH,
    FIXTURE,
    DaemonRun,
    PayloadMaker,
    ledger_counts,
    migrated_db,
    settings_for,
    wait_until,
)

ENGINE = "trt-curve"
LOOPBACK = "tcp://127.0.0.1:*"
BATCHES = 12


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    """``engine``, ``consumer`` and ``rogue`` key pairs in one directory."""
    folder = tmp_path / "keys"
    for name in ("engine", "consumer", "rogue"):
        keygen(folder, name)
    return folder


def _publisher(keys: Path, secret: str | None, peers: str = "consumer.key", **options) -> KvEventPublisher:
    curve = None if secret is None else CurveKeys.from_files(keys / f"{secret}.key_secret", keys / peers)
    return KvEventPublisher(options.pop("endpoint", LOOPBACK), LOOPBACK, topic=b"kv", curve=curve, **options)


def _publish(pub: KvEventPublisher, batches: int = BATCHES) -> None:
    make = PayloadMaker("trt")
    for seq in range(batches):
        _, events, rank = msgspec.msgpack.decode(make(seq))
        pub.publish(events, rank)
    assert pub.flush(5)


def _consumer_settings(db: str, keys: Path, pub: KvEventPublisher, secret: str | None, **source):
    src = {"engine_id": ENGINE, "endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint, **source}
    if secret is not None:
        src["curve_publisher_key"] = keys / "engine.key"
        return settings_for(db, src, curve_secret_key=keys / f"{secret}.key_secret")
    return settings_for(db, src)


def _refused(run: DaemonRun, socket_label: str, reason: str) -> float:
    return run.metric("semkv_consumer_curve_refused_total", engine_id=ENGINE, socket=socket_label, reason=reason)


async def _assert_nothing_ingested(run: DaemonRun, path: Path, pub: KvEventPublisher, sub_reason: str,
                                   replay_reason: str, pub_reason: str) -> None:
    _publish(pub)
    # Generous bounds: under a loaded 2-core CI machine, ZMQ's reconnect-and-handshake cycle is slow.
    await wait_until(lambda: _refused(run, "sub", sub_reason) >= 1, 30, f"SUB refusal ({sub_reason})")
    await wait_until(lambda: _refused(run, "replay", replay_reason) >= 2
                     and run.metric("semkv_consumer_replay_probes_total", engine_id=ENGINE) >= 2,
                     30, "a second replay probe, refused too")
    await wait_until(lambda: pub.stats().refused_by_reason.get(pub_reason, 0) >= 1, 30,
                     f"publisher counts {pub_reason}")
    await run.stop()
    counts = ledger_counts(path)
    assert counts.engine_events == 0 and counts.batches == 0 and counts.dead_letters == 0
    assert run.metric("semkv_consumer_messages_received_total", engine_id=ENGINE) == 0
    assert run.metric("semkv_consumer_handshakes_total", engine_id=ENGINE, socket="sub") == 0
    assert pub.stats().handshakes_succeeded == 0


# --- keys ------------------------------------------------------------------------------------------


def _app() -> typer.Typer:
    app = typer.Typer()
    app.callback()(lambda: None)
    register(app)
    return app


def test_keygen_command_writes_a_key_pair_and_never_overwrites(tmp_path: Path) -> None:
    result = CliRunner().invoke(_app(), ["keygen", str(tmp_path / "k"), "--name", "trt-0"])
    assert result.exit_code == 0, result.output
    public, secret = tmp_path / "k" / "trt-0.key", tmp_path / "k" / "trt-0.key_secret"
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    pair = CurveKeys.from_files(secret, public)
    assert pair.peers == (pair.public,) and len(pair.secret) == 40
    assert pair.public.decode() in result.output
    again = CliRunner().invoke(_app(), ["keygen", str(tmp_path / "k"), "--name", "trt-0"])
    assert again.exit_code == 2 and "never overwritten" in again.output


def test_bad_key_files_are_refused_with_a_message(keys: Path) -> None:
    from consumer.curve import CurveError

    with pytest.raises(CurveError, match="holds no secret key"):
        CurveKeys.from_files(keys / "engine.key", keys / "consumer.key")
    with pytest.raises(CurveError, match="not found"):
        CurveKeys.from_files(keys / "missing.key_secret", keys / "consumer.key")
    with pytest.raises(CurveError, match="exactly one server key"):
        CurveKeys.from_files(keys / "engine.key_secret", keys).server_key()  # a directory of 3 keys
    with pytest.raises(ValueError, match="needs the engine's public key"):
        load_settings({"db": "x.db", "curve_secret_key": keys / "consumer.key_secret"},
                      cli_source={"engine_id": ENGINE})


# --- engine binds: the consumer is the CURVE client ---------------------------------------------------


async def test_right_keys_events_flow_live_and_by_replay(tmp_path: Path, keys: Path) -> None:
    db, path = migrated_db(tmp_path)
    with _publisher(keys, "engine") as pub:
        async with DaemonRun(_consumer_settings(db, keys, pub, "consumer")) as run:
            _publish(pub)
            await wait_until(lambda: ledger_counts(path).engine_events == BATCHES * EVENTS_PER_BATCH, 20,
                             "every event in the ledger")
            stats = await run.stop()
        assert run.metric("semkv_consumer_handshakes_total", engine_id=ENGINE, socket="sub") >= 1
        assert run.metric("semkv_consumer_handshakes_total", engine_id=ENGINE, socket="replay") >= 1
        assert run.daemon.sources[0].handshakes_refused == 0
        published = pub.stats()
    assert stats.events_applied == BATCHES * EVENTS_PER_BATCH
    assert published.handshakes_refused == 0 and published.handshakes_succeeded >= 2


async def test_publisher_without_the_engine_secret_key_is_refused_and_counted(tmp_path: Path, keys: Path) -> None:
    """An impostor with its own key pair (and even the consumer's public key) cannot complete the
    handshake: the consumer pinned engine.key."""
    db, path = migrated_db(tmp_path)
    with _publisher(keys, "rogue") as pub:
        async with DaemonRun(_consumer_settings(db, keys, pub, "consumer")) as run:
            await _assert_nothing_ingested(run, path, pub, "no_detail", "no_detail", "cryptographic")


async def test_subscriber_without_keys_is_refused_and_counted(tmp_path: Path, keys: Path) -> None:
    db, path = migrated_db(tmp_path)
    with _publisher(keys, "engine") as pub:
        async with DaemonRun(_consumer_settings(db, keys, pub, None)) as run:
            await _assert_nothing_ingested(run, path, pub, "mechanism_mismatch", "mechanism_mismatch",
                                           "mechanism_mismatch")


async def test_subscriber_key_not_authorized_is_refused_and_counted(tmp_path: Path, keys: Path) -> None:
    db, path = migrated_db(tmp_path)
    with _publisher(keys, "engine") as pub:  # authorizes consumer.key only
        async with DaemonRun(_consumer_settings(db, keys, pub, "rogue")) as run:
            await _assert_nothing_ingested(run, path, pub, "auth", "auth", "auth")


@pytest.mark.skipif(not FIXTURE.exists(), reason=f"{FIXTURE} not found (shared/ beside the repo)")
async def test_publish_command_with_curve_feeds_the_recorded_stream(tmp_path: Path, keys: Path) -> None:
    """``semkv-ledger publish --curve-*`` (XPUB waiting for the secured subscription) -> ``consume``."""
    from consumer.capture import read_capture

    messages = sum(1 for _ in read_capture(FIXTURE))
    endpoint, replay_endpoint = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
    args = ["publish", "--from-file", str(FIXTURE), "--endpoint", endpoint, "--replay-endpoint", replay_endpoint,
            "--speed", "0", "--wait-for-subscriber", "--subscriber-timeout", "20", "--linger", "2",
            "--curve-secret-key", str(keys / "engine.key_secret"), "--curve-subscriber-keys", str(keys / "consumer.key")]
    publishing = await asyncio.create_subprocess_exec(sys.executable, "-m", "ledger", *args, stdout=PIPE, stderr=PIPE)
    db, path = migrated_db(tmp_path)
    source = {"engine_id": ENGINE, "endpoint": endpoint, "replay_endpoint": replay_endpoint,
              "curve_publisher_key": keys / "engine.key"}
    settings = settings_for(db, source, curve_secret_key=keys / "consumer.key_secret")
    async with DaemonRun(settings, stop_after_batches=messages) as run:
        stats = await asyncio.wait_for(run._task, 30)  # noqa: SLF001 - ends by itself after `messages` batches
    out, err = await asyncio.wait_for(publishing.communicate(), 30)
    assert publishing.returncode == 0, err.decode()[-3000:]
    report = json.loads(out.decode().strip().splitlines()[-1])
    assert report["event"] == "publish.report" and report["handshakes_refused"] == 0
    assert report["handshakes_succeeded"] >= 1
    assert ledger_counts(path).batches == messages == stats.batches
    assert "without CURVE" not in err.decode()  # no exposure warning: loopback, and CURVE on


# --- consumer binds: the consumer is the CURVE server (ZAP) ---------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_bound_consumer_admits_the_engine_key_and_refuses_another(tmp_path: Path, keys: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    db, path = migrated_db(tmp_path)
    with _publisher(keys, "engine", endpoint=endpoint, bind=False) as pub:  # PUB pins consumer.key
        settings = _consumer_settings(db, keys, pub, "consumer", endpoint=endpoint, bind=True)
        async with DaemonRun(settings) as run:
            _publish(pub)
            await wait_until(lambda: ledger_counts(path).engine_events == BATCHES * EVENTS_PER_BATCH, 20,
                             "every event in the ledger")
            await run.stop()
        assert run.metric("semkv_consumer_handshakes_total", engine_id=ENGINE, socket="sub") >= 1
        assert run.daemon.sources[0].handshakes_refused == 0

    db2, path2 = migrated_db(tmp_path, "second.db")
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    with _publisher(keys, "rogue", endpoint=endpoint, bind=False) as pub:
        settings = _consumer_settings(db2, keys, pub, "consumer", endpoint=endpoint, bind=True)
        async with DaemonRun(settings) as run:
            # the consumer's ZAP handler refuses rogue.key; its replay DEALER cannot verify rogue's ROUTER
            await _assert_nothing_ingested(run, path2, pub, "auth", "no_detail", "auth")


# --- exposure warnings --------------------------------------------------------------------------------


@pytest.mark.parametrize(("endpoint", "loopback"), [
    ("tcp://127.0.0.1:5557", True), ("tcp://localhost:5557", True), ("tcp://[::1]:5557", True),
    ("tcp://127.3.0.1:1", True), ("ipc:///run/semkv/kv.sock", True), ("tcp://*:5557", False),
    ("tcp://0.0.0.0:5557", False), ("tcp://10.0.0.5:5557", False), ("tcp://eth0:5557", False),
    ("tcp://[::]:5557", False),
])  # fmt: skip
def test_is_loopback(endpoint: str, loopback: bool) -> None:
    assert is_loopback(endpoint) is loopback


@pytest.mark.parametrize(("endpoint", "warned"), [
    ("tcp://0.0.0.0:5557", True), ("ws://0.0.0.0:5557", True), ("tcp://127.0.0.1:5557", False),
    ("http://127.0.0.1:5557", False), ("ipc:///run/semkv/kv.sock", False),
])  # fmt: skip
def test_only_a_network_transport_off_loopback_is_warned_of(endpoint: str, warned: bool) -> None:
    # `publish --endpoint http://127.0.0.1:…` was warned of as "not loopback" before ZMQ refused the scheme
    assert (exposure_warning(endpoint, curve=False, what="x") is not None) is warned


def test_bridge_warns_when_binding_off_loopback_without_curve(keys: Path) -> None:
    with pytest.warns(InsecureEndpointWarning, match="forged BlockStored/BlockRemoved"):
        KvEventPublisher("tcp://0.0.0.0:*", None).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error", InsecureEndpointWarning)
        KvEventPublisher(LOOPBACK, LOOPBACK).close()  # loopback: silent
        curve = CurveKeys.from_files(keys / "engine.key_secret", keys / "consumer.key")
        KvEventPublisher("tcp://0.0.0.0:*", None, curve=curve).close()  # CURVE: silent


def test_publish_command_warns_when_binding_off_loopback_without_curve() -> None:
    args = ["publish", "--from-file", str(FIXTURE), "--endpoint", "tcp://0.0.0.0:0", "--replay-endpoint", "",
            "--speed", "0", "--linger", "0"]
    result = CliRunner().invoke(_app(), args)
    assert result.exit_code == 0, result.output
    assert "warning: publish's PUB binds tcp://0.0.0.0:0 (not loopback) without CURVE" in result.output
    assert "forged BlockStored/BlockRemoved events" in result.output


async def test_consume_warns_when_a_bound_source_is_off_loopback_without_curve(tmp_path: Path) -> None:
    db, _ = migrated_db(tmp_path)
    settings = settings_for(db, {"engine_id": ENGINE, "endpoint": "tcp://0.0.0.0:0", "bind": True})
    with structlog.testing.capture_logs() as logs:
        async with DaemonRun(settings) as run:
            await run.stop()
    warned = [e for e in logs if e["event"] == "source.exposed_without_curve"]
    assert len(warned) == 1 and "forged BlockStored/BlockRemoved" in warned[0]["message"]
    assert warned[0]["log_level"] == "warning"


def test_consume_command_refuses_a_missing_key_file(tmp_path: Path) -> None:
    """A real process: ``consume`` configures logging for its process (not a CliRunner's streams)."""
    db, _ = migrated_db(tmp_path)
    args = ["consume", "--db", db, "--engine-id", ENGINE, "--curve-secret-key", str(tmp_path / "none.key_secret"),
            "--curve-publisher-key", str(tmp_path / "engine.key"), "--exit-when-idle", "0.1"]
    result = subprocess.run([sys.executable, "-m", "ledger", *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "none.key_secret not found" in result.stderr and "semkv-ledger keygen" in result.stderr


async def test_healthz_is_degraded_while_handshakes_are_refused_and_sub_refusals_are_logged(
        tmp_path: Path, keys: Path) -> None:
    """An impostor publisher: /healthz reports the refusals and "degraded" (HTTP 200: a restart cannot
    fix keys), and the SUB socket's refusals are logged, not only the replay socket's first one."""
    from tests.integration.consumer.test_daemon_settings import http_get

    db, _ = migrated_db(tmp_path)
    with _publisher(keys, "rogue") as pub, structlog.testing.capture_logs() as logs:
        src = {"engine_id": ENGINE, "endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint,
               "curve_publisher_key": keys / "engine.key"}
        settings = settings_for(db, src, curve_secret_key=keys / "consumer.key_secret", metrics_port=0)
        async with DaemonRun(settings) as run:
            _publish(pub, 2)
            await wait_until(lambda: _refused(run, "sub", "no_detail") >= 1, 30, "SUB refusal")
            status, _, body = await http_get(run.daemon.metrics_port, "/healthz")
            health = json.loads(body)
            await run.stop()
    source = health["sources"][f"{ENGINE}@{pub.endpoint}"]
    assert status == 200 and health["status"] == "degraded", health
    assert source["handshakes_refused"] >= 1 and source["handshakes_refused_since_last_message"] >= 1
    assert source["degraded"] and source["messages"] == 0
    refused = [e for e in logs if e["event"] == "source.handshake_refused"]
    assert {e["socket"] for e in refused} == {"sub", "replay"}, refused


async def test_a_peer_that_is_no_zmq_publisher_is_not_called_a_key_problem(tmp_path: Path) -> None:
    """No CURVE configured and the endpoint is a TCP port that closes every connection (another
    service, a wrong port): the refusal's hint says so instead of naming keys nobody configured."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    stop = threading.Event()

    def close_every_connection() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=close_every_connection, daemon=True).start()
    db, _ = migrated_db(tmp_path)
    endpoint = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    try:
        with structlog.testing.capture_logs() as logs:
            async with DaemonRun(settings_for(db, {"engine_id": ENGINE, "endpoint": endpoint})) as run:
                await wait_until(lambda: any(e["event"] == "source.handshake_refused" for e in logs), 30, "a refusal")
                await run.stop()
    finally:
        stop.set()
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
    refused = [e for e in logs if e["event"] == "source.handshake_refused"]
    assert all("not a ZMQ publisher" in e["hint"] and "secret key" not in e["hint"] for e in refused), refused


async def test_a_host_name_that_does_not_resolve_makes_the_source_degraded(tmp_path: Path) -> None:
    """``--endpoint tcp://ledger-hots.invalid:5557`` (a typo): libzmq retries the name silently and
    /healthz said ok, receiving; now the source is degraded, naming the host, and the log says so."""
    from tests.integration.consumer.test_daemon_settings import http_get

    db, _ = migrated_db(tmp_path)
    src = {"engine_id": ENGINE, "endpoint": "tcp://ledger-hots.invalid:5557",
           "replay_endpoint": "tcp://ledger-hots.invalid:5558"}
    with structlog.testing.capture_logs() as logs:
        async with DaemonRun(settings_for(db, src, metrics_port=0, replay_timeout_s=0.2)) as run:
            await wait_until(lambda: any(e["event"] == "source.host_unresolved" for e in logs), 30, "the warning")
            status, _, body = await http_get(run.daemon.metrics_port, "/healthz")
            await run.stop()
    health = json.loads(body)
    source = next(iter(health["sources"].values()))
    assert status == 200 and health["status"] == "degraded", health
    assert source["degraded"] and source["unresolved_hosts"] == ["ledger-hots.invalid"]
    [warning] = [e for e in logs if e["event"] == "source.host_unresolved"]
    assert list(warning["hosts"]) == ["ledger-hots.invalid"]

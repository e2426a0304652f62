"""Settings sources (flags > env > TOML), and the /metrics + /healthz endpoint of a running daemon."""

from __future__ import annotations

import asyncio
import json

import pytest
import zmq
from pydantic import ValidationError

from consumer.settings import ConsumerSettings, SourceSettings, load_settings
from tests.integration.consumer.daemon_support import DaemonRun, FaultPublisher, PayloadMaker, migrated_db, settings_for, subscribed, wait_until
from ledger.db import DEFAULT_DB

TOML = """
db = "sqlite:///from-toml.db"
batch_max_events = 10
metrics_port = 9400
[[sources]]
engine_id = "trt-a"
endpoint = "tcp://10.0.0.5:5557"
replay_endpoint = "tcp://10.0.0.5:5558"
topic = "kv"
[[sources]]
engine_id = "trt-b"
"""


def test_flags_beat_env_beat_toml(tmp_path, monkeypatch):
    config = tmp_path / "semkv.toml"
    config.write_text(TOML)
    monkeypatch.setenv("SEMKV_BATCH_MAX_EVENTS", "20")
    monkeypatch.setenv("SEMKV_METRICS_PORT", "9500")
    settings = load_settings({"metrics_port": 9600, "db": None}, config_file=config,
                             cli_source={"engine_id": "vllm-c", "endpoint": "tcp://127.0.0.1:0", "bind": True})
    assert settings.db == "sqlite:///from-toml.db"
    assert settings.batch_max_events == 20 and settings.metrics_port == 9600
    assert [s.source_id for s in settings.sources] == [
        "trt-a@tcp://10.0.0.5:5557", "trt-b@tcp://127.0.0.1:5557", "vllm-c@tcp://127.0.0.1:0"]
    assert settings.sources[0].replay_endpoint == "tcp://10.0.0.5:5558" and settings.sources[2].bind
    with pytest.raises(ValidationError):
        settings.db = "other"  # frozen


def test_sources_from_env_and_defaults(monkeypatch):
    monkeypatch.setenv("SEMKV_SOURCES", json.dumps([{"engine_id": "e", "source_id": "slot-1"}]))
    settings = load_settings()
    assert settings.db == DEFAULT_DB and settings.sources == [
        SourceSettings(engine_id="e", endpoint="tcp://127.0.0.1:5557", source_id="slot-1")]
    assert not settings.sources[0].bind and settings.sources[0].replay_endpoint is None


@pytest.mark.parametrize("bad", [
    {},  # no source
    {"sources": [{"engine_id": "e"}, {"engine_id": "e"}]},  # same source_id twice
    {"sources": [{"engine_id": "e", "endpoint": "http://x"}]},
    {"sources": [{"engine_id": "e"}], "queue_max_batches": 0},
    # values that passed the bounds and then stalled or crashed the daemon (newcomer, 2026-12-05)
    {"sources": [{"engine_id": "e"}], "batch_max_delay_ms": float("inf")},  # committed nothing until SIGTERM
    {"sources": [{"engine_id": "e"}], "replay_timeout_s": float("inf")},  # OverflowError at start
    {"sources": [{"engine_id": "e"}], "idle_replay_s": float("nan")},
    {"sources": [{"engine_id": "e"}], "rcv_hwm": 3_000_000_000},  # past ZMQ_RCVHWM's C int
])
def test_invalid_settings_are_refused(bad, monkeypatch):
    monkeypatch.delenv("SEMKV_SOURCES", raising=False)
    with pytest.raises(ValidationError):
        load_settings(bad)


def test_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_settings(config_file=tmp_path / "absent.toml", cli_source={"engine_id": "e"})


async def http_get(port: int, path: str) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    raw = await reader.read()
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


async def test_metrics_and_health_endpoint(tmp_path):
    db, _ = migrated_db(tmp_path)
    make = PayloadMaker()
    with FaultPublisher() as pub:
        source = {"engine_id": "trt-0", "endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint}
        async with DaemonRun(settings_for(db, source, metrics_port=0, metrics_host="127.0.0.1")) as run:
            await subscribed(pub, run)
            for seq in range(5):
                pub.publish(seq, make(seq))
            await wait_until(lambda: run.daemon.stats.batches == 5, what="5 batches")
            port = run.daemon.metrics_port
            status, headers, body = await http_get(port, "/metrics")
            assert status == 200 and headers["Content-Type"].startswith("text/plain")
            text = body.decode()
            assert "semkv_consumer_events_applied_total 15.0" in text
            assert 'semkv_consumer_messages_received_total{engine_id="trt-0"} 5.0' in text
            assert "semkv_consumer_commit_seconds_bucket" in text and "semkv_consumer_lag_seconds_count" in text
            status, _, body = await http_get(port, "/healthz")
            health = json.loads(body)
            assert status == 200 and health["status"] == "ok" and health["db"]["ok"]
            assert health["sources"][f"trt-0@{pub.endpoint}"]["last_seq"] == 4
            assert (await http_get(port, "/nope"))[0] == 404
            await run.stop()


async def test_a_source_that_cannot_bind_is_unhealthy_and_retried(tmp_path):
    db, _ = migrated_db(tmp_path)
    ctx = zmq.Context()
    squatter = ctx.socket(zmq.PUB)
    port = squatter.bind_to_random_port("tcp://127.0.0.1")
    try:
        good = {"engine_id": "ok", "endpoint": "tcp://127.0.0.1:0", "bind": True}
        bad = {"engine_id": "bad", "endpoint": f"tcp://127.0.0.1:{port}", "bind": True}
        settings = settings_for(db, good, bad, metrics_port=0, metrics_host="127.0.0.1")
        run = DaemonRun(settings)
        task = asyncio.create_task(run.daemon.run())
        await wait_until(lambda: run.daemon.ready.is_set(), 10, "daemon ready")
        await wait_until(lambda: run.daemon.sources[0].running, 10, "good source up")
        status, _, body = await http_get(run.daemon.metrics_port, "/healthz")
        health = json.loads(body)
        assert status == 503 and health["status"] == "unhealthy"
        assert not health["sources"][f"bad@tcp://127.0.0.1:{port}"]["alive"]
        run.daemon.request_stop()
        stats = await asyncio.wait_for(task, 10)
        assert stats.clean_exit
    finally:
        squatter.close(0)
        ctx.term()


def test_settings_model_is_the_one_passed_down():
    settings = ConsumerSettings(sources=[SourceSettings(engine_id="e")])
    assert settings.model_config["frozen"] and settings.sources[0].source_id == "e@tcp://127.0.0.1:5557"


def test_an_empty_variable_counts_as_unset(monkeypatch):
    """``SEMKV_RECORD=`` read as the path '' ("--record . is a directory"), ``SEMKV_CURVE_SECRET_KEY=``
    as a key given (newcomer, 2026-12-05): an empty variable is no value."""
    monkeypatch.setenv("SEMKV_RECORD", "")
    monkeypatch.setenv("SEMKV_CURVE_SECRET_KEY", "")
    monkeypatch.setenv("SEMKV_SOURCES", '[{"engine_id": "e"}]')
    settings = load_settings({})
    assert settings.record is None and settings.curve_secret_key is None

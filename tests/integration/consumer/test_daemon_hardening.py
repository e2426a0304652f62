"""Faults a newcomer found in ``consume`` (real ZMQ on 127.0.0.1, real SQLite files, the real process
where the fault is a process exit):

* a NaN/inf/negative batch ``ts`` is a dead letter, never a crash, never a row in the ledger;
* ``--exit-when-idle`` above ``idle_replay_s`` still exits (a replay probe is not a message);
* ``idle_replay_s = 0`` disables the idle probe (TOML and env have no null);
* start-up errors of ``--record``, ``--metrics-port`` and ``--metrics-host`` are one line, exit 2;
* a tcp endpoint's port is checked (1..65535; ``*``/0 only where the socket binds).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time

import msgspec
import pytest
from pydantic import ValidationError

from consumer.settings import load_settings, unknown_env_settings
from tests.integration.consumer.daemon_support import (
    DaemonRun,
    FaultPublisher,
    PayloadMaker,
    ledger_counts,
    migrated_db,
    settings_for,
    subscribed,
    wait_until,
)
from tests.integration.consumer.test_daemon_process import CLI, Consumer, batches_in, source_args, wait_for

ENGINE = "trt-0"
ENC = msgspec.msgpack.Encoder()
STORED = {"type": "BlockStored", "block_hashes": [77], "parent_block_hash": None, "token_ids": list(range(16)),
          "block_size": 16, "medium": "GPU"}


# --- 1. non-finite ts ------------------------------------------------------------------------------


def test_nan_and_inf_ts_are_dead_lettered_and_the_daemon_keeps_running(tmp_path):
    """Each bad batch is alone in its commit (the case that crashed with NOT NULL sources.last_ts)."""
    db, path = migrated_db(tmp_path)
    make = PayloadMaker()
    with FaultPublisher() as pub:
        consumer = Consumer(*source_args(db, pub, "--idle-replay-s", "0"))
        try:
            consumer.wait_event("source.started")
            pub.wait_for_subscriber()
            payloads = [make(0), ENC.encode([math.nan, [STORED], 0]), ENC.encode([math.inf, [STORED], 0]),
                        ENC.encode([-5.0, [STORED], 0]), make(4)]
            for seq, payload in enumerate(payloads):
                pub.publish(seq, payload)
                wait_for(lambda n=seq + 1: batches_in(path) == n or consumer.proc.poll() is not None, 20,
                         f"batch {seq} committed")
                assert consumer.proc.poll() is None, "".join(consumer.lines)[-3000:]
            consumer.proc.send_signal(signal.SIGTERM)
            assert consumer.finish() == 0, "".join(consumer.lines)[-3000:]
        finally:
            if consumer.proc.poll() is None:
                consumer.proc.kill()
    counts = ledger_counts(path)
    assert counts.batches == 5 and counts.dead_letters_by_reason == {"value_out_of_range": 3}
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        (last_ts,) = conn.execute("SELECT last_ts FROM sources").fetchone()
        ts_values = [row[0] for row in conn.execute("SELECT last_ts FROM sources")]
    finally:
        conn.close()
    assert all(v is not None and math.isfinite(v) for v in [last_ts, *ts_values])
    letters = [e for e in consumer.events() if e.get("event") == "source.dead_letter"]
    assert [e["reason"] for e in letters] == ["value_out_of_range"] * 3 and "nan" in letters[0]["detail"]


# --- 2. exit-when-idle with idle probes ------------------------------------------------------------


async def test_exit_when_idle_fires_although_idle_probes_keep_running(tmp_path):
    db, path = migrated_db(tmp_path)
    make = PayloadMaker()
    with FaultPublisher() as pub:
        source = {"engine_id": ENGINE, "endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint}
        run = DaemonRun(settings_for(db, source, idle_replay_s=0.2), exit_when_idle_s=1.5)
        async with run:
            await subscribed(pub, run)
            pub.publish(0, make(0))
            await wait_until(lambda: run.daemon.stats.batches == 1, what="1 batch")
            started = time.monotonic()
            stats = await asyncio.wait_for(run._task, 15)  # idle exit: nobody triggers a stop
            idle_for = time.monotonic() - started
            run.stats = stats
    assert stats.clean_exit and 1.0 <= idle_for < 10
    assert run.metric("semkv_consumer_replay_probes_total", engine_id=ENGINE) >= 3  # probes ran meanwhile
    assert ledger_counts(path).batches == 1


# --- 3. idle_replay_s = 0 --------------------------------------------------------------------------


def test_idle_replay_s_zero_is_accepted_from_every_source(tmp_path, monkeypatch):
    config = tmp_path / "semkv.toml"
    config.write_text('idle_replay_s = 0\n[[sources]]\nengine_id = "e"\n')
    assert load_settings(config_file=config).idle_replay_s == 0
    monkeypatch.setenv("SEMKV_IDLE_REPLAY_S", "0")
    assert load_settings(cli_source={"engine_id": "e"}).idle_replay_s == 0
    assert load_settings({"idle_replay_s": 0}, cli_source={"engine_id": "e"}).idle_replay_s == 0
    with pytest.raises(ValidationError):
        load_settings({"idle_replay_s": -1}, cli_source={"engine_id": "e"})


async def test_idle_replay_s_zero_disables_the_idle_probe(tmp_path):
    db, _ = migrated_db(tmp_path)
    with FaultPublisher() as pub:
        source = {"engine_id": ENGINE, "endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint}
        async with DaemonRun(settings_for(db, source, idle_replay_s=0)) as run:
            await subscribed(pub, run)  # the start-up probe still runs
            await asyncio.sleep(1.0)
            assert run.metric("semkv_consumer_replay_probes_total", engine_id=ENGINE) == 1
            assert all(s.running for s in run.daemon.sources)
            await run.stop()


# --- 4. start-up errors: one line, exit 2 -----------------------------------------------------------


def _consume(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, "consume", *args], capture_output=True, text=True, timeout=60)


def _error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The one non-JSON line on stderr (JSON log lines aside); no traceback."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = []
    for line in result.stderr.splitlines():
        try:
            json.loads(line)
        except ValueError:
            lines.append(line)
    assert len(lines) == 1, result.stderr
    return lines[0]


def _base(db: str) -> list[str]:
    return ["--db", db, "--engine-id", ENGINE, "--endpoint", "tcp://127.0.0.1:9", "--exit-when-idle", "0.5"]


def test_record_path_that_cannot_be_opened_is_one_line_exit_2(tmp_path):
    db, _ = migrated_db(tmp_path)
    result = _consume(*_base(db), "--record", str(tmp_path / "no" / "such" / "dir" / "x.bin"))
    assert result.returncode == 2
    line = _error_line(result)
    assert line.startswith("error: --record ") and "No such file or directory" in line


def test_metrics_port_in_use_is_one_line_exit_2(tmp_path):
    db, _ = migrated_db(tmp_path)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        result = _consume(*_base(db), "--metrics-port", str(port))
    assert result.returncode == 2
    line = _error_line(result)
    assert line.startswith(f"error: --metrics-port {port}") and "in use" in line


def test_metrics_host_not_on_this_machine_is_one_line_exit_2(tmp_path):
    host = "10.255.255.1"
    with socket.socket() as probe:
        try:
            probe.bind((host, 0))
        except OSError:
            pass
        else:
            pytest.skip(f"{host} is an address of this machine")
    db, _ = migrated_db(tmp_path)
    result = _consume(*_base(db), "--metrics-host", host, "--metrics-port", "0")
    assert result.returncode == 2
    line = _error_line(result)
    assert line.startswith(f"error: --metrics-host {host}") and "assign" in line


# --- 6. tcp ports -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("source", "message"), [
    ({"endpoint": "tcp://127.0.0.1:99999"}, "not in 1..65535"),
    ({"endpoint": "tcp://127.0.0.1:0"}, "only where the socket binds"),
    ({"endpoint": "tcp://127.0.0.1:*"}, "only where the socket binds"),
    ({"endpoint": "tcp://*:5557"}, "host * only where the socket binds"),
    ({"endpoint": "tcp://127.0.0.1:port"}, "not in 1..65535"),
    ({"endpoint": "tcp://127.0.0.1"}, "expected tcp://HOST:PORT"),
    ({"replay_endpoint": "tcp://127.0.0.1:0"}, "only where the socket binds"),
    ({"replay_endpoint": "tcp://127.0.0.1:70000"}, "not in 1..65535"),
], ids=["port-too-big", "port-0-connect", "port-star-connect", "host-star-connect", "port-name", "no-port",
        "replay-port-0", "replay-port-too-big"])
def test_bad_tcp_ports_are_refused(source, message):
    with pytest.raises(ValidationError, match=message.replace("*", r"\*").replace(".", r"\.")):
        load_settings(cli_source={"engine_id": "e", **source})


def test_good_tcp_endpoints_are_accepted():
    for source in ({"endpoint": "tcp://127.0.0.1:1"}, {"endpoint": "tcp://[::1]:65535"},
                   {"endpoint": "tcp://*:5557", "bind": True}, {"endpoint": "tcp://127.0.0.1:0", "bind": True},
                   {"endpoint": "tcp://127.0.0.1:*", "bind": True}, {"endpoint": "ipc:///tmp/kv.sock"},
                   {"endpoint": "tcp://eth0;10.0.0.5:5557"}):
        load_settings(cli_source={"engine_id": "e", **source})


def test_consume_refuses_a_port_out_of_range_in_one_line_exit_2(tmp_path):
    result = _consume("--db", str(tmp_path / "x.db"), "--engine-id", ENGINE, "--endpoint", "tcp://127.0.0.1:99999")
    assert result.returncode == 2
    line = _error_line(result)
    assert line.startswith("error: ") and "99999" in line and "1..65535" in line



def test_consume_says_sources_from_the_environment_are_json(tmp_path):
    """``SEMKV_SOURCES=A=tcp://…`` got pydantic-settings' 'error parsing value for field "sources" from
    source "EnvSettingsSource"', which names neither the variable nor JSON."""
    result = subprocess.run([*CLI, "consume", "--db", str(tmp_path / "x.db")], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "SEMKV_SOURCES": "A=tcp://127.0.0.1:5557"})
    assert result.returncode == 2
    line = _error_line(result)
    assert line.startswith("error: SEMKV_SOURCES is not valid JSON: Expecting value") and "is JSON" in line



def test_a_semkv_variable_naming_no_setting_is_reported():
    """``SEMKV_BATCH_MAX_EVENT=64`` (a typo) left the default 1024 in force without a word."""
    env = {"SEMKV_BATCH_MAX_EVENT": "64", "SEMKV_BATCH_MAX_EVENTS": "64", "SEMKV_SOURCES__0__ENGINE_ID": "e",
           "SEMKV_CURVE_SECRET_KEY": "k", "PATH": "/bin"}
    assert unknown_env_settings(env) == ["SEMKV_BATCH_MAX_EVENT"]



@pytest.mark.parametrize("args, message", [
    (("--engine-id", ENGINE, "--exit-when-idle", "-1"), "--exit-when-idle -1: a number of seconds above 0"),
    (("--engine-id", ENGINE, "--exit-when-idle", "nan"), "--exit-when-idle nan"),
    (("--engine-id", "a\nb"), "an engine id cannot hold control characters"),
])
def test_consume_refuses_odd_but_plausible_values(tmp_path, args, message):
    """``--exit-when-idle -1`` exited 0 at once; an engine id with a newline was accepted (it splits
    log lines, tables and Prometheus labels)."""
    result = _consume("--db", str(tmp_path / "x.db"), *args)
    assert result.returncode == 2 and message in _error_line(result)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))

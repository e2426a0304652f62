"""``semkv-ledger demo`` (the README's main command) runs green, and its checks are real: a fault
injected on purpose makes it exit non-zero with that check failed."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def run_demo(*args: str) -> subprocess.CompletedProcess[str]:
    """The demo with its stdout a pipe and no COLUMNS: what `make demo | tee` or a CI log shows."""
    return subprocess.run([sys.executable, "-m", "ledger", "demo", "--quick", *args], capture_output=True, text=True,
                          timeout=400, env=_env())


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "COLUMNS"}


def test_demo_passes_every_check() -> None:
    done = run_demo()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all checks passed" in done.stdout
    assert "FAIL" not in done.stdout
    assert "…" not in done.stdout  # piped: tables are as wide as they need, nothing cut


def test_demo_json_is_one_object_with_every_check() -> None:
    import json

    done = run_demo("--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] is True and len(report["checks"]) >= 5 and all(c["ok"] for c in report["checks"])
    assert report["stats"]["events_total"] > 0 and set(report["connectors"]) == {"A", "B"}


def test_a_directory_holding_an_earlier_run_is_refused(tmp_path) -> None:
    (tmp_path / "ledger.db").write_bytes(b"")  # what `demo --dir D --keep` leaves behind
    done = run_demo("--dir", str(tmp_path))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("error: --dir ") and "already holds a demo run" in done.stderr
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr


@pytest.mark.parametrize(("fault", "failing_check"), [
    ("tamper-projection", "replay: projections equal a rebuild of the log"),
    ("drop-recorded-message", "recorded stream: every event in the log, per type"),
])
def test_a_broken_step_makes_the_demo_fail(fault: str, failing_check: str) -> None:
    done = run_demo("--fault", fault)
    assert done.returncode == 1, done.stdout + done.stderr
    failed = [line for line in done.stdout.splitlines() if "FAIL" in line]
    assert any(failing_check[:30] in line for line in failed), done.stdout

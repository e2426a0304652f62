"""``semkv-ledger demo`` (the README's main command) runs green, and its checks are real: a fault
injected on purpose makes it exit non-zero with that check failed."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def run_demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ledger", "demo", "--quick", *args], capture_output=True, text=True,
                          timeout=400, env={"COLUMNS": "200", **_env()})


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "COLUMNS"}


def test_demo_passes_every_check() -> None:
    done = run_demo()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all checks passed" in done.stdout
    assert "FAIL" not in done.stdout


@pytest.mark.parametrize(("fault", "failing_check"), [
    ("tamper-projection", "replay: projections equal a rebuild of the log"),
    ("drop-recorded-message", "recorded stream: every event in the log, per type"),
])
def test_a_broken_step_makes_the_demo_fail(fault: str, failing_check: str) -> None:
    done = run_demo("--fault", fault)
    assert done.returncode == 1, done.stdout + done.stderr
    failed = [line for line in done.stdout.splitlines() if "FAIL" in line]
    assert any(failing_check[:30] in line for line in failed), done.stdout

"""``semkv-ledger demo`` (the README's main command) runs green, and its checks are real: a fault
injected on purpose makes it exit non-zero with that check failed."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def run_demo(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The demo with its stdout a pipe and no COLUMNS: what `make demo | tee` or a CI log shows."""
    return subprocess.run([sys.executable, "-m", "ledger", "demo", "--quick", *args], capture_output=True, text=True,
                          timeout=400, env={**_env(), **(env or {})}, stdin=subprocess.DEVNULL)


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


@pytest.mark.parametrize("below_a_file", [False, True])
def test_a_dir_that_cannot_be_a_directory_is_refused(tmp_path, below_a_file: bool) -> None:
    """``--dir FILE`` and ``--dir FILE/x``: one ``error:`` line and exit 2, as for an earlier run."""
    file = tmp_path / "a-file"
    file.write_text("x")
    done = run_demo("--dir", str(file / "x" if below_a_file else file))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(f"error: --dir {file}") and "directory" in done.stderr, done.stderr
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr
    assert file.read_text() == "x"


def test_a_step_that_fails_keeps_its_whole_reason(tmp_path) -> None:
    """A harness engine that cannot start: the check says why (the exception it died of, with the
    setting and where its value came from), on one line, not only "engine A did not start:"."""
    import json

    done = run_demo("--json", "--dir", str(tmp_path / "demo"),  # a failed demo keeps its directory
                    env={"TRTLLM_SEMKV_LOOKUP_TIMEOUT_S": "-1"})  # every harness engine refuses it
    assert done.returncode == 1, done.stdout + done.stderr
    failed = [c for c in json.loads(done.stdout)["checks"] if not c["ok"]]
    assert failed and failed[0]["name"] == "demo ran to the end", failed
    detail = failed[0]["detail"]
    assert detail.startswith("engine A did not start: "), detail
    assert "lookup_timeout_s" in detail and "TRTLLM_SEMKV_LOOKUP_TIMEOUT_S" in detail, detail
    assert "\n" not in detail and "Traceback" not in detail and len(detail) <= 500, detail


def test_failure_detail_is_one_bounded_line() -> None:
    from connector.demo.run import DemoError, failure_detail

    trace = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n    boom()\n    ^^^^^^\n"
             "ValueError: 1 validation error\n  field\n    Input should be > 0\n")
    assert failure_detail(DemoError(f"engine B failed sync:\n{trace}")) == (
        "engine B failed sync: ValueError: 1 validation error field Input should be > 0")
    assert failure_detail(DemoError("timed out\nafter 90 s\twaiting")) == "timed out after 90 s waiting"
    long = failure_detail(DemoError("x" * 2000))
    assert len(long) == 500 and long.endswith("…")


@pytest.mark.parametrize(("fault", "failing_check"), [
    ("tamper-projection", "replay: projections equal a rebuild of the log"),
    ("drop-recorded-message", "recorded stream: every event in the log, per type"),
])
def test_a_broken_step_makes_the_demo_fail(fault: str, failing_check: str) -> None:
    done = run_demo("--fault", fault)
    assert done.returncode == 1, done.stdout + done.stderr
    failed = [line for line in done.stdout.splitlines() if "FAIL" in line]
    assert any(failing_check[:30] in line for line in failed), done.stdout


@pytest.mark.parametrize(("signal_name", "to_group", "status"), [("SIGINT", True, 130), ("SIGTERM", False, 143)])
def test_ctrl_c_or_sigterm_stops_the_demo_quietly_and_removes_its_directory(tmp_path, signal_name: str,
                                                                           to_group: bool, status: int) -> None:
    """A Ctrl-C (SIGINT to the whole process group, as a terminal sends it) printed two engine
    processes' KeyboardInterrupt tracebacks and left its temporary directory behind; a SIGTERM to the
    demo alone (``timeout``, a CI cancelling) killed it and left its consumer, publisher and directory."""
    import os
    import signal
    import time

    env = {**_env(), "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "ledger", "demo", "--quick"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
                            stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("semkv-demo-*/consumer.toml")):  # the engines and the consumer run
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
        time.sleep(0.1)
    sig = getattr(signal, signal_name)
    if to_group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == status, out
    assert "Traceback" not in out and out.rstrip().endswith("interrupted"), out
    assert not list(tmp_path.glob("semkv-demo-*")), out
    deadline = time.monotonic() + 30  # the demo's children (same process group) are gone too
    while True:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "processes of the demo's group still run"
        time.sleep(0.1)

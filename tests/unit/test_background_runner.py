"""The connector's BackgroundRunner: queued jobs and periodic jobs on one thread, in a bounded order."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from connector.lookup import BackgroundRunner


def wait_for(predicate, timeout_s: float = 10.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_periodic_and_queued_jobs_run_on_one_thread_a_period_apart() -> None:
    runner = BackgroundRunner("test-runner")
    runs: list[tuple[str, float, int]] = []
    try:
        runner.every("tick", 0.02, lambda: runs.append(("tick", time.monotonic(), threading.get_ident())))
        runner.submit(lambda: runs.append(("job", time.monotonic(), threading.get_ident())), must=True)
        wait_for(lambda: sum(1 for r in runs if r[0] == "tick") >= 4)
    finally:
        runner.close()
    assert len({thread for _, _, thread in runs}) == 1 and runs[0][2] != threading.get_ident()
    ticks = [at for name, at, _ in runs if name == "tick"]
    assert all(b - a >= 0.02 for a, b in zip(ticks, ticks[1:]))
    assert "job" in [name for name, _, _ in runs]


def test_a_queued_job_waits_for_one_run_of_a_slow_periodic_job_not_more() -> None:
    """A periodic job slower than its period does not starve queued jobs (leases)."""
    runner = BackgroundRunner("test-runner")
    order: list[str] = []
    gate = threading.Event()

    def slow_tick() -> None:
        order.append("tick")
        gate.wait(10)

    try:
        runner.every("tick", 0.001, slow_tick)
        wait_for(lambda: order == ["tick"])
        runner.submit(lambda: order.append("lease"), must=True)
        time.sleep(0.05)  # the tick is overdue many times over by now
        gate.set()
        wait_for(lambda: "lease" in order)
    finally:
        gate.set()
        runner.close()
    assert order[:2] == ["tick", "lease"]


def test_a_failing_periodic_job_is_logged_once_and_runs_again(caplog: pytest.LogCaptureFixture) -> None:
    runner = BackgroundRunner("test-runner")
    calls: list[int] = []

    def failing() -> None:
        calls.append(1)
        raise RuntimeError("ledger down")

    with caplog.at_level(logging.WARNING, logger="connector.lookup"):
        try:
            runner.every("view catch-up", 0.005, failing)
            wait_for(lambda: len(calls) >= 3)
        finally:
            runner.close()
    assert [r.getMessage() for r in caplog.records] == ["semkv: view catch-up failed: ledger down"]


def test_queued_jobs_run_before_a_due_periodic_job() -> None:
    """Leases first: jobs queued while the thread was busy all run before a periodic job that
    became due meanwhile."""
    runner = BackgroundRunner("test-runner")
    order: list[str] = []
    gate = threading.Event()
    period_s = 2.0  # long: a loaded machine must not make the tick a whole period late meanwhile
    try:
        runner.every("tick", period_s, lambda: order.append("tick"))
        due = time.monotonic() + period_s
        runner.submit(lambda: (order.append("busy"), gate.wait(30)), must=True)
        wait_for(lambda: "busy" in order)
        for name in ("lease-1", "lease-2", "release-1"):
            runner.submit(lambda name=name: order.append(name), must=True)
        time.sleep(max(0.0, due - time.monotonic()) + 0.05)  # the tick is due by now, but not a whole period late
        gate.set()
        wait_for(lambda: "tick" in order[order.index("busy"):])
    finally:
        gate.set()
        runner.close()
    after = order[order.index("busy") + 1:]
    assert after[:4] == ["lease-1", "lease-2", "release-1", "tick"]


def test_a_steady_stream_of_queued_jobs_does_not_starve_a_periodic_job() -> None:
    """The jobs are all queued at once, so the queue stays non-empty until the last one starts
    however slowly the machine runs them (ticks are not counted against wall time, which a loaded
    machine may spend elsewhere)."""
    runner = BackgroundRunner("test-runner")
    events: list[str] = []
    try:
        runner.every("tick", 0.02, lambda: events.append("tick"))
        for _ in range(200):  # at least 1 s of queued work, 5 ms a job
            runner.submit(lambda: (events.append("job"), time.sleep(0.005)), must=True)
        assert runner.flush(60)
    finally:
        runner.close()
    last_job = len(events) - 1 - events[::-1].index("job")
    assert events[:last_job].count("tick") >= 3  # ticks ran while jobs were still queued


def test_backlog_counts_the_oldest_queued_or_running_job() -> None:
    runner = BackgroundRunner("test-runner")
    gate = threading.Event()
    try:
        assert runner.backlog_s() == 0.0
        runner.submit(lambda: gate.wait(10), must=True)
        runner.submit(lambda: None, must=True)
        time.sleep(0.05)
        assert runner.backlog_s() >= 0.05
        gate.set()
        assert runner.flush(10)
        assert runner.backlog_s() < 0.05
    finally:
        gate.set()
        runner.close()


def test_a_period_too_long_for_a_timeout_does_not_stop_the_thread() -> None:
    """``donor_view_refresh_s = 1e10`` (or inf) once overflowed the queue's timeout and killed the
    thread that writes leases."""
    runner = BackgroundRunner("test-runner")
    done: list[int] = []
    try:
        runner.every("never", float("inf"), lambda: None)
        runner.every("rarely", 1e10, lambda: None)
        runner.submit(lambda: done.append(1), must=True)
        assert runner.flush(5) and done == [1]
    finally:
        runner.close()


def test_close_runs_what_was_queued_and_stops_the_thread() -> None:
    runner = BackgroundRunner("test-runner")
    done: list[int] = []
    runner.every("tick", 0.005, lambda: None)
    runner.submit(lambda: done.append(1), must=True)
    runner.close()
    assert done == [1] and not runner._thread.is_alive()

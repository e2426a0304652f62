"""Providers in their own processes (``provider_isolation = "process"``) and the caller's scheduling
during an inline wait (``wait_priority = "fifo"``): same answers as thread providers, a hung or dead
provider process is a counted miss and never holds the caller, nothing outlives ``close``."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from connector.discovery.service import DiscoveryService
from connector.settings import ConnectorConfigError
from tests.discovery.conftest import MODEL_ID, NS, donor_namespace, record, seed_workload, settings
from tests.discovery.test_service import Sleepy
from tools.workloads import Workload

HUNG = "tests.discovery.process_providers:Hung"
DYING = "tests.discovery.process_providers:Dying"
ROOT = Path(__file__).resolve().parents[2]


def outcome(svc: DiscoveryService, provider: str, name: str) -> float:
    return svc.metrics.value("semkv_discovery_outcomes_total", provider=provider, outcome=name)


def gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()


def answers(svc: DiscoveryService, workload: Workload) -> dict[str, tuple[str, str, int] | None]:
    out = {}
    for lab in workload.labels:
        m = svc.lookup(workload.prompt(lab.target).tokens, None, MODEL_ID, NS, deadline_s=30.0, inline=False)
        out[lab.target] = None if m is None else (m.donor_id, m.match_type, m.reusable_token_count)
    return out


def test_process_providers_answer_exactly_as_thread_providers(sqlite_db: str, workload: Workload) -> None:
    threads_before = threading.active_count()
    with DiscoveryService(settings(), db=sqlite_db) as on_threads:
        seed_workload(sqlite_db, workload, on_threads)
        assert on_threads.flush(30)
        expected = answers(on_threads, workload)
        sizes = on_threads.indexed()
    with DiscoveryService(settings(provider_isolation="process"), db=sqlite_db) as in_processes:
        pids = [p.proc.pid for p in in_processes._processes]
        assert len(pids) == 3 and os.getpid() not in pids
        for key in workload.donors:  # the ledger is seeded already: only queue them
            p = workload.prompt(key)
            in_processes.register_donor(record(key, p.tokens, namespace=donor_namespace(workload, key), text=p.text))
        assert in_processes.flush(60)
        assert in_processes.indexed() == sizes
        got = answers(in_processes, workload)
        assert sum(v is not None for v in got.values()) >= 5  # the comparison is not between two empty sets
        assert got == expected
        assert sum(n for (_, o), n in in_processes.metrics.outcome_counts().items() if o == "timeout") == 0
        # the ledger check runs in the children too: other_salt's donor is a counted namespace mismatch
        assert in_processes.metrics.value("semkv_discovery_dropped_total", provider="minhash",
                                          reason="namespace_mismatch") >= 1
    assert all(gone(pid) for pid in pids)
    assert threading.active_count() == threads_before


def test_a_hung_provider_process_is_a_counted_timeout_and_is_killed_at_close(sqlite_db: str,
                                                                             workload: Workload) -> None:
    lab = next(lab for lab in workload.labels if lab.scenario == "rag_reordered")
    tokens = workload.prompt(lab.target).tokens
    svc = DiscoveryService(settings(providers=(HUNG, "chunks"), provider_isolation="process", provider_queue_max=2),
                           db=sqlite_db)
    try:
        seed_workload(sqlite_db, workload, svc)
        assert svc.flush(60)
        hung_pid = next(p.proc.pid for p in svc._processes if p.name == "hung")
        for _ in range(5):  # the caller comes back (a hang here would be the bug: pytest's timeout ends it)
            svc.lookup(tokens, None, MODEL_ID, NS, deadline_s=0.002)
        # 2 sent and never answered, then its 2 outstanding requests make it skipped: all 5 are timeouts
        assert outcome(svc, "hung", "timeout") == 5
        hung = next(p for p in svc._processes if p.name == "hung")
        assert len(hung._jobs) == 2  # bounded: nothing more was written to a process that does not answer
        # the other provider still answers within a generous deadline (on a busy machine the 2 ms lookups
        # above may still occupy chunks' two slots: skipped, counted as timeout; so ask until it is free)
        deadline, match = time.monotonic() + 30.0, None
        while match is None and time.monotonic() < deadline:
            match = svc.lookup(tokens, None, MODEL_ID, NS, deadline_s=5.0)
        assert match is not None and match.donor_id == lab.donor
        assert outcome(svc, "hung", "timeout") >= 6
        assert len(hung._jobs) == 2
        assert not gone(hung_pid)
    finally:
        svc.close()
    assert gone(hung_pid)  # stuck in a provider call: killed, not leaked


def test_a_provider_process_that_dies_is_an_error_miss_from_then_on(sqlite_db: str, workload: Workload) -> None:
    lab = next(lab for lab in workload.labels if lab.scenario == "rag_reordered")
    tokens = workload.prompt(lab.target).tokens
    with DiscoveryService(settings(providers=(DYING, "chunks", "minhash"), provider_isolation="process"),
                          db=sqlite_db) as svc:
        seed_workload(sqlite_db, workload, svc)
        assert svc.flush(60)
        # a generous deadline: the caller learns of the exit from the pipe's end of file, not the clock
        match = svc.lookup(tokens, None, MODEL_ID, NS, deadline_s=30.0)
        assert match is not None and match.donor_id == lab.donor
        assert outcome(svc, "dying", "error") == 1
        assert svc.metrics.value("semkv_discovery_provider_exits_total", provider="dying") == 1
        # killed from outside (an OOM kill): the same, for minhash
        minhash = next(p for p in svc._processes if p.name == "minhash")
        os.kill(minhash.proc.pid, signal.SIGKILL)
        minhash.proc.wait(10)
        match = svc.lookup(tokens, None, MODEL_ID, NS, deadline_s=30.0)
        assert match is not None and match.donor_id == lab.donor  # chunks still answers
        assert outcome(svc, "dying", "error") == 2
        assert outcome(svc, "minhash", "error") == 1
        assert svc.metrics.value("semkv_discovery_provider_exits_total", provider="minhash") == 1
        pids = [p.proc.pid for p in svc._processes]
    assert all(gone(pid) for pid in pids)


def test_a_provider_that_cannot_start_in_its_process_is_a_config_error(sqlite_db: str) -> None:
    with pytest.raises(ConnectorConfigError, match="no index here"):
        DiscoveryService(settings(providers=("chunks", "tests.discovery.process_providers:FailsToStart"),
                                  provider_isolation="process"), db=sqlite_db)


def _may_use_fifo() -> bool:
    return os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_RTPRIO)[0] >= 1


def test_wait_priority_fifo_lifts_only_the_inline_wait_and_restores_the_caller(sqlite_db: str,
                                                                               workload: Workload) -> None:
    sleepy = Sleepy()
    before = (os.sched_getscheduler(0), os.sched_getparam(0).sched_priority, os.getpriority(os.PRIO_PROCESS, 0))
    seen: list[int] = []

    class Watching(Sleepy):  # runs on its lane thread: the caller's policy is read from /proc below
        name = "watching"

    with DiscoveryService(settings(wait_priority="fifo", provider_queue_max=100), db=sqlite_db,
                          providers=[sleepy, Watching()]) as svc:
        tokens = workload.prompt(workload.labels[0].target).tokens
        for _ in range(3):
            assert svc.lookup(tokens, None, MODEL_ID, NS, deadline_s=0.002) is None
            seen.append(os.sched_getscheduler(0))
        svc.lookup(tokens, None, MODEL_ID, NS, deadline_s=0.002, inline=False)  # not inline: never lifted
        m = svc.metrics
        results = {r: m.value("semkv_discovery_wait_priority_total", result=r)
                   for r in ("raised", "denied", "unsupported", "already_realtime")}
        assert sum(results.values()) == 3
        if _may_use_fifo():
            assert results["raised"] == 3
        sleepy.release.set()
    assert seen == [before[0]] * 3
    assert (os.sched_getscheduler(0), os.sched_getparam(0).sched_priority,
            os.getpriority(os.PRIO_PROCESS, 0)) == before


_DENIED = """
import os
from connector.discovery.priority import raised_priority
results = []
with raised_priority(results.append) as r:
    inside = os.sched_getscheduler(0)
print(r, inside == os.SCHED_OTHER, os.sched_getscheduler(0) == os.SCHED_OTHER)
"""


@pytest.mark.skipif(not (sys.platform == "linux" and os.geteuid() == 0 and shutil.which("setpriv")),
                    reason="needs root and setpriv(1) to run a child without CAP_SYS_NICE")
def test_wait_priority_without_permission_is_a_counted_no_op() -> None:
    out = subprocess.run(["setpriv", "--bounding-set=-sys_nice", "--inh-caps=-sys_nice", sys.executable, "-c", _DENIED],
                         cwd=ROOT, capture_output=True, text=True, timeout=120,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_RTPRIO, (0, 0)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["denied", "True", "True"]


def test_a_frozen_provider_process_never_blocks_the_caller(sqlite_db: str, workload: Workload) -> None:
    """SIGSTOP: the child reads nothing, its request pipe fills up; lookups (32K-token queries, 128 KiB
    each) are then skipped at once, never written halfway, and the provider answers again once resumed."""
    lab = next(lab for lab in workload.labels if lab.scenario == "rag_reordered")
    tokens = list(workload.prompt(lab.target).tokens)
    big = (tokens * (32768 // len(tokens) + 1))[:32768]
    with DiscoveryService(settings(providers=("chunks",), provider_isolation="process", provider_queue_max=1000),
                          db=sqlite_db) as svc:
        seed_workload(sqlite_db, workload, svc)
        assert svc.flush(60)
        chunks = svc._processes[0]
        os.kill(chunks.proc.pid, signal.SIGSTOP)
        try:
            for _ in range(40):  # 40 × 128 KiB: far more than the 1 MiB pipe holds
                svc.lookup(big, None, MODEL_ID, NS, deadline_s=0.002)
            assert outcome(svc, "chunks", "timeout") == 40
            sent = len(chunks._jobs)
            assert 0 < sent < 40  # some were written, the rest skipped when the pipe was full
        finally:
            os.kill(chunks.proc.pid, signal.SIGCONT)
        deadline, match = time.monotonic() + 30.0, None
        while match is None and time.monotonic() < deadline:  # the backlog expires unstarted, then it answers
            match = svc.lookup(tokens, None, MODEL_ID, NS, deadline_s=5.0)
        assert match is not None and match.donor_id == lab.donor
        pid = chunks.proc.pid
    assert gone(pid)

"""The waiting caller's CPU priority during an inline lookup (``wait_priority = "fifo"``).

Why (measured, tools/bench_deadline.py and tools/results/deadline-2026-12-05-*.md): with both cores
busy, a caller thread of the default policy (``SCHED_OTHER``, nice 0) that sleeps until the 2 ms
deadline is woken by its timer on time but then waits on the run queue for a CPU — p99 10–24 ms
of ``run_delay`` in ``/proc/thread-self/schedstat`` for a bare ``threading.Event().wait(0.002)``,
no Python of ours involved; shorter EEVDF slices (``sched_attr.sched_runtime``) did not change it.
The same wait at ``SCHED_FIFO`` priority 1 came back at p99 2.07 ms. No change of code in this
process can buy CPU time from the kernel; only the thread's scheduling class can.

:func:`raised_priority` therefore lifts the CALLING thread (on TensorRT-LLM, the executor loop) to
``SCHED_FIFO`` priority 1 — the lowest real-time priority — for the duration of one inline lookup
(bounded by the deadline plus the lookup's own few hundred microseconds) and puts back the policy
and priority it found. It needs ``CAP_SYS_NICE`` or ``RLIMIT_RTPRIO >= 1`` (``ulimit -r 1``;
systemd ``LimitRTPRIO=1``; Docker ``--ulimit rtprio=1`` or ``--cap-add SYS_NICE``); without it
(``EPERM``), on a platform without ``os.sched_setscheduler``, or on a thread already real-time, the
lookup runs at the priority it has, and the attempt is counted. Never raises. Linux's real-time
throttling (``/proc/sys/kernel/sched_rt_runtime_us``, default 95 %) bounds what a real-time thread
can take in any case.

What it does not do (measured, same files): the lookup's own work then ends on time (p99 about
2.2–2.6 ms with both cores busy), but putting the thread back to ``SCHED_OTHER`` while it runs makes
Linux reschedule at once (``switched_to_fair`` in kernel/sched/fair.c: "We were most likely switched
from sched_rt, so kick off the schedule if running"), and with every core busy the engine's thread
then waits its turn behind the load: the caller-observed p99 stays several milliseconds. Only an
engine thread that keeps a priority above the load (a deployment choice: a real-time executor
thread, for which this is ``already_realtime`` and a no-op, or a cgroup with a larger CPU weight)
keeps it; a nice value does not reach across groups (autogroups, cgroups).

Sources: Linux ``sched(7)`` (SCHED_FIFO, RLIMIT_RTPRIO, "Privileges and resource limits"),
``getrlimit(2)`` (RLIMIT_RTPRIO); Python's ``os.sched_setscheduler`` (pid 0 = the calling thread on Linux).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator

__all__ = ["raised_priority"]

log = logging.getLogger(__name__)
_FIFO = getattr(os, "SCHED_FIFO", None)
_ORDINARY = {getattr(os, n) for n in ("SCHED_OTHER", "SCHED_BATCH", "SCHED_IDLE") if hasattr(os, n)}
_warned = False


@contextlib.contextmanager
def raised_priority(count: Callable[[str], None] | None = None) -> Iterator[str]:
    """Run the block with the calling thread at ``SCHED_FIFO`` priority 1, then restore it.

    Args:
        count: called once with the result: ``raised``, ``denied`` (no permission), ``unsupported``
            (no such call here) or ``already_realtime``.

    Yields the same result string. Never raises for its own sake.
    """
    global _warned
    result, previous = "unsupported", None
    if _FIFO is not None and hasattr(os, "sched_getscheduler"):
        try:
            policy = os.sched_getscheduler(0)
            if policy not in _ORDINARY:
                result = "already_realtime"
            else:
                previous = (policy, os.sched_getparam(0))
                os.sched_setscheduler(0, _FIFO, os.sched_param(1))
                result = "raised"
        except PermissionError:
            previous, result = None, "denied"
            if not _warned:
                _warned = True
                log.warning("semkv discovery: wait_priority = 'fifo' but this process may not use SCHED_FIFO "
                            "(needs CAP_SYS_NICE or RLIMIT_RTPRIO >= 1); inline lookups wait at normal priority")
        except OSError as exc:  # e.g. a sandbox without the call: run as we are
            previous, result = None, "unsupported"
            log.debug("semkv discovery: SCHED_FIFO unavailable: %r", exc)
    if count is not None:
        count(result)
    try:
        yield result
    finally:
        if previous is not None:
            try:
                os.sched_setscheduler(0, previous[0], previous[1])
            except OSError:  # pragma: no cover - lowering one's own priority is always allowed
                log.exception("semkv discovery: could not restore the caller's scheduling policy")

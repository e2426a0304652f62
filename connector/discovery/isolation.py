"""Providers in their own processes (``provider_isolation = "process"``): the caller never waits on the GIL.

Why (measured, tools/bench_deadline.py): with providers on threads of the engine's process, a caller
woken at the deadline must take the GIL back from a provider thread that is running Python
(minhash's Jaccard ranking, token alignment); CPython lets a waiting thread ask for the GIL only
after ``sys.getswitchinterval()`` (5 ms), and a holder preempted by the OS keeps it until it runs
again. With each provider in a child process, the caller waits on pipe file descriptors
(``select``) with the remaining time and competes only with the OS scheduler (see
:mod:`.priority` for that part).

One :class:`ProcessProvider` per provider spec: ``python -m connector.discovery.worker`` started with
:class:`subprocess.Popen` (``pass_fds``: a request pipe and a reply pipe; no fork of the engine's
process, whose CUDA state must not be forked) builds the provider itself from the spec, the settings
and the ledger URL, so nothing but donors, queries and answers crosses the boundary. Frames are a
4-byte big-endian length and a pickle (protocol 5) — between this process and its own child only.

The proxy implements :class:`~connector.discovery.types.DiscoveryProvider` for the service's indexer
thread (``index``/``forget``/``prepare``/``flush``, which may block briefly on a full pipe) and adds
:meth:`ProcessProvider.submit` for lookups, which never blocks: the request is written only when the
pipe has room for all of it (``FIONREAD`` against ``F_GETPIPE_SZ``, less a 64 KiB margin) and no
earlier frame's tail is still waiting in the outbox, else skipped (a counted ``timeout``, as a full
thread lane); writes are non-blocking, and a tail the pipe did not take is sent at the next send or
read, so a frame is never cut. Pipes are enlarged to 1 MiB (``F_SETPIPE_SZ``) where allowed.
The child answers a lookup with its fresh matches (the ledger check, :func:`.runner.fresh_only`, runs
there, on its own ledger connection) or skips it unstarted when its deadline (``time.monotonic()``,
one clock for both processes on Linux) has passed. An answer that arrives after the caller's
deadline is discarded (the caller already counted a ``timeout``).

A child that exits (crash, OOM kill) makes every later lookup of that provider an ``error`` miss at
once, logged once and counted in ``semkv_discovery_provider_exits_total``; it is not restarted (its
index died with it). A child stuck in a provider is bounded by ``provider_queue_max`` outstanding
requests, exactly like a thread lane. :meth:`ProcessProvider.close` closes the request pipe (the
child exits at end of file), waits ``timeout_s`` and kills it if needed: no process outlives the service.

Raises (constructor): ConnectorConfigError when the child cannot build the provider or does not
report ready within ``start_timeout_s``.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import pickle
import select
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from connector.discovery.runner import Job
from connector.discovery.types import DonorRecord, Query
from connector.settings import ConnectorConfigError

__all__ = ["ProcessProvider", "ProviderExited", "wait_processes"]

log = logging.getLogger(__name__)
_HEADER = struct.Struct("!I")
_PIPE_BYTES = 1 << 20
_F_SETPIPE_SZ, _F_GETPIPE_SZ = 1031, 1032  # fcntl(2), Linux
_FD_SETSIZE = 1024
_POLL_SLICE_S = 0.0005  # when another caller may drain our answer, look again this often
_LOCK_WAIT_S = 0.0005  # a lookup waits this long at most for the indexer's write to the same pipe
_MARGIN = 64 * 1024  # room kept free in a pipe, in bytes (its capacity is counted in 4 KiB pages)


class ProviderExited(RuntimeError):
    """The provider's process is gone; its lookups are ``error`` misses."""


def encode(obj: Any) -> bytes:
    """One frame: ``!I`` length, then the pickle."""
    body = pickle.dumps(obj, protocol=5)
    return _HEADER.pack(len(body)) + body


class FrameReader:
    """Splits a byte stream into decoded frames."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        self._buf += data
        out = []
        while len(self._buf) >= _HEADER.size:
            (n,) = _HEADER.unpack_from(self._buf)
            if len(self._buf) < _HEADER.size + n:
                break
            out.append(pickle.loads(bytes(self._buf[_HEADER.size:_HEADER.size + n])))
            del self._buf[:_HEADER.size + n]
        return out


def compact(query: Query) -> Query:
    """The query with int32 token ids when they fit (half the bytes through the pipe)."""
    ids = query.token_ids
    if ids.size and int(ids.max()) < 2**31:
        ids = ids.astype(np.int32)
    return Query(ids, query.text, query.model_id, query.namespace, query.tokens_per_block, query.inline)


def enlarge(fd: int) -> None:
    """Best effort: a 1 MiB pipe (the default 64 KiB holds one 8K-token query)."""
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, _F_SETPIPE_SZ, _PIPE_BYTES)


class ProcessProvider:
    """See the module docstring.

    Args:
        spec: a provider spec of ``DiscoverySettings.providers`` (alias or ``package.module:Class``).
        settings: the discovery settings (sent to the child as JSON-compatible values).
        db: the ledger URL (the child's provider and its freshness check read it).
        max_pending: outstanding lookups before submissions are skipped (``provider_queue_max``).
    """

    def __init__(self, spec: str, settings: Any, *, db: str | None, max_pending: int,
                 start_timeout_s: float = 120.0) -> None:
        self.spec, self._max = spec, max_pending
        self.on_embed: Callable[[float], None] | None = None
        self.size = 0
        self.exited = False
        self._seq = itertools.count(1)
        self._jobs: dict[int, Job] = {}
        self._acks: dict[int, threading.Event] = {}
        self._wlock, self._rlock, self._jlock = threading.Lock(), threading.Lock(), threading.Lock()
        self._reader = FrameReader()
        self._outbox = bytearray()
        self._closed = False
        self._exit_counter: Callable[[], None] | None = None
        req_r, self._w = os.pipe()
        self._r, rep_w = os.pipe()
        enlarge(self._w)
        enlarge(rep_w)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p)  # the same code as ours
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "connector.discovery.worker", str(req_r), str(rep_w)],
                                         pass_fds=(req_r, rep_w), stdin=subprocess.DEVNULL, env=env)
        finally:
            os.close(req_r)
            os.close(rep_w)
        self._capacity = self._pipe_size(self._w)
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._started_at = time.monotonic()
        self._start_timeout_s = start_timeout_s
        self.name, self.generation, self.needs_text = spec, 0, False
        self._ready: tuple[str, int, bool] | None = None
        self._failed: str | None = None
        self._send_blocking(("init", spec, settings.model_dump(mode="json"), db))

    # ------------------------------------------------------------------ start-up
    def wait_ready(self) -> None:
        """Wait for the child's ``ready`` (or failure).

        Raises:
            ConnectorConfigError: the provider could not be built, or no answer within ``start_timeout_s``.
        """
        deadline = self._started_at + self._start_timeout_s
        while self._ready is None and self._failed is None and not self.exited:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._wait_readable(min(remaining, 0.1))
            self.drain()
        if self._ready is None:
            why = self._failed or ("its process exited" if self.exited else f"no answer in {self._start_timeout_s} s")
            self.close(0.5)
            raise ConnectorConfigError(f"discovery provider {self.spec!r} could not start in its process: {why}")
        self.name, self.generation, self.needs_text = self._ready

    def count_exits(self, counter: Callable[[], None]) -> None:
        """``counter()`` is called once if the child exits before :meth:`close`."""
        self._exit_counter = counter

    # ------------------------------------------------------------------ lookups (caller, never blocks)
    def submit(self, query: Query, limit: int, deadline_mono: float) -> Job | None:
        """Send a lookup; None (skipped) when ``max_pending`` are outstanding or the pipe is full. A
        lookup of an exited child is a finished Job with :class:`ProviderExited`."""
        if self.exited or self._closed:
            return self._exited_job()
        if len(self._jobs) >= self._max:
            self.drain()  # answers of earlier lookups may be waiting in the pipe: nobody else reads them
        with self._jlock:
            if len(self._jobs) >= self._max:
                return None
            seq = next(self._seq)
            job = Job(None)  # type: ignore[arg-type]
            self._jobs[seq] = job
        if not self._send_now(encode(("lookup", seq, compact(query), limit, deadline_mono))):
            with self._jlock:
                self._jobs.pop(seq, None)
            return self._exited_job() if self.exited else None  # a dead reader breaks the pipe at once
        return job

    def _exited_job(self) -> Job:
        job = Job(None)  # type: ignore[arg-type]
        job.finished, job.error = True, ProviderExited(f"discovery provider {self.name} has exited")
        job.done.set()
        return job

    def drain(self) -> None:
        """Read and dispatch every answer already in the reply pipe (skipped when another thread is
        reading), after sending what the outbox holds (skipped when another thread is writing)."""
        if self._outbox and self._wlock.acquire(blocking=False):
            try:
                if not self._closed and not self.exited:
                    self._flush_outbox()
            except OSError:
                self._mark_exited()
            finally:
                self._wlock.release()
        if not self._rlock.acquire(blocking=False):
            return
        try:
            frames: list[Any] = []
            while True:
                try:
                    data = os.read(self._r, 1 << 20)
                except BlockingIOError:
                    break
                except OSError:
                    data = b""
                if not data:
                    self._mark_exited()
                    break
                frames.extend(self._reader.feed(data))
        finally:
            self._rlock.release()
        for frame in frames:
            self._dispatch(frame)

    def _dispatch(self, frame: tuple) -> None:
        kind = frame[0]
        if kind in ("result", "error", "skipped"):
            with self._jlock:
                job = self._jobs.pop(frame[1], None)
            if job is None:
                return
            with job.lock:
                if job.abandoned:  # late: the caller counted a timeout and left
                    return
                if kind == "result":
                    job.finished, job.value, job.elapsed_s = True, (frame[2], frame[3]), frame[4]
                elif kind == "error":
                    job.finished, job.error = True, _child_error(frame[2], frame[3])
                else:
                    return  # skipped unstarted: the caller's deadline had passed; it counts the timeout
            job.done.set()
        elif kind == "size":
            self.size = frame[1]
        elif kind == "ack":
            event = self._acks.pop(frame[1], None)
            if event is not None:
                event.set()
        elif kind == "embed":
            if self.on_embed is not None:
                with contextlib.suppress(Exception):
                    self.on_embed(frame[1])
        elif kind == "ready":
            self._ready = (frame[1], frame[2], frame[3])
        elif kind == "failed":
            self._failed = frame[1]

    # ------------------------------------------------------------------ indexer thread (may block briefly)
    def index(self, donor: DonorRecord) -> None:
        if not self._send_blocking(("index", donor)):
            raise ProviderExited(f"discovery provider {self.name} could not take donor {donor.donor_id}")

    def forget(self, donor_id: str) -> None:
        self._send_blocking(("forget", donor_id))

    def prepare(self, query: Query) -> None:
        self._send_blocking(("prepare", query))

    def flush(self, force: bool = True, timeout_s: float = 60.0) -> None:
        """``force``: wait until the child has indexed and published everything sent before (as a
        thread provider's ``flush(True)`` returns with its index published)."""
        if not force:  # the child publishes on its own when idle (see connector.discovery.worker)
            return
        token, event = next(self._seq), threading.Event()
        self._acks[token] = event
        if not self._send_blocking(("flush", True, token), timeout_s=timeout_s):
            self._acks.pop(token, None)
            return
        deadline = time.monotonic() + timeout_s
        while not event.is_set() and not self.exited and time.monotonic() < deadline:
            self._wait_readable(0.05)
            self.drain()

    def candidates(self, query: Query, limit: int) -> list:
        """The protocol's call, for completeness (the service uses :meth:`submit`): fresh matches or []."""
        job = self.submit(query, limit, time.monotonic() + 30.0)
        wait_processes([(self, job)], time.perf_counter() + 30.0)
        if job is None or not job.finished or job.error is not None:
            return []
        return list(job.value[0])

    # ------------------------------------------------------------------ lifecycle
    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the child (end of file on its request pipe; killed after ``timeout_s``); idempotent."""
        if self._closed:
            return
        self._closed = True
        with self._wlock:
            with contextlib.suppress(OSError):
                os.close(self._w)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10.0)
        with contextlib.suppress(OSError):
            os.close(self._r)
        with self._jlock:
            self._jobs.clear()

    # ------------------------------------------------------------------ pipes
    @staticmethod
    def _pipe_size(fd: int) -> int:
        try:
            return int(fcntl.fcntl(fd, _F_GETPIPE_SZ))
        except OSError:
            return 65536

    def _unread(self) -> int:
        buf = fcntl.ioctl(self._w, termios.FIONREAD, b"\0\0\0\0")
        return struct.unpack("i", buf)[0]

    def _send_now(self, frame: bytes, *, caller: bool = True) -> bool:
        """Send ``frame`` without blocking: False (nothing sent) when the pipe lacks room for it or an
        earlier frame's tail is still waiting. A frame accepted is sent whole, its tail (if the pipe took
        only part of it) from :attr:`_outbox` at the next send or read. ``caller``: on the lookup path,
        wait at most 0.5 ms for the write lock (the indexer's write)."""
        if not self._wlock.acquire(timeout=_LOCK_WAIT_S if caller else -1):
            return False
        try:
            if self._closed or self.exited or not self._flush_outbox():
                return False
            # room counted in bytes, but a pipe holds pages: a margin makes a partial write rare
            if self._capacity - self._unread() < len(frame) + _MARGIN:
                return False
            self._outbox += frame
            self._flush_outbox()
            return True
        except OSError:
            self._mark_exited()
            return False
        finally:
            self._wlock.release()

    def _flush_outbox(self) -> bool:
        """Write what the outbox holds, without blocking (caller holds the write lock); True when empty.

        Raises:
            OSError: the pipe is broken (the child exited).
        """
        while self._outbox:
            try:
                n = os.write(self._w, self._outbox)
            except BlockingIOError:
                return False
            del self._outbox[:n]
        return True

    def _send_blocking(self, obj: Any, timeout_s: float = 60.0) -> bool:
        """Write a frame, waiting (in 1 ms steps, without holding the write lock) for room."""
        frame = encode(obj)
        if len(frame) + _MARGIN > self._capacity:
            log.error("semkv discovery: a %d-byte %s message does not fit provider %s's %d-byte pipe; dropped",
                      len(frame), obj[0], self.spec, self._capacity)
            return False
        deadline = time.monotonic() + timeout_s
        while True:
            if self._send_now(frame, caller=False):
                return True
            if self._closed or self.exited or time.monotonic() >= deadline:
                return False
            time.sleep(0.001)
            self.drain()

    def _wait_readable(self, timeout_s: float) -> None:
        with contextlib.suppress(OSError, ValueError):
            if self._r < _FD_SETSIZE:
                select.select([self._r], [], [], timeout_s)
            else:
                time.sleep(timeout_s)

    def _mark_exited(self) -> None:
        if self.exited or self._closed:
            return
        self.exited = True
        log.error("semkv discovery: provider %s's process exited (code %s); its lookups are errors from now on",
                  self.spec, self.proc.poll())
        with self._jlock:
            jobs, self._jobs = list(self._jobs.values()), {}
        for job in jobs:
            with job.lock:
                if not job.abandoned and not job.finished:
                    job.finished, job.error = True, ProviderExited(f"discovery provider {self.name} has exited")
            job.done.set()
        if self._exit_counter is not None:
            with contextlib.suppress(Exception):
                self._exit_counter()


def _child_error(text: str, not_prepared: bool) -> BaseException:
    if not_prepared:
        from connector.discovery.embedding import NotPrepared

        return NotPrepared(text)
    return RuntimeError(text)


def wait_processes(jobs: Sequence[tuple[ProcessProvider, Job | None]], deadline: float) -> list[bool]:
    """Wait until every job is answered or ``deadline`` (``time.perf_counter()``) passes, reading the
    children's reply pipes on this thread. Returns, per job, whether it finished in time;
    unfinished jobs are marked abandoned (their late answers are discarded)."""
    waiting = [(lane, job) for lane, job in jobs if job is not None]
    fds = [lane._r for lane, _ in waiting if not lane.exited and not lane._closed]
    while True:
        for lane, job in waiting:
            if not job.done.is_set():
                lane.drain()
        pending = [(lane, job) for lane, job in waiting if not job.done.is_set()]
        remaining = deadline - time.perf_counter()
        if not pending or remaining <= 0:
            break
        # another thread may be draining a pipe (and so our answer): then look again soon
        contended = any(lane._rlock.locked() for lane, _ in pending)
        timeout = min(remaining, _POLL_SLICE_S) if contended else remaining
        live = [fd for fd in fds if fd >= 0]
        try:
            if live and max(live) < _FD_SETSIZE:
                select.select(live, [], [], timeout)
            else:
                time.sleep(min(timeout, _POLL_SLICE_S))
        except (OSError, ValueError):  # a pipe closed under us (service closing): stop waiting
            break
    out = []
    for _, job in jobs:
        if job is None:
            out.append(False)
            continue
        with job.lock:
            if not job.finished:
                job.abandoned = True
            out.append(job.finished)
    return out


def start_processes(settings: Any, *, db: str | None, registry_metrics: Any = None) -> list[ProcessProvider]:
    """One :class:`ProcessProvider` per spec of ``settings.providers``, started together, each ready.

    Raises:
        ConnectorConfigError: a provider cannot be built in its process, or two share a name (every
            started process is stopped first).
    """
    procs: list[ProcessProvider] = []
    try:
        for spec in settings.providers:
            procs.append(ProcessProvider(spec, settings, db=db, max_pending=settings.provider_queue_max))
        for proc in procs:
            proc.wait_ready()
        names = [p.name for p in procs]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ConnectorConfigError(f"two discovery providers are named {dup!r}")
    except BaseException:
        for proc in procs:
            proc.close(0.5)
        raise
    if registry_metrics is not None:
        for proc in procs:
            proc.count_exits(lambda name=proc.name: registry_metrics.provider_exits.labels(provider=name).inc())
    return procs

"""The consumer daemon: one asyncio process serving every source of one ledger database (DESIGN §4).

Tasks, supervised by one ``asyncio.TaskGroup`` (hypercorn ``asyncio/run.py``, STYLE §4):

* one :class:`~consumer.source.Source` task per engine endpoint (restarted with back-off if it
  crashes; ``/healthz`` reports it down meanwhile);
* ONE writer task for the database, fed by a bounded ``asyncio.Queue`` of decoded messages. It
  commits up to ``batch_max_events`` events, or what arrived within ``batch_max_delay_ms`` of the
  first waiting message, in one ledger transaction (:meth:`ledger.writer.LedgerWriter.append`),
  run on SQLite by a child process (``writer_process``, the default; :mod:`ledger.writer_process`)
  so that recording and receiving use two cores;
* the block index's follower (:class:`ledger.block_index.BlockIndexFollower`, every
  ``block_index_interval_s``; 0: none): off the writer's transactions, one window of the log per
  transaction of its own, never while batches wait for the writer, and then only while the log is
  quiet or the index is more than :data:`~ledger.block_index.MAX_LAG_SEQS` behind
  (``step_when_quiet``), pausing as long as each
  window took; it stops at shutdown after its current window. A watermark past the log's head
  stops it (``block_index.ahead``), not the daemon;
* the metrics/health HTTP server (``metrics_port``) and the shutdown watcher.

Back-pressure policy (memory stays bounded whatever the publishers do): when the queue holds
``queue_max_batches`` messages, a source awaits ``queue.put`` and stops reading its SUB socket
(counted: ``semkv_consumer_backpressure_total`` and ``…_seconds_total``). ZMQ then buffers up to the
SUB's receive HWM (``rcv_hwm``) and the publisher's send HWM; beyond those the PUB socket drops
messages. A dropped message is a seq gap at the consumer, recovered from the engine's replay buffer
when it still holds it, otherwise recorded by the ledger as a gap with a generation bump and
quarantine. Nothing unbounded is ever held by the daemon.

Database errors: a transient :class:`~ledger.errors.PersistenceError` (SQLite locked, connection
lost, the writer process died) leaves nothing recorded (a writer process that died after its
COMMIT is the exception: see :mod:`ledger.writer_process`), so the writer keeps the same items and retries with exponential
back-off (``db_retry_initial_s`` … ``db_retry_max_s``; ``semkv_consumer_db_retries_total``) while the
queue fills and back-pressure engages: nothing accepted is lost. A permanent one (a constraint
violation) stops the daemon with an error; the items were not recorded, so a restart replays them.
Opening the ledger at start is tried :data:`OPEN_ATTEMPTS` times on a transient error (a writer
process killed while it started), then the error stands (exit 2).

The SQLite ledger's files are watched (:class:`ledger.sqlite_writer.LedgerFiles`): once the file,
its ``-wal`` or ``-shm`` is deleted or replaced, or the file, its journal or its directory made
read-only, the next transaction raises :class:`~ledger.errors.LedgerUnwritable` before it is
reported done, and the daemon logs ``ledger.append_failed`` and stops (exit 1) without
acknowledging it: no retry, and no batch is singled out (none is at fault). A disk I/O error or a
full disk on files still in place stays transient (retried as above). PostgreSQL is not a file:
nothing to watch.

Shutdown (``shutdown_trigger`` awaitable; SIGINT/SIGTERM handlers only when it is None): sources stop
reading and return, the writer commits everything already received, then :meth:`Daemon.run`
returns (exit code 0). ``shutdown_timeout_s`` bounds the wait. A SIGKILL loses only what was not
committed, and the next start resumes from the ledger's position by replay (``consumer/source.py``).

Logs: structlog JSON lines (:func:`ledger.logs.configure_json_logging`), ``engine_id``/``source_id`` bound per source.

Security: with ``curve_secret_key`` every source is CURVE-secured (``consumer/curve.py``); key files
are read at start (a bad one is a :class:`~ledger.errors.ConfigurationError`, exit 2) and a ZAP
handler admits, per ``bind`` source, only that source's publisher keys. A ``bind`` source on a
non-loopback address without CURVE is logged as ``source.exposed_without_curve`` (warning) at
start, and a metrics server on a non-loopback ``metrics_host`` (plain HTTP, no authentication) as
``metrics.exposed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import structlog
import zmq.asyncio

from consumer.capture import CaptureWriter
from consumer.curve import CurveError, CurveKeys, ZapAuthorizer, exposure_warning, metrics_exposure_warning
from consumer.metrics import ConsumerMetrics, MetricsServer
from consumer.settings import ConsumerSettings, SourceSettings, unknown_env_settings
from consumer.source import Item, Source
from ledger.block_index import BlockIndexFollower, IndexAhead
from ledger.errors import (ConfigurationError, LedgerError, LedgerUnwritable, PersistenceError, SchemaOutOfDate,
                           database_error_line, is_transient, one_line, url_for_humans)
from ledger.decide import AppendResult, Loss
from ledger.events import DeadLetter, GapReport, ReceivedBatch
from ledger.logs import configure_json_logging
from ledger.migrate import refuse_missing_ledger_file
from ledger.types import DeadLetterReason
from ledger.writer import LedgerWriter, SourcePosition

__all__ = ["Daemon", "DaemonStats", "ShutdownTrigger", "serve"]

ShutdownTrigger = Awaitable[Any] | Callable[[], Awaitable[Any]]
_STOP = object()  # queue sentinel: every source has returned
_SUPERVISE_BACKOFF_S = (0.5, 30.0)
_HEALTH_DB_TIMEOUT_S = 2.0
GAPS_LOGGED = 8
"""``[expected, got]`` pairs one ``ledger.continuity_lost`` line lists (the count says how many)."""
OPEN_ATTEMPTS = 3
"""Tries to open the ledger writer at start when the error is transient (ledger.errors.is_transient)."""


@dataclasses.dataclass
class DaemonStats(AppendResult):
    """Counters of one :meth:`Daemon.run` (also in ``repr``, arq style): every transaction's
    :class:`~ledger.decide.AppendResult` summed (events unless named), plus the daemon's own
    counters below. What holds for one transaction only (``losses``, logged as they happen) is not
    kept."""

    transactions: int = 0
    db_retries: int = 0
    clean_exit: bool = False

    def add(self, result: AppendResult) -> None:
        """Count one transaction and what it did."""
        self.transactions += 1
        self.merge(dataclasses.replace(result, losses=[]))  # losses kept would grow all run long

    def counters(self) -> dict[str, int | bool]:
        """Every counter by name, flat (the ``daemon.stopped`` log line)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("first_seq", "last_seq", "max_event_ts", "losses")}


class Daemon:
    """Consume every configured source into the ledger until shut down.

    Args:
        settings: the frozen settings (:func:`consumer.settings.load_settings`).
        shutdown_trigger: awaitable (or callable returning one) that ends the daemon when it
            completes; None installs SIGINT/SIGTERM handlers instead.
        stop_after_batches: for tests/benchmarks: stop once the ledger recorded this many new
            batches in this run.
        exit_when_idle_s: "burst" mode: stop once no message arrived for this long and the
            queue is empty.
    """

    def __init__(self, settings: ConsumerSettings, *, shutdown_trigger: ShutdownTrigger | None = None,
                 stop_after_batches: int | None = None, exit_when_idle_s: float | None = None) -> None:
        self.settings = settings
        self.metrics = ConsumerMetrics()
        for engine_id in dict.fromkeys(cfg.engine_id for cfg in settings.sources):
            self.metrics.track_engine(engine_id)
        self.stats = DaemonStats()
        self.sources: list[Source] = []
        self.metrics_port: int | None = None
        self._trigger, self._stop_after, self._idle_exit_s = shutdown_trigger, stop_after_batches, exit_when_idle_s
        self._queue: asyncio.Queue[Item | object] = asyncio.Queue(settings.queue_max_batches)
        self._stopping = asyncio.Event()  # sources stop reading
        self._wake = asyncio.Event()  # something was queued
        self._writer: LedgerWriter | None = None
        self._writer_task: asyncio.Task[None] | None = None
        self._db_error: str | None = None
        self._last_put = time.monotonic()
        self.ready = asyncio.Event()  # sockets open, server listening
        self.log = structlog.get_logger("consumer.daemon")

    def __repr__(self) -> str:
        return f"<Daemon db={url_for_humans(self.settings.db)} sources={len(self.settings.sources)} {self.stats}>"

    # -- run ----------------------------------------------------------------------------------

    async def run(self) -> DaemonStats:
        """Run until shut down; returns the stats (``clean_exit`` False if the shutdown timed out).

        Raises:
            SchemaOutOfDate: the database is not migrated (run ``semkv-ledger migrate``).
            PersistenceError: the database cannot be opened, or refused a transaction permanently.
            ConfigurationError: a configured source is bound to another engine in the ledger.
            zmq.ZMQError: an endpoint cannot be bound or connected.
        """
        curve = self._load_curve()
        self._writer = await self._open_writer()
        ctx = zmq.asyncio.Context()
        records: list[CaptureWriter] = []
        server: MetricsServer | None = None
        zap: ZapAuthorizer | None = None
        try:
            if any(cfg.bind for cfg in self.settings.sources if cfg.source_id in curve):
                zap = ZapAuthorizer(ctx)  # before any CURVE server socket exists
                for cfg in self.settings.sources:
                    if cfg.bind:
                        zap.authorize(cfg.source_id, curve[cfg.source_id].peers)
            positions = await self._writer.source_positions()
            self.sources = [self._make_source(cfg, ctx, positions, records, i, curve.get(cfg.source_id))
                            for i, cfg in enumerate(self.settings.sources)]
            server = await self._start_server()
            with self._signal_handlers():
                try:
                    await self._supervise_all()
                except ExceptionGroup as group:  # re-raise the first failure as itself (documented types)
                    for exc in group.exceptions[1:]:
                        self.log.error("daemon.task_failed", error=repr(exc))
                    raise _leaf(group) from group
        finally:
            if server is not None:
                await server.close()
            for record in records:
                record.close()
            if zap is not None:
                zap.stop()
            ctx.destroy(linger=0)
            await self._writer.close()
        self.log.info("daemon.stopped", **self.stats.counters())
        return self.stats

    def _load_curve(self) -> dict[str, CurveKeys]:
        """Each source's CURVE keys (none without ``curve_secret_key``); warns about exposed binds.

        Raises:
            ConfigurationError: a key file is missing or unusable, or a connecting source (or a
                replay endpoint) has not exactly one publisher key to pin.
        """
        keys: dict[str, CurveKeys] = {}
        secret_file = self.settings.curve_secret_key
        for cfg in self.settings.sources:
            if secret_file is None or cfg.curve_publisher_key is None:
                warning = exposure_warning(cfg.endpoint if cfg.bind else None, curve=False,
                                           what=f"source {cfg.source_id!r} (SUB --bind)")
                if warning:
                    self.log.warning("source.exposed_without_curve", engine_id=cfg.engine_id,
                                     source_id=cfg.source_id, endpoint=cfg.endpoint, message=warning)
                continue
            try:
                source_keys = CurveKeys.from_files(secret_file, cfg.curve_publisher_key)
                if not cfg.bind or cfg.replay_endpoint is not None:
                    source_keys.server_key()  # a client pins exactly one engine key
            except CurveError as exc:
                raise ConfigurationError(f"source {cfg.source_id!r}: {exc}") from exc
            keys[cfg.source_id] = source_keys
        if keys:
            self.log.info("daemon.curve_on", sources=len(keys))
        return keys

    def _make_source(self, cfg: SourceSettings, ctx: zmq.asyncio.Context, positions: dict[str, SourcePosition],
                     records: list[CaptureWriter], index: int, curve: CurveKeys | None = None) -> Source:
        position = positions.get(cfg.source_id)
        if position is not None and position.engine_id != cfg.engine_id:
            raise ConfigurationError(f"source {cfg.source_id!r} belongs to engine {position.engine_id!r} in the "
                                     f"ledger, not {cfg.engine_id!r}: give it another source_id")
        record = None
        if self.settings.record is not None:
            record = CaptureWriter(_record_path(self.settings.record, cfg, index, len(self.settings.sources)),
                                   append=True)
            records.append(record)

        async def submit(item: Item) -> None:
            await self._put(cfg.engine_id, item)

        return Source(cfg, self.settings, ctx, submit, self.metrics, position, record, curve)

    async def _start_server(self) -> MetricsServer | None:
        if self.settings.metrics_port is None:
            return None
        host = self.settings.metrics_host
        server = MetricsServer(self.metrics, self.health, host, self.settings.metrics_port)
        await server.start()
        self.metrics_port = server.port
        warning = metrics_exposure_warning(host, server.port)
        if warning:
            self.log.warning("metrics.exposed", host=host, port=server.port, message=warning)
        return server

    async def _supervise_all(self) -> None:
        self.metrics.queue_capacity.set(self.settings.queue_max_batches)
        self.metrics.queue_depth.set_function(self._queue.qsize)
        async with asyncio.TaskGroup() as group:
            self._writer_task = group.create_task(self._write_loop(), name="semkv-writer")
            tasks = [group.create_task(self._supervise(s), name=f"semkv-source-{s.source_id}")
                     for s in self.sources]
            group.create_task(self._shutdown_when_asked(tasks), name="semkv-shutdown")
            if self.settings.block_index_interval_s > 0:
                group.create_task(self._follow_block_index(self.settings.block_index_interval_s),
                                  name="semkv-block-index")
            self.log.info("daemon.started", db=url_for_humans(self.settings.db), sources=len(tasks),
                          metrics_port=self.metrics_port, writer=self._writer.mode if self._writer else None)
            self.ready.set()

    async def _supervise(self, source: Source) -> None:
        """Run a source until shutdown; a crash is logged, counted and restarted with back-off."""
        delay = _SUPERVISE_BACKOFF_S[0]
        while not self._stopping.is_set():
            try:
                await source.run(self._stopping)
                return
            except (zmq.ZMQError, OSError, ValueError) as exc:  # boundary: one source must not stop the others
                source.log.error("source.crashed", error=repr(exc), restart_in_s=delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)
            delay = min(delay * 2, _SUPERVISE_BACKOFF_S[1])

    async def _follow_block_index(self, interval_s: float) -> None:
        """Keep the block index behind the log until shutdown (module docstring). Database errors
        are logged and retried after ``interval_s``: the index is derived data, and ``inspect``
        answers without it."""
        follower = await asyncio.to_thread(BlockIndexFollower, self.settings.db)
        log = self.log.bind(task="block_index")
        try:
            while not self._stopping.is_set():
                try:
                    while not self._stopping.is_set():
                        if self._queue.qsize():
                            break  # batches wait for the writer: ingest first, the index waits (its lag is searched)
                        started = time.perf_counter()
                        if not await asyncio.to_thread(follower.step_when_quiet):
                            break
                        await asyncio.sleep(time.perf_counter() - started)  # low priority: half the time at most
                except IndexAhead as exc:
                    log.error("block_index.ahead", error=str(exc))
                    return
                except PersistenceError as exc:
                    log.warning("block_index.step_failed", error=str(exc), retry_in_s=interval_s)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), interval_s)
        finally:
            await asyncio.to_thread(follower.close)

    # -- shutdown -----------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Begin a graceful shutdown (what the trigger and the signals do)."""
        if not self._stopping.is_set():
            self.log.info("daemon.stopping")
            self._stopping.set()

    async def _shutdown_when_asked(self, source_tasks: list[asyncio.Task[None]]) -> None:
        waiters = [asyncio.ensure_future(self._stopping.wait())]
        if self._trigger is not None:
            trigger = self._trigger() if callable(self._trigger) else self._trigger
            waiters.append(asyncio.ensure_future(trigger))
        if self._idle_exit_s is not None:
            waiters.append(asyncio.ensure_future(self._idle_watch(self._idle_exit_s)))
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
        self.request_stop()
        deadline = time.monotonic() + self.settings.shutdown_timeout_s
        if source_tasks:  # asyncio.wait refuses an empty set (a daemon built with no source)
            await asyncio.wait(source_tasks, timeout=self.settings.shutdown_timeout_s)
        assert self._writer_task is not None
        try:
            await asyncio.wait_for(self._queue.put(_STOP), max(0.0, deadline - time.monotonic()))
            self._wake.set()
            await asyncio.wait_for(asyncio.shield(self._writer_task), max(0.0, deadline - time.monotonic()))
            self.stats.clean_exit = True
        except TimeoutError:
            self.log.error("daemon.shutdown_timeout", queued=self._queue.qsize(), db_error=self._db_error)
            self._writer_task.cancel()
            for task in source_tasks:
                task.cancel()

    async def _idle_watch(self, idle_s: float) -> None:
        while True:
            await asyncio.sleep(min(idle_s / 4, 0.25))
            quiet_since = max(self._last_put, *(s.last_activity for s in self.sources)) if self.sources else 0
            if time.monotonic() - quiet_since >= idle_s and self._queue.empty():
                self.log.info("daemon.idle_exit", idle_s=idle_s)
                return

    @contextlib.contextmanager
    def _signal_handlers(self):  # noqa: ANN202
        if self._trigger is not None:
            yield
            return
        loop = asyncio.get_running_loop()
        installed = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
                loop.add_signal_handler(sig, self.request_stop)
                installed.append(sig)
        try:
            yield
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)

    # -- queue and writer ---------------------------------------------------------------------

    async def _put(self, engine_id: str, item: Item) -> None:
        if self._queue.full():
            self.metrics.backpressure.labels(engine_id=engine_id).inc()
            started = time.monotonic()
            await self._queue.put(item)
            self.metrics.backpressure_seconds.labels(engine_id=engine_id).inc(time.monotonic() - started)
        else:
            self._queue.put_nowait(item)
        self._last_put = time.monotonic()
        self._wake.set()

    async def _write_loop(self) -> None:
        while True:
            items, stop = await self._collect()
            if items:
                await self._commit(items)
            if stop:
                return

    async def _collect(self) -> tuple[list[Item], bool]:
        """Wait for one message, then gather up to batch_max_events events or batch_max_delay_ms."""
        first = await self._queue.get()
        if first is _STOP:
            return [], True
        items: list[Item] = [first]  # type: ignore[list-item]
        weight = _weight(first)
        limit = self.settings.batch_max_events
        deadline = time.monotonic() + self.settings.batch_max_delay_ms / 1000
        while weight < limit:
            while weight < limit and not self._queue.empty():
                item = self._queue.get_nowait()
                if item is _STOP:
                    return items, True
                items.append(item)  # type: ignore[arg-type]
                weight += _weight(item)
            remaining = deadline - time.monotonic()
            if weight >= limit or remaining <= 0 or self._stopping.is_set():
                break
            self._wake.clear()
            if self._queue.empty():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), remaining)
        return items, False

    async def _open_writer(self) -> LedgerWriter:
        """:meth:`LedgerWriter.open`, retried on a transient error up to :data:`OPEN_ATTEMPTS` times
        with the transactions' back-off: a writer process killed while it started (an OOM kill), a
        database locked for longer than its busy timeout. Past that, or on a permanent error, the
        error stands (exit 2: a restart would likely meet the same condition).

        Raises:
            SchemaOutOfDate: not migrated, or (SQLite) no file at the path: it is refused before
                anything opens it, since SQLite would create an empty file that stays behind.
            PersistenceError: the database cannot be opened.
        """
        refuse_missing_ledger_file(self.settings.db)
        delay = self.settings.db_retry_initial_s
        for attempt in range(1, OPEN_ATTEMPTS + 1):
            try:
                return await LedgerWriter.open(self.settings.db, process=self.settings.writer_process)
            except PersistenceError as exc:
                if not is_transient(exc) or attempt == OPEN_ATTEMPTS:
                    raise
                self.stats.db_retries += 1
                self.metrics.db_retries.inc()
                self.log.warning("ledger.open_retry", error=str(exc), attempt=attempt, retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.settings.db_retry_max_s)
        raise AssertionError("unreachable")  # the loop returns or raises

    async def _commit(self, items: list[Item]) -> None:
        """One ledger transaction for ``items`` (transient database errors are retried forever); a
        permanent refusal is narrowed down to the batch it belongs to (:meth:`_isolate`)."""
        started = time.perf_counter()
        try:
            result = await self._append(items)
        except LedgerUnwritable as exc:  # the whole ledger, not these items: nothing to isolate
            self.log.error("ledger.append_failed", error=str(exc), items=len(items))
            raise
        except PersistenceError as exc:
            result = await self._isolate(items, exc)
        self._observe(items, result, time.perf_counter() - started)
        if self._stop_after is not None and self.stats.batches >= self._stop_after:
            self.request_stop()

    async def _append(self, items: list[Item]) -> AppendResult:
        """:meth:`LedgerWriter.append`, retried with back-off while the error is transient.

        Raises:
            PersistenceError: a permanent refusal (nothing of ``items`` was recorded).
        """
        assert self._writer is not None
        delay = self.settings.db_retry_initial_s
        while True:
            try:
                result = await self._writer.append(items)
                self._db_error = None
                return result
            except PersistenceError as exc:
                if not is_transient(exc):
                    raise
                self._db_error = str(exc)
                self.stats.db_retries += 1
                self.metrics.db_retries.inc()
                self.log.warning("ledger.append_retry", error=str(exc), retry_in_s=delay, items=len(items))
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.settings.db_retry_max_s)

    async def _isolate(self, items: list[Item], refusal: PersistenceError) -> AppendResult:
        """The ledger refused ``items`` for good: commit them one by one, so that one bad batch
        cannot take its neighbours with it nor, refused again at every restart (the engine's
        replay buffer hands it back), crash-loop the daemon. A batch the ledger refuses alone is
        logged as its events' dead letters (``refused_by_ledger``, raw bytes kept: nothing
        accepted is lost). Decoding bounds every stored value (consumer/wire.py), so this is the
        net under a gap in those bounds, and the error is logged as such.

        Raises:
            PersistenceError: a gap report or frame-level dead letter refused alone, or a batch
                whose dead letters are refused too (the database refuses everything: the error
                stands and the daemon stops).
        """
        self.log.error("ledger.append_refused", error=str(refusal), items=len(items))
        total = AppendResult()
        for item in items:
            try:
                if len(items) == 1:  # already refused alone
                    raise refusal
                total.merge(await self._append([item]))
            except LedgerUnwritable as exc:  # the file went meanwhile: the whole ledger, not this item
                self.log.error("ledger.append_failed", error=str(exc), items=1)
                raise
            except PersistenceError as exc:
                if not isinstance(item, ReceivedBatch):
                    self.log.error("ledger.append_failed", error=str(exc), items=1)
                    raise
                self.log.error("ledger.batch_refused", engine_id=item.engine_id, source_id=item.source_id,
                               seq=item.seq, events=len(item.events), error=str(exc))
                total.merge(await self._append([refused_by_ledger(item, exc)]))
        return total

    def _observe(self, items: list[Item], result: AppendResult, elapsed_s: float) -> None:
        m = self.metrics
        self.stats.add(result)
        m.transactions.inc()
        m.commit_seconds.observe(elapsed_s)
        if result.log_lock_wait_s is not None:
            m.log_lock_wait_seconds.observe(result.log_lock_wait_s)
        m.batches_committed.inc(result.batches)
        m.events_applied.inc(result.events_applied)
        m.events_duplicate.inc(result.events_duplicate)
        m.events_stale.inc(result.events_stale)
        m.dead_letters_committed.inc(result.dead_letters)
        now, newest = time.time(), {}
        for item in items:
            if isinstance(item, ReceivedBatch) and item.ts > 0:
                m.lag_seconds.observe(max(0.0, now - item.ts))
                newest[item.engine_id] = max(newest.get(item.engine_id, 0.0), item.ts)
            elif isinstance(item, GapReport):
                self.log.warning("ledger.gap_reported", engine_id=item.engine_id, source_id=item.source_id,
                                 reason=str(item.reason), from_seq=item.from_seq, to_seq=item.to_seq)
        for engine_id, ts in newest.items():
            m.lag_last_seconds.labels(engine_id=engine_id).set(max(0.0, now - ts))
        if result.losses:  # rare: nothing more to do on the ingest path without a loss
            self._continuity_lost(result.losses)

    def _continuity_lost(self, losses: list[Loss]) -> None:
        """Count the losses by engine and reason, and log one ``ledger.continuity_lost`` line per
        engine, source and reason: which engine lost what, why, and the generation it went to."""
        groups: dict[tuple[str, str | None, str], list[Loss]] = {}
        for loss in losses:
            groups.setdefault((loss.engine_id, loss.source_id, str(loss.reason)), []).append(loss)
        for (engine_id, source_id, reason), group in groups.items():
            gaps = [loss for loss in group if loss.kind == "gap"]
            bumps = [loss for loss in group if loss.kind == "bump"]
            if gaps:
                self.metrics.gaps_recorded.labels(engine_id=engine_id, reason=reason).inc(len(gaps))
            if bumps:
                self.metrics.generation_bumps.labels(engine_id=engine_id, reason=reason).inc(len(bumps))
            self.log.warning("ledger.continuity_lost", engine_id=engine_id, source_id=source_id, reason=reason,
                             gaps=len(gaps), generation_bumps=len(bumps),
                             generation=bumps[-1].generation if bumps else None,
                             expected_got=[[loss.expected, loss.got] for loss in gaps[:GAPS_LOGGED]])

    # -- health -------------------------------------------------------------------------------

    async def health(self) -> tuple[bool, dict[str, Any]]:
        """DB reachable (a read within 2 s, no failing transaction) and every source task alive."""
        db: dict[str, Any] = {"ok": True}
        if self._db_error is not None:
            db = {"ok": False, "error": self._db_error}
        elif self._writer is not None:
            try:
                await asyncio.wait_for(self._writer.source_positions(), _HEALTH_DB_TIMEOUT_S)
            except (LedgerError, OSError, TimeoutError) as exc:
                db = {"ok": False, "error": repr(exc)}
        writer_alive = self._writer_task is not None and not self._writer_task.done()
        sources = {s.source_id: s.status() for s in self.sources}
        healthy = db["ok"] and writer_alive and all(s.alive for s in self.sources)
        return healthy, {"db": db, "writer_alive": writer_alive, "queue_depth": self._queue.qsize(),
                         "sources": sources}


def refused_by_ledger(batch: ReceivedBatch, error: PersistenceError) -> ReceivedBatch:
    """``batch`` with every event turned into a dead letter ``refused_by_ledger`` (each keeps its
    raw bytes and payload position; the batch's own dead letters stay), so the batch's seq is still
    consumed and the log holds everything it carried."""
    detail = f"the ledger refused this event's batch: {error}"
    letters = [DeadLetter(batch.source_id, batch.engine_id, DeadLetterReason.REFUSED_BY_LEDGER, detail, event.raw,
                          batch.seq, index if event.batch_index is None else event.batch_index, batch.received_at)
               for index, event in enumerate(batch.events)]
    return msgspec.structs.replace(batch, events=[], dead_letters=[*batch.dead_letters, *letters])


def _leaf(group: BaseExceptionGroup) -> BaseException:
    first = group.exceptions[0]
    return _leaf(first) if isinstance(first, BaseExceptionGroup) else first


def _weight(item: object) -> int:
    if isinstance(item, ReceivedBatch):
        return max(1, len(item.events) + len(item.dead_letters))
    return 1


def _record_path(path: Path, cfg: SourceSettings, index: int, count: int) -> Path:
    """One capture per source: ``path`` itself for one source, ``stem.<i>-<engine_id>.suffix`` otherwise."""
    if count == 1:
        return path
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in cfg.engine_id)
    return path.with_name(f"{path.stem}.{index}-{safe}{path.suffix}")


def serve(settings: ConsumerSettings, *, migrate: bool = False, exit_when_idle_s: float | None = None) -> int:
    """Blocking entry point of ``semkv-ledger consume``: logging, optional migration, the daemon.

    Returns the exit code: 0 clean shutdown; 1 the shutdown timed out or the ledger refused a
    transaction permanently (a SQLite ledger deleted, replaced or made read-only while running
    included); 2 database not migrated / unreachable / not writable at start, bad configuration
    or endpoint.
    """
    from ledger.migrate import upgrade

    configure_json_logging(settings.log_level)
    log = structlog.get_logger("consumer.daemon")
    if typos := unknown_env_settings():
        log.warning("settings.unknown_env", variables=typos,
                    detail="these SEMKV_* variables name no consume setting and are ignored")
    daemon = Daemon(settings, exit_when_idle_s=exit_when_idle_s)
    try:
        if migrate:
            before, after = upgrade(settings.db)
            log.info("ledger.migrated", db=url_for_humans(settings.db), before=before, after=after)
        stats = asyncio.run(daemon.run())
    except SchemaOutOfDate as exc:
        print(f"error: {exc}" + ("" if exc.unknown else " (or start with --migrate)"), file=sys.stderr)
        return 2
    except (ConfigurationError, zmq.ZMQError) as exc:
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except PersistenceError as exc:
        if daemon.ready.is_set() or isinstance(exc, LedgerUnwritable):  # while running, or a read-only file
            log.error("daemon.database_error", error=str(exc))
            print(f"error: ledger database: {one_line(str(exc))}", file=sys.stderr)
            return 1 if daemon.ready.is_set() else 2
        # start-up: unreachable, refused, not a database: one line, no log line (nothing ran yet)
        print(f"error: {database_error_line(exc, settings.db, setting='db')}", file=sys.stderr)
        return 2
    except LedgerError as exc:  # e.g. a SQLite path in a missing directory, an unsupported URL
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    return 0 if stats.clean_exit else 1

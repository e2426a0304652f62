"""The ledger's own commands: ``migrate``, ``replay``, ``snapshot``, ``stats``, ``inspect``.

Errors a user can cause (bad URL, unreachable database, schema not migrated, a ledger that cannot
be written given to ``migrate``) print one line and exit 2; a replay that disagrees with the live
projections exits 1, and so does an ``inspect`` that finds no log row for its item.

``stats``, ``inspect`` and ``replay`` only read: a SQLite ledger they cannot write (a read-only
mount, a snapshot, another user's file) is opened read-only (:func:`ledger.db.audit_engine`) and
one ``note:`` line on stderr says so. ``migrate`` and ``replay`` draw a progress bar on stderr when
stderr is a terminal (not with ``--json``): ``replay`` while it rebuilds, ``migrate`` for each step a
revision reports (:func:`ledger.migrate.migration_progress`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import sys
from collections.abc import Callable, Iterator
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TimeElapsedColumn
from rich.table import Table
from sqlalchemy import Connection
from sqlalchemy.exc import SQLAlchemyError

from ledger.backends.base import ReadOnlyOpen
from ledger.cli import HelpCommand, app
from ledger.db import DEFAULT_DB, write_refusal
from ledger.errors import (LedgerError, PersistenceError, database_error_line, is_database_error, is_transient,
                           one_line, url_for_humans)
from ledger.views import count, exit_for_broken_pipe, id_column, output_console, stdout_reader_gone

DbOption = Annotated[str, typer.Option("--db", envvar="SEMKV_DB", help="Ledger database: a SQLite file path, "
                                       "sqlite:///PATH or postgresql://USER@HOST:PORT/DB.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]
console = output_console()
err_console = Console(stderr=True)


INTERRUPTED_STATUS = 130
"""The exit status after Ctrl-C: the shell's for a process ended by SIGINT (128 + 2)."""

_INTERRUPTED = {
    "migrate": " (the upgrade runs in one transaction: the ledger is at the revision it had)",
    "replay": " (an --out file it created is removed)",
    "snapshot": " (a snapshot is stored in one transaction: none was added)",
    "index": " (each window is committed with its watermark: the next run resumes there)",
}
"""What an interrupted command left, where it matters."""


def user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn ledger, database, file and value errors into one line on stderr and exit code 2; a
    database error names ``--db`` and the driver's reason (:func:`ledger.errors.database_error_line`).
    Ctrl-C prints one ``interrupted:`` line and exits :data:`INTERRUPTED_STATUS`."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            try:
                return fn(*args, **kwargs)
            finally:
                sys.stdout.flush()  # a reader gone away is found here, not by the flush at exit
                if stdout_reader_gone():  # ... or here, when a blocked write came back short
                    raise BrokenPipeError
        except BrokenPipeError:  # the reader of stdout went away (`| head`): quietly, no ledger error
            exit_for_broken_pipe()
        except KeyboardInterrupt:  # Ctrl-C: typer would exit 130 without a word
            err_console.print(f"interrupted: {fn.__name__} did not finish{_INTERRUPTED.get(fn.__name__, '')}",
                              highlight=False, soft_wrap=True)
            raise typer.Exit(INTERRUPTED_STATUS) from None
        except (LedgerError, SQLAlchemyError, OSError, ValueError) as exc:
            db = kwargs.get("db")
            message = database_error_line(exc, db) if db and is_database_error(exc) else one_line(str(exc))
            err_console.print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper


@app.command(cls=HelpCommand)
@user_errors
def migrate(db: DbOption = DEFAULT_DB) -> None:
    """Create or upgrade the ledger schema to the newest revision (SQLite or PostgreSQL).

    A missing SQLite file is created (mode 0600) in an EXISTING directory; a missing directory is an
    error (exit 2), never created: a mistyped path must not start a second ledger elsewhere.

    A long step (0003 rebuilds every projection from the log) shows a progress bar on stderr when
    stderr is a terminal. A SQLite ledger this user cannot write (a read-only mount) is refused.

    Exit codes: 0 the schema is at the newest revision (upgraded or already there); 2 usage or database
    error, a missing directory, a ledger that cannot be written, or a ledger a newer semkv-ledger
    migrated (one ``error:`` line).
    """
    from ledger.migrate import upgrade

    with _progress_bar(enabled=sys.stderr.isatty()) as bar:
        before, after = upgrade(db, progress=None if bar is None else functools.partial(_migration_step, bar))
    verb = "already at" if before == after else f"upgraded {before or 'empty database'} →"
    console.print(f"ledger {url_for_humans(db)}: {verb} {after}", highlight=False)


@app.command(cls=HelpCommand)
@user_errors
def replay(
    db: DbOption = DEFAULT_DB,
    until: Annotated[int | None, typer.Option(help="Stop after this log seq (time travel; from the newest "
                                              "snapshot at or before it, if any); no diff then, unless SEQ is "
                                              "at or past the log's head (the whole audit).", min=0,
                                              max=2**63 - 1)] = None,
    out: Annotated[str | None, typer.Option(help="Keep the rebuilt projections (tables only, no log) in this SQLite file, for sqlite3.")] = None,
    json_out: JsonOption = False,
) -> None:
    """Rebuild every projection from the log in a scratch database and diff it against the live one.

    The ledger is only read: one it cannot write (a read-only mount, a snapshot) is opened read-only,
    with a note on stderr. A progress bar on stderr while it rebuilds, when stderr is a terminal and
    not with --json.

    Exit 0 when equal, 1 when not, 2 on usage or database errors. With --until before the log's head
    nothing is compared (exit 0; in --json "compared" is false and "equal" null); at or past the
    head it is the whole audit. On PostgreSQL the log and the projections are read in one snapshot
    (REPEATABLE READ), so consumers may keep writing.
    """
    from ledger.replay import replay as run_replay

    with _progress_bar(enabled=not json_out and sys.stderr.isatty()) as bar:
        progress = None if bar is None else _mover(bar, bar.add_task("replaying log", total=None))
        report = run_replay(db, until=until, scratch=out, progress=progress, on_read_only=_note_read_only)
    if json_out:
        print(json.dumps(_report_json(report), default=str))
    else:
        _print_report(report)
    if report.compared and not report.equal:
        raise typer.Exit(1)


@app.command(cls=HelpCommand)
@user_errors
def snapshot(db: DbOption = DEFAULT_DB, json_out: JsonOption = False) -> None:
    """Take a projection snapshot at the head of the log (the fold of the log, from the newest snapshot).

    ``replay --until SEQ`` then starts from the newest snapshot at or before SEQ and folds only the
    log after it. Snapshots are made by folding the log, never copied from the live projections,
    and the audit (``replay`` without --until) never uses them. A progress bar on stderr while it
    folds, when stderr is a terminal and not with --json.

    Exit codes: 0 taken (or the newest one is already at the head); 2 usage or database error.
    """
    from ledger.replay import snapshot_at_head

    refusal = write_refusal(db)
    if refusal is not None:  # say so up front, not as the driver's "unable to open database file"
        raise LedgerError(f"cannot take a snapshot of the ledger {url_for_humans(db)}: it cannot be written here "
                          f"({refusal}); `replay --until SEQ` reads it read-only (folding from the start)")
    with _progress_bar(enabled=not json_out and sys.stderr.isatty()) as bar:
        progress = None if bar is None else _mover(bar, bar.add_task("folding the log", total=None))
        taken = snapshot_at_head(db, progress)
    if json_out:
        print(json.dumps(dataclasses.asdict(taken)))
        return
    since = f"the snapshot at seq {taken.started_from}" if taken.started_from else "the start of the log"
    console.print(f"snapshot at seq {taken.seq}: folded {count(taken.folded)} log rows from {since} in "
                  f"{taken.seconds:.1f} s, {count(taken.size_bytes)} bytes" if taken.folded else
                  f"snapshot at seq {taken.seq}: already there (nothing logged since)", highlight=False)


@contextlib.contextmanager
def _progress_bar(*, enabled: bool) -> Iterator[Progress | None]:
    """A progress display on stderr, erased when done (None when not ``enabled``: off a terminal,
    in --json mode)."""
    if not enabled:
        yield None
        return
    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err_console, transient=True) as bar:
        yield bar


def _mover(bar: Progress, task: TaskID) -> Callable[..., None]:
    """``progress(done, total=None)`` moving ``task`` of ``bar``."""

    def progress(done: int, total: int | None = None) -> None:
        bar.update(task, completed=done, total=total)  # rich leaves a None total as it was

    return progress


@contextlib.contextmanager
def _migration_step(bar: Progress, description: str, total: int | None) -> Iterator[Callable[..., None]]:
    """One step of a migration (:data:`ledger.migrate.MigrationListener`) as a line of ``bar``,
    drawn once more as it ended, then removed: the line shows what runs now."""
    task = bar.add_task(description, total=total)
    try:
        yield _mover(bar, task)
    finally:
        bar.refresh()  # rich redraws 10 times a second: a step's last position would go unseen
        bar.remove_task(task)


def _note_read_only(read_only: ReadOnlyOpen) -> None:
    err_console.print(f"note: {read_only.describe()}", highlight=False, soft_wrap=True)


def _report_json(report) -> dict[str, Any]:
    return {
        "equal": report.equal if report.compared else None, "compared": report.compared, "events": report.events, "last_seq": report.last_seq,
        "rebuild_seconds": report.rebuild_seconds, "events_per_second": report.events_per_second,
        "row_counts": report.row_counts, "scratch_path": report.scratch_path, "started_from": report.started_from,
        "diffs": [{"table": d.table, "only_in_live": d.totals[0], "only_in_replay": d.totals[1], "changed": d.totals[2],
                   "samples": {"only_in_live": d.only_in_live, "only_in_replay": d.only_in_replay,
                               "changed": [{"live": a, "replay": b} for a, b in d.changed]}}
                  for d in report.diffs if d.count],
    }


def _print_report(report) -> None:
    start = f", from the snapshot at seq {report.started_from}" if report.started_from else ""
    table = Table(title=f"replay of {count(report.events)} log rows (through seq {report.last_seq}{start})")
    for column in ("projection", "rows rebuilt", "only in live", "only in replay", "changed"):
        table.add_column(column, justify="right" if column != "projection" else "left")
    diffs = {d.table: d for d in report.diffs}
    for name, rows in report.row_counts.items():
        d = diffs.get(name)
        totals = d.totals if d else ("-", "-", "-")
        table.add_row(name, count(rows), *(t if isinstance(t, str) else count(t) for t in totals))
    console.print(table)
    console.print(f"rebuild: {report.rebuild_seconds:.3f} s, {report.events_per_second:,.0f} events/s", highlight=False)
    for d in report.diffs:
        for row in d.only_in_live[:3]:
            console.print(f"[red]- {d.table} only in live:[/red] {row}", highlight=False)
        for row in d.only_in_replay[:3]:
            console.print(f"[red]+ {d.table} only in replay:[/red] {row}", highlight=False)
        for live, rebuilt in d.changed[:3]:
            changed = {k: (live[k], rebuilt[k]) for k in live if live[k] != rebuilt.get(k)}
            console.print(f"[red]~ {d.table} changed (live, replay):[/red] {changed}", highlight=False)
    if not report.compared:
        console.print("stopped before the head of the log: projections not compared", highlight=False)
    elif report.equal:
        console.print("[green]projections equal the replay of the log[/green]")
    else:
        console.print("[red]projections DIFFER from the replay of the log[/red]")


@contextlib.contextmanager
def _reading(db: str) -> Iterator[Connection]:
    """A connection to the ledger at the schema head, for a command that only reads it: opened
    read-only, with a note, when it cannot be written (:func:`ledger.db.audit_engine`)."""
    from ledger.db import audit_engine
    from ledger.migrate import check_schema

    with audit_engine(db) as (engine, read_only), engine.connect() as conn:
        if read_only is not None:
            _note_read_only(read_only)
        check_schema(conn, db, cannot_write=read_only.reason if read_only is not None else None)
        yield conn


@app.command(cls=HelpCommand)
@user_errors
def stats(db: DbOption = DEFAULT_DB, json_out: JsonOption = False) -> None:
    """What the ledger knows: events per engine and type, generations, blocks, donors, dead letters.

    The ledger is only read: one it cannot write (a read-only mount, a snapshot) is opened read-only,
    with a note on stderr.

    Exit codes: 0 printed (an empty ledger too); 2 usage or database error (one ``error:`` line naming --db).
    """
    from ledger.stats import ledger_stats
    from ledger.views import print_stats

    with _reading(db) as conn:
        data = ledger_stats(conn)
    if json_out:
        print(json.dumps(data, default=str))
    else:
        print_stats(console, data)


@app.command(cls=HelpCommand, context_settings={"ignore_unknown_options": True})  # a signed block hash (-667…) is an argument
@user_errors
def inspect(
    kind: Annotated[str, typer.Argument(help="engine, donor or block")],
    ident: Annotated[str, typer.Argument(help="engine id, donor id, or block hash (decimal, 0x…, or 64 hex chars)")],
    db: DbOption = DEFAULT_DB,
    limit: Annotated[int, typer.Option(help="At most this many log rows (newest).", min=1, max=1_000_000)] = 200,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object: kind, id, truncated (older rows "
                                           "than --limit exist) and every log row shown with its full decoded "
                                           "body (block hashes as decimal integers, "
                                           "wide ones as 64 hex chars).")] = False,
) -> None:
    """Show one item's history from the log.

    The ledger is only read: one it cannot write (a read-only mount, a snapshot) is opened read-only,
    with a note on stderr. A block's history comes from the block index up to its watermark and a
    search of the log rows after it (``semkv-ledger index`` and the consumer keep the index; an
    empty one means a search of the whole log, seconds on millions of rows): a progress bar on
    stderr while the log is searched, when stderr is a terminal, not with --json; the tables say
    how far the index went.

    Exit codes: 0 the item has log rows, 1 nothing found (no log row names it), 2 usage or
    database error.
    """
    from ledger.stats import find_block, history
    from ledger.types import parse_hash

    lookup = None
    with _reading(db) as conn, _progress_bar(enabled=kind == "block" and not json_out and sys.stderr.isatty()) as bar:
        if kind == "block":
            progress = None if bar is None else _mover(bar, bar.add_task("searching the log after the index", total=None))
            lookup = find_block(conn, parse_hash(ident), limit + 1, progress)
            rows = lookup.rows
        else:
            rows = history(conn, kind, ident, limit + 1)
    truncated = len(rows) > limit  # one more row than shown was asked for: there are older ones
    rows = rows[-limit:]
    if lookup is not None and lookup.index_ahead:
        err_console.print("warning: the block index claims more of the log than there is: not used, the whole log was "
                          "searched (rebuild it: `semkv-ledger index --rebuild`)", highlight=False, soft_wrap=True)
    if json_out:
        print(json.dumps({"kind": kind, "id": ident, "truncated": truncated, "rows": [_log_row_json(r) for r in rows]},
                         default=_json_bytes))
    else:
        _print_history(kind, ident, rows, truncated)
        if lookup is not None:
            console.print(f"block index through seq {lookup.indexed_through:,}; log searched after it: "
                          f"{lookup.searched_seqs:,} seqs", highlight=False)
        if not rows:  # exit 1 says it to scripts; say it to people, with where to look
            err_console.print(f"no log row names {kind} {ident!r}: `semkv-ledger stats --db …` lists the engines, "
                              "donors and counts this ledger holds", highlight=False, soft_wrap=True)
    if not rows:
        raise typer.Exit(1)


@app.command(cls=HelpCommand)
@user_errors
def index(
    db: DbOption = DEFAULT_DB,
    follow: Annotated[bool, typer.Option("--follow", help="Then keep following the log until interrupted (SIGINT/SIGTERM), "
                                         "as the consumer's follower does.")] = False,
    interval_s: Annotated[float, typer.Option(help="With --follow: seconds between looks at the log (> 0).")] = 1.0,
    window_seqs: Annotated[int, typer.Option(help="Log seqs per transaction.", min=1)] = 10_000,
    max_lag_seqs: Annotated[int, typer.Option(help="With --follow: index while the log grows only when this many "
                                              "seqs behind (else when it is quiet).", min=0)] = 100_000,
    rebuild: Annotated[bool, typer.Option("--rebuild", help="Empty the index first, then build it again.")] = False,
    json_out: JsonOption = False,
) -> None:
    """Bring the block index that inspect block reads up to the log's head, behind the writer.

    Reads the log after the index's watermark and writes each window's index rows with the new
    watermark in one transaction, so an interrupted run resumes where it stopped; on SQLite a window
    holds the write lock ~0.1 s and gives up after waiting 1 s for it (tried again later). With
    --follow it then indexes only while the log is quiet or the index is more than --max-lag-seqs
    behind, as the consumer's follower (its block_index_interval_s setting). A progress bar on stderr
    when stderr is a terminal and not with --json. A ledger this process cannot write is refused in
    one line (inspect reads it read-only and searches the log past the index).

    Exit codes: 0 caught up (or followed until interrupted); 2 usage or database error, or an index
    whose watermark is past the log's head (rebuild it with --rebuild).
    """
    import math
    import signal
    import threading
    import time

    from ledger.block_index import BlockIndexFollower

    if not (math.isfinite(interval_s) and interval_s > 0):
        raise ValueError(f"--interval-s must be a number of seconds above 0, not {interval_s}")
    refusal = write_refusal(db)
    if refusal is not None:  # say so up front, not as the driver's "attempt to write a readonly database"
        raise LedgerError(f"cannot index the ledger {url_for_humans(db)}: it cannot be written here ({refusal}); "
                          "`inspect block` reads it read-only and searches the log past the index")
    started = time.perf_counter()
    with BlockIndexFollower(db, window_seqs=window_seqs) as follower:
        follower.check_schema()
        if rebuild:
            follower.rebuild()
        stop = threading.Event()  # a signal ends a pause at once (a sleep would last to its end)
        if follow:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
        with _progress_bar(enabled=not json_out and sys.stderr.isatty()) as bar:
            progress = None if bar is None else _mover(bar, bar.add_task("indexing the log", total=None))
            done = follower.catch_up(progress=progress)
            failing_since: float | None = None
            while follow and not stop.is_set():  # as the consumer's follower: when quiet or too far behind, paced
                window_started = time.perf_counter()
                try:
                    stepped = follower.step_when_quiet(done, max_lag_seqs=max_lag_seqs)
                except PersistenceError as exc:  # the database gone meanwhile: the index waits, as the consumer's
                    if not is_transient(exc):
                        raise
                    if failing_since is None:
                        print(f"warning: {url_for_humans(db)}: {one_line(str(exc))}; retrying every {interval_s:g} s",
                              file=sys.stderr)
                        failing_since = time.monotonic()
                    stop.wait(interval_s)
                    continue
                if failing_since is not None:
                    print(f"note: the ledger answers again after {time.monotonic() - failing_since:.0f} s",
                          file=sys.stderr)
                    failing_since = None
                stop.wait(time.perf_counter() - window_started if stepped else interval_s)
        done.seconds = time.perf_counter() - started
    if json_out:
        print(json.dumps(dataclasses.asdict(done)))
        return
    console.print(f"block index through seq {done.watermark:,} (log head {done.head:,}): {count(done.log_rows)} block "
                  f"event rows indexed in {done.windows} window(s), {count(done.index_rows)} index rows"
                  f", {done.seconds:.1f} s", highlight=False)


def _log_row_json(row: dict[str, Any]) -> dict[str, Any]:
    import msgspec

    return {**row, "body": {"tag": type(row["body"]).__name__,
                            **msgspec.to_builtins(row["body"], builtin_types=(bytes,))}}


def _json_bytes(value: Any) -> str:
    if isinstance(value, bytes):
        return value.hex()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _print_history(kind: str, ident: str, rows: list[dict[str, Any]], truncated: bool) -> None:
    from ledger.stats import describe

    shown = f"the newest {count(len(rows))} log rows (older ones: --limit)" if truncated else f"{count(len(rows))} log row(s)"
    table = Table(title=f"{kind} {ident}: {shown}")
    for column in ("seq", "kind", "type"):
        table.add_column(column)
    id_column(table, "engine")
    for column in ("zmq seq", "event_id", "applied"):
        table.add_column(column)
    id_column(table, "details")
    for r in rows:
        table.add_row(str(r["seq"]), r["kind"], r["type_name"], r["engine_id"] or "", _blank_if_none(r["zmq_seq"]),
                      _blank_if_none(r["event_id"]), "yes" if r["applied"] else "no", describe(r["body"]))
    console.print(table)


def _blank_if_none(value: int | None) -> str:
    return "" if value is None else str(value)

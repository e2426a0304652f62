"""Rich output of the commands: ``semkv-ledger stats`` tables (the demo prints the same) and the
console every table goes to.

Identifiers (engine ids, hashes, donor ids) are never cut: on a terminal their cells wrap
(``overflow="fold"``); off a terminal (piped, redirected) lines are as long as the table needs, so
``grep`` and ``cut`` see whole rows. Counts carry thousands separators.
"""

from __future__ import annotations

import os
import select
import signal
import stat
import sys
from typing import Any, NoReturn, TextIO

from rich.console import Console
from rich.table import Table

PIPED_WIDTH = 100_000
"""Console width off a terminal (characters): wide enough that no table row is ever wrapped or cut;
a table only takes the width its content needs."""


BROKEN_PIPE_STATUS = 128 + signal.SIGPIPE
"""The exit status of a command whose reader of stdout went away (``| head``): the shell's for a
process ended by SIGPIPE (141), not 1, which ``replay`` ("projections differ") and ``inspect``
("nothing found") give meanings of their own."""


def exit_for_broken_pipe() -> NoReturn:
    """End the command quietly with :data:`BROKEN_PIPE_STATUS`; stdout goes to /dev/null so that
    nothing is left to flush (and fail) at exit.

    Raises:
        SystemExit: always.
    """
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    raise SystemExit(BROKEN_PIPE_STATUS)


def stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader closed it (``| head``), as ``poll`` reports it (POLLERR
    on the write end). Needed beside BrokenPipeError: a write blocked on a full pipe when the reader
    leaves comes back short (the kernel returns what the pipe took), and CPython's buffered stdout
    then dropped the rest without an error (seen on 3.11 with a 500 KB ``inspect`` table)."""
    try:
        fd = sys.stdout.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return False
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no real stdout (a test runner's, closed): nothing to say
        return False


class _Console(Console):
    """rich's Console, except for a reader that went away: rich's own handler exits 1."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        exit_for_broken_pipe()


def output_console(*, stderr: bool = False, file: TextIO | None = None) -> Console:
    """A console for tables and reports: the terminal's width on a terminal, else :data:`PIPED_WIDTH`
    (rich leaves colour codes out off a terminal; ``NO_COLOR`` and ``FORCE_COLOR`` work as usual)."""
    stream = file or (sys.stderr if stderr else sys.stdout)
    if stream.isatty():
        return _Console(file=file, stderr=stderr)
    return _Console(file=file, stderr=stderr, width=PIPED_WIDTH, highlight=False)


def count(value: int) -> str:
    """A count for people: ``1,874,690``."""
    return f"{value:,}"


def id_column(table: Table, header: str) -> None:
    """Add a column of identifiers: wrapped on a narrow terminal, never cut with an ellipsis."""
    table.add_column(header, overflow="fold")


def print_stats(console: Console, data: dict[str, Any]) -> None:
    """Render :func:`ledger.stats.ledger_stats` output as tables."""
    engines = Table(title="engines")
    id_column(engines, "engine")
    for column in ("generation", "status", "events by type", "gaps", "generation bumps", "dead letters"):
        engines.add_column(column, overflow="fold")
    for engine in data["engines"]:
        counters = engine["counters"]
        engines.add_row(
            engine["engine_id"], count(engine["generation"]), engine["status"],
            ", ".join(f"{k}={count(v)}" for k, v in sorted(engine["events_by_type"].items())),
            _prefixed(counters, "gaps."), _prefixed(counters, "generation_bumps."), _prefixed(counters, "dead_letters."))
    console.print(engines)
    summary = Table(title="ledger")
    summary.add_column("what")
    summary.add_column("count", justify="right")
    summary.add_row("engine events logged", count(data["events_total"]))
    summary.add_row("log rows (events and decisions)", count(data["log_rows"]))
    summary.add_row("dead letters", count(data["dead_letters"]))
    for title in ("blocks_by_state", "donors_by_state", "leases_by_state"):
        for state, value in sorted(data[title].items()):
            summary.add_row(f"{title.split('_')[0]} {state}", count(value))
    console.print(summary)


def _prefixed(counters: dict[str, int], prefix: str) -> str:
    parts = [f"{k.removeprefix(prefix)}={count(v)}" for k, v in sorted(counters.items()) if k.startswith(prefix)]
    return ", ".join(parts) or "0"

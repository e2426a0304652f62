"""``semkv-ledger`` command line.

The ledger package owns the ledger commands (``migrate``, ``replay``, ``stats``, ``inspect``).
Commands of the other packages (``consume``, ``publish``, ``demo``…) are registered through the
``semkv_ledger.commands`` entry-point group, each value a ``register(app: typer.Typer) -> None``;
that keeps ``ledger`` free of imports from ``consumer`` and ``connector``.

Exit codes: 0 success; 1 a check failed or nothing was found (``replay`` differs, ``inspect`` of an item no
log row names, ``publish`` without a subscriber in time, a ``demo`` check); 2 usage, configuration, database,
connection, file or port error, printed as ONE line ``error: …`` on stderr (database errors through
``ledger.errors.database_error_line``), never a traceback; 130 after Ctrl-C (one ``interrupted:`` line;
``ledger.commands.user_errors``); 141 when the reader of stdout went away.
"""

from __future__ import annotations

import os
import re
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, NoReturn

import typer
import typer.core

app = typer.Typer(
    name="semkv-ledger",
    help="Safe KV-cache reuse beyond exact prefixes for TensorRT-LLM fleets.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ENTRY_POINT_GROUP = "semkv_ledger.commands"


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"semkv-ledger {version('semkv-ledger')}")
        raise typer.Exit()


@app.callback()
def _options(_version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                           help="Print the installed version and exit.")) -> None:
    """Options before the command."""


HELP_WIDTH_OFF_TERMINAL = 160
"""Columns of ``--help`` written off a terminal (stdout piped, ``COLUMNS`` and ``TERMINAL_WIDTH`` unset):
rich would use 80, and cut the longest option names with ``…`` (tests/deploy/test_cli_help.py)."""


class HelpCommand(typer.core.TyperCommand):
    """A command whose ``--help`` off a terminal is :data:`HELP_WIDTH_OFF_TERMINAL` wide, so no option
    name is cut; on a terminal, or with ``COLUMNS`` set, rich's width stands."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        from typer import rich_utils

        if (rich_utils.MAX_WIDTH is not None or "COLUMNS" in os.environ
                or (sys.stdout is not None and sys.stdout.isatty())):
            return super().format_help(ctx, formatter)
        rich_utils.MAX_WIDTH = HELP_WIDTH_OFF_TERMINAL
        try:
            return super().format_help(ctx, formatter)
        finally:
            rich_utils.MAX_WIDTH = None


def require_toml_file(flag: str, path: Path, what: str) -> None:
    """Refuse ``path`` now, in one line naming ``flag``, unless it is a readable TOML file: a
    directory, a missing or unreadable file and bad TOML each say so (exit 2)."""
    import tomllib

    def fail(why: str) -> NoReturn:
        typer.echo(f"error: {flag} {path}{why}", err=True)
        raise typer.Exit(2)

    if path.is_dir():
        fail(f" is a directory, not a {what} file")
    try:
        text = path.read_bytes().decode()
    except FileNotFoundError:
        fail(f": {what} file not found")
    except OSError as exc:
        fail(f": cannot read the {what} file: {exc.strerror or exc}")
    except UnicodeDecodeError as exc:
        fail(f": the {what} file is not UTF-8 text (TOML): {exc.reason} at byte {exc.start}")
    try:
        tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        fail(f": the {what} file is not valid TOML: {exc}")


def _register_plugins() -> None:
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            register = ep.load()
        except ImportError as exc:  # e.g. a consumer-only host: the other commands must still work
            print(f"warning: semkv-ledger commands of {ep.value!r} unavailable: {exc}", file=sys.stderr)
            continue
        register(app)
    _plain_help_texts(app)


_RST_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")


def _plain_help_texts(typer_app: typer.Typer) -> None:
    """Docstrings are reStructuredText for the API docs; ``--help`` shows them as plain text, so a
    command's help loses its RST markup: ``literal`` → `literal`, :func:`name` → name."""
    import inspect

    for info in typer_app.registered_commands:
        text = info.help if info.help is not None else inspect.getdoc(info.callback)
        if text:
            info.help = _RST_ROLE.sub(r"\1", text).replace("``", "`")


def main() -> None:
    """Console-script entry point. Ctrl-C before a command runs (while modules import) is the one
    ``interrupted`` line and exit 130 a running command gives (``ledger.commands.user_errors``)."""
    try:
        from ledger import commands  # noqa: F401  (registers the ledger's own commands on `app`)

        _register_plugins()
    except KeyboardInterrupt:
        print("interrupted: before the command started", file=sys.stderr)
        sys.exit(130)
    app()

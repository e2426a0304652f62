"""``semkv-ledger`` command line.

The ledger package owns the ledger commands (``migrate``, ``replay``, ``stats``, ``inspect``).
Commands of the other packages (``consume``, ``publish``, ``demo``…) are registered through the
``semkv_ledger.commands`` entry-point group, each value a ``register(app: typer.Typer) -> None``;
that keeps ``ledger`` free of imports from ``consumer`` and ``connector``.

Exit codes: 0 success; 1 a check failed or nothing was found (``replay`` differs, ``inspect`` of an item no
log row names, ``publish`` without a subscriber in time, a ``demo`` check); 2 usage, configuration, database,
connection, file or port error, printed as ONE line ``error: …`` on stderr (database errors through
``ledger.errors.database_error_line``), never a traceback.
"""

from __future__ import annotations

import sys
from importlib.metadata import entry_points

import typer

app = typer.Typer(
    name="semkv-ledger",
    help="Safe KV-cache reuse beyond exact prefixes for TensorRT-LLM fleets.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ENTRY_POINT_GROUP = "semkv_ledger.commands"


def _register_plugins() -> None:
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            register = ep.load()
        except ImportError as exc:  # e.g. a consumer-only host: the other commands must still work
            print(f"warning: semkv-ledger commands of {ep.value!r} unavailable: {exc}", file=sys.stderr)
            continue
        register(app)


def main() -> None:
    """Console-script entry point."""
    from ledger import commands  # noqa: F401  (registers the ledger's own commands on `app`)

    _register_plugins()
    app()

"""``semkv-ledger`` commands contributed by the ``connector`` package (see ``ledger.cli``).

``semkv-ledger connector-check [--config semkv.toml]``: the pre-flight an operator runs on a
TensorRT-LLM host before starting the engine — the same settings the connector will load
(``TRTLLM_SEMKV_CONFIG`` / ``TRTLLM_SEMKV_*``), a ledger at the schema head, a writable donor store.
Exit codes follow ``ledger.cli``: 0 ready, 2 a setting, the ledger or the store is not usable (one
``error:`` line naming the setting and the true origin of its value).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from ledger.cli import HelpCommand, require_toml_file  # --help off a terminal: nothing cut


def register(app: typer.Typer) -> None:
    """Add this package's commands to the ``semkv-ledger`` app."""
    app.command("connector-check", cls=HelpCommand)(connector_check)
    __import__("connector.placement.cli", fromlist=["register"]).register(app)  # issue 6: `serve`
    app.command("demo", cls=HelpCommand)(demo)


def demo(
    keep: Annotated[bool, typer.Option("--keep", help="Keep the demo directory (ledger, logs, configs).")] = False,
    workdir: Annotated[Path | None, typer.Option("--dir", readable=False,
                                                 help="Run in this directory (created if missing; "
                                                 "must not hold an earlier run) instead of a fresh "
                                                 "temporary one.")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="A shorter document (for CI).")] = False,
    fault: Annotated[str | None, typer.Option(hidden=True, help="Break one thing on purpose (tests).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object (checks, ledger stats, connector "
                                           "counters) instead of tables; progress goes to stderr.")] = False,
) -> None:
    """Run the whole product on loopback with an embedded SQLite ledger and check what it did.

    Consumer daemon + recorded real engine stream + two reference-engine harness processes with the
    connector in exact_equivalent. Exit codes: 0 every check held, 1 a check failed, 2 --dir holds an
    earlier run or cannot be a directory.
    """
    from connector.demo.run import run_demo

    try:
        code = run_demo(workdir=workdir, keep=keep, quick=quick, fault=fault, json_out=json_out)
    except ValueError as exc:  # a directory holding an earlier run or not a directory, an unknown fault
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(code)


def connector_check(
    config: Annotated[Path | None, typer.Option(readable=False,
                                                help="Connector TOML (default: $TRTLLM_SEMKV_CONFIG).")] = None,
) -> None:
    """Validate the connector's settings, ledger and donor store as the engine would at start-up.

    Exit codes: 0 ready; 2 a setting, the ledger or the donor store is not usable: one ``error:``
    line naming the setting and where its value came from (env TRTLLM_SEMKV_*, the TOML file, or
    the default).
    """
    from connector.donor_store import FileDonorStore, StoreDirUnusable
    from connector.settings import CONFIG_ENV, ConnectorConfigError, load_connector_settings, setting_origin
    from ledger.errors import LedgerError, database_error_line, is_database_error, url_for_humans
    from ledger.client import LedgerClient

    environ = dict(os.environ)
    if config is not None:  # checked here, so that the error names --config, not TRTLLM_SEMKV_CONFIG
        require_toml_file("--config", config, "connector config")
        environ[CONFIG_ENV] = str(config)
    try:
        settings = load_connector_settings(environ=environ)
    except ConnectorConfigError as exc:
        _fail(str(exc))

    def origin(name: str) -> str:
        return f"setting '{name}', {setting_origin(name, config=settings.config)}"

    try:  # with the engine's statement timeout: an unreachable host fails within it, as the engine would
        LedgerClient(settings.db, statement_timeout_s=settings.ledger_statement_timeout_s).close()
    except Exception as exc:  # noqa: BLE001 - only ledger and driver errors are the user's; the rest re-raised
        if not (isinstance(exc, LedgerError) or is_database_error(exc)):
            raise
        _fail(f"{database_error_line(exc, settings.db, setting='db')} ({origin('db')})")
    try:
        store = FileDonorStore(settings.store_dir, settings.store_capacity_bytes)
        probe = store.root / f".tmp-{os.getpid()}-check.kv"
        probe.write_bytes(b"")
        probe.unlink()
    except StoreDirUnusable as exc:
        _fail(f"{exc} ({origin('store_dir')})")
    except OSError as exc:  # the probe write
        _fail(f"donor store directory {settings.store_dir} (store_dir): cannot write in it: {exc.strerror or exc} "
              f"({origin('store_dir')})")
    typer.echo(f"connector ready: mode={settings.mode} engine_id={settings.engine_id} "
               f"ledger={url_for_humans(settings.db)} store={store.root} "
               f"({store.used_bytes():,} of {settings.store_capacity_bytes:,} bytes used)")


def _fail(message: str) -> NoReturn:
    """One line ``error: …`` on stderr, exit code 2."""
    typer.echo(f"error: {' '.join(message.split())}", err=True)
    raise typer.Exit(2)

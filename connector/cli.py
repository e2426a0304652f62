"""``semkv-ledger`` commands contributed by the ``connector`` package (see ``ledger.cli``).

``semkv-ledger connector-check [--config semkv.toml]``: the pre-flight an operator runs on a
TensorRT-LLM host before starting the engine — the same settings the connector will load
(``TRTLLM_SEMKV_CONFIG`` / ``TRTLLM_SEMKV_*``), a ledger at the schema head, a writable donor store.
Exit codes follow ``ledger.cli``: 0 ready, 2 a setting, the ledger or the store is not usable.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    """Add this package's commands to the ``semkv-ledger`` app."""
    app.command("connector-check")(connector_check)
    __import__("connector.placement.cli", fromlist=["register"]).register(app)  # issue 6: `serve`
    app.command("demo")(demo)


def demo(
    keep: Annotated[bool, typer.Option("--keep", help="Keep the demo directory (ledger, logs, configs).")] = False,
    workdir: Annotated[Path | None, typer.Option("--dir", help="Run in this directory instead of a fresh "
                                                 "temporary one.")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="A shorter document (for CI).")] = False,
    fault: Annotated[str | None, typer.Option(hidden=True, help="Break one thing on purpose (tests).")] = None,
) -> None:
    """Run the whole product on loopback with an embedded SQLite ledger and check what it did.

    Consumer daemon + recorded real engine stream + two reference-engine harness processes with the
    connector in exact_equivalent; exits 0 only if every check held.
    """
    from connector.demo.run import run_demo

    raise typer.Exit(run_demo(workdir=workdir, keep=keep, quick=quick, fault=fault))


def connector_check(
    config: Annotated[Path | None, typer.Option(help="Connector TOML (default: $TRTLLM_SEMKV_CONFIG).")] = None,
) -> None:
    """Validate the connector's settings, ledger and donor store as the engine would at start-up."""
    from connector.donor_store import FileDonorStore
    from connector.settings import CONFIG_ENV, ConnectorConfigError, load_connector_settings
    from ledger.errors import LedgerError, url_for_humans
    from ledger.queries import LedgerClient

    environ = dict(os.environ)
    if config is not None:
        environ[CONFIG_ENV] = str(config)
    try:
        settings = load_connector_settings(environ=environ)
        client = LedgerClient(settings.db)
        client.close()
        store = FileDonorStore(settings.store_dir, settings.store_capacity_bytes)
        probe = store.root / f".tmp-{os.getpid()}-check.kv"
        probe.write_bytes(b"")
        probe.unlink()
    except (ConnectorConfigError, LedgerError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"connector ready: mode={settings.mode} engine_id={settings.engine_id} "
               f"ledger={url_for_humans(settings.db)} store={store.root} "
               f"({store.used_bytes():,} of {settings.store_capacity_bytes:,} bytes used)")

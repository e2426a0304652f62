"""``semkv-ledger serve``: the placement-advice HTTP service (Mode 3), registered by ``connector.cli``.

    semkv-ledger serve --db postgresql://semkv@ledger-host/semkv --host 0.0.0.0 --port 9420 \\
        --provider chunks --provider minhash [--provider embedding --allow-prompt-text]

Reads the ledger the consumer daemon writes (read-only), keeps its own semantic index of donors
posted to ``/v1/donors``, and serves ``/v1/placement``, ``/healthz``, ``/metrics`` and the OpenAPI
schema (``/openapi.json``, ``/docs``) with uvicorn. Discovery settings default to the ``[discovery]``
table of ``TRTLLM_SEMKV_CONFIG`` / ``TRTLLM_SEMKV_DISCOVERY__*``; ``--provider`` replaces the list.
Exit codes follow ``ledger.cli``: 2 when the settings, the providers or the ledger are not usable.
"""

from __future__ import annotations

from typing import Annotated

import typer

__all__ = ["register", "serve"]


def register(app: typer.Typer) -> None:
    """Add ``serve`` to the ``semkv-ledger`` app."""
    app.command("serve")(serve)


def serve(
    db: Annotated[str, typer.Option(help="Ledger URL or SQLite path (the consumer daemon's).")],
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind (0: any free port).", min=0, max=65535)] = 9420,
    provider: Annotated[list[str] | None, typer.Option(help="Discovery provider (repeatable): exact, chunks, "
                                                       "minhash, embedding or package.module:Class.")] = None,
    discovery_on: Annotated[bool, typer.Option("--discovery/--no-discovery",
                                               help="Semantic candidates (off: exact overlap only).")] = True,
    allow_prompt_text: Annotated[bool | None, typer.Option("--allow-prompt-text/--no-prompt-text",
                                                           help="Let providers see request/donor text.")] = None,
    tokens_per_block: Annotated[int, typer.Option(help="The fleet's KV block size (tokens).", min=1)] = 32,
    semantic_timeout_s: Annotated[float, typer.Option(help="Deadline of the semantic part of an answer (s).")] = 0.05,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
) -> None:
    """Serve placement advice over HTTP from fresh ledger state (advice only, never a promise)."""
    import uvicorn
    from sqlalchemy.exc import SQLAlchemyError

    from connector.discovery.service import DiscoveryService
    from connector.discovery.settings import load_discovery_settings
    from connector.placement.advice import PlacementAdvisor
    from connector.placement.http import create_app
    from connector.settings import ConnectorConfigError
    from ledger.db import sync_engine
    from ledger.errors import LedgerError, url_for_humans
    from ledger.migrate import check_schema

    discovery = None
    try:
        engine = sync_engine(db)
        with engine.connect() as conn:
            check_schema(conn, db)
        engine.dispose()
        if discovery_on:
            overrides = {"providers": provider or None, "allow_prompt_text": allow_prompt_text}
            discovery = DiscoveryService(load_discovery_settings(overrides), db=db)
        advisor = PlacementAdvisor(db, discovery=discovery, tokens_per_block=tokens_per_block,
                                   semantic_timeout_s=semantic_timeout_s)
    except (ConnectorConfigError, LedgerError, SQLAlchemyError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"semkv placement advice on http://{host}:{port} ledger={url_for_humans(db)} "
               f"providers={[p.name for p in discovery.providers] if discovery else []}", err=True)
    try:
        uvicorn.run(create_app(advisor, discovery=discovery), host=host, port=port, log_level=log_level)
    finally:
        advisor.close()
        if discovery is not None:
            discovery.close()

"""``semkv-ledger serve``: the placement-advice HTTP service (Mode 3), registered by ``connector.cli``;
and ``semkv-ledger route-report FILE``: totals of a route join (:mod:`connector.placement.route_join`).

    semkv-ledger serve --db postgresql://semkv@ledger-host/semkv --host 0.0.0.0 --port 9420 \\
        --provider chunks --provider minhash [--provider embedding --allow-prompt-text]

Reads the ledger the consumer daemon writes (read-only), keeps its own semantic index of donors
posted to ``/v1/donors``, and serves ``/v1/placement``, ``/healthz``, ``/metrics`` and the OpenAPI
schema (``/openapi.json``; ``/docs`` lists it without any CDN) with uvicorn, logging JSON lines.
Discovery settings default to the ``[discovery]`` table of ``TRTLLM_SEMKV_CONFIG`` /
``TRTLLM_SEMKV_DISCOVERY__*``; ``--provider`` replaces the list.
Exit codes follow ``ledger.cli``: 0 stopped by a signal, 2 when the settings, the providers, the
ledger or the port are not usable, or the ``[discovery]`` extra (uvicorn, FastAPI) is not installed.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, NoReturn

import typer

__all__ = ["register", "route_report", "serve", "server_stack"]


def register(app: typer.Typer) -> None:
    """Add ``serve`` and ``route-report`` to the ``semkv-ledger`` app."""
    from ledger.cli import HelpCommand  # --help off a terminal: nothing cut

    app.command("serve", cls=HelpCommand)(serve)
    app.command("route-report", cls=HelpCommand)(route_report)


def route_report(
    records: Annotated[Path, typer.Argument(help="JSONL file of route records (connector.placement.route_join).")],
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")] = False,
) -> None:
    """Available vs routed vs delivered reuse tokens, summed over a file of route records.

    Per request: the ledger's best live overlap before it was sent, its overlap on the engine the
    router chose, and the cached tokens the engine reported (tokens; requests for the counts).

    Exit codes: 0 printed; 2 the file cannot be read or a line is not a route record (one
    ``error:`` line naming the line)."""
    from connector.placement.route_join import read_records, route_totals

    try:
        totals = route_totals(read_records(records))
    except OSError as exc:  # one line naming the file, as every command's errors do
        _fail(f"route-report: cannot read {records}: {exc.strerror or exc}")
    except ValueError as exc:
        _fail(f"route-report: {exc}")
    if json_out:
        typer.echo(json.dumps(totals.to_dict()))
        return
    from rich.table import Table

    from ledger.views import output_console

    table = Table("requests", "same events", "prompt tokens", "available", "routed", "delivered",
                  "routed to top set", "delivered = ledger", title=f"route join: {records}")
    t = totals
    table.add_row(*map(str, (t.requests, t.same_events, t.prompt_tokens, t.available_tokens, t.routed_tokens,
                             t.delivered_tokens)), f"{t.routed_to_top}/{t.requests}",
                  f"{t.delivered_as_advised}/{t.requests - t.routed_unknown}")
    output_console().print(table)  # off a terminal as wide as the table: no header cut to "reques…"


def serve(
    db: Annotated[str, typer.Option(help="Ledger URL or SQLite path (the consumer daemon's).")],
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind, 0 to 65535 (0: any free port).")] = 9420,
    provider: Annotated[list[str] | None, typer.Option(help="Discovery provider (repeatable): exact, chunks, "
                                                       "minhash, embedding or package.module:Class.")] = None,
    discovery_on: Annotated[bool, typer.Option("--discovery/--no-discovery",
                                               help="Semantic candidates (off: exact overlap only).")] = True,
    allow_prompt_text: Annotated[bool | None, typer.Option("--allow-prompt-text/--no-prompt-text",
                                                           help="Let providers see request/donor text.")] = None,
    tokens_per_block: Annotated[int, typer.Option(help="The fleet's KV block size (tokens, at least 1).")] = 32,
    semantic_timeout_s: Annotated[float, typer.Option(help="Deadline of the semantic part of an answer (s).")] = 0.05,
    overlap_weight: Annotated[float, typer.Option(help="Weight of prefill blocks in the load-aware cost, used when a "
                                                  "request gives every engine's load (Dynamo's overlap_score_weight: "
                                                  "higher favours reuse, lower spreads load; 0 to 1e6).")] = 1.0,
    log_level: Annotated[str, typer.Option(help="Level of the JSON log lines on stderr (uvicorn's included): "
                                           "critical, error, warning, info, debug or trace.")] = "info",
) -> None:
    """Serve placement advice over HTTP from fresh ledger state (advice only, never a promise).

    Logs are JSON lines on stderr, uvicorn's server and access logs included (``serve.started``
    gives the address, and uvicorn's HTTP parser and event loop: httptools and uvloop from the
    extra, else h11 and asyncio). API docs: ``/docs``, a page this process serves (no CDN: it works on an
    offline host), and the schema at ``/openapi.json``. Exit codes: 0 stopped by SIGINT/SIGTERM;
    2 a setting, a provider, the ledger or the port is not usable, or the optional "discovery"
    extra (uvicorn, FastAPI) is not installed (one ``error:`` line, before anything listens).
    """
    if not 0 <= port <= 65535:  # here, not click's min/max: one error line, not a usage box
        _fail(f"--port {port}: not a TCP port: give 0 to 65535 (0: any free port)")
    if tokens_per_block < 1:
        _fail(f"--tokens-per-block {tokens_per_block}: must be at least 1")
    from connector.placement.advice import MAX_OVERLAP_WEIGHT

    if not 0 <= overlap_weight <= MAX_OVERLAP_WEIGHT:  # NaN and inf too
        _fail(f"--overlap-weight {overlap_weight}: must be a number from 0 to {MAX_OVERLAP_WEIGHT:g}")
    if not 0 < semantic_timeout_s <= 60:  # NaN and inf too; a minute is already no deadline for an answer
        _fail(f"--semantic-timeout-s {semantic_timeout_s}: must be a number of seconds above 0, at most 60")
    _require_http_extra()
    import structlog
    import uvicorn

    from connector.discovery.service import DiscoveryService
    from connector.discovery.settings import load_discovery_settings
    from connector.placement.advice import PlacementAdvisor
    from connector.placement.http import create_app
    from connector.settings import ConnectorConfigError
    from ledger.errors import url_for_humans
    from ledger.logs import configure_json_logging

    try:
        configure_json_logging(log_level)
    except ValueError as exc:
        _fail(f"--log-level: {exc}")
    _check_ledger(db)
    sock = _bind(host, port)
    discovery = advisor = None
    try:
        if discovery_on:
            overrides = {"providers": provider or None, "allow_prompt_text": allow_prompt_text}
            discovery = DiscoveryService(load_discovery_settings(overrides), db=db)
        advisor = PlacementAdvisor(db, discovery=discovery, tokens_per_block=tokens_per_block,
                                   semantic_timeout_s=semantic_timeout_s, overlap_weight=overlap_weight)
    except Exception as exc:  # noqa: BLE001 - settings, ledger and driver errors are the user's; the rest re-raised
        sock.close()
        if discovery is not None:
            discovery.close()
        if isinstance(exc, ConnectorConfigError):
            _fail(str(exc))
        _fail_on_database_error(exc, db)
        raise
    log = structlog.get_logger("connector.placement")
    sock.listen(2048)  # now, not when uvicorn starts: a client that read serve.started is queued, not refused
    bound_host, bound_port = sock.getsockname()[:2]
    http, loop = server_stack()
    log.info("serve.started", url=f"http://{host}:{bound_port}", address=bound_host, port=bound_port,
             ledger=url_for_humans(db), providers=[p.name for p in discovery.providers] if discovery else [],
             http=http, loop=loop)
    if not ipaddress.ip_address(bound_host).is_loopback:
        log.warning("serve.exposed", address=bound_host, port=bound_port,
                    detail="plain HTTP without authentication or TLS: anyone who can reach it reads the advice "
                           "(engine ids, overlaps, load) and queues donors for the semantic index (POST /v1/donors). "
                           "Bind 127.0.0.1, or let only the router reach the port (docs/security.md)")
    if advisor.index is not None and advisor.index.engines() == 0:
        log.warning("serve.no_engines", ledger=url_for_humans(db),
                    detail="the ledger knows no engine yet: every answer is uninformed (engine_id order, no "
                           "overlap) until a consumer writes the engines' KV events (semkv-ledger consume)")
    server = uvicorn.Server(uvicorn.Config(create_app(advisor, discovery=discovery), log_config=None,
                                          log_level=log_level.lower(), http=http, loop=loop))
    try:
        with _signals_end_the_server():
            server.run(sockets=[sock])
    finally:
        sock.close()
        advisor.close()
        if discovery is not None:
            discovery.close()
    log.info("serve.stopped")


HTTP_EXTRA = "discovery"
"""The optional extra (pyproject.toml) that carries uvicorn and FastAPI, which ``serve`` needs."""


def server_stack() -> tuple[str, str]:
    """``(http, loop)``: uvicorn's HTTP parser and event loop for ``serve`` (its ``http`` and ``loop``
    settings, named in ``serve.started``). ``httptools`` and ``uvloop`` (C, both in the [discovery]
    extra; uvloop not on Windows) where they import, else uvicorn's pure-Python ``h11`` and the
    standard ``asyncio`` loop, each falling back on its own. On ``POST /v1/placement`` the pair is
    ~15 % faster at 2K tokens: tools/results/placement-http-2026-12-05-1715.md (issue 22)."""
    return _importable("httptools", fallback="h11"), _importable("uvloop", fallback="asyncio")


def _importable(module: str, *, fallback: str) -> str:
    """``module`` when it imports here, else ``fallback``."""
    try:
        __import__(module)
    except ImportError:
        return fallback
    return module


def _require_http_extra() -> None:
    """Refuse (exit 2, one line naming the extra) when uvicorn or FastAPI cannot be imported: they
    are not runtime dependencies of every install, only of ``semkv-ledger[discovery]``."""
    for module in ("uvicorn", "fastapi"):
        try:
            __import__(module)
        except ImportError as exc:
            _fail(f"serve needs the optional [{HTTP_EXTRA}] extra (uvicorn, FastAPI): "
                  f"pip install 'semkv-ledger[{HTTP_EXTRA}]' ({module}: {exc})")


def _check_ledger(db: str) -> None:
    """Refuse (exit 2, one line) a ledger that cannot be opened or is not at the schema head, or a
    SQLite ledger this process cannot write (a read-only mount): ``serve`` follows a live ledger and
    does not open one read-only as the audits do, since a frozen copy would be answered as if current."""
    from ledger.db import sync_engine, write_refusal
    from ledger.errors import url_for_humans
    from ledger.migrate import check_schema

    try:
        refusal = write_refusal(db)
        if refusal is None:
            engine = sync_engine(db)
            try:
                with engine.connect() as conn:
                    check_schema(conn, db)
            finally:
                engine.dispose()
    except Exception as exc:  # noqa: BLE001 - ledger and driver errors are the user's; the rest re-raised
        _fail_on_database_error(exc, db)
        raise
    if refusal is not None:
        _fail(f"cannot serve advice from the ledger {url_for_humans(db)}: it cannot be written here ({refusal}); "
              "serve follows the live ledger its consumer writes: run it where that ledger can be written")


def _bind(host: str, port: int) -> socket.socket:
    """The service's socket, bound now: a port in use is refused in one line (exit 2) before
    anything says the service is up; uvicorn listens on it later (``Server.run(sockets=…)``)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        _fail(f"--host {host}: cannot resolve it: {exc.strerror}")
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart need not wait out TIME_WAIT
        sock.bind(address)
    except OSError as exc:
        sock.close()
        _fail(f"--port {port} (--host {host}): the placement service cannot listen on {host}:{port}: "
              f"{exc.strerror} (errno {exc.errno})")
    return sock


@contextlib.contextmanager
def _signals_end_the_server() -> Iterator[None]:
    """uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again under the
    handler it found (the default one kills the process: exit 143 for SIGTERM). Under these
    handlers the second delivery does nothing, so a signal stop exits 0 like the other daemons."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _fail_on_database_error(exc: BaseException, db: str) -> None:
    """Exit 2 with one line when ``exc`` is a ledger or database error; return otherwise."""
    from ledger.errors import LedgerError, database_error_line, is_database_error

    if isinstance(exc, LedgerError) or is_database_error(exc):
        _fail(database_error_line(exc, db))


def _fail(message: str) -> NoReturn:
    """One line ``error: …`` on stderr, exit code 2."""
    typer.echo(f"error: {' '.join(message.split())}", err=True)
    raise typer.Exit(2)

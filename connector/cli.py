"""``semkv-ledger`` commands contributed by the ``connector`` package (see ``ledger.cli``).

``semkv-ledger connector-check [--config semkv.toml] [--llm-args semkv.yaml [--model DIR]]``: the
pre-flight an operator runs on a TensorRT-LLM host before starting the engine — the same settings the
connector will load (``TRTLLM_SEMKV_CONFIG`` / ``TRTLLM_SEMKV_*``), a ledger at the schema head, a
writable donor store; with ``--llm-args`` (the LLM API options file given to ``trtllm-serve
--extra_llm_api_options``) also which parallel layouts of that configuration the connector serves
(:mod:`connector.layouts`: TP, PP, CP, attention DP, sliding windows, MLA), each supported or
refused with the reason. Exit codes follow ``ledger.cli``: 0 ready; 1 the configuration uses a
layout the connector refuses (it would materialize nothing and register no donor); 2 a setting, the
ledger, the store or the ``--llm-args`` file is not usable (one ``error:`` line naming the setting
and the true origin of its value).
"""

from __future__ import annotations

import json
import os
import shutil
import types
from pathlib import Path
from typing import Annotated, Any, NoReturn

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
    llm_args: Annotated[Path | None, typer.Option(
        "--llm-args", readable=False,
        help="TensorRT-LLM LLM API options (the YAML or JSON given to trtllm-serve --extra_llm_api_options): "
             "report which of its parallel layouts the connector supports.")] = None,
    model: Annotated[Path | None, typer.Option(
        readable=False, help="With --llm-args: the model directory, whose config.json tells MLA.")] = None,
) -> None:
    """Validate the connector's settings, ledger and donor store as the engine would at start-up.

    With --llm-args, also which parallel layouts of that TensorRT-LLM configuration (TP, PP, CP,
    attention DP, sliding windows, MLA) the connector serves, each with the reason.

    Exit codes: 0 ready; 1 the --llm-args configuration uses a layout the connector refuses (it would
    materialize nothing and register no donor; the reason is printed); 2 a setting, the ledger, the
    donor store or the --llm-args file is not usable: one ``error:`` line naming the setting and where
    its value came from (env TRTLLM_SEMKV_*, the TOML file, or the default).
    """
    from connector.donor_store import FileDonorStore, StoreDirUnusable
    from connector.settings import (CONFIG_ENV, ConnectorConfigError, load_connector_settings, setting_origin,
                                    unknown_env_settings)
    from ledger.errors import LedgerError, database_error_line, is_database_error, url_for_humans
    from ledger.client import LedgerClient

    options = _llm_options(llm_args) if llm_args is not None else None
    model_config = _model_config(model) if llm_args is not None and model is not None else None
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

    for name in unknown_env_settings(environ):
        typer.echo(f"warning: {name} names no connector setting: ignored (docs/connector-settings.md)", err=True)
    if settings.engine_id is None and settings.mode != "discovery_only":
        typer.echo("warning: engine_id is not set: this engine never registers donors of its own (it can still "
                   "load other engines'); set it per host (engine_id in the TOML, or TRTLLM_SEMKV_ENGINE_ID) to the "
                   "consumer's [[sources]] engine_id for this engine", err=True)

    if settings.discovery.enabled:  # the engine resolves its providers at start-up, and fails on one it cannot
        from connector.discovery.registry import resolve_provider

        for spec in settings.discovery.providers:
            try:
                resolve_provider(spec)
            except ConnectorConfigError as exc:
                _fail(f"{exc} (setting 'discovery.providers': [discovery] providers in the TOML file or "
                      "env TRTLLM_SEMKV_DISCOVERY__PROVIDERS)")

    try:  # with the engine's statement timeout: an unreachable host fails within it, as the engine would
        LedgerClient(settings.db, statement_timeout_s=settings.ledger_statement_timeout_s).close()
    except Exception as exc:  # noqa: BLE001 - only ledger and driver errors are the user's; the rest re-raised
        if not (isinstance(exc, LedgerError) or is_database_error(exc)):
            raise
        _fail(f"{database_error_line(exc, settings.db, setting='db')} ({origin('db')})")
    if settings.donor_store == "redis":
        ready = _check_redis(settings, origin)
        _check_layouts(llm_args, options, model_config, settings)  # a refused layout exits 1: never "ready"
        typer.echo(ready)
        return
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
    disk = shutil.disk_usage(store.root)
    if settings.store_capacity_bytes > disk.free + store.used_bytes():
        typer.echo(f"warning: store_capacity_bytes {settings.store_capacity_bytes:,} is more than the file system of "
                   f"{store.root} can give the store ({disk.free:,} bytes free of {disk.total:,}, plus "
                   f"{store.used_bytes():,} it holds): the disk fills before the store evicts, and saves then fail "
                   f"({origin('store_capacity_bytes')})", err=True)
    _check_layouts(llm_args, options, model_config, settings)  # a refused layout exits 1: never "ready"
    typer.echo(f"connector ready: mode={settings.mode} engine_id={settings.engine_id} "
               f"ledger={url_for_humans(settings.db)} store={store.root} "
               f"({store.used_bytes():,} of {settings.store_capacity_bytes:,} bytes used)")


def _check_redis(settings: Any, origin: Any) -> str:
    """``donor_store = "redis"``: one round trip to ``redis_url`` (exit 2 naming the setting); the
    "connector ready" line to print once every other check has passed."""
    from connector.donor_store import StoreUnavailable
    from connector.redis_store import RedisDonorStore, operator_warnings

    store = RedisDonorStore(settings.redis_url, settings.store_dir, key_prefix=settings.redis_key_prefix,
                            timeout_s=settings.redis_timeout_s)
    try:
        store.ping()
        warnings = operator_warnings(store, redis_ttl_s=settings.redis_ttl_s, donor_ttl_s=settings.donor_ttl_s)
    except StoreUnavailable as exc:
        _fail(f"donor store (redis_url): {exc} ({origin('redis_url')})")
    finally:
        store.close()
    for warning in warnings:
        typer.echo(f"warning: {warning}", err=True)
    return (f"connector ready: mode={settings.mode} engine_id={settings.engine_id} ledger={_ledger_url(settings)} "
            f"store=redis {store.where()} prefix={settings.redis_key_prefix} ttl={settings.redis_ttl_s:g} s")


def _ledger_url(settings: Any) -> str:
    from ledger.errors import url_for_humans

    return url_for_humans(settings.db)


def _check_layouts(llm_args: Path | None, options: Any, model_config: dict[str, Any] | None, settings: Any) -> None:
    """With --llm-args: print the parallel layouts' verdicts; exit 1 if one in use is refused."""
    if options is None:
        return
    refused = _report_layouts(llm_args, options, model_config, settings.namespace.kv_layout)
    if refused is not None:
        typer.echo(f"not ready for {llm_args}: {refused.title} is refused ({refused.setting}; the reason above): "
                   "the connector would materialize nothing and register no donor", err=True)
        raise typer.Exit(1)


def _report_layouts(path: Path, options: Any, model_config: dict[str, Any] | None, kv_layout: str | None) -> Any:
    """Print every layout's verdict for ``options``; returns the first refused one in use, or None."""
    from connector import _trtllm
    from connector.layouts import (attention_dp_api, mla_layout, model_kv_heads, parallel_layouts, refused,
                                   sliding_window_layout)

    api = attention_dp_api()
    where = (_trtllm.TRTLLM_CONNECTOR_MODULE if _trtllm.TRTLLM_AVAILABLE else
             "TensorRT-LLM not importable here: checked against the connector's own ABCs (2026 main's contract)")
    rows = [*parallel_layouts(options, attention_dp_api=api, num_kv_heads=model_kv_heads(model_config)),
            sliding_window_layout(options, _num_layers(model_config)),
            mla_layout(model_config, kv_layout)]
    typer.echo(f"parallel layouts of {path} (connector API: {where}):")
    for row in rows:
        verdict = ("supported" if row.supported else "REFUSED") if row.in_use else (
            "not in use" if row.known else "not checked")
        shown = row.in_use or not row.known
        typer.echo(f"  {row.title}: {verdict} ({row.setting})" + (f": {row.reason}" if shown else ""))
    return refused(rows)


def _num_layers(model_config: dict[str, Any] | None) -> int | None:
    """``num_hidden_layers`` of the model's config.json (or its ``text_config``), when given."""
    if model_config is None:
        return None
    text_config = model_config.get("text_config")
    layers = (text_config if isinstance(text_config, dict) else model_config).get("num_hidden_layers")
    return layers if isinstance(layers, int) and not isinstance(layers, bool) and layers > 0 else None


def _llm_options(path: Path) -> Any:
    """The LLM API options file as attributes (``options.kv_cache_config.max_attention_window``);
    exit 2 naming ``--llm-args`` when it cannot be read or is not a mapping. YAML needs PyYAML
    (TensorRT-LLM depends on it); JSON, a subset of YAML, is read without it."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        _fail(f"--llm-args {path}: cannot read the LLM API options file: {getattr(exc, 'strerror', None) or exc}")
    try:
        import yaml
    except ImportError:
        yaml = None
    errors: tuple[type[Exception], ...] = (json.JSONDecodeError,) if yaml is None else (yaml.YAMLError,)
    try:
        data = yaml.safe_load(text) if yaml is not None else json.loads(text)
    except errors as exc:
        kind = "YAML" if yaml is not None else "JSON (PyYAML is not installed)"
        _fail(f"--llm-args {path}: not valid {kind}: {exc}")
    if not isinstance(data, dict):
        _fail(f"--llm-args {path}: expected a mapping of LLM API options (tensor_parallel_size, "
              f"enable_attention_dp, kv_cache_config, ...), got {type(data).__name__}")
    return _attributes(data)


def _attributes(value: Any) -> Any:
    if isinstance(value, dict):
        return types.SimpleNamespace(**{str(k): _attributes(v) for k, v in value.items()})
    return value


def _model_config(model: Path) -> dict[str, Any]:
    """``model/config.json``; exit 2 naming ``--model`` when it cannot be read."""
    try:
        data = json.loads((model / "config.json").read_text())
    except (OSError, ValueError) as exc:
        _fail(f"--model {model}: cannot read config.json: {getattr(exc, 'strerror', None) or exc}")
    if not isinstance(data, dict):
        _fail(f"--model {model}: config.json is not a JSON object")
    return data


def _fail(message: str) -> NoReturn:
    """One line ``error: …`` on stderr, exit code 2."""
    typer.echo(f"error: {' '.join(message.split())}", err=True)
    raise typer.Exit(2)

"""Settings of the consumer daemon (``semkv-ledger consume``): one frozen model built once at the edge.

Sources of values, highest priority first (pydantic-settings):

1. command-line flags (passed to :func:`load_settings` as ``overrides`` / ``cli_source``);
2. environment variables, prefix ``SEMKV_``, nested fields with ``__``
   (``SEMKV_DB=postgresql://…``, ``SEMKV_BATCH_MAX_EVENTS=4096``,
   ``SEMKV_SOURCES='[{"engine_id": "trt-0", "endpoint": "tcp://10.0.0.5:5557"}]'``);
3. a TOML file (``--config semkv.toml``) listing many engines::

       db = "sqlite:///semkv-ledger.db"
       metrics_port = 9400
       [[sources]]
       engine_id = "trtllm-0"
       endpoint = "tcp://10.0.0.5:5557"
       replay_endpoint = "tcp://10.0.0.5:5558"
       topic = "kv"

4. the defaults below.

A source given on the command line (``--engine-id``/``--endpoint``) is *added* to the sources of
the environment or TOML file; two sources with the same ``source_id`` are an error.

Defaults follow the engines' own: TensorRT-LLM and vLLM publishers bind port 5557, so a consumer on the same host
connects to ``tcp://127.0.0.1:5557``. Replay is off unless ``replay_endpoint`` is set (the
publisher bridge and ``semkv-ledger publish`` serve it on port 5558 by default).

CURVE (``consumer/curve.py``, docs/security.md): ``curve_secret_key`` (this consumer's key pair)
turns it on for every source, and then every source needs ``curve_publisher_key`` (the engine's
public key). ``docs/consume-settings.md`` is generated from this model: ``python -m consumer.settings``.
"""

from __future__ import annotations

import contextvars
import ipaddress
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from ledger.db import DEFAULT_DB
from ledger.types import BlockKeyScheme, checked_engine_id
from ledger.settings_doc import default_text, markdown_cell

__all__ = ["DEFAULT_ENDPOINT", "ENV_PREFIX", "ConsumerSettings", "SourceSettings", "check_tcp_endpoint",
           "load_settings", "tcp_host_name", "unknown_env_settings"]

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
ENV_PREFIX = "SEMKV_"
"""The prefix of every consume setting's environment variable (``SEMKV_DB``, ``SEMKV_SOURCES`` …)."""
MIB = 2**20
_TRANSPORTS = ("tcp://", "ipc://", "inproc://")
_CONFIG_FILE: contextvars.ContextVar[Path | None] = contextvars.ContextVar("semkv_config_file", default=None)


def check_tcp_endpoint(endpoint: str, *, bind: bool, what: str = "endpoint") -> None:
    """A ``tcp://HOST:PORT`` endpoint has a port in 1..65535; ``*`` or 0 (any free port) and a ``*``
    host only where the socket binds. Other transports are not checked here.

    Raises:
        ValueError: naming ``what``, the endpoint and the rule.
    """
    if not endpoint.startswith("tcp://"):
        return
    address = endpoint[len("tcp://"):].rsplit(";", 1)[-1]  # connect: "tcp://SOURCE;HOST:PORT"
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{what} {endpoint!r}: expected tcp://HOST:PORT")
    if port == "*" or port == "0":
        if not bind:
            raise ValueError(f"{what} {endpoint!r}: port {port} (any free port) only where the socket binds "
                             "(--bind); a connecting socket needs a port in 1..65535")
        return
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{what} {endpoint!r}: port {port!r} is not in 1..65535")
    if host == "*" and not bind:
        raise ValueError(f"{what} {endpoint!r}: host * only where the socket binds; give the engine's address")


def tcp_host_name(endpoint: str) -> str | None:
    """The host NAME a connecting ``tcp://HOST:PORT`` endpoint resolves (None: another transport, an
    IP address, ``*``, or no host part); a name that does not resolve leaves libzmq retrying
    silently for ever."""
    if not endpoint.startswith("tcp://"):
        return None
    host = endpoint[len("tcp://"):].rsplit(";", 1)[-1].rpartition(":")[0].strip("[]")
    if not host or host == "*":
        return None
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return host
    return None


class SourceSettings(BaseModel):
    """One engine event endpoint: the ZMQ PUB socket (and optional replay ROUTER) of one engine."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)

    engine_id: Annotated[str, AfterValidator(checked_engine_id)] = Field(min_length=1, max_length=200)
    """Stable id of the engine's deployment slot (kept across restarts); no control characters."""
    endpoint: str = DEFAULT_ENDPOINT
    """ZMQ endpoint of the engine's PUB socket (or, with ``bind``, where our SUB binds)."""
    replay_endpoint: str | None = None
    """ZMQ endpoint of the engine's replay ROUTER; None: gaps cannot be recovered, only recorded."""
    topic: str = ""
    """Topic of the engine's messages, matched exactly: ZMQ's SUBSCRIBE also lets through longer
    topics that start with it (``kvX`` for ``kv``), which are dropped and counted
    (``semkv_consumer_foreign_topic_dropped_total``), never recorded. "" (vLLM's default topic)
    takes every topic. An engine publishes every message on its one configured topic (vLLM
    ``KVEventsConfig.topic``)."""
    bind: bool = False
    """Bind the SUB socket instead of connecting (for vLLM engines that connect their PUB)."""
    source_id: str = ""
    """Ledger key of this source; default ``f"{engine_id}@{endpoint}"``."""
    block_key_scheme: BlockKeyScheme | None = None
    """How the engine computes its block hashes: ``trtllm_v1``, ``trtllm_v2``, ``vllm`` or ``dynamo``;
    logged in the ledger, so that placement advice computes a request's hashes the engine's way.
    None: inferred where the wire tells (TensorRT-LLM LLM-API events: ``trtllm_v1``); otherwise
    advice answers the engine as ``unknown`` unless the caller gives its own block hashes."""
    curve_publisher_key: Path | None = None
    """CURVE: the engine publisher's public key file (``ENGINE.key``), pinned when connecting; for a
    ``bind`` source, the key file or directory of ``*.key`` files of the publishers admitted (ZAP).
    Required when ``curve_secret_key`` is set."""

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _transport(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(_TRANSPORTS):
            raise ValueError(f"endpoint {value!r} must start with one of {', '.join(_TRANSPORTS)}")
        return value

    @model_validator(mode="after")
    def _tcp_ports(self) -> SourceSettings:
        check_tcp_endpoint(self.endpoint, bind=self.bind, what="endpoint")
        if self.replay_endpoint is not None:  # the replay DEALER always connects
            check_tcp_endpoint(self.replay_endpoint, bind=False, what="replay_endpoint")
        return self

    @model_validator(mode="after")
    def _default_source_id(self) -> SourceSettings:
        if not self.source_id:
            object.__setattr__(self, "source_id", f"{self.engine_id}@{self.endpoint}")
        return self


class ConsumerSettings(BaseSettings):
    """Everything ``semkv-ledger consume`` needs. Units are in the field names."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__", frozen=True,
                                      extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False,
                                      env_ignore_empty=True)  # VAR= means unset

    db: str = DEFAULT_DB
    """Ledger database URL or SQLite file path (default: ``semkv-ledger.db`` in the working directory)."""
    sources: list[SourceSettings] = Field(default_factory=list)
    """Engine endpoints (``[[sources]]`` tables in TOML; fields in the second table below)."""
    batch_max_events: int = Field(1024, ge=1)
    """Engine events per ledger transaction, at most (a single larger message still goes alone)."""
    batch_max_delay_ms: float = Field(20.0, ge=0, le=3_600_000)
    """How long the writer waits for more messages before committing a partial transaction."""
    writer_process: bool = True
    """SQLite: run the ledger writer in a child process (``ledger/writer_process.py``), so the
    recorder and the receive/decode of the sources do not share one GIL (+~0.5 s at start-up, a
    second process in ``ps``); false: a thread of the daemon. PostgreSQL ignores it."""
    block_index_interval_s: float = Field(1.0, ge=0, le=86_400)
    """How often the daemon's follower looks for log rows the block index (``inspect block``'s,
    ``ledger/block_index.py``) has not reached; it indexes them a window at a time, each in its own
    transaction, when no batch waits for the writer and the log did not grow since its last look
    (or the index is over 100,000 seqs behind), pausing as long as a window took between windows
    (on SQLite it shares the ledger's write lock: a saturated writer is never made to wait for
    it; ``inspect`` searches the log past the index instead); 0: no follower here (run
    ``semkv-ledger index --follow`` elsewhere, e.g. once per PostgreSQL fleet)."""
    queue_max_batches: int = Field(1024, ge=1)
    """Messages waiting between the sources and the writer; a full queue stops the sources reading."""
    replay_timeout_s: float = Field(2.0, gt=0, le=3600)
    """Replay gives up when no reply arrives for this long (between two replies)."""
    idle_replay_s: float = Field(0.5, ge=0, le=3600)
    """After this long without a message, ask the replay endpoint again for the last batch passed
    on and anything newer: finds lost trailing batches, batches published before the SUB
    connected, and an engine that restarted and stayed idle (its buffer no longer holds that
    batch: the generation is bumped within about ``idle_replay_s`` + 0.2 s of the restarted
    engine answering; issue #22). Cost per idle engine: 1 / ``idle_replay_s`` requests per second
    (2 at the default), each answered with one batch (the last one) and the end marker; none while
    messages flow. 0 disables it (the start-up probe and the replay of seen gaps still run; an
    idle restart is then seen only when the engine publishes again)."""
    max_frame_bytes: int = Field(16 * MIB, ge=1024)
    """A frame above this is dead-lettered undecoded (``oversized_frame``)."""
    max_events_per_message: int = Field(65_536, ge=1)
    """Events in one message; a message with more is one dead letter (``message_over_limit``, its
    first 4 KiB kept). Our TensorRT-LLM bridge sends one drain per message: keep this at or above
    the engine's ``event_buffer_max_size``."""
    max_blocks_per_message: int = Field(65_536, ge=1)
    """Blocks in one message (stored, removed and updated together); beyond it, as above. It bounds
    the stall one message costs every source (it is one transaction): the largest message allowed
    (65,536 blocks of 64 tokens, 4.5 MB) took 2.6–4.3 s and ~+150 MB peak per process on a loaded
    2-core machine (tests/integration/consumer/test_daemon_large_message.py). Real engines send far
    fewer: vLLM one scheduler step's blocks, TensorRT-LLM (through our bridge) one drain."""
    max_tokens_per_message: int = Field(4 * MIB, ge=1)
    """Token ids in one message's stored blocks; beyond it, as above (token lists are the bulk of a
    message's decoded size)."""
    rcv_hwm: int = Field(10_000, ge=1, le=2**31 - 1)  # ZMQ_RCVHWM is a C int
    """ZMQ receive high-water mark of each SUB socket, in messages: with the writer queue, the bound
    on memory when a publisher outpaces the ledger (about rcv_hwm × message size; beyond it the PUB
    drops, the source sees a gap and recovers it from the engine's replay buffer)."""
    dedup_window_batches: int = Field(16_384, ge=16)
    """Per source, how many recent (seq, digest) pairs are kept to drop duplicates before the ledger."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """HTTP port for ``/metrics`` (Prometheus) and ``/healthz`` (JSON); None: no server; 0: any free port."""
    metrics_host: str = "127.0.0.1"
    """Loopback by default; set 0.0.0.0 (or an interface) to let a remote Prometheus scrape."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Lowest level logged (JSON lines on stderr)."""
    record: Path | None = None
    """Append every message passed to the ledger to this capture file (the format `semkv-ledger publish --from-file` reads); mode
    0600 whatever the umask (it holds prompt token ids)."""
    db_retry_initial_s: float = Field(0.05, gt=0, le=3600)
    """First back-off while the database refuses a transaction (e.g. SQLite locked); doubles each retry."""
    db_retry_max_s: float = Field(2.0, gt=0, le=3600)
    """Longest back-off between two retries of a refused transaction."""
    shutdown_timeout_s: float = Field(30.0, gt=0, le=86_400)
    """On SIGTERM/SIGINT: how long to wait for the received messages to commit before giving up."""
    curve_secret_key: Path | None = None
    """CURVE: this consumer's key pair (``NAME.key_secret`` from ``semkv-ledger keygen``). Set: every
    source is secured and needs ``curve_publisher_key``; unset: plain ZMQ (keep it on loopback)."""

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _unique_sources(self) -> ConsumerSettings:
        seen: set[str] = set()
        for source in self.sources:
            if source.source_id in seen:
                raise ValueError(f"two sources have source_id {source.source_id!r}")
            seen.add(source.source_id)
        for source in self.sources:
            if self.curve_secret_key is not None and source.curve_publisher_key is None:
                raise ValueError(f"source {source.source_id!r} has no curve_publisher_key, but curve_secret_key "
                                 "is set: every source of a CURVE consumer needs the engine's public key")
            if self.curve_secret_key is None and source.curve_publisher_key is not None:
                raise ValueError(f"source {source.source_id!r} has a curve_publisher_key but curve_secret_key is "
                                 "not set: give this consumer's key pair (--curve-secret-key)")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        config_file = _CONFIG_FILE.get()
        if config_file is None:
            return init_settings, env_settings
        return init_settings, env_settings, TomlConfigSettingsSource(settings_cls, toml_file=config_file)


def load_settings(
    overrides: Mapping[str, Any] | None = None,
    *,
    config_file: str | Path | None = None,
    cli_source: Mapping[str, Any] | None = None,
) -> ConsumerSettings:
    """Build the daemon's settings from flags, environment and an optional TOML file.

    Args:
        overrides: flag values (``None`` values are ignored, so unset flags do not hide env/TOML).
        config_file: TOML file (see the module docstring).
        cli_source: one source given by flags (``engine_id``, ``endpoint``…), appended.

    Raises:
        FileNotFoundError: ``config_file`` does not exist.
        pydantic.ValidationError: a value is invalid, no source is configured, or two sources
            share a ``source_id``.
    """
    path = None
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} not found")
    values = {k: v for k, v in (overrides or {}).items() if v is not None}
    token = _CONFIG_FILE.set(path)
    try:
        settings = ConsumerSettings(**values)
    finally:
        _CONFIG_FILE.reset(token)
    if cli_source is not None:
        source = SourceSettings(**{k: v for k, v in cli_source.items() if v is not None})
        merged = settings.model_dump()
        merged["sources"] = [*merged["sources"], source.model_dump()]
        settings = ConsumerSettings.model_validate(merged)
    if not settings.sources:
        raise _no_source_error()
    return settings


_OTHER_ENV = frozenset({"SEMKV_CURVE_SECRET_KEY"})
"""``SEMKV_*`` variables ``consume`` reads that are not settings (flags' environment variables)."""


def unknown_env_settings(environ: Mapping[str, str] | None = None) -> list[str]:
    """``SEMKV_*`` variables of ``environ`` (default ``os.environ``) that name no consume setting:
    pydantic-settings ignores them, so a typo (``SEMKV_BATCH_MAX_EVENT``) leaves the default in
    force without a word. A variable under a table (``SEMKV_SOURCES__…``) counts as its table's."""
    env = os.environ if environ is None else environ
    fields = {ENV_PREFIX + name.upper() for name in ConsumerSettings.model_fields}
    return sorted(name for name in env if name.upper().startswith(ENV_PREFIX) and name.upper() not in _OTHER_ENV
                  and name.upper().split("__", 1)[0] not in fields)


def _no_source_error() -> Exception:
    from pydantic_core import InitErrorDetails, PydanticCustomError, ValidationError

    error = PydanticCustomError("no_source", "no source configured: give --engine-id (and --endpoint), "
                                "SEMKV_SOURCES, or [[sources]] in --config")
    details: list[InitErrorDetails] = [{"type": error, "loc": ("sources",), "input": []}]
    return ValidationError.from_exception_data("ConsumerSettings", details)


# --- the settings table (docs/consume-settings.md) -------------------------------------------------


def _consume_flags() -> dict[str, str]:
    """``{parameter name: "--flag"}`` of ``semkv-ledger consume`` (read from the real command)."""
    import typer
    from typer.main import get_command

    from consumer.cli import register

    app = typer.Typer()
    app.callback()(lambda: None)
    register(app)
    command = get_command(app).commands["consume"]  # type: ignore[attr-defined]
    return {p.name: "/".join([*p.opts, *p.secondary_opts]) for p in command.params if p.name}


def settings_markdown() -> str:
    """The settings table of ``semkv-ledger consume``, generated from the models above."""
    flags = _consume_flags()
    lines = ["# `semkv-ledger consume` settings", "",
             "Generated from `consumer/settings.py` by `python -m consumer.settings > docs/consume-settings.md`",
             "(a test fails when this file and the model disagree). Priority: flag > environment > TOML file",
             "(`--config`) > default. `SEMKV_SOURCES` is a JSON list of source objects. An empty variable",
             "counts as unset. Numbers are finite.", "",
             "| setting (TOML key) | environment | flag | default | meaning |", "|---|---|---|---|---|"]
    for name, field in ConsumerSettings.model_fields.items():
        lines.append(f"| `{name}` | `SEMKV_{name.upper()}` | {_flag(flags, name)} | {default_text(field)} | "
                     f"{markdown_cell(field.description)} |")
    lines += ["", "Each `[[sources]]` entry (or element of the JSON list in `SEMKV_SOURCES`); the flags give one",
              "source, added to those of the file and the environment:", "",
              "| source field | flag | default | meaning |", "|---|---|---|---|"]
    for name, field in SourceSettings.model_fields.items():
        default = default_text(field)
        lines.append(f"| `{name}` | {_flag(flags, name)} | {default} | {markdown_cell(field.description)} |")
    only = sorted(set(flags) - set(ConsumerSettings.model_fields) - set(SourceSettings.model_fields))
    lines += ["", "Flags that are not settings: " + ", ".join(f"`{flags[n]}`" for n in only) + " (see "
              "`semkv-ledger consume --help`).", ""]
    return "\n".join(lines)


def _flag(flags: dict[str, str], name: str) -> str:
    return f"`{flags[name]}`" if name in flags else "—"


if __name__ == "__main__":
    print(settings_markdown(), end="")

"""Settings of the KV Cache Connector: one frozen model, built once per process at start-up.

TensorRT-LLM constructs the connector in every MPI worker and forwards only environment variables
prefixed ``TRTLLM``/``TLLM`` to them (reference/TRTLLM_CONNECTOR.md), so the connector reads:

1. keyword overrides (tests, or code that builds the classes itself);
2. environment variables ``TRTLLM_SEMKV_<FIELD>``, nested fields with ``__``
   (``TRTLLM_SEMKV_MODE=exact_equivalent``, ``TRTLLM_SEMKV_NAMESPACE__KV_DTYPE=bfloat16``);
3. the TOML file named by ``TRTLLM_SEMKV_CONFIG``::

       db = "postgresql://semkv@ledger-host:5432/semkv"
       mode = "exact_equivalent"          # discovery_only | exact_equivalent | placement
       engine_id = "trtllm-0"             # the consumer's [[sources]] engine_id for this engine
       freshness_policy = "engine"        # engine | store
       lookup_timeout_s = 0.002
       lease_ttl_s = 60
       store_dir = "/dev/shm/semkv-donors"
       store_capacity_bytes = 34359738368
       donor_store = "file"               # file | redis (redis_url = "redis://donors:6379/0")
       metrics_port = 9410
       [namespace]
       kv_dtype = "bfloat16"              # needed when llm_args says "auto"
       tenant = "prod"
       [discovery]                        # optional donor discovery (telemetry only; default off)
       enabled = true
       providers = ["chunks", "minhash"]

4. the defaults below, which are safe: ``discovery_only`` never changes what the engine computes.

Invalid values fail at start-up with :class:`ConnectorConfigError` naming the setting and where it
came from; ``mode = "experimental"`` (Mode 4, approximate KV) is refused (docs/safety.md rule 5).
"""

from __future__ import annotations

import contextvars
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import (BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError,
                               TomlConfigSettingsSource)

from connector.discovery.settings import DiscoverySettings
from ledger.settings_errors import explain_settings_error
from ledger.types import FreshnessPolicy, checked_engine_id

__all__ = ["CONFIG_ENV", "ENV_PREFIX", "ConnectorConfigError", "ConnectorSettings", "NamespaceOverrides", "ProfitSettings", "kv_layout_dims",
           "load_connector_settings", "setting_origin"]

ENV_PREFIX = "TRTLLM_SEMKV_"
CONFIG_ENV = "TRTLLM_SEMKV_CONFIG"
GIB = 2**30
Mode = Literal["discovery_only", "exact_equivalent", "placement"]
_CONFIG_FILE: contextvars.ContextVar[Path | None] = contextvars.ContextVar("semkv_connector_config", default=None)


class ConnectorConfigError(ValueError):
    """The connector's settings are invalid; the message names the setting (raised at start-up)."""


def kv_layout_dims(text: str) -> tuple[int, int, int]:
    """``(num_layers, kv_factor, block_elems)`` of a ``[namespace] kv_layout`` string such as
    ``"num_layers=32,kv_factor=2,block_elems=4096"`` (one rank's pool: layers, K and V or one latent,
    elements per block per layer and factor).

    Raises:
        ValueError: not exactly those three keys, a value that is not a positive integer, or a
            ``kv_factor`` other than 1 or 2.
    """
    expected = "expected 'num_layers=N,kv_factor=2,block_elems=E' (positive integers; kv_factor 1 or 2)"
    try:
        parts = dict(item.strip().split("=", 1) for item in text.split(","))
        dims = tuple(int(parts.pop(key)) for key in ("num_layers", "kv_factor", "block_elems"))
    except (KeyError, ValueError):
        raise ValueError(f"cannot parse kv_layout={text!r}; {expected}") from None
    if parts or min(dims) < 1 or dims[1] > 2:
        raise ValueError(f"kv_layout={text!r}: {expected}")
    return dims  # type: ignore[return-value]


class NamespaceOverrides(BaseModel):
    """Namespace fields the connector cannot read from ``llm_args`` on every TensorRT-LLM version.

    A value here REPLACES what would be derived; None means "derive it, or treat it as unknown".
    Every field here ends up in the namespace digest (docs/safety.md rule 9), see :mod:`connector.namespace`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)

    model_id: str | None = None
    """Stable model identity (e.g. a HF repo id plus revision); default ``llm_args.model``."""
    engine_version: str | None = None
    """Engine build; default ``tensorrt_llm.__version__`` (or the harness's version)."""
    kv_dtype: str | None = None
    """KV cache dtype, e.g. ``bfloat16``, ``fp8``; required when llm_args only says ``auto``."""
    kv_layout: str | None = None
    """``"num_layers=32,kv_factor=2,block_elems=4096"`` for this rank; default from the model config."""

    @field_validator("kv_layout")
    @classmethod
    def _kv_layout_parses(cls, value: str | None) -> str | None:
        if value is not None:
            kv_layout_dims(value)
        return value
    attention_backend: str | None = None
    """Token layout inside a block depends on it (NHD/HND); default ``llm_args.attn_backend``."""
    tokenizer: str | None = None
    """Tokenizer identity, mixed in when known (keys are token ids, so it cannot change bytes); default the model."""
    chat_template: str | None = None
    """Chat template identity, mixed in when known (informational for the same reason)."""
    tenant: str | None = None
    """Extra tenant scope mixed into every request's namespace (on top of ``cache_salt``)."""
    lora_task_ids: Literal["engine", "fleet"] = "engine"
    """What a request's ``lora_task_id`` names. ``engine`` (default): an adapter only inside the engine that
    assigned the id (TensorRT-LLM's own prefix reuse assumes no more), so a LoRA request reuses only its own
    engine's donors (the namespace gets ``engine_id``; without one, LoRA requests are never materialized).
    ``fleet``: every engine maps each id to the same adapter weights (you assign ids centrally), so engines
    share LoRA donors. Requests that name their adapter (the vLLM adapter: ``lora_name`` + ``lora_path``) are
    namespaced by that name instead of the id, under the same rule: a name and path, too, are trusted across
    engines only with ``fleet``."""
    extra: dict[str, str] = Field(default_factory=dict)
    """Anything else that changes KV bytes in your deployment (quantization recipe, ...)."""


class ProfitSettings(BaseModel):
    """``[profit]``: the profitability gate (:mod:`connector.profit`). A candidate is promised only
    when the prefill it saves, predicted from this engine's own recent forwards, beats its load,
    predicted from this engine's own recent loads from the same memory level, by ``margin``;
    otherwise the lookup misses with reason ``unprofitable``."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)

    enabled: bool = True
    """Off: every fresh span at least ``min_match_blocks`` long is promised (the static gate only)."""
    margin: float = Field(1.2, ge=1.0, le=1000.0)
    """Accept when ``predicted saved prefill ≥ margin × predicted load`` (1.0: any load predicted not
    slower than the prefill it replaces)."""
    window: int = Field(64, ge=2, le=4096)
    """Forwards kept per context-length bucket, and loads per memory level, to predict from."""
    min_prefill_samples: int = Field(8, ge=1)
    """Forwards that computed prompt tokens needed before the gate judges (until then it accepts)."""
    explore_every: int = Field(50, ge=0)
    """One declined candidate in this many is loaded anyway, so a load path that got faster is seen
    again (0: never)."""


class ConnectorSettings(BaseSettings):
    """Everything the connector needs. Units are in the field names."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__", frozen=True,
                                      extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False,
                                      env_ignore_empty=True)  # VAR= means unset

    config: Path | None = None
    """The TOML file these settings came from (``TRTLLM_SEMKV_CONFIG``); informational."""
    db: str = "sqlite:///semkv-ledger.db"
    """Ledger database URL or SQLite path; the consumer daemon writes the same one."""
    mode: Mode = "discovery_only"
    """``discovery_only`` (Mode 1, telemetry only), ``exact_equivalent`` (Mode 2, materialize exact KV),
    ``placement`` (Mode 3, advice only); ``experimental`` (Mode 4) is refused."""
    engine_id: Annotated[str, AfterValidator(checked_engine_id)] | None = Field(None, min_length=1, max_length=200)
    """This engine's id as the consumer knows it (no control characters); None: donors are not registered by this engine."""
    freshness_policy: FreshnessPolicy = FreshnessPolicy.ENGINE
    """``engine``: every donor block must be live in the donor engine; ``store``: bytes in the store suffice."""
    lookup_timeout_s: float = Field(0.002, gt=0, le=1.0)
    """Hard deadline of the ledger/store part of ``get_num_new_matched_tokens`` (seconds)."""
    lease_ttl_s: float = Field(60.0, gt=0, le=86_400)
    """A lease (pin on a donor) expires after this long even if never released (seconds)."""
    lease_before_answer: bool = False
    """Write the ledger lease BEFORE answering the engine (on a lookup thread, under
    ``lease_in_lookup_timeout_s``), so a donor that went stale since the donor view's last catch-up is a
    miss rather than a promise the ledger then calls stale (on vLLM its plan fails and is recomputed; on
    TensorRT-LLM it is loaded from its secured bytes and counted in ``semkv_stale_after_promise_total``).
    On TensorRT-LLM this is the only way a promise writes a ledger lease.
    Costs a ledger write transaction in every hit (~0.3-8 ms on SQLite, ~3-20 ms on PostgreSQL here),
    which the lookup budget (docs/benchmarks.md) does not allow; off by default on every engine."""
    lease_in_lookup_timeout_s: float = Field(0.05, gt=0, le=10)
    """With ``lease_before_answer``: the lookup's hard deadline (seconds) for finding the span AND writing its
    lease, instead of ``lookup_timeout_s``. A lease write takes ~0.3-8 ms on SQLite and ~3-20 ms on PostgreSQL
    here (tools/results/connector-*.md), so the 2 ms lookup deadline would miss every hit there; the engine
    waits this long at most, to save a prefill of seconds."""
    lease_confirm_timeout_s: float = Field(0.5, gt=0, le=60)
    """vLLM: a promise's ledger lease is written off the engine's path; ``build_connector_meta`` waits this
    long for it before shipping the plan (seconds). A lease refused or not committed by then ships the plan
    failed and vLLM recomputes it (counted in ``semkv_promises_broken_total``). While the connector's ledger
    thread has been busy or backed up for half of this, lookups miss (``ledger_busy``) instead of promising.
    TensorRT-LLM writes no lease (unless ``lease_before_answer``): its promises hold the donor's secured file."""
    lease_confirm_in_worker: bool = False
    """vLLM: a plan whose ledger lease is still being written when ``build_connector_meta`` runs ships at
    once, and the worker confirms the lease in the ledger itself before its first copy (its first, full
    check asks for the lease anyway), waiting for it until ``lease_confirm_timeout_s`` after the metadata
    was built. The lease's write transaction (~0.5 ms on SQLite at 8,000 tokens) then overlaps vLLM's
    hand-over of the step to its worker process instead of delaying the scheduler. No copy happens before
    the ledger shows the lease held; a lease refused for stale blocks or a stale donor fails the load at
    once (the worker's check sees why), one that never commits fails it at the deadline, and vLLM
    recomputes in both cases (counted in ``semkv_load_failures_total``, and the refusal or failure in
    ``semkv_promises_broken_total`` as before). Off: the scheduler waits for the commit (the default)."""
    donor_view_refresh_s: float = Field(0.005, ge=0)
    """The scheduler answers lookups from an in-memory view of the ledger's fresh donors (those whose bytes
    this host's store holds, with their block liveness), caught up from the ledger this often (seconds).
    0: no view, every lookup reads the ledger (slower: the lookup budget in docs/benchmarks.md needs the view)."""
    donor_view_max_blocks: int = Field(131_072, ge=1)
    """Donor blocks the view holds at most (~570 bytes each: ~71 MiB at the default); beyond it the oldest donors leave."""
    ledger_statement_timeout_s: float = Field(5.0, gt=0, le=600)
    """PostgreSQL: the server cancels any of the connector's ledger statements running longer (seconds; lock
    waits included, e.g. behind a migration's ``ACCESS EXCLUSIVE`` lock), and connecting gives up after as
    long, so a stuck ledger fails a lease, a load or a registration instead of hanging the engine (the
    worker's revalidation runs on the engine's thread). SQLite: reads never wait; writes wait at most
    ``busy_timeout`` (30 s); the donor registration at most ``register_lock_wait_s`` (the engine start
    recorded at construction keeps the 30 s)."""
    register_lock_wait_s: float = Field(5.0, gt=0, le=60)
    """``request_finished`` writes a donor's registration itself only when the ledger's write lock is free
    within 1 ms; otherwise it queues the write on the connector's ledger thread (the engine never waits for
    the lock), which waits at most this long (seconds) for the write lock (SQLite's database lock,
    PostgreSQL's lock on the log) that a consumer, a migration or another connector may hold, instead of
    30 s on SQLite and no limit on PostgreSQL; past it the request is not a donor (counted in
    ``semkv_donors_not_registered_total{reason="ledger_busy"}``) and its copied bytes are not published. The
    worker's store writer waits for the registration this long plus 10 s."""
    request_orphan_timeout_s: float = Field(120.0, gt=0, le=86_400)
    """TensorRT-LLM: a request no connector hook named for this long (seconds) is released — its promise,
    store pin, ledger lease and armed save — because the engine dropped it without ``request_finished``
    (a cancelled or failed request, in the AsyncTransferManager-era executor). A live request is named in
    every iteration that schedules it; checked every quarter of this on the connector's ledger thread, so
    a dropped request is released within 1.25 times it (``semkv_orphaned_requests_total``)."""
    donor_ttl_s: float | None = Field(3600.0, gt=0)
    """Registered donors expire after this long (seconds); None: never."""
    min_match_blocks: int = Field(1, ge=1)
    """Promise only spans of at least this many new blocks."""
    min_donor_blocks: int = Field(1, ge=1)
    """Register a finished request as a donor only if it has this many whole prompt blocks."""
    max_plans_per_iteration: int = Field(256, ge=1, le=65_536)
    """Bounds ``ConnectorMetadata``; a lookup beyond it is a miss (``plan_limit``)."""
    donor_store: Literal["file", "redis"] = "file"
    """Where donor KV bytes live. ``file`` (default, embedded): one file per donor in ``store_dir``, reachable
    only from this host. ``redis``: a Redis/Valkey server at ``redis_url`` that every host of the fleet reaches
    (connector/redis_store.py): blocks content-addressed by namespace and checksum (identical KV stored once),
    every key expiring ``redis_ttl_s`` after its last save, a donor found expired or evicted recorded in the
    ledger as ``donor_evicted``; verified entries are staged in this process's memory (``redis_stage_bytes``)
    before a lookup promises them. docs/operations.md, "A donor store every host reaches"."""
    store_dir: Path = Field(default_factory=lambda: Path(tempfile.gettempdir()) / "semkv-donors")
    """Host-local donor store directory (shared by every engine on the host; /dev/shm is a good choice). With
    ``donor_store = "redis"`` it only scopes what the engine's scheduler and worker share in one process."""
    store_capacity_bytes: int = Field(8 * GIB, ge=1)
    """Donor store capacity (``file``); unleased donors are evicted oldest first to make room. A Redis server
    bounds its own memory (``maxmemory``; the keys carry TTLs, so ``volatile-lru`` or ``allkeys-lru`` both work)."""
    redis_url: str = "redis://127.0.0.1:6379/0"
    """``donor_store = "redis"``: the server, as redis-py reads it (``redis://[user:password@]host:port/db``,
    ``rediss://`` for TLS, ``unix:///path?db=0``)."""
    redis_key_prefix: str = Field("semkv", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    """First part of every Redis key of this fleet (fleets that share a server use different ones)."""
    redis_ttl_s: float = Field(3600.0, gt=0, le=30 * 86_400)
    """Seconds a donor's blocks and manifest live in Redis after the last save that wrote or shared them
    (keep it at least ``donor_ttl_s``: a donor whose bytes expired first is a miss, recorded as evicted)."""
    redis_timeout_s: float = Field(1.0, gt=0, le=60)
    """Connect and socket timeout of each Redis call (seconds); past it the call fails closed (a miss, a failed
    load on vLLM, a dropped save), logged once per outage."""
    redis_stage_bytes: int = Field(4 * GIB, ge=0)
    """Verified Redis entries this process keeps in memory (bytes), least recently used dropped first. On
    TensorRT-LLM a lookup promises only staged entries (a promise cannot be retracted, so its bytes must
    not depend on the network at load time). The vLLM adapter keeps none (only which entries were
    verified): its loads fetch from Redis, and a failed load is recomputed."""
    store_inline_verify_max_bytes: int = Field(4 * 2**20, ge=0)
    """A donor entry not yet verified by this process is checksummed inside the lookup when it is at
    most this big; bigger ones are verified in the background (and missed until then)."""
    store_recheck_s: float = Field(0.05, ge=0)
    """How often (seconds) a periodic job on the connector's ledger thread stats donor store entries this
    process has checksummed (up to 256 per run, round robin) and forgets any whose file changed or vanished,
    so that the lookup trusts its record without a ``stat`` on the engine's thread. On TensorRT-LLM a
    promise holds the checksummed file itself (kept open), so a path removed or replaced after the check
    cannot reach it; a file written IN PLACE is caught within ``ceil(entries / 256)`` runs, and before that
    by the worker's per-layer checksums (connector/README.md, "What a promise means"). 0: stat the entry in
    every lookup (a system call on the engine's thread in every hit; an entry found gone is forgotten
    then, and the file this process held open for it closed)."""
    save_queue_max: int = Field(64, ge=1)
    """Donor saves in flight (being copied out of the KV pool, or waiting for the background writer); beyond
    it a save is dropped (``semkv_donor_saves_total{outcome="queue_full"}``) and its blocks are released at once."""
    save_copy: Literal["side", "engine_thread"] = "side"
    """How a finished donor's blocks leave the KV pool. ``side`` (default): the engine's thread only enqueues;
    a side worker copies them into reusable host buffers (pinned, on a CUDA side stream ordered after the
    forward by an event, when the pool is on a GPU; a background thread on the CPU) and ``get_finished``
    reports the request (so the engine frees its blocks) only once that copy has completed. When no other
    request of the engine is live (or the worker cannot tell: vLLM, TensorRT-LLM ranks > 0), the copy is made
    on the engine's thread in that ``get_finished``: an idle TensorRT-LLM executor blocks and calls no hook,
    so an id left for a later call would pin the blocks until the next request, and that wait delays no
    other request (connector/README.md, "Saves off the engine's thread"). ``engine_thread``: the copy runs synchronously on the engine's
    thread (the behaviour before 2026-12-05, kept for comparison: tools/bench_saves.py)."""
    save_in_discovery_only: bool = False
    """In ``discovery_only`` mode, register finished requests as donors and save their KV (for other engines
    to load). Off by default: saving holds a finished request's blocks until its copy completes and costs the
    engine's thread the enqueue and a ledger write per donor (tools/results/saves-2026-12-05.md), and
    ``discovery_only`` promises to change nothing in the engine. Other modes always save."""
    load_before_forward: bool | None = None
    """vLLM: copy every layer of every plan in ``start_load_kv``, before the forward, instead of layer by
    layer in ``wait_for_layer_load`` (then the load overlaps the forward). None: layer by layer. TensorRT-LLM
    always loads before the forward, whatever this says: an exception inside its forward fails the whole
    batch and stores the batch's blocks for reuse, so every check that can fail must run before it
    (connector/README.md, "What a promise means")."""
    load_async: bool = False
    """vLLM: answer a hit ``(n, True)`` (vLLM's asynchronous load): the request waits in
    ``WAITING_FOR_REMOTE_KVS`` while a thread of the worker loads every layer — the same checks as a
    synchronous load: the ledger read again before each layer's copy, each layer's checksum verified before
    any of its bytes is copied — and reports it in ``get_finished``; only then does vLLM schedule it. A
    failed load is reported as a failed receive: vLLM recomputes the request
    (``kv_load_failure_policy="recompute"``) or fails it (``"fail"``), and the connector promises that
    request nothing again. Other requests' forwards go on meanwhile, where a synchronous load holds up the
    whole step; a lone request waits at least one more engine step (tools/results/vllm-cpu-2026-12-05.md
    has both side by side). One loader thread runs the asynchronous loads one after another; each layer's
    liveness re-check follows ``per_layer_block_check`` as a synchronous load's does. A vLLM without
    ``get_transfer_results`` (before 0.32) loads synchronously instead, with a warning at start. Off (the
    default): synchronous loads. TensorRT-LLM ignores it (its loads are always synchronous here)."""
    per_layer_block_check: bool | None = None
    """Re-check donor block liveness (policy ``engine``) before every layer, not only before layer 0.
    Unset (the default): on when the worker loads layer by layer (vLLM's default), where the forward
    runs between two layers' copies and a donor block removed on its engine meanwhile must fail the
    plan (vLLM then recomputes it); off when every layer is copied at once before the forward
    (``load_before_forward``, and always on TensorRT-LLM, which keeps a promised load going on its
    secured bytes anyway). Cost, on the engine's thread: per layer, one statement over the plan's
    donor blocks on top of the state check (~30 µs SQLite, ~0.2 ms PostgreSQL): +3-6 µs per donor
    block on SQLite, +11-14 µs on PostgreSQL (a 2,048-block plan: ~8 / ~23 ms per layer); a 32-layer,
    8K-token load's revalidation went from 1-2 % to 4-7 % of its copy time (tools/bench_connector.py
    synthetic load, SQLite; measured on a 2-core VM shared with other work). On SQLite a layer's check
    after a fresh one of the same load costs ~3 µs while no connection committed anything since
    (``PRAGMA data_version``; any commit, or an expiry passed, and it reads the ledger again)."""
    window_size: int | None = Field(None, ge=1)
    """Attention window the engine reports in KV events; default from llm_args (max_seq_len)."""
    attention_dp_rank: int = Field(0, ge=0)
    """Rank whose blocks this engine's donors live in (the KV events' ``attention_dp_rank``), for an engine
    WITHOUT attention DP (a vLLM data-parallel rank is one engine). Under TensorRT-LLM's attention DP every rank
    reads the same settings: leave it unset, each rank's donors take the rank TensorRT-LLM reports
    (``SchedulerOutput.attention_dp_rank``); a value set that disagrees stops that rank registering donors."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Serve ``/metrics`` on this port (+ the process's rank); None: no server."""
    metrics_host: str = Field("127.0.0.1", min_length=1)
    """Address the ``/metrics`` server listens on: loopback by default (plain HTTP, no authentication); set
    ``0.0.0.0`` (or an interface's address) to let a remote Prometheus scrape."""
    namespace: NamespaceOverrides = Field(default_factory=NamespaceOverrides)
    discovery: DiscoverySettings = Field(default_factory=DiscoverySettings)
    profit: ProfitSettings = Field(default_factory=ProfitSettings)
    """Donor discovery (``[discovery]``, ``TRTLLM_SEMKV_DISCOVERY__*``; :mod:`connector.discovery.settings`):
    off unless ``enabled``; evidence and telemetry only, it never changes what the engine is told."""

    @field_validator("mode", mode="before")
    @classmethod
    def _refuse_experimental(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() == "experimental":
            raise ValueError("mode 'experimental' (Mode 4: approximate donor KV) is refused: the connector never "
                             "commits approximate KV as reusable cache state (docs/safety.md rule 5); use "
                             "discovery_only, exact_equivalent or placement")
        return value

    @field_validator("redis_url")
    @classmethod
    def _check_redis_url(cls, value: str) -> str:
        """Parsed by redis-py's own parser (``redis.connection.parse_url``), which the store's client
        uses, plus what it lets through: a host, and a path that is a database number."""
        from urllib.parse import urlparse

        from redis.connection import parse_url

        form = "redis://host:port/db, rediss://..., unix:///path"
        if not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"{value!r} is not a Redis URL ({form})")
        try:
            parsed = parse_url(value)
        except ValueError as exc:
            raise ValueError(f"{value!r} is not a Redis URL ({form}): {exc}") from None
        if value.startswith("unix://"):
            if not parsed.get("path"):
                raise ValueError(f"{value!r} names no socket path ({form})")
            return value
        path = urlparse(value).path.strip("/")
        if not parsed.get("host") or (path and not path.isdigit()):
            raise ValueError(f"{value!r} needs a host and, if any, a database number as its path ({form})")
        return value

    @field_validator("db")
    @classmethod
    def _check_db(cls, value: str) -> str:
        from ledger.db import normalize_url
        from ledger.errors import LedgerError

        try:
            normalize_url(value)
        except (LedgerError, ValueError) as exc:  # pydantic reports ValueErrors with the field's name
            raise ValueError(str(exc)) from None
        return value

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        config_file = _CONFIG_FILE.get()
        if config_file is None:
            return init_settings, env_settings
        return init_settings, env_settings, TomlConfigSettingsSource(settings_cls, toml_file=config_file)

    @property
    def materializes(self) -> bool:
        """Whether this mode may ever promise tokens (only ``exact_equivalent``)."""
        return self.mode == "exact_equivalent"


def load_connector_settings(overrides: Mapping[str, Any] | None = None, *,
                            environ: Mapping[str, str] | None = None) -> ConnectorSettings:
    """Build the settings from overrides, ``TRTLLM_SEMKV_*`` variables and the TOML file.

    Args:
        overrides: values that win over everything (None values are ignored).
        environ: the environment to read the TOML path from (default ``os.environ``); the
            ``TRTLLM_SEMKV_*`` field variables are always read from ``os.environ`` by pydantic-settings.

    Raises:
        ConnectorConfigError: the TOML file is missing or unreadable, or a setting is invalid; the
            message names every bad setting (``lookup_timeout_s: Input should be greater than 0``).
    """
    env = os.environ if environ is None else environ
    path_text = env.get(CONFIG_ENV)
    path = Path(path_text) if path_text else None
    if path is not None and not path.is_file():
        why = "is a directory, not a connector config file" if path.is_dir() else "connector config file not found"
        raise ConnectorConfigError(f"{CONFIG_ENV}={path_text}: {why}")
    values = {k: v for k, v in (overrides or {}).items() if v is not None}
    if path is not None:
        values.setdefault("config", path)
    token = _CONFIG_FILE.set(path)
    try:
        return ConnectorSettings(**values)
    except ValidationError as exc:
        raise ConnectorConfigError(_describe(exc, path, values)) from None
    except SettingsError as exc:  # a list or table from the environment that is not JSON
        raise ConnectorConfigError(f"invalid connector setting: {explain_settings_error(exc, ENV_PREFIX)}") from None
    except Exception as exc:  # TOML syntax errors, bad URLs (LedgerError): name the source
        where = f" (config file {path})" if path else ""
        raise ConnectorConfigError(f"invalid connector settings{where}: {' '.join(str(exc).split())}") from None
    finally:
        _CONFIG_FILE.reset(token)


def unknown_env_settings(environ: Mapping[str, str] | None = None) -> list[str]:
    """``TRTLLM_SEMKV_*`` variables of ``environ`` (default ``os.environ``) that name no setting:
    pydantic-settings ignores them, so a typo (``TRTLLM_SEMKV_MDOE``) would leave the default in
    force without a word. (A variable under a table, ``TRTLLM_SEMKV_DISCOVERY__…``, is checked by
    the table's own model, which refuses unknown keys.)"""
    env = os.environ if environ is None else environ
    known = {ENV_PREFIX + name.upper() for name in ConnectorSettings.model_fields} | {CONFIG_ENV}
    tables = tuple(ENV_PREFIX + name.upper() + "__" for name, field in ConnectorSettings.model_fields.items()
                   if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel))
    return sorted(name for name in env if name.upper().startswith(ENV_PREFIX)
                  and name.upper() not in known and not name.upper().startswith(tables))


def _describe(exc: ValidationError, path: Path | None, overrides: Mapping[str, Any]) -> str:
    problems = []
    for error in exc.errors():
        name = ".".join(str(part) for part in error["loc"]) or "settings"
        message = error["msg"].removeprefix("Value error, ")
        origin = setting_origin(tuple(str(part) for part in error["loc"]), config=path, overrides=overrides)
        problems.append(f"{name}: {message} (setting '{name}', {origin})")
    return f"invalid connector setting{'s' if len(problems) > 1 else ''}: " + "; ".join(problems)


def setting_origin(loc: str | tuple[str, ...], *, config: Path | None, overrides: Mapping[str, Any] | None = None,
                   environ: Mapping[str, str] | None = None) -> str:
    """Where the value of setting ``loc`` (``"db"``, or ``("namespace", "kv_dtype")``) came from,
    in :func:`load_connector_settings`' order of priority, for error messages: ``given directly``
    (an override), ``from env TRTLLM_SEMKV_…`` (the variable, or one naming a table above it),
    ``from FILE`` (the TOML file ``config`` holds it), else ``default; env TRTLLM_SEMKV_…`` (how
    to set it). A TOML file that cannot be parsed counts as not holding it."""
    parts = (loc,) if isinstance(loc, str) else loc
    env_name = ENV_PREFIX + "__".join(parts).upper()
    if _lookup(overrides or {}, parts):
        return "given directly"
    env_names = {key.upper() for key in (os.environ if environ is None else environ)}
    for depth in range(len(parts), 0, -1):  # TRTLLM_SEMKV_NAMESPACE='{...}' sets a whole table
        name = ENV_PREFIX + "__".join(parts[:depth]).upper()
        if name in env_names:
            return f"from env {name}"
    if config is not None and _lookup(_toml_values(config), parts):
        return f"from {config}"
    return f"default; env {env_name}"


def _lookup(values: Mapping[str, Any], parts: tuple[str, ...]) -> bool:
    for part in parts:
        if not isinstance(values, Mapping) or part not in values:
            return False
        values = values[part]
    return True


def _toml_values(path: Path) -> Mapping[str, Any]:
    import tomllib

    try:
        with path.open("rb") as file:
            return tomllib.load(file)
    except (OSError, tomllib.TOMLDecodeError):
        return {}


def settings_markdown() -> str:
    """The connector's settings page (``docs/connector-settings.md``), generated from the models."""
    from connector.discovery.settings import DiscoverySettings
    from ledger.settings_doc import model_rows

    header = ["| setting (TOML key) | environment | default | meaning |", "|---|---|---|---|"]
    return "\n".join([
        "# Connector settings", "",
        "Generated from `connector/settings.py` by `python -m connector.settings > docs/connector-settings.md`",
        "(a test fails when this file and the models disagree).",
        f"Priority: environment > TOML file (named by `{CONFIG_ENV}`) > default. Only `TRTLLM_*` variables",
        "reach TensorRT-LLM's MPI workers; vLLM takes the file from",
        "`kv_connector_extra_config={\"semkv_config\": ...}` and single values from `\"semkv_settings\"`.",
        "`semkv-ledger connector-check --config FILE` validates a file. An empty variable counts as unset; one",
        "naming no setting is warned about (connector-check, and the scheduler's log at start). Numbers are finite.",
        "",
        *header, *model_rows(ConnectorSettings, env_prefix=ENV_PREFIX, skip=frozenset({"namespace", "discovery", "profit"})), "",
        "## `[namespace]`: fields the connector cannot always read from the engine", "",
        *header, *model_rows(NamespaceOverrides, env_prefix=ENV_PREFIX, key_prefix="namespace."), "",
        "## `[discovery]`: semantic donor discovery (evidence and telemetry only)", "",
        *header, *model_rows(DiscoverySettings, env_prefix=ENV_PREFIX, key_prefix="discovery."), "",
        "## `[profit]`: the profitability gate (reuse only when it pays)", "",
        "Learnt per engine from its own forwards and loads (`connector/profit.py`); a decline is a miss",
        "`unprofitable`, also in `semkv_backend_declined_total{reason}`. TensorRT-LLM ranks other than 0",
        "and engines whose worker runs in another process than their scheduler never teach it: there the",
        "gate lets every candidate through.", "",
        *header, *model_rows(ProfitSettings, env_prefix=ENV_PREFIX, key_prefix="profit."), ""])


if __name__ == "__main__":
    print(settings_markdown(), end="")

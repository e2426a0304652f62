"""Discovery as the connector's scheduler drives it: :class:`SchedulerDiscovery`.

:class:`connector.scheduler.SemKvScheduler` holds one of these when discovery is on (``[discovery]
enabled = true``, or a service passed as ``SemKvScheduler(..., discovery=service)``) and calls it at
three points; none of them can change what the engine is told or raise into it (DESIGN §2 rules 2
and 4), every failure is logged and ignored:

* :meth:`SchedulerDiscovery.observe` — from ``get_num_new_matched_tokens`` AFTER its answer is fixed:
  the prompt goes to the service's discovery thread (``lookup_async``: off the block-manager lock,
  background deadline, may embed; a full queue drops it, counted) or, with ``inline = true``, to
  :meth:`DiscoveryService.lookup` on the calling thread, bounded by ``lookup_timeout_s`` (providers
  answer from their indexes only);
* :meth:`SchedulerDiscovery.donor_record` — from ``request_finished`` for a new donor: a
  :class:`DonorRecord` (the donor's whole prompt blocks' tokens, the generation it was registered
  in, its text when allowed), which :meth:`SchedulerDiscovery.index_donor` puts on the service's
  bounded index queue from the connector's ledger thread once the registration was written there
  (the registration's write is queued on that thread, in order); the indexer thread checks
  the ledger and drops it when the donor is stale or its generation is no longer the engine's;
* :meth:`flush` / :meth:`close` — the service is closed only if the scheduler built it.

Prompt text: TensorRT-LLM's ``LlmRequest`` carries token ids only. ``text_of(request)`` supplies text
when the serving layer has it (default :func:`~connector.discovery.types.request_text`); it is called
only when ``allow_prompt_text`` is set.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from connector.discovery.types import DonorRecord, readonly_tokens, request_text
from connector.namespace import Namespace

if TYPE_CHECKING:
    from connector.discovery.service import DiscoveryService
    from connector.discovery.settings import DiscoverySettings

__all__ = ["SchedulerDiscovery"]

log = logging.getLogger(__name__)


class SchedulerDiscovery:
    """See the module docstring. Built by :meth:`start`; used on the scheduler's thread only.

    Args:
        service: the discovery service.
        owns_service: close it in :meth:`close` (the scheduler built it).
        ledger: the scheduler's ledger client.
        metrics: the connector's metrics (``semkv_semantic_lookups_total``).
        engine_id, model_id, tokens_per_block: this engine's, as in its donors and namespace.
        text_of: ``request -> str | None`` (default :func:`request_text`).
    """

    def __init__(self, service: DiscoveryService, *, owns_service: bool, ledger: Any, metrics: Any,
                 engine_id: str, model_id: str, tokens_per_block: int,
                 text_of: Callable[[Any], str | None] | None = None) -> None:
        self.service, self.owns_service = service, owns_service
        self.metrics, self.engine_id, self.model_id, self.tokens_per_block = metrics, engine_id, model_id, tokens_per_block
        self.text_of = text_of or request_text

    @classmethod
    def start(cls, settings: DiscoverySettings, service: DiscoveryService | None, *, db: str, registry: Any,
              **kwargs: Any) -> SchedulerDiscovery | None:
        """``service`` if given (shared, not owned), else a service built from ``settings`` on ``db``
        counting on ``registry`` when ``settings.enabled``; None when discovery is off.

        Raises:
            ConnectorConfigError: a provider cannot be built.
        """
        owns = service is None
        if owns:
            if not settings.enabled:
                return None
            from connector.discovery.service import DiscoveryService  # only when on: providers, datasketch

            service = DiscoveryService(settings, db=db, registry=registry)
        assert service is not None
        return cls(service, owns_service=owns, **kwargs)

    def _text(self, request: Any) -> str | None:
        return self.text_of(request) if self.service.settings.allow_prompt_text else None

    def observe(self, request: Any, namespace_of: Callable[[Any], Any]) -> None:
        """Show a prompt to discovery (queued, or inline under its deadline). Never raises.

        Args:
            namespace_of: ``request -> Namespace | NamespaceUnknown`` (the scheduler's, which reuses
                what its lookup computed); an unknown namespace makes the lookup ``policy_denied``.
        """
        try:
            tpb = self.tokens_per_block
            prompt_len = int(request.prompt_len)
            if prompt_len < tpb:
                return
            ns = namespace_of(request)
            digest = ns.digest if isinstance(ns, Namespace) else ""  # unknown namespace: policy_denied
            tokens = request.get_tokens(0)[:prompt_len]
            text, rid = self._text(request), str(request.request_id)
            self.metrics.semantic_lookups.inc()
            if self.service.settings.inline:
                self.service.lookup(tokens, text, self.model_id, digest, tokens_per_block=tpb, request_id=rid)
            else:
                self.service.lookup_async(tokens, text, self.model_id, digest, tokens_per_block=tpb, request_id=rid)
        except Exception:  # boundary (DESIGN §2 rules 2 and 4): discovery never affects the engine
            log.exception("semkv: discovery failed for request %s", getattr(request, "request_id", "?"))

    def donor_record(self, request: Any, save: Any, donor: Any) -> DonorRecord | None:
        """What indexing a new donor needs, read on the engine's thread (the request's tokens and
        text): ``save`` its :class:`~connector.plan.SaveInstruction`, ``donor`` its
        ``donor_registered`` event. Never raises (None: logged)."""
        try:
            num_tokens = save.num_blocks * save.tokens_per_block
            return DonorRecord(
                donor_id=save.donor_id, engine_id=self.engine_id, namespace=save.namespace, model_id=self.model_id,
                token_ids=readonly_tokens(request.get_tokens(0)[:num_tokens]), tokens_per_block=save.tokens_per_block,
                generation=donor.generation, text=self._text(request))
        except Exception:  # boundary: a donor we failed to index is still a donor
            log.exception("semkv: discovery could not read donor %s", getattr(save, "donor_id", "?"))
            return None

    def index_donor(self, record: DonorRecord) -> None:
        """Queue ``record`` for indexing, once its registration is in the ledger (the indexer drops a
        donor the ledger does not know): the scheduler calls it on its ledger thread, behind the
        registration. Never blocks, never raises (a full queue drops it, counted)."""
        try:
            self.service.register_donor(record)
        except Exception:  # boundary: a donor we failed to index is still a donor
            log.exception("semkv: discovery could not queue donor %s", record.donor_id)

    def flush(self, timeout_s: float) -> bool:
        """Wait until queued lookups ran and queued donors are indexed (False: closed or timed out)."""
        return self.service.flush(timeout_s)

    def close(self) -> None:
        """Close the service if the scheduler built it (an injected one is its owner's to close)."""
        if not self.owns_service:
            return
        try:
            self.service.close()
        except Exception:  # shutdown goes on
            log.exception("semkv: closing the discovery service failed")

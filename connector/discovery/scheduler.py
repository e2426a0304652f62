"""The connector's scheduler with discovery hooked in: :class:`DiscoveringScheduler`.

A subclass of :class:`connector.scheduler.SemKvScheduler` that changes nothing the engine sees: it
calls the parent's hooks and returns their answers unchanged, so KV, promises and materialization
are exactly those of ``SemKvScheduler`` in every mode (DESIGN §2 rule 2). Around them it:

* ``get_num_new_matched_tokens`` — after the parent answered, asks the :class:`DiscoveryService`
  about the prompt: by default queued to the discovery thread (``lookup_async``: off the
  block-manager lock, background deadline, may embed); with ``[discovery] inline = true`` on the
  calling thread, bounded by ``lookup_timeout_s`` (providers answer from their indexes only). Any
  failure is logged and ignored; the parent's ``(n, False)`` is returned either way.
* ``request_finished`` — when the parent registered a donor, queues a :class:`DonorRecord` (its
  whole-block tokens, and its text when allowed) for indexing.

Prompt text: TensorRT-LLM's ``LlmRequest`` carries token ids only. ``text_of(request)`` supplies
text when the serving layer has it (default: a ``prompt_text``/``py_prompt_text`` string attribute,
else None); it is used only when ``allow_prompt_text`` is set.

This is the seam until ``SemKvScheduler`` takes a ``discovery`` argument itself (the change is
described in ``connector/discovery/__init__.py``); it reads the parent's ``namespace``,
``tokens_per_block``, ``settings``, ``metrics`` and wraps its ``_donors`` registrar.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from connector.discovery.service import DiscoveryService
from connector.discovery.settings import DiscoverySettings, load_discovery_settings
from connector.discovery.types import DonorRecord, readonly_tokens
from connector.namespace import Namespace
from connector.scheduler import SemKvScheduler

__all__ = ["DiscoveringScheduler", "request_text"]

log = logging.getLogger(__name__)


def request_text(request: Any) -> str | None:
    """The request's prompt text if the serving layer attached one (``prompt_text``/``py_prompt_text``)."""
    for name in ("prompt_text", "py_prompt_text"):
        value = getattr(request, name, None)
        if isinstance(value, str):
            return value
    return None


class DiscoveringScheduler(SemKvScheduler):
    """``SemKvScheduler`` plus discovery telemetry (see the module docstring).

    Args:
        llm_args: as for ``SemKvScheduler``.
        discovery: a service to share (e.g. between engines of one process); default: one built from
            ``discovery_settings`` on this scheduler's ledger, counting on its metrics registry.
        discovery_settings: default :func:`load_discovery_settings` (``[discovery]`` of the TOML).
        text_of: ``request -> str | None`` prompt text source (default :func:`request_text`).
        **kwargs: passed to ``SemKvScheduler`` (settings, ledger, store, metrics).
    """

    def __init__(self, llm_args: Any, *, discovery: DiscoveryService | None = None,
                 discovery_settings: DiscoverySettings | None = None,
                 text_of: Callable[[Any], str | None] | None = None, **kwargs: Any) -> None:
        super().__init__(llm_args, **kwargs)
        self._owns_discovery = discovery is None
        if discovery is None:
            discovery = DiscoveryService(discovery_settings or load_discovery_settings(), db=self.settings.db,
                                         registry=self.metrics.registry)
        self.discovery = discovery
        self.discovery_settings = discovery.settings
        self._text_of = text_of or request_text
        self._donors = _IndexingRegistrar(self._donors, self)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """The parent's answer, unchanged; discovery observes the prompt (bounded or queued)."""
        answer = super().get_num_new_matched_tokens(request, num_computed_tokens)
        try:
            self._observe(request)
        except Exception:  # boundary (DESIGN §2 rule 4): discovery never affects the engine
            log.exception("semkv: discovery failed for request %s", getattr(request, "request_id", "?"))
        return answer

    def _observe(self, request: Any) -> None:
        tpb = self.tokens_per_block
        tokens = request.get_tokens(0)[: int(request.prompt_len)]
        if len(tokens) < tpb:
            return
        ns = self.namespace.for_request(request)
        digest = ns.digest if isinstance(ns, Namespace) else ""  # unknown namespace: policy_denied
        text = self._text_of(request) if self.discovery_settings.allow_prompt_text else None
        rid = str(request.request_id)
        self.metrics.semantic_lookups.inc()
        if self.discovery_settings.inline:
            self.discovery.lookup(tokens, text, self.model_id, digest, tokens_per_block=tpb, request_id=rid)
        else:
            self.discovery.lookup_async(tokens, text, self.model_id, digest, tokens_per_block=tpb, request_id=rid)

    @property
    def model_id(self) -> str:
        """The deployment's model id (the namespace's ``model_id`` field), or ``""`` when unknown."""
        return (self.namespace.fields or {}).get("model_id", "")

    def index_donor(self, request: Any, donor_id: str, namespace: str, num_tokens: int) -> None:
        """Queue a registered donor's first ``num_tokens`` prompt tokens (and text if allowed) for indexing."""
        text = self._text_of(request) if self.discovery_settings.allow_prompt_text else None
        self.discovery.register_donor(DonorRecord(
            donor_id=donor_id, engine_id=self.settings.engine_id or "", namespace=namespace, model_id=self.model_id,
            token_ids=readonly_tokens(request.get_tokens(0)[:num_tokens]), tokens_per_block=self.tokens_per_block,
            text=text))

    def flush(self, timeout_s: float = 30.0) -> None:
        super().flush(timeout_s)
        self.discovery.flush(timeout_s)

    def close(self) -> None:
        super().close()
        if self._owns_discovery:
            self.discovery.close()


class _IndexingRegistrar:
    """Wraps the parent's ``DonorRegistrar``: a registered donor is also queued for indexing."""

    def __init__(self, inner: Any, scheduler: DiscoveringScheduler) -> None:
        self._inner, self._scheduler = inner, scheduler

    def register(self, request: Any, block_ids: list[int], **kwargs: Any) -> Any:
        save = self._inner.register(request, block_ids, **kwargs)
        if save is not None:
            try:
                self._scheduler.index_donor(request, save.donor_id, save.namespace,
                                            save.num_blocks * save.tokens_per_block)
            except Exception:  # boundary: a donor we failed to index is still a donor
                log.exception("semkv: discovery could not queue donor %s", save.donor_id)
        return save

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

"""Donor registration: a finished request becomes a donor (DESIGN §3 "donor"; scheduler side).

Called from ``request_finished`` on the scheduler rank, synchronously and cheaply: one fast read
(is the same span already a live donor?), one ledger read (the engine's generation) and one ledger
write (``donor_registered``). The worker then saves the bytes (:class:`~connector.plan.SaveInstruction`)
and the store appends ``donor_saved``; only then can a lookup find the donor.

A request is registered only when its prefill completed (at least one token was generated: a
request that failed before that, e.g. because its own load failed, may hold partial KV), when it
has at least ``min_donor_blocks`` whole prompt blocks, and when its namespace is fully known. The
donor covers the whole blocks of the PROMPT (``prompt_len // tokens_per_block``): generated tokens'
KV is computed by decode steps, and is left out so that every donor block is prefill KV.

Engine block hashes (for freshness policy ``engine``) come from ``RequestData.block_hashes`` (newer
TensorRT-LLM) or, on 1.2 where that field does not exist, are recomputed with ``v1_block_key``
(1.1/1.2's salt id is BLAKE3, which Python reproduces; WIRE.md §A.1).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from connector.block_keys import request_v1_hashes
from connector.namespace import DeploymentNamespace, Namespace, content_keys, probe_key
from connector.plan import SaveInstruction
from connector.settings import ConnectorSettings
from ledger import events as ev
from ledger.errors import LedgerError

__all__ = ["DonorRegistrar", "LedgerBusy", "prefill_completed"]


class LedgerBusy(LedgerError):
    """A donor registration skipped because the caller is backing off a busy ledger."""


class DonorRegistrar:
    """Registers finished requests as donors. See the module docstring for the rules."""

    def __init__(self, settings: ConnectorSettings, namespace: DeploymentNamespace, ledger: Any, reader: Any,
                 metrics: Any, tokens_per_block: int, window_size: int) -> None:
        self.settings, self.namespace, self.ledger, self.reader = settings, namespace, ledger, reader
        self.metrics, self.tokens_per_block, self.window_size = metrics, tokens_per_block, window_size

    def candidate(self, request: Any, block_ids: list[int], namespace: Any = None) -> tuple[Namespace, int] | None:
        """``(namespace, whole prompt blocks)`` when ``request`` can become a donor once its prefill
        completes (an engine id, at least ``min_donor_blocks`` whole prompt blocks allocated, a known
        namespace and layout); None otherwise. No ledger access."""
        n = int(request.prompt_len) // self.tokens_per_block
        if self.settings.engine_id is None or n < self.settings.min_donor_blocks or len(block_ids) < n:
            return None
        ns = namespace if isinstance(namespace, Namespace) else self.namespace.for_request(request)
        if not isinstance(ns, Namespace) or self.namespace.layout is None:
            return None
        return ns, n

    def instruction(self, request: Any, block_ids: list[int], ns: Namespace, n: int, *, donor_id: str,
                    on_finish: bool = False) -> SaveInstruction:
        """What the worker saves for donor ``donor_id``: the request's first ``n`` blocks."""
        assert self.namespace.layout is not None  # candidate() checked it
        prompt = request.get_tokens(0)[: int(request.prompt_len)]
        return SaveInstruction(
            request_id=request.request_id, donor_id=donor_id, block_ids=tuple(int(b) for b in block_ids[:n]),
            num_blocks=n, tokens_per_block=self.tokens_per_block, namespace=ns.digest,
            layout=self.namespace.layout.describe(), probe=probe_key(prompt), namespace_fields=dict(ns.fields),
            on_finish=on_finish)

    def register(self, request: Any, block_ids: list[int], *, namespace: Any = None, keys: list[bytes] | None = None,
                 block_hashes: list[int] | None = None, donor_id: str | None = None,
                 ledger_access: Callable[[], AbstractContextManager[Any]] | None = None) -> SaveInstruction | None:
        """Register ``request`` as a donor; returns what the worker must save, or None (not a donor).

        Args:
            block_ids: the request's blocks in token order (``cache_block_ids`` of ``request_finished``).
            namespace, keys: what the lookup already computed for this request, if anything.
            block_hashes: the engine's hashes of the request's full blocks (``RequestData.block_hashes``).
            donor_id: the id to register under (an armed save's); default a new one.
            ledger_access: entered once the request qualifies, around every ledger access (the
                caller bounds the write lock's wait there, or raises :class:`LedgerBusy` while it
                backs off a busy ledger).

        Raises:
            PersistenceError, EventRejected: the ledger refused (the caller treats it as "no donor").
            LedgerBusy: from ``ledger_access``.
        """
        found = self.candidate(request, block_ids, namespace)
        if found is None or not prefill_completed(request):
            return None
        ns, n = found
        prompt = request.get_tokens(0)[: int(request.prompt_len)]
        keys = list((keys if keys is not None and len(keys) >= n else content_keys(ns, prompt, self.tokens_per_block, n))[:n])
        donor_id = donor_id or uuid.uuid4().hex
        with ledger_access() if ledger_access is not None else contextlib.nullcontext():
            if not self._write(request, ns, keys, block_hashes, donor_id):
                return None
        self.metrics.donors_registered.inc()
        return self.instruction(request, block_ids, ns, n, donor_id=donor_id)

    def _write(self, request: Any, ns: Namespace, keys: list[bytes], block_hashes: list[int] | None,
               donor_id: str) -> bool:
        """Register the donor in the ledger; False when the same span already is a fresh donor (or
        its engine block hashes cannot be known)."""
        s, n, tpb = self.settings, len(keys), self.tokens_per_block
        existing = self.reader.find_span(ns.digest, keys, time.time(), min_blocks=n)
        if existing is not None and existing.num_blocks >= n and (
                s.freshness_policy != "engine" or self.reader.live_prefix(existing, n) >= n):
            return False  # the same bytes are already a fresh donor
        hashes = block_hashes[:n] if block_hashes and len(block_hashes) >= n else request_v1_hashes(request, tpb, n)
        if hashes is None:
            return False
        engine = self.ledger.engine(s.engine_id)
        self.ledger.register_donor(ev.DonorRegistered(
            donor_id=donor_id, namespace=ns.digest, engine_id=s.engine_id,
            generation=engine.generation if engine else 1, content_keys=keys, block_hashes=hashes,
            num_tokens=n * tpb, tokens_per_block=tpb,
            expires_at=time.time() + s.donor_ttl_s if s.donor_ttl_s else None,
            attention_dp_rank=s.attention_dp_rank, window_size=self.window_size))
        return True


def prefill_completed(request: Any) -> bool:
    """At least one token was generated: the prompt's KV is complete (a request that failed before
    that, e.g. in its first forward, may hold partial KV)."""
    return len(request.get_tokens(0)) > int(request.prompt_len)


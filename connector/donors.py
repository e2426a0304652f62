"""Donor registration: a finished request becomes a donor (DESIGN §3 "donor"; scheduler side).

Decided in ``request_finished`` on the scheduler rank, synchronously and cheaply: one fast read
(is the same span already a live donor?) and one ledger read (the engine's generation) give the
``donor_registered`` event (:meth:`DonorRegistrar.prepare`). Its WRITE needs the ledger's write
lock, which another process (the consumer, a migration) may hold for a while: it is made on the
engine's thread only when the lock is free at once, else on the connector's ledger thread
(:meth:`DonorRegistrar.write`; :mod:`connector.saves` decides). The worker saves the bytes
(:class:`~connector.plan.SaveInstruction`) once the registration is in the ledger, and the store
appends ``donor_saved``; only then can a lookup find the donor.

A request is registered only when its prefill completed (at least one token was generated: a
request that failed before that, e.g. because its own load failed, may hold partial KV), when it
has at least ``min_donor_blocks`` whole prompt blocks, and when its namespace is fully known. The
donor covers the whole blocks of the PROMPT (``prompt_len // tokens_per_block``): generated tokens'
KV is computed by decode steps, and is left out so that every donor block is prefill KV.

Engine block hashes (for freshness policy ``engine``) come from ``RequestData.block_hashes`` (newer
TensorRT-LLM) or, on 1.2 where that field does not exist, are recomputed with ``v1_block_key``
(1.1/1.2's salt id is BLAKE3, which Python reproduces; WIRE.md §A.1).

A donor is registered under the attention-DP rank whose blocks hold it (:class:`DonorRank`): the
ledger reads a donor's block liveness from the blocks of its ``(engine_id, attention_dp_rank,
window_size)`` stream only (ledger/reads.py ``_FIRST_DEAD``, ledger/liveness.py), and ranks of one
engine serving the same prefix hold blocks of the same hashes — a donor registered under another
rank than its owner's would look fresh while its owner has evicted its blocks. Under attention DP
the rank is the one TensorRT-LLM reports in ``SchedulerOutput.attention_dp_rank``; a request
finishing before any report, or a report that contradicts an earlier one or the settings, registers
no donor (``semkv_donors_not_registered_total{reason="attention_dp_rank_unknown"|"attention_dp_rank_conflict"}``).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, NamedTuple

from connector.block_keys import request_v1_hashes
from connector.namespace import DeploymentNamespace, Namespace, content_keys, probe_key
from connector.plan import SaveInstruction
from connector.settings import ConnectorSettings
from ledger import events as ev

__all__ = ["DonorRank", "DonorRegistrar", "Donation", "prefill_completed"]


class Donation(NamedTuple):
    """What :meth:`DonorRegistrar.prepare` decided: the registration to write, and the namespace and
    whole prompt blocks the donor's save instruction is made from."""

    event: ev.DonorRegistered
    namespace: Namespace
    num_blocks: int


log = logging.getLogger(__name__)


class DonorRank:
    """The attention-DP rank whose blocks this scheduler's requests live in, for donor registration.

    Args:
        settings: ``attention_dp_rank`` (the rank without attention DP; a value set explicitly must
            agree with TensorRT-LLM's under it).
        attention_dp: ``llm_args.enable_attention_dp``: one scheduler per rank, each told its rank
            in every ``SchedulerOutput`` (NVIDIA/TensorRT-LLM
            ``tensorrt_llm/_torch/pyexecutor/connectors/kv_cache_connector.py`` @
            035ab91cad04b7b77a479a9526edecfbc742c661, ``KvCacheConnectorManager.build_scheduler_output``:
            ``attention_dp_rank = mpi_rank()``; the rank its KV events carry is ``mapping.rank``, the
            same number for an engine whose ranks are one MPI world without pipeline or context
            parallelism, the only layouts the connector serves).
        num_ranks: attention-DP ranks (``llm_args.tensor_parallel_size`` under attention DP): a
            reported rank outside ``[0, num_ranks)`` is a conflict.

    Thread-safety: ``observe`` and ``for_donor`` run on the engine's thread (the scheduler's hooks).
    """

    UNKNOWN = "attention_dp_rank_unknown"
    CONFLICT = "attention_dp_rank_conflict"

    def __init__(self, settings: ConnectorSettings, *, attention_dp: bool = False, num_ranks: int = 1) -> None:
        self.attention_dp, self.num_ranks = attention_dp, max(1, num_ranks)
        self._configured = settings.attention_dp_rank if (
            not attention_dp or "attention_dp_rank" in settings.model_fields_set) else None
        self.rank: int | None = None if attention_dp else settings.attention_dp_rank
        """The rank donors are registered under; None while unknown (attention DP, no report yet)."""
        self.conflict: str | None = None
        """Why no donor of this scheduler is registered any more (sticky), or None."""

    def observe(self, reported: Any) -> None:
        """One ``SchedulerOutput.attention_dp_rank`` (None: not reported; TensorRT-LLM sets it only
        under attention DP, and 1.x has no such field). A report that contradicts the earlier ones,
        the rank range or the settings stops donor registration for good, logged once."""
        if reported is None or self.conflict is not None:
            return
        if not self.attention_dp:
            self._refuse(f"TensorRT-LLM reports attention_dp_rank={reported!r} but llm_args has no "
                         "enable_attention_dp")
        elif not isinstance(reported, int) or isinstance(reported, bool) or not 0 <= reported < self.num_ranks:
            self._refuse(f"TensorRT-LLM reports attention_dp_rank={reported!r}, outside the {self.num_ranks} "
                         "attention-DP ranks of llm_args.tensor_parallel_size")
        elif self.rank is not None and reported != self.rank:
            self._refuse(f"TensorRT-LLM reported attention_dp_rank={reported} after {self.rank}")
        elif self._configured is not None and reported != self._configured:
            self._refuse(f"TensorRT-LLM reports attention_dp_rank={reported} but the setting attention_dp_rank "
                         f"is {self._configured} (under attention DP every rank shares the settings: leave it unset)")
        else:
            self.rank = reported

    def _refuse(self, why: str) -> None:
        self.conflict = why
        log.error("semkv: %s: this scheduler registers no donor any more (a donor under the wrong rank would have "
                  "its block liveness read from another rank's blocks)", why)

    def for_donor(self) -> int | str:
        """The rank to register a donor under, or why none can be (a ``donors_not_registered`` reason)."""
        if self.conflict is not None:
            return self.CONFLICT
        return self.UNKNOWN if self.rank is None else self.rank


class DonorRegistrar:
    """Registers finished requests as donors. See the module docstring for the rules."""

    def __init__(self, settings: ConnectorSettings, namespace: DeploymentNamespace, ledger: Any, reader: Any,
                 metrics: Any, tokens_per_block: int, window_size: int, rank: DonorRank | None = None) -> None:
        self.settings, self.namespace, self.ledger, self.reader = settings, namespace, ledger, reader
        self.metrics, self.tokens_per_block, self.window_size = metrics, tokens_per_block, window_size
        self.rank = rank or DonorRank(settings)

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
            on_finish=on_finish, num_shards=self.namespace.tp_size)

    def prepare(self, request: Any, block_ids: list[int], *, namespace: Any = None, keys: list[bytes] | None = None,
                block_hashes: list[int] | None = None, donor_id: str | None = None) -> Donation | None:
        """The ``donor_registered`` event that makes ``request`` a donor (with the namespace and the
        number of prompt blocks its save instruction needs), or None (not a donor). Reads
        the ledger (is the span already a fresh donor? the engine's generation, which the donor's KV
        was computed in); writes nothing (:meth:`write`).

        Args:
            block_ids: the request's blocks in token order (``cache_block_ids`` of ``request_finished``).
            namespace, keys: what the lookup already computed for this request, if anything.
            block_hashes: the engine's hashes of the request's full blocks (``RequestData.block_hashes``).
            donor_id: the id to register under (an armed save's); default a new one.

        Raises:
            PersistenceError: a ledger read failed (the caller treats it as "no donor").
        """
        found = self.candidate(request, block_ids, namespace)
        if found is None or not prefill_completed(request):
            return None
        rank = self.rank.for_donor()
        if isinstance(rank, str):  # which rank's blocks hold it is not known: its liveness could not be read
            self.metrics.donors_not_registered.labels(reason=rank).inc()
            return None
        ns, n = found
        prompt = request.get_tokens(0)[: int(request.prompt_len)]
        keys = list((keys if keys is not None and len(keys) >= n else content_keys(ns, prompt, self.tokens_per_block, n))[:n])
        s, tpb = self.settings, self.tokens_per_block
        existing = self.reader.find_span(ns.digest, keys, time.time(), min_blocks=n)
        if existing is not None and existing.num_blocks >= n and (
                s.freshness_policy != "engine" or self.reader.live_prefix(existing, n) >= n):
            return None  # the same bytes are already a fresh donor (of any rank: donors are shared between ranks)
        hashes = block_hashes[:n] if block_hashes and len(block_hashes) >= n else request_v1_hashes(request, tpb, n)
        if hashes is None:  # its engine block hashes cannot be known
            return None
        engine = self.ledger.engine(s.engine_id)
        return Donation(ev.DonorRegistered(
            donor_id=donor_id or uuid.uuid4().hex, namespace=ns.digest, engine_id=s.engine_id,
            generation=engine.generation if engine else 1, content_keys=keys, block_hashes=hashes,
            num_tokens=n * tpb, tokens_per_block=tpb,
            expires_at=time.time() + s.donor_ttl_s if s.donor_ttl_s else None,
            attention_dp_rank=rank, window_size=self.window_size), ns, n)

    def write(self, donor: ev.DonorRegistered, lock_wait_s: float) -> None:
        """Append ``donor`` (:meth:`prepare`'s) to the ledger, waiting at most ``lock_wait_s`` seconds
        for the write lock; counted in ``semkv_donors_registered_total``.

        Raises:
            PersistenceError: the ledger refused or the lock wait timed out
                (:func:`ledger.errors.lock_timed_out`).
        """
        with self.ledger.lock_wait(lock_wait_s):
            self.ledger.register_donor(donor)
        self.metrics.donors_registered.inc()


def prefill_completed(request: Any) -> bool:
    """At least one token was generated: the prompt's KV is complete (a request that failed before
    that, e.g. in its first forward, may hold partial KV)."""
    return len(request.get_tokens(0)) > int(request.prompt_len)


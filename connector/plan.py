"""What the scheduler ships to the workers each iteration (DESIGN §3 "load plan").

``build_connector_meta`` returns a :class:`ConnectorMetadata`; TensorRT-LLM pickles it and
broadcasts it to every worker rank, so everything here is a frozen, slotted dataclass of plain
values (ints, strings, tuples) — picklable, no tensors, no handles.

Size bound: a metadata object holds at most ``max_plans_per_iteration`` load plans and as many save
instructions (the scheduler defers extra saves to the next iteration; it never promises more loads
than it can ship). A plan is ~300 bytes plus 8 bytes per target block id, so a 32K-token plan with
32 tokens per block pickles to about 9 KB; :meth:`ConnectorMetadata.approx_size_bytes` estimates it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

__all__ = ["ConnectorMetadata", "LoadPlan", "SaveInstruction"]


@dataclasses.dataclass(frozen=True, slots=True)
class LoadPlan:
    """Copy donor blocks ``[donor_block_start, donor_block_start + num_blocks)`` into ``target_block_ids``.

    The recipient's prompt tokens ``[donor_block_start * tokens_per_block, ... + token_count)`` get the
    donor's KV; the target blocks are recipient-owned block ids (indices into the KV pool
    ``[num_blocks, num_layers, kv_factor, block_elems]``), one per promised block, in token order.
    ``failed`` is set on a plan that must NOT be loaded: the worker fails the request with that
    reason (a promise could not be honoured after the fact, e.g. allocation did not match).
    ``binding`` marks a plan the engine cannot retract (TensorRT-LLM: no recompute path): the
    scheduler secured the donor's checksummed file before it answered and handed it to this
    process's worker under ``lease_id``; after the promise, what the ledger says is a freshness
    signal, counted, and only the bytes' own checks (header, per-layer checksums) can stop the load
    (connector/README.md, "What a promise means").
    ``shards``: under tensor parallelism, every rank's shard of the donor as ``(store_ref,
    checksum)`` by rank (from the donor's manifest, ``store_ref``): each rank's worker loads its
    own, and the plan fails as a whole if one cannot (the scheduler offered the donor only with every
    shard checksummed). Empty without tensor parallelism.
    ``shard_handles``: for a binding plan under tensor parallelism, every rank's shard as the file
    rank 0's scheduler secured, ``(path, st_dev, st_ino)`` by rank
    (:meth:`connector.donor_store.SecuredEntry.handle`): another rank opens it, so a shard evicted or
    replaced after the promise still loads the checksummed bytes; it opens ``shards[rank]`` by name
    only when the handle cannot be opened. Empty otherwise.
    """

    request_id: int
    donor_id: str
    provider_generation: int
    namespace: str
    mode: str
    target_block_ids: tuple[int, ...]
    donor_block_start: int
    num_blocks: int
    token_count: int
    score_bucket: str
    lease_id: str
    store_ref: str
    checksum: str
    donor_engine_id: str
    donor_generation: int
    layout: str
    """:meth:`connector.namespace.KvLayout.describe` the scheduler expects the worker's pool to have."""
    freshness_policy: str
    failed: str | None = None
    binding: bool = False
    shards: tuple[tuple[str, str], ...] = ()
    shard_handles: tuple[tuple[str, int, int], ...] = ()
    predicted_saved_s: float | None = None
    """Prefill seconds the profitability gate predicted this load saves (None: not predicted;
    :mod:`connector.profit`); the worker compares it with the load's real time
    (``semkv_ttft_delta_seconds``)."""
    lease_confirm_by: float | None = None
    """Set when the plan shipped before its ledger lease committed (``lease_confirm_in_worker``): the
    worker confirms the lease in the ledger before its first copy, waiting for it until this time
    (epoch seconds); None: the scheduler saw the lease held (or the plan takes none)."""
    asynchronous: bool = False
    """Loaded off the engine's thread, every layer before the engine computes on the blocks (vLLM with
    ``load_async``: the request waits in ``WAITING_FOR_REMOTE_KVS`` until the worker reports it in
    ``get_finished``); False: synchronous, layer by layer during the forward or all before it."""

    @property
    def donor_block_end(self) -> int:
        """One past the last donor block position this plan reads."""
        return self.donor_block_start + self.num_blocks


@dataclasses.dataclass(frozen=True, slots=True)
class SaveInstruction:
    """Save the KV of a request's first ``num_blocks`` blocks as donor ``donor_id``.

    ``block_ids`` are the request's blocks (kept allocated until the worker reports the save
    through ``get_finished``). ``namespace_fields`` and ``probe`` go into the store entry's header
    so misses can be explained later (telemetry only). ``on_finish``: an ARMED save, shipped with
    the request's first report; the worker gathers the bytes only when ``get_finished`` passes the
    request among the finished ones whose ``request_finished`` returned True (TensorRT-LLM), in the
    same executor iteration, so an engine that then goes idle still saves it. Otherwise the save
    ships after ``request_finished`` and is gathered at the next forward's end (vLLM).
    ``num_shards``: tensor-parallel ranks; every rank's worker saves its own shard of the donor
    (:meth:`connector.donor_store.FileDonorStore.put_shard`), and the donor is complete when all are.
    """

    request_id: int
    donor_id: str
    block_ids: tuple[int, ...]
    num_blocks: int
    tokens_per_block: int
    namespace: str
    layout: str
    probe: str | None = None
    namespace_fields: Mapping[str, str] = dataclasses.field(default_factory=dict)
    on_finish: bool = False
    num_shards: int = 1


@dataclasses.dataclass(frozen=True, slots=True)
class ConnectorMetadata:
    """One iteration's work for the workers: loads to perform, donors to save, and the armed saves
    to drop (``disarmed``: request ids whose request finished without becoming a donor, or vanished)."""

    loads: tuple[LoadPlan, ...] = ()
    saves: tuple[SaveInstruction, ...] = ()
    iteration: int = 0
    disarmed: tuple[int | str, ...] = ()
    scheduled_tokens: int = 0
    """Tokens the engine computes in this iteration's forward (every request's
    ``num_scheduled_tokens``): with :attr:`prefill_context`, what the worker divides the forward's
    time by to learn the prefill cost (:mod:`connector.profit`)."""
    prefill_context: int = 0
    """The longest prompt (tokens) among this iteration's requests still in prefill; 0: no prefill."""

    def approx_size_bytes(self) -> int:
        """Rough pickled size (bytes), for the bound documented above."""
        loads = sum(320 + 8 * len(p.target_block_ids) + 96 * len(p.shards) for p in self.loads)
        saves = sum(400 + 8 * len(s.block_ids) + 64 * len(s.namespace_fields) for s in self.saves)
        return 64 + loads + saves + 16 * len(self.disarmed)

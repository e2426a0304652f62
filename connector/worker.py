"""Worker half of the semkv KV Cache Connector (one per rank): loads plans, saves donors.

Hooks, in TensorRT-LLM's call order (``connector/_trtllm.py``):

* ``register_kv_caches(kv)`` — once: the pool ``[num_blocks, num_layers, kv_factor, block_elems]``.
  Other engines' adapters (``connector/vllm_connector.py``) call :meth:`SemKvWorker.register_layer_views`
  with one block-major view ``[num_blocks, kv_factor, block_elems]`` per layer instead; everything
  below works on those per-layer views, so the core is the same for every engine.
* ``start_load_kv(stream)`` — every scheduled iteration, after ``bind_connector_meta``. For each
  :class:`~connector.plan.LoadPlan`: the plan, the pool layout, a ledger revalidation (freshness,
  generation, namespace — DESIGN §2 rule 6: after allocation and before the first copy) and the
  donor store header against the ledger's checksum. On TensorRT-LLM every layer is then copied here,
  before the forward.
* ``wait_for_layer_load(layer_idx, stream)`` — before each decoder layer: on vLLM, for every active
  plan, revalidate against the ledger again (block liveness included: a donor block removed on its
  engine while the forward ran the layers before fails the plan; ``per_layer_block_check``, on by
  default when loading layer by layer), read that layer's donor bytes, verify their checksum,
  copy them into the target blocks ``kv[target_block_ids, layer_idx]``, and only then return — a
  layer is released to attention only when copied and verified. (A host pool whose blocks are
  byte ranges, vLLM's CPU attention, is read straight into the target blocks and verified there:
  one copy instead of two; a failed check fails the plan before the layer is released, and vLLM
  recomputes its blocks — :meth:`SemKvWorker._read_into_pool`.) A layer asked for while an earlier one was never
  loaded, or a forward that ends before the last layer was asked for (``wait_for_save``), fails the
  plan (``layer_skipped``). After the last layer, with every layer copied, the plan counts as
  materialized (DESIGN §2 rule 8).
* ``load_async(plans)`` / ``finished_async_loads()`` — vLLM with ``load_async``: plans the engine
  does not compute on until they are reported (``WAITING_FOR_REMOTE_KVS``) are loaded whole on a
  loader thread — the same ``_begin`` (ledger, store header) and per-layer ``_copy_layer`` (ledger
  before the copy, the layer's checksum before its bytes) — and reported loaded or failed, by
  request; a failure is counted and fails only its own plan.
* ``wait_for_save(stream)`` / ``get_finished(...)`` — donor saves. An ARMED save (TensorRT-LLM,
  shipped with the request's first report) has its copy out of the pool (device → host) queued in
  the ``get_finished`` that names its request among the finished ones, in the iteration that
  finished it; other saves at the next forward's end (or the next ``get_finished`` when no forward
  ran). A side worker copies the blocks (:mod:`connector.save_copies`) and the request is reported
  done only once the copy has completed — at once, copied on the engine's thread, when no other
  request is live (see :meth:`SemKvWorker.get_finished`). A background thread writes the store entry
  (checksummed, atomically published, ``donor_saved`` in the ledger) once the donor's registration,
  which the scheduler's ledger thread writes, is in the ledger (:meth:`SemKvWorker._registered`).

What a failure after the promise does depends on whether the engine can retract a promise
(:mod:`connector.engine_contract`), and is written on the plan (``LoadPlan.binding``):

* vLLM (not binding): any failed validation or copy fails the WHOLE plan — the hook raises
  :class:`SemKvLoadError` (the adapter reports the plan's blocks; vLLM recomputes them), so no layer
  ever runs on partially loaded KV.
* TensorRT-LLM (binding): the scheduler secured the donor's checksummed file before it answered and
  handed it to this process's worker. What the LEDGER says after the promise (stale donor, blocks
  removed, engine restarted, lease missing, ledger unreachable) is a freshness signal: counted in
  ``semkv_stale_after_promise_total{reason}``, logged, and the load goes on from the secured bytes.
  Only the bytes' own checks — the header against the checksum the ledger recorded, the layout,
  every layer's checksum — can stop it, and they all run in ``start_load_kv`` before anything is
  read by attention: a failure raises there, which stops TensorRT-LLM's executor (fail closed: no
  block computed on, none stored for reuse). That is the residual case with no safe path in
  TensorRT-LLM: the secured file written in place between the answer and the read
  (connector/README.md, "What a promise means").
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from collections import OrderedDict, deque
from typing import Any

import torch

from connector._trtllm import KvCacheConnectorWorker
from connector.donor_store import (ChecksumMismatch, DonorReader, DonorStore, DonorStoreError, EntryMissing,
                                   SecuredEntry, SecuredShards, StoreUnavailable, open_donor_store)
from connector.engine_contract import TENSORRT_LLM, EngineContract
from connector.layouts import process_rank, tensor_parallel_size
from connector.lookup import stale_reason_name
from connector.metrics import ConnectorMetrics, process_metrics
from connector.namespace import KvLayout, pool_key, register_pool_layout
from connector.plan import ConnectorMetadata, LoadPlan, SaveInstruction
from connector.profit import cost_model_for
from connector.save_copies import HostBuffers, SaveCopier, SaveCopy, copy_blocks
from connector.saves import activity_for
from connector.settings import ConnectorSettings, load_connector_settings
from ledger.client import FreshnessMemo, LedgerClient
from ledger.types import FreshnessPolicy, StaleReason

__all__ = ["DonorNotRegistered", "SemKvLoadError", "SemKvWorker"]

log = logging.getLogger(__name__)
_SAVE_REPORT_TIMEOUT_S = 120.0
_FAILED_PLANS_KEPT = 4096  # TensorRT-LLM never drains them (the hook raises instead)
_ARMED_KEPT = 65_536
"""Armed saves the worker keeps at most (oldest dropped first); the scheduler disarms those of
requests that finish without becoming donors, so only requests alive at once count."""
_REGISTRATION_SLACK_S = 10.0
"""The store writer waits for a donor's registration ``register_lock_wait_s`` plus this long (seconds):
the registration is queued on the scheduler's ledger thread, possibly behind other ledger jobs (lease
writes, the donor view's catch-up)."""
_SLICE_RUNS_MAX = 16
"""A load's targets in at most this many runs of consecutive blocks are copied run by run (:func:`_target_runs`)."""


def _iov_max() -> int:
    """How many buffers one ``preadv`` takes (``IOV_MAX``: 1024 on Linux; POSIX guarantees 16)."""
    try:
        return int(os.sysconf("SC_IOV_MAX"))
    except (AttributeError, ValueError, OSError):
        return 16


_IN_PLACE_RUNS_MAX = max(1, min(_iov_max(), 1024) - 2)
"""A load read straight into the pool (:meth:`SemKvWorker._read_into_pool`) scatters each layer over
at most this many runs of target blocks, plus the donor rows before and after them, in one ``preadv``."""
_READ_BUFFER_KEPT_MAX = 256 * 2**20
"""The worker keeps a read buffer up to this size (bytes) between loads; a bigger layer gets its own."""


_LEASE_POLL_S = 100e-6
"""How often the worker asks the ledger for a lease still being committed (``lease_confirm_in_worker``):
the write takes ~0.5 ms on SQLite, so a few tries at most."""

_LEASE_BLOCK_CHECK_EVERY = 20
"""While waiting for a lease, the donor's block liveness is read on every this-many-th try (~2 ms
apart), the donor and the lease alone on the others."""

_LEASE_NOT_HELD = f"ledger_{StaleReason.LEASE_NOT_HELD}"


class DonorNotRegistered(RuntimeError):
    """A donor's registration did not reach the ledger in time (the ledger refused it or stayed
    locked): its copied bytes are not published (the store writer's thread; never the engine's)."""


class SemKvLoadError(RuntimeError):
    """A promised load could not be completed; the request must not be computed on its blocks."""

    def __init__(self, plan: LoadPlan, reason: str, detail: str, layer_idx: int | None = None) -> None:
        where = f" at layer {layer_idx}" if layer_idx is not None else " before the first layer"
        outcome = ("the executor must stop: TensorRT-LLM cannot recompute a promised load, and no block may be "
                   "computed on or kept for reuse with these bytes" if plan.binding
                   else "the engine recomputes the request's blocks")
        super().__init__(f"semkv connector: load of request {plan.request_id} from donor {plan.donor_id} failed"
                         f"{where} ({reason}: {detail}); {outcome}")
        self.plan, self.reason, self.layer_idx = plan, reason, layer_idx


@dataclasses.dataclass(slots=True)
class _ActiveLoad:
    plan: LoadPlan
    work_s: float = 0.0
    """Seconds the worker spent on this load's own work so far: :meth:`SemKvWorker._begin` (ledger
    check, store open, header) and each layer's :meth:`SemKvWorker._copy_layer` (revalidation,
    read, checksum, copy into the pool) — never the engine's code between the hooks (on vLLM the
    forward of the layers before the last one runs between its copies) nor other plans' work.
    Reported as ``semkv_load_seconds`` and taught to the cost model (:meth:`SemKvWorker._materialized`)."""
    secured: SecuredEntry | SecuredShards | None = None
    """The scheduler's secured entry this load reads through (released when the load ends)."""
    reader: DonorReader | None = None
    """Set by ``_begin`` before the load becomes active."""
    ref: str = ""
    """The store entry read: the plan's, or this rank's shard of it (tensor parallelism)."""
    targets: torch.Tensor | None = None
    """The target block ids as a tensor on the pool's device; set with :attr:`reader`."""
    runs: tuple[tuple[int, int, int], ...] | None = None
    """The targets as runs of consecutive blocks ``(first target, first source row, length)``, when
    there are few enough to copy each run as one slice (:func:`_target_runs`); None: one
    ``index_copy_`` over :attr:`targets`."""
    into_pool: bool = False
    """Each layer is read straight into the target blocks and verified there (:meth:`SemKvWorker._read_into_pool`)."""
    next_layer: int = 0
    """Layers ``[0, next_layer)`` are copied; a layer past it asked for means one was skipped."""
    signals: set[str] = dataclasses.field(default_factory=set)
    """Freshness signals already counted for this binding plan (each once)."""
    memo: FreshnessMemo = dataclasses.field(default_factory=FreshnessMemo)
    """The ledger's last fresh answer for this load (:meth:`LedgerClient.donor_freshness`): the next
    revalidation is one change-counter read while nothing committed since."""
    ledger_down: bool = False
    """A revalidation of this binding plan found the ledger unreachable: later layers skip it (each
    would wait for the same error on the engine's thread)."""


class SemKvWorker(KvCacheConnectorWorker):
    """The connector's worker (see the module docstring). One per rank; under attention DP it loads
    into and saves from its own rank's pool only, and reports only its own rank's requests in
    ``get_finished`` (TensorRT-LLM completes them per owner). Under tensor parallelism (every rank's
    worker bound to the metadata rank 0's scheduler built) it saves and loads only its rank's shard
    of each donor: a save is published as shard :attr:`tp_rank`
    (:meth:`~connector.donor_store.FileDonorStore.put_shard`: the donor completes when every rank's
    shard is), a plan is read from ``plan.shards[tp_rank]`` and checked against that shard's checksum.

    Args:
        llm_args: TensorRT-LLM's ``TorchLlmArgs`` (or the harness's).
        settings, ledger, store, metrics: injected for tests; by default built from the settings.
        engine: the engine hosting the connector (default TensorRT-LLM: every layer is loaded in
            ``start_load_kv``; the vLLM adapter passes :data:`~connector.engine_contract.VLLM`).
    """

    supports_attention_dp = True
    """Owner-local under attention DP: plans name this rank's block ids, saves read this rank's pool,
    and the donor store it reads and writes is shared by content, never by rank (docs/modes.md)."""

    def __init__(self, llm_args: Any, *, settings: ConnectorSettings | None = None, ledger: LedgerClient | None = None,
                 store: DonorStore | None = None, metrics: ConnectorMetrics | None = None,
                 engine: EngineContract = TENSORRT_LLM) -> None:
        super().__init__(llm_args)
        self.settings = s = settings or load_connector_settings()
        self.engine = engine
        self.metrics = metrics or process_metrics()
        self.ledger = ledger or LedgerClient(s.db, statement_timeout_s=s.ledger_statement_timeout_s)
        self.store = store or open_donor_store(s, self.ledger, keep_bytes=not engine.recomputes_failed_loads)
        self.tp_size = tensor_parallel_size(llm_args)
        """Tensor-parallel ranks: each rank's worker saves and loads its own shard of every donor."""
        self.tp_rank = process_rank() if self.tp_size > 1 else 0
        """This worker's rank (TensorRT-LLM's ``mpi_rank()``: one MPI process per rank)."""
        if not 0 <= self.tp_rank < self.tp_size:  # e.g. pipeline ranks too: a layout the namespace refuses
            log.error("semkv: process rank %d is not one of tensor_parallel_size=%d: this worker saves and loads no "
                      "shard", self.tp_rank, self.tp_size)
        self.layers: list[torch.Tensor] = []  # per layer: [num_blocks, kv_factor, block_elems] (views)
        self._pool_blocks_contiguous = False
        """Every layer view is host memory with its blocks one after another (vLLM's CPU attention):
        a run of consecutive target blocks is one byte range a read can land in."""
        self._layer_bytes: list[memoryview] = []
        """With :attr:`_pool_blocks_contiguous`: each layer's bytes as one flat ``memoryview``, made
        once here, which a run of target blocks is sliced from (:meth:`_read_into_pool`)."""
        self.num_blocks = 0
        self.layout: KvLayout | None = None
        self._active: list[_ActiveLoad] = []
        self._read_bufs = threading.local()
        """Per thread (the engine's, the asynchronous loader's): the buffer every layer read reuses
        (:meth:`_read_buffer`)."""
        self._async_plans: queue.Queue[LoadPlan | None] = queue.Queue()
        self._async_lock = threading.Lock()
        self._async_ended: list[tuple[LoadPlan, bool]] = []
        """Asynchronous loads that ended since the last :meth:`finished_async_loads`: (plan, loaded)."""
        self._async_loader: threading.Thread | None = None
        """Started with the first asynchronous plan (:meth:`load_async`)."""
        self._held_for_ranks: list[tuple[int, SecuredShards]] = []
        """Rank 0: shards secured for loads the other ranks read through :attr:`LoadPlan.shard_handles`,
        with the ``get_finished`` count when this rank's load ended (:meth:`_release_held_for_ranks`)."""
        self._get_finished_calls = 0
        self.failed_plans: deque[LoadPlan] = deque(maxlen=_FAILED_PLANS_KEPT)
        """Plans whose load failed or was abandoned, oldest first; an engine adapter that reports
        failed blocks to its engine (vLLM's ``get_block_ids_with_load_errors``) drains it."""
        self._stream: Any = None
        self._armed: OrderedDict[Any, SaveInstruction] = OrderedDict()
        self._to_gather: dict[Any, SaveInstruction] = {}
        self._gathered: set[Any] = set()
        """Ids whose save no longer reads the pool (copied, failed, dropped): reportable."""
        self._copying: set[Any] = set()
        """Ids whose copy out of the pool is queued or running: their blocks must stay held."""
        self._awaiting: dict[Any, float] = {}  # finished ids passed in -> when
        self._queue: queue.Queue[SaveCopy | None] = queue.Queue()  # copied donors -> the store writer
        self._idle = threading.Condition()
        self._in_flight = 0  # saves queued for a copy, being copied, or waiting for / in the writer
        self.host_buffers = HostBuffers(pinned=torch.cuda.is_available())
        self._side_copies = s.save_copy == "side"
        """Copy donors out of the pool on the copier's thread (``ConnectorSettings.save_copy``)."""
        self.copier = SaveCopier(self._copied, buffers=self.host_buffers) if self._side_copies else None
        """The side worker copying donors out of the pool (None with ``save_copy = "engine_thread"``)."""
        self._activity = activity_for(pool_key(s.engine_id, s.store_dir), llm_args)
        self.save_engine_seconds = 0.0
        """Cumulative seconds the engine's thread spent on donor saves (gathers, enqueues, waits), for benchmarks."""
        self.save_wait_seconds = 0.0
        """Of those, with side copies on: seconds spent copying here or waiting for a queued copy
        because no other request was live (the engine may block after the iteration)."""
        self._saver = threading.Thread(target=self._save_loop, name="semkv-saver", daemon=True)
        self._saver.start()
        self.revalidation_seconds = 0.0  # cumulative, for benchmarks
        self.copy_seconds = 0.0
        self.cost_model = cost_model_for(pool_key(s.engine_id, s.store_dir), **s.profit.model_dump(exclude={"enabled"}))
        """Taught here, read by this engine's scheduler when it shares the process (:mod:`connector.profit`)."""
        self._forward: tuple[ConnectorMetadata, float] | None = None
        """A forward that loads nothing and computes prompt tokens: its metadata and when it began."""
        self.load_before_forward = bool(s.load_before_forward) or not engine.recomputes_failed_loads
        """Copy every layer in ``start_load_kv`` (always on TensorRT-LLM; see
        ``ConnectorSettings.load_before_forward``)."""
        self.per_layer_block_check = (not self.load_before_forward if s.per_layer_block_check is None
                                      else s.per_layer_block_check)
        """Re-check donor block liveness before every layer's copy (default: when loading layer by
        layer; see ``ConnectorSettings.per_layer_block_check``)."""

    # ============================================================ layout
    def register_kv_caches(self, kv_cache_tensor: torch.Tensor) -> None:
        """Learn the pool ``[num_blocks, num_layers, kv_factor, block_elems]`` (once, at start-up)."""
        if kv_cache_tensor.dim() != 4:
            raise ValueError(f"semkv expects a KV pool [num_blocks, num_layers, kv_factor, block_elems], "
                             f"got shape {tuple(kv_cache_tensor.shape)}")
        _, layers, kv_factor, elems = kv_cache_tensor.shape
        self.register_layer_views([kv_cache_tensor[:, layer] for layer in range(layers)],
                                  KvLayout(layers, kv_factor, elems, str(kv_cache_tensor.dtype).removeprefix("torch.")))

    def register_kv_cache_layout(self, layout: Any) -> None:
        """TensorRT-LLM 2026 main's description of the cache (``KvCacheLayout``): a cache that is one
        pool tensor is registered as :meth:`register_kv_caches`; one of several layer groups or
        regions (VSWA) is not served (docs/modes.md, "Variable sliding windows"): nothing is loaded
        or saved, and the pool registered under this engine's key names no namespace's layout, so
        the scheduler's lookups miss and it registers no donor (``_pool_matches``). Overridden so
        such an engine still starts (the default raises ``NotImplementedError``)."""
        tensor = layout.as_single_pool_tensor()
        if tensor is not None:
            self.register_kv_caches(tensor)
            return
        groups = len(getattr(layout, "groups", ()) or ())
        regions = sum(len(getattr(group, "regions", ()) or ()) for group in getattr(layout, "groups", ()) or ())
        self.layers, self.num_blocks, self.layout = [], 0, None
        register_pool_layout(pool_key(self.settings.engine_id, self.settings.store_dir),
                             KvLayout(0, 0, 0, f"not-served:{groups}-layer-groups-{regions}-regions"))
        log.warning("semkv: the KV cache has %d layer group(s) and %d region(s) (variable sliding windows): the "
                    "connector loads and saves nothing on this engine", groups, regions)

    def register_layer_views(self, views: list[torch.Tensor], layout: KvLayout) -> None:
        """Learn the pool as one view per layer, each ``[num_blocks, kv_factor, block_elems]``.

        The views may be strided (a slice of a stacked pool, a permuted ``[2, num_blocks, ...]``
        tensor); loads write through them (a slice copy per run of consecutive target blocks, else
        ``index_copy_``) and saves gather with
        ``index_select``, so no layer is ever copied whole.

        Raises:
            ValueError: the views disagree with ``layout`` or with each other.
        """
        if len(views) != layout.num_layers or not views:
            raise ValueError(f"semkv: {len(views)} layer views for a layout of {layout.num_layers} layers")
        expected = (views[0].shape[0], layout.kv_factor, layout.block_elems)
        for idx, view in enumerate(views):
            if tuple(view.shape) != expected or str(view.dtype).removeprefix("torch.") != layout.dtype:
                raise ValueError(f"semkv: layer {idx} view {tuple(view.shape)} {view.dtype} does not match "
                                 f"{expected} {layout.dtype}")
        self.layers, self.num_blocks, self.layout = list(views), expected[0], layout
        self._pool_blocks_contiguous = all(view.device.type == "cpu" and view.is_contiguous() for view in views)
        self._layer_bytes = ([memoryview(view.view(-1).view(torch.uint8).numpy()) for view in views]
                             if self._pool_blocks_contiguous else [])
        register_pool_layout(pool_key(self.settings.engine_id, self.settings.store_dir), layout)

    # ============================================================ loads
    def start_load_kv(self, stream: Any) -> None:
        """Take this iteration's saves and plans; validate the plans (ledger + store header) and,
        with :attr:`load_before_forward`, copy all their layers now.

        Raises:
            SemKvLoadError: a plan failed (see the module docstring for what that means per engine).
        """
        self._stream = stream
        self._abandon_active()
        self._forward = None
        meta = self.get_connector_meta()
        if not isinstance(meta, ConnectorMetadata):
            return
        self._take_saves(meta)
        for plan in meta.loads:
            try:
                self._active.append(self._begin(plan))
            except SemKvLoadError as exc:
                self._fail_all(exc, meta.loads)
                raise
            except Exception as exc:  # an unexpected error still fails the plan, counted
                error = SemKvLoadError(plan, "internal_error", repr(exc))
                self._fail_all(error, meta.loads)
                raise error from exc
        if self.load_before_forward and self._active:
            for layer_idx in range(self.layout.num_layers):  # type: ignore[union-attr]
                self._copy_active_layer(layer_idx)
        if meta.prefill_context and not meta.loads:  # a forward that only computes: the prefill cost
            self._forward = (meta, time.perf_counter())

    def _begin(self, plan: LoadPlan) -> _ActiveLoad:
        """Validate ``plan`` and open its bytes (the ledger's first check, the store header); the
        time it takes opens the load's :attr:`_ActiveLoad.work_s`.

        Raises:
            SemKvLoadError: the plan cannot be loaded (nothing was copied)."""
        started = time.perf_counter()
        load = self._begin_checked(plan)
        load.work_s += time.perf_counter() - started
        return load

    def _begin_checked(self, plan: LoadPlan) -> _ActiveLoad:
        if plan.failed:
            raise SemKvLoadError(plan, "plan_failed", plan.failed)
        if not self.layers or self.layout is None:
            raise SemKvLoadError(plan, "no_kv_cache", "register_kv_caches was not called")
        if plan.layout != self.layout.describe():
            raise SemKvLoadError(plan, "layout_mismatch", f"plan {plan.layout} vs pool {self.layout.describe()}")
        if len(plan.shards) != (self.tp_size if self.tp_size > 1 else 0) or not 0 <= self.tp_rank < self.tp_size:
            raise SemKvLoadError(plan, "layout_mismatch", f"plan names {len(plan.shards)} shards; this engine has "
                                 f"tensor_parallel_size={self.tp_size} and this worker rank {self.tp_rank}")
        if len(plan.target_block_ids) != plan.num_blocks or (
                plan.target_block_ids and max(plan.target_block_ids) >= self.num_blocks):
            raise SemKvLoadError(plan, "bad_targets", f"{len(plan.target_block_ids)} target blocks")
        load = _ActiveLoad(plan, secured=self.store.claim(plan.lease_id) if plan.binding else None,
                           ref=plan.shards[self.tp_rank][0] if plan.shards else plan.store_ref)
        self.store.lease(plan.donor_id)  # pinned here until _close
        try:
            self._first_check(load)
            load.reader = reader = self._open(plan, load.secured)
            h = reader.header
            shard = (self.tp_rank, self.tp_size) if plan.shards else None
            if (h.namespace != plan.namespace or h.layout() != plan.layout or h.num_blocks < plan.donor_block_end
                    or h.donor_id != plan.donor_id or h.shard != shard or h.shards):
                raise SemKvLoadError(plan, "header_mismatch",
                                     f"entry {h.donor_id} {h.layout()} {h.num_blocks} blocks")
        except BaseException:
            self._close(load)
            raise
        load.targets = torch.tensor(plan.target_block_ids, dtype=torch.long, device=self.layers[0].device)
        in_place = (not plan.binding and self._pool_blocks_contiguous and hasattr(reader, "read_layer_into")
                    and h.itemsize == self.layers[0].element_size())
        load.runs = _target_runs(plan.target_block_ids, _IN_PLACE_RUNS_MAX if in_place else _SLICE_RUNS_MAX)
        load.into_pool = in_place and load.runs is not None
        return load

    def _open(self, plan: LoadPlan, secured: SecuredEntry | SecuredShards | None) -> DonorReader:
        """A reader of the plan's bytes (this rank's shard under tensor parallelism): the secured file
        (binding plans, in the scheduler's process), else the entry by path."""
        ref, checksum = plan.shards[self.tp_rank] if plan.shards else (plan.store_ref, plan.checksum)
        if isinstance(secured, SecuredShards):
            secured = secured.shard(self.tp_rank)
        try:
            if secured is not None:
                return secured.reader()
            if plan.shard_handles:
                return self._open_secured_shard(plan, ref, checksum)
            return self.store.open(ref, checksum)
        except EntryMissing as exc:
            self._forget(plan, ref)  # lookups check it in full again
            raise SemKvLoadError(plan, "store_missing", str(exc)) from exc
        except ChecksumMismatch as exc:
            self._forget(plan, ref)
            raise SemKvLoadError(plan, "checksum_mismatch", str(exc)) from exc
        except StoreUnavailable as exc:  # a networked store down: nothing was read
            raise SemKvLoadError(plan, "store_unavailable", str(exc)) from exc

    def _open_secured_shard(self, plan: LoadPlan, ref: str, checksum: str) -> DonorReader:
        """This rank's shard as the file rank 0's scheduler secured for the promise (whatever
        happened to its name since); by name only if that handle cannot be opened (another host or
        user, no ``/proc``), with a warning: then the shard must still be in the store.

        Raises:
            EntryMissing, ChecksumMismatch, StoreUnavailable: as :meth:`FileDonorStore.open`.
        """
        try:
            return self.store.open_handle(plan.shard_handles[self.tp_rank], ref, checksum)
        except EntryMissing as exc:
            log.warning("semkv: request %s: rank %d opens shard %s by name: %s", plan.request_id, self.tp_rank,
                        ref, exc)
            return self.store.open(ref, checksum)

    def _forget(self, plan: LoadPlan, ref: str) -> None:
        """A load found ``ref`` (the plan's entry, or this rank's shard of it) missing or corrupt."""
        self.store.forget_verified(ref)
        self.store.forget_verified(plan.store_ref)

    def _revalidate(self, load: _ActiveLoad, layer_idx: int | None, *, full: bool) -> None:
        """The ledger's ``donor_freshness``: ``full`` includes block liveness (policy ``engine``,
        one statement over the plan's blocks: +3-6 µs per block on SQLite, +11-14 µs on PostgreSQL);
        otherwise state, namespace, expiry, generation and lease only, one prepared statement
        (~20-30 µs on SQLite). On SQLite a check after a fresh answer of the same load reads the
        ledger's change counter first (``PRAGMA data_version``, ~3 µs): when no connection committed
        since and no expiry passed, that answer still holds and the statement is not run
        (:meth:`LedgerClient.donor_freshness`'s ``memo``); any commit — a block removed, a lease released,
        an unrelated event — means a full read again. ``full`` runs before the first copy and, with
        :attr:`per_layer_block_check`, before every layer (see ``ConnectorSettings.per_layer_block_check``
        for its share of the copy). A binding plan's outcome is a signal; its lease is not asked for
        (the scheduler writes it in the background and the bytes do not depend on it)."""
        plan = load.plan
        if load.ledger_down:
            return
        started = time.perf_counter()
        try:
            stale = self.ledger.donor_freshness(
                plan.donor_id, namespace=plan.namespace, num_blocks=plan.donor_block_end if full else 0,
                policy=FreshnessPolicy(plan.freshness_policy), lease_id=None if plan.binding else plan.lease_id,
                memo=load.memo)
            self.metrics.revalidations.labels(answer="unchanged" if load.memo.unchanged else "read").inc()
        except Exception as exc:  # the ledger unreachable is a failed validation, not a pass
            if not plan.binding:
                raise SemKvLoadError(plan, "ledger_error", repr(exc), layer_idx) from exc
            load.ledger_down = True
            self._signal(load, "ledger_error", repr(exc))
            return
        finally:
            elapsed = time.perf_counter() - started
            self.revalidation_seconds += elapsed
            self.metrics.revalidation_seconds.observe(elapsed)
        if stale is None:
            return
        if not plan.binding:
            raise SemKvLoadError(plan, f"ledger_{stale}", f"donor no longer fresh: {stale}", layer_idx)
        self._signal(load, stale_reason_name(stale), f"donor no longer fresh: {stale}")

    def _first_check(self, load: _ActiveLoad) -> None:
        """The load's first, full revalidation (DESIGN §2 rule 6). A plan shipped before its lease
        committed (``LoadPlan.lease_confirm_by``) is checked until the ledger shows the lease held
        (:meth:`_await_lease`); nothing is read or copied before.

        Raises:
            SemKvLoadError: stale, the ledger unreachable, or the lease not held by its deadline.
        """
        while True:
            try:
                self._revalidate(load, None, full=True)
                return
            except SemKvLoadError as exc:
                confirm_by = load.plan.lease_confirm_by
                if confirm_by is None or exc.reason != _LEASE_NOT_HELD or time.time() >= confirm_by:
                    raise
            self._await_lease(load, confirm_by)

    def _await_lease(self, load: _ActiveLoad, confirm_by: float) -> None:
        """Wait until the ledger shows the plan's lease held, or ``confirm_by`` (epoch seconds). Each
        try asks the donor and the lease alone (one statement, ~30 µs): a donor gone stale fails the
        load at once. Every :data:`_LEASE_BLOCK_CHECK_EVERY`-th try also reads the donor's block
        liveness without the lease (~0.35 ms over 250 blocks): a lease the scheduler's ledger thread
        refuses for removed blocks fails the load then (~2 ms in) rather than at the deadline. A
        lease committing in the usual ~0.5 ms costs cheap tries only, which leave the cores to the
        lease's write.

        Raises:
            SemKvLoadError: the donor stale, or the ledger unreachable.
        """
        plan, started = load.plan, time.perf_counter()
        policy, tries = FreshnessPolicy(plan.freshness_policy), 0
        try:
            while time.time() < confirm_by:
                stale = self.ledger.donor_freshness(plan.donor_id, namespace=plan.namespace, num_blocks=0,
                                                    policy=policy, lease_id=plan.lease_id)
                if stale is None:
                    return
                if stale == StaleReason.LEASE_NOT_HELD and tries % _LEASE_BLOCK_CHECK_EVERY == _LEASE_BLOCK_CHECK_EVERY - 1:
                    stale = self.ledger.donor_freshness(plan.donor_id, namespace=plan.namespace,
                                                        num_blocks=plan.donor_block_end, policy=policy, lease_id=None)
                if stale is not None and stale != StaleReason.LEASE_NOT_HELD:
                    raise SemKvLoadError(plan, f"ledger_{stale}", f"donor no longer fresh: {stale}")
                tries += 1
                time.sleep(_LEASE_POLL_S)
        except SemKvLoadError:
            raise
        except Exception as exc:  # the ledger unreachable is a failed validation, not a pass
            raise SemKvLoadError(plan, "ledger_error", repr(exc)) from exc
        finally:
            self.revalidation_seconds += time.perf_counter() - started

    def _signal(self, load: _ActiveLoad, reason: str, detail: str) -> None:
        """A freshness signal on a binding plan: counted and logged once per plan and reason."""
        if reason in load.signals:
            return
        load.signals.add(reason)
        self.metrics.stale_after_promise.labels(reason=reason).inc()
        log.warning("semkv: request %s: donor %s %s after the promise; loading its secured, checksummed bytes",
                    load.plan.request_id, load.plan.donor_id, detail)

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        """Revalidate, verify and copy layer ``layer_idx`` of every active plan, then return (with
        :attr:`load_before_forward` that was done in ``start_load_kv``: nothing is left to load)."""
        self._copy_active_layer(layer_idx)

    def _copy_active_layer(self, layer_idx: int) -> None:
        for load in self._active:
            try:
                if layer_idx > load.next_layer:  # attention already ran on a layer we never loaded
                    raise SemKvLoadError(load.plan, "layer_skipped", f"layer {layer_idx} asked for before "
                                         f"layers {load.next_layer}..{layer_idx - 1} were loaded", layer_idx)
                self._copy_layer(load, layer_idx)
                load.next_layer = max(load.next_layer, layer_idx + 1)
            except SemKvLoadError as exc:
                self._fail_all(exc)
                raise
            except Exception as exc:  # a copy error fails the whole plan
                error = SemKvLoadError(load.plan, "copy_error", repr(exc), layer_idx)
                self._fail_all(error)
                raise error from exc
        if self._active and layer_idx == self.layout.num_layers - 1:  # type: ignore[union-attr]
            for load in self._active:  # every layer copied: the skip check above saw to it
                self._materialized(load)
            self._active = []

    def _copy_layer(self, load: _ActiveLoad, layer_idx: int) -> None:
        """Revalidate, read, verify and copy layer ``layer_idx`` of ``load`` (:meth:`_copy_layer_work`);
        its time, failed or not, is added to the load's :attr:`_ActiveLoad.work_s`.

        Raises:
            SemKvLoadError: the ledger or the bytes failed the plan."""
        started = time.perf_counter()
        try:
            self._copy_layer_work(load, layer_idx)
        finally:
            load.work_s += time.perf_counter() - started

    def _copy_layer_work(self, load: _ActiveLoad, layer_idx: int) -> None:
        plan, kv = load.plan, self.layers[layer_idx]
        assert load.reader is not None and load.targets is not None  # set by _begin
        h = load.reader.header
        self._revalidate(load, layer_idx, full=self.per_layer_block_check)
        started = time.perf_counter()
        try:
            if load.into_pool:
                self._read_into_pool(load, layer_idx)
                self.copy_seconds += time.perf_counter() - started
                return
            raw = load.reader.read_layer(layer_idx, into=self._read_buffer(h.layer_bytes))
        except ChecksumMismatch as exc:
            self._forget(plan, load.ref)  # lookups check it in full again
            raise SemKvLoadError(plan, "checksum_mismatch", str(exc), layer_idx) from exc
        except StoreUnavailable as exc:
            raise SemKvLoadError(plan, "store_unavailable", str(exc), layer_idx) from exc
        except DonorStoreError as exc:
            self._forget(plan, load.ref)
            raise SemKvLoadError(plan, "store_missing", str(exc), layer_idx) from exc
        src = torch.frombuffer(raw, dtype=kv.dtype).view(h.num_blocks, h.kv_factor, h.block_elems)
        src = src[plan.donor_block_start : plan.donor_block_end].to(kv.device, non_blocking=False)
        if load.runs is not None:  # a slice copy per run of consecutive blocks: a memcpy each
            for target, row, length in load.runs:
                kv[target : target + length].copy_(src[row : row + length])
        else:
            kv.index_copy_(0, load.targets, src)
        self.copy_seconds += time.perf_counter() - started

    def _read_into_pool(self, load: _ActiveLoad, layer_idx: int) -> None:
        """Read layer ``layer_idx`` of the donor straight into the target blocks (one ``preadv``
        scattering the donor's rows over the runs of consecutive targets; the rows the plan does
        not load land in the read buffer) and verify its checksum there
        (:meth:`~connector.donor_store.DonorReader.read_layer_into`): one copy of the layer instead
        of two (file → buffer → pool), ~0.7 ms less per 8 MiB layer on the 2-core machine
        (tools/results/vllm-cpu-2026-12-05-*.md).

        Only where a failed load is recomputed (vLLM: the plan is not binding), so bytes that fail
        their check are never computed on: the plan fails before the layer is released to
        attention, and the engine treats every target block of a failed plan as holding nothing
        (vLLM ``get_block_ids_with_load_errors``; ``finished_async_loads``), as it does with a
        layer never loaded. TensorRT-LLM's plans (and GPU pools) keep the read → verify → copy
        order of :meth:`_copy_layer`.

        Raises:
            ChecksumMismatch, EntryMissing: from the reader (the caller maps them to the plan's failure).
        """
        plan, h = load.plan, load.reader.header  # type: ignore[union-attr]
        head = plan.donor_block_start * h.block_bytes
        tail = (h.num_blocks - plan.donor_block_end) * h.block_bytes
        spare = memoryview(self._read_buffer(head + tail) or bytearray(head + tail))
        pieces: list[Any] = [spare[:head]] if head else []
        # slices of the layer's flat bytes (~0.1 µs a run) where a tensor slice per run viewed as
        # bytes cost ~4 µs: ~0.9 ms per layer for the 250 one-block runs of a fragmented 8K plan
        # (tools/results/vllm-cpu-2026-12-05-1724.md)
        layer, block = self._layer_bytes[layer_idx], h.block_bytes
        for target, _, length in load.runs:  # type: ignore[union-attr]  # in source-row order
            pieces.append(layer[target * block : (target + length) * block])
        if tail:
            pieces.append(spare[head : head + tail])
        load.reader.read_layer_into(layer_idx, pieces)  # type: ignore[union-attr]

    def _read_buffer(self, size: int) -> bytearray | None:
        """The worker's reusable read buffer, at least ``size`` bytes (each layer of each load is read
        into it, verified, and copied into the pool before the next read: one thread, one buffer).
        None above :data:`_READ_BUFFER_KEPT_MAX`: such a layer is read into a buffer of its own."""
        if size > _READ_BUFFER_KEPT_MAX:
            return None
        buf = getattr(self._read_bufs, "buf", None)
        if buf is None or len(buf) < size:
            buf = self._read_bufs.buf = bytearray(size)
        return buf

    # ============================================================ asynchronous loads (vLLM)
    def load_async(self, plans: tuple[LoadPlan, ...] | list[LoadPlan]) -> None:
        """Queue ``plans`` (:attr:`LoadPlan.asynchronous`) for the loader thread: each is validated,
        read, verified and copied layer by layer exactly as a synchronous load (:meth:`_begin`, then
        :meth:`_copy_layer` per layer: the ledger before each copy, the layer's checksum before its
        bytes), off the engine's thread; :meth:`finished_async_loads` reports how each ended. The
        engine must not compute on the target blocks before that (vLLM keeps the request in
        ``WAITING_FOR_REMOTE_KVS``, and keeps its blocks allocated until it is reported even if
        the request is aborted meanwhile)."""
        if not plans:
            return
        if self._async_loader is None:
            self._async_loader = threading.Thread(target=self._async_loop, name="semkv-loader", daemon=True)
            self._async_loader.start()
        for plan in plans:
            self._async_plans.put(plan)

    def finished_async_loads(self) -> tuple[list[Any], list[LoadPlan]]:
        """``(request ids whose asynchronous load ended, the plans among them that failed)`` since the
        last call; a failed plan's blocks hold nothing the engine may compute on (counted in
        ``semkv_load_failures_total``, logged)."""
        with self._async_lock:
            ended, self._async_ended = self._async_ended, []
        return [plan.request_id for plan, _ in ended], [plan for plan, loaded in ended if not loaded]

    def _async_loop(self) -> None:
        while (plan := self._async_plans.get()) is not None:
            loaded = False
            try:
                loaded = self._load_whole(plan)
            except Exception:  # boundary: the plan is reported failed below, never lost
                log.exception("semkv: asynchronous load of request %s failed", plan.request_id)
            with self._async_lock:
                self._async_ended.append((plan, loaded))

    def _load_whole(self, plan: LoadPlan) -> bool:
        """Load every layer of ``plan`` on this thread; False (counted, logged) when it failed."""
        try:
            load = self._begin(plan)
        except SemKvLoadError as exc:
            self._async_failed(exc, None)
            return False
        except Exception as exc:  # noqa: BLE001 - an unexpected error still fails the plan, counted
            self._async_failed(SemKvLoadError(plan, "internal_error", repr(exc)), None)
            return False
        try:
            for layer_idx in range(self.layout.num_layers):  # type: ignore[union-attr]
                self._copy_layer(load, layer_idx)
                load.next_layer = layer_idx + 1
            if load.targets is not None and load.targets.device.type == "cuda":  # copies done before reporting
                started = time.perf_counter()
                torch.cuda.current_stream(load.targets.device).synchronize()
                load.work_s += time.perf_counter() - started
        except SemKvLoadError as exc:
            self._async_failed(exc, load)
            return False
        except Exception as exc:  # noqa: BLE001 - a copy error fails the plan
            self._async_failed(SemKvLoadError(plan, "copy_error", repr(exc), load.next_layer), load)
            return False
        self._materialized(load)
        return True

    def _async_failed(self, error: SemKvLoadError, load: _ActiveLoad | None) -> None:
        log.error("%s", error)
        self.metrics.load_failures.labels(reason=error.reason).inc()
        if load is not None:
            self._close(load)

    def _materialized(self, load: _ActiveLoad) -> None:
        """Every layer of ``load`` is copied: close it and record its load time — the worker's own
        work on it (:attr:`_ActiveLoad.work_s`, plus closing it here), not the wall time from its
        first check to its last copy, which on vLLM spans the forward of every layer but the last
        (``wait_for_layer_load`` is called before each layer's attention) and with several plans in
        one iteration the other plans' work — in ``semkv_load_seconds{source}``, the cost model's
        load samples (:mod:`connector.profit`) and ``semkv_ttft_delta_seconds``."""
        started = time.perf_counter()
        self._close(load)
        seconds, plan = load.work_s + (time.perf_counter() - started), load.plan
        self.metrics.materialized.inc()
        self.metrics.materialized_tokens.inc(plan.token_count)
        self.metrics.materialized_tokens_hist.observe(plan.token_count)
        source = load.reader.source if load.reader is not None else "unknown"  # host_ram, local_file, redis
        self.metrics.load_seconds.labels(source=source).observe(seconds)
        self.cost_model.observe_load(source, plan.token_count, seconds)
        if plan.predicted_saved_s is not None:
            self.metrics.ttft_delta_seconds.observe(plan.predicted_saved_s - seconds)

    def _forward_ended(self) -> None:
        """A forward that computed prompt tokens and loaded nothing ended: teach the cost model its
        time per scheduled token (forwards with loads would mix the two costs it tells apart)."""
        if self._forward is not None:
            (meta, started), self._forward = self._forward, None
            self.cost_model.observe_prefill(meta.scheduled_tokens, meta.prefill_context, time.perf_counter() - started)

    def _close(self, load: _ActiveLoad) -> None:
        """The load is over: its reader, its pin here and the secured entry it read through go."""
        if load.reader is not None:
            load.reader.close()
        self.store.release(load.plan.donor_id)
        if isinstance(load.secured, SecuredShards) and load.plan.shard_handles:
            # the other ranks open their shards through the files held here (plan.shard_handles)
            self._held_for_ranks.append((self._get_finished_calls, load.secured))
        elif load.secured is not None:
            load.secured.release()
        load.secured = None

    def _release_held_for_ranks(self, *, every: bool = False) -> None:
        """Give back the shards held for the other ranks' loads once every rank is past them: at
        the second ``get_finished`` after the load. TensorRT-LLM all-gathers every rank's answer
        right after each ``get_finished`` (``KvCacheConnectorManager.get_finished`` →
        ``mpi_allgather``, NVIDIA/TensorRT-LLM tensorrt_llm/_torch/pyexecutor/connectors/
        kv_cache_connector.py @ 035ab91c), so when the second call comes, every rank has been in
        the all-gather after the first, which each rank reaches only after its own
        ``start_load_kv`` of the load (overlapped iterations or not). ``every``: all (closing)."""
        keep = []
        for held_at, secured in self._held_for_ranks:
            if not every and self._get_finished_calls - held_at < 2:
                keep.append((held_at, secured))
                continue
            try:  # get_finished runs outside TensorRT-LLM's forward: an exception here stops the executor
                secured.release()
            except OSError as exc:  # closing a descriptor: nothing a load depends on any more
                log.error("semkv: giving back donor %s's shards held for the other ranks failed: %r", secured.ref, exc)
        self._held_for_ranks = keep

    def _fail_all(self, error: SemKvLoadError, plans: tuple[LoadPlan, ...] = ()) -> None:
        """``error``'s plan failed: every active plan (and the iteration's other ``plans``) fails."""
        log.error("%s", error)
        self.metrics.load_failures.labels(reason=error.reason).inc()
        self.failed_plans.append(error.plan)
        self.failed_plans.extend(load.plan for load in self._active if load.plan is not error.plan)
        begun = {id(load.plan) for load in self._active} | {id(error.plan)}
        for plan in plans:  # the iteration's plans: none is loaded now
            if id(plan) not in begun:
                self.failed_plans.append(plan)
            self.store.drop_unclaimed(plan.lease_id)  # a secured entry handed over for it (no-op once claimed)
        for load in self._active:
            self._close(load)
        self._active = []

    def _abandon_active(self) -> None:
        """Plans bound in an iteration whose forward never ran (request dropped): not materialized."""
        for load in self._active:
            self.metrics.load_failures.labels(reason="abandoned").inc()
            self.failed_plans.append(load.plan)
            self._close(load)
        self._active = []

    # ============================================================ saves
    def _take_saves(self, meta: ConnectorMetadata) -> None:
        """Arm the metadata's armed saves, queue the others for the next gather, drop disarmed ones."""
        for rid in meta.disarmed:
            self._armed.pop(rid, None)
        for instruction in meta.saves:
            if instruction.on_finish:
                self._armed[instruction.request_id] = instruction
                while len(self._armed) > _ARMED_KEPT:
                    dropped, _ = self._armed.popitem(last=False)
                    log.warning("semkv: armed save of request %s dropped (more than %d armed)", dropped, _ARMED_KEPT)
            else:
                self._to_gather[instruction.request_id] = instruction

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        """No-op: donors are saved whole once their request finished (see get_finished)."""

    def wait_for_save(self, stream: Any) -> None:
        """End of a forward: queue the copies of the donors to save (vLLM: instructions shipped after
        ``request_finished``); their ids are reported by ``get_finished`` once copied.

        Raises:
            SemKvLoadError: a plan of this forward was not loaded to its last layer (the engine
                never waited on its last layers: attention read them unloaded); the plan fails and
                nothing counts as materialized."""
        self._forward_ended()
        if self._active:  # every plan of a forward that ran to its end is loaded by now
            load, last = self._active[0], self.layout.num_layers - 1  # type: ignore[union-attr]
            error = SemKvLoadError(load.plan, "layer_skipped",
                                   f"the forward ended before layers {load.next_layer}..{last} were loaded",
                                   load.next_layer)
            self._fail_all(error)
            raise error
        if self._to_gather:
            started = time.perf_counter()
            self._gather(stream)
            self.save_engine_seconds += time.perf_counter() - started

    def get_finished(self, finished_gen_req_ids: list[Any],
                     started_loading_req_ids: list[Any]) -> tuple[list[Any], list[Any]]:
        """``(ids whose donor blocks were copied out of the pool, [])``: loads are synchronous,
        never reported here.

        An id passed in whose save is armed has its copy queued now (the iteration that finished
        it) on the side worker; it is reported in the first ``get_finished`` after the copy
        completed, so the engine keeps its blocks until then. When no other request of the engine
        is live (:class:`~connector.saves.EngineActivity`; always on vLLM and where the scheduler
        lives in another process) the copy is made here instead, and copies still queued for the
        ids awaited are waited for: TensorRT-LLM's idle loop calls no hook, so an id left for later
        would pin the blocks until the next request; the wait delays no other request."""
        started = time.perf_counter()
        self._get_finished_calls += 1
        self._release_held_for_ranks()
        now = time.monotonic()
        for rid in finished_gen_req_ids:
            armed = self._armed.pop(rid, None)
            if armed is not None:
                self._to_gather[rid] = armed
            self._awaiting[rid] = now
        if self._to_gather:  # no forward ran since, or an armed save: queue the copies now
            self._gather(self._stream)
        if self._side_copies and self._awaiting:
            self._wait_if_engine_idles()
        with self._idle:
            done = [rid for rid in self._awaiting if rid in self._gathered]
            copying = set(self._copying)
        for rid, since in list(self._awaiting.items()):
            if rid not in self._gathered and rid not in copying and now - since > _SAVE_REPORT_TIMEOUT_S:
                log.error("semkv: no save instruction for finished request %s; releasing its blocks", rid)
                done.append(rid)
        with self._idle:
            for rid in done:
                self._awaiting.pop(rid, None)
                self._gathered.discard(rid)
        self.save_engine_seconds += time.perf_counter() - started
        return sorted(done), []

    def _wait_if_engine_idles(self) -> None:
        """Wait for the awaited ids' copies when the engine may block after this call (see
        :meth:`get_finished`). A copy that never ends keeps its blocks held: the wait gives up
        after ``_SAVE_REPORT_TIMEOUT_S`` and the id stays unreported (never freed under a copy)."""
        with self._idle:
            pending = self._copying.intersection(self._awaiting)
        if not pending or self._engine_goes_on():
            return
        started = time.perf_counter()
        with self._idle:
            copied = self._idle.wait_for(lambda: not self._copying.intersection(pending), _SAVE_REPORT_TIMEOUT_S)
        self.save_wait_seconds += time.perf_counter() - started
        if not copied:
            log.error("semkv: donor copies of requests %s still running after %.0f s; their blocks stay held",
                      sorted(self._copying.intersection(pending)), _SAVE_REPORT_TIMEOUT_S)

    def _engine_goes_on(self) -> bool:
        """Will the engine call ``get_finished`` again without a new request? (TensorRT-LLM, another
        request live: :class:`~connector.saves.EngineActivity`; elsewhere not known: no.)"""
        return self.engine.finished_ids_are_saves and self._activity.others_live(self._awaiting)

    def _gather(self, stream: Any) -> None:
        """Queue the copies of ``_to_gather`` on the side worker (``save_copy = "side"`` while the
        engine goes on), or run them here: with ``"engine_thread"``, and when the engine may block
        after this iteration — then ``get_finished`` would wait for a queued copy anyway, and a copy
        on this thread is the shorter wait (no hand-over to another thread)."""
        layout = self.layout
        side = self.copier is not None and self._engine_goes_on()
        for rid, instruction in list(self._to_gather.items()):
            del self._to_gather[rid]
            if not self.layers or layout is None or instruction.layout != layout.describe():
                self.metrics.donor_saves.labels(outcome="layout_mismatch").inc()
                self._resolved(rid)
                continue
            with self._idle:
                full = self._in_flight >= self.settings.save_queue_max
                if not full:
                    self._in_flight += 1
                    if side:
                        self._copying.add(rid)
            if full:  # nothing reads the blocks: the engine may free them at once
                self.metrics.donor_saves.labels(outcome="queue_full").inc()
                self._resolved(rid)
                continue
            job = SaveCopy(rid, instruction, list(self.layers), time.perf_counter())
            if side:
                assert self.copier is not None
                job.ready = _forward_done_event(stream, self.layers[0].device)
                self.copier.submit(job)
                continue
            started = time.perf_counter()
            if stream is not None:  # the forward's writes must be done first
                stream.synchronize()
            try:
                copy_blocks(job, self.host_buffers)
            except Exception as exc:  # boundary: counted like a failed side copy
                job.error = exc
            if self.copier is not None:  # side copies on, but the engine may block next: a wait
                self.save_wait_seconds += time.perf_counter() - started
            self._copied(job)

    def _copied(self, job: SaveCopy) -> None:
        """A copy ended (the copier's thread, or the engine's with ``engine_thread``): the blocks are
        no longer read, the id is reportable; the bytes go to the store writer."""
        if job.error is not None:
            log.error("semkv: copying donor %s out of the KV pool failed: %r", job.instruction.donor_id, job.error)
            self.metrics.donor_saves.labels(outcome="failed").inc()
            with self._idle:
                self._in_flight -= 1
            self._resolved(job.request_id)
            return
        self._queue.put(job)
        self._resolved(job.request_id)

    def _resolved(self, rid: Any) -> None:
        with self._idle:
            self._copying.discard(rid)
            self._gathered.add(rid)
            self._idle.notify_all()

    def _save_loop(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                self._save(job.instruction, job.layers or [])
                self.metrics.donor_saves.labels(outcome="saved").inc()
                self.metrics.save_seconds.observe(time.perf_counter() - job.enqueued)
            except StoreUnavailable:  # a networked store down: the store logged it once per outage
                self.metrics.donor_saves.labels(outcome="store_unavailable").inc()
            except DonorNotRegistered as exc:  # the scheduler counted why (donors_not_registered)
                log.warning("semkv: %s", exc)
                self.metrics.donor_saves.labels(outcome="not_registered").inc()
            except Exception as exc:  # boundary: a failed save leaves the donor unsaved (never fresh)
                log.error("semkv: saving donor %s failed: %r", job.instruction.donor_id, exc)
                self.metrics.donor_saves.labels(outcome="failed").inc()
            finally:
                job.layers = None
                self.host_buffers.give(job.buffer)  # the stores keep no reference to it
                with self._idle:
                    self._in_flight -= 1
                    self._idle.notify_all()

    def _save(self, instruction: SaveInstruction, layers: list[Any]) -> None:
        layout = self.layout
        assert layout is not None and self.layers
        header = {
            "namespace": instruction.namespace, "num_layers": layout.num_layers, "kv_factor": layout.kv_factor,
            "block_elems": layout.block_elems, "dtype": layout.dtype, "itemsize": self.layers[0].element_size(),
            "num_blocks": instruction.num_blocks, "tokens_per_block": instruction.tokens_per_block,
            "probe": instruction.probe, "namespace_fields": dict(instruction.namespace_fields)}
        if instruction.num_shards != self.tp_size:
            raise ValueError(f"save of donor {instruction.donor_id} names {instruction.num_shards} shards; this "
                             f"engine has tensor_parallel_size={self.tp_size}")
        if not self._registered(instruction):
            raise DonorNotRegistered(f"donor {instruction.donor_id} is not in the ledger after "
                                     f"{self.settings.register_lock_wait_s + _REGISTRATION_SLACK_S:g} s: its bytes are not saved")
        if instruction.num_shards > 1:
            self.store.put_shard(instruction.donor_id, self.tp_rank, instruction.num_shards, layers, header)
        else:
            self.store.put(instruction.donor_id, layers, header)

    def _registered(self, instruction: SaveInstruction) -> bool:
        """Wait (the store writer's thread) until the ledger knows donor ``instruction.donor_id``,
        whose registration the scheduler wrote or queued at ``request_finished``
        (``donor_saved`` must follow ``donor_registered``; bytes published for a donor the ledger
        never registers would be orphans); False after ``register_lock_wait_s`` plus
        ``_REGISTRATION_SLACK_S``. Usually the first read answers: the engine's thread wrote the
        registration itself (the write lock was free), or the ledger thread did while the blocks were
        copied. Raises what the ledger read raises (PersistenceError)."""
        deadline = time.monotonic() + self.settings.register_lock_wait_s + _REGISTRATION_SLACK_S
        pause = 0.002
        while self.ledger.donor_freshness(instruction.donor_id, namespace=instruction.namespace, num_blocks=0,
                                          policy=FreshnessPolicy.STORE) == StaleReason.UNKNOWN_DONOR:
            if time.monotonic() + pause > deadline:
                return False
            time.sleep(pause)
            pause = min(2 * pause, 0.1)
        return True

    # ============================================================ lifecycle
    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued donor is copied, written and recorded (tests, shutdown)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout_s)

    def close(self) -> None:
        self.flush()
        if self._async_loader is not None:  # the loads queued end first (the engine holds their blocks)
            self._async_plans.put(None)
            self._async_loader.join(30)
        if self.copier is not None:
            self.copier.close()
        self._queue.put(None)
        self._saver.join(10)
        self._abandon_active()
        self._release_held_for_ranks(every=True)
        self.store.close()
        self.ledger.close()


def _target_runs(target_block_ids: tuple[int, ...] | list[int],
                 limit: int = _SLICE_RUNS_MAX) -> tuple[tuple[int, int, int], ...] | None:
    """``target_block_ids`` as runs of consecutive ids ``(first target, first source row, length)``,
    in source-row order; None when there are more than ``limit`` (copied through a buffer, more
    than :data:`_SLICE_RUNS_MAX` make one ``index_copy_`` cheaper).

    A pool's free blocks are mostly handed out in order, so a plan's targets are usually one run or
    a few: a slice copy per run is a plain memcpy (on a 2-core CPU, 8 MiB: ~0.1 ms, where
    ``index_copy_`` took ~1.2 ms and ``kv[targets] = src`` ~4.6 ms)."""
    runs: list[tuple[int, int, int]] = []
    for row, target in enumerate(target_block_ids):
        if runs and runs[-1][0] + runs[-1][2] == target:
            first, source, length = runs[-1]
            runs[-1] = (first, source, length + 1)
        else:
            if len(runs) == limit:
                return None
            runs.append((target, row, 1))
    return tuple(runs)


def _forward_done_event(stream: Any, device: torch.device) -> Any:
    """CUDA: an event recorded on the engine's stream (``stream``, else the device's current one):
    the side stream's copy waits for it, so it reads the blocks after the forward wrote them, and
    the engine's thread does not synchronize. None for a CPU pool (its writes are done by now)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(stream if isinstance(stream, torch.cuda.Stream) else torch.cuda.current_stream(device))
    return event

"""Worker half of the semkv KV Cache Connector (one per rank): loads plans, saves donors.

Hooks, in TensorRT-LLM's call order (``connector/_trtllm.py``):

* ``register_kv_caches(kv)`` — once: the pool ``[num_blocks, num_layers, kv_factor, block_elems]``.
  Other engines' adapters (``connector/vllm_connector.py``) call :meth:`SemKvWorker.register_layer_views`
  with one block-major view ``[num_blocks, kv_factor, block_elems]`` per layer instead; everything
  below works on those per-layer views, so the core is the same for every engine.
* ``start_load_kv(stream)`` — every iteration, after ``bind_connector_meta``. For each
  :class:`~connector.plan.LoadPlan`: a failed plan, a layout that differs from the pool, a ledger
  revalidation that fails (freshness, generation, lease, namespace — DESIGN §2 rule 6: after
  allocation and before the first copy) or a donor store header that does not match the ledger's
  checksum fails the plan. Nothing is copied here.
* ``wait_for_layer_load(layer_idx, stream)`` — before each decoder layer: for every active plan,
  revalidate against the ledger again (state, generation, lease, namespace, expiry; block liveness
  too with ``per_layer_block_check``), read that layer's donor bytes, verify their checksum, copy
  them into the target blocks ``kv[target_block_ids, layer_idx]``, and only then return — a layer is
  released to attention only when copied. A layer asked for while an earlier one was never
  loaded (attention ran on it unloaded), or a forward that ends before the last layer was asked
  for (``wait_for_save``), fails the plan (``layer_skipped``). After the last layer,
  with every layer copied, the plan counts as materialized (DESIGN §2 rule 8). With
  ``load_before_forward`` (TensorRT-LLM 1.1/1.2 by default) all of that
  runs in ``start_load_kv`` for every layer, before the forward, so nothing can fail inside it.
* ``wait_for_save(stream)`` / ``get_finished(...)`` — donors to save (from ``request_finished``)
  are gathered from the pool (device → host) after the forward's stream is synchronized, then
  written to the donor store by a background thread (checksummed, atomically published,
  ``donor_saved`` in the ledger). The request's id is reported in ``get_finished(...)[0]`` once its
  bytes are gathered, so the engine keeps the blocks exactly as long as it must.

Failure policy (documented choice): any failed validation or copy fails the WHOLE plan — the
hook raises :class:`SemKvLoadError`, so the layer is never run on partially loaded KV. On releases
that offer ``cancel_load``/``request_reset`` the engine discards the load and recomputes the tokens.
TensorRT-LLM 1.1/1.2 has no such path, and its source (connector/README.md, "TensorRT-LLM 1.1/1.2")
shows that an exception from ``start_load_kv`` stops its executor, and one from
``wait_for_layer_load`` fails every request of the batch and then stores their blocks for reuse
without checking their prefill completed. So on those releases the worker loads before the forward
(``load_before_forward``): a failure is raised by ``start_load_kv`` (the executor stops: an
incident, fail closed), never inside the forward. Either way it is counted in
``semkv_load_failures_total{reason}`` and the lease is released by the scheduler.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import torch

from connector._trtllm import TRTLLM_WITHOUT_RECOMPUTE, KvCacheConnectorWorker
from connector.donor_store import ChecksumMismatch, DonorReader, DonorStoreError, EntryMissing, FileDonorStore
from connector.metrics import ConnectorMetrics, process_metrics
from connector.namespace import KvLayout
from connector.plan import ConnectorMetadata, LoadPlan, SaveInstruction
from connector.settings import ConnectorSettings, load_connector_settings
from ledger.queries import LedgerClient
from ledger.types import FreshnessPolicy

__all__ = ["SemKvLoadError", "SemKvWorker"]

log = logging.getLogger(__name__)
_STORE_CACHE_LEVEL = "1"  # host memory / local disk
_SAVE_REPORT_TIMEOUT_S = 120.0
_FAILED_PLANS_KEPT = 4096  # TensorRT-LLM never drains them (the hook raises instead)


class SemKvLoadError(RuntimeError):
    """A promised load could not be completed; the request must not be computed on its blocks."""

    def __init__(self, plan: LoadPlan, reason: str, detail: str, layer_idx: int | None = None) -> None:
        where = f" at layer {layer_idx}" if layer_idx is not None else " before the first layer"
        super().__init__(f"semkv connector: load of request {plan.request_id} from donor {plan.donor_id} failed"
                         f"{where} ({reason}: {detail}); the request fails rather than run on partially "
                         "loaded KV (engines with cancel_load/request_reset recompute it instead)")
        self.plan, self.reason, self.layer_idx = plan, reason, layer_idx


@dataclasses.dataclass(slots=True)
class _ActiveLoad:
    plan: LoadPlan
    reader: DonorReader
    targets: torch.Tensor
    started: float
    next_layer: int = 0
    """Layers ``[0, next_layer)`` are copied; a layer past it asked for means one was skipped."""


class SemKvWorker(KvCacheConnectorWorker):
    """The connector's worker (see the module docstring).

    Args:
        llm_args: TensorRT-LLM's ``TorchLlmArgs`` (or the harness's).
        settings, ledger, store, metrics: injected for tests; by default built from the settings.
    """

    def __init__(self, llm_args: Any, *, settings: ConnectorSettings | None = None, ledger: LedgerClient | None = None,
                 store: FileDonorStore | None = None, metrics: ConnectorMetrics | None = None) -> None:
        super().__init__(llm_args)
        self.settings = s = settings or load_connector_settings()
        self.metrics = metrics or process_metrics()
        self.ledger = ledger or LedgerClient(s.db, statement_timeout_s=s.ledger_statement_timeout_s)
        self.store = store or FileDonorStore(s.store_dir, s.store_capacity_bytes, ledger=self.ledger)
        self.layers: list[torch.Tensor] = []  # per layer: [num_blocks, kv_factor, block_elems] (views)
        self.num_blocks = 0
        self.layout: KvLayout | None = None
        self._active: list[_ActiveLoad] = []
        self.failed_plans: deque[LoadPlan] = deque(maxlen=_FAILED_PLANS_KEPT)
        """Plans whose load failed or was abandoned, oldest first; an engine adapter that reports
        failed blocks to its engine (vLLM's ``get_block_ids_with_load_errors``) drains it."""
        self._stream: Any = None
        self._to_gather: dict[int, SaveInstruction] = {}
        self._gathered: set[int] = set()
        self._awaiting: dict[int, float] = {}  # finished ids passed in -> when
        self._queue: queue.Queue[tuple[SaveInstruction, list[Any], float] | None] = queue.Queue(s.save_queue_max)
        self._idle = threading.Condition()
        self._in_flight = 0
        self._saver = threading.Thread(target=self._save_loop, name="semkv-saver", daemon=True)
        self._saver.start()
        self.revalidation_seconds = 0.0  # cumulative, for benchmarks
        self.copy_seconds = 0.0
        self.load_before_forward = (TRTLLM_WITHOUT_RECOMPUTE if s.load_before_forward is None
                                    else s.load_before_forward)
        """Copy every layer in ``start_load_kv`` (see ``ConnectorSettings.load_before_forward``)."""

    # ============================================================ layout
    def register_kv_caches(self, kv_cache_tensor: torch.Tensor) -> None:
        """Learn the pool ``[num_blocks, num_layers, kv_factor, block_elems]`` (once, at start-up)."""
        if kv_cache_tensor.dim() != 4:
            raise ValueError(f"semkv expects a KV pool [num_blocks, num_layers, kv_factor, block_elems], "
                             f"got shape {tuple(kv_cache_tensor.shape)}")
        _, layers, kv_factor, elems = kv_cache_tensor.shape
        self.register_layer_views([kv_cache_tensor[:, layer] for layer in range(layers)],
                                  KvLayout(layers, kv_factor, elems, str(kv_cache_tensor.dtype).removeprefix("torch.")))

    def register_layer_views(self, views: list[torch.Tensor], layout: KvLayout) -> None:
        """Learn the pool as one view per layer, each ``[num_blocks, kv_factor, block_elems]``.

        The views may be strided (a slice of a stacked pool, a permuted ``[2, num_blocks, ...]``
        tensor); loads write through them with ``index_put_`` and saves gather with
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

    # ============================================================ loads
    def start_load_kv(self, stream: Any) -> None:
        """Validate this iteration's plans (ledger + store header) and, with
        :attr:`load_before_forward`, copy all their layers now; raises SemKvLoadError on failure."""
        self._stream = stream
        self._abandon_active()
        meta = self.get_connector_meta()
        if not isinstance(meta, ConnectorMetadata):
            return
        for instruction in meta.saves:
            self._to_gather[instruction.request_id] = instruction
        for plan in meta.loads:
            try:
                self._active.append(self._begin(plan))
            except SemKvLoadError as exc:
                self._fail_all(exc)
                raise
            except Exception as exc:  # an unexpected error still fails the plan, counted
                error = SemKvLoadError(plan, "internal_error", repr(exc))
                self._fail_all(error)
                raise error from exc
        if self.load_before_forward and self._active:
            for layer_idx in range(self.layout.num_layers):  # type: ignore[union-attr]
                self._copy_active_layer(layer_idx)

    def _begin(self, plan: LoadPlan) -> _ActiveLoad:
        if plan.failed:
            raise SemKvLoadError(plan, "plan_failed", plan.failed)
        if not self.layers or self.layout is None:
            raise SemKvLoadError(plan, "no_kv_cache", "register_kv_caches was not called")
        if plan.layout != self.layout.describe():
            raise SemKvLoadError(plan, "layout_mismatch", f"plan {plan.layout} vs pool {self.layout.describe()}")
        if len(plan.target_block_ids) != plan.num_blocks or (
                plan.target_block_ids and max(plan.target_block_ids) >= self.num_blocks):
            raise SemKvLoadError(plan, "bad_targets", f"{len(plan.target_block_ids)} target blocks")
        self._revalidate(plan, None, full=True)
        try:
            reader = self.store.open(plan.store_ref, plan.checksum)
        except EntryMissing as exc:
            self.store.forget_verified(plan.store_ref)  # lookups check it in full again
            raise SemKvLoadError(plan, "store_missing", str(exc)) from exc
        except ChecksumMismatch as exc:
            self.store.forget_verified(plan.store_ref)
            raise SemKvLoadError(plan, "checksum_mismatch", str(exc)) from exc
        h = reader.header
        if (h.namespace != plan.namespace or h.layout() != plan.layout or h.num_blocks < plan.donor_block_end
                or h.donor_id != plan.donor_id):
            reader.close()
            raise SemKvLoadError(plan, "header_mismatch", f"entry {h.donor_id} {h.layout()} {h.num_blocks} blocks")
        self.store.lease(plan.donor_id)
        targets = torch.tensor(plan.target_block_ids, dtype=torch.long, device=self.layers[0].device)
        return _ActiveLoad(plan, reader, targets, time.perf_counter())

    def _revalidate(self, plan: LoadPlan, layer_idx: int | None, *, full: bool) -> None:
        """The ledger's ``donor_freshness``: ``full`` includes block liveness (policy ``engine``,
        one statement over the plan's blocks); otherwise state, namespace, expiry, generation and
        lease only, one prepared statement (~20 µs on SQLite), so a re-check per layer stays a
        small share of the copy (DESIGN §7: ≤ 5 %)."""
        started = time.perf_counter()
        try:
            stale = self.ledger.donor_freshness(
                plan.donor_id, namespace=plan.namespace, num_blocks=plan.donor_block_end if full else 0,
                policy=FreshnessPolicy(plan.freshness_policy), lease_id=plan.lease_id)
        except Exception as exc:  # the ledger unreachable is a failed validation, not a pass
            raise SemKvLoadError(plan, "ledger_error", repr(exc), layer_idx) from exc
        finally:
            elapsed = time.perf_counter() - started
            self.revalidation_seconds += elapsed
            self.metrics.revalidation_seconds.observe(elapsed)
        if stale is not None:
            raise SemKvLoadError(plan, f"ledger_{stale}", f"donor no longer fresh: {stale}", layer_idx)

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
        plan, h, kv = load.plan, load.reader.header, self.layers[layer_idx]
        self._revalidate(plan, layer_idx, full=self.settings.per_layer_block_check)
        started = time.perf_counter()
        try:
            raw = load.reader.read_layer(layer_idx)
        except ChecksumMismatch as exc:
            self.store.forget_verified(plan.store_ref)  # lookups check it in full again
            raise SemKvLoadError(plan, "checksum_mismatch", str(exc), layer_idx) from exc
        except DonorStoreError as exc:
            self.store.forget_verified(plan.store_ref)
            raise SemKvLoadError(plan, "store_missing", str(exc), layer_idx) from exc
        src = torch.frombuffer(raw, dtype=kv.dtype).view(h.num_blocks, h.kv_factor, h.block_elems)
        src = src[plan.donor_block_start : plan.donor_block_end]
        kv[load.targets] = src.to(kv.device, non_blocking=False)
        self.copy_seconds += time.perf_counter() - started

    def _materialized(self, load: _ActiveLoad) -> None:
        load.reader.close()
        self.store.release(load.plan.donor_id)
        self.metrics.materialized.inc()
        self.metrics.materialized_tokens.inc(load.plan.token_count)
        self.metrics.materialized_tokens_hist.observe(load.plan.token_count)
        self.metrics.load_seconds.labels(cache_level=_STORE_CACHE_LEVEL).observe(time.perf_counter() - load.started)

    def _fail_all(self, error: SemKvLoadError) -> None:
        log.error("%s", error)
        self.metrics.load_failures.labels(reason=error.reason).inc()
        self.failed_plans.append(error.plan)
        self.failed_plans.extend(load.plan for load in self._active if load.plan is not error.plan)
        for load in self._active:
            load.reader.close()
            self.store.release(load.plan.donor_id)
        self._active = []

    def _abandon_active(self) -> None:
        """Plans bound in an iteration whose forward never ran (request dropped): not materialized."""
        for load in self._active:
            self.metrics.load_failures.labels(reason="abandoned").inc()
            self.failed_plans.append(load.plan)
            load.reader.close()
            self.store.release(load.plan.donor_id)
        self._active = []

    # ============================================================ saves
    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        """No-op: donors are saved whole once their request finished (see wait_for_save)."""

    def wait_for_save(self, stream: Any) -> None:
        """End of a forward: synchronize, then gather the donors to save (device → host).

        Raises:
            SemKvLoadError: a plan of this forward was not loaded to its last layer (the engine
                never waited on its last layers: attention read them unloaded); the plan fails and
                nothing counts as materialized."""
        if self._active:  # every plan of a forward that ran to its end is loaded by now
            load, last = self._active[0], self.layout.num_layers - 1  # type: ignore[union-attr]
            error = SemKvLoadError(load.plan, "layer_skipped",
                                   f"the forward ended before layers {load.next_layer}..{last} were loaded",
                                   load.next_layer)
            self._fail_all(error)
            raise error
        if self._to_gather:
            stream.synchronize()
            self._gather()

    def get_finished(self, finished_gen_req_ids: list[int],
                     started_loading_req_ids: list[int]) -> tuple[list[int], list[int]]:
        """``(ids whose donor bytes are gathered, [])``: loads are synchronous, never reported here."""
        now = time.monotonic()
        for rid in finished_gen_req_ids:
            self._awaiting[rid] = now
        if self._to_gather:  # no forward ran this iteration: gather now
            if self._stream is not None:
                self._stream.synchronize()
            self._gather()
        done = [rid for rid in self._awaiting if rid in self._gathered]
        for rid, since in list(self._awaiting.items()):
            if rid not in self._gathered and now - since > _SAVE_REPORT_TIMEOUT_S:
                log.error("semkv: no save instruction for finished request %s; releasing its blocks", rid)
                done.append(rid)
        for rid in done:
            self._awaiting.pop(rid, None)
            self._gathered.discard(rid)
        return sorted(done), []

    def _gather(self) -> None:
        layout = self.layout
        for rid, instruction in list(self._to_gather.items()):
            del self._to_gather[rid]
            self._gathered.add(rid)
            if not self.layers or layout is None or instruction.layout != layout.describe():
                self.metrics.donor_saves.labels(outcome="layout_mismatch").inc()
                continue
            started = time.perf_counter()
            ids = torch.tensor(instruction.block_ids[: instruction.num_blocks], dtype=torch.long,
                               device=self.layers[0].device)
            # per layer [n, kv_factor, elems]: a host copy, so the engine may free the blocks at once
            layers = [view.index_select(0, ids).cpu().contiguous().view(torch.uint8).numpy() for view in self.layers]
            with self._idle:
                self._in_flight += 1
            try:
                self._queue.put_nowait((instruction, layers, started))
            except queue.Full:
                with self._idle:
                    self._in_flight -= 1
                self.metrics.donor_saves.labels(outcome="queue_full").inc()

    def _save_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            instruction, layers, started = item
            try:
                self._save(instruction, layers)
                self.metrics.donor_saves.labels(outcome="saved").inc()
                self.metrics.save_seconds.observe(time.perf_counter() - started)
            except Exception as exc:  # boundary: a failed save leaves the donor unsaved (never fresh)
                log.error("semkv: saving donor %s failed: %r", instruction.donor_id, exc)
                self.metrics.donor_saves.labels(outcome="failed").inc()
            finally:
                with self._idle:
                    self._in_flight -= 1
                    self._idle.notify_all()

    def _save(self, instruction: SaveInstruction, layers: list[Any]) -> None:
        layout = self.layout
        assert layout is not None and self.layers
        self.store.put(instruction.donor_id, layers, {
            "namespace": instruction.namespace, "num_layers": layout.num_layers, "kv_factor": layout.kv_factor,
            "block_elems": layout.block_elems, "dtype": layout.dtype, "itemsize": self.layers[0].element_size(),
            "num_blocks": instruction.num_blocks, "tokens_per_block": instruction.tokens_per_block,
            "probe": instruction.probe, "namespace_fields": dict(instruction.namespace_fields)})

    # ============================================================ lifecycle
    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every gathered donor is written and recorded (tests, shutdown)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout_s)

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._saver.join(10)
        self._abandon_active()
        self.ledger.close()

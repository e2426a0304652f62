"""REFERENCE ENGINE HARNESS — TensorRT-LLM's PyExecutor loop, one iteration per :meth:`ExecutorLoop.step`.

Test and demo infrastructure only; never an engine for serving. Follows the NON-overlap loop
``PyExecutor._executor_loop`` (``disable_overlap_scheduler=True``) of NVIDIA/TensorRT-LLM
``tensorrt_llm/_torch/pyexecutor/py_executor.py`` (newest stored copy, read_file id 3542389387),
with the differences between versions taken from a :class:`~.trtllm_versions.TrtllmVersion`.
One iteration:

1. Nothing active and nothing waiting: the loop is blocked in ``_fetch_and_enqueue_requests``
   (timeout None) — no connector call at all, not even ``get_finished``.
2. ``_fetch_and_activate_new_requests``: waiting requests become active (FIFO, up to
   ``max_batch_size``). ``_schedule``: every active request that can run is scheduled — a context
   request for one chunk, a generating one for one token; parked requests (async load in flight)
   are active but not scheduled; a first chunk is scheduled only when the pool can hold the
   whole request on top of what the active requests still need (``GUARANTEED_NO_EVICT``).
3. ``prepare_resources`` (``KVCacheManager.prepare_resources``): first context chunks only,
   ``add_sequence`` → under the manager's lock ``get_num_new_matched_tokens`` (C++
   ``addSequence``) → ``update_state_after_alloc``; generating requests get their next block;
   then ``build_scheduler_output``.
4. Only with a non-empty batch (``_can_queue``): ``_kv_connector_start_batch`` —
   ``take_scheduled_requests_pending_load`` parks async loads, ``handle_metadata``,
   ``start_load_kv``. ``_can_queue`` is evaluated again: the batch may now be empty.
5. ``_forward_step``: one batched forward — per layer ``wait_for_layer_load`` on every worker,
   the layer for the whole batch, ``save_kv_layer`` on every worker — then ``wait_for_save``.
   Any exception here (a worker hook's or the model's) goes to ``_handle_errors``: EVERY active
   request (parked ones too) fails with it and is terminated, and the loop continues.
6. ``_update_request_states`` / ``_update_requests`` (greedy), ``_send_kv_async``
   (``request_finished`` for the batch's requests that finished normally, unless the version calls
   it on termination), ``_handle_canceled_requests``, ``_handle_responses`` (finished requests
   leave and are terminated: ``free_resources`` → ``remove_sequence``, which stores their blocks
   for reuse; a pinned request's blocks stay until its save is reported), ``update_resources``
   (context blocks stored after the last chunk).
7. ``_kv_connector_terminate_requests``: ``get_finished`` on every worker, every non-blocked
   iteration; saved ids are unpinned and freed, loaded ids go back to ``CONTEXT_INIT``. Then the
   iteration's KV events are flushed (after ``get_finished``, unlike TensorRT-LLM, so an engine
   about to block never holds events back: same events, same order).

Exceptions from connector calls outside the forward's ``try`` stop the executor
(:class:`~.connector_driver.ExecutorStopped`): every active and waiting request fails with it, no
connector method is called again, and :meth:`ExecutorLoop.step` raises it from then on.

Harness-only rules, not TensorRT-LLM's: a parked request is failed with
:class:`~.connector_driver.ConnectorContractError` after ``connector_timeout_s`` (its blocks
released unstored); a request larger than the pool fails with ``KvCacheCapacityError``; each
context request's chunk is at most ``max_num_tokens`` on its own (TensorRT-LLM budgets
``max_num_tokens`` across the batch; per request the chunk grid stays the same whatever else runs,
which keeps concurrent and sequential runs bit-identical).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .connector_driver import AttentionOrderError, ConnectorContractError, ConnectorDriver
from .connector_driver import ExecutorStopped
from .kv_cache_manager import KVCacheManager, KvCacheCapacityError, KVSequence
from .model import HarnessTransformer, PagedChunk
from .request import GenerationResult, LlmRequest, LlmRequestState
from .trtllm_versions import TrtllmVersion

__all__ = ["ExecutorLoop", "ForwardObserver", "LifecycleObserver", "LIFECYCLE_POINTS"]

ForwardObserver = Callable[[str, int, list[int]], None]
"""``observer(event, layer_idx, request_ids)`` with event ``wait_for_layer_load_returned``,
``attention_read`` or ``save_kv_layer_returned``; ``request_ids`` is the forward's batch."""

LifecycleObserver = Callable[[str, list[int]], None]
"""``callback(point, request_ids)`` at one of :data:`LIFECYCLE_POINTS`."""

LIFECYCLE_POINTS = (
    "after_get_num_new_matched_tokens",  # [request id], checks passed, manager lock still held
    "after_update_state_after_alloc",    # [request id]
    "after_build_connector_meta",        # ids in the SchedulerOutput (new, then cached)
    "after_start_load_kv",               # the batch left after parking
    "after_forward",                     # the batch, after wait_for_save returned
    "after_request_finished",            # [request id]
    "after_get_finished",                # ids every worker has now reported: saved, then loaded
)

_STATE = LlmRequestState


@dataclass(eq=False)
class _Run:
    """The executor's bookkeeping for one request."""

    req: LlmRequest
    t_start: float
    seq: KVSequence | None = None
    logits: list[torch.Tensor] = field(default_factory=list)
    num_reused_tokens: int = 0
    connector_tokens: int = 0
    prefill_seconds: float = 0.0
    prefill_completed_now: bool = False
    parked_since: float | None = None
    finish_reason: str | None = None
    block_ids: list[int] = field(default_factory=list)
    result: GenerationResult | None = None
    error: BaseException | None = None
    done: bool = False

    @property
    def request_id(self) -> int:
        return self.req.request_id

    @property
    def holds_blocks(self) -> bool:
        return self.seq is not None and not self.seq.released


@dataclass
class _Batch:
    context: list[_Run] = field(default_factory=list)
    generation: list[_Run] = field(default_factory=list)

    @property
    def runs(self) -> list[_Run]:
        return [*self.context, *self.generation]

    @property
    def ids(self) -> list[int]:
        return [run.request_id for run in self.runs]


class _ForwardHooks:
    """The connector's per-layer hooks for one batched forward, plus the "no read before wait
    returned" self-check (``DecoderLayer`` pre/post hooks registered by
    ``_maybe_init_kv_connector_manager``)."""

    def __init__(self, driver: ConnectorDriver | None, request_ids: list[int],
                 observers: list[ForwardObserver]) -> None:
        self.driver, self.request_ids, self.observers = driver, request_ids, observers
        self.ready: set[int] = set()

    def _emit(self, event: str, layer_idx: int) -> None:
        for observer in self.observers:
            observer(event, layer_idx, self.request_ids)

    def before_layer(self, layer_idx: int) -> None:
        if self.driver is not None:
            self.driver.wait_for_layer_load(layer_idx, self.request_ids)
        self.ready.add(layer_idx)
        self._emit("wait_for_layer_load_returned", layer_idx)

    def before_attention_read(self, layer_idx: int) -> None:
        if layer_idx not in self.ready:
            raise AttentionOrderError(f"attention read layer {layer_idx} before wait_for_layer_load")
        self._emit("attention_read", layer_idx)

    def after_layer(self, layer_idx: int) -> None:
        if self.driver is not None:
            self.driver.save_kv_layer(layer_idx, self.request_ids)
        self._emit("save_kv_layer_returned", layer_idx)


class ExecutorLoop:
    """The executor's request state and its loop body (see the module docstring).

    Args:
        model: the transformer.
        manager: the KV cache manager (pool, reuse, events).
        driver: the connector's runtime side, or None without a connector.
        version: the modelled TensorRT-LLM version.
        max_num_tokens: longest context chunk (tokens, a multiple of ``tokens_per_block``).
        max_batch_size: most active requests (``max_num_sequences``).
        connector_timeout_s: longest a request may stay parked for an async load (seconds).
    """

    def __init__(self, model: HarnessTransformer, manager: KVCacheManager, driver: ConnectorDriver | None,
                 version: TrtllmVersion, *, max_num_tokens: int, max_batch_size: int,
                 connector_timeout_s: float) -> None:
        self.model, self.manager, self.driver, self.version = model, manager, driver, version
        self.max_num_tokens, self.max_batch_size = max_num_tokens, max_batch_size
        self.connector_timeout_s = connector_timeout_s
        self.forward_observers: list[ForwardObserver] = []
        self.lifecycle_observers: list[LifecycleObserver] = []
        self.runs: dict[int, _Run] = {}
        self.waiting: deque[_Run] = deque()
        self.active: list[_Run] = []
        self.pinned: dict[int, _Run] = {}
        """Finished requests whose async save is not reported yet (blocks kept)."""
        self.canceled_ids: set[int] = set()
        self.stopped: ExecutorStopped | None = None
        self.forwarded = False
        """Whether the last iteration ran a forward (callers spin-wait gently otherwise)."""

    # ================================================================ entry points
    def enqueue(self, req: LlmRequest) -> None:
        """Queue a validated request (``enqueue_request``)."""
        run = _Run(req, time.perf_counter())
        self.runs[req.request_id] = run
        self.waiting.append(run)

    def step(self) -> bool:
        """One iteration; False when blocked (nothing active or waiting: nothing is called).

        Raises:
            ExecutorStopped: this iteration, or an earlier one, stopped the executor.
        """
        if self.stopped is not None:
            raise self.stopped
        if not self.active and not self.waiting:
            return False
        try:
            self._iteration()
        except ExecutorStopped as stop:
            self._stop(stop)
            raise
        return True

    # ================================================================ one iteration
    def _iteration(self) -> None:
        self.forwarded = False
        self._activate_waiting()
        batch = self._schedule()
        if batch.runs:
            output = self._prepare_resources(batch)
            self._kv_connector_start_batch(batch, output)
        if batch.runs:  # "scheduled_batch might have changed": every context request parked
            logits = self._forward_step(batch)
            if logits is not None:
                self._update_request_states(batch, logits)
                self._send_kv_async(batch)
            self._handle_canceled_requests()
            self._handle_responses()
            self._update_resources(batch)
        self._kv_connector_terminate_requests()
        self.manager.flush_iteration_events()
        self._expire_parked()

    def _activate_waiting(self) -> None:
        while self.waiting and len(self.active) < self.max_batch_size:
            self.active.append(self.waiting.popleft())

    def _schedule(self) -> _Batch:
        batch, free = _Batch(), self._blocks_free_for_new_requests()
        for run in list(self.active):
            state = run.req.state
            if state is _STATE.GENERATION_IN_PROGRESS:
                batch.generation.append(run)
            elif state is _STATE.CONTEXT_INIT:
                if run.seq is None:
                    needed = self._blocks_needed(run)
                    if needed > self.manager.num_blocks:
                        self._fail_too_large(run)
                        continue
                    if needed > free:
                        continue  # waits: blocks come back when other requests end
                    free -= needed
                batch.context.append(run)
        return batch

    def _blocks_needed(self, run: _Run) -> int:
        req, tpb = run.req, self.manager.tokens_per_block
        return -(-(req.prompt_len + req.max_new_tokens - 1) // tpb)

    def _blocks_free_for_new_requests(self) -> int:
        reserved = sum(max(0, self._blocks_needed(r) - len(r.seq.blocks))
                       for r in self.active if r.holds_blocks)
        return self.manager.num_available_blocks() - reserved

    def _fail_too_large(self, run: _Run) -> None:
        self.active.remove(run)
        self._fail(run, KvCacheCapacityError(
            f"request {run.request_id} needs {self._blocks_needed(run)} blocks; the pool has "
            f"{self.manager.num_blocks}"))

    # ---------------------------------------------------------------- prepare_resources
    def _prepare_resources(self, batch: _Batch) -> object | None:
        for run in batch.context:
            if run.seq is None:
                self._add_sequence(run)
            run.req.context_chunk_size = self._chunk_len(run.req)
        for run in batch.generation:
            self.manager.ensure_capacity(run.seq, run.req.get_num_tokens())
        if self.driver is None:
            return None
        return self.driver.build_scheduler_output([(r.req, r.seq) for r in batch.context],
                                                  [(r.req, r.seq) for r in batch.generation])

    def _add_sequence(self, run: _Run) -> None:
        req, driver = run.req, self.driver

        def on_matched(num_computed_tokens: int) -> int:
            num_tokens = driver.get_num_new_matched_tokens(req, num_computed_tokens)
            self._notify("after_get_num_new_matched_tokens", [req.request_id])
            return num_tokens

        seq, connector_tokens = self.manager.add_sequence(
            req.request_id, req.prompt_token_ids, max_new_tokens=req.max_new_tokens,
            lora_task_id=req.lora_task_id, cache_salt=req.cache_salt,
            retention=req.kv_cache_retention_config, on_matched=on_matched if driver else None)
        run.seq, run.num_reused_tokens, run.connector_tokens = seq, seq.num_reused_tokens, connector_tokens
        req.context_current_position = seq.num_reused_tokens + connector_tokens
        if driver is not None:
            driver.update_state_after_alloc(req, seq.block_ids)
            self._notify("after_update_state_after_alloc", [req.request_id])

    def _chunk_len(self, req: LlmRequest) -> int:
        start, tpb = req.context_current_position, self.manager.tokens_per_block
        end = start + self.max_num_tokens
        if end < req.prompt_len:
            end = end // tpb * tpb  # chunks end on a block boundary (setPrepopulatedPromptLen)
        return min(end, req.prompt_len) - start

    # ---------------------------------------------------------------- connector start, forward
    def _kv_connector_start_batch(self, batch: _Batch, output: object | None) -> None:
        driver = self.driver
        if driver is None:
            return
        for run in [r for r in batch.context if driver.is_loading_async(r.request_id)]:
            run.req.state = _STATE.DISAGG_GENERATION_TRANS_IN_PROGRESS
            run.parked_since = time.monotonic()
            batch.context.remove(run)
        driver.handle_metadata(output)
        self._notify("after_build_connector_meta",
                     [d.request_id for d in (*output.new_requests, *output.cached_requests)])
        driver.start_load_kv()
        self._notify("after_start_load_kv", batch.ids)

    def _forward_step(self, batch: _Batch) -> list[torch.Tensor] | None:
        self.forwarded = True
        hooks = _ForwardHooks(self.driver, batch.ids, self.forward_observers)
        try:
            logits = self.model.forward_paged_batch([self._chunk(run) for run in batch.runs],
                                                    self.manager.kv_cache, hooks)
            if self.driver is not None:
                self.driver.wait_for_save(batch.ids)
        except AssertionError:  # the harness's own ordering self-check (AttentionOrderError): a bug, not an engine event
            raise
        except Exception as error:  # _forward_step's `except Exception`: _handle_errors (a worker hook or the model)
            self._handle_errors(error)
            return None
        self._notify("after_forward", batch.ids)
        return logits

    @staticmethod
    def _chunk(run: _Run) -> PagedChunk:
        req = run.req
        if req.state is _STATE.CONTEXT_INIT:
            start = req.context_current_position
            return PagedChunk(req.prompt_token_ids[start : start + req.context_chunk_size], start,
                              run.seq.block_ids)
        return PagedChunk([req.output_token_ids[-1]], req.get_num_tokens() - 1, run.seq.block_ids)

    def _handle_errors(self, error: BaseException) -> None:
        """Every active request fails with ``error`` (responses first), then each is terminated."""
        failed, self.active = self.active, []
        for run in failed:
            run.req.state = _STATE.GENERATION_COMPLETE
            self._fail(run, error)
        for run in failed:
            self._terminate(run)

    # ---------------------------------------------------------------- after the forward
    def _update_request_states(self, batch: _Batch, logits: list[torch.Tensor]) -> None:
        for run, out in zip(batch.runs, logits):
            req = run.req
            if req.state is _STATE.CONTEXT_INIT:
                run.logits.append(out)
                req.context_current_position += out.shape[0]
                if req.context_current_position < req.prompt_len:
                    continue
                run.prefill_seconds = time.perf_counter() - run.t_start
                run.prefill_completed_now = True
                req.state = _STATE.GENERATION_IN_PROGRESS
            self._append_token(run, int(torch.argmax(out[-1])))

    def _append_token(self, run: _Run, token: int) -> None:
        run.req.output_token_ids.append(token)
        run.seq.tokens.append(token)
        if len(run.req.output_token_ids) >= run.req.max_new_tokens:
            run.req.state, run.finish_reason = _STATE.GENERATION_COMPLETE, "length"

    def _send_kv_async(self, batch: _Batch) -> None:
        if self.driver is None or self.version.request_finished_on_every_termination:
            return
        for run in batch.runs:
            if run.finish_reason is not None and not run.done and run.holds_blocks:
                self._request_finished(run)

    def _request_finished(self, run: _Run) -> bool:
        saving = self.driver.request_finished(run.req, run.seq.block_ids)
        self._notify("after_request_finished", [run.request_id])
        if saving:
            self.pinned[run.request_id] = run
            if self.version.stores_blocks_when_save_starts:
                self.manager.store_blocks_for_reuse(run.seq)
        return saving

    def _handle_canceled_requests(self) -> None:
        if not self.canceled_ids:
            return
        for run in [r for r in self.waiting if r.request_id in self.canceled_ids]:
            self.waiting.remove(run)  # never scheduled: it just leaves
            run.finish_reason = "cancelled"
            self._complete(run)
        for run in self.active:
            if run.request_id in self.canceled_ids and run.finish_reason is None:
                run.req.state, run.finish_reason = _STATE.GENERATION_COMPLETE, "cancelled"
        self.canceled_ids.clear()

    def _handle_responses(self) -> None:
        finished = [run for run in self.active if run.finish_reason is not None]
        self.active = [run for run in self.active if run.finish_reason is None]
        for run in finished:
            self._complete(run)
        for run in finished:
            self._terminate(run)

    def _terminate(self, run: _Run) -> None:
        """``_do_terminate_request``: ``request_finished`` first only when the version does so."""
        if not run.holds_blocks or run.request_id in self.pinned:
            return
        if self.driver is not None and self.version.request_finished_on_every_termination:
            if self._request_finished(run):
                return  # blocks stay allocated until every worker reported the save
        self.manager.remove_sequence(run.seq, store_for_reuse=True)

    def _update_resources(self, batch: _Batch) -> None:
        for run in batch.context:
            if run.prefill_completed_now and run.holds_blocks:
                self.manager.store_context_blocks(run.seq)
            run.prefill_completed_now = False

    # ---------------------------------------------------------------- get_finished, timeouts
    def _kv_connector_terminate_requests(self) -> None:
        if self.driver is None:
            return
        saved, loaded = self.driver.get_finished()
        for request_id in saved:
            run = self.pinned.pop(request_id, None)
            if run is not None:
                run.req.state = _STATE.DISAGG_CONTEXT_COMPLETE
                self.manager.remove_sequence(run.seq, store_for_reuse=True)
        for request_id in loaded:
            run = self.runs.get(request_id)
            if run is not None and run in self.active and run.parked_since is not None:
                run.req.state, run.parked_since = _STATE.CONTEXT_INIT, None
        self._notify("after_get_finished", [*saved, *loaded])

    def _expire_parked(self) -> None:
        now = time.monotonic()
        for run in [r for r in self.active if r.parked_since is not None]:
            if now - run.parked_since <= self.connector_timeout_s:
                continue
            self.active.remove(run)
            self._fail(run, ConnectorContractError(
                f"async load of request {run.request_id} not reported by every worker's "
                f"get_finished within {self.connector_timeout_s} s (harness safety limit)"))
            self.manager.remove_sequence(run.seq, store_for_reuse=False)

    # ---------------------------------------------------------------- results, stop
    def _complete(self, run: _Run) -> None:
        req = run.req
        if run.holds_blocks:
            run.block_ids = run.seq.block_ids
        logits = torch.cat(run.logits) if run.logits else torch.empty(0, self.model.cfg.vocab_size)
        run.result = GenerationResult(
            request_id=req.request_id, token_ids=list(req.output_token_ids), prefill_logits=logits,
            prefill_start=run.num_reused_tokens + run.connector_tokens,
            num_reused_tokens=run.num_reused_tokens, num_connector_tokens=run.connector_tokens,
            prefill_seconds=run.prefill_seconds, block_ids=list(run.block_ids),
            finish_reason=run.finish_reason or "length")
        run.done = True

    @staticmethod
    def _fail(run: _Run, error: BaseException) -> None:
        run.error, run.finish_reason, run.done = error, "error", True

    def _stop(self, stop: ExecutorStopped) -> None:
        """Every active and waiting request fails with its own ``ExecutorStopped``; nothing is freed."""
        self.stopped = stop
        for run in [*self.active, *self.waiting]:
            if not run.done:
                error = ExecutorStopped(str(stop), hook=stop.hook)
                error.__cause__ = stop.__cause__
                self._fail(run, error)
        self.active, self.waiting = [], deque()

    def _notify(self, point: str, request_ids: list[int]) -> None:
        for callback in self.lifecycle_observers:
            callback(point, list(request_ids))

"""REFERENCE ENGINE HARNESS — an ``LLM``-like facade that runs a KV Cache Connector in TensorRT-LLM's order.

Test and demo infrastructure only; never an engine for serving. One :class:`HarnessLLM` is one
"engine": a :class:`~.model.HarnessTransformer`, a :class:`~.kv_cache_manager.KVCacheManager` and
optionally a connector (scheduler + one or more workers). It keeps no global state, so two engines
in one process (or one per process) can share a donor store and a ledger through their connectors.

Each executor iteration follows ``PyExecutor._executor_loop`` (NVIDIA/TensorRT-LLM
``tensorrt_llm/_torch/pyexecutor/py_executor.py``):

1. prepare resources — a new request: ``add_sequence`` matches reusable blocks and allocates its
   context blocks, then, still under the manager's lock, the connector's
   ``get_num_new_matched_tokens(request, num_computed_tokens)``; lock released,
   ``update_state_after_alloc(request, block_ids)``. A generating request: one more block if needed.
2. ``build_connector_meta(scheduler_output)`` → ``bind_connector_meta`` on every worker; a request
   whose load is async is parked (``DISAGG_GENERATION_TRANS_IN_PROGRESS``) and left out of the batch;
   ``start_load_kv(stream)`` on every worker.
3. forward (only when a request is scheduled): per layer ``wait_for_layer_load(layer_idx, stream)``,
   the layer, ``save_kv_layer(layer_idx, stream)``; then ``wait_for_save(stream)``.
4. responses: a finished request gets ``request_finished(request, cache_block_ids)``; True keeps its
   blocks until every worker reports the save; then resources: the context blocks are stored for
   reuse after the last context chunk.
5. ``get_finished(finished_gen_req_ids, started_loading_req_ids)`` on every worker, every iteration;
   then the iteration's KV events are flushed to the bounded buffer.

Rules enforced (errors are raised from :meth:`HarnessLLM.generate`):

- ``(0, True)``, negative counts, promises that are not whole blocks or that leave no prompt token to
  compute → :class:`~.connector_driver.ConnectorContractError` (the request fails, its blocks are
  released unstored, ``request_finished`` is still called);
- an async load parks the request until EVERY worker reported it in ``get_finished(...)[1]``
  (``connector_timeout_s`` bounds the wait);
- attention never gathers a layer's KV before ``wait_for_layer_load`` returned for it on every
  worker (checked per layer, :class:`~.connector_driver.AttentionOrderError`);
- an exception in any worker hook fails that request with
  :class:`~.connector_driver.ConnectorWorkerError` and its blocks are NOT stored for reuse; other
  requests and the cache stay intact. With ``trtllm_hook_errors=True`` the harness instead does
  what TensorRT-LLM 1.1/1.2's source shows (connector/README.md, "TensorRT-LLM 1.1/1.2"): an
  exception from ``start_load_kv`` (called outside the forward's error handling) stops the executor
  — that request fails and every later ``generate`` raises :class:`ExecutorStopped`; one from
  ``wait_for_layer_load`` fails the request and stores its blocks for reuse
  (``_handle_errors`` → ``free_resources`` → ``remove_sequence(id, request)`` → ``releaseBlocks``),
  half-loaded connector blocks included. (The harness runs one request at a time, so "every active
  request" is that one.) If the scheduler implements the newer
  ``cancel_load(request, start, end)`` and/or ``request_reset(request)``, a failure in
  ``start_load_kv``/``wait_for_layer_load`` instead calls them and recomputes the promised range
  locally (once), as newer TensorRT-LLM recomputes a discarded load.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .connector_driver import AttentionOrderError, ConnectorContractError, ConnectorDriver
from .connector_driver import ConnectorWorkerError
from .events import EventShape, KvEventIterator
from .kv_cache_manager import KVCacheManager, KVSequence
from .llm_args import HarnessLlmArgs, KvCacheConfig, KvCacheConnectorConfig
from .model import HarnessTransformer, ModelConfig
from .request import GenerationResult, LlmRequest, LlmRequestState
from .retention import KvCacheRetentionConfig

__all__ = ["ExecutorStopped", "ForwardObserver", "HarnessLLM"]


class ExecutorStopped(RuntimeError):
    """The engine's executor loop ended on a worker hook exception (``trtllm_hook_errors``): no
    request is served any more; an operator restarts the engine (its cache starts empty)."""

log = logging.getLogger(__name__)
ForwardObserver = Callable[[str, int, list[int]], None]
"""``observer(event, layer_idx, request_ids)`` with event ``wait_for_layer_load_returned``,
``attention_read`` or ``save_kv_layer_returned``."""


@dataclass(eq=False)
class _Run:
    req: LlmRequest
    t_start: float
    seq: KVSequence | None = None
    logits: list[torch.Tensor] = field(default_factory=list)
    connector_tokens: int = 0
    connector_queried: bool = False
    prefill_seconds: float = 0.0
    recomputed: bool = False
    finished: bool = False
    block_ids: list[int] = field(default_factory=list)
    error: BaseException | None = None


class _ForwardHooks:
    """Per-layer connector hooks plus the "no read before wait returned" check."""

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


class HarnessLLM:
    """``LLM``-like reference engine on the CPU.

    Args:
        model_config: model shape (default :class:`ModelConfig`).
        kv_cache_config: pool and reuse settings; ``tokens_per_block`` must match the model's.
        kv_connector: None; ``(scheduler_cls, worker_cls)`` constructed with :attr:`llm_args`;
            ``(scheduler, worker)`` instances; a worker slot may be a list (one worker per simulated
            rank); or a :class:`KvCacheConnectorConfig` (module imported with importlib).
        max_num_tokens: prefill chunk size (tokens, a multiple of ``tokens_per_block``).
        max_seq_len: longest prompt + generation (tokens); default ``model_config.max_context``.
        attention_dp_rank: reported in events and ``SchedulerOutput`` when not None.
        event_shape: ``"newer"`` or ``"1.2"`` KV-event dicts.
        first_request_id: first request id of this engine.
        connector_timeout_s: longest wait for an async load (seconds).
        model: reuse an already built model (must match ``model_config``).
    """

    def __init__(
        self,
        model_config: ModelConfig | None = None,
        *,
        kv_cache_config: KvCacheConfig | None = None,
        kv_connector: Any = None,
        max_num_tokens: int = 512,
        max_seq_len: int | None = None,
        attention_dp_rank: int | None = None,
        event_shape: EventShape = "newer",
        first_request_id: int = 1,
        connector_timeout_s: float = 30.0,
        model: HarnessTransformer | None = None,
        trtllm_hook_errors: bool = False,
    ) -> None:
        cfg = model_config or ModelConfig()
        kvc = kv_cache_config or KvCacheConfig(tokens_per_block=cfg.tokens_per_block)
        tpb = cfg.tokens_per_block
        if kvc.tokens_per_block != tpb:
            raise ValueError(f"kv_cache_config.tokens_per_block={kvc.tokens_per_block} != model {tpb}")
        if max_num_tokens < tpb or max_num_tokens % tpb:
            raise ValueError("max_num_tokens must be a positive multiple of tokens_per_block")
        self.model_config = cfg
        self.model = model if model is not None else HarnessTransformer(cfg)
        self.max_num_tokens = max_num_tokens
        self.max_seq_len = max_seq_len or cfg.max_context
        self.connector_timeout_s = connector_timeout_s
        block_bytes = cfg.kv_bytes_per_token * tpb
        self.kv_cache_manager = KVCacheManager(
            num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            tokens_per_block=tpb, num_blocks=(kvc.max_tokens or max(4 * cfg.max_context, 1024)) // tpb,
            host_num_blocks=(kvc.host_cache_size or 0) // block_bytes,
            enable_block_reuse=kvc.enable_block_reuse,
            secondary_offload_min_priority=kvc.secondary_offload_min_priority
            if kvc.secondary_offload_min_priority is not None else 30,
            event_buffer_max_size=kvc.event_buffer_max_size, attention_dp_rank=attention_dp_rank,
            window_size=self.max_seq_len, event_shape=event_shape,
        )
        self.llm_args = HarnessLlmArgs(
            model=cfg.name, harness_model_config=cfg, kv_cache_config=kvc, max_seq_len=self.max_seq_len,
            max_num_tokens=max_num_tokens, enable_attention_dp=attention_dp_rank is not None,
            kv_connector_config=kv_connector if isinstance(kv_connector, KvCacheConnectorConfig) else None,
        )
        self._lock = threading.Lock()
        self._next_request_id = first_request_id
        self._parked: dict[int, LlmRequest] = {}
        self._pinned: dict[int, tuple[KVSequence | None, bool]] = {}
        self._observers: list[ForwardObserver] = []
        self.trtllm_hook_errors = trtllm_hook_errors
        """Model TensorRT-LLM 1.1/1.2's handling of worker hook exceptions (module docstring)."""
        self._stopped: ConnectorWorkerError | None = None
        self.connector = self._build_connector(kv_connector, attention_dp_rank)

    # ================================================================ public API
    @property
    def kv_cache(self) -> torch.Tensor:
        """The GPU pool ``[num_blocks, num_layers, 2, num_kv_heads * head_dim * tokens_per_block]``."""
        return self.kv_cache_manager.kv_cache

    @property
    def tokens_per_block(self) -> int:
        """KV block size (tokens)."""
        return self.model_config.tokens_per_block

    def add_forward_observer(self, observer: ForwardObserver) -> None:
        """Observe per-layer hook returns and attention reads (tests check the ordering)."""
        self._observers.append(observer)

    def get_kv_cache_events(self, timeout: float | None = 2) -> list[dict[str, Any]]:
        """Drain KV-cache events, waiting up to ``timeout`` seconds for the first one."""
        return self.kv_cache_manager.events.get_events(timeout)

    def get_kv_cache_events_async(self, timeout: float | None = 2) -> KvEventIterator:
        """Async iterator of KV-cache events (ends after ``timeout`` seconds without one)."""
        return self.kv_cache_manager.events.aiter(timeout)

    def generate(
        self,
        prompt_token_ids: list[int],
        max_new_tokens: int = 1,
        cache_salt: str | None = None,
        lora_task_id: int | None = None,
        kv_cache_retention_config: KvCacheRetentionConfig | None = None,
    ) -> GenerationResult:
        """Prefill (chunked, with reuse and connector loads) and greedy-decode one request.

        Raises:
            ValueError: empty prompt, token out of vocabulary, or too long for ``max_seq_len``.
            KvCacheCapacityError: the pool cannot hold the request.
            ConnectorContractError, ConnectorWorkerError, AttentionOrderError: see the module doc.
            ExecutorStopped: an earlier ``start_load_kv`` exception stopped it (``trtllm_hook_errors``).
        """
        if self._stopped is not None:
            raise ExecutorStopped("the executor stopped on a worker hook exception; restart the engine") from self._stopped
        prompt = [int(t) for t in prompt_token_ids]
        self._validate(prompt, max_new_tokens)
        with self._lock:
            req = LlmRequest(self._next_request_id, prompt, max_new_tokens, lora_task_id, cache_salt,
                             kv_cache_retention_config)
            self._next_request_id += 1
            run = _Run(req, time.perf_counter())
            self._drive(run)
            return GenerationResult(
                request_id=req.request_id, token_ids=list(req.output_token_ids),
                prefill_logits=torch.cat(run.logits), prefill_start=req.prompt_len - sum(
                    x.shape[0] for x in run.logits),
                num_reused_tokens=run.seq.num_reused_tokens if run.seq else 0,
                num_connector_tokens=run.connector_tokens, prefill_seconds=run.prefill_seconds,
                block_ids=run.block_ids,
                recomputed_after_load_failure=run.recomputed)

    def wait_for_pending_transfers(self, timeout_s: float = 10.0) -> None:
        """Run idle iterations until every pinned (async-saving) request is released.

        Raises:
            TimeoutError: saves still outstanding after ``timeout_s`` seconds.
        """
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self.connector is not None and (self._pinned or self.connector.has_pending()):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"connector transfers pending: {sorted(self._pinned)}")
                self._idle_iteration()
                time.sleep(0.0005)

    def shutdown(self) -> None:
        """Wait for pending connector transfers (bounded), then flush events."""
        if self.connector is not None:
            self.wait_for_pending_transfers()
        self.kv_cache_manager.flush_iteration_events()

    # ================================================================ construction helpers
    def _validate(self, prompt: list[int], max_new_tokens: int) -> None:
        if not prompt:
            raise ValueError("prompt_token_ids must not be empty")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if len(prompt) + max_new_tokens > self.max_seq_len:
            raise ValueError(f"{len(prompt)} + {max_new_tokens} tokens exceed max_seq_len={self.max_seq_len}")
        if min(prompt) < 0 or max(prompt) >= self.model_config.vocab_size:
            raise ValueError("token id outside the vocabulary")

    def _build_connector(self, spec: Any, attention_dp_rank: int | None) -> ConnectorDriver | None:
        if spec is None:
            return None
        if isinstance(spec, KvCacheConnectorConfig):
            module = importlib.import_module(spec.connector_module)
            spec = (getattr(module, spec.connector_scheduler_class),
                    getattr(module, spec.connector_worker_class))
        scheduler, worker_spec = spec
        if isinstance(scheduler, type):
            scheduler = scheduler(self.llm_args)
        workers = worker_spec if isinstance(worker_spec, list) else [worker_spec]
        workers = [w(self.llm_args) if isinstance(w, type) else w for w in workers]
        for worker in workers:
            worker.register_kv_caches(self.kv_cache_manager.kv_cache)
        if hasattr(scheduler, "wait_for_initialization"):
            scheduler.wait_for_initialization()
        return ConnectorDriver(scheduler, workers, self.kv_cache_manager, attention_dp_rank)

    # ================================================================ the executor loop
    def _drive(self, run: _Run) -> None:
        deadline = None
        while not run.finished:
            self._step(run)
            if run.req.state is LlmRequestState.DISAGG_GENERATION_TRANS_IN_PROGRESS:
                deadline = deadline or time.monotonic() + self.connector_timeout_s
                if time.monotonic() > deadline:
                    error = ConnectorContractError(
                        f"async load of request {run.req.request_id} not reported by every worker's "
                        f"get_finished within {self.connector_timeout_s} s")
                    self._fail(run)
                    raise error
                time.sleep(0.0005)

    def _step(self, run: _Run) -> None:
        try:
            self._schedule_and_forward(run)
        except ConnectorWorkerError as exc:
            if self._can_recompute(exc, run):
                self._recompute(run)
            else:
                run.error = exc
                if self.trtllm_hook_errors and exc.hook == "start_load_kv":
                    self._stopped = exc
        except Exception as exc:  # boundary: the request fails, the engine keeps running
            run.error = exc
        if run.error is not None:
            self._fail(run, store_for_reuse=self.trtllm_hook_errors and isinstance(run.error, ConnectorWorkerError)
                       and run.error.hook == "wait_for_layer_load")
        try:
            self._end_iteration()
        except Exception as exc:
            if run.error is None:
                if not run.finished:
                    self._fail(run)
                raise
            log.error("get_finished failed after request %s failed: %s", run.req.request_id, exc)
        if run.error is not None:
            raise run.error

    def _schedule_and_forward(self, run: _Run) -> None:
        req = run.req
        if run.seq is None:
            self._admit(run)
        seq = run.seq
        context, generation = [], []
        if req.state is LlmRequestState.CONTEXT_INIT:
            req.context_chunk_size = self._chunk_len(req)
            context = [(req, seq)]
        elif req.state is LlmRequestState.GENERATION_IN_PROGRESS:
            self.kv_cache_manager.ensure_capacity(seq, req.get_num_tokens())
            generation = [(req, seq)]
        ids = [req.request_id] if context or generation else []
        if self.connector is not None:
            output = self.connector.build_scheduler_output(context, generation)
            if context and req.request_id in self.connector.new_loading:
                req.state = LlmRequestState.DISAGG_GENERATION_TRANS_IN_PROGRESS
                self._parked[req.request_id] = req
                context, ids = [], []
            self.connector.handle_metadata(output)
            self.connector.start_load_kv(ids)
        if not (context or generation):
            return
        logits = self._forward(req, seq, bool(context))
        if self.connector is not None:
            self.connector.wait_for_save(ids)
        self._after_forward(run, logits, bool(context))

    def _admit(self, run: _Run) -> None:
        req, driver = run.req, self.connector

        def on_matched(num_computed_tokens: int) -> int:
            run.connector_queried = True
            return driver.query(req, num_computed_tokens)

        seq, connector_tokens = self.kv_cache_manager.add_sequence(
            req.request_id, req.prompt_token_ids, max_new_tokens=req.max_new_tokens,
            lora_task_id=req.lora_task_id, cache_salt=req.cache_salt,
            retention=req.kv_cache_retention_config, on_matched=on_matched if driver else None)
        run.seq, run.connector_tokens = seq, connector_tokens
        req.context_current_position = seq.num_reused_tokens + connector_tokens
        if driver is not None:
            driver.update_state_after_alloc(req, seq.block_ids)

    def _chunk_len(self, req: LlmRequest) -> int:
        start, tpb = req.context_current_position, self.tokens_per_block
        end = start + self.max_num_tokens
        if end < req.prompt_len:
            end = end // tpb * tpb  # chunks end on a block boundary (setPrepopulatedPromptLen)
        return min(end, req.prompt_len) - start

    def _forward(self, req: LlmRequest, seq: KVSequence, is_context: bool) -> torch.Tensor:
        hooks = _ForwardHooks(self.connector, [req.request_id], self._observers)
        if is_context:
            start = req.context_current_position
            tokens = req.prompt_token_ids[start : start + req.context_chunk_size]
        else:
            start, tokens = req.get_num_tokens() - 1, [req.output_token_ids[-1]]
        return self.model.forward_paged(tokens, start, seq.block_ids, self.kv_cache, hooks)

    def _after_forward(self, run: _Run, logits: torch.Tensor, is_context: bool) -> None:
        req, seq = run.req, run.seq
        if is_context:
            run.logits.append(logits)
            req.context_current_position += logits.shape[0]
            if req.context_current_position < req.prompt_len:
                return
            run.prefill_seconds = time.perf_counter() - run.t_start
            req.state = LlmRequestState.GENERATION_IN_PROGRESS
        self._append_token(run, int(torch.argmax(logits[-1])))
        if is_context and not seq.released:
            self.kv_cache_manager.store_context_blocks(seq)

    def _append_token(self, run: _Run, token: int) -> None:
        run.req.output_token_ids.append(token)
        run.seq.tokens.append(token)
        if len(run.req.output_token_ids) >= run.req.max_new_tokens:
            self._finish(run)

    def _finish(self, run: _Run) -> None:
        req, seq = run.req, run.seq
        req.state, run.finished = LlmRequestState.GENERATION_COMPLETE, True
        run.block_ids = seq.block_ids
        if self.connector is not None and self.connector.request_finished(req, seq.block_ids):
            self._pinned[req.request_id] = (seq, True)
            return
        self.kv_cache_manager.remove_sequence(seq, store_for_reuse=True)

    def _fail(self, run: _Run, *, store_for_reuse: bool = False) -> None:
        """Release a failed request: ``request_finished`` is still called; its blocks are stored for
        reuse only when ``store_for_reuse`` (TensorRT-LLM 1.1/1.2 after an error in the forward)."""
        req, seq = run.req, run.seq
        req.state, run.finished = LlmRequestState.GENERATION_COMPLETE, True
        self._parked.pop(req.request_id, None)
        pin = False
        if self.connector is not None and run.connector_queried:
            self.connector.reset_request(req.request_id)
            try:
                pin = self.connector.request_finished(req, seq.block_ids if seq else [])
            except Exception as exc:  # boundary: cleanup of an already failed request
                log.error("request_finished raised for failed request %s: %s", req.request_id, exc)
        if pin:
            self._pinned[req.request_id] = (seq, store_for_reuse)
        elif seq is not None:
            self.kv_cache_manager.remove_sequence(seq, store_for_reuse=store_for_reuse)

    def _can_recompute(self, exc: ConnectorWorkerError, run: _Run) -> bool:
        scheduler = self.connector.scheduler if self.connector else None
        return (exc.hook in ("start_load_kv", "wait_for_layer_load") and run.connector_tokens > 0
                and not run.recomputed and run.seq is not None
                and run.req.state is LlmRequestState.CONTEXT_INIT
                and (hasattr(scheduler, "cancel_load") or hasattr(scheduler, "request_reset")))

    def _recompute(self, run: _Run) -> None:
        req, seq, scheduler = run.req, run.seq, self.connector.scheduler
        start = seq.num_reused_tokens
        if hasattr(scheduler, "cancel_load"):
            scheduler.cancel_load(req, start, start + run.connector_tokens)
        if hasattr(scheduler, "request_reset"):
            scheduler.request_reset(req)
        self.connector.reset_request(req.request_id)
        req.context_current_position, req.py_num_connector_matched_tokens = start, 0
        run.connector_tokens, run.logits, run.recomputed = 0, [], True

    def _end_iteration(self) -> None:
        """``get_finished``, then publish the iteration's events.

        TensorRT-LLM flushes before ``_kv_connector_terminate_requests``, so blocks released by a
        finished save show up one iteration later; the harness flushes after it so an idle engine
        never holds events back (same events, same order).
        """
        try:
            if self.connector is not None:
                self._apply_finished(*self.connector.get_finished())
        finally:
            self.kv_cache_manager.flush_iteration_events()

    def _apply_finished(self, saved: list[int], loaded: list[int]) -> None:
        for request_id in loaded:
            req = self._parked.pop(request_id, None)
            if req is not None:
                req.state = LlmRequestState.CONTEXT_INIT
        for request_id in saved:
            seq, store = self._pinned.pop(request_id, (None, False))
            if seq is not None:
                self.kv_cache_manager.remove_sequence(seq, store_for_reuse=store)

    def _idle_iteration(self) -> None:
        if self.connector is not None:
            self.connector.handle_metadata(self.connector.build_scheduler_output([], []))
            self.connector.start_load_kv([])
        self._end_iteration()

"""REFERENCE ENGINE HARNESS — an ``LLM``-like facade over TensorRT-LLM's executor loop, per version.

Test and demo infrastructure only; never an engine for serving. One :class:`HarnessLLM` is one
"engine": a :class:`~.model.HarnessTransformer`, a :class:`~.kv_cache_manager.KVCacheManager`,
optionally a connector (scheduler + one worker per simulated rank, driven by
:class:`~.connector_driver.ConnectorDriver`), and the executor loop of
:mod:`.executor`, which runs many requests together as ``PyExecutor._executor_loop`` does
(NVIDIA/TensorRT-LLM ``tensorrt_llm/_torch/pyexecutor/py_executor.py``, non-overlap loop,
``disable_overlap_scheduler=True``, the mode the product documents). It keeps no global state, so
two engines in one process (or one per process) can share a donor store and a ledger through their
connectors.

The modelled version (``trtllm_version``, default :data:`~.trtllm_versions.TRTLLM_MAIN_2026`)
decides which exits call ``request_finished`` and what ``RequestData`` carries
(:mod:`.trtllm_versions`). TensorRT-LLM's semantics are the only semantics:

- an exception from ``get_num_new_matched_tokens`` (or the runtime's checks on its answer),
  ``update_state_after_alloc``, ``build_connector_meta``, ``start_load_kv``, ``request_finished``
  or ``get_finished`` stops the executor: every active and waiting request fails with
  :class:`~.connector_driver.ExecutorStopped`, nothing is called again, and later
  ``generate``/``submit``/``step`` raise it;
- an exception from ``wait_for_layer_load``, ``save_kv_layer`` or ``wait_for_save`` fails EVERY
  active request (parked ones included) with :class:`~.connector_driver.ConnectorWorkerError`;
  their blocks are stored for reuse as they are (``releaseBlocks`` does not check that a prefill
  completed) and the loop goes on. Under the overlap loop (TensorRT-LLM's default, not modelled)
  such an exception also stops the executor: ``assert sample_state is not None``;
- nothing recomputes a failed load (TensorRT-LLM has no ``cancel_load``/``request_reset``);
- an idle engine is blocked waiting for requests and calls no connector hook at all: a save
  reported only by a later ``get_finished`` stays pending until the next request arrives
  (:meth:`HarnessLLM.wait_for_pending_transfers` raises rather than pretend otherwise); shutdown
  drains nothing.
"""

from __future__ import annotations

import importlib
import threading
import time
from typing import Any

import torch

from .connector_driver import ConnectorDriver, ExecutorStopped
from .events import EventShape, KvEventIterator
from .executor import ExecutorLoop, ForwardObserver, LifecycleObserver
from .kv_cache_manager import KVCacheManager
from .llm_args import HarnessLlmArgs, KvCacheConfig, KvCacheConnectorConfig
from .model import HarnessTransformer, ModelConfig, TensorParallel
from .request import GenerationResult, LlmRequest
from .retention import KvCacheRetentionConfig
from .trtllm_versions import TRTLLM_MAIN_2026, TrtllmVersion

__all__ = ["ExecutorStopped", "ForwardObserver", "HarnessLLM", "LifecycleObserver"]

_SPIN_S = 0.0005
"""Pause after an iteration that forwarded nothing (parked requests keep the loop awake)."""


class HarnessLLM:
    """``LLM``-like reference engine on the CPU.

    Args:
        model_config: model shape (default :class:`ModelConfig`).
        kv_cache_config: pool and reuse settings; ``tokens_per_block`` must match the model's.
        kv_connector: None; ``(scheduler_cls, worker_cls)`` constructed with :attr:`llm_args`;
            ``(scheduler, worker)`` instances; a worker slot may be a list (one worker per simulated
            rank); or a :class:`KvCacheConnectorConfig` (module imported with importlib).
        max_num_tokens: longest prefill chunk of a request (tokens, a multiple of
            ``tokens_per_block``).
        max_seq_len: longest prompt + generation (tokens); default ``model_config.max_context``.
        attention_dp_rank: this engine is rank ``attention_dp_rank`` of an attention-DP engine
            (``llm_args.enable_attention_dp``): it holds its own KV pool, scheduler and worker, as each
            rank of TensorRT-LLM's attention DP does, and reports the rank in its KV events and (2026
            main) in every ``SchedulerOutput``. Build one ``HarnessLLM`` per rank (same model and
            configuration) to model the whole engine; requests go to the rank they are submitted to
            (TensorRT-LLM's attention-DP router decides that in a real engine).
        attention_dp_size: attention-DP ranks of that engine (``llm_args.tensor_parallel_size``, as
            in TensorRT-LLM, where the attention-DP ranks are the tensor-parallel ranks with
            attention not sharded); default ``attention_dp_rank + 1``. Ignored without a rank.
        tensor_parallel: this engine is rank ``tensor_parallel.rank`` of a tensor-parallel engine of
            ``tensor_parallel.size`` processes (``torch.distributed`` initialized, e.g. gloo on
            127.0.0.1): the model's heads and MLP are split (:class:`~.model.TensorParallel`), the
            pool holds this rank's KV heads, the connector's scheduler is built on rank 0 only and
            its answers are broadcast (:mod:`.connector_driver`). TensorRT-LLM's rank 0 broadcasts
            every new request to the other ranks; here the caller submits the same requests, in the
            same order, on every rank (each rank then runs the same iterations in lockstep, its
            collectives pairing with the others').
        event_shape: ``"newer"`` or ``"1.2"`` KV-event dicts.
        first_request_id: first request id of this engine.
        connector_timeout_s: longest a request may wait parked for an async load (seconds;
            harness safety limit: the request then fails with ``ConnectorContractError``).
        model: reuse an already built model (must match ``model_config``).
        trtllm_version: the TensorRT-LLM version whose behaviour is modelled.
        max_batch_size: most requests active at once; later ones wait (FIFO).

    Raises:
        ValueError: inconsistent configuration (``tokens_per_block``, ``max_num_tokens``,
            ``max_batch_size``, an ``attention_dp_rank`` outside ``attention_dp_size``).
        NotImplementedError: under attention DP on 2026 main, a connector class that does not
            declare ``supports_attention_dp = True`` (TensorRT-LLM refuses it at bring-up).

    Thread-safety: every public method may be called from any thread; iterations are serialised.
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
        attention_dp_size: int | None = None,
        event_shape: EventShape = "newer",
        first_request_id: int = 1,
        connector_timeout_s: float = 30.0,
        model: HarnessTransformer | None = None,
        trtllm_version: TrtllmVersion = TRTLLM_MAIN_2026,
        max_batch_size: int = 8,
        tensor_parallel: TensorParallel | None = None,
    ) -> None:
        cfg = model_config or ModelConfig()
        kvc = kv_cache_config or KvCacheConfig(tokens_per_block=cfg.tokens_per_block)
        tpb = cfg.tokens_per_block
        if kvc.tokens_per_block != tpb:
            raise ValueError(f"kv_cache_config.tokens_per_block={kvc.tokens_per_block} != model {tpb}")
        if max_num_tokens < tpb or max_num_tokens % tpb:
            raise ValueError("max_num_tokens must be a positive multiple of tokens_per_block")
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        dp_size = 1
        if attention_dp_rank is not None:
            dp_size = attention_dp_size if attention_dp_size is not None else attention_dp_rank + 1
            if not 0 <= attention_dp_rank < dp_size:
                raise ValueError(f"attention_dp_rank={attention_dp_rank} is not one of {dp_size} attention-DP ranks")
        tp = tensor_parallel or TensorParallel()
        if tp.size > 1 and attention_dp_rank is not None:
            raise ValueError("tensor_parallel and attention_dp_rank are exclusive (under attention DP the "
                             "tensor-parallel ranks are the attention-DP ranks: give attention_dp_size)")
        self.tensor_parallel = tp
        self.model_config = cfg
        self.model = model if model is not None else HarnessTransformer(cfg, tp=tp)
        if self.model.tp != tp:
            raise ValueError(f"the model is split for {self.model.tp}, the engine runs {tp}")
        self.max_num_tokens = max_num_tokens
        self.max_seq_len = max_seq_len or cfg.max_context
        self.trtllm_version = trtllm_version
        self.kv_cache_manager = self._build_kv_cache_manager(cfg, kvc, attention_dp_rank, event_shape)
        self.llm_args = HarnessLlmArgs(
            model=cfg.name, harness_model_config=cfg, kv_cache_config=kvc, max_seq_len=self.max_seq_len,
            max_num_tokens=max_num_tokens, enable_attention_dp=attention_dp_rank is not None,
            tensor_parallel_size=dp_size if attention_dp_rank is not None else tp.size,
            kv_connector_config=kv_connector if isinstance(kv_connector, KvCacheConnectorConfig) else None,
        )
        self._lock = threading.RLock()
        self._next_request_id = first_request_id
        self.connector = self._build_connector(kv_connector, attention_dp_rank)
        self._loop = ExecutorLoop(self.model, self.kv_cache_manager, self.connector, trtllm_version,
                                  max_num_tokens=max_num_tokens, max_batch_size=max_batch_size,
                                  connector_timeout_s=connector_timeout_s)

    # ================================================================ properties and observers
    @property
    def kv_cache(self) -> torch.Tensor:
        """The GPU pool ``[num_blocks, num_layers, 2, num_kv_heads * head_dim * tokens_per_block]``."""
        return self.kv_cache_manager.kv_cache

    @property
    def tokens_per_block(self) -> int:
        """KV block size (tokens)."""
        return self.model_config.tokens_per_block

    @property
    def stopped(self) -> ExecutorStopped | None:
        """The :class:`ExecutorStopped` that ended the executor loop (``__cause__`` is the hook's
        exception, ``.hook`` its name), or None while it runs."""
        return self._loop.stopped

    def add_forward_observer(self, observer: ForwardObserver) -> None:
        """Observe per-layer hook returns and attention reads (tests check the ordering)."""
        self._loop.forward_observers.append(observer)

    def add_lifecycle_observer(self, callback: LifecycleObserver) -> None:
        """``callback(point, request_ids)`` between the connector's hooks (tests inject faults).

        Points, in iteration order: ``after_get_num_new_matched_tokens`` (one id, after the
        runtime's checks, under the manager lock), ``after_update_state_after_alloc``,
        ``after_build_connector_meta``, ``after_start_load_kv``, ``after_forward``,
        ``after_request_finished`` (one id), ``after_get_finished``. An exception the callback
        raises propagates out of :meth:`step` unchanged (a test bug, not an engine event).
        """
        self._loop.lifecycle_observers.append(callback)

    def get_kv_cache_events(self, timeout: float | None = 2) -> list[dict[str, Any]]:
        """Drain KV-cache events, waiting up to ``timeout`` seconds for the first one."""
        return self.kv_cache_manager.events.get_events(timeout)

    def get_kv_cache_events_async(self, timeout: float | None = 2) -> KvEventIterator:
        """Async iterator of KV-cache events (ends after ``timeout`` seconds without one)."""
        return self.kv_cache_manager.events.aiter(timeout)

    # ================================================================ requests
    def submit(
        self,
        prompt_token_ids: list[int],
        max_new_tokens: int = 1,
        cache_salt: str | None = None,
        lora_task_id: int | None = None,
        kv_cache_retention_config: KvCacheRetentionConfig | None = None,
    ) -> int:
        """Queue one greedy request; returns its request id. Nothing runs until :meth:`step`.

        Raises:
            ValueError: empty prompt, token out of vocabulary, or too long for ``max_seq_len``.
            ExecutorStopped: the executor loop has ended.
        """
        prompt = [int(t) for t in prompt_token_ids]
        self._validate(prompt, max_new_tokens)
        with self._lock:
            self._raise_if_stopped()
            req = LlmRequest(self._next_request_id, prompt, max_new_tokens, lora_task_id, cache_salt,
                             kv_cache_retention_config)
            self._next_request_id += 1
            self._loop.enqueue(req)
            return req.request_id

    def generate(
        self,
        prompt_token_ids: list[int],
        max_new_tokens: int = 1,
        cache_salt: str | None = None,
        lora_task_id: int | None = None,
        kv_cache_retention_config: KvCacheRetentionConfig | None = None,
    ) -> GenerationResult:
        """:meth:`submit`, then run iterations until THAT request is done (others advance too).

        Raises:
            ValueError: see :meth:`submit`.
            KvCacheCapacityError: the pool can never hold the request.
            ConnectorWorkerError: a worker hook inside a forward raised (``.hook``, ``.layer_idx``).
            ConnectorContractError: an async load outlived ``connector_timeout_s``.
            ExecutorStopped: the executor loop ended (``__cause__``: the hook's exception).
            AttentionOrderError: harness self-check (a bug in the harness).
        """
        request_id = self.submit(prompt_token_ids, max_new_tokens, cache_salt, lora_task_id,
                                 kv_cache_retention_config)
        self._run_until_done(request_id)
        return self.result(request_id)

    def cancel(self, request_id: int) -> None:
        """Ask for ``request_id`` to be cancelled (``LLM``'s abort → ``cancel_request``).

        Applied by ``_handle_canceled_requests``, which runs only in an iteration that forwards: an
        active request finishes with reason ``"cancelled"`` after that forward and is freed (its
        blocks stored for reuse); a request still waiting just leaves. No-op for a finished or
        unknown request.
        """
        with self._lock:
            run = self._loop.runs.get(request_id)
            if run is not None and not run.done:
                self._loop.canceled_ids.add(request_id)

    def step(self) -> bool:
        """Run one executor iteration; False when the loop is blocked (nothing active or waiting).

        Raises:
            ExecutorStopped: this or an earlier iteration stopped the executor.
        """
        with self._lock:
            return self._loop.step()

    def run_until_idle(self, timeout_s: float = 60.0) -> None:
        """Run iterations until :meth:`step` returns False (every request done or failed).

        Raises:
            TimeoutError: requests still active after ``timeout_s`` seconds.
            ExecutorStopped: the executor loop ended.
        """
        deadline = time.monotonic() + timeout_s
        while self.step():
            if time.monotonic() > deadline:
                raise TimeoutError(f"requests {self.active_request_ids()} still active after {timeout_s} s")
            self._pause_if_idle_iteration()

    def result(self, request_id: int) -> GenerationResult:
        """The finished request's result.

        Raises:
            KeyError: unknown request id.
            RuntimeError: the request is not done yet.
            Exception: the error the request failed with (see :meth:`generate`).
        """
        run = self._loop.runs[request_id]
        if not run.done:
            raise RuntimeError(f"request {request_id} is not done")
        if run.error is not None:
            raise run.error
        return run.result

    def active_request_ids(self) -> list[int]:
        """Ids of the active requests (scheduled or parked), in activation order."""
        with self._lock:
            return [run.request_id for run in self._loop.active]

    # ================================================================ async saves, shutdown
    def pending_transfers(self) -> list[int]:
        """Ids of finished requests whose async save every worker has not reported yet."""
        with self._lock:
            return sorted(self._loop.pinned)

    def wait_for_pending_transfers(self, timeout_s: float = 10.0) -> None:
        """Run iterations while requests are active until no save is pending.

        Never runs an iteration on an idle engine: TensorRT-LLM's loop is blocked then and calls
        no connector hook, so a save that only a later ``get_finished`` would report stays pending.

        Raises:
            TimeoutError: saves pending on an idle (or stopped) engine — at once — or still
                pending after ``timeout_s`` seconds; the message names the request ids.
        """
        deadline = time.monotonic() + timeout_s
        while pending := self.pending_transfers():
            with self._lock:
                idle = self._loop.stopped is not None or not (self._loop.active or self._loop.waiting)
            if idle:
                raise TimeoutError(
                    f"async saves of requests {pending} are pending on an idle engine: TensorRT-LLM's "
                    "executor is blocked waiting for requests and calls no connector hook (get_finished "
                    "included) until one arrives; a connector must not rely on later iterations")
            if time.monotonic() > deadline:
                raise TimeoutError(f"async saves of requests {pending} still pending after {timeout_s} s")
            self.step()
            self._pause_if_idle_iteration()

    def shutdown(self) -> None:
        """Flush KV events. Drains nothing: TensorRT-LLM's shutdown neither waits for nor reports
        pending async saves."""
        self.kv_cache_manager.flush_iteration_events()

    # ================================================================ helpers
    def _run_until_done(self, request_id: int) -> None:
        run = self._loop.runs[request_id]
        while not run.done:
            try:
                self.step()
            except ExecutorStopped:
                if not run.done:
                    raise
            self._pause_if_idle_iteration()

    def _pause_if_idle_iteration(self) -> None:
        if not self._loop.forwarded:
            time.sleep(_SPIN_S)

    def _raise_if_stopped(self) -> None:
        stop = self._loop.stopped
        if stop is not None:
            raise ExecutorStopped(f"the executor loop has ended ({stop}); restart the engine",
                                  hook=stop.hook) from stop.__cause__

    def _validate(self, prompt: list[int], max_new_tokens: int) -> None:
        if not prompt:
            raise ValueError("prompt_token_ids must not be empty")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if len(prompt) + max_new_tokens > self.max_seq_len:
            raise ValueError(f"{len(prompt)} + {max_new_tokens} tokens exceed max_seq_len={self.max_seq_len}")
        if min(prompt) < 0 or max(prompt) >= self.model_config.vocab_size:
            raise ValueError("token id outside the vocabulary")

    def _build_kv_cache_manager(self, cfg: ModelConfig, kvc: KvCacheConfig, attention_dp_rank: int | None,
                                event_shape: EventShape) -> KVCacheManager:
        tpb = cfg.tokens_per_block
        return KVCacheManager(
            num_layers=cfg.num_layers, num_kv_heads=self.model.num_kv_heads, head_dim=cfg.head_dim,
            tokens_per_block=tpb, num_blocks=(kvc.max_tokens or max(4 * cfg.max_context, 1024)) // tpb,
            host_num_blocks=(kvc.host_cache_size or 0) * self.tensor_parallel.size // (cfg.kv_bytes_per_token * tpb),
            enable_block_reuse=kvc.enable_block_reuse, enable_partial_reuse=kvc.enable_partial_reuse,
            secondary_offload_min_priority=kvc.secondary_offload_min_priority
            if kvc.secondary_offload_min_priority is not None else 30,
            event_buffer_max_size=kvc.event_buffer_max_size, attention_dp_rank=attention_dp_rank,
            window_size=self.max_seq_len, event_shape=event_shape,
        )

    def _build_connector(self, spec: Any, attention_dp_rank: int | None) -> ConnectorDriver | None:
        if spec is None:
            return None
        if isinstance(spec, KvCacheConnectorConfig):
            module = importlib.import_module(spec.connector_module)
            spec = (getattr(module, spec.connector_scheduler_class),
                    getattr(module, spec.connector_worker_class))
        scheduler, worker_spec = spec
        if self.tensor_parallel.rank != 0:
            scheduler = None  # KvCacheConnectorManager: the scheduler exists on rank 0 only
        elif isinstance(scheduler, type):
            scheduler = scheduler(self.llm_args)
        workers = worker_spec if isinstance(worker_spec, list) else [worker_spec]
        workers = [w(self.llm_args) if isinstance(w, type) else w for w in workers]
        for worker in workers:
            worker.register_kv_caches(self.kv_cache_manager.kv_cache)
        if hasattr(scheduler, "wait_for_initialization"):
            scheduler.wait_for_initialization()
        return ConnectorDriver(scheduler, workers, self.kv_cache_manager, attention_dp_rank,
                               self.trtllm_version, tp=self.tensor_parallel)

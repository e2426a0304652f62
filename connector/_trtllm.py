"""Import shim for TensorRT-LLM's KV Cache Connector API.

Resolution order (first that imports wins; :data:`TRTLLM_CONNECTOR_MODULE` names it):

1. ``tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector`` (2026 main and newer);
2. ``tensorrt_llm._torch.pyexecutor.kv_cache_connector`` (TensorRT-LLM 1.0–1.2);
3. the local definitions below, with the same names, signatures and fields, so connector code and
   the reference engine harness (``connector.harness``) run where TensorRT-LLM is not installed.

:data:`TRTLLM_AVAILABLE` is True only for 1 or 2. Heavy imports (torch, TensorRT-LLM bindings) stay
under ``TYPE_CHECKING`` in the local fallback.

Sources (NVIDIA/TensorRT-LLM): ``tensorrt_llm/_torch/pyexecutor/connectors/kv_cache_connector.py``
(ABCs, ``RequestData``, ``SchedulerOutput``, ``KvCacheConnectorManager``), its 1.x predecessor
``tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py``, the caller
``cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp`` (``addSequence`` → ``getNumNewMatchedTokens``)
and ``tensorrt_llm/_torch/pyexecutor/py_executor.py`` (``_kv_connector_start_batch``,
``_forward_step`` → ``_kv_connector_wait_for_save``, ``_kv_connector_terminate_requests``).

The connector contract, in runtime call order (one executor iteration)
-------------------------------------------------------------------
Scheduler side (rank 0 only, its results broadcast to every worker; under attention DP one per
rank, called locally, its metadata going to that rank's worker only):

1. ``get_num_new_matched_tokens(request, num_computed_tokens)`` — once per request (its first
   context chunk), from C++ ``addSequence`` while the block manager HOLDS ITS LOCK, after device
   prefix matching. Returns ``(num_tokens, load_is_async)``.
2. ``update_state_after_alloc(request, block_ids)`` — right after, lock released.
3. ``build_connector_meta(scheduler_output)`` — every iteration that SCHEDULES a batch (never on an
   idle one); result is pickled and broadcast.
4. ``request_finished(request, cache_block_ids)`` — when generation ends, before the blocks are
   freed. The AsyncTransferManager-era executor calls it ONLY on normal completion; a cancelled
   request, or one failed by ``_handle_errors``, is freed without it (older executors call it from
   ``_do_terminate_request`` on every exit).

Worker side (every rank), each iteration:

5. ``bind_connector_meta(metadata)`` (provided) → ``start_load_kv(stream)``, only when a batch is
   scheduled;
6. for every decoder layer: ``wait_for_layer_load(layer_idx, stream)``, the layer,
   ``save_kv_layer(layer_idx, stream)``; then ``wait_for_save(stream)`` (only when a forward ran);
7. ``get_finished(finished_gen_req_ids, started_loading_req_ids)`` — every iteration that is not
   blocked idle (an executor with no active request waits for one and calls nothing).

Once at start-up: ``register_kv_caches(kv_cache_tensor)`` with the pool
``[num_blocks, num_layers, kv_factor, block_elems]``.

What an exception does there (``py_executor.py``): from any hook but the three forward hooks, it
leaves ``_executor_loop`` and the EXECUTOR STOPS; from ``wait_for_layer_load``, ``save_kv_layer`` or
``wait_for_save`` (inside ``_forward_step``'s try) every active request fails and their blocks are
released into the reuse tree (and under the overlap scheduler the loop then stops on
``assert sample_state is not None``). No version has ``cancel_load`` or ``request_reset``: nothing
recomputes a failed connector load. docs/tensorrt-llm.md has the per-version table.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # heavy imports for annotations only
    import torch

__all__ = [
    "TRTLLM_AVAILABLE",
    "TRTLLM_CONNECTOR_MODULE",
    "TRTLLM_IMPORT_ERROR",
    "KvCacheConnectorScheduler",
    "KvCacheConnectorWorker",
    "RequestData",
    "SchedulerOutput",
]

_CANDIDATE_MODULES = (
    "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector",
    "tensorrt_llm._torch.pyexecutor.kv_cache_connector",
)


def _import_trtllm() -> tuple[Any | None, str | None, str | None]:
    """Return ``(module, module_name, error)`` for the first importable connector module."""
    errors = []
    for name in _CANDIDATE_MODULES:
        try:
            return importlib.import_module(name), name, None
        except (ImportError, OSError) as exc:  # absent, or a broken CUDA/driver install
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
    return None, None, "; ".join(errors)


_module, TRTLLM_CONNECTOR_MODULE, TRTLLM_IMPORT_ERROR = _import_trtllm()
TRTLLM_AVAILABLE: bool = _module is not None


@dataclass
class _RequestData:
    """Data about one in-flight request, reported to ``build_connector_meta``.

    Fields up to ``num_scheduled_tokens`` exist in 1.0–1.2; the rest were added later and default
    to empty (the harness fills them all).
    """

    request_id: int
    """The request id (``LlmRequest.request_id``)."""
    new_tokens: list[int]
    """Tokens appended since the previous report; the first report carries the whole prompt."""
    new_block_ids: list[int]
    """Block ids allocated since the previous report; the first report carries all of them."""
    computed_position: int
    """Tokens with valid KV before this forward. For a NEW request it EXCLUDES the tokens the
    connector promised, so the connector's blocks are
    ``new_block_ids[computed_position // tokens_per_block : ...]``."""
    num_scheduled_tokens: int
    """Tokens the coming forward computes (a context chunk, or 1 in generation)."""
    block_hashes: list[int] = field(default_factory=list)
    """Cumulative chain of the hashes KV events report for each FULL block of beam 0 (may front-run
    the ``stored`` event); empty under KVCacheManagerV2. Newer only."""
    priorities: list[int] | None = None
    """Retention priority of each new block (same length as ``new_block_ids``) when the request has
    a ``KvCacheRetentionConfig``; None otherwise. Newer only."""
    cache_salt: str | None = None
    """The request's cache salt. Connectors that key content on tokens MUST mix it in. Newer only."""
    new_block_ids_by_layer_group: list[list[int]] = field(default_factory=list)
    """New page indices per layer group; empty when one flat block space describes the cache."""


@dataclass
class _SchedulerOutput:
    """Everything scheduled in one iteration, as passed to ``build_connector_meta``."""

    new_requests: list[_RequestData] = field(default_factory=list)
    """Requests reported for the first time (exactly once each)."""
    cached_requests: list[_RequestData] = field(default_factory=list)
    """Requests already reported in an earlier iteration."""
    attention_dp_rank: int | None = None
    """Owner rank of the block ids under attention DP; None without it. Newer only."""


class _KvCacheConnectorScheduler(ABC):
    """Scheduler half of a KV Cache Connector (rank 0, or every attention-DP rank).

    Constructed with ``llm_args`` (``TorchLlmArgs``; older releases passed an executor config)
    concurrently with the worker, in every MPI process that hosts a scheduler.
    """

    supports_attention_dp: bool = False
    """Opt in only when transfers and completion are owner-local under attention DP."""

    def __init__(self, llm_args: Any) -> None:
        self._llm_args = llm_args
        super().__init__()

    @abstractmethod
    def build_connector_meta(self, scheduler_output: _SchedulerOutput) -> object:
        """Build this iteration's metadata for the workers.

        Called: every iteration that schedules a batch (never on an idle one), after
        ``update_state_after_alloc`` of the iteration's new requests, on the scheduler rank; no lock
        held. An exception here stops the executor.
        Returns: any picklable object; it is broadcast and handed to every worker's
        ``bind_connector_meta`` before ``start_load_kv``.
        """

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """How many prompt tokens past ``num_computed_tokens`` the connector can load.

        Called: ONCE per request (per allocation), from C++ ``addSequence`` WHILE THE BLOCK MANAGER
        HOLDS ITS LOCK, after device reuse matched ``num_computed_tokens`` tokens. Must be
        synchronous, bounded and cheap; generation-only (disaggregated) requests raise in the
        runtime before reaching it.
        ``request.get_tokens(0)`` is the prompt; ``request.cache_salt_id``/``lora_task_id`` are set.
        Returns: ``(num_tokens, load_is_async)``. ``num_tokens > 0`` is a PROMISE that valid KV for
        prompt tokens ``[num_computed_tokens, num_computed_tokens + num_tokens)`` will be in the
        request's blocks before attention reads each layer. ``num_computed_tokens + num_tokens``
        must stay below the prompt length (at least one token is always computed).
        ``(0, True)`` is illegal: the runtime raises
        ``RuntimeError("load_kv_async must be False when num_tokens is 0!")``.
        With ``load_is_async`` the request is parked until every worker lists it in
        ``get_finished(...)[1]``.
        """

    @abstractmethod
    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        """Receive the request's block ids (all of its context blocks, in token order).

        Called: once per request right after ``get_num_new_matched_tokens``, lock released. The
        connector's target blocks are ``block_ids[num_computed_tokens // tokens_per_block :]``
        for the promised tokens.
        """

    @abstractmethod
    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        """The request finished generating (or failed); its blocks are about to be freed.

        Called: once per request, before the blocks are released; no lock held. Not called for
        every request: see the module docstring. An exception here stops the executor.
        Returns: True to keep the blocks allocated (an asynchronous save is running) until every
        worker lists the id in ``get_finished(...)[0]`` — the only way to pin blocks; False to let
        the runtime free them now.
        """

    def request_finished_by_layer_group(self, request: Any,
                                        cache_block_ids_by_layer_group: list[list[int]]) -> bool:
        """Per-layer-group form of ``request_finished`` (newer); one group folds to the flat form.

        Raises:
            NotImplementedError: more than one layer group and no override.
        """
        if len(cache_block_ids_by_layer_group) != 1:
            raise NotImplementedError(f"{type(self).__name__} implements only the flat form")
        return self.request_finished(request, cache_block_ids_by_layer_group[0])

    def update_state_after_alloc_by_layer_group(self, request: Any,
                                                block_ids_by_layer_group: list[list[int]]) -> None:
        """Per-layer-group form of ``update_state_after_alloc`` (newer); one group folds to flat.

        Raises:
            NotImplementedError: more than one layer group and no override.
        """
        if len(block_ids_by_layer_group) != 1:
            raise NotImplementedError(f"{type(self).__name__} implements only the flat form")
        self.update_state_after_alloc(request, block_ids_by_layer_group[0])

    def wait_for_initialization(self) -> None:
        """Block until the connector's resources are ready (newer; called once at start-up)."""
        return None


class _KvCacheConnectorWorker(ABC):
    """Worker half of a KV Cache Connector (one per rank); performs and tracks transfers."""

    supports_attention_dp: bool = False
    """Opt in only when transfers and completion are owner-local under attention DP."""

    def __init__(self, llm_args: Any) -> None:
        self._llm_args = llm_args
        self._metadata: object | None = None
        super().__init__()

    def bind_connector_meta(self, metadata: object) -> None:
        """Store this iteration's metadata (provided; called before ``start_load_kv``)."""
        self._metadata = metadata

    def get_connector_meta(self) -> object:
        """This iteration's metadata as bound by ``bind_connector_meta``."""
        return self._metadata

    def _clear_connector_meta(self) -> None:
        self._metadata = None

    def register_forward_pass_callable(self) -> Callable[..., Any] | None:
        """Optional callable run at the end of the forward pass on the forward stream."""
        return None

    @abstractmethod
    def register_kv_caches(self, kv_cache_tensor: "torch.Tensor") -> None:
        """Receive the KV pool once at start-up.

        Shape ``[num_blocks, num_layers, kv_factor, block_elems]`` with ``kv_factor`` 2 (K, V) or
        1 (K-only/MLA) and ``block_elems = num_kv_heads * head_dim * tokens_per_block`` for this
        rank; ``kv_cache_tensor[block_id]`` is one whole block across all layers.
        """

    @abstractmethod
    def start_load_kv(self, stream: Any) -> None:
        """Begin loading the blocks named in the bound metadata.

        Called: every iteration that schedules a batch, after ``bind_connector_meta``, before the
        forward (2026 main may then skip the forward, when every context request was parked for an
        async load). An exception here STOPS THE EXECUTOR (``_executor_loop`` calls it outside any
        try).
        """

    @abstractmethod
    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        """Block until layer ``layer_idx`` of every promised block is loaded.

        Called: immediately before the layer's work is enqueued, once per layer per forward.
        Attention reads the layer's KV only after this returns. An exception here fails every
        active request, whose blocks are then stored for reuse.
        """

    @abstractmethod
    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        """Begin saving layer ``layer_idx``; called immediately after the layer's work is enqueued."""

    @abstractmethod
    def wait_for_save(self, stream: Any) -> None:
        """Block until all synchronous saves are complete; called at the end of each forward."""

    @abstractmethod
    def get_finished(self, finished_gen_req_ids: list[int],
                     started_loading_req_ids: list[int]) -> tuple[list[int], list[int]]:
        """Report requests whose asynchronous saves / loads completed.

        Called: every iteration that is not blocked idle, including the one that called
        ``request_finished``. Each id is passed exactly once: in ``finished_gen_req_ids`` when
        ``request_finished`` returned True, in ``started_loading_req_ids`` when the load was
        async; the worker must remember pending ids. An exception here, or an id returned that was
        never passed in, stops the executor.
        Returns: ``(done_saving_ids, done_loading_ids)``; an id may only be returned after it was
        passed in, and the runtime acts on it only once ALL workers holding the request returned it.
        """


if _module is not None:
    KvCacheConnectorScheduler = _module.KvCacheConnectorScheduler
    KvCacheConnectorWorker = _module.KvCacheConnectorWorker
    SchedulerOutput = _module.SchedulerOutput
    RequestData = _module.RequestData
else:
    KvCacheConnectorScheduler = _KvCacheConnectorScheduler
    KvCacheConnectorWorker = _KvCacheConnectorWorker
    SchedulerOutput = _SchedulerOutput
    RequestData = _RequestData
    for _public, _local in (("KvCacheConnectorScheduler", _KvCacheConnectorScheduler),
                            ("KvCacheConnectorWorker", _KvCacheConnectorWorker),
                            ("SchedulerOutput", _SchedulerOutput), ("RequestData", _RequestData)):
        _local.__name__ = _local.__qualname__ = _public

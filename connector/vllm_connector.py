"""vLLM adapter of the semkv connector: the same scheduler/worker core, ledger and donor store as
the TensorRT-LLM connector, behind vLLM's ``KVConnectorBase_V1``.

Load it with::

    from vllm.config import KVTransferConfig
    KVTransferConfig(kv_connector="SemKvVllmConnector", kv_connector_module_path="connector.vllm_connector",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"semkv_config": "/etc/semkv/connector.toml"})

``semkv_config`` names the connector's TOML (the same file as ``TRTLLM_SEMKV_CONFIG``, which is
read when it is absent); ``semkv_settings`` (a table) overrides single settings. With
``metrics_port`` set, the scheduler (EngineCore process) serves ``/metrics`` on that port and the
worker process on ``metrics_port + 1 + rank`` (loads, saves, revalidation).

Only this module and :mod:`connector._vllm` know vLLM. They translate, and nothing else:

* ``vllm_config`` + ``kv_cache_config`` → the ``llm_args`` the core reads (:class:`VllmDeployment`):
  ``block_size`` is ``tokens_per_block``; the KV layout comes from the single full-attention KV
  cache group (``num_layers = len(layer_names)``, ``kv_factor = 2``,
  ``block_elems = block_size * num_kv_heads * head_size``). Hybrid models (several groups), sliding
  windows, MLA and padded pages are refused at start-up as unsupported namespace fields (rule 3:
  nothing is materialized, lookups count ``unsupported``).
* ``Request`` → the request the core reads (:class:`VllmRequest`): prompt, cache salt, LoRA id,
  multimodal identifiers, prompt embeddings (unsupported); the engine's block hashes for the
  ledger's ``engine`` freshness policy are vLLM's own (``request.block_hashes``), converted exactly
  as its KV events publish them (``vllm/v1/core/kv_cache_utils.py: maybe_convert_block_hash``: the
  low 64 bits, big-endian, unless ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``).
* ``SchedulerOutput.scheduled_new_reqs`` → the core's ``RequestData`` view; for a new request vLLM's
  ``num_computed_tokens`` INCLUDES the connector's tokens, so ``computed_position`` subtracts them.
* Per-layer KV tensors → block-major views ``[num_blocks, kv_factor, block_elems]`` for the core
  worker: CPU attention's ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` and the GPU
  backends' ``[2, num_blocks, block_size, num_kv_heads, head_size]`` are both handled; the bytes of a
  block are copied whole, so the donor's and the recipient's layout must be equal — which the
  namespace (``kv_layout``, ``attention_backend``) guarantees.
* A failed load never raises into vLLM: the plan's target blocks are reported by
  ``get_block_ids_with_load_errors``, and vLLM discards the step's output for that request and fails
  it (``kv_load_failure_policy="fail"``, vLLM's default) or recomputes the blocks (``"recompute"``);
  either way no token is ever computed on partially loaded KV (DESIGN §2 rule 8).

Loads are synchronous by default (``load_is_async`` False): vLLM then calls ``start_load_kv`` before the
forward, and each attention layer waits in ``wait_for_layer_load`` until its blocks are copied and
revalidated (the donor's block liveness included: ``per_layer_block_check``, on by default here).
With ``load_async`` a hit is answered ``(n, True)``: vLLM allocates the blocks and parks the request
in ``WAITING_FOR_REMOTE_KVS`` (``vllm/v1/core/sched/scheduler.py``, vLLM 0.32.0), so the request is
not among the step's scheduled requests: the adapter ships its plan itself in that step's
``build_connector_meta`` (marked :attr:`~connector.plan.LoadPlan.asynchronous`), the worker loads it
on a thread of its own (:meth:`~connector.worker.SemKvWorker.load_async`: the same ledger check
before each layer's copy and checksum before each layer's bytes) and names the request in
``get_finished``'s received ids once every layer is copied; vLLM schedules it only then. A failed
load is named in ``failed_recving`` as well (``get_transfer_results``), and vLLM recomputes the
request from token 0 (or fails it, ``kv_load_failure_policy="fail"``); the adapter answers that
request's next lookup ``(0, False)``, so it is not promised the same load again. vLLM keeps an
aborted request's blocks until its load is reported (``delay_free_blocks`` for
``WAITING_FOR_REMOTE_KVS``), so no block is freed under a copy.
Saves follow the TensorRT-LLM path: ``request_finished`` registers the donor and returns True (vLLM
keeps the blocks), the worker gathers the bytes after the next forward and reports the request in
``get_finished``, and vLLM frees the blocks.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import types
from collections.abc import Iterable
from typing import Any

from connector._vllm import (TRANSFER_RESULTS_AVAILABLE, VLLM_VERSION, KVConnectorBase_V1, KVConnectorMetadata,
                             KVConnectorRole, KVConnectorTransferResults)
from connector.block_keys import vllm_event_block_hashes
from connector.engine_contract import VLLM
from connector.metrics import serve_metrics
from connector.namespace import KvLayout, NamespaceUnknown
from connector.plan import ConnectorMetadata
from connector.settings import CONFIG_ENV, ConnectorSettings, load_connector_settings

__all__ = ["EXTRA_CONFIG_KEY", "EXTRA_SETTINGS_KEY", "SemKvVllmConnector", "SemKvVllmMetadata", "VllmDeployment", "VllmRequest",
           "layer_views"]

log = logging.getLogger(__name__)
EXTRA_CONFIG_KEY = "semkv_config"
"""``kv_connector_extra_config`` key naming the connector's TOML file."""
EXTRA_SETTINGS_KEY = "semkv_settings"
"""``kv_connector_extra_config`` key of a table of single settings (they win over the file)."""


class SemKvVllmMetadata(KVConnectorMetadata):
    """One step's :class:`~connector.plan.ConnectorMetadata` in vLLM's metadata type (picklable).
    ``unplanned``: requests answered ``(n, True)`` whose plan the core did not ship (none should
    be): the worker reports them as failed receives, or vLLM would wait for them forever."""

    def __init__(self, inner: ConnectorMetadata, unplanned: tuple[str, ...] = ()) -> None:
        self.inner = inner
        self.unplanned = unplanned


# ==================================================================================== translation
class VllmRequest:
    """A vLLM ``Request`` as the core reads a request (``request_id``, ``prompt_len``,
    ``get_tokens``, ``cache_salt``, ``lora_task_id``, ``multimodal_hashes``, p-tuning)."""

    __slots__ = ("_request",)

    def __init__(self, request: Any) -> None:
        self._request = request

    @property
    def request_id(self) -> str:
        return self._request.request_id

    @property
    def prompt_len(self) -> int:
        """Prompt length (tokens)."""
        return int(self._request.num_prompt_tokens)

    def get_tokens(self, beam: int = 0) -> list[int]:
        """Prompt and generated token ids so far (vLLM has one sequence per request)."""
        return list(self._request.all_token_ids)

    @property
    def cache_salt(self) -> str | None:
        return getattr(self._request, "cache_salt", None)

    @property
    def lora_task_id(self) -> int | None:
        lora = getattr(self._request, "lora_request", None)
        return None if lora is None else int(lora.lora_int_id)

    @property
    def lora_identity(self) -> str | None:
        """The adapter's name and path (vLLM ``LoRARequest.lora_name`` / ``lora_path``,
        vllm/lora/request.py): what the weights are, where ``lora_int_id`` is only a per-deployment
        number (vLLM: "must be globally unique ... not enforced")."""
        lora = getattr(self._request, "lora_request", None)
        name, path = getattr(lora, "lora_name", None) or "", getattr(lora, "lora_path", None) or ""
        return f"{name}\x00{path}" if name or path else None

    @property
    def multimodal_hashes(self) -> list[str] | None:
        features = getattr(self._request, "mm_features", None) or []
        return [str(getattr(f, "identifier", f)) for f in features] or None

    @property
    def prompt_embedding_table(self) -> Any:
        """Prompt embeddings have no token ids to key on: the core refuses them like p-tuning."""
        return getattr(self._request, "prompt_embeds", None)

    @property
    def block_hashes(self) -> list[int | bytes]:
        """The engine's hashes of the request's full blocks, as its KV events carry them."""
        return vllm_event_block_hashes(getattr(self._request, "block_hashes", ()))


class VllmDeployment:
    """``vllm_config`` + ``kv_cache_config`` as the ``llm_args`` the core reads (see the module docstring)."""

    backend = "vllm"
    enable_attention_dp = False
    semkv_window_size = 0
    """vLLM's KV events carry no attention window; the consumer records 0 (``consumer/wire.py``)."""
    semkv_tensor_parallel_refused = ("the vLLM adapter does not save or load per-rank shards: its workers' ranks "
                                     "and per-rank failed-load reports are not built (TensorRT-LLM's are)")
    """Tensor parallelism is served on TensorRT-LLM's connector API only (connector/layouts.py)."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any) -> None:
        model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
        self.model = str(model.model)
        self.tokenizer = str(getattr(model, "tokenizer", None) or model.model)
        self.dtype = str(model.dtype).removeprefix("torch.")
        self.max_seq_len = int(model.max_model_len)
        self.tensor_parallel_size = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
        self.pipeline_parallel_size = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
        self.context_parallel_size = max(int(getattr(parallel, "decode_context_parallel_size", 1) or 1),
                                         int(getattr(parallel, "prefill_context_parallel_size", 1) or 1))
        cache_dtype = str(getattr(cache, "cache_dtype", "auto") or "auto")
        self.kv_cache_config = types.SimpleNamespace(
            tokens_per_block=int(cache.block_size), dtype=None if cache_dtype == "auto" else cache_dtype,
            max_attention_window=getattr(model, "get_sliding_window", lambda: None)())
        self.quant_config = types.SimpleNamespace(quant_algo=getattr(model, "quantization", None),
                                                  kv_cache_quant_algo=cache_dtype)
        self.speculative_config = getattr(vllm_config, "speculative_config", None)
        self.lora_config = getattr(vllm_config, "lora_config", None)
        self.attn_backend = _attention_backend(vllm_config)
        self.semkv_engine_version = f"vllm/{VLLM_VERSION}" if VLLM_VERSION else None
        self.semkv_kv_layout = kv_layout(kv_cache_config)
        self.layer_names = _layer_names(kv_cache_config)


def _attention_backend(vllm_config: Any) -> str:
    """The attention backend that lays out tokens inside a block, e.g. ``cpu:auto``."""
    device = str(getattr(getattr(vllm_config, "device_config", None), "device_type", "") or "")
    if not device:
        try:
            from vllm.platforms import current_platform

            device = str(current_platform.device_type)
        except ImportError:
            device = "unknown"
    attention = getattr(vllm_config, "attention_config", None)
    return f"{device}:{getattr(attention, 'backend', None) or 'auto'}"


def _layer_names(kv_cache_config: Any) -> list[str]:
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    return list(groups[0].layer_names) if len(groups) == 1 else []


def kv_layout(kv_cache_config: Any) -> KvLayout | NamespaceUnknown:
    """The per-layer block layout of a vLLM KV cache config, or why it is unsupported."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) != 1:
        return NamespaceUnknown("kv_layout", f"{len(groups)} KV cache groups (hybrid model)", "unsupported")
    spec = groups[0].kv_cache_spec
    if type(spec).__name__ != "FullAttentionSpec" or getattr(spec, "sliding_window", None):
        return NamespaceUnknown("kv_layout", f"{type(spec).__name__} is not plain full attention", "unsupported")
    head_v = getattr(spec, "head_size_v", None) or spec.head_size
    if head_v != spec.head_size or getattr(spec, "page_size_padded", None):
        return NamespaceUnknown("kv_layout", "K and V of different sizes or padded pages", "unsupported")
    return KvLayout(len(groups[0].layer_names), 2, int(spec.block_size) * int(spec.num_kv_heads) * int(spec.head_size),
                    str(spec.dtype).removeprefix("torch."))


def layer_views(kv_caches: dict[str, Any], layer_names: list[str], num_blocks: int, layout: KvLayout) -> list[Any]:
    """Block-major views ``[num_blocks, kv_factor, block_elems]`` of vLLM's per-layer KV tensors.

    Handles the block dimension first (CPU attention: ``[num_blocks, num_kv_heads, block_size,
    2 * head_size]``) or second after K/V (``[2, num_blocks, ...]``, the GPU backends).

    Raises:
        ValueError: a layer is missing, or its tensor has neither shape (its blocks are not
            contiguous byte ranges we can copy whole).
    """
    views = []
    for name in layer_names:
        if name not in kv_caches:
            raise ValueError(f"semkv: vLLM registered no KV cache for layer {name}")
        kv = kv_caches[name]
        if kv.shape[0] == num_blocks:
            views.append(kv.view(num_blocks, layout.kv_factor, layout.block_elems))
        elif kv.dim() >= 2 and kv.shape[0] == layout.kv_factor and kv.shape[1] == num_blocks:
            views.append(kv.view(layout.kv_factor, num_blocks, layout.block_elems).permute(1, 0, 2))
        else:
            raise ValueError(f"semkv: cannot find the block dimension of {name} {tuple(kv.shape)} "
                             f"({num_blocks} blocks)")
    return views


def _settings(vllm_config: Any) -> ConnectorSettings:
    """The connector settings of a vLLM engine (vLLM recomputes blocks whose load failed, so the
    worker loads layer by layer during the forward unless ``load_before_forward`` says otherwise)."""
    extra = dict(getattr(getattr(vllm_config, "kv_transfer_config", None), "kv_connector_extra_config", None) or {})
    environ = dict(os.environ)
    if extra.get(EXTRA_CONFIG_KEY):
        environ[CONFIG_ENV] = str(extra[EXTRA_CONFIG_KEY])
    return load_connector_settings(dict(extra.get(EXTRA_SETTINGS_KEY) or {}), environ=environ)


def _resumed(cached: Any) -> list[tuple[str, Any, int]]:
    """``(req_id, block_ids per group, num_computed_tokens)`` of the cached requests resumed from
    preemption (vLLM 0.32 ``CachedRequestData.resumed_req_ids``; older releases had a
    ``resumed_from_preemption`` list)."""
    resumed = getattr(cached, "resumed_req_ids", None)
    if resumed is None:
        flags = getattr(cached, "resumed_from_preemption", None) or []
        resumed = {rid for rid, flag in zip(cached.req_ids, flags, strict=False) if flag}
    return [(rid, cached.new_block_ids[i] or (), cached.num_computed_tokens[i])
            for i, rid in enumerate(cached.req_ids) if rid in resumed]


class _HostStream:
    """The ``stream`` argument of the core's worker hooks where no device stream exists (CPU)."""

    def synchronize(self) -> None:
        return None


def _current_stream() -> Any:
    import torch

    return torch.cuda.current_stream() if torch.cuda.is_available() else _HostStream()


# ==================================================================================== connector
class SemKvVllmConnector(KVConnectorBase_V1):
    """vLLM's connector class: a scheduler core in the scheduler process, a worker core per worker.

    Raises (at construction, so vLLM fails to start with a message naming the setting):
        ConnectorConfigError: invalid settings (including ``mode = "experimental"``).
        SchemaOutOfDate, PersistenceError: the ledger is not migrated or not reachable.
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        settings = _settings(vllm_config)
        self.deployment = VllmDeployment(vllm_config, kv_cache_config)
        self.num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
        self.scheduler: Any = None
        self.worker: Any = None
        if role == KVConnectorRole.SCHEDULER:
            from connector.scheduler import SemKvScheduler  # imports torch-free code only

            self.scheduler = SemKvScheduler(self.deployment, settings=settings, engine=VLLM)
            self._requests: dict[str, Any] = {}
            self._promised: dict[str, int] = {}
            self._load_async = bool(settings.load_async) and TRANSFER_RESULTS_AVAILABLE
            if settings.load_async and not TRANSFER_RESULTS_AVAILABLE:
                log.warning("semkv: load_async needs vLLM's get_transfer_results (failed_recving, vLLM 0.32); "
                            "loads stay synchronous on vLLM %s", VLLM_VERSION)
            self._async_lookups: dict[str, int] = {}
            """Requests answered ``(n, True)`` -> the ``num_computed_tokens`` their lookup started at."""
            self._async_allocated: dict[str, tuple[list[int], int]] = {}
            """Asynchronous promises allocated in this step: (block ids, computed position), shipped by
            the step's ``build_connector_meta`` (vLLM does not schedule the request in that step)."""
            self._async_failed: set[str] = set()
            """Requests whose asynchronous load failed: vLLM recomputes them; promised nothing again."""
        else:
            from connector.scheduler import process_rank
            from connector.worker import SemKvWorker

            self.worker = SemKvWorker(self.deployment, settings=settings, engine=VLLM)
            if settings.metrics_port is not None:  # the scheduler serves metrics_port in its own process
                serve_metrics(self.worker.metrics, settings.metrics_port + 1 + process_rank())
            self._layer_index: dict[str, int] = {}
            self._errored_blocks: set[int] = set()
            self._failed_recving: set[str] = set()
            """Asynchronous loads that failed, for the next ``get_transfer_results``."""
            self._saves_shipped: set[str] = set()
            """Requests whose save instruction reached this worker: the only ids ``get_finished`` may
            name as sent (see there)."""
            self._unplanned: set[str] = set()
            """Requests waiting for an asynchronous load that has no plan (:class:`SemKvVllmMetadata`)."""

    # ------------------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens past ``num_computed_tokens`` (vLLM's local prefix hit) loaded from a donor, and
        whether they load asynchronously (``load_async``); never raises. A request whose
        asynchronous load failed gets ``(0, False)`` (vLLM recomputes it)."""
        rid = request.request_id
        self._requests[rid] = request
        if rid in self._async_failed:
            self._promised[rid] = 0
            return 0, False
        tokens, load_async = self.scheduler.get_num_new_matched_tokens(VllmRequest(request), num_computed_tokens)
        self._promised[rid] = tokens
        if tokens and self._load_async:
            self._async_lookups[rid] = int(num_computed_tokens)
            return tokens, True
        self._async_lookups.pop(rid, None)
        return tokens, load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Bind the allocated blocks to the promise; a promise vLLM did not take is released."""
        view = VllmRequest(request)
        if num_external_tokens == 0:  # also an asynchronous load's second call, after it was loaded
            self._async_lookups.pop(request.request_id, None)
            if self._promised.pop(request.request_id, 0):
                self.scheduler.release(view, "not_allocated")
            return
        block_ids = blocks.get_block_ids()
        ids = list(block_ids[0]) if len(block_ids) == 1 else []
        self.scheduler.update_state_after_alloc(view, ids)
        computed = self._async_lookups.pop(request.request_id, None)
        if computed is not None:
            self._async_allocated[request.request_id] = (ids, computed)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """This step's load plans and save instructions.

        A request resumed after preemption was looked up again and may hold a new promise: vLLM
        lists it among the cached requests with its whole block list, so it is reported to the
        core as a new request too — otherwise its plan would never ship and vLLM would compute on
        blocks nobody loaded.
        """
        first_reports = [(d.req_id, d.block_ids, d.num_computed_tokens) for d in scheduler_output.scheduled_new_reqs]
        first_reports += _resumed(scheduler_output.scheduled_cached_reqs)
        new = []
        for req_id, block_ids, num_computed in first_reports:
            request = self._requests.get(req_id)
            external = self._promised.pop(req_id, 0)
            new.append(types.SimpleNamespace(
                request_id=req_id, new_block_ids=list(block_ids[0]) if len(block_ids) == 1 else [],
                computed_position=int(num_computed) - external,
                block_hashes=VllmRequest(request).block_hashes if request is not None else []))
        # asynchronous promises allocated in this step: their first (and only) report to the core;
        # when vLLM schedules them later, their plan has shipped and is not shipped again
        waiting, self._async_allocated = self._async_allocated, {}
        for req_id, (block_ids, computed) in waiting.items():
            request = self._requests.get(req_id)
            self._promised.pop(req_id, None)
            new.append(types.SimpleNamespace(
                request_id=req_id, new_block_ids=block_ids, computed_position=computed,
                block_hashes=VllmRequest(request).block_hashes if request is not None else []))
        meta = self.scheduler.build_connector_meta(types.SimpleNamespace(
            new_requests=new, cached_requests=[], semkv_work=self._work(scheduler_output)))
        unplanned: tuple[str, ...] = ()
        if waiting:
            meta = dataclasses.replace(meta, loads=tuple(
                dataclasses.replace(plan, asynchronous=True) if plan.request_id in waiting else plan
                for plan in meta.loads))
            planned = {plan.request_id for plan in meta.loads}
            unplanned = tuple(rid for rid in waiting if rid not in planned)
            for rid in unplanned:
                log.error("semkv: request %s waits for an asynchronous load that has no plan; reported failed", rid)
        return SemKvVllmMetadata(meta, unplanned)

    def update_connector_output(self, connector_output: Any) -> None:
        """Note the requests whose asynchronous load failed (vLLM recomputes them): their next
        lookup is answered ``(0, False)``."""
        self._async_failed.update(getattr(connector_output, "failed_recving", None) or ())

    def _work(self, scheduler_output: Any) -> tuple[int, int]:
        """The step's ``(tokens scheduled, longest prompt still in prefill)`` for the profitability
        gate: vLLM calls ``build_connector_meta`` before it advances ``num_computed_tokens``
        (``vllm/v1/core/sched/scheduler.py``, ``schedule``), so a request still short of its prompt
        computes prompt tokens in this step."""
        context = 0
        for req_id in getattr(scheduler_output, "num_scheduled_tokens", None) or {}:
            request = self._requests.get(req_id)
            if request is not None and int(request.num_computed_tokens) < VllmRequest(request).prompt_len:
                context = max(context, VllmRequest(request).prompt_len)
        return int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0), context

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Release the lease; register a finished request as a donor (True: keep blocks until saved)."""
        for book in (self._requests, self._promised, self._async_lookups, self._async_allocated):
            book.pop(request.request_id, None)
        self._async_failed.discard(request.request_id)
        return self.scheduler.request_finished(VllmRequest(request), list(block_ids)), None

    # ------------------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Learn the per-layer KV tensors. An unusable layout leaves the worker without a pool, so
        every plan fails closed (reported as load errors) instead of vLLM failing to start."""
        layout, names = self.deployment.semkv_kv_layout, self.deployment.layer_names
        if not isinstance(layout, KvLayout):
            log.warning("semkv: KV layout unsupported (%s); nothing will be loaded", layout.detail)
            return
        try:
            self.worker.register_layer_views(layer_views(kv_caches, names, self.num_blocks, layout), layout)
        except ValueError as exc:
            log.error("%s; nothing will be loaded", exc)
            return
        self._layer_index = {name: idx for idx, name in enumerate(names)}

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Validate this step's plans (ledger, store header); collect save instructions."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, SemKvVllmMetadata):
            return
        inner = meta.inner
        self._saves_shipped.update(str(save.request_id) for save in inner.saves)
        self._unplanned.update(getattr(meta, "unplanned", ()))
        background = tuple(plan for plan in inner.loads if plan.asynchronous)
        if background:  # loaded on the worker's loader thread, reported by get_finished
            inner = dataclasses.replace(inner, loads=tuple(plan for plan in inner.loads if not plan.asynchronous))
        self.worker.bind_connector_meta(inner)
        if not self._guarded(lambda: self.worker.start_load_kv(_current_stream())):
            # the core stops at the first failed plan and fails the step's others unstarted
            self._errored_blocks.update(b for plan in inner.loads for b in plan.target_block_ids)
        self.worker.load_async(background)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Revalidate and copy this layer's blocks of every active plan before attention reads them."""
        idx = self._layer_index.get(layer_name)
        if idx is not None:
            self._guarded(lambda: self.worker.wait_for_layer_load(idx, _current_stream()))

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """No-op: donors are saved whole after their request finished (see ``wait_for_save``)."""

    def wait_for_save(self) -> None:
        """Gather the bytes of donors to save (a host copy) once the step's forward is done."""
        self.worker.wait_for_save(_current_stream())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(requests whose donor bytes are gathered, requests whose asynchronous load ended)``:
        vLLM may free the first ones' blocks now, and schedule (or, failed, recompute) the others.
        The failed loads go to the next :meth:`get_transfer_results`' ``failed_recving``."""
        done, _ = self.worker.get_finished(sorted(finished_req_ids), [])
        # vLLM passes EVERY finished request, donors or not, and frees a non-donor's blocks at once
        # (request_finished answered False); the core gives up waiting for a save instruction after
        # _SAVE_REPORT_TIMEOUT_S and reports the id, and vLLM asserts that an id named as sent is
        # still one of its requests (Scheduler._update_from_kv_xfer_finished, vLLM 0.32.0): its
        # engine core died on it. Only ids whose save instruction came are named, each once.
        sent = {rid for rid in done if rid in self._saves_shipped}
        self._saves_shipped.difference_update(sent)
        ended, failed = self.worker.finished_async_loads()
        unplanned, self._unplanned = self._unplanned, set()
        self._failed_recving.update(plan.request_id for plan in failed)
        self._failed_recving.update(unplanned)
        return (sent or None), (set(ended) | unplanned or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM 0.32's per-step report: :meth:`get_finished` and the asynchronous loads that failed
        (``failed_recving``: vLLM recomputes those requests, or fails them)."""
        sending, recving = self.get_finished(finished_req_ids)
        failed, self._failed_recving = self._failed_recving, set()
        return KVConnectorTransferResults(finished_sending=set(sending or ()), finished_recving=set(recving or ()),
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Target blocks of plans that failed this step: vLLM fails or recomputes their requests."""
        errored, self._errored_blocks = self._errored_blocks, set()
        return errored

    def _guarded(self, hook: Any) -> bool:
        """Run a core worker hook; False when a load failed (counted and logged by the core)."""
        from connector.worker import SemKvLoadError

        try:
            hook()
            return True
        except SemKvLoadError:
            return False
        finally:
            self._drain_failed(self.worker.failed_plans)

    def _drain_failed(self, failed: Any) -> None:
        while failed:
            self._errored_blocks.update(failed.popleft().target_block_ids)

    def shutdown(self) -> None:
        """Release leases and stop the core's threads."""
        for core in (self.scheduler, self.worker):
            if core is not None:
                core.close()

    def take_events(self) -> Iterable[Any]:
        return ()

"""REFERENCE ENGINE HARNESS — the runtime side of the KV Cache Connector API (TensorRT-LLM's manager).

Test and demo infrastructure only; never an engine for serving. :class:`ConnectorDriver` plays
``KvCacheConnectorManager`` and ``KvCacheConnectorSchedulerOutputManager`` of the modelled
:class:`~.trtllm_versions.TrtllmVersion` (NVIDIA/TensorRT-LLM
``tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py`` @ 00fdcbff5ad82a6438b3e0c9dbc5480b6ee52bdc,
read_file id 19460767766; ``tensorrt_llm/_torch/pyexecutor/connectors/kv_cache_connector.py`` @
035ab91cad04b7b77a479a9526edecfbc742c661, read_file id 68382362537) for one scheduler and one worker
per simulated rank:

- ``get_num_new_matched_tokens``: rejects generation-only requests, ``(0, True)`` (same message),
  negative counts, a promise reaching the last prompt token (C++ ``setPrepopulatedPromptLen``:
  prepopulated < prompt length) and — stricter than TensorRT-LLM, which does not check it — a count
  that is not a whole number of blocks. Records the async load and the connector's tokens.
- ``build_scheduler_output``: new vs cached requests, cumulative deltas of tokens and block ids,
  ``computed_position`` minus the connector's tokens on the first report only (the record is
  cleared by every build), requests whose load just went async left out; only the ``RequestData``
  / ``SchedulerOutput`` fields the modelled version defines.
- ``handle_metadata``: ``build_connector_meta`` on the scheduler, ``bind_connector_meta`` on every
  worker.
- ``get_finished``: each id is passed to each worker exactly once; per-rank pending sets; an id a
  worker returns that is not pending on that rank (never passed in, or already returned) raises
  ``KeyError`` (``AsyncRequests.extract_by_id``); the runtime acts on an id only when EVERY worker
  has returned it (the ``mpi_allgather`` intersection).
- tensor parallelism (a driver with a :class:`~.model.TensorParallel` of size > 1): the driver is
  ONE rank (one process) of the engine with its one worker; the scheduler exists on rank 0 only
  and every scheduler call runs there and is broadcast to the other ranks
  (``KvCacheConnectorManager._run_on_leader`` → ``mpi_broadcast``; here
  ``torch.distributed.broadcast_object_list``), so every rank's worker binds the same metadata;
  ``get_finished`` gathers every rank's locally finished ids (``mpi_allgather``; here
  ``all_gather_object``) and acts on an id only when every rank returned it. An exception of the
  leader's scheduler is broadcast too, so every rank stops its executor together.
- attention DP (a driver with an ``attention_dp_rank``): the driver is ONE rank of the engine, with
  its own scheduler (the 2026 manager builds one on every attention-DP owner and calls it without
  broadcasting) and its own workers, whose ``get_finished`` completes that rank's requests alone (no
  allgather across owners). Under a version whose ``SchedulerOutput`` has ``attention_dp_rank``
  (2026 main) the driver refuses, as ``KvCacheConnectorManager.validate_attention_dp`` does at
  executor bring-up, a scheduler or worker class that does not declare
  ``supports_attention_dp = True`` (``NotImplementedError``). TensorRT-LLM's ``is_dummy_request``
  padding requests, which the manager never shows the connector, are not modelled.

Where the source lets an exception escape the executor loop (every call outside ``_forward_step``'s
``try``: the scheduler hooks, ``bind_connector_meta``, ``start_load_kv``, ``get_finished``, the
manager's own checks) the driver raises :class:`ExecutorStopped` from the original exception. The
forward's worker hooks (``wait_for_layer_load``, ``save_kv_layer``, ``wait_for_save``) raise
:class:`ConnectorWorkerError`, which the engine hands to ``_handle_errors``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, TypeVar

import torch
import torch.distributed

from .._trtllm import RequestData, SchedulerOutput
from .kv_cache_manager import KVCacheManager, KVSequence
from .model import TensorParallel
from .request import LlmRequest, LlmRequestState
from .trtllm_versions import TRTLLM_MAIN_2026, TrtllmVersion

__all__ = [
    "AttentionOrderError",
    "ConnectorContractError",
    "ConnectorDriver",
    "ConnectorWorkerError",
    "ExecutorStopped",
    "HarnessStream",
]

T = TypeVar("T")


class ConnectorContractError(RuntimeError):
    """The connector broke a rule of the runtime (raised by the manager's checks)."""


class ConnectorWorkerError(RuntimeError):
    """A worker hook inside the forward raised; ``_handle_errors`` fails every active request with it.

    Attributes:
        hook: the worker method that raised (``wait_for_layer_load``, ``save_kv_layer``,
            ``wait_for_save``).
        layer_idx: the layer, for per-layer hooks.
    """

    def __init__(self, message: str, *, hook: str, layer_idx: int | None = None) -> None:
        super().__init__(message)
        self.hook = hook
        self.layer_idx = layer_idx


class ExecutorStopped(RuntimeError):
    """The executor loop ended: a connector call outside the forward's error handling raised.

    TensorRT-LLM's ``_event_loop_wrapper`` logs and re-raises, ``_executor_loop_cleanup`` marks
    the executor shut down, and no request is served any more; an operator restarts the engine
    (its cache starts empty). ``__cause__`` is the exception the hook (or the manager's check)
    raised.

    Attributes:
        hook: the connector method during which the loop ended (``get_num_new_matched_tokens``,
            ``update_state_after_alloc``, ``build_connector_meta``, ``bind_connector_meta``,
            ``start_load_kv``, ``request_finished``, ``get_finished``).
    """

    def __init__(self, message: str, *, hook: str) -> None:
        super().__init__(message)
        self.hook = hook


class LeaderError(RuntimeError):
    """The tensor-parallel leader's scheduler raised (received by the other ranks)."""


class AttentionOrderError(AssertionError):
    """Attention read a layer's KV before ``wait_for_layer_load`` returned for it (harness bug)."""


class HarnessStream:
    """Stand-in for ``torch.cuda.Stream`` on the CPU: every operation completes immediately."""

    def synchronize(self) -> None:
        """No-op: CPU work is synchronous."""

    def wait_stream(self, other: Any) -> None:
        """No-op."""

    def record_event(self, event: Any = None) -> Any:
        """No-op; returns ``event``."""
        return event


@dataclass
class _Reported:
    num_tokens: int = 0
    num_block_ids: int = 0


@dataclass
class _RankState:
    """One rank's ``pending_async_requests`` and ``local_finished_async_requests`` ids."""

    pending: dict[str, set[int]] = field(default_factory=lambda: {"saving": set(), "loading": set()})
    done: dict[str, set[int]] = field(default_factory=lambda: {"saving": set(), "loading": set()})


def _narrowed(cls: type, names: tuple[str, ...]) -> type:
    """``cls`` itself when it has exactly ``names``; else a dataclass of the same name with only
    those of ``names`` that ``cls`` has, so the modelled version's missing attributes are missing."""
    have = {f.name: f for f in fields(cls)}
    keep = [n for n in names if n in have]
    if keep == list(have):
        return cls
    spec = [(n, have[n].type, field(default=have[n].default, default_factory=have[n].default_factory))
            for n in keep]
    return make_dataclass(cls.__name__, spec, namespace={"__doc__": cls.__doc__})


class ConnectorDriver:
    """Runtime side of the connector API for one harness engine.

    Args:
        scheduler: the connector's scheduler object (None on a tensor-parallel rank other than 0).
        workers: one worker per simulated rank (all see the same KV pool); under tensor parallelism
            this process's rank's worker.
        manager: the engine's KV cache manager.
        attention_dp_rank: this driver is that attention-DP rank: set on every ``SchedulerOutput``
            (when the version has the field), and the connector classes must opt in (see above).
        version: the modelled TensorRT-LLM version.
        tp: this process's tensor-parallel rank (``torch.distributed`` initialized when its size > 1).
    """

    def __init__(self, scheduler: Any, workers: list[Any], manager: KVCacheManager,
                 attention_dp_rank: int | None = None, version: TrtllmVersion = TRTLLM_MAIN_2026,
                 tp: TensorParallel | None = None) -> None:
        if not workers:
            raise ValueError("at least one connector worker is required")
        self.tp = tp if tp is not None and tp.size > 1 else None
        if (scheduler is None) != (self.tp is not None and self.tp.rank != 0):
            raise ValueError("a scheduler is required on tensor-parallel rank 0 (or without tensor parallelism) "
                             "and only there (KvCacheConnectorManager)")
        if attention_dp_rank is not None and version.scheduler_output_has_attention_dp_rank:
            for cls in (type(scheduler), *(type(w) for w in workers)):
                if getattr(cls, "supports_attention_dp", False) is not True:
                    raise NotImplementedError(
                        f"{cls.__name__}: the connector must declare supports_attention_dp=True and implement "
                        "owner-local scheduling/transfers against a shared pool (TensorRT-LLM's "
                        "KvCacheConnectorManager.validate_attention_dp)")
        self.scheduler = scheduler
        self.workers = workers
        self.manager = manager
        self.attention_dp_rank = attention_dp_rank
        self.version = version
        self.stream = HarnessStream()
        self.request_data_class = _narrowed(RequestData, version.request_data_fields)
        output_fields = ("new_requests", "cached_requests") + (
            ("attention_dp_rank",) if version.scheduler_output_has_attention_dp_rank else ())
        self.scheduler_output_class = _narrowed(SchedulerOutput, output_fields)
        self._reported: dict[int, _Reported] = {}
        self._external_loads: dict[int, int] = {}
        self.new_loading: dict[int, LlmRequest] = {}
        """Async loads recorded since the last ``get_finished`` (``new_async_requests.loading``)."""
        self.new_saving: dict[int, LlmRequest] = {}
        """Async saves recorded since the last ``get_finished`` (``new_async_requests.saving``)."""
        self._ranks = [_RankState() for _ in workers]

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: LlmRequest, num_computed_tokens: int) -> int:
        """The connector's count plus the runtime's checks; call under the manager lock.

        Raises:
            ExecutorStopped: the hook raised, or a check failed (``__cause__``: RuntimeError for a
                generation-only request, ConnectorContractError for ``(0, True)``, negative, not
                whole blocks, or no prompt token left to compute).
        """
        return self._stopping("get_num_new_matched_tokens",
                              lambda: self._checked_match(request, num_computed_tokens))

    def _checked_match(self, request: LlmRequest, num_computed_tokens: int) -> int:
        if request.is_generation_only_request:
            raise RuntimeError("Connector API is not supported for generation-only requests!")
        num_tokens, load_async = self._on_leader(
            lambda: self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens))
        num_tokens, tpb = int(num_tokens), self.manager.tokens_per_block
        if num_tokens == 0 and load_async:
            raise ConnectorContractError("load_kv_async must be False when num_tokens is 0!")
        if num_tokens < 0:
            raise ConnectorContractError(f"get_num_new_matched_tokens returned {num_tokens} < 0")
        if num_computed_tokens + num_tokens >= request.prompt_len:
            raise ConnectorContractError(
                f"There must be at least one uncomputed token in the prompt! request "
                f"{request.request_id}: {num_computed_tokens} + {num_tokens} >= {request.prompt_len}")
        if num_tokens % tpb:
            raise ConnectorContractError(
                f"request {request.request_id}: connector promised {num_tokens} tokens after "
                f"num_computed_tokens={num_computed_tokens}; promises must be whole blocks of "
                f"{tpb} tokens (TensorRT-LLM would leave a partly filled block)")
        if load_async:
            self.new_loading[request.request_id] = request
        self._external_loads[request.request_id] = num_tokens
        if self.version.sets_py_num_connector_matched_tokens:
            request.py_num_connector_matched_tokens = num_tokens
        return num_tokens

    def update_state_after_alloc(self, request: LlmRequest, block_ids: list[int]) -> None:
        """Hand the request's block ids to the scheduler (lock released).

        Raises:
            ExecutorStopped: the hook raised.
        """
        self._stopping("update_state_after_alloc", lambda: self._on_leader(
            lambda: self.scheduler.update_state_after_alloc(request, list(block_ids))))

    def is_loading_async(self, request_id: int) -> bool:
        """Whether the request's lookup this iteration answered an async load (to be parked)."""
        return request_id in self.new_loading

    def build_scheduler_output(self, context: list[tuple[LlmRequest, KVSequence]],
                               generation: list[tuple[LlmRequest, KVSequence]]) -> Any:
        """This iteration's ``SchedulerOutput`` (clears the recorded connector loads)."""
        output = self.scheduler_output_class()
        for request, seq in context:
            if request.request_id in self.new_loading:
                continue
            is_new = request.request_id not in self._reported
            data = self._request_data(request, seq)
            if request.request_id in self._external_loads:
                data.computed_position -= self._external_loads[request.request_id]
            (output.new_requests if is_new else output.cached_requests).append(data)
        for request, seq in generation:
            output.cached_requests.append(self._request_data(request, seq))
        if self.attention_dp_rank is not None and hasattr(output, "attention_dp_rank"):
            output.attention_dp_rank = self.attention_dp_rank
        self._external_loads = {}
        return output

    def _request_data(self, request: LlmRequest, seq: KVSequence) -> Any:
        seen = self._reported.setdefault(request.request_id, _Reported())
        tokens, block_ids = request.get_tokens(0), seq.block_ids
        new_tokens, new_block_ids = tokens[seen.num_tokens:], block_ids[seen.num_block_ids:]
        seen.num_tokens, seen.num_block_ids = len(tokens), len(block_ids)
        if request.state is LlmRequestState.CONTEXT_INIT:
            computed = request.context_current_position
            scheduled = min(request.context_remaining_length, request.context_chunk_size)
        else:
            computed, scheduled = len(tokens) - 1, 1
        values: dict[str, Any] = {
            "request_id": request.request_id, "new_tokens": new_tokens, "new_block_ids": new_block_ids,
            "computed_position": computed, "num_scheduled_tokens": scheduled,
            "cache_salt": request.cache_salt, "new_block_ids_by_layer_group": []}
        names = {f.name for f in fields(self.request_data_class)}
        if "block_hashes" in names:
            values["block_hashes"] = self.manager.block_hashes(seq)
        if "priorities" in names and request.kv_cache_retention_config is not None:
            values["priorities"] = [self.manager.get_priority_by_block_id(b) for b in new_block_ids]
        return self.request_data_class(**{k: v for k, v in values.items() if k in names})

    def handle_metadata(self, scheduler_output: Any) -> None:
        """``build_connector_meta`` on the scheduler, then ``bind_connector_meta`` on every worker.

        Raises:
            ExecutorStopped: either hook raised.
        """
        if scheduler_output is None and self.version.handle_metadata_needs_scheduler_output:
            return
        metadata = self._stopping("build_connector_meta", lambda: self._on_leader(
            lambda: self.scheduler.build_connector_meta(scheduler_output)))
        self._on_every_worker("bind_connector_meta", lambda w: w.bind_connector_meta(metadata))

    def request_finished(self, request: LlmRequest, block_ids: list[int]) -> bool:
        """``request_finished``; True records an async save (state ``DISAGG_CONTEXT_TRANS_IN_PROGRESS``).

        Raises:
            ExecutorStopped: the hook raised.
        """
        saving = bool(self._stopping("request_finished", lambda: self._on_leader(
            lambda: self.scheduler.request_finished(request, list(block_ids)))))
        if saving:
            self.new_saving[request.request_id] = request
            request.state = LlmRequestState.DISAGG_CONTEXT_TRANS_IN_PROGRESS
        return saving

    # ------------------------------------------------------------------ worker side
    def start_load_kv(self) -> None:
        """``start_load_kv(stream)`` on every worker.

        Raises:
            ExecutorStopped: a worker raised (the call is outside ``_forward_step``'s ``try``).
        """
        self._on_every_worker("start_load_kv", lambda w: w.start_load_kv(self.stream))

    def wait_for_layer_load(self, layer_idx: int, request_ids: list[int]) -> None:
        """``wait_for_layer_load(layer_idx, stream)`` on every worker.

        Raises:
            ConnectorWorkerError: a worker raised.
        """
        self._in_forward("wait_for_layer_load",
                         lambda w: w.wait_for_layer_load(layer_idx, self.stream), layer_idx, request_ids)

    def save_kv_layer(self, layer_idx: int, request_ids: list[int]) -> None:
        """``save_kv_layer(layer_idx, stream)`` on every worker.

        Raises:
            ConnectorWorkerError: a worker raised.
        """
        self._in_forward("save_kv_layer", lambda w: w.save_kv_layer(layer_idx, self.stream),
                         layer_idx, request_ids)

    def wait_for_save(self, request_ids: list[int]) -> None:
        """``wait_for_save(stream)`` on every worker (end of a forward, still in its ``try``).

        Raises:
            ConnectorWorkerError: a worker raised.
        """
        self._in_forward("wait_for_save", lambda w: w.wait_for_save(self.stream), None, request_ids)

    def get_finished(self) -> tuple[list[int], list[int]]:
        """``get_finished`` on every worker; returns ``(saved_ids, loaded_ids)`` done on ALL workers.

        Raises:
            ExecutorStopped: a worker raised, or returned an id not pending on its rank
                (``__cause__`` KeyError).
        """
        started_loading, finished_gen = list(self.new_loading), list(self.new_saving)
        self.new_loading, self.new_saving = {}, {}
        for rank, worker in enumerate(self.workers):
            state = self._ranks[rank]
            state.pending["loading"].update(started_loading)
            state.pending["saving"].update(finished_gen)
            done_saving, done_loading = self._stopping(
                "get_finished", lambda w=worker: w.get_finished(list(finished_gen), list(started_loading)),
                rank)
            self._stopping("get_finished", lambda s=state, ds=done_saving, dl=done_loading:
                           self._extract(s, ds, dl, rank), rank)
        return self._intersect("saving"), self._intersect("loading")

    @staticmethod
    def _extract(state: _RankState, done_saving: list[int], done_loading: list[int], rank: int) -> None:
        for kind, ids in (("saving", done_saving), ("loading", done_loading)):
            for request_id in ids:
                if request_id not in state.pending[kind]:
                    raise KeyError(f"worker rank {rank} reported {kind} done for request {request_id}, "
                                   "which is not pending on that rank (never passed in, or already returned)")
                state.pending[kind].discard(request_id)
                state.done[kind].add(request_id)

    def _intersect(self, kind: str) -> list[int]:
        done = set.intersection(*(state.done[kind] for state in self._ranks))
        if self.tp is not None:  # mpi_allgather: every rank's locally finished ids
            gathered: list[Any] = [None] * self.tp.size
            torch.distributed.all_gather_object(gathered, sorted(done))
            done = set.intersection(*(set(ids) for ids in gathered))
        for state in self._ranks:
            state.done[kind].difference_update(done)
        return sorted(done)

    def has_pending(self) -> bool:
        """Whether any async load or save is still outstanding on some rank."""
        return bool(self.new_loading or self.new_saving or any(
            s.pending["saving"] or s.pending["loading"] or s.done["saving"] or s.done["loading"]
            for s in self._ranks))

    # ------------------------------------------------------------------ error boundaries
    def _on_leader(self, call: Callable[[], T]) -> T:
        """``call`` (a scheduler hook) on the tensor-parallel leader, its result broadcast to every
        rank (``_run_on_leader``); without tensor parallelism just ``call()``.

        Raises:
            LeaderError: on a rank other than 0, the leader's call raised.
        """
        if self.tp is None:
            return call()
        box: list[Any] = [None]
        if self.tp.rank == 0:
            try:
                box[0] = ("ok", call())
            except Exception as exc:
                torch.distributed.broadcast_object_list([("error", f"{type(exc).__name__}: {exc}")], src=0)
                raise
        torch.distributed.broadcast_object_list(box, src=0)
        status, value = box[0]
        if status == "error":
            raise LeaderError(f"the scheduler on tensor-parallel rank 0 raised: {value}")
        return value


    @staticmethod
    def _stopping(hook: str, call: Callable[[], T], rank: int | None = None) -> T:
        try:
            return call()
        except Exception as exc:  # boundary: outside _forward_step's try the executor loop ends
            where = f"connector worker rank {rank}" if rank is not None else "connector"
            raise ExecutorStopped(
                f"executor stopped: {where} raised in {hook}: {type(exc).__name__}: {exc}", hook=hook,
            ) from exc

    def _on_every_worker(self, hook: str, call: Callable[[Any], Any]) -> None:
        for rank, worker in enumerate(self.workers):
            self._stopping(hook, lambda w=worker: call(w), rank)

    def _in_forward(self, hook: str, call: Callable[[Any], Any], layer_idx: int | None,
                    request_ids: list[int]) -> None:
        for rank, worker in enumerate(self.workers):
            try:
                call(worker)
            except Exception as exc:  # boundary: inside _forward_step's try → _handle_errors
                where = f" layer {layer_idx}" if layer_idx is not None else ""
                raise ConnectorWorkerError(
                    f"connector worker rank {rank} raised in {hook}{where} for requests "
                    f"{request_ids}: {type(exc).__name__}: {exc}", hook=hook, layer_idx=layer_idx,
                ) from exc

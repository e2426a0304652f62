"""REFERENCE ENGINE HARNESS — drives a KV Cache Connector the way TensorRT-LLM's runtime does.

Test and demo infrastructure only; never an engine for serving. Mirrors ``KvCacheConnectorManager``
and ``KvCacheConnectorSchedulerOutputManager`` in NVIDIA/TensorRT-LLM
``tensorrt_llm/_torch/pyexecutor/connectors/kv_cache_connector.py`` (1.x:
``tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py``):

- ``query`` = ``get_num_new_matched_tokens``: rejects generation-only requests, ``(0, True)``
  (same ``RuntimeError`` message), negative counts, a promise reaching the last prompt token
  (C++ ``setPrepopulatedPromptLen``: prepopulated < prompt length) and — stricter than TensorRT-LLM,
  which does not check it — a count that is not a whole number of blocks.
- ``build_scheduler_output``: new vs cached requests, cumulative deltas of tokens and block ids,
  ``computed_position`` minus the connector's tokens on the first report, requests whose load just
  went async are left out of that iteration, ``block_hashes``/``priorities``/``cache_salt``.
- ``get_finished``: ids are passed once; per-worker pending sets; the runtime acts on an id only
  when EVERY worker has returned it (the ``mpi_allgather`` intersection).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from .._trtllm import RequestData, SchedulerOutput
from .kv_cache_manager import KVCacheManager, KVSequence
from .request import LlmRequest, LlmRequestState

__all__ = [
    "AttentionOrderError",
    "ConnectorContractError",
    "ConnectorDriver",
    "ConnectorWorkerError",
    "HarnessStream",
]


class ConnectorContractError(RuntimeError):
    """The connector broke a rule of the runtime; the request fails."""


class ConnectorWorkerError(RuntimeError):
    """A worker hook raised; the request of that forward fails (with ``trtllm_hook_errors``, as
    TensorRT-LLM 1.1/1.2 handles it: see :mod:`connector.harness.engine`).

    Attributes:
        hook: the worker method that raised (``start_load_kv``, ``wait_for_layer_load``, ...).
        layer_idx: the layer, for per-layer hooks.
    """

    def __init__(self, message: str, *, hook: str, layer_idx: int | None = None) -> None:
        super().__init__(message)
        self.hook = hook
        self.layer_idx = layer_idx


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


def _request_data(**values: Any) -> Any:
    """Build ``RequestData`` passing only fields the installed class has (1.2 lacks newer ones)."""
    names = {f.name for f in fields(RequestData)}
    return RequestData(**{k: v for k, v in values.items() if k in names})


class ConnectorDriver:
    """Runtime side of the connector API for one harness engine.

    Args:
        scheduler: the connector's scheduler object.
        workers: one worker per simulated rank (all see the same KV pool).
        manager: the engine's KV cache manager.
        attention_dp_rank: set on every ``SchedulerOutput`` when not None.
    """

    def __init__(self, scheduler: Any, workers: list[Any], manager: KVCacheManager,
                 attention_dp_rank: int | None = None) -> None:
        if not workers:
            raise ValueError("at least one connector worker is required")
        self.scheduler = scheduler
        self.workers = workers
        self.manager = manager
        self.attention_dp_rank = attention_dp_rank
        self.stream = HarnessStream()
        self._reported: dict[int, _Reported] = {}
        self._external_loads: dict[int, int] = {}
        self.new_loading: dict[int, LlmRequest] = {}
        self.new_saving: dict[int, LlmRequest] = {}
        self._pending: list[dict[str, set[int]]] = [{"saving": set(), "loading": set()} for _ in workers]
        self._waiting = {"saving": set(), "loading": set()}

    # ------------------------------------------------------------------ scheduler side
    def query(self, request: LlmRequest, num_computed_tokens: int) -> int:
        """``get_num_new_matched_tokens`` plus the runtime's checks; call under the manager lock.

        Raises:
            RuntimeError: generation-only request (as TensorRT-LLM).
            ConnectorContractError: ``(0, True)``, negative, not whole blocks, or no token left.
        """
        if request.is_generation_only_request:
            raise RuntimeError("Connector API is not supported for generation-only requests!")
        num_tokens, load_async = self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
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
        if load_async and num_tokens:
            self.new_loading[request.request_id] = request
        self._external_loads[request.request_id] = num_tokens
        request.py_num_connector_matched_tokens = num_tokens
        return num_tokens

    def update_state_after_alloc(self, request: LlmRequest, block_ids: list[int]) -> None:
        """Hand the request's block ids to the scheduler (lock released)."""
        self.scheduler.update_state_after_alloc(request, list(block_ids))

    def build_scheduler_output(self, context: list[tuple[LlmRequest, KVSequence]],
                               generation: list[tuple[LlmRequest, KVSequence]]) -> Any:
        """This iteration's ``SchedulerOutput`` (clears the recorded connector loads)."""
        output = SchedulerOutput()
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
        priorities = None
        if request.kv_cache_retention_config is not None:
            priorities = [self.manager.get_priority_by_block_id(b) for b in new_block_ids]
        return _request_data(
            request_id=request.request_id, new_tokens=new_tokens, new_block_ids=new_block_ids,
            computed_position=computed, num_scheduled_tokens=scheduled,
            block_hashes=self.manager.block_hashes(seq), priorities=priorities,
            cache_salt=request.cache_salt, new_block_ids_by_layer_group=[])

    def reset_request(self, request_id: int) -> None:
        """Forget a request's deltas so a recompute is reported as a new request."""
        self._reported.pop(request_id, None)
        self._external_loads.pop(request_id, None)

    def handle_metadata(self, scheduler_output: Any) -> None:
        """``build_connector_meta`` on the scheduler, ``bind_connector_meta`` on every worker."""
        metadata = self.scheduler.build_connector_meta(scheduler_output)
        for worker in self.workers:
            worker.bind_connector_meta(metadata)

    def request_finished(self, request: LlmRequest, block_ids: list[int]) -> bool:
        """``request_finished``; True pins the blocks until every worker reports the save done."""
        saving = bool(self.scheduler.request_finished(request, list(block_ids)))
        if saving:
            self.new_saving[request.request_id] = request
            request.state = LlmRequestState.DISAGG_CONTEXT_TRANS_IN_PROGRESS
        return saving

    # ------------------------------------------------------------------ worker side
    def _call_workers(self, hook: str, call: Callable[[Any], Any], layer_idx: int | None = None,
                      request_ids: list[int] | None = None) -> None:
        for rank, worker in enumerate(self.workers):
            try:
                call(worker)
            except Exception as exc:  # boundary: any worker failure fails the forward's requests
                where = f" layer {layer_idx}" if layer_idx is not None else ""
                raise ConnectorWorkerError(
                    f"connector worker rank {rank} raised in {hook}{where} for requests "
                    f"{request_ids or []}: {type(exc).__name__}: {exc}", hook=hook, layer_idx=layer_idx,
                ) from exc

    def start_load_kv(self, request_ids: list[int]) -> None:
        """``start_load_kv(stream)`` on every worker."""
        self._call_workers("start_load_kv", lambda w: w.start_load_kv(self.stream), None, request_ids)

    def wait_for_layer_load(self, layer_idx: int, request_ids: list[int]) -> None:
        """``wait_for_layer_load(layer_idx, stream)`` on every worker."""
        self._call_workers("wait_for_layer_load",
                           lambda w: w.wait_for_layer_load(layer_idx, self.stream), layer_idx, request_ids)

    def save_kv_layer(self, layer_idx: int, request_ids: list[int]) -> None:
        """``save_kv_layer(layer_idx, stream)`` on every worker."""
        self._call_workers("save_kv_layer",
                           lambda w: w.save_kv_layer(layer_idx, self.stream), layer_idx, request_ids)

    def wait_for_save(self, request_ids: list[int]) -> None:
        """``wait_for_save(stream)`` on every worker (end of a forward)."""
        self._call_workers("wait_for_save", lambda w: w.wait_for_save(self.stream), None, request_ids)

    def get_finished(self) -> tuple[list[int], list[int]]:
        """``get_finished`` on every worker; returns ``(saved_ids, loaded_ids)`` done on ALL workers.

        Raises:
            ConnectorContractError: a worker returned an id it was never given.
            ConnectorWorkerError: a worker raised.
        """
        started_loading, finished_gen = list(self.new_loading), list(self.new_saving)
        self._waiting["loading"].update(started_loading)
        self._waiting["saving"].update(finished_gen)
        self.new_loading, self.new_saving = {}, {}
        for rank, worker in enumerate(self.workers):
            pending = self._pending[rank]
            pending["loading"].update(started_loading)
            pending["saving"].update(finished_gen)
            try:
                done_saving, done_loading = worker.get_finished(list(finished_gen), list(started_loading))
            except Exception as exc:  # boundary: a worker failure surfaces as ConnectorWorkerError
                raise ConnectorWorkerError(
                    f"connector worker rank {rank} raised in get_finished: {type(exc).__name__}: {exc}",
                    hook="get_finished") from exc
            for kind, ids in (("saving", done_saving), ("loading", done_loading)):
                unknown = set(ids) - pending[kind] - self._local_done(rank, kind)
                if unknown:
                    raise ConnectorContractError(
                        f"worker rank {rank} reported {kind} done for ids never passed in: {sorted(unknown)}")
                pending[kind].difference_update(ids)
                self._local_done(rank, kind).update(ids)
        return self._intersect("saving"), self._intersect("loading")

    def _local_done(self, rank: int, kind: str) -> set[int]:
        return self._pending[rank].setdefault(f"done_{kind}", set())

    def _intersect(self, kind: str) -> list[int]:
        done = set.intersection(*(self._local_done(r, kind) for r in range(len(self.workers))))
        done &= self._waiting[kind]
        for rank in range(len(self.workers)):
            self._local_done(rank, kind).difference_update(done)
        self._waiting[kind].difference_update(done)
        return sorted(done)

    def has_pending(self) -> bool:
        """Whether any async load or save is still outstanding."""
        return bool(self.new_loading or self.new_saving or self._waiting["loading"]
                    or self._waiting["saving"])

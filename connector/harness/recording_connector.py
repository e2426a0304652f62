"""REFERENCE ENGINE HARNESS — a test-only KV Cache Connector that records every call.

Test and demo infrastructure only; never a connector for serving. :func:`make_recording_connector`
returns ``(scheduler_cls, worker_cls)`` bound to one :class:`RecordingPlan`, which both records the
calls (``plan.calls``, in order, shared by scheduler and worker) and steers behaviour: promise ``n``
tokens, load asynchronously, copy donor blocks layer by layer, raise in any scheduler or worker hook
(at a given layer), save asynchronously, report ids a worker was never given.

It keys nothing on content: the test decides what to promise and where the bytes come from
(``plan.donor``), so it can never be mistaken for a real connector.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .._trtllm import KvCacheConnectorScheduler, KvCacheConnectorWorker

__all__ = ["RecordingPlan", "donor_from_engine", "make_recording_connector"]

Promise = int | Callable[[Any, int], int]
Donor = Callable[[int, int, int], list[torch.Tensor]]
"""``donor(request_id, start_token, num_tokens) -> [block [num_layers, 2, block_elems], ...]``"""


@dataclass
class RecordingPlan:
    """Knobs and the shared call log of one recording connector.

    Attributes:
        promise: tokens to promise, or ``f(request, num_computed_tokens) -> tokens``.
        load_async: answer ``(n, True)`` when ``n > 0``; the worker reports the load done after
            ``async_ready_after`` ``get_finished`` calls.
        force_async_flag: return this as ``load_is_async`` whatever ``n`` is (to provoke (0, True)).
        layerwise: copy donor blocks per layer in ``wait_for_layer_load`` (else all in
            ``start_load_kv``).
        donor: source of the promised blocks' bytes; None writes nothing.
        fail_hook / fail_layer / fail_times: raise ``RuntimeError`` in that hook — scheduler
            (``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``,
            ``request_finished``) or worker (``start_load_kv``, ``wait_for_layer_load``,
            ``save_kv_layer``, ``wait_for_save``, ``get_finished``) — at that layer, for the first
            ``fail_times`` matching calls (on any worker rank).
        save_async / save_ready_after: ``request_finished`` returns True (or ``save_async(request)``);
            the save is reported done after that many ``get_finished`` calls (counted from the call
            that passed the id).
        extra_finished: ``(saved_ids, loaded_ids)`` every worker adds to its next ``get_finished``
            answer, once (ids never passed in, or already returned: a contract breach).
        worker_delays: per worker rank, overrides ``async_ready_after`` (a slow rank).
        save_worker_delays: per worker rank, overrides ``save_ready_after``.
        lock_probe: called inside ``get_num_new_matched_tokens``; its result is recorded.
        calls: ``(hook, *details)`` tuples in call order.
        scheduler_outputs: every ``SchedulerOutput`` given to ``build_connector_meta``.
    """

    promise: Promise = 0
    load_async: bool = False
    force_async_flag: bool | None = None
    async_ready_after: int = 1
    layerwise: bool = True
    donor: Donor | None = None
    fail_hook: str | None = None
    fail_layer: int | None = None
    fail_times: int = 1
    save_async: bool | Callable[[Any], bool] = False
    save_ready_after: int = 1
    worker_delays: list[int] | None = None
    save_worker_delays: list[int] | None = None
    extra_finished: tuple[list[int], list[int]] | None = None
    lock_probe: Callable[[], bool] | None = None
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    scheduler_outputs: list[Any] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _num_workers: int = field(default=0, repr=False)

    def next_worker_rank(self) -> int:
        """Rank for a newly constructed worker (construction order)."""
        with self._lock:
            self._num_workers += 1
            return self._num_workers - 1

    def load_delay(self, rank: int) -> int:
        """``get_finished`` calls worker ``rank`` waits before reporting an async load done."""
        return self.worker_delays[rank] if self.worker_delays else self.async_ready_after

    def save_delay(self, rank: int) -> int:
        """``get_finished`` calls worker ``rank`` takes to report an async save done."""
        return self.save_worker_delays[rank] if self.save_worker_delays else self.save_ready_after

    def record(self, *entry: Any) -> None:
        """Append one call record (thread-safe)."""
        with self._lock:
            self.calls.append(entry)

    def hooks(self) -> list[str]:
        """Just the hook names of :attr:`calls`, in order."""
        return [entry[0] for entry in self.calls]

    def maybe_fail(self, hook: str, layer_idx: int | None = None) -> None:
        """Raise if this call matches ``fail_hook``/``fail_layer`` and failures remain."""
        if self.fail_hook != hook or self.fail_times <= 0:
            return
        if self.fail_layer is not None and layer_idx != self.fail_layer:
            return
        self.fail_times -= 1
        raise RuntimeError(f"injected failure in {hook} (layer {layer_idx})")


def make_recording_connector(plan: RecordingPlan) -> tuple[type, type]:
    """Build ``(scheduler_cls, worker_cls)`` sharing ``plan``; both take ``llm_args``."""

    class RecordingScheduler(KvCacheConnectorScheduler):
        supports_attention_dp = True  # records its own rank's calls only: owner-local

        def __init__(self, llm_args: Any) -> None:
            super().__init__(llm_args)
            self.tokens_per_block = llm_args.kv_cache_config.tokens_per_block
            self.promised: dict[int, tuple[int, int]] = {}
            self.targets: dict[int, list[int]] = {}
            plan.record("scheduler_init", llm_args.model)

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
            lock = plan.lock_probe() if plan.lock_probe else None
            n = plan.promise(request, num_computed_tokens) if callable(plan.promise) else plan.promise
            flag = plan.load_async and n > 0 if plan.force_async_flag is None else plan.force_async_flag
            plan.record("get_num_new_matched_tokens", request.request_id, num_computed_tokens, n, lock)
            plan.maybe_fail("get_num_new_matched_tokens")
            self.promised[request.request_id] = (num_computed_tokens, n)
            return n, flag

        def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
            lock = plan.lock_probe() if plan.lock_probe else None
            plan.record("update_state_after_alloc", request.request_id, list(block_ids), lock)
            plan.maybe_fail("update_state_after_alloc")
            start, n = self.promised.get(request.request_id, (0, 0))
            tpb = self.tokens_per_block
            self.targets[request.request_id] = block_ids[start // tpb : (start + n) // tpb]

        def build_connector_meta(self, scheduler_output: Any) -> dict[str, Any]:
            plan.scheduler_outputs.append(scheduler_output)
            plan.record("build_connector_meta",
                        [r.request_id for r in scheduler_output.new_requests],
                        [r.request_id for r in scheduler_output.cached_requests])
            plan.maybe_fail("build_connector_meta")
            loads = []
            for request_id, targets in self.targets.items():
                start, n = self.promised[request_id]
                loads.append({"request_id": request_id, "block_ids": targets, "start": start, "n": n,
                              "async": plan.load_async and n > 0})
            self.targets = {}
            return {"loads": loads}

        def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
            plan.record("request_finished", request.request_id, list(cache_block_ids))
            plan.maybe_fail("request_finished")
            return plan.save_async(request) if callable(plan.save_async) else plan.save_async

    class RecordingWorker(KvCacheConnectorWorker):
        supports_attention_dp = True  # transfers into its own rank's pool only: owner-local

        def __init__(self, llm_args: Any) -> None:
            super().__init__(llm_args)
            self.rank = plan.next_worker_rank()
            self.kv_cache: torch.Tensor | None = None
            self.active: list[dict[str, Any]] = []
            self.pending_loads: dict[int, int] = {}
            self.pending_saves: dict[int, int] = {}
            self.extra_sent = False

        def register_kv_caches(self, kv_cache_tensor: torch.Tensor) -> None:
            plan.record("register_kv_caches", tuple(kv_cache_tensor.shape), self.rank)
            self.kv_cache = kv_cache_tensor

        def bind_connector_meta(self, metadata: object) -> None:
            plan.record("bind_connector_meta")
            super().bind_connector_meta(metadata)

        def start_load_kv(self, stream: Any) -> None:
            plan.record("start_load_kv")
            plan.maybe_fail("start_load_kv")
            self.active = [load for load in self.get_connector_meta()["loads"] if load["n"] > 0]
            for load in self.active:
                if load["async"] or not plan.layerwise:
                    self._copy(load, layers=None)
                if load["async"]:
                    self.pending_loads[load["request_id"]] = plan.load_delay(self.rank)
            self.active = [load for load in self.active if not load["async"] and plan.layerwise]

        def _copy(self, load: dict[str, Any], layers: int | None) -> None:
            if plan.donor is None:
                return
            blocks = plan.donor(load["request_id"], load["start"], load["n"])
            for block_id, block in zip(load["block_ids"], blocks):
                if layers is None:
                    self.kv_cache[block_id].copy_(block)
                else:
                    self.kv_cache[block_id, layers].copy_(block[layers])

        def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
            plan.record("wait_for_layer_load", layer_idx, self.rank)
            plan.maybe_fail("wait_for_layer_load", layer_idx)
            for load in self.active:
                self._copy(load, layers=layer_idx)

        def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
            plan.record("save_kv_layer", layer_idx)
            plan.maybe_fail("save_kv_layer", layer_idx)

        def wait_for_save(self, stream: Any) -> None:
            plan.record("wait_for_save")
            plan.maybe_fail("wait_for_save")
            stream.synchronize()

        def get_finished(self, finished_gen_req_ids: list[int],
                         started_loading_req_ids: list[int]) -> tuple[list[int], list[int]]:
            for request_id in finished_gen_req_ids:
                self.pending_saves[request_id] = plan.save_delay(self.rank)
            for request_id in started_loading_req_ids:
                self.pending_loads.setdefault(request_id, plan.load_delay(self.rank))
            saved = _count_down(self.pending_saves)
            loaded = _count_down(self.pending_loads)
            if plan.extra_finished is not None and not self.extra_sent:
                self.extra_sent = True
                saved, loaded = saved + list(plan.extra_finished[0]), loaded + list(plan.extra_finished[1])
            plan.record("get_finished", list(finished_gen_req_ids), list(started_loading_req_ids),
                        saved, loaded, self.rank)
            plan.maybe_fail("get_finished")
            return saved, loaded

    return RecordingScheduler, RecordingWorker


def _count_down(pending: dict[int, int]) -> list[int]:
    done = []
    for request_id in list(pending):
        pending[request_id] -= 1
        if pending[request_id] <= 0:
            done.append(request_id)
            del pending[request_id]
    return done


def donor_from_engine(engine: Any, prompt: list[int], *, cache_salt: str | None = None,
                      lora_task_id: int | None = None) -> Donor:
    """A :data:`Donor` that copies ``prompt``'s stored blocks out of another harness engine.

    Blocks are looked up by their ``v1_block_key`` chain (salt and LoRA included) in
    ``engine.kv_cache_manager``; a missing block raises ``KeyError``.
    """
    from connector.block_keys import block_hash_chain

    tpb = engine.tokens_per_block
    hashes = block_hash_chain(prompt, tpb, cache_salt=cache_salt, lora_task_id=lora_task_id)

    def donor(request_id: int, start: int, num_tokens: int) -> list[torch.Tensor]:
        blocks = []
        for block_hash in hashes[start // tpb : (start + num_tokens) // tpb]:
            block = engine.kv_cache_manager.read_stored_block(block_hash)
            if block is None:
                raise KeyError(f"block {block_hash} is not stored in the donor engine")
            blocks.append(block)
        return blocks

    return donor

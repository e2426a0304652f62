"""What the engine hosting the connector does with a promise and with a finished request.

The connector's core (scheduler, worker) is one for every engine; the few things that differ by
engine are decided once, at construction, from an :class:`EngineContract` — never branched on
inside a hook:

* **Can the engine retract a promise?** vLLM can: a plan that fails after ``get_num_new_matched_tokens``
  answered is reported through ``get_block_ids_with_load_errors`` and vLLM recomputes those blocks
  (``kv_load_failure_policy="recompute"``; vLLM 0.32 ``vllm/distributed/kv_transfer/kv_connector/v1/base.py``).
  TensorRT-LLM cannot, in any version: its connector ABC has no ``cancel_load`` or ``request_reset``
  (NVIDIA/TensorRT-LLM ``tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py`` @ 00fdcbff5ad8,
  ``connectors/kv_cache_connector.py`` @ 035ab91cad04: "the ABC has no ``cancel_load``"), an
  exception from ``start_load_kv`` stops the executor (``_executor_loop`` calls it outside any try),
  and one from ``wait_for_layer_load`` fails every request of the batch, whose blocks
  ``releaseBlocks`` then stores for reuse. There a promise must be kept: the scheduler secures the
  donor's bytes before it answers (:mod:`connector.promises`, ``BindingPromises``) and the worker
  loads every layer before the forward.
* **Does ``get_finished`` name exactly the requests whose ``request_finished`` returned True, in the
  iteration that finished them?** TensorRT-LLM's ``KvCacheConnectorManager.get_finished`` passes
  ``new_async_requests.saving`` (those requests) and runs at the end of every executor iteration
  that is not blocked idle; the iteration that calls ``request_finished`` calls it too. So the
  worker can gather a donor's bytes right there, with an instruction armed earlier
  (:mod:`connector.saves`, ``ArmedSaves``) — nothing waits for a next request, which an idle
  engine never gets (its loop blocks and calls no connector hook). vLLM passes every finished
  request, so there the save instruction ships after ``request_finished`` (``SavesAfterFinish``).
* **Does every request end with ``request_finished``?** vLLM calls it for every finished or aborted
  request. TensorRT-LLM's AsyncTransferManager-era executor calls it only on normal completion
  (``_send_kv_async``): a cancelled request, or one failed by ``_handle_errors``, is freed without
  it (older executors call it from ``_do_terminate_request`` on every exit). There the scheduler
  releases what a request held once no hook named it for ``request_orphan_timeout_s``.
"""

from __future__ import annotations

import dataclasses

__all__ = ["TENSORRT_LLM", "VLLM", "EngineContract"]


@dataclasses.dataclass(frozen=True, slots=True)
class EngineContract:
    """The engine facts the connector's core is built around (see the module docstring)."""

    name: str
    """For logs and docs: ``tensorrt_llm``, ``vllm``."""
    recomputes_failed_loads: bool
    """True: a plan may fail after its promise and the engine recomputes its blocks. False: a
    promise must be kept (bytes secured before the answer; what the ledger says afterwards is a
    freshness signal; only the bytes' own checks can stop a load, and then by stopping the
    executor, before anything is read)."""
    finished_ids_are_saves: bool
    """``get_finished``'s finished ids are exactly the requests whose ``request_finished`` returned
    True, passed in the same iteration: saves are armed at allocation and gathered there."""
    drops_requests_silently: bool
    """Some requests end without ``request_finished`` (and the engine reports every live request in
    every iteration it schedules it): the scheduler reaps requests no hook named for a while."""


TENSORRT_LLM = EngineContract("tensorrt_llm", recomputes_failed_loads=False, finished_ids_are_saves=True,
                              drops_requests_silently=True)
"""TensorRT-LLM 1.x and 2026 main (the reference engine harness models both)."""
VLLM = EngineContract("vllm", recomputes_failed_loads=True, finished_ids_are_saves=False,
                      drops_requests_silently=False)
"""vLLM 0.32's ``KVConnectorBase_V1`` (connector/vllm_connector.py)."""

"""REFERENCE ENGINE HARNESS — what differs between the TensorRT-LLM versions the harness runs as.

Test and demo infrastructure only; never an engine for serving. :class:`~.engine.HarnessLLM` runs
the NON-overlap executor loop (``PyExecutor._executor_loop``, ``disable_overlap_scheduler=True``) of
NVIDIA/TensorRT-LLM ``tensorrt_llm/_torch/pyexecutor/py_executor.py`` in every profile; a profile
changes only the behaviours the versions' sources disagree on:

- which exits of a request call ``request_finished`` (normal completion only, from
  ``_send_kv_async``; or every termination of a request that has a KV sequence, from
  ``_do_terminate_request``);
- whether the blocks of a request whose ``request_finished`` returned True are stored for reuse
  (and pinned) when its save starts (``AsyncTransferManager.start_transfer`` →
  ``store_blocks_for_reuse(request, True)``), or stay allocated, unstored, until the save ends;
- the fields ``RequestData`` and ``SchedulerOutput`` carry;
- whether ``handle_metadata`` skips ``build_connector_meta`` when no scheduler output was built;
- whether the manager sets ``request.py_num_connector_matched_tokens``.

Sources: the connector modules are read at the commits named on each profile; the executors are
the stored copies the fact sheet names V1/V2 (read_file ids 38554173388, 736889464; commits
unknown), V3a (``py_executor.py`` @ 00fdcbff5ad82a6438b3e0c9dbc5480b6ee52bdc, id 19803420373) and
V3 (id 3542389387, commit unknown, the newest stored).

Not modelled in any profile: the overlap loop (default in TensorRT-LLM; there a forward-hook
exception also stops the executor, because ``_sample_async`` returns None after ``_handle_errors``
and ``assert sample_state is not None, "Sampling failed"`` raises), pipeline parallelism (refused
with a connector), pausing/preemption (``GUARANTEED_NO_EVICT``), attention-DP dummy requests.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "REQUEST_DATA_FIELDS_1X",
    "REQUEST_DATA_FIELDS_2026",
    "TRTLLM_1X",
    "TRTLLM_1X_TERMINATE",
    "TRTLLM_MAIN_2026",
    "TRTLLM_VERSIONS",
    "TrtllmVersion",
]

REQUEST_DATA_FIELDS_1X = ("request_id", "new_tokens", "new_block_ids", "computed_position",
                          "num_scheduled_tokens")
"""``RequestData`` of the 1.x module (read_file ids 19460767766 and 930780166)."""

REQUEST_DATA_FIELDS_2026 = (*REQUEST_DATA_FIELDS_1X, "block_hashes", "priorities", "cache_salt",
                            "new_block_ids_by_layer_group")
"""``RequestData`` of ``connectors/kv_cache_connector.py`` @ 035ab91c (read_file id 68382362537)."""


@dataclass(frozen=True)
class TrtllmVersion:
    """The connector-visible behaviours of one TensorRT-LLM version.

    Attributes:
        name: short label used in test ids and messages.
        connector_module: path of the connector module in NVIDIA/TensorRT-LLM.
        source: the commits / stored files the profile was read from.
        request_finished_on_every_termination: True: ``request_finished`` runs whenever a request
            with a KV sequence is terminated (completion, ``_handle_errors``, cancel) and a True
            answer keeps the blocks allocated until the save is reported. False: only a request
            that completed normally in the iteration's batch is passed, from ``_send_kv_async``.
        stores_blocks_when_save_starts: a True ``request_finished`` stores the request's blocks
            for reuse at once (pinned until the save is reported).
        request_data_fields: the ``RequestData`` fields this version's module defines, in order.
        scheduler_output_has_attention_dp_rank: ``SchedulerOutput.attention_dp_rank`` exists.
        handle_metadata_needs_scheduler_output: ``handle_metadata`` returns early, calling no
            ``build_connector_meta``, when no scheduler output was built.
        sets_py_num_connector_matched_tokens: the manager writes the honoured count onto the
            request (``commit_new_matched_tokens``).
    """

    name: str
    connector_module: str
    source: str
    request_finished_on_every_termination: bool
    stores_blocks_when_save_starts: bool
    request_data_fields: tuple[str, ...]
    scheduler_output_has_attention_dp_rank: bool
    handle_metadata_needs_scheduler_output: bool
    sets_py_num_connector_matched_tokens: bool


TRTLLM_1X = TrtllmVersion(
    name="1.x",
    connector_module="tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py",
    source=("NVIDIA/TensorRT-LLM kv_cache_connector.py and py_executor.py @ "
            "00fdcbff5ad82a6438b3e0c9dbc5480b6ee52bdc (read_file ids 19460767766, 19803420373)"),
    request_finished_on_every_termination=False,
    stores_blocks_when_save_starts=True,
    request_data_fields=REQUEST_DATA_FIELDS_1X,
    scheduler_output_has_attention_dp_rank=False,
    handle_metadata_needs_scheduler_output=False,
    sets_py_num_connector_matched_tokens=False,
)
"""TensorRT-LLM 1.x, the first ``AsyncTransferManager`` executor (fact sheet V3a, C-00f).

``request_finished`` is called only from ``_send_kv_async`` for a request of the batch that
finished normally; ``_handle_errors``, ``_handle_canceled_requests`` and paused requests only free
(``_do_terminate_request`` → ``free_resources``). A True answer: ``start_transfer`` always calls
``store_blocks_for_reuse(request, True)`` (stored and pinned), the sequence is freed, and
``get_finished`` → ``end_transfer`` unpins. ``RequestData`` has five fields and ``SchedulerOutput``
no ``attention_dp_rank``; ``handle_metadata`` always calls ``build_connector_meta``.

Deviation, documented: V3a matches in ``_prepare_and_schedule_batch`` (``_prepare_disagg_gen_init``
→ ``add_sequence``; ``mark_ready_requests``; a second ``_schedule``), so there
``get_num_new_matched_tokens``/``update_state_after_alloc`` may run in an iteration that forwards
nothing and an async-loading request is never in the scheduled batch; the harness matches inside
``prepare_resources`` and parks afterwards (the V3 shape) in every profile.
"""

TRTLLM_MAIN_2026 = TrtllmVersion(
    name="main-2026",
    connector_module="tensorrt_llm/_torch/pyexecutor/connectors/kv_cache_connector.py",
    source=("NVIDIA/TensorRT-LLM connectors/kv_cache_connector.py @ "
            "035ab91cad04b7b77a479a9526edecfbc742c661 (read_file id 68382362537) with the newest "
            "stored py_executor.py (read_file id 3542389387, commit unknown)"),
    request_finished_on_every_termination=False,
    stores_blocks_when_save_starts=True,
    request_data_fields=REQUEST_DATA_FIELDS_2026,
    scheduler_output_has_attention_dp_rank=True,
    handle_metadata_needs_scheduler_output=True,
    sets_py_num_connector_matched_tokens=True,
)
"""2026 main (fact sheet V3 with C-2026); the harness default.

``request_finished`` only from ``_send_kv_async`` for a request of the batch that finished
normally (cancel is applied after ``_send_kv_async``, errors only free). A True answer:
``start_transfer`` stores and pins the blocks when block reuse is on (``should_store_blocks``),
``get_finished`` → ``_end_transfer_and_maybe_terminate`` unpins and frees. ``handle_metadata``
returns early without a scheduler output. ``start_load_kv`` can run in an iteration whose
forward is then skipped: ``take_scheduled_requests_pending_load`` may empty the batch and
``_can_queue`` is evaluated again before the forward. Every ``RequestData`` field.
"""

TRTLLM_1X_TERMINATE = TrtllmVersion(
    name="1.x-terminate",
    connector_module="tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py",
    source=("the first connector-era executors (fact sheet V1 read_file id 38554173388, upstream "
            "side; V2 id 736889464; commits unknown) with the 1.x manager (id 930780166)"),
    request_finished_on_every_termination=True,
    stores_blocks_when_save_starts=False,
    request_data_fields=REQUEST_DATA_FIELDS_1X,
    scheduler_output_has_attention_dp_rank=False,
    handle_metadata_needs_scheduler_output=False,
    sets_py_num_connector_matched_tokens=False,
)
"""The earlier connector-era executor: ``_do_terminate_request`` calls ``request_finished`` on
EVERY termination of a request that has a KV sequence (``get_cache_indices`` succeeds):
completion (``_handle_responses``), ``_handle_errors`` (parked requests included) and cancel. A
True answer keeps the sequence and its blocks allocated (V1: no ``free_resources``) until every
worker reported the save; then ``free_resources`` (the blocks are stored for reuse on release).
An exception from ``request_finished`` propagates out of whichever path terminated, even out of
``_forward_step``'s ``except``: the executor stops.
"""

TRTLLM_VERSIONS = (TRTLLM_1X, TRTLLM_MAIN_2026, TRTLLM_1X_TERMINATE)
"""Every profile, for parametrized tests."""

"""Parallel layouts: which of TensorRT-LLM's ways of splitting a model the connector serves, and why.

Pure module (no I/O, no TensorRT-LLM import). One table, read by the namespace
(:class:`connector.namespace.DeploymentNamespace` refuses a request of a refused layout:
``kind="unsupported"``, lookup miss ``unsupported``, no donor registered) and by
``semkv-ledger connector-check --llm-args`` (which prints it). docs/modes.md, "Parallel layouts",
is the same table for operators.

What TensorRT-LLM does per layout (NVIDIA/TensorRT-LLM, read through the project's source tools):

* **Tensor parallelism** (``tensor_parallel_size > 1`` without attention DP): every rank holds a
  shard of the KV heads (``block_elems`` per rank is ``num_kv_heads / tp`` heads); one scheduler
  on rank 0 broadcasts to every rank's worker (``_run_on_leader``). A donor would be one shard per
  rank, complete only when every shard is saved and verified: not built yet (issue 21). Refused.
* **Pipeline parallelism** / **context parallelism**: a rank holds some of the layers / some of
  the sequence; no rank holds a whole block. Refused.
* **Attention data parallelism** (``enable_attention_dp``; ``tensor_parallel_size`` is then the
  number of attention-DP ranks): attention is NOT sharded — every rank holds all KV heads (the KV
  cache is sized with ``tp_size = 1 if mapping.enable_attention_dp``; read_file id 176357542) for
  its own requests in its own pool. The 2026 connector API runs one scheduler per rank
  (``KvCacheConnectorManager``: "A scheduler is required on every attention-DP owner"), calls it
  locally (``_run_on_leader`` does not broadcast under attention DP), sets
  ``SchedulerOutput.attention_dp_rank = mpi_rank()`` ("Owner of the local block IDs under attention
  DP ... This is not a storage namespace"), completes ``get_finished`` per owner (no allgather),
  and refuses a connector that does not declare ``supports_attention_dp = True`` on both classes
  (``validate_attention_dp``) — ``tensorrt_llm/_torch/pyexecutor/connectors/kv_cache_connector.py``
  @ 035ab91cad04b7b77a479a9526edecfbc742c661. Its KV events carry ``attention_dp_rank=mapping.rank``
  (``kv_cache/kv_cache_manager_v2.py``, stored version, read_file id 56023105518). Supported on that
  API: blocks and donors are per rank, a donor is registered under the rank TensorRT-LLM reports,
  and its block liveness is read from that rank's blocks (docs/modes.md). TensorRT-LLM 1.x's
  connector API has no attention DP (one scheduler on rank 0, every call broadcast): refused there.
* **Variable sliding windows** (``kv_cache_config.max_attention_window``): blocks a window passed
  hold no KV (``BAD_PAGE_INDEX``), and several windows mean several layer groups; the
  ``*_by_layer_group`` hooks are not implemented. Refused (the namespace checks it).
* **MLA** (``kv_lora_rank`` in the model config): one latent per token (``kv_factor`` 1), which
  the model config alone does not size; supported with an explicit ``[namespace] kv_layout`` (a
  byte copy of whole blocks needs only the pool's shape), refused without (the namespace checks it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["LayoutSupport", "attention_dp_api", "attention_dp_layout", "mla_layout", "parallel_layouts", "refused",
           "sliding_window_layout"]


@dataclasses.dataclass(frozen=True, slots=True)
class LayoutSupport:
    """Whether one layout is in use in a configuration and whether the connector serves it.

    Attributes:
        layout: ``tensor_parallel``, ``pipeline_parallel``, ``context_parallel``, ``attention_dp``,
            ``sliding_window``, ``mla``.
        title: its name for people (``tensor parallelism (TP)``).
        in_use: the configuration uses it.
        supported: the connector materializes and registers donors under it (when in use).
        setting: what was read (``tensor_parallel_size=2``).
        reason: why it is supported or refused (one sentence, for logs, ``connector-check`` and
            the namespace's ``NamespaceUnknown.detail``).
        known: False when what decides it was not given (MLA without the model's config).
    """

    layout: str
    title: str
    in_use: bool
    supported: bool
    setting: str
    reason: str
    known: bool = True


def _size(llm_args: Any, name: str) -> int | None:
    """A parallel size as TensorRT-LLM's pydantic ``TorchLlmArgs`` would read it: absent or None is
    its default 1; an int, or a string or float holding one, must be ≥ 1; anything else is None
    (unreadable: the layout is refused, never guessed)."""
    value = getattr(llm_args, name, None)
    if value is None:
        return 1
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    elif isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


_TRUE, _FALSE = {"true", "1", "yes", "on", "t", "y"}, {"false", "0", "no", "off", "f", "n"}


def _flag(llm_args: Any, name: str) -> bool | None:
    """A boolean as pydantic reads one (``"false"`` is False); absent is False; None when unreadable."""
    value = getattr(llm_args, name, None)
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    return None


def _unreadable(layout: str, title: str, name: str, value: Any, expected: str) -> LayoutSupport:
    return LayoutSupport(layout, title, True, False, f"{name}={value!r}",
                         f"{name} is not {expected}: the connector does not guess a parallel layout")


def attention_dp_api() -> bool:
    """Does the connector API this process runs against have attention DP (``supports_attention_dp``
    on the scheduler ABC: TensorRT-LLM 2026 main, and the connector's own ABCs that model it)? False
    under TensorRT-LLM 1.x. Imports :mod:`connector._trtllm` (TensorRT-LLM, when installed)."""
    from connector._trtllm import KvCacheConnectorScheduler

    return hasattr(KvCacheConnectorScheduler, "supports_attention_dp")


def attention_dp_layout(llm_args: Any) -> str | None:
    """The namespace's ``parallel_layout`` field under attention DP, else None.

    Under attention DP the MLP / MoE of every layer is computed across the ranks (TP or EP over
    ``tensor_parallel_size`` ranks), so the hidden states a layer's K/V come from depend on that
    split (reduction order): KV computed under one split is not byte-identical to KV computed
    under another, or without attention DP. The rank is NOT part of it: every rank of one engine
    (and of any engine with the same split) computes the same bytes for the same tokens.
    """
    if not _flag(llm_args, "enable_attention_dp"):
        return None
    parts = [f"attention_dp={_size(llm_args, 'tensor_parallel_size')}"]
    for name, label in (("moe_tensor_parallel_size", "moe_tp"), ("moe_expert_parallel_size", "moe_ep"),
                        ("moe_cluster_parallel_size", "moe_cluster")):
        value = getattr(llm_args, name, None)
        parts.append(f"{label}={'auto' if value is None else value}")
    return ",".join(parts)


def parallel_layouts(llm_args: Any, *, attention_dp_api: bool) -> list[LayoutSupport]:
    """TP, PP, CP and attention DP of ``llm_args`` (TensorRT-LLM's ``TorchLlmArgs``, the harness's,
    or any object with those attribute names; missing ones mean TensorRT-LLM's defaults).

    Args:
        attention_dp_api: whether the connector API has attention DP (:func:`attention_dp_api`).
    """
    names = ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size")
    tp, pp, cp = (_size(llm_args, name) for name in names)
    adp = _flag(llm_args, "enable_attention_dp")
    unreadable = [_unreadable(layout, title, name, getattr(llm_args, name, None), "a positive integer")
                  for layout, title, name, size in zip(("tensor_parallel", "pipeline_parallel", "context_parallel"),
                                                       ("tensor parallelism (TP)", "pipeline parallelism (PP)",
                                                        "context parallelism (CP)"), names, (tp, pp, cp))
                  if size is None]
    if adp is None:
        unreadable.append(_unreadable("attention_dp", "attention data parallelism", "enable_attention_dp",
                                      getattr(llm_args, "enable_attention_dp", None), "a boolean"))
    if unreadable:
        return unreadable
    tp_in_use = tp > 1 and not adp
    rows = [
        LayoutSupport(
            "tensor_parallel", "tensor parallelism (TP)", tp_in_use, not tp_in_use,
            f"tensor_parallel_size={tp}" + (", the attention-DP ranks: attention not sharded" if adp else ""),
            "every rank holds a shard of the KV heads; a donor would be one shard per rank, complete only when "
            "every rank's shard is saved and verified, which the connector does not do yet (issue 21)"
            if tp_in_use else "not in use: each rank holds every KV head of its blocks"),
        LayoutSupport(
            "pipeline_parallel", "pipeline parallelism (PP)", pp > 1, pp == 1, f"pipeline_parallel_size={pp}",
            "every rank holds only some of the layers: no rank holds a whole block, and some TensorRT-LLM "
            "versions reject a connector with pipeline parallelism" if pp > 1 else "not in use"),
        LayoutSupport(
            "context_parallel", "context parallelism (CP)", cp > 1, cp == 1, f"context_parallel_size={cp}",
            "the sequence is split across ranks: no rank holds every token of a block" if cp > 1 else "not in use"),
    ]
    if not adp:
        rows.append(LayoutSupport("attention_dp", "attention data parallelism", False, True,
                                  "enable_attention_dp=false", "not in use"))
    elif not attention_dp_api:
        rows.append(LayoutSupport(
            "attention_dp", "attention data parallelism", True, False, f"enable_attention_dp=true, {tp} rank{'s' if tp != 1 else ''}",
            "this TensorRT-LLM's connector API (1.x) has no attention DP: one scheduler on rank 0 whose every "
            "answer is broadcast, while each rank schedules its own requests; TensorRT-LLM 2026 main "
            "(supports_attention_dp, SchedulerOutput.attention_dp_rank) is needed"))
    else:
        rows.append(LayoutSupport(
            "attention_dp", "attention data parallelism", True, True, f"enable_attention_dp=true, {tp} rank{'s' if tp != 1 else ''}",
            "one scheduler and one KV pool per rank, every KV head on every rank; donors are registered under "
            "the rank TensorRT-LLM reports (SchedulerOutput.attention_dp_rank) and their blocks' liveness is "
            "read from that rank's KV events; any rank of the same engine, or of an engine with the same "
            "parallel layout, may load them"))
    return rows


def sliding_window_layout(llm_args: Any) -> LayoutSupport:
    """Variable / sliding attention windows (``kv_cache_config.max_attention_window``)."""
    window = getattr(getattr(llm_args, "kv_cache_config", None), "max_attention_window", None)
    return LayoutSupport(
        "sliding_window", "sliding / variable attention windows (VSWA layer groups)", bool(window), not window,
        f"kv_cache_config.max_attention_window={window}",
        "blocks a window has passed hold no KV (BAD_PAGE_INDEX) and several windows are several layer groups; "
        "the per-layer-group hooks (update_state_after_alloc_by_layer_group, request_finished_by_layer_group, "
        "register_kv_cache_layout) are not implemented" if window else "not in use: one full-attention pool")


def mla_layout(model_config: Mapping[str, Any] | None, kv_layout: str | None) -> LayoutSupport:
    """MLA (``kv_lora_rank`` in the model's ``config.json``, or its ``text_config``)."""
    if model_config is None:
        return LayoutSupport("mla", "multi-head latent attention (MLA)", False, True, "model config.json not read",
                             "give the model directory (--model) to check; with an explicit [namespace] kv_layout "
                             "MLA is supported", known=False)
    text_config = model_config.get("text_config")
    config = text_config if isinstance(text_config, Mapping) else model_config
    mla = "kv_lora_rank" in config
    if not mla:
        return LayoutSupport("mla", "multi-head latent attention (MLA)", False, True, "no kv_lora_rank",
                             "not in use")
    return LayoutSupport(
        "mla", "multi-head latent attention (MLA)", True, bool(kv_layout), f"kv_lora_rank={config['kv_lora_rank']}",
        "the pool's shape is given by [namespace] kv_layout; whole blocks are copied byte for byte" if kv_layout
        else "one latent per token (kv_factor 1) that the model config does not size: set [namespace] kv_layout")


def refused(rows: list[LayoutSupport]) -> LayoutSupport | None:
    """The first layout in use that the connector refuses, or None."""
    return next((row for row in rows if row.in_use and not row.supported), None)

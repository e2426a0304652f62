"""Parallel layouts: which of TensorRT-LLM's ways of splitting a model the connector serves, and why.

Pure module (no I/O, no TensorRT-LLM import). One table, read by the namespace
(:class:`connector.namespace.DeploymentNamespace` refuses a request of a refused layout:
``kind="unsupported"``, lookup miss ``unsupported``, no donor registered) and by
``semkv-ledger connector-check --llm-args`` (which prints it). docs/modes.md, "Parallel layouts",
is the same table for operators.

What TensorRT-LLM does per layout (NVIDIA/TensorRT-LLM, read through the project's source tools):

* **Tensor parallelism** (``tensor_parallel_size > 1`` without attention DP): every rank holds a
  contiguous shard of the KV heads (``block_elems`` per rank is ``num_kv_heads / tp`` heads:
  ``tensorrt_llm/_torch/modules/attention.py`` splits heads with ``mapping.tp_size``); one
  scheduler on rank 0 whose every answer is broadcast to every rank's worker (``_run_on_leader`` →
  ``mpi_broadcast``), and ``get_finished`` acted on only when every rank returned an id
  (``mpi_allgather``; ``connectors/kv_cache_connector.py`` @ 035ab91cad04). Supported: each rank's
  worker saves and loads its own shard; a donor is complete (its ``donor_saved`` written, pointing
  at a manifest of every rank's shard) only when every rank's shard is published, and offered only
  once every shard is checksummed (:mod:`connector.donor_store`); a plan names every rank's shard
  and fails as a whole. The namespace's ``parallel_layout`` carries the TP size and the
  head-to-rank mapping (:func:`tensor_parallel_layout`), so shards of different layouts never mix.
  KV heads fewer than (or not a multiple of) the ranks — TensorRT-LLM then replicates heads — are
  refused.
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
* **Variable sliding windows** (``kv_cache_config.max_attention_window``, one window per layer,
  the list repeated over the layers when shorter): TensorRT-LLM groups layers by window size, one
  layer group per distinct window (``BaseKVCacheManager::groupLayersByWindowSize``, a map ordered
  by window: ``cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp``, stored version, read_file id
  126178160). :func:`layer_groups` judges each group: a FULL-attention group (window ≥
  ``max_seq_len``) keeps every block's KV and could be reused by a byte copy of whole blocks, as
  today; a SLIDING group keeps only the blocks of the last ``window`` tokens (the others are
  ``BAD_PAGE_INDEX``, -1, in the page lists), so no prefix of whole blocks from position 0 can be
  copied out of a donor for it. The deployment is refused as a whole while any group is sliding,
  and with several groups in any case: TensorRT-LLM 1.x's KV cache manager refuses a connector
  with several window sizes ("KV Cache Connector is not supported with multiple window sizes",
  same file), and 2026 main's calls the ``*_by_layer_group`` hooks and ``register_kv_cache_layout``,
  which the connector implements only to decline (so that the engine starts: TensorRT-LLM rejects a
  flat-only scheduler at bring-up). One window ≥ ``max_seq_len`` is full attention: served.
* **MLA** (``kv_lora_rank`` in the model config): one latent per token (``kv_factor`` 1), which
  the model config alone does not size; supported with an explicit ``[namespace] kv_layout`` (a
  byte copy of whole blocks needs only the pool's shape), refused without (the namespace checks it).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

__all__ = ["LayerGroup", "LayoutSupport", "attention_dp_api", "attention_dp_layout", "mla_layout", "parallel_layouts",
           "layer_groups", "model_kv_heads", "process_rank", "refused", "sliding_window_layout", "tensor_parallel_kv_heads", "tensor_parallel_layout",
           "tensor_parallel_size"]


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


def tensor_parallel_size(llm_args: Any) -> int:
    """Ranks the KV heads are split over: ``tensor_parallel_size`` without attention DP, else 1
    (under attention DP every rank holds every head); 1 when unreadable (the layout is refused)."""
    if _flag(llm_args, "enable_attention_dp") is not False:
        return 1
    return _size(llm_args, "tensor_parallel_size") or 1


def tensor_parallel_kv_heads(num_kv_heads: int, tp_size: int) -> list[range] | None:
    """The KV heads of each rank, contiguous (rank ``r`` holds ``[r * n / tp, (r + 1) * n / tp)``),
    or None when ``num_kv_heads`` is not a positive multiple of ``tp_size`` (TensorRT-LLM then
    replicates KV heads across ranks, which the connector refuses)."""
    if num_kv_heads < tp_size or num_kv_heads % tp_size:
        return None
    per_rank = num_kv_heads // tp_size
    return [range(r * per_rank, (r + 1) * per_rank) for r in range(tp_size)]


def tensor_parallel_layout(tp_size: int, num_kv_heads: int | None) -> str:
    """The namespace's ``parallel_layout`` under tensor parallelism: the TP size and which KV heads
    each rank holds (``tp=2,kv_heads=0-1/2-3``); ``kv_heads=per_rank_kv_layout`` when the pool's
    per-rank shape comes from ``[namespace] kv_layout`` and the heads are not known. A TP engine's
    KV differs from a TP = 1 engine's (partial sums reduced across ranks), so the TP size alone
    already keeps their donors apart; the mapping keeps apart engines that split heads differently.

    Raises:
        ValueError: ``num_kv_heads`` cannot be split over ``tp_size`` ranks.
    """
    if num_kv_heads is None:
        return f"tp={tp_size},kv_heads=per_rank_kv_layout"
    heads = tensor_parallel_kv_heads(num_kv_heads, tp_size)
    if heads is None:
        raise ValueError(f"{num_kv_heads} KV heads cannot be split over {tp_size} tensor-parallel ranks")
    return f"tp={tp_size},kv_heads=" + "/".join(f"{h.start}-{h.stop - 1}" for h in heads)


def process_rank() -> int:
    """This process's rank: the tensor-parallel rank of a TensorRT-LLM worker (one MPI process per
    rank; pipeline parallelism is refused), from the most authoritative source present:

    1. TensorRT-LLM's own ``tensorrt_llm._utils.mpi_rank()`` when the engine has imported
       TensorRT-LLM (the rank its connector manager broadcasts and all-gathers by; imported in
       NVIDIA/TensorRT-LLM tensorrt_llm/_torch/pyexecutor/connectors/kv_cache_connector.py @ 035ab91c);
    2. ``torch.distributed.get_rank()`` when a process group is initialized (vLLM, the harness);
    3. the launcher's environment (``OMPI_COMM_WORLD_RANK``, ``PMI_RANK``, ``PMIX_RANK``, ``RANK``,
       ``SLURM_PROCID``); 0 when none is set.

    The environment comes last: one launcher's variables can say another rank than the process
    group the engine really runs in (every rank 0, or ranks of a larger job), and a worker that
    takes another rank's number loads that rank's shard into its own pool, which no checksum
    can tell apart (same shape, a valid shard). A disagreement is logged.
    """
    import os

    env_rank = next((int(os.environ[name]) for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "RANK",
                                                        "SLURM_PROCID") if os.environ.get(name, "").isdigit()), None)
    rank = _engine_rank()
    if rank is None:
        return env_rank if env_rank is not None else 0
    if env_rank is not None and env_rank != rank:
        logging.getLogger(__name__).warning(
            "semkv: the launcher's environment says rank %d, the engine's process group rank %d: using %d",
            env_rank, rank, rank)
    return rank


def _engine_rank() -> int | None:
    """The rank TensorRT-LLM (already imported by the engine) or an initialized
    ``torch.distributed`` process group gives this process; None when neither does."""
    import sys

    if "tensorrt_llm" in sys.modules:  # never imported here: only what the hosting engine loaded
        try:
            from tensorrt_llm._utils import mpi_rank

            return int(mpi_rank())
        except Exception:  # noqa: BLE001 - no MPI in this process, or another TensorRT-LLM layout
            pass
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except (ImportError, RuntimeError, ValueError):
        pass
    return None


def model_kv_heads(model_config: Mapping[str, Any] | None) -> int | None:
    """KV heads of a model's ``config.json`` (or its ``text_config``), or None when not given."""
    if model_config is None:
        return None
    text_config = model_config.get("text_config")
    config = text_config if isinstance(text_config, Mapping) else model_config
    heads = config.get("num_key_value_heads") or config.get("num_attention_heads")
    return heads if isinstance(heads, int) and not isinstance(heads, bool) and heads > 0 else None


def parallel_layouts(llm_args: Any, *, attention_dp_api: bool, num_kv_heads: int | None = None) -> list[LayoutSupport]:
    """TP, PP, CP and attention DP of ``llm_args`` (TensorRT-LLM's ``TorchLlmArgs``, the harness's,
    or any object with those attribute names; missing ones mean TensorRT-LLM's defaults).

    Args:
        attention_dp_api: whether the connector API has attention DP (:func:`attention_dp_api`).
        num_kv_heads: the model's KV heads when known: tensor parallelism is refused when they
            cannot be split evenly over the ranks.
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
    heads = tensor_parallel_kv_heads(num_kv_heads, tp) if tp_in_use and num_kv_heads is not None else None
    engine_refuses = getattr(llm_args, "semkv_tensor_parallel_refused", None)  # an adapter without shards
    if tp_in_use and isinstance(engine_refuses, str):
        tp_row = LayoutSupport("tensor_parallel", "tensor parallelism (TP)", True, False,
                               f"tensor_parallel_size={tp}", engine_refuses)
    elif tp_in_use and num_kv_heads is not None and heads is None:
        tp_row = LayoutSupport(
            "tensor_parallel", "tensor parallelism (TP)", True, False,
            f"tensor_parallel_size={tp}, {num_kv_heads} KV heads",
            "the KV heads are not a multiple of the ranks: TensorRT-LLM replicates KV heads across ranks then, "
            "which the connector does not serve")
    else:
        tp_row = LayoutSupport(
            "tensor_parallel", "tensor parallelism (TP)", tp_in_use, True,
            f"tensor_parallel_size={tp}" + (", the attention-DP ranks: attention not sharded" if adp else "")
            + (f", KV heads by rank {tensor_parallel_layout(tp, num_kv_heads).split('=')[-1]}" if heads else "")
            + (", if the model's KV heads are a multiple of the ranks: not checked without them"
               if tp_in_use and num_kv_heads is None else ""),
            "every rank holds a contiguous shard of the KV heads; each rank's worker saves and loads its own "
            "shard, a donor is offered only once every rank's shard is saved and checksummed, a plan names every "
            "rank's shard and fails as a whole, and the namespace's parallel_layout (TP size, KV heads per rank) "
            "keeps shards of different layouts apart; KV heads not a multiple of the ranks are refused"
            if tp_in_use else "not in use: each rank holds every KV head of its blocks")
    rows = [
        tp_row,
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


@dataclasses.dataclass(frozen=True, slots=True)
class LayerGroup:
    """One of TensorRT-LLM's KV layer groups (the layers sharing one attention window).

    Attributes:
        group: its index, groups ordered by window size (TensorRT-LLM's map from window to layers).
        window: the attention window (tokens).
        layers: the layers in it, e.g. ``1,3,5`` (or ``l % 2 == 1`` when the layer count is unknown).
        full_attention: the window covers ``max_seq_len``: no block ever leaves it.
        reusable: a byte copy of whole blocks from position 0 could serve this group.
        reason: why (one sentence).
    """

    group: int
    window: int
    layers: str
    full_attention: bool
    reusable: bool
    reason: str

    def describe(self) -> str:
        """``group 1 (window 512, layers 1,3): NOT reusable: ...`` for logs and connector-check."""
        verdict = "reusable" if self.reusable else "NOT reusable"
        return f"group {self.group} (window {self.window}, layers {self.layers}): {verdict}: {self.reason}"


def _windows(value: Any) -> list[int] | None:
    """``kv_cache_config.max_attention_window`` as a list of positive ints (an int is one window for
    every layer); None when not set; [] when unreadable."""
    if value is None:
        return None
    values = [value] if isinstance(value, (int, str)) else value
    try:
        windows = [int(v) for v in values]
    except (TypeError, ValueError):
        return []
    return windows if windows and all(w > 0 for w in windows) else []


def layer_groups(windows: list[int], num_layers: int | None, max_seq_len: int | None) -> list[LayerGroup]:
    """TensorRT-LLM's layer groups for per-layer ``windows`` (repeated over the layers when shorter),
    each judged for reuse (see the module docstring).

    Args:
        windows: ``kv_cache_config.max_attention_window`` (tokens, each > 0).
        num_layers: the model's layers, when known.
        max_seq_len: ``llm_args.max_seq_len``, when known: a window at least that long is full attention.
    """
    by_window: dict[int, list[int]] = {}
    for position, window in enumerate(windows if num_layers is None else
                                      [windows[l % len(windows)] for l in range(num_layers)]):
        by_window.setdefault(window, []).append(position)
    groups = []
    for index, window in enumerate(sorted(by_window)):
        positions = by_window[window]
        if num_layers is not None:
            layers = ",".join(map(str, positions))
        else:  # the list repeats over the layers: name the positions it gives
            layers = "all" if len(windows) == 1 else f"l % {len(windows)} in {{{','.join(map(str, positions))}}}"
        full = max_seq_len is not None and window >= max_seq_len
        groups.append(LayerGroup(
            index, window, layers, full, full,
            "full attention: every block keeps its KV, so whole blocks copied byte for byte would serve it"
            if full else
            f"sliding window: a block the window has passed holds no KV (BAD_PAGE_INDEX, -1), so a donor keeps only "
            f"its last {window} tokens' blocks and no prefix of whole blocks from position 0 can be copied for it"
            + ("" if max_seq_len is not None else " (max_seq_len unknown: taken as a sliding window)")))
    return groups


def sliding_window_layout(llm_args: Any, num_layers: int | None = None) -> LayoutSupport:
    """Variable / sliding attention windows (``kv_cache_config.max_attention_window``), judged per
    layer group (:func:`layer_groups`); ``num_layers`` names each group's layers when given."""
    raw = getattr(getattr(llm_args, "kv_cache_config", None), "max_attention_window", None)
    windows, setting = _windows(raw), f"kv_cache_config.max_attention_window={raw}"
    title = "sliding / variable attention windows (VSWA layer groups)"
    if windows is None:
        return LayoutSupport("sliding_window", title, False, True, setting, "not in use: one full-attention pool")
    if not windows:
        return LayoutSupport("sliding_window", title, True, False, setting,
                             "max_attention_window is not a list of positive integers: the connector does not guess")
    max_seq_len = _size(llm_args, "max_seq_len") if getattr(llm_args, "max_seq_len", None) is not None else None
    groups = layer_groups(windows, num_layers, max_seq_len)
    if len(groups) == 1 and groups[0].full_attention:
        return LayoutSupport("sliding_window", title, False, True, setting,
                             f"not in use: one window ({groups[0].window}) covering max_seq_len is full attention")
    why = ("several layer groups: TensorRT-LLM 1.x refuses a connector with several window sizes, and 2026 main "
           "calls the per-layer-group hooks (update_state_after_alloc_by_layer_group, "
           "request_finished_by_layer_group, register_kv_cache_layout), which the connector implements only to "
           "decline: the engine runs, nothing is reused"
           if len(groups) > 1 else "its only layer group is a sliding window")
    return LayoutSupport("sliding_window", title, True, False, setting,
                         f"{why}; " + "; ".join(group.describe() for group in groups))


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

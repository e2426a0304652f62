"""Variable sliding-window attention (VSWA): the layer groups TensorRT-LLM builds from
``kv_cache_config.max_attention_window`` (one per distinct window, ordered by window:
``BaseKVCacheManager::groupLayersByWindowSize``) and the connector's verdict on each — which could be
reused, which cannot, and why — in connector/layouts.py, the namespace's refusal and
``connector-check``."""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path

from connector.harness import HarnessLlmArgs, KvCacheConfig, LlmRequest, ModelConfig
from connector.layouts import layer_groups, sliding_window_layout
from connector.namespace import DeploymentNamespace, Namespace, NamespaceUnknown

CFG = ModelConfig(num_layers=6)
ARGS = HarnessLlmArgs(model=CFG.name, harness_model_config=CFG, kv_cache_config=KvCacheConfig(), max_seq_len=4096,
                      max_num_tokens=512)


def with_windows(windows, max_seq_len: int = 4096) -> HarnessLlmArgs:  # noqa: ANN001
    """ARGS with TorchLlmArgs' ``kv_cache_config.max_attention_window`` (the harness does not model VSWA)."""
    kvc = types.SimpleNamespace(**dataclasses.asdict(ARGS.kv_cache_config), max_attention_window=windows)
    return dataclasses.replace(ARGS, max_seq_len=max_seq_len, kv_cache_config=kvc)


def test_layers_are_grouped_by_window_the_list_repeating_over_the_layers() -> None:
    groups = layer_groups([4096, 512, 512], num_layers=6, max_seq_len=4096)
    assert [(g.group, g.window, g.layers, g.full_attention, g.reusable) for g in groups] == [
        (0, 512, "1,2,4,5", False, False), (1, 4096, "0,3", True, True)]
    assert "BAD_PAGE_INDEX" in groups[0].reason and "last 512 tokens" in groups[0].reason
    assert "every block keeps its KV" in groups[1].reason
    unknown = layer_groups([4096, 512], num_layers=None, max_seq_len=None)  # nothing to call full
    assert [(g.layers, g.reusable) for g in unknown] == [("l % 2 in {1}", False), ("l % 2 in {0}", False)]


def test_vswa_is_refused_naming_each_group_and_why() -> None:
    row = sliding_window_layout(with_windows([4096, 512, 512]), num_layers=6)
    assert row.in_use and not row.supported
    assert "TensorRT-LLM 1.x refuses a connector with several window sizes" in row.reason
    assert ("group 0 (window 512, layers 1,2,4,5): NOT reusable: sliding window" in row.reason
            and "group 1 (window 4096, layers 0,3): reusable: full attention" in row.reason)
    ns = DeploymentNamespace(with_windows([4096, 512, 512]), engine_id="e").for_request(LlmRequest(1, [1], 1))
    assert isinstance(ns, NamespaceUnknown) and (ns.field, ns.kind) == ("attention_window", "unsupported")
    assert "group 0 (window 512, layers 1,2,4,5): NOT reusable" in ns.detail


def test_one_sliding_window_is_refused_and_one_full_window_is_full_attention() -> None:
    sliding = sliding_window_layout(with_windows(1024))  # an int: every layer (vLLM's get_sliding_window)
    assert not sliding.supported and sliding.reason.startswith("its only layer group is a sliding window")
    assert "group 0 (window 1024, layers all)" in sliding.reason
    full = sliding_window_layout(with_windows([4096]))
    assert not full.in_use and full.supported and "full attention" in full.reason
    ns = DeploymentNamespace(with_windows([4096]), engine_id="e").for_request(LlmRequest(1, [1], 1))
    plain = DeploymentNamespace(ARGS, engine_id="e").for_request(LlmRequest(1, [1], 1))
    assert isinstance(ns, Namespace) and ns.digest == plain.digest  # the same KV as no window at all
    # two windows both covering max_seq_len are still two layer groups: refused, both reusable
    two = sliding_window_layout(with_windows([4096, 8192]), num_layers=6)
    assert not two.supported and two.reason.count(": reusable: full attention") == 2


def test_an_unreadable_window_list_is_refused() -> None:
    row = sliding_window_layout(with_windows(["wide"]))
    assert row.in_use and not row.supported and "not a list of positive integers" in row.reason


def test_connector_check_names_the_groups_layers_from_the_model(check, tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "num_attention_heads": 8}))
    result = check(json.dumps({"max_seq_len": 8192, "kv_cache_config": {"max_attention_window": [1024, 8192]}}),
                   "--model", str(model))
    assert result.exit_code == 1, result.output
    assert "group 0 (window 1024, layers 0,2): NOT reusable" in result.output
    assert "group 1 (window 8192, layers 1,3): reusable: full attention" in result.output


# ------------------------------------------------------------- a cache of several layer groups (2026 main)
class TwoGroupLayout:
    """What TensorRT-LLM 2026 main's ``KvCacheLayout`` offers a worker (``groups``, each with
    ``regions``; ``as_single_pool_tensor()`` None when one tensor cannot describe the cache): the
    attributes ``register_kv_cache_layout``'s default reads (``connectors/kv_cache_connector.py`` @
    035ab91cad04). TensorRT-LLM cannot run here; this stands for its layout of a VSWA cache."""

    groups = (types.SimpleNamespace(regions=(object(),)), types.SimpleNamespace(regions=(object(),)))

    def as_single_pool_tensor(self) -> None:
        return None


def test_a_vswa_engine_starts_and_the_connector_declines_every_layer_group(tmp_path: Path, sqlite_db: str) -> None:
    from connector._trtllm import KvCacheConnectorScheduler
    from connector.metrics import ConnectorMetrics
    from connector.scheduler import SemKvScheduler
    from connector.settings import load_connector_settings
    from connector.worker import SemKvWorker

    # TensorRT-LLM rejects at bring-up a scheduler left with the flat forms under several groups
    for hook in ("update_state_after_alloc_by_layer_group", "request_finished_by_layer_group"):
        assert getattr(SemKvScheduler, hook) is not getattr(KvCacheConnectorScheduler, hook)
    settings = load_connector_settings({"db": sqlite_db, "mode": "exact_equivalent", "engine_id": "vswa",
                                        "store_dir": str(tmp_path / "store")}, environ={})
    metrics = ConnectorMetrics()
    args = dataclasses.replace(ARGS, kv_cache_config=types.SimpleNamespace(
        **dataclasses.asdict(ARGS.kv_cache_config), max_attention_window=None))  # windows not in llm_args
    scheduler, worker = (SemKvScheduler(args, settings=settings, metrics=metrics),
                         SemKvWorker(args, settings=settings, metrics=metrics))
    try:
        worker.register_kv_cache_layout(TwoGroupLayout())  # the default would raise NotImplementedError
        assert worker.layers == [] and worker.layout is None
        request = LlmRequest(7, list(range(1, 200)), 4)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
        assert metrics.misses_by_reason() == {"layout_mismatch": 1}  # the pool the worker registered
        scheduler.update_state_after_alloc_by_layer_group(request, [[1, 2], [3, -1]])
        request.output_token_ids.append(5)  # its prefill completed: a donor candidate on a served cache
        assert scheduler.request_finished_by_layer_group(request, [[1, 2], [3, -1]]) is False  # no donor, no pin
        assert metrics.value("semkv_donors_registered_total") == 0
    finally:
        scheduler.close()
        worker.close()

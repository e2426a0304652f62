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

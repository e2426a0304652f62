"""Attention DP without a fleet: which layouts the namespace serves (connector/layouts.py), the
namespace's ``parallel_layout`` field, the rank a scheduler registers donors under
(connector/donors.py ``DonorRank``), and ``semkv-ledger connector-check --llm-args``."""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path

import pytest

from connector.donors import DonorRank
from connector.harness import HarnessLlmArgs, KvCacheConfig, LlmRequest, ModelConfig
from connector.layouts import parallel_layouts, refused
from connector.namespace import DeploymentNamespace, Namespace, NamespaceUnknown
from connector.scheduler import SemKvScheduler
from connector.settings import NamespaceOverrides, load_connector_settings
from connector.worker import SemKvWorker

CFG = ModelConfig()
ARGS = HarnessLlmArgs(model=CFG.name, harness_model_config=CFG, kv_cache_config=KvCacheConfig(), max_seq_len=4096,
                      max_num_tokens=512)
ADP4 = dataclasses.replace(ARGS, enable_attention_dp=True, tensor_parallel_size=4)


def namespace(args: HarnessLlmArgs, *, api: bool = True) -> Namespace | NamespaceUnknown:
    return DeploymentNamespace(args, engine_id="e", attention_dp_api=api).for_request(LlmRequest(1, [1], 1))


def test_attention_dp_is_served_on_the_2026_api_with_the_parallel_layout_in_the_namespace() -> None:
    adp, plain = namespace(ADP4), namespace(ARGS)
    assert isinstance(adp, Namespace) and isinstance(plain, Namespace)
    assert adp.fields["parallel_layout"] == "attention_dp=4,moe_tp=auto,moe_ep=auto,moe_cluster=auto"
    assert "parallel_layout" not in plain.fields  # deployments without attention DP keep their digest
    assert adp.digest != plain.digest
    # every rank of the engine has the same namespace (the rank is not in it) and the same pool layout
    assert adp.fields["kv_layout"] == plain.fields["kv_layout"]  # every KV head on every rank
    assert namespace(dataclasses.replace(ADP4, tensor_parallel_size=2)).digest != adp.digest


def test_attention_dp_is_refused_on_a_connector_api_without_it() -> None:
    """TensorRT-LLM 1.x: one scheduler on rank 0, every answer broadcast to ranks that each
    schedule their own requests: nothing there tells a rank's blocks apart."""
    ns = namespace(ADP4, api=False)
    assert isinstance(ns, NamespaceUnknown) and (ns.field, ns.kind) == ("parallelism", "unsupported")
    assert "1.x" in ns.detail and "2026 main" in ns.detail


@pytest.mark.parametrize(("change", "layout"), [
    ({"pipeline_parallel_size": 2}, "pipeline_parallel"),
    ({"pipeline_parallel_size": 2, "tensor_parallel_size": 2}, "pipeline_parallel"),
    ({"pipeline_parallel_size": 2, "enable_attention_dp": True}, "pipeline_parallel"),
])
def test_pp_and_cp_stay_refused_with_their_reason(change: dict, layout: str) -> None:
    args = dataclasses.replace(ARGS, **change)
    ns = namespace(args)
    assert isinstance(ns, NamespaceUnknown) and ns.kind == "unsupported"
    row = refused(parallel_layouts(args, attention_dp_api=True))
    assert row is not None and row.layout == layout and row.reason in ns.detail


def test_context_parallelism_is_refused() -> None:
    class Args:  # TorchLlmArgs has context_parallel_size; the harness's llm_args do not
        context_parallel_size = 2

    row = refused(parallel_layouts(Args(), attention_dp_api=True))
    assert row is not None and row.layout == "context_parallel" and "sequence" in row.reason


def test_both_connector_classes_opt_in_to_attention_dp() -> None:
    assert SemKvScheduler.supports_attention_dp is True and SemKvWorker.supports_attention_dp is True


# ----------------------------------------------------------------------------------- DonorRank
def settings(**values):  # noqa: ANN003, ANN201
    return load_connector_settings(values, environ={})


def test_without_attention_dp_donors_take_the_configured_rank() -> None:
    rank = DonorRank(settings())
    assert rank.for_donor() == 0
    rank.observe(None)  # SchedulerOutput without attention DP: attention_dp_rank None (or no field)
    assert rank.for_donor() == 0
    assert DonorRank(settings(attention_dp_rank=3)).for_donor() == 3


def test_under_attention_dp_the_rank_is_what_tensorrt_llm_reports() -> None:
    rank = DonorRank(settings(), attention_dp=True, num_ranks=4)
    assert rank.for_donor() == DonorRank.UNKNOWN  # before the first SchedulerOutput
    rank.observe(None)
    assert rank.for_donor() == DonorRank.UNKNOWN
    rank.observe(2)
    rank.observe(2)
    assert rank.for_donor() == 2 and rank.conflict is None


@pytest.mark.parametrize(("values", "attention_dp", "reports", "why"), [
    ({}, True, [1, 3], "after 1"),  # a rank that changes
    ({}, True, [4], "outside the 4"),  # not one of the ranks
    ({}, True, [True], "outside the 4"),  # not an int
    ({"attention_dp_rank": 0}, True, [1], "setting attention_dp_rank is 0"),  # a shared TOML naming one rank
    ({}, False, [1], "no enable_attention_dp"),  # a rank without attention DP
])
def test_a_contradicting_rank_stops_donor_registration_for_good(values, attention_dp, reports, why) -> None:
    rank = DonorRank(settings(**values), attention_dp=attention_dp, num_ranks=4)
    for reported in reports:
        rank.observe(reported)
    assert rank.for_donor() == DonorRank.CONFLICT and why in (rank.conflict or "")
    rank.observe(0)  # sticky: nothing afterwards makes it trusted again
    assert rank.for_donor() == DonorRank.CONFLICT


def test_a_configured_rank_that_agrees_is_accepted() -> None:
    rank = DonorRank(settings(attention_dp_rank=2), attention_dp=True, num_ranks=4)
    assert rank.for_donor() == DonorRank.UNKNOWN  # still waits for TensorRT-LLM's word
    rank.observe(2)
    assert rank.for_donor() == 2


# ----------------------------------------------------------------------------------- connector-check (fixture `check`: conftest.py)
def test_connector_check_reports_attention_dp_supported(check) -> None:
    result = check("tensor_parallel_size: 4\nenable_attention_dp: true\nkv_cache_config:\n  tokens_per_block: 32\n")
    assert result.exit_code == 0, result.output
    assert "connector ready" in result.output
    assert "attention data parallelism: supported (enable_attention_dp=true, 4 ranks)" in result.output
    assert "tensor parallelism (TP): not in use" in result.output


@pytest.mark.parametrize(("options", "line"), [
    ("pipeline_parallel_size: 2\n", "pipeline parallelism (PP): REFUSED"),
    ("context_parallel_size: 2\n", "context parallelism (CP): REFUSED"),
    (json.dumps({"kv_cache_config": {"max_attention_window": [512, 4096]}}),
     "sliding / variable attention windows (VSWA layer groups): REFUSED"),
])
def test_connector_check_reports_refused_layouts_with_their_reason(check, options: str, line: str) -> None:
    result = check(options)
    assert result.exit_code == 1, result.output
    assert line in result.output and "would materialize nothing" in result.output
    assert "connector ready" not in result.output  # not above "not ready" any more


def test_connector_check_reads_mla_from_the_model(check, tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"kv_lora_rank": 512, "num_hidden_layers": 4}))
    result = check("enable_attention_dp: true\ntensor_parallel_size: 8\n", "--model", str(model))
    assert result.exit_code == 1
    assert "multi-head latent attention (MLA): REFUSED (kv_lora_rank=512): one latent per token" in result.output
    assert "attention data parallelism: supported" in result.output


def test_connector_check_names_a_bad_llm_args_file(check) -> None:
    result = check("- just\n- a list\n")
    assert result.exit_code == 2 and "--llm-args" in result.output and "mapping" in result.output
    result = check("tensor_parallel_size: [\n")
    assert result.exit_code == 2 and "not valid YAML" in result.output


@pytest.mark.parametrize(("options", "line", "code"), [
    # read as TensorRT-LLM's pydantic arguments would read them, never as a default
    ('tensor_parallel_size: "2"\n', "tensor parallelism (TP): supported (tensor_parallel_size=2, ", 0),
    ("tensor_parallel_size: 2.0\n", "tensor parallelism (TP): supported (tensor_parallel_size=2, ", 0),
    ('enable_attention_dp: "false"\ntensor_parallel_size: 2\n', "tensor parallelism (TP): supported", 0),
    ('enable_attention_dp: "true"\ntensor_parallel_size: "2"\n', "attention data parallelism: supported", 0),
    # unreadable: refused, naming the value
    ("tensor_parallel_size: 0\n", "tensor parallelism (TP): REFUSED (tensor_parallel_size=0)", 1),
    ("tensor_parallel_size: -2\n", "REFUSED (tensor_parallel_size=-2): tensor_parallel_size is not a positive", 1),
    ('pipeline_parallel_size: "two"\n', "pipeline parallelism (PP): REFUSED (pipeline_parallel_size='two')", 1),
    ("enable_attention_dp: maybe\n", "attention data parallelism: REFUSED (enable_attention_dp='maybe')", 1),
])
def test_connector_check_reads_sizes_and_flags_as_tensorrt_llm_would_and_refuses_the_unreadable(
        check, options: str, line: str, code: int) -> None:
    result = check(options)
    assert result.exit_code == code, result.output
    assert line in result.output


@pytest.mark.parametrize("text_config", [None, "a string", {"num_attention_heads": 4}])
def test_a_model_config_with_an_odd_text_config_is_read_not_a_traceback(check, tmp_path: Path, text_config) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"text_config": text_config, "kv_lora_rank": 512}))
    result = check("tensor_parallel_size: 1\n", "--model", str(model))
    mla_in_use = not isinstance(text_config, dict)  # a text_config object is where a multimodal model says it
    assert result.exit_code == (1 if mla_in_use else 0), result.output
    assert ("multi-head latent attention (MLA): REFUSED" in result.output) == mla_in_use
    # the engine's own namespace reads the same file (it once raised TypeError on a null text_config)
    args = types.SimpleNamespace(model=str(model), backend="pytorch", attn_backend="TRTLLM",
                                 kv_cache_config=types.SimpleNamespace(tokens_per_block=32))
    overrides = NamespaceOverrides(kv_dtype="float16", engine_version="test")
    ns = DeploymentNamespace(args, overrides).for_request(LlmRequest(0, [1, 2, 3], 1))
    assert isinstance(ns, NamespaceUnknown) and ns.field == "kv_layout"
    assert ("MLA model" in ns.detail) == mla_in_use  # else: the nested config has no head counts

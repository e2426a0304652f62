"""The vLLM adapter's translation, without vLLM (its local stand-ins): layouts, views over real
tensors, block hashes, request scope. The whole chain on real vLLM engines is tests/vllm_cpu."""

from __future__ import annotations

import contextlib
import sqlite3
import types

import pytest
import torch

from connector.namespace import DeploymentNamespace, KvLayout, Namespace, NamespaceUnknown
from connector.settings import NamespaceOverrides
from connector.block_keys import vllm_event_block_hash, vllm_event_block_hashes
from connector.vllm_connector import VllmDeployment, VllmRequest, kv_layout, layer_views
from connector.worker import SemKvWorker

BLOCKS, TPB, HEADS, HEAD = 6, 32, 2, 64


@pytest.fixture(autouse=True)
def vllm_version(monkeypatch) -> None:
    """vLLM is not installed here: pretend the version the adapter would read from it."""
    monkeypatch.setattr("connector.vllm_connector.VLLM_VERSION", "0.32.0")


class FullAttentionSpec:  # the class name is what the adapter checks
    def __init__(self, **fields: object) -> None:
        self.__dict__.update(dict(block_size=TPB, num_kv_heads=HEADS, head_size=HEAD, head_size_v=HEAD,
                                  dtype=torch.float32, sliding_window=None, page_size_padded=None) | fields)


class SlidingWindowSpec(FullAttentionSpec):
    pass


def kv_cache_config(spec: object = None, layers: int = 2, groups: int = 1) -> types.SimpleNamespace:
    group = types.SimpleNamespace(layer_names=[f"model.layers.{i}.self_attn.attn" for i in range(layers)],
                                  kv_cache_spec=spec or FullAttentionSpec())
    return types.SimpleNamespace(num_blocks=BLOCKS, kv_cache_groups=[group] * groups)


def vllm_config(model_dir: str = "/models/tiny", cache_dtype: str = "auto") -> types.SimpleNamespace:
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(model=model_dir, tokenizer=model_dir, dtype=torch.float32,
                                           max_model_len=4096, quantization=None, get_sliding_window=lambda: None),
        cache_config=types.SimpleNamespace(block_size=TPB, cache_dtype=cache_dtype),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        device_config=types.SimpleNamespace(device_type="cpu"), attention_config=types.SimpleNamespace(backend=None),
        speculative_config=None, lora_config=None, kv_transfer_config=None)


def test_layout_of_a_single_full_attention_group() -> None:
    assert kv_layout(kv_cache_config()) == KvLayout(2, 2, TPB * HEADS * HEAD, "float32")


@pytest.mark.parametrize("config", [
    kv_cache_config(groups=2), kv_cache_config(SlidingWindowSpec()), kv_cache_config(FullAttentionSpec(head_size_v=32)),
    kv_cache_config(FullAttentionSpec(page_size_padded=4096)), kv_cache_config(FullAttentionSpec(sliding_window=128)),
])
def test_unsupported_layouts_are_refused_not_guessed(config) -> None:
    layout = kv_layout(config)
    assert isinstance(layout, NamespaceUnknown) and layout.kind == "unsupported"


def test_deployment_namespace_is_known_and_names_vllm() -> None:
    deployment = VllmDeployment(vllm_config(), kv_cache_config())
    namespace = DeploymentNamespace(deployment)
    assert namespace.unknown is None
    assert namespace.tokens_per_block == TPB
    assert namespace.fields["backend"] == "vllm" and namespace.fields["attention_backend"] == "cpu:auto"
    assert namespace.fields["kv_dtype"] == "float32"
    assert namespace.fields["engine_version"] == "vllm/0.32.0"
    assert deployment.semkv_window_size == 0


def test_without_a_vllm_version_nothing_is_materialized(monkeypatch) -> None:
    monkeypatch.setattr("connector.vllm_connector.VLLM_VERSION", None)
    namespace = DeploymentNamespace(VllmDeployment(vllm_config(), kv_cache_config()))
    assert namespace.unknown is not None and namespace.unknown.field == "engine_version"


def test_hybrid_model_makes_every_request_unsupported() -> None:
    namespace = DeploymentNamespace(VllmDeployment(vllm_config(), kv_cache_config(groups=2)))
    assert namespace.unknown is not None and namespace.unknown.field == "kv_layout"


def _request(salt: str | None = None, lora: int | None = None, embeds: object = None,
             lora_name: str = "legal") -> types.SimpleNamespace:
    lora_request = None if lora is None else types.SimpleNamespace(lora_int_id=lora, lora_name=lora_name,
                                                                     lora_path=f"/adapters/{lora_name}")
    return types.SimpleNamespace(request_id="r1", num_prompt_tokens=64, all_token_ids=list(range(70)),
                                 cache_salt=salt, lora_request=lora_request,
                                 mm_features=[], prompt_embeds=embeds, block_hashes=[bytes(range(32)), b"\xff" * 32])


def test_request_scope_separates_salts_and_loras_and_refuses_prompt_embeds() -> None:
    namespace = DeploymentNamespace(VllmDeployment(vllm_config(), kv_cache_config()), engine_id="vllm-0")
    plain, salted, lora = (namespace.for_request(VllmRequest(_request(**kw)))
                           for kw in ({}, {"salt": "tenant-A"}, {"lora": 3}))
    assert all(isinstance(ns, Namespace) for ns in (plain, salted, lora))
    assert len({plain.digest, salted.digest, lora.digest}) == 3
    # the adapter's name and path, not vLLM's per-deployment lora_int_id, name its weights
    other_adapter_same_id = namespace.for_request(VllmRequest(_request(lora=3, lora_name="medical")))
    same_adapter_other_id = namespace.for_request(VllmRequest(_request(lora=7)))
    assert other_adapter_same_id.digest != lora.digest and same_adapter_other_id.digest == lora.digest
    fleet = DeploymentNamespace(VllmDeployment(vllm_config(), kv_cache_config()),
                                NamespaceOverrides(lora_task_ids="fleet"), engine_id="vllm-1")
    assert fleet.for_request(VllmRequest(_request(lora=3))).fields["lora_task_id"].startswith("adapter:")
    refused = namespace.for_request(VllmRequest(_request(embeds=torch.zeros(1))))
    assert isinstance(refused, NamespaceUnknown) and refused.field == "ptuning"
    view = VllmRequest(_request())
    assert view.prompt_len == 64 and view.get_tokens(0)[:3] == [0, 1, 2]


def test_block_hashes_are_converted_as_vllm_events_publish_them(monkeypatch) -> None:
    digest = bytes(range(32))
    assert vllm_event_block_hash(digest) == int.from_bytes(digest[-8:], "big")
    assert VllmRequest(_request()).block_hashes[1] == 2**64 - 1
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    assert vllm_event_block_hash(digest) == digest


@pytest.mark.parametrize("as_int", ["1", "0"])
def test_a_requests_block_hashes_convert_as_each_hash_does(monkeypatch, as_int: str) -> None:
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", as_int)
    digests = [bytes([i]) * 32 for i in range(40)] + [bytes(range(32))]
    assert vllm_event_block_hashes(digests) == [vllm_event_block_hash(d) for d in digests]
    request = _request()
    assert VllmRequest(request).block_hashes == [vllm_event_block_hash(h) for h in request.block_hashes]


@pytest.mark.parametrize("shape", ["cpu", "kv_first"])
def test_layer_views_write_through_to_the_engine_tensors(shape: str) -> None:
    layout = kv_layout(kv_cache_config())
    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    if shape == "cpu":  # CPU attention: [num_blocks, num_kv_heads, block_size, 2 * head_size]
        tensors = {n: torch.zeros(BLOCKS, HEADS, TPB, 2 * HEAD) for n in names}
    else:  # GPU backends: [2, num_blocks, block_size, num_kv_heads, head_size]
        tensors = {n: torch.zeros(2, BLOCKS, TPB, HEADS, HEAD) for n in names}
    views = layer_views(tensors, names, BLOCKS, layout)
    assert all(tuple(v.shape) == (BLOCKS, 2, layout.block_elems) for v in views)
    block = torch.arange(2 * layout.block_elems, dtype=torch.float32).view(1, 2, layout.block_elems)
    views[1][torch.tensor([4])] = block
    tensor = tensors[names[1]]
    written = tensor[4] if shape == "cpu" else tensor[:, 4]
    assert torch.equal(written.flatten(), block.flatten())
    assert torch.count_nonzero(tensors[names[0]]) == 0
    assert torch.equal(views[1].index_select(0, torch.tensor([4])), block)


def test_layer_views_refuse_an_unknown_block_dimension() -> None:
    layout = kv_layout(kv_cache_config())
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    with pytest.raises(ValueError, match="block dimension"):
        layer_views({n: torch.zeros(3, 7, 5) for n in names}, names, BLOCKS, layout)
    with pytest.raises(ValueError, match="registered no KV cache"):
        layer_views({}, names, BLOCKS, layout)


def test_worker_core_accepts_layer_views_and_refuses_mismatches(tmp_path, sqlite_db) -> None:
    from connector.settings import load_connector_settings

    settings = load_connector_settings({"db": sqlite_db, "store_dir": tmp_path / "store"}, environ={})
    worker = SemKvWorker(VllmDeployment(vllm_config(), kv_cache_config()), settings=settings)
    try:
        layout = kv_layout(kv_cache_config())
        names = ["a", "b"]
        views = layer_views({n: torch.zeros(BLOCKS, HEADS, TPB, 2 * HEAD) for n in names}, names, BLOCKS, layout)
        worker.register_layer_views(views, layout)
        assert worker.num_blocks == BLOCKS and worker.layout == layout
        with pytest.raises(ValueError):
            worker.register_layer_views(views[:1], layout)
        with pytest.raises(ValueError):
            worker.register_layer_views([v.to(torch.float16) for v in views], layout)
    finally:
        worker.close()


def test_resumed_requests_are_first_reports_in_both_vllm_shapes() -> None:
    from connector.vllm_connector import _resumed

    current = types.SimpleNamespace(req_ids=["a", "b"], resumed_req_ids={"b"}, new_block_ids=[([9],), ([1, 2, 3],)],
                                    num_computed_tokens=[100, 64])
    assert _resumed(current) == [("b", ([1, 2, 3],), 64)]
    older = types.SimpleNamespace(req_ids=["a", "b"], resumed_from_preemption=[True, False],
                                  new_block_ids=[([4, 5],), None], num_computed_tokens=[32, 7])
    assert _resumed(older) == [("a", ([4, 5],), 32)]


def test_scheduler_role_builds_on_the_core_and_ships_metadata(tmp_path, sqlite_db) -> None:
    from connector._vllm import KVConnectorRole
    from connector.plan import ConnectorMetadata
    from connector.vllm_connector import SemKvVllmConnector, SemKvVllmMetadata

    config = vllm_config()
    config.kv_transfer_config = types.SimpleNamespace(kv_connector_extra_config={"semkv_settings": {
        "db": sqlite_db, "mode": "exact_equivalent", "engine_id": "vllm-a", "store_dir": str(tmp_path / "store")}})
    connector = SemKvVllmConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config())
    try:
        request = _request()
        assert connector.get_num_new_matched_tokens(request, 0) == (0, False)  # empty ledger: a counted miss
        output = types.SimpleNamespace(
            scheduled_new_reqs=[types.SimpleNamespace(req_id="r1", block_ids=([0, 1],), num_computed_tokens=0)],
            scheduled_cached_reqs=types.SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                                        num_computed_tokens=[]))
        meta = connector.build_connector_meta(output)
        assert isinstance(meta, SemKvVllmMetadata) and isinstance(meta.inner, ConnectorMetadata)
        assert meta.inner.loads == ()
        # the step's work, read before vLLM advances num_computed_tokens (the profitability gate's prefill cost)
        request.num_computed_tokens = 0
        output.num_scheduled_tokens, output.total_num_scheduled_tokens = {"r1": 64, "gone": 1}, 65
        work = connector.build_connector_meta(output).inner
        assert (work.scheduled_tokens, work.prefill_context) == (65, 64)
        request.num_computed_tokens = 64  # decoding: no prompt token computed
        assert connector.build_connector_meta(output).inner.prefill_context == 0
        assert connector.request_finished(request, [0, 1]) == (True, None)  # a donor: keep blocks until saved
        assert len(connector.build_connector_meta(output).inner.saves) == 1
    finally:
        connector.shutdown()


def test_worker_names_as_sent_only_finished_requests_that_were_saves(tmp_path, sqlite_db, monkeypatch) -> None:
    """vLLM passes every finished request to ``get_finished``; one that was not a donor is freed by
    vLLM at once, and naming it as sent later killed the engine core (``assert req_id in
    self.requests``, vLLM 0.32). The core's wait for a save instruction that never comes is cut to 0
    here: the non-donor's id is still never named; the donor's is, once."""
    from connector._vllm import KVConnectorRole
    from connector.plan import ConnectorMetadata, SaveInstruction
    from connector.vllm_connector import SemKvVllmConnector, SemKvVllmMetadata

    monkeypatch.setattr("connector.worker._SAVE_REPORT_TIMEOUT_S", 0.0)
    config = vllm_config()
    config.kv_transfer_config = types.SimpleNamespace(kv_connector_extra_config={"semkv_settings": {
        "db": sqlite_db, "mode": "exact_equivalent", "engine_id": "vllm-b", "store_dir": str(tmp_path / "store")}})
    connector = SemKvVllmConnector(config, KVConnectorRole.WORKER, kv_cache_config())
    try:
        save = SaveInstruction(request_id="donor", donor_id="d1", block_ids=(0, 1), num_blocks=2, tokens_per_block=TPB,
                               namespace="ns", layout="not this pool's")  # dropped unread: reportable at once
        connector.bind_connector_metadata(SemKvVllmMetadata(ConnectorMetadata(saves=(save,))))
        connector.start_load_kv(None)
        connector.wait_for_save()
        sent = [connector.get_finished({"donor", "not-a-donor"})[0] for _ in range(3)]
        assert sent == [{"donor"}, None, None]
        assert connector.get_transfer_results({"late-non-donor"}).finished_sending == set()
    finally:
        connector.shutdown()


def test_a_request_waiting_for_an_unplanned_asynchronous_load_is_reported_failed(tmp_path, sqlite_db) -> None:
    """A request answered ``(n, True)`` whose plan did not ship (the scheduler names it ``unplanned``)
    would wait in vLLM's ``WAITING_FOR_REMOTE_KVS`` forever: the worker reports it received and
    failed (vLLM recomputes it), once."""
    from connector._vllm import KVConnectorRole
    from connector.plan import ConnectorMetadata
    from connector.vllm_connector import SemKvVllmConnector, SemKvVllmMetadata

    config = vllm_config()
    config.kv_transfer_config = types.SimpleNamespace(kv_connector_extra_config={"semkv_settings": {
        "db": sqlite_db, "mode": "exact_equivalent", "engine_id": "vllm-b", "store_dir": str(tmp_path / "store")}})
    connector = SemKvVllmConnector(config, KVConnectorRole.WORKER, kv_cache_config())
    try:
        connector.bind_connector_metadata(SemKvVllmMetadata(ConnectorMetadata(), unplanned=("r9",)))
        connector.start_load_kv(None)
        first, second = connector.get_transfer_results(set()), connector.get_transfer_results(set())
        assert (first.finished_recving, first.failed_recving) == ({"r9"}, {"r9"})
        assert (second.finished_recving, second.failed_recving) == (set(), set())
    finally:
        connector.shutdown()


def test_bytes_block_hashes_reach_the_donor_as_vllm_publishes_them(tmp_path, sqlite_db, monkeypatch) -> None:
    """With ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` vLLM publishes its 32-byte hashes, and the adapter
    passes the same bytes; the scheduler's report handling took ``int()`` of each (a TypeError: that
    step's metadata failed and the finished request registered no donor)."""
    from connector._vllm import KVConnectorRole
    from connector.vllm_connector import SemKvVllmConnector
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    config = vllm_config()
    config.kv_transfer_config = types.SimpleNamespace(kv_connector_extra_config={"semkv_settings": {
        "db": sqlite_db, "mode": "exact_equivalent", "engine_id": "vllm-a", "store_dir": str(tmp_path / "store"),
        "freshness_policy": "engine"}})
    connector = SemKvVllmConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config())
    try:
        request = _request()
        assert connector.get_num_new_matched_tokens(request, 0) == (0, False)
        output = types.SimpleNamespace(
            scheduled_new_reqs=[types.SimpleNamespace(req_id="r1", block_ids=([0, 1],), num_computed_tokens=0)],
            scheduled_cached_reqs=types.SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                                        num_computed_tokens=[]))
        connector.build_connector_meta(output)
        request.num_computed_tokens = 64
        assert connector.request_finished(request, [0, 1]) == (True, None)
        assert len(connector.build_connector_meta(output).inner.saves) == 1
        connector.scheduler.flush()
    finally:
        connector.shutdown()
    path = sqlite_db.removeprefix("sqlite:///")
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        rows = conn.execute("SELECT b.block_hash_ext FROM donors d JOIN donor_blocks b USING (donor_id) "
                            "WHERE d.engine_id = 'vllm-a' ORDER BY b.position").fetchall()
    assert rows == [(bytes(range(32)),), (b"\xff" * 32,)]

"""Engine A serves document D; engine B serves D + question and materializes D's KV from A's donor.

Real ledger (SQLite file), real consumer daemon over loopback ZMQ between the engines and the ledger,
one donor store directory shared by both engines (DESIGN §9).
"""

from __future__ import annotations

import torch

from connector.harness import HarnessLLM, KvCacheConfig
from tools.harness.fleet import MODEL, Fleet, doc_tokens, native_engine, shared_model

TPB = MODEL.tokens_per_block


def test_rule_3_b_materializes_a_donor_bit_identical_to_native_reuse(fleet: Fleet, record_property) -> None:
    a, b = fleet.engine("A"), fleet.engine("B")
    doc, question = doc_tokens(15 * TPB), doc_tokens(40, seed=2)
    a.generate(doc)
    fleet.sync()
    order: list[tuple[str, int]] = []
    b.llm.add_forward_observer(lambda event, layer, ids: order.append((event, layer)))

    got = b.generate(doc + question, max_new_tokens=4)

    assert got.num_reused_tokens == 0
    assert got.num_connector_tokens == len(doc) == 480
    record_property("tokens_materialized", got.num_connector_tokens)
    print(f"tokens materialized by B from A's donor: {got.num_connector_tokens}")
    # every layer was released to attention only after its wait_for_layer_load returned
    first_read = order.index(("attention_read", 0))
    assert order[first_read - 1] == ("wait_for_layer_load_returned", 0)
    assert ("wait_for_layer_load_returned", 1) in order[: order.index(("attention_read", 1))]

    native = native_engine()
    native.generate(doc, 1)
    reference = native.generate(doc + question, 4)
    assert reference.num_reused_tokens == got.num_connector_tokens  # same prefill start
    assert torch.equal(got.prefill_logits, reference.prefill_logits)  # bit-identical
    assert got.token_ids == reference.token_ids
    cold = shared_model(MODEL).forward_dense(doc + question)
    assert torch.allclose(got.prefill_logits, cold[got.prefill_start:], rtol=1e-4, atol=1e-4)
    # the materialized blocks hold exactly the native engine's bytes for D
    blocks = len(doc) // TPB
    assert torch.equal(b.llm.kv_cache[got.block_ids[:blocks]], native.kv_cache[reference.block_ids[:blocks]])

    m = b.metrics
    assert m.value("semkv_promises_total") == 1
    assert m.value("semkv_exact_materialized_total") == 1
    assert m.value("semkv_materialized_tokens_total") == 480
    assert m.value("semkv_experimental_materialized_total") == 0
    assert b.misses() == {}
    assert m.value("semkv_leases_held") == 0
    assert fleet.held_leases() == 0
    # B's finished request became a donor in its turn (D + question: 16 whole blocks)
    fleet.sync()
    assert b.metrics.value("semkv_donor_saves_total", outcome="saved") == 1


def test_donor_round_trip_through_the_connector_config_module(fleet: Fleet, monkeypatch, tmp_path) -> None:
    """TensorRT-LLM's way in: KvCacheConnectorConfig(connector_module="connector", ...) with the
    settings in a TOML file named by TRTLLM_SEMKV_CONFIG (the only variables MPI workers get)."""
    from connector.harness import KvCacheConnectorConfig

    config = tmp_path / "connector.toml"
    config.write_text(f'db = "{fleet.db}"\nmode = "exact_equivalent"\nengine_id = "B"\n'
                      f'store_dir = "{fleet.store_dir}"\nlookup_timeout_s = 1.0\n')
    monkeypatch.setenv("TRTLLM_SEMKV_CONFIG", str(config))
    a = fleet.engine("A")
    doc = doc_tokens(4 * TPB, seed=5)
    a.generate(doc)
    fleet.sync()
    spec = KvCacheConnectorConfig(connector_module="connector", connector_scheduler_class="SemKvScheduler",
                                  connector_worker_class="SemKvWorker")
    kvc = KvCacheConfig(tokens_per_block=TPB, max_tokens=4 * MODEL.max_context)
    llm = HarnessLLM(MODEL, kv_cache_config=kvc, kv_connector=spec, max_num_tokens=256, model=shared_model(MODEL))
    try:
        got = llm.generate(doc + [7, 8, 9], 1)
        assert got.num_connector_tokens == len(doc)
        assert llm.connector.scheduler.settings.engine_id == "B"
    finally:
        llm.wait_for_pending_transfers()
        llm.connector.workers[0].close()
        llm.connector.scheduler.close()

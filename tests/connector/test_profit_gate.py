"""The profitability gate on a real engine (reference harness, real ledger, store and consumer):
the worker teaches the cost model from the engine's own forwards and loads, the scheduler declines
a load predicted not to pay as a miss ``unprofitable`` (DESIGN §10), and the request is still right."""

from __future__ import annotations

import math

import torch

from tools.harness.fleet import MODEL, Engine, Fleet, doc_tokens, shared_model

TPB = MODEL.tokens_per_block
DOCS = [doc_tokens(16 * TPB, seed=300 + i) for i in range(4)]


def questions(seed: int) -> list[int]:
    return doc_tokens(8, seed=seed)


def donors_on_a(fleet: Fleet) -> None:
    a = fleet.engine("A")
    for doc in DOCS:
        a.generate(doc + questions(1))
    fleet.sync()


def assert_cold_equal(engine: Engine, tokens: list[int], result) -> None:
    cold = shared_model(engine.llm.model_config).forward_dense(tokens)
    assert torch.allclose(result.prefill_logits, cold[result.prefill_start:], rtol=1e-4, atol=1e-4)


def test_the_worker_teaches_the_model_from_the_engines_forwards_and_loads(fleet: Fleet) -> None:
    donors_on_a(fleet)
    b = fleet.engine("B", profit={"min_prefill_samples": 1})
    b.generate(doc_tokens(12 * TPB, seed=99))  # a cold forward: the prefill cost
    model = b.worker.cost_model
    assert model is b.scheduler.promises.cost_model  # one model per engine pool in the process
    assert not math.isnan(model.prefill_seconds(512, 16 * TPB))
    prompt = DOCS[0] + questions(2)
    result = b.generate(prompt)
    assert result.num_connector_tokens == len(DOCS[0])
    assert model.load_seconds("local_file", len(DOCS[0])) > 0
    assert b.metrics.value("semkv_ttft_delta_seconds_count") == 1  # predicted saving vs measured load
    assert_cold_equal(b, prompt, result)


def test_a_load_predicted_not_to_pay_is_declined_as_unprofitable(fleet: Fleet) -> None:
    """With a margin no load on this machine can meet, the second donor is declined once the
    model has seen one load (the first is let through: nothing to judge it by)."""
    donors_on_a(fleet)
    b = fleet.engine("B", profit={"min_prefill_samples": 1, "margin": 1000.0, "explore_every": 0})
    b.generate(doc_tokens(12 * TPB, seed=99))
    first = b.generate(DOCS[0] + questions(2))
    assert first.num_connector_tokens == len(DOCS[0])
    prompt = DOCS[1] + questions(3)
    declined = b.generate(prompt)
    assert declined.num_connector_tokens == 0
    assert b.misses() == {"no_donor": 1, "unprofitable": 1}  # the cold forward, then the decline
    assert b.metrics.value("semkv_backend_declined_total", reason="unprofitable") == 1
    assert_cold_equal(b, prompt, declined)
    [forecast] = b.scheduler.promises.cost_model.declined
    assert forecast.tokens == len(DOCS[1]) and forecast.margin == 1000.0 and forecast.basis == "measured"
    assert 0 < forecast.saved_s < 1000.0 * forecast.load_s


def test_with_the_gate_off_the_same_load_is_promised(fleet: Fleet) -> None:
    donors_on_a(fleet)
    b = fleet.engine("B", profit={"enabled": False, "min_prefill_samples": 1, "margin": 1000.0})
    b.generate(doc_tokens(12 * TPB, seed=99))
    b.generate(DOCS[0] + questions(2))
    prompt = DOCS[1] + questions(3)
    result = b.generate(prompt)
    assert result.num_connector_tokens == len(DOCS[1])
    assert b.misses() == {"no_donor": 1}  # the cold forward only
    assert_cold_equal(b, prompt, result)

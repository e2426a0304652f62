"""``discovery_only`` and ``placement`` (Modes 1 and 3) never change KV and never report materialization."""

from __future__ import annotations

import torch

from tools.harness.fleet import MODEL, Fleet, doc_tokens
from tests.connector.test_two_engines import native_engine

TPB = MODEL.tokens_per_block
DOC = doc_tokens(8 * TPB, seed=31)
PROMPT = DOC + doc_tokens(30, seed=32)


def test_discovery_only_changes_nothing_in_kv_and_never_materializes(fleet: Fleet) -> None:
    a = fleet.engine("A")
    a.generate(DOC)
    fleet.sync()
    b = fleet.engine("B", mode="discovery_only")
    got = b.generate(PROMPT, max_new_tokens=3)
    reference = native_engine().generate(PROMPT, 3)
    native_kv = native_engine()
    native_result = native_kv.generate(PROMPT, 3)

    assert got.num_connector_tokens == 0 and got.prefill_start == 0
    assert torch.equal(got.prefill_logits, reference.prefill_logits)
    assert got.token_ids == reference.token_ids
    blocks = len(PROMPT) // TPB
    assert torch.equal(b.llm.kv_cache[got.block_ids[:blocks]], native_kv.kv_cache[native_result.block_ids[:blocks]])
    b.scheduler.flush()
    m = b.metrics
    assert m.value("semkv_discovery_only_hits_total") == 1
    assert m.value("semkv_discovery_only_tokens_total") == len(DOC)
    assert m.value("semkv_promises_total") == 0
    assert m.value("semkv_exact_materialized_total") == 0
    assert m.value("semkv_materialized_tokens_total") == 0
    assert m.value("semkv_lookups_total", mode="discovery_only") == 1
    assert fleet.held_leases() == 0


def test_placement_mode_gives_advice_only(fleet: Fleet) -> None:
    a = fleet.engine("A")
    a.generate(DOC)
    fleet.sync()
    b = fleet.engine("B", mode="placement")
    got = b.generate(PROMPT)
    assert got.num_connector_tokens == 0
    b.scheduler.flush()
    assert b.metrics.value("semkv_placement_advice_total", donor_engine_id="A") == 1
    assert b.metrics.value("semkv_exact_materialized_total") == 0

"""The offline quality evaluator of issue 24 (tools/quality_eval.py, tools/quality_lm.py): its metrics on
known sequences and its KV-reuse machinery on real tensors (a small harness model with seeded random
weights: these tests check the mechanics, the trained model's numbers are in the results file)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from connector.harness.model import HarnessTransformer, ModelConfig
from tools.discovery_pairs import Pair, build_pairs
from tools.quality_eval import evaluate_pair, reuse_plan, rouge_l, token_f1
from tools.quality_lm import QUICK_LM, QualityLM, WordVocab, blended_forward, rerotate

CFG = ModelConfig(vocab_size=512, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=64,
                  max_context=512, seed=3)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    # as tools/quality_eval.py runs: two contended intra-op threads on a busy 2-core machine (pytest under
    # nice at load 10) made one of these tests run past the 300 s timeout; on one thread it takes 2 s
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model() -> HarnessTransformer:
    return HarnessTransformer(CFG, num_threads=1)


@pytest.fixture(scope="module")
def pairs() -> dict[str, Pair]:
    ps = build_pairs(1, ctx=128, classes=("other_instructions", "reordered_chunks", "paraphrase"))
    return {p.cls if p.cls != "other_instructions" else p.variant: p for p in ps.pairs}


def test_token_f1_and_rouge_l_on_known_sequences() -> None:
    assert token_f1([1, 1, 2], [1, 2, 2]) == pytest.approx(2 / 3)
    assert rouge_l([1, 2, 3, 4], [1, 3, 4, 5]) == pytest.approx(0.75)  # LCS 1 3 4
    assert token_f1([1, 2, 3], [3, 2, 1]) == 1.0 and rouge_l([1, 2, 3], [3, 2, 1]) == pytest.approx(1 / 3)
    assert token_f1([1, 2], [3]) == 0.0 and rouge_l([1, 2], [3]) == 0.0
    assert token_f1([], []) == 1.0 and rouge_l([], []) == 1.0
    assert rouge_l([5, 6, 7], [5, 6]) == pytest.approx(2 * 1.0 * (2 / 3) / (1 + 2 / 3))


def test_exact_blended_forward_is_the_harness_dense_forward(model: HarnessTransformer) -> None:
    ids = torch.randint(1, CFG.vocab_size, (150,), generator=torch.Generator().manual_seed(1))
    blend = blended_forward(model, ids)
    assert blend.rows.tolist() == list(range(150))
    assert torch.allclose(blend.logits, model.forward_dense(ids), atol=1e-5)


def test_rerotate_moves_keys_to_another_position(model: HarnessTransformer) -> None:
    # layer 0's K depends only on the token and its position: the same tokens 7 positions later
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(1, CFG.vocab_size, (40,), generator=gen)
    at0 = blended_forward(model, tokens)
    at7 = blended_forward(model, torch.cat((torch.randint(1, CFG.vocab_size, (7,), generator=gen), tokens)))
    moved = rerotate(at0.keys[0], torch.full((40,), 7), model)
    assert torch.allclose(moved, at7.keys[0][7:], atol=1e-4)
    assert not torch.allclose(at0.keys[0], at7.keys[0][7:], atol=1e-2)
    assert torch.allclose(at0.values[0], at7.values[0][7:], atol=1e-5)
    assert torch.allclose(rerotate(moved, torch.full((40,), -7), model), at0.keys[0], atol=1e-4)


def test_own_kv_reuse_is_exact_and_corrupted_kv_is_not(model: HarnessTransformer) -> None:
    ids = torch.randint(1, CFG.vocab_size, (120,), generator=torch.Generator().manual_seed(4))
    exact = blended_forward(model, ids)
    keep = torch.zeros(120, dtype=torch.bool)
    keep[10:90] = True
    same = blended_forward(model, ids, keep, (exact.keys, exact.values))
    assert same.rows.tolist() == list(range(10)) + list(range(90, 120))
    assert torch.allclose(same.logits, exact.logits[same.rows], atol=1e-5)
    noisy_k = [k.clone() for k in exact.keys]
    for k in noisy_k[1:]:
        k[40:50] += 0.5 * torch.randn(k[40:50].shape, generator=torch.Generator().manual_seed(5))
    corrupted = blended_forward(model, ids, keep, (noisy_k, exact.values))
    assert (corrupted.logits[-30:] - exact.logits[-30:]).abs().max() > 1e-3
    # CacheBlend-style selection finds exactly the corrupted positions and recomputing them restores exact
    fixed = blended_forward(model, ids, keep, (noisy_k, exact.values), deviation_fraction=10 / 80)
    assert fixed.recomputed_kept.nonzero().squeeze(1).tolist() == list(range(40, 50))
    assert torch.allclose(fixed.logits[-30:], exact.logits[-30:], atol=1e-5)
    # recomputing the first tokens of the segment instead leaves the corruption in place
    first = torch.zeros(120, dtype=torch.bool)
    first[10:20] = True
    partial = blended_forward(model, ids, keep, (noisy_k, exact.values), recompute=first)
    assert partial.recomputed_kept.nonzero().squeeze(1).tolist() == list(range(10, 20))
    assert (partial.logits[-30:] - exact.logits[-30:]).abs().max() > 1e-3


def test_reuse_plan_stays_inside_the_prompt_before_its_last_token(pairs: dict[str, Pair]) -> None:
    for pair in pairs.values():
        prompt = len(pair.target.pieces) - 16
        plan, source = reuse_plan(pair, prompt, min_run=4)
        assert plan, pair.pair_id
        assert source.startswith("aligned") == (not pair.shared_spans)
        for t0, d0, n in plan:
            assert t0 + n <= prompt - 1 and d0 + n <= len(pair.donor.pieces)
            assert pair.target.pieces[t0:t0 + n] == pair.donor.pieces[d0:d0 + n]


def test_evaluate_pair_control_is_exact_and_moved_kv_changes_the_output(model: HarnessTransformer,
                                                                        pairs: dict[str, Pair]) -> None:
    text = [p for pair in pairs.values() for p in pair.target.pieces + pair.donor.pieces]
    lm = QualityLM(model, WordVocab.build(text, CFG.vocab_size), QUICK_LM, {})
    for name in ("before", "reordered_chunks", "paraphrase"):
        res = evaluate_pair(lm, pairs[name], cont=8, gen=6, min_run=4, fractions=[0.25])
        assert res.reused > 0
        assert abs(res.dlogprob["control"]) < 1e-5 and res.f1["control"] == res.rouge["control"] == 1.0
        assert res.abs_dlogprob["control"] < 1e-5 and abs(res.kl["control"]) < 1e-6
        assert res.kl["reuse"] > 1e-6 and res.abs_dlogprob["reuse"] >= abs(res.dlogprob["reuse"])
        assert res.recompute["control"] == 0.0 and res.recompute["first@0.25"] >= 0.25
        # the document follows another prefix in the target: its donor K/V are not the target's
        assert abs(res.dlogprob["reuse"]) > 1e-4, name
        assert res.dlogprob["reuse"] != res.dlogprob["no_rerotate"], name

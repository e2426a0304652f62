"""The labelled pairs of tools/discovery_pairs.py (counts, labels, determinism) and the precision /
recall scoring of tools/discovery_eval.py (issue 24: discovery evaluated at scale)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from connector.discovery.tokens import align_segments, window_hashes
from tools.discovery_eval import Counts, precision_recall, score, wilson
from tools.discovery_pairs import NEGATIVE_CLASSES, PAIR_CLASSES, POSITIVE_CLASSES, PairSet, build_pairs, \
    namespace_digest


@pytest.fixture(scope="module")
def pairs() -> PairSet:
    return build_pairs()  # the evaluation's default: 8 classes × 125


def test_default_set_has_over_a_thousand_pairs_in_every_class(pairs: PairSet) -> None:
    assert len(pairs.pairs) >= 1000
    assert pairs.counts() == {cls: 125 for cls in PAIR_CLASSES}
    assert len({p.pair_id for p in pairs.pairs}) == len(pairs.pairs)
    assert {p.cls for p in pairs.pairs if p.positive} == set(POSITIVE_CLASSES)
    assert {p.cls for p in pairs.pairs if not p.positive} == set(NEGATIVE_CLASSES)
    assert all(len(p.donor.tokens) >= 128 and len(p.target.tokens) >= 128 for p in pairs.pairs)
    # text is handed out once: no two donors are the same prompt
    assert len({p.donor.tokens for p in pairs.pairs}) == len(pairs.pairs)


def test_shared_spans_are_token_exact_and_where_each_class_puts_them(pairs: PairSet) -> None:
    for p in pairs.pairs:
        for t, d, n in p.shared_spans:
            assert n > 0 and p.target.tokens[t : t + n] == p.donor.tokens[d : d + n], p.pair_id
    for p in pairs.by_class("reordered_chunks"):
        chunks = p.shared_spans[1:]
        assert len(chunks) == 3 and any(t != d for t, d, _ in chunks)  # another order, never the same
    for p in pairs.by_class("tool_schema") + pairs.by_class("restatement"):
        t, d, n = p.shared_spans[-1]
        assert n >= 64 and p.target.tokens[:t] != p.donor.tokens[:d]  # after another prefix: not exact KV
    for p in pairs.by_class("other_instructions"):
        t, d, _ = p.shared_spans[0]
        assert (t == d == 0) == (p.variant == "after")
    for p in pairs.by_class("paraphrase"):
        assert p.donor.tokens != p.target.tokens and not p.shared_spans


def test_negatives_are_what_they_claim(pairs: PairSet) -> None:
    base = namespace_digest()
    for p in pairs.pairs:
        if p.cls in ("other_salt", "other_adapter"):
            assert not p.positive and p.donor_namespace != p.target_namespace
            assert p.target.tokens[:192] == p.donor.tokens[:192]  # same text: only the namespace differs
        else:
            assert p.donor_namespace == p.target_namespace == base
    variants = {p.variant for p in pairs.by_class("near_miss")}
    assert variants == {"shared_header", "shuffled", "dense_edits"}
    for p in pairs.by_class("near_miss"):
        target, donor = np.asarray(p.target.tokens), np.asarray(p.donor.tokens)
        assert align_segments(target, donor, anchor=8, min_tokens=16) == []  # nothing reusable (min segment)
        if p.variant == "dense_edits":
            assert not set(window_hashes(target, 8).tolist()) & set(window_hashes(donor, 8).tolist())
        if p.variant == "shuffled":
            assert sorted(p.target.tokens) == sorted(p.donor.tokens)


def test_pairs_are_deterministic_given_the_seed() -> None:
    a, b, c = build_pairs(12, seed=3), build_pairs(12, seed=3), build_pairs(12, seed=4)
    assert a == b
    assert a != c
    assert [p.target.tokens for p in a.by_class("reordered_chunks")] != \
        [p.target.tokens for p in c.by_class("reordered_chunks")]
    with pytest.raises(ValueError):
        build_pairs(0)
    with pytest.raises(ValueError):
        build_pairs(2, classes=("nope",))


LABELS = [("p1", "paraphrase", True, "d1"), ("p2", "paraphrase", True, "d2"), ("p3", "tool_schema", True, "d3"),
          ("n1", "other_salt", False, "d4"), ("n2", "near_miss", False, "d5")]
ANSWERS = {"p1": "d1", "p2": "d9", "p3": None, "n1": "d4", "n2": None}


def test_score_counts_each_outcome() -> None:
    got = score(LABELS, ANSWERS)
    # p1 right (TP); p2 a wrong donor (FP and FN); p3 unanswered (FN); n1 answered (FP); n2 silent (TN)
    assert (got["all"].tp, got["all"].fp, got["all"].fn, got["all"].tn, got["all"].pairs) == (1, 2, 2, 1, 5)
    assert got["all"].precision == pytest.approx(1 / 3) and got["all"].recall == pytest.approx(1 / 3)
    assert got["all"].answered == 3
    assert (got["paraphrase"].tp, got["paraphrase"].fp, got["paraphrase"].fn) == (1, 1, 1)
    assert (got["other_salt"].fp, got["near_miss"].tn) == (1, 1)
    assert (got["positive"].pairs, got["negative"].pairs) == (3, 2)


def test_score_with_flipped_labels_gives_other_numbers() -> None:
    flipped = [(pid, cls, not positive, donor) for pid, cls, positive, donor in LABELS]
    got = score(flipped, ANSWERS)
    # positives n1 (its donor: TP) and n2 (FN); negatives p1, p2 answered (FP), p3 silent (TN)
    assert (got["all"].tp, got["all"].fp, got["all"].fn, got["all"].tn) == (1, 2, 1, 1)
    assert got["all"].recall == pytest.approx(0.5) != score(LABELS, ANSWERS)["all"].recall


def test_wilson_interval() -> None:
    lo, hi = wilson(8, 10)  # Wilson (1927); e.g. Agresti & Coull (1998), Am. Stat. 52: 119-126
    assert (round(lo, 4), round(hi, 4)) == (0.4902, 0.9433)
    assert wilson(0, 10)[0] == 0.0 and round(wilson(0, 10)[1], 4) == 0.2775
    assert all(math.isnan(x) for x in wilson(0, 0))
    assert math.isnan(Counts().precision) and math.isnan(Counts().recall)


def test_precision_recall_on_a_real_ledger_and_real_providers(tmp_path: Path) -> None:
    """Token providers and the exact path on 3 pairs per class (no embedding model: it is optional)."""
    ps = build_pairs(3, seed=1)
    result = precision_recall(ps, tmp_path, None, None)
    service, raw = result["service"], result["raw"]
    assert set(service) == {"exact", "chunks", "minhash"}
    for name in service:  # another salt or adapter is never answered once the ledger has checked it
        assert service[name]["other_salt"].fp == service[name]["other_adapter"].fp == 0
    assert service["chunks"]["reordered_chunks"].tp == 3
    assert service["exact"]["other_instructions"].tp >= 1  # the ``after`` variant is an exact prefix
    assert service["exact"]["paraphrase"].tp == 0
    assert raw["minhash"]["other_salt"].fp == 3  # the provider alone does not see namespaces

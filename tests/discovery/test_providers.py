"""Each token provider finds its labelled cases of the RFC workload and misses the negative controls
(provider level: no ledger; the service's ledger check is tested in test_service.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from datasketch import MinHash

from connector.discovery.chunks import BlockChunkProvider
from connector.discovery.minhash import MinHashProvider, minhash_values
from connector.discovery.registry import build_providers, resolve_provider
from connector.discovery.settings import DiscoverySettings, load_discovery_settings
from connector.discovery.tokens import align_segments, window_hashes
from connector.discovery.types import Query, readonly_tokens, score_bucket
from connector.settings import ConnectorConfigError, load_connector_settings
from tests.discovery.conftest import MODEL_ID, NS, TPB, record
from tools.workloads import Workload


def indexed(provider, workload: Workload):
    for key in workload.donors:
        provider.index(record(key, workload.prompt(key).tokens))
    provider.flush(True)
    return provider


def found(provider, workload: Workload, target: str, model_id: str = MODEL_ID):
    t = workload.prompt(target)
    return provider.candidates(Query(readonly_tokens(t.tokens), t.text, model_id, NS, TPB), 4)


def labelled(workload: Workload, provider_name: str):
    return [lab for lab in workload.labels if provider_name in lab.expected_providers]


def test_block_chunks_find_relocated_spans_at_their_labelled_positions(workload: Workload) -> None:
    chunks = indexed(BlockChunkProvider(DiscoverySettings()), workload)
    cases = labelled(workload, "chunks")
    assert {lab.scenario for lab in cases} == {"rag_reordered", "agent_tools"}
    for lab in cases:
        matches = found(chunks, workload, lab.target)
        assert matches and matches[0].donor_id == lab.donor, lab.scenario
        best = matches[0]
        assert best.match_type == "semantic_candidate"  # KV at another position is never exact
        for t, d, n in lab.relocated:  # every labelled span is inside one reported segment, same shift
            assert any(s.target_start <= t and t + n <= s.target_start + s.token_count
                       and s.donor_start - s.target_start == d - t for s in best.segments), (lab.scenario, t, d, n)
        assert all(s.relocated for s in best.segments)
        assert best.reusable_token_count == sum(s.token_count for s in best.segments)
        assert best.donor_block_refs and all(r.donor_id == lab.donor for r in best.donor_block_refs)


@pytest.mark.parametrize("scenario", ["unrelated", "other_salt", "system_prompt", "host_offload"])
def test_block_chunks_miss_negative_controls_and_plain_prefixes(workload: Workload, scenario: str) -> None:
    chunks = indexed(BlockChunkProvider(DiscoverySettings()), workload)
    for lab in (lab for lab in workload.labels if lab.scenario == scenario):
        assert found(chunks, workload, lab.target) == []  # same position after the same prefix: exact path's


def test_minhash_finds_partial_overlaps_and_misses_unrelated(workload: Workload) -> None:
    mh = indexed(MinHashProvider(DiscoverySettings()), workload)
    for lab in labelled(workload, "minhash"):
        matches = found(mh, workload, lab.target)
        assert matches and matches[0].donor_id == lab.donor, lab.scenario
        if lab.exact_prefix_tokens >= 16:  # the common prefix is reported as a verified segment
            first = matches[0].segments[0]
            assert (first.target_start, first.donor_start) == (0, 0)
            assert first.token_count >= lab.exact_prefix_tokens
    unrelated = next(lab for lab in workload.labels if lab.scenario == "unrelated")
    assert found(mh, workload, unrelated.target) == []
    assert found(mh, workload, labelled(workload, "minhash")[0].target, model_id="other-model") == []


def test_minhash_forget_and_reindex(workload: Workload) -> None:
    mh = indexed(MinHashProvider(DiscoverySettings()), workload)
    lab = labelled(workload, "minhash")[0]
    mh.forget(lab.donor)
    assert all(m.donor_id != lab.donor for m in found(mh, workload, lab.target))
    mh.index(record(lab.donor, workload.prompt(lab.donor).tokens))
    assert found(mh, workload, lab.target)[0].donor_id == lab.donor


def test_minhash_values_estimate_jaccard() -> None:
    rng = np.random.default_rng(0)
    base = rng.integers(0, 2**32, 4000, dtype=np.uint64).astype(np.uint32)
    a, b = base[:3000], base[1000:]  # |A∩B| = 2000, |A∪B| = 4000: Jaccard 0.5
    perms = np.asarray(MinHash(num_perm=256, scheme="affine32").permutations, dtype=np.uint32)
    ma = MinHash(num_perm=256, hashvalues=minhash_values(a, perms), permutations=perms, scheme="affine32")
    mb = MinHash(num_perm=256, hashvalues=minhash_values(b, perms), permutations=perms, scheme="affine32")
    assert abs(ma.jaccard(mb) - 0.5) < 0.1


def test_align_segments_are_verified_and_non_overlapping() -> None:
    rng = np.random.default_rng(1)
    donor = rng.integers(1, 512, 2000)
    target = np.concatenate([rng.integers(1, 512, 100), donor[500:900], rng.integers(1, 512, 50), donor[:300]])
    assert align_segments(target, donor, anchor=8, min_tokens=16) == [(100, 500, 400), (550, 0, 300)]
    assert align_segments(rng.integers(1, 512, 500), donor, anchor=8, min_tokens=16) == []
    hashes = window_hashes(target, 32)
    assert len(hashes) == len(target) - 31 and hashes[100] == window_hashes(donor, 32)[500]
    assert list(window_hashes(donor[:96], 32, stride=32)) == [window_hashes(donor, 32)[i] for i in (0, 32, 64)]


def test_buckets_and_tokens() -> None:
    assert [score_bucket(x) for x in (0.1, 0.6, 0.75, 0.85, 0.92, 0.99)] == [
        "lt_0.50", "0.50_0.70", "0.70_0.80", "0.80_0.90", "0.90_0.95", "ge_0.95"]
    with pytest.raises(ValueError):
        readonly_tokens([1, -2])
    arr = readonly_tokens([1, 2, 3])
    assert not arr.flags.writeable and readonly_tokens(arr) is arr


def test_registry_and_settings(tmp_path, monkeypatch) -> None:
    assert resolve_provider("chunks") is BlockChunkProvider
    assert resolve_provider("connector.discovery.minhash:MinHashProvider") is MinHashProvider
    for bad in ("nope", "connector.discovery.minhash:Nope", "json:dumps"):
        with pytest.raises(ConnectorConfigError):
            resolve_provider(bad)
    with pytest.raises(ConnectorConfigError):
        build_providers(DiscoverySettings(providers=("chunks", "chunks")), db=None)
    config = tmp_path / "semkv.toml"
    config.write_text('db = "x.db"\n[discovery]\nproviders = ["minhash"]\nlookup_timeout_s = 0.004\n')
    env = {"TRTLLM_SEMKV_CONFIG": str(config), "TRTLLM_SEMKV_DISCOVERY__ALLOW_PROMPT_TEXT": "true",
           "TRTLLM_SEMKV_DISCOVERY__PROVIDERS": "chunks,minhash"}
    s = load_discovery_settings(environ=env)
    assert s.providers == ("chunks", "minhash") and s.lookup_timeout_s == 0.004 and s.allow_prompt_text
    assert load_discovery_settings({"inline": True}, environ={}).inline
    with pytest.raises(ConnectorConfigError, match="lookup_timeout_s"):
        load_discovery_settings({"lookup_timeout_s": 0}, environ={})


def test_connector_settings_carry_the_discovery_table(tmp_path, monkeypatch) -> None:
    """``[discovery]`` of the connector's TOML and ``TRTLLM_SEMKV_DISCOVERY__*`` are the connector
    settings' ``discovery`` field, read the same way as :func:`load_discovery_settings`; off by default."""
    for name in [n for n in os.environ if n.startswith("TRTLLM_SEMKV_")]:
        monkeypatch.delenv(name)
    assert load_connector_settings(environ={}).discovery == DiscoverySettings()
    assert not DiscoverySettings().enabled
    config = tmp_path / "connector.toml"
    config.write_text('db = "x.db"\nmode = "exact_equivalent"\n[discovery]\nenabled = true\n'
                      'providers = ["minhash"]\nlookup_timeout_s = 0.004\n')
    monkeypatch.setenv("TRTLLM_SEMKV_CONFIG", str(config))
    monkeypatch.setenv("TRTLLM_SEMKV_DISCOVERY__PROVIDERS", "chunks, minhash")
    monkeypatch.setenv("TRTLLM_SEMKV_DISCOVERY__ALLOWED_MODELS", '["m1", "m2"]')
    s = load_connector_settings()
    assert s.discovery == load_discovery_settings()
    assert s.discovery.enabled and s.discovery.providers == ("chunks", "minhash")
    assert s.discovery.lookup_timeout_s == 0.004 and s.discovery.allowed_models == ("m1", "m2")
    monkeypatch.delenv("TRTLLM_SEMKV_CONFIG")
    for values, named in (({"lookup_timeout_s": 0}, "discovery.lookup_timeout_s"),
                          ({"no_such_knob": 1}, "discovery.no_such_knob")):
        with pytest.raises(ConnectorConfigError, match=f"setting '{named}'"):
            load_connector_settings({"discovery": values}, environ={})

"""REFERENCE ENGINE HARNESS tests: the paged transformer against its dense single-pass forward.

Tolerance: paged chunked prefill and the dense forward run different kernels on different shapes, so
they agree to fp32 rounding, not bit for bit: ``atol = rtol = 1e-4`` on logits of magnitude ~5.
"""

from __future__ import annotations

import pytest
import torch

from connector.harness.model import HarnessTransformer, ModelConfig, PagedChunk

CFG = ModelConfig(vocab_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=64, tokens_per_block=8, max_context=512)
ATOL = RTOL = 1e-4


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _pool(num_blocks: int) -> torch.Tensor:
    return torch.zeros(num_blocks, CFG.num_layers, 2, CFG.num_kv_heads * CFG.head_dim * CFG.tokens_per_block)


@pytest.fixture(scope="module")
def model() -> HarnessTransformer:
    return HarnessTransformer(CFG)


@pytest.mark.parametrize("chunk", [8, 24, 200])
def test_paged_chunked_prefill_matches_dense(model: HarnessTransformer, chunk: int) -> None:
    tokens = _prompt(200)
    pool = _pool(40)
    table = list(range(39, 14, -1))  # scattered, descending block ids
    pieces = [model.forward_paged(tokens[s : s + chunk], s, table, pool)
              for s in range(0, len(tokens), chunk)]
    torch.testing.assert_close(torch.cat(pieces), model.forward_dense(tokens), atol=ATOL, rtol=RTOL)


def test_greedy_decode_through_the_pool_matches_dense(model: HarnessTransformer) -> None:
    tokens, pool, table = _prompt(37, seed=3), _pool(16), list(range(16))
    logits = model.forward_paged(tokens, 0, table, pool)
    generated = []
    for _ in range(5):
        generated.append(int(logits[-1].argmax()))
        position = len(tokens) + len(generated) - 1
        logits = model.forward_paged([generated[-1]], position, table, pool)
    dense = model.forward_dense(tokens + generated)
    assert [int(x) for x in dense[len(tokens) - 1 : -1].argmax(-1)] == generated
    torch.testing.assert_close(logits[-1], dense[-1], atol=ATOL, rtol=RTOL)


def test_same_chunk_over_same_kv_is_bit_identical_whatever_the_block_ids(model: HarnessTransformer) -> None:
    tokens = _prompt(64, seed=5)
    pool_a, pool_b = _pool(8), _pool(8)
    model.forward_paged(tokens[:48], 0, list(range(8)), pool_a)
    model.forward_paged(tokens[:48], 0, [7, 6, 5, 4, 3, 2, 1, 0], pool_b)
    out_a = model.forward_paged(tokens[48:], 48, list(range(8)), pool_a)
    out_b = model.forward_paged(tokens[48:], 48, [7, 6, 5, 4, 3, 2, 1, 0], pool_b)
    assert torch.equal(out_a, out_b)


class _LayerLog:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def before_layer(self, layer_idx: int) -> None:
        self.calls.append(("before_layer", layer_idx))

    def before_attention_read(self, layer_idx: int) -> None:
        self.calls.append(("before_attention_read", layer_idx))

    def after_layer(self, layer_idx: int) -> None:
        self.calls.append(("after_layer", layer_idx))


def test_batched_forward_is_bit_identical_to_one_request_at_a_time(model: HarnessTransformer) -> None:
    """Three requests at different phases (first chunk, later chunk, decode step) in one batch
    give each the bits a single-request forward gives, in KV and logits; hooks run once per layer."""
    a, b, c = _prompt(40, seed=6), _prompt(70, seed=7), _prompt(30, seed=8)
    tables = {"a": [0, 1, 2, 3, 4], "b": [9, 8, 7, 6, 5, 10, 11, 12, 13], "c": [14, 15, 16, 17]}
    solo, batched = _pool(18), _pool(18)
    for pool in (solo, batched):  # shared history: b's first chunk and c's prompt are in the cache
        model.forward_paged(b[:32], 0, tables["b"], pool)
        model.forward_paged(c, 0, tables["c"], pool)
    chunks = [PagedChunk(a[:24], 0, tables["a"]), PagedChunk(b[32:64], 32, tables["b"]),
              PagedChunk([c[-1]], 30, tables["c"])]
    expected = [model.forward_paged(ch.token_ids, ch.start, ch.block_table, solo) for ch in chunks]
    log = _LayerLog()
    got = model.forward_paged_batch(chunks, batched, log)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    assert torch.equal(solo, batched)
    per_layer = [("before_layer", 0), ("before_attention_read", 0), ("after_layer", 0)]
    assert log.calls == per_layer + [(name, 1) for name, _ in per_layer]


def test_weights_are_seeded_and_deterministic() -> None:
    a, b = HarnessTransformer(CFG), HarnessTransformer(CFG)
    c = HarnessTransformer(ModelConfig(**{**CFG.__dict__, "seed": 1}))
    for (name, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(),
                                            c.named_parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert a.cfg.name != c.cfg.name


def test_gelu_variant_and_errors() -> None:
    gelu = HarnessTransformer(ModelConfig(**{**CFG.__dict__, "mlp": "gelu"}))
    tokens = _prompt(20)
    pieces = [gelu.forward_paged(tokens[:16], 0, [0, 1, 2], _pool(3))]
    assert pieces[0].shape == (16, CFG.vocab_size)
    with pytest.raises(ValueError, match="block table"):
        gelu.forward_paged(tokens, 0, [0], _pool(3))
    with pytest.raises(ValueError, match="max_context"):
        gelu.forward_dense(_prompt(600))
    with pytest.raises(ValueError):
        ModelConfig(num_heads=3, num_kv_heads=2)

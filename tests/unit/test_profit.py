"""The profitability gate's cost model (connector/profit.py): what it learns from forwards and loads,
and when it declines."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.profit import ReuseCostModel, context_bucket, cost_model_for, forget_cost_models


def taught(*, prefill_per_token: float = 1e-4, load_per_token: float = 1e-6, load_fixed: float = 0.0,
           **kw: float | int) -> ReuseCostModel:
    """A model taught 8 forwards of 512 tokens at ``prefill_per_token`` in 4K-token prompts, and loads
    of 256 and 1024 tokens costing ``load_fixed + load_per_token × tokens``."""
    model = ReuseCostModel(**{"explore_every": 0, **kw})
    for _ in range(8):
        model.observe_prefill(512, 4096, 512 * prefill_per_token)
    for tokens in (256, 1024, 256, 1024):
        model.observe_load("local_file", tokens, load_fixed + load_per_token * tokens)
    return model


def test_context_buckets_are_powers_of_two_with_a_floor() -> None:
    assert context_bucket(1) == context_bucket(128) == 7
    assert context_bucket(129) == context_bucket(256) == 8
    assert context_bucket(32_768) == 15


def test_until_taught_it_cannot_judge_and_lets_the_load_through() -> None:
    model = ReuseCostModel(min_prefill_samples=2)
    first = model.forecast(512, 4096, "local_file")
    assert first.pays and first.basis == "no_prefill_samples" and math.isnan(first.saved_s)
    model.observe_prefill(512, 4096, 0.05)
    model.observe_prefill(512, 4096, 0.05)
    second = model.forecast(512, 4096, "local_file")
    assert second.pays and second.basis == "no_load_samples" and second.saved_s == pytest.approx(0.05)


def test_a_load_faster_than_the_prefill_it_saves_pays() -> None:
    forecast = taught().forecast(1024, 4096, "local_file")
    assert forecast.pays and forecast.basis == "measured"
    assert forecast.saved_s == pytest.approx(1024 * 1e-4)
    assert forecast.load_s == pytest.approx(1024 * 1e-6, rel=1e-6)


def test_a_load_slower_than_the_prefill_is_declined_and_kept_for_diagnosis() -> None:
    model = taught(load_fixed=0.5)  # a fixed half second per load beats any short prefill
    forecast = model.forecast(256, 4096, "local_file")
    assert not forecast.pays and forecast.basis == "measured"
    assert forecast.load_s == pytest.approx(0.5 + 256e-6, rel=1e-6)
    assert list(model.declined) == [forecast]
    assert "256 tokens from local_file" in forecast.describe()


def test_the_load_fit_separates_a_fixed_cost_from_a_per_token_cost() -> None:
    model = taught(load_fixed=0.002, load_per_token=3e-6)
    assert model.load_seconds("local_file", 0) == pytest.approx(0.002, rel=1e-6)
    assert model.load_seconds("local_file", 10_000) == pytest.approx(0.002 + 0.03, rel=1e-6)


def test_one_load_size_only_gives_seconds_per_token() -> None:
    model = ReuseCostModel()
    model.observe_load("local_file", 512, 0.01)
    assert model.load_seconds("local_file", 1024) == pytest.approx(0.02)


def test_levels_are_learnt_apart() -> None:
    model = taught()
    assert math.isnan(model.load_seconds("redis", 512))
    assert model.forecast(512, 4096, "redis").basis == "no_load_samples"


def test_margin_demands_more_than_break_even() -> None:
    # saving 0.1 s against a 0.09 s load: pays at margin 1.0, not at 1.2
    for margin, pays in ((1.0, True), (1.2, False)):
        model = taught(prefill_per_token=1e-4, load_per_token=9e-5, margin=margin)
        assert model.forecast(1000, 4096, "local_file").pays is pays


def test_prefill_cost_is_read_from_the_nearest_context_bucket() -> None:
    model = ReuseCostModel(min_prefill_samples=1)
    model.observe_prefill(100, 1024, 100 * 1e-5)
    model.observe_prefill(100, 32_768, 100 * 1e-4)
    assert model.prefill_seconds(10, 1000) == pytest.approx(1e-4)
    assert model.prefill_seconds(10, 30_000) == pytest.approx(1e-3)
    assert model.prefill_seconds(10, 16_000) == pytest.approx(1e-3)  # 14 is nearer 15 than 10


def test_one_declined_candidate_in_explore_every_goes_through() -> None:
    model = taught(load_fixed=0.5, explore_every=3)
    verdicts = [model.forecast(256, 4096, "local_file") for _ in range(6)]
    assert [v.pays for v in verdicts] == [False, False, True, False, False, True]
    assert [v.basis for v in verdicts if v.pays] == ["explore", "explore"]
    assert len(model.declined) == 4


def test_declines_kept_are_bounded() -> None:
    model = taught(load_fixed=0.5, declined_kept=5)
    for _ in range(50):
        model.forecast(256, 4096, "local_file")
    assert len(model.declined) == 5


def test_nonsense_samples_are_ignored() -> None:
    model = ReuseCostModel(min_prefill_samples=1)
    for tokens, seconds in ((0, 1.0), (10, 0.0), (10, -1.0), (10, math.inf), (10, math.nan)):
        model.observe_prefill(tokens, 1024, seconds)
        model.observe_load("local_file", tokens, seconds)
    assert math.isnan(model.prefill_seconds(10, 1024)) and math.isnan(model.load_seconds("local_file", 10))


def test_one_model_per_pool_in_a_process() -> None:
    forget_cost_models()
    assert cost_model_for("engine-a\x00/store") is cost_model_for("engine-a\x00/store", margin=3.0)
    assert cost_model_for("engine-b\x00/store") is not cost_model_for("engine-a\x00/store")
    forget_cost_models()


@settings(max_examples=200, deadline=None)
@given(prefill=st.floats(1e-7, 1e-2), load=st.floats(1e-8, 1e-2), fixed=st.floats(0, 0.1),
       tokens=st.integers(1, 100_000), margin=st.floats(1.0, 10.0))
def test_the_verdict_is_saving_against_margin_times_cost(prefill: float, load: float, fixed: float, tokens: int,
                                                         margin: float) -> None:
    model = taught(prefill_per_token=prefill, load_per_token=load, load_fixed=fixed, margin=margin)
    forecast = model.forecast(tokens, 4096, "local_file")
    assert forecast.pays is (forecast.saved_s >= margin * forecast.load_s)
    assert forecast.saved_s == pytest.approx(prefill * tokens, rel=1e-9)

"""tools/reuse_trials.py, the DESIGN §10 TTFT trials of tools/bench_discovery.py: its statistics, and one
short run on real harness engines (the three modes really differ the way the report says)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from tools.bench_discovery import make_donors, make_service
from tools.discovery_report import slower_scenarios, trials_report, verdict
from tools.reuse_trials import MODES, median_interval, run_trials
from tools.workloads import build_workload


def test_the_median_interval_is_order_statistics_around_the_median() -> None:
    values = list(range(1, 31))  # n = 30: ranks floor(15 - 5.37) = 9 and ceil(16 + 5.37) = 22
    assert median_interval(values) == (15.5, 9.0, 22.0)
    assert median_interval([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)  # small n: the whole range
    assert all(math.isnan(x) for x in median_interval([]))


def test_the_interval_covers_the_true_median_about_95_percent_of_the_time() -> None:
    rng = np.random.default_rng(0)
    hits = sum(lo <= 0.0 <= hi for _, lo, hi in (median_interval(rng.standard_normal(30).tolist())
                                                for _ in range(2000)))
    assert 0.93 <= hits / 2000 <= 0.995


def test_verdicts_need_the_intervals_apart() -> None:
    assert verdict((10, 9, 11), (5, 4, 6)) == "faster"
    assert verdict((10, 9, 11), (15, 12, 18)) == "**slower**"
    assert verdict((10, 9, 11), (10.5, 8, 13)) == "no difference"


@pytest.fixture(scope="module")
def trials(tmp_path_factory: pytest.TempPathFactory) -> dict:
    w = build_workload(256, scenarios=("system_prompt", "unrelated", "other_salt", "high_load"), load=2)
    root = Path(tmp_path_factory.mktemp("trials"))

    def donors(fleet, service, text_of, cfg) -> None:  # noqa: ANN001
        make_donors(w, fleet, service, text_of, cfg)

    return run_trials(w, 3, root, lambda db: make_service(db, None), donors)


def test_every_mode_runs_every_target_every_repetition(trials: dict) -> None:
    assert set(trials["ttft"]) == {"system_prompt", "unrelated", "other_salt", "high_load"}
    for scenario, by_mode in trials["ttft"].items():
        runs = 3 * (2 if scenario == "high_load" else 1)
        assert {mode: len(values) for mode, values in by_mode.items()} == {mode: runs for mode in MODES}
        assert all(seconds > 0 for values in by_mode.values() for seconds in values)
    assert len(trials["burst"]["cold"]) == len(trials["burst"]["exact_equivalent"]) == 3
    assert trials["burst_requests"] == 2


def test_only_the_warm_engine_loads_and_never_a_negative_control(trials: dict) -> None:
    assert sum(trials["loaded"]["system_prompt"]) > 0  # the first load at least: the gate cannot judge it yet
    assert sum(trials["loaded"]["unrelated"]) == sum(trials["loaded"]["other_salt"]) == 0
    assert trials["materialized"] >= 1 and trials["materialized_tokens"] >= 32


def test_the_report_has_the_design_section_10_table(trials: dict) -> None:
    runs = {"discovery_only": {"discovery_hits": 1, "semantic": 0, "n": 4}, "exact_equivalent": {}}
    text = trials_report(256, trials, runs, {})
    for item in ("cold TTFT", "exact warm TTFT", "discovery-only hit rate", "semantic placement rate",
                 "backend-confirmed materialized reuse", "backend-declined reuse", "materialized token count",
                 "lookup latency", "load latency", "route overhead", "quality", "requests/s"):
        assert item in text, item
    assert isinstance(slower_scenarios(trials), list)

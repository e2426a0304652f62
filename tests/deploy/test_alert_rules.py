"""The alerts name the engine they are about (issue 19, item 3).

* A real ``semkv-ledger consume`` (its own process, real ZMQ on 127.0.0.1, a SQLite ledger) with two
  engines, one of which loses batches beyond its replay buffer: its ``/metrics`` counts the gap and
  the generation bump under THAT engine's ``engine_id`` and the reason, and its
  ``ledger.continuity_lost`` log line names the engine, the source and the reason.
* ``promtool check rules`` accepts deploy/prometheus/semkv-alerts.yml, and ``promtool test rules``
  runs tests/deploy/promtool/semkv-alerts.test.yml: for every alert, series of two engines (or two
  scraped processes) of which one fires, with its name in the labels and the rendered annotations.
  promtool is Debian's ``prometheus`` package (.ci/run installs it); missing, these tests fail in CI
  and skip elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ledger.types import GenerationReason
from tests.deploy.test_dashboards import ALERTS, alert_exprs, exported, metric_references
from tests.integration.consumer.daemon_support import REPO, FaultPublisher, PayloadMaker, migrated_db

PROMTOOL_TESTS = REPO / "tests" / "deploy" / "promtool" / "semkv-alerts.test.yml"
CACHED_PROMTOOL = (Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                   / "semkv-ledger" / "promtool" / "usr" / "bin" / "promtool")
"""Where .ci/run unpacks Debian's promtool when it cannot install the package."""
GAP, BUMP = "semkv_consumer_gaps_total", "semkv_consumer_generation_bumps_total"
REASONS = {reason.value for reason in GenerationReason}


def promtool() -> str:
    """The promtool to run: ``SEMKV_PROMTOOL``, else on PATH, else .ci/run's unpacked copy."""
    found = os.environ.get("SEMKV_PROMTOOL") or shutil.which("promtool")
    if found is None and CACHED_PROMTOOL.is_file():
        found = str(CACHED_PROMTOOL)
    if found is None:
        why = "promtool not found (Debian: apt-get install prometheus; .ci/run installs it)"
        if os.environ.get("CI"):
            pytest.fail(f"{why}: required in CI")
        pytest.skip(why)
    return found


def run_promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120, cwd=REPO)


# --------------------------------------------------------------------------------------------
# promtool
# --------------------------------------------------------------------------------------------


def test_promtool_check_rules_accepts_the_alert_rules():
    done = run_promtool("check", "rules", str(ALERTS))
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_unit_tests_fire_every_alert_for_its_engine():
    done = run_promtool("test", "rules", str(PROMTOOL_TESTS))
    assert done.returncode == 0, done.stdout + done.stderr


def rule_names_and_scopes() -> dict[str, str]:
    """{alert: the label it names} — engine_id when its expression keeps that label, else instance."""
    yaml = pytest.importorskip("yaml")
    rules = [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]
    return {rule["alert"]: "engine_id" if re.search(r"by \([^)]*\bengine_id\b", rule["expr"]) else "instance"
            for rule in rules}


def test_every_alert_has_a_promtool_case_where_one_of_two_engines_fires_named():
    """The promtool file covers every alert, each with series of at least two engines (or scraped
    processes) of which only some fire, and each expected alert names its own in its summary (the
    rendered text, checked by promtool) and not another's."""
    yaml = pytest.importorskip("yaml")
    scopes = rule_names_and_scopes()
    tested: dict[str, int] = {}
    for group in yaml.safe_load(PROMTOOL_TESTS.read_text())["tests"]:
        series = [s["series"] for s in group["input_series"]]
        for case in group["alert_rule_test"]:
            name, expected = case["alertname"], case["exp_alerts"]
            if not expected:
                continue
            scope = scopes[name]
            fed = set(re.findall(rf'{scope}="([^"]+)"', " ".join(series)))
            fired = {alert["exp_labels"][scope] for alert in expected}
            assert len(fed) >= 2 and fired < fed, f"{name}: fed {fed}, fired {fired}"
            for alert in expected:
                text = " ".join(alert["exp_annotations"].values())
                assert alert["exp_labels"][scope] in alert["exp_annotations"]["summary"], name
                assert not [other for other in fed - fired if other in text], f"{name} names another {scope}"
            tested[name] = tested.get(name, 0) + 1
    assert set(tested) == set(scopes), set(scopes) - set(tested)


def test_alerts_on_per_engine_metrics_keep_and_name_the_engine():
    """An alert over a consumer metric labelled engine_id aggregates by it and names it."""
    names = exported()
    yaml = pytest.importorskip("yaml")
    rules = [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]
    assert len(rules) == len(alert_exprs())
    for rule in rules:
        metrics = [name for name, _ in metric_references(rule["expr"])]
        if any("engine_id" in names[m] for m in metrics):
            assert re.search(r"by \([^)]*\bengine_id\b", rule["expr"]), rule["alert"]
            assert "{{ $labels.engine_id }}" in rule["annotations"]["summary"], rule["alert"]
        if any("reason" in names[m] for m in metrics) and "reason" not in rule["expr"]:
            assert rule["alert"] == "SemkvQuarantineStorm", rule["alert"]  # its description lists them


# --------------------------------------------------------------------------------------------
# a real consumer: a gap on one of two engines
# --------------------------------------------------------------------------------------------


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels): value} of the daemon's /metrics."""
    body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


def samples(scraped: dict, name: str) -> dict[frozenset, float]:
    return {labels: value for (sample, labels), value in scraped.items() if sample == name}


def value(scraped: dict, name: str, **labels: str) -> float | None:
    return scraped.get((name, frozenset(labels.items())))


def log_lines(path: Path) -> list[dict]:
    """The JSON lines the daemon finished writing (a line still being written has no newline yet)."""
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line.startswith("{")]


def wait_for(predicate: Callable[[], bool], proc: subprocess.Popen, what: str, timeout_s: float = 60.0) -> None:
    """Poll a condition (not a delay) while the daemon runs; AssertionError at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert proc.poll() is None, f"the daemon exited with {proc.returncode} waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def config_for(db: str, publishers: dict[str, FaultPublisher]) -> str:
    sources = "".join(f'\n[[sources]]\nengine_id = "{engine}"\nsource_id = "{engine}-src"\n'
                      f'endpoint = "{pub.endpoint}"\nreplay_endpoint = "{pub.replay_endpoint}"\n'
                      for engine, pub in publishers.items())
    return (f'db = "{db}"\nmetrics_port = 0\nreplay_timeout_s = 1.0\nidle_replay_s = 0\n'
            f'batch_max_delay_ms = 2\n{sources}')


def test_a_gap_on_one_of_two_engines_is_counted_and_logged_for_that_engine(tmp_path):
    db, _ = migrated_db(tmp_path)
    log = tmp_path / "consume.log"
    make_a, make_b = PayloadMaker(run=0), PayloadMaker(run=1)
    with FaultPublisher() as a, FaultPublisher(buffer_steps=5) as b, log.open("wb") as out:
        config = tmp_path / "semkv.toml"
        config.write_text(config_for(db, {"trt-a": a, "trt-b": b}))
        proc = subprocess.Popen([sys.executable, "-m", "ledger", "consume", "--config", str(config)],
                                stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        try:
            a.wait_for_subscriber(30)
            b.wait_for_subscriber(30)
            wait_for(lambda: any(line["event"] == "daemon.started" for line in log_lines(log)), proc, "start")
            port = next(line["metrics_port"] for line in log_lines(log) if line["event"] == "daemon.started")
            for seq in range(30):
                a.publish(seq, make_a(seq))
            for seq in range(20):
                b.publish(seq, make_b(seq))
            committed = "semkv_consumer_batches_committed_total"
            wait_for(lambda: value(scrape(port), committed) == 50, proc, "50 batches")
            for seq in range(20, 30):
                b.publish(seq, make_b(seq), send=False)  # lost on the wire; b's buffer keeps only 5
            b.publish(30, make_b(30))  # replay brings 26..30: 20..25 are lost
            wait_for(lambda: value(scrape(port), committed) == 55, proc, "b's 26..30")
            scraped = scrape(port)
        finally:
            proc.terminate()
            assert proc.wait(30) == 0
    gaps, bumps = samples(scraped, GAP), samples(scraped, BUMP)
    for series in (gaps, bumps):
        assert {frozenset(dict(labels)) for labels in series} == {frozenset({"engine_id", "reason"})}
        assert {dict(labels)["reason"] for labels in series} == REASONS  # every reason at 0 from the start
        assert {dict(labels)["engine_id"] for labels in series} == {"trt-a", "trt-b"}
        lost = {labels: count for labels, count in series.items() if count}
        assert lost == {frozenset({"engine_id": "trt-b", "reason": "seq_gap"}.items()): 1.0}

    lines = log_lines(log)
    lost_lines = [line for line in lines if line["event"] == "ledger.continuity_lost"]
    assert [{k: line[k] for k in ("engine_id", "source_id", "reason", "gaps", "generation_bumps", "generation",
                                  "expected_got")} for line in lost_lines] == [
        {"engine_id": "trt-b", "source_id": "trt-b-src", "reason": "seq_gap", "gaps": 1, "generation_bumps": 1,
         "generation": 2, "expected_got": [[20, 26]]}]
    unrecovered = [line for line in lines if line["event"] == "source.gap_unrecovered"]
    assert [(line["engine_id"], line["source_id"], line["reason"]) for line in unrecovered] == [
        ("trt-b", "trt-b-src", "seq_gap")]

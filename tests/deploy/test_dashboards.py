"""deploy/grafana/semkv-dashboard.json and deploy/prometheus/semkv-alerts.yml name only metrics the code
exports: the names are collected from the real registries (``ConsumerMetrics``, ``ConnectorMetrics``,
``RouteMetrics``) with the suffixes Prometheus exposes (``_total`` for counters;
``_bucket``/``_count``/``_sum`` for histograms), and the labels used in selectors exist on those
metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.metrics import MetricWrapperBase

from connector.discovery.telemetry import DiscoveryMetrics
from connector.metrics import ConnectorMetrics
from connector.placement.http import PlacementMetrics
from connector.placement.route_join import RouteMetrics
from consumer.metrics import ConsumerMetrics

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "semkv-dashboard.json"
ALERTS = REPO / "deploy" / "prometheus" / "semkv-alerts.yml"

_FUNCTIONS = {"sum", "min", "max", "avg", "count", "rate", "irate", "increase", "histogram_quantile", "absent",
              "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
              "label_values", "clamp_min", "clamp_max", "topk", "bottomk", "offset"}
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",),
             "summary": ("_count", "_sum", "")}


def exported() -> dict[str, set[str]]:
    """{exposed sample name: label names} of every metric the consumer, the connector (its discovery's
    on the same /metrics), the route join and the placement service register."""
    names: dict[str, set[str]] = {}
    for metrics in (ConsumerMetrics(), ConnectorMetrics(), DiscoveryMetrics(), RouteMetrics(), PlacementMetrics()):
        for metric in vars(metrics).values():
            if not isinstance(metric, MetricWrapperBase):
                continue
            labels = set(metric._labelnames)  # noqa: SLF001 - public in spirit: the metric's declared labels
            if metric._type == "histogram":  # noqa: SLF001
                labels.add("le")
            for suffix in _SUFFIXES[metric._type]:  # noqa: SLF001
                names[metric._name + suffix] = labels  # noqa: SLF001
    # the real registries agree (a metric not held in an attribute would be missed above)
    for metrics in (ConsumerMetrics(), ConnectorMetrics(), DiscoveryMetrics(), RouteMetrics(), PlacementMetrics()):
        for family in metrics.registry.collect():
            assert any(n == family.name or n.startswith(family.name + "_") for n in names), family.name
    return names


def metric_references(expr: str) -> list[tuple[str, set[str]]]:
    """(metric name, labels in its selector) for every metric in a PromQL expression."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)  # grouping labels
    found = []
    for match in re.finditer(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{[^}]*\})?", expr):
        name, selector = match.group(1), match.group(2) or ""
        if name in _FUNCTIONS or re.fullmatch(r"[0-9.e]+", name):
            continue
        end = match.end(1)
        if expr[end:].lstrip().startswith("("):  # a function call
            continue
        labels = set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", selector))
        found.append((name, labels))
    return found


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs() -> list[str]:
    exprs = [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"].removeprefix("label_values(").rstrip(")").split(",")[0]
              for v in dashboard()["templating"]["list"] if v["type"] == "query"]
    return exprs


def alert_exprs() -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"^\s+expr:\s*(.+)$", ALERTS.read_text(), re.MULTILINE)]


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_referenced_metric_is_exported_with_its_labels(source: str) -> None:
    names = exported()
    exprs = dashboard_exprs() if source == "dashboard" else alert_exprs()
    assert exprs
    for expr in exprs:
        for name, labels in metric_references(expr):
            assert name in names, f"{name} (in {expr!r}) is not exported by the code"
            assert labels <= names[name], f"{name} has no label {labels - names[name]} (in {expr!r})"


def test_cross_check_catches_a_wrong_name() -> None:
    names = exported()
    assert "semkv_consumer_gaps_total" in names and "semkv_lookup_seconds_bucket" in names
    assert [n for n, _ in metric_references('sum(rate(semkv_consumer_gap_total{engine_id="x"}[5m]))')
            if n not in names] == ["semkv_consumer_gap_total"]
    assert metric_references("histogram_quantile(0.99, sum by (le) (rate(semkv_lookup_seconds_bucket[5m])))") == [
        ("semkv_lookup_seconds_bucket", set())]


def test_dashboard_loads_and_covers_design_section_8() -> None:
    dash = dashboard()
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] == "semkv-ledger"
    variables = {v["name"] for v in dash["templating"]["list"]}
    for panel in panels:
        assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert set(re.findall(r"\$(\w+)", target["expr"])) - {"__rate_interval"} <= variables
    cells = {(p["gridPos"]["x"] + dx, p["gridPos"]["y"] + dy) for p in dash["panels"]
             for dx in range(p["gridPos"]["w"]) for dy in range(p["gridPos"]["h"])}
    assert len(cells) == sum(p["gridPos"]["w"] * p["gridPos"]["h"] for p in dash["panels"]), "panels overlap"
    referenced = {n for e in dashboard_exprs() for n, _ in metric_references(e)}
    design = {  # DESIGN §8 / issue 8: ingest, lag, gaps, generations, lookups, materialized vs declined, leases
        "semkv_consumer_events_received_total", "semkv_consumer_lag_last_seconds", "semkv_consumer_lag_seconds_bucket",
        "semkv_consumer_gaps_total", "semkv_consumer_seq_gaps_total", "semkv_consumer_generation_bumps_total",
        "semkv_consumer_dead_letters_total", "semkv_consumer_replays_total", "semkv_lookups_total",
        "semkv_lookup_seconds_bucket", "semkv_exact_materialized_total", "semkv_materialized_tokens_total",
        "semkv_backend_declined_total", "semkv_stale_donor_total", "semkv_namespace_mismatch_total",
        "semkv_provider_timeout_total", "semkv_load_failures_total", "semkv_leases_held",
        "semkv_discovery_only_hits_total", "semkv_experimental_materialized_total", "semkv_semantic_lookups_total",
        "semkv_consumer_curve_refused_total"}
    assert design <= referenced, design - referenced


def test_alert_rules_are_valid_prometheus_rule_groups() -> None:
    yaml = pytest.importorskip("yaml", reason="PyYAML is not a dependency; the metric cross-check above needs none")
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    names = [rule["alert"] for group in groups for rule in group["rules"]]
    assert len(names) == len(set(names))
    for group in groups:
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
            assert rule["labels"]["severity"] in {"warning", "critical"} and rule["annotations"]["summary"]
            assert re.fullmatch(r"\d+[smh]", rule.get("for", "0s"))
    covered = " ".join(alert_exprs())
    for metric in ("semkv_consumer_gaps_total", "semkv_consumer_generation_bumps_total",
                   "semkv_consumer_dead_letters_total", "semkv_consumer_lag_last_seconds"):
        assert metric in covered  # issue 8: gaps, quarantine storms, dead letters, lag
    assert len(alert_exprs()) == len(names)


def test_consumer_panels_filter_and_legend_by_engine() -> None:
    """Every dashboard query of a consumer metric labelled engine_id filters by the dashboard's
    ``engine_id`` variable, keeps the label and names the engine in its legend (docs/deploy.md)."""
    names = exported()
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert "engine_id" in variables and "engine_id" in variables["engine_id"]["definition"]
    checked = 0
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            per_engine = [n for n, _ in metric_references(expr)
                          if n.startswith("semkv_consumer_") and "engine_id" in names[n]]
            if not per_engine:
                continue
            checked += 1
            for name in per_engine:
                assert re.search(re.escape(name) + r'\{[^}]*engine_id=~"\$engine_id"', expr), (panel["title"], expr)
            for _, grouping in re.findall(r"\b(sum|max|min|avg|count)\s*(?:by\s*\(([^)]*)\))?\s*\(", expr):
                assert "engine_id" in grouping, (panel["title"], expr)  # a plain sum(...) drops the engine
            assert "{{engine_id}}" in target["legendFormat"], (panel["title"], target["legendFormat"])
    assert checked >= 10

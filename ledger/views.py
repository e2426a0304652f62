"""Rich tables for ``semkv-ledger stats`` (and the demo, which prints the same)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def print_stats(console: Console, data: dict[str, Any]) -> None:
    """Render :func:`ledger.stats.ledger_stats` output as tables."""
    engines = Table(title="engines")
    for column in ("engine", "generation", "status", "events by type", "gaps", "generation bumps", "dead letters"):
        engines.add_column(column)
    for engine in data["engines"]:
        counters = engine["counters"]
        engines.add_row(
            engine["engine_id"], str(engine["generation"]), engine["status"],
            ", ".join(f"{k}={v}" for k, v in sorted(engine["events_by_type"].items())),
            _prefixed(counters, "gaps."), _prefixed(counters, "generation_bumps."), _prefixed(counters, "dead_letters."))
    console.print(engines)
    summary = Table(title="ledger")
    summary.add_column("what")
    summary.add_column("count", justify="right")
    summary.add_row("engine events logged", str(data["events_total"]))
    summary.add_row("log rows (events and decisions)", str(data["log_rows"]))
    summary.add_row("dead letters", str(data["dead_letters"]))
    for title in ("blocks_by_state", "donors_by_state", "leases_by_state"):
        for state, count in sorted(data[title].items()):
            summary.add_row(f"{title.split('_')[0]} {state}", str(count))
    console.print(summary)


def _prefixed(counters: dict[str, int], prefix: str) -> str:
    parts = [f"{k.removeprefix(prefix)}={v}" for k, v in sorted(counters.items()) if k.startswith(prefix)]
    return ", ".join(parts) or "0"

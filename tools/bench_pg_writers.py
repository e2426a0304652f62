"""Several consumers writing one PostgreSQL fleet ledger: each commit's wait for the log lock, and a
simulation, fed with what is measured here, of where that design stops on the way to 1,000 engines
(issue 23).

Measured: 1, 2 and 4 writer processes, each the product's :class:`ledger.writer.LedgerWriter` (asyncpg)
for an engine of its own, start together on one scratch ledger and append ``--txns`` transactions of
``--events`` engine events (4 blocks each, store/evict alternating, as tools/bench_ledger.py). Per
commit: the wait for the log lock (``AppendResult.log_lock_wait_s``, the recorder's ``LOCK TABLE log``)
and the rest of the transaction (its service time: everything it does holding the lock, commit
included). Also the PostgreSQL server's CPU per block event (every ``postgres`` process's CPU from
/proc, the postmaster's reaped children included: the server runs on this machine) and the writers'
own CPU per block event.

Simulated (SimPy): a fleet of M engines, each emitting ``--engine-rate`` block events/s in engine
batches (Poisson arrivals), read by M / ``--engines-per-consumer`` consumers. A consumer commits
what has queued for it (at most ``--max-batch`` engine events per transaction, like the daemon's
``batch_max_events``); a commit costs the measured service time ``a + b × events`` (fitted on
1-writer runs at three batch sizes). Two designs:

* ``table lock`` (today): every commit holds the one log lock for its whole service time;
* ``per-stream order`` (the issue's proposal: no global gapless sequence, readers follow a
  watermark): commits only share the server's CPU — ``--server-cores`` cores, each commit holding
  one for its measured server-CPU share — and a consumer's own client work runs on its own host.

The simulation reports the offered and committed block events/s, the commit lag (engine batch to
commit) p50/p99 and the lock wait p99, per fleet size. It models queueing only; what it does not
model (network round trips between hosts, PostgreSQL's WAL flush contention, row locks) is said
in the results file.

Usage: python tools/bench_pg_writers.py [--txns 200] [--events 256] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.bench_ledger import BLOCKS_PER_EVENT, make_batches  # noqa: E402

WRITERS = (1, 2, 4)
FIT_EVENTS = (64, 256, 1024)  # engine events per transaction of the 1-writer runs the cost line is fitted on


# --------------------------------------------------------------------------------------------
# measuring
# --------------------------------------------------------------------------------------------


@dataclass
class WriterRun:
    """One writer process's transactions: per commit (lock wait s, service s), its CPU s, span."""

    waits: list[float]
    services: list[float]
    cpu_s: float
    started: float
    ended: float


def _writer(db: str, engine_id: str, txns: int, events: int, barrier, out) -> None:
    """A writer process: open the ledger, wait for the others, append ``txns`` transactions."""
    from ledger.writer import LedgerWriter

    batches = make_batches(txns * events, events, engine_id=engine_id)

    async def run() -> WriterRun:
        writer = await LedgerWriter.open(db)
        try:
            await asyncio.to_thread(barrier.wait)
            waits, services = [], []
            cpu0, started = time.process_time(), time.time()
            for b in batches:
                t0 = time.perf_counter()
                result = await writer.append([b])
                elapsed = time.perf_counter() - t0
                wait = result.log_lock_wait_s or 0.0
                waits.append(wait)
                services.append(elapsed - wait)
            return WriterRun(waits, services, time.process_time() - cpu0, started, time.time())
        finally:
            await writer.close()

    out.put(asyncio.run(run()))


def _postgres_cpu_s() -> float:
    """CPU seconds of every ``postgres`` process on this machine, the exited backends included
    (the postmaster's ``cutime``/``cstime``: it reaps them). /proc/PID/stat fields 14–17."""
    ticks = os.sysconf("SC_CLK_TCK")
    procs: dict[int, tuple[int, list[str]]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        if name == "postgres" or name.startswith("postgres:"):
            procs[int(entry.name)] = (int(fields[1]), fields)
    total = 0
    for ppid, fields in procs.values():
        total += int(fields[11]) + int(fields[12])
        if ppid not in procs:  # the postmaster: add its reaped children
            total += int(fields[13]) + int(fields[14])
    return total / ticks


@dataclass
class Measured:
    writers: int
    events: int
    runs: list[WriterRun]
    server_cpu_s: float
    block_events: int = 0
    wall_s: float = 0.0
    all_waits: list[float] = field(default_factory=list)
    all_services: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.block_events = sum(len(r.waits) for r in self.runs) * self.events * BLOCKS_PER_EVENT
        self.wall_s = max(r.ended for r in self.runs) - min(r.started for r in self.runs)
        self.all_waits = [w for r in self.runs for w in r.waits]
        self.all_services = [s for r in self.runs for s in r.services]


def measure(writers: int, txns: int, events: int) -> Measured:
    from ledger.migrate import upgrade
    from tools.harness.postgres import create_pg_database, drop_pg_database

    db = create_pg_database()
    try:
        upgrade(db)
        ctx = mp.get_context("spawn")
        barrier, out = ctx.Barrier(writers + 1), ctx.Queue()
        procs = [ctx.Process(target=_writer, args=(db, f"engine-{i}", txns, events, barrier, out))
                 for i in range(writers)]
        for p in procs:
            p.start()
        barrier.wait(timeout=120)
        cpu0 = _postgres_cpu_s()
        runs = [out.get(timeout=600) for _ in procs]
        server = _postgres_cpu_s() - cpu0
        for p in procs:
            p.join(60)
            if p.exitcode != 0:
                raise RuntimeError(f"a writer process exited {p.exitcode}")
        return Measured(writers, events, runs, server)
    finally:
        drop_pg_database(db)


def _q(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


# --------------------------------------------------------------------------------------------
# simulating (SimPy)
# --------------------------------------------------------------------------------------------


@dataclass
class Costs:
    """Per transaction of ``n`` engine events: service ``fixed_s + per_event_s × n`` (the lock held
    all of it), of which the server's part is ``server_share`` (the server's CPU over the server's
    and the writer's, measured) and the rest the consumer's own (its CPU and its waits for replies)."""

    fixed_s: float
    per_event_s: float
    server_share: float

    def service_s(self, n: int) -> float:
        return self.fixed_s + self.per_event_s * n


def simulate(engines: int, *, costs: Costs, design: str, engine_rate: float, engines_per_consumer: int,
             max_batch: int, server_cores: int, seconds: float, seed: int) -> dict[str, float]:
    """One fleet for ``seconds`` of simulated time. ``engine_rate`` in block events/s per engine;
    engine batches of 16 engine events (64 block events) arrive as a Poisson process."""
    import simpy

    rng = random.Random(seed)
    env = simpy.Environment()
    lock = simpy.Resource(env, capacity=1)
    cores = simpy.Resource(env, capacity=server_cores)
    batch_events = 16
    batch_rate = engine_rate / (batch_events * BLOCKS_PER_EVENT)
    consumers = max(1, engines // engines_per_consumer)
    queues = [simpy.Store(env) for _ in range(consumers)]
    lags: list[float] = []
    lock_waits: list[float] = []
    committed = [0]

    def engine(i: int):
        q = queues[i % consumers]
        while True:
            yield env.timeout(rng.expovariate(batch_rate))
            q.put((env.now, batch_events))

    def consumer(q: simpy.Store):
        while True:
            first = yield q.get()
            taken = [first]
            while q.items and sum(n for _, n in taken) < max_batch:
                taken.append((yield q.get()))
            n = sum(n for _, n in taken)
            if design == "table lock":
                asked = env.now
                with lock.request() as req:
                    yield req
                    lock_waits.append(env.now - asked)
                    yield env.timeout(costs.service_s(n))
            else:  # per-stream order: the client's share on its own host, the server's on a shared core
                server_s = costs.server_share * costs.service_s(n)
                yield env.timeout(costs.service_s(n) - server_s)
                with cores.request() as req:
                    yield req
                    yield env.timeout(server_s)
            now = env.now
            lags.extend(now - t for t, _ in taken)
            if now > seconds / 5:  # after the warm-up fifth
                committed[0] += n * BLOCKS_PER_EVENT

    for i in range(engines):
        env.process(engine(i))
    for q in queues:
        env.process(consumer(q))
    env.run(until=seconds)
    measured_s = seconds * 4 / 5
    return {"offered": engines * engine_rate, "committed": committed[0] / measured_s,
            "lag_p50": _q(lags, 0.5), "lag_p99": _q(lags, 0.99),
            "lock_wait_p99": _q(lock_waits, 0.99) if lock_waits else 0.0, "consumers": consumers}


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--txns", type=int, default=200, help="transactions per writer per run")
    parser.add_argument("--events", type=int, default=256, help="engine events per transaction (×4 block events)")
    parser.add_argument("--engine-rate", type=float, default=3000.0, help="simulated block events/s per engine")
    parser.add_argument("--engines-per-consumer", type=int, default=8)
    parser.add_argument("--max-batch", type=int, default=1024, help="simulated engine events per transaction, at most")
    parser.add_argument("--server-cores", type=int, default=32, help="simulated PostgreSQL server cores")
    parser.add_argument("--sim-seconds", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=None, help="results file (default tools/results/pg-writers-DATE-HHMM.md)")
    args = parser.parse_args()
    started = dt.datetime.now(dt.timezone.utc)
    out = args.out or Path(__file__).parent / "results" / f"pg-writers-{started:%Y-%m-%d-%H%M}.md"
    load_start = _load()

    rows, by_writers = [], {}
    for writers in WRITERS:
        m = measure(writers, args.txns, args.events)
        by_writers[writers] = m
        waited = sum(m.all_waits) / sum(r.ended - r.started for r in m.runs)
        rows.append(f"| {writers} | {args.events} | {m.block_events / m.wall_s:,.0f} | "
                    f"{m.block_events / m.wall_s / writers:,.0f} | {_q(m.all_waits, 0.5) * 1e3:.2f} / "
                    f"{_q(m.all_waits, 0.99) * 1e3:.2f} | {waited:.0%} | {_q(m.all_services, 0.5) * 1e3:.2f} | "
                    f"{sum(r.cpu_s for r in m.runs) / m.block_events * 1e6:.1f} | "
                    f"{m.server_cpu_s / m.block_events * 1e6:.1f} |")
        print(rows[-1], flush=True)
    fit = {n: measure(1, max(20, args.txns * args.events // n // 2), n) for n in FIT_EVENTS}
    per_event, fixed = statistics.linear_regression(FIT_EVENTS, [statistics.median(fit[n].all_services)
                                                                 for n in FIT_EVENTS])
    fixed = max(0.0, fixed)
    server = sum(fit[n].server_cpu_s for n in FIT_EVENTS)
    share = server / (server + sum(r.cpu_s for n in FIT_EVENTS for r in fit[n].runs))
    costs = Costs(fixed, per_event, share)
    for n in FIT_EVENTS:
        print(f"fit run {n} events/txn: service p50 {statistics.median(fit[n].all_services) * 1e3:.2f} ms", flush=True)

    sims = []
    for engines in (8, 32, 64, 128, 256, 512, 1000):
        for design in ("table lock", "per-stream order"):
            r = simulate(engines, costs=costs, design=design, engine_rate=args.engine_rate,
                         engines_per_consumer=args.engines_per_consumer, max_batch=args.max_batch,
                         server_cores=args.server_cores, seconds=args.sim_seconds, seed=engines)
            sims.append(f"| {engines} | {r['consumers']} | {design} | {r['offered']:,.0f} | {r['committed']:,.0f} | "
                        f"{r['committed'] / r['offered']:.2f} | {r['lag_p50'] * 1e3:,.1f} / {r['lag_p99'] * 1e3:,.1f} | "
                        f"{r['lock_wait_p99'] * 1e3:,.1f} |")
            print(sims[-1], flush=True)
    ended = dt.datetime.now(dt.timezone.utc)
    lock_cap = 1 / (costs.per_event_s / BLOCKS_PER_EVENT)
    server_cap = args.server_cores / (costs.server_share * costs.per_event_s / BLOCKS_PER_EVENT)
    lines = [
        f"# PostgreSQL fleet ledger: writers on one log lock, measured and simulated — {started:%Y-%m-%d %H:%M}–{ended:%H:%M} UTC",
        "",
        f"`python tools/bench_pg_writers.py --txns {args.txns} --events {args.events}` (issue 23). Machine: "
        f"{os.cpu_count()} CPUs shared with other work; load average at start {load_start}, at end {_load()}. "
        "PostgreSQL on 127.0.0.1 (this machine: server and writers share the 2 cores, so the measured "
        "rates cannot grow with writers here; read the waits).",
        "",
        "## Measured: 1 → 2 → 4 writers, each its own engine, started together",
        "",
        "| writers | engine events/txn | block events/s (all) | per writer | lock wait per commit p50 / p99 (ms) "
        "| writers' time waiting | service per commit p50 (ms) | writer CPU µs / block event "
        "| server CPU µs / block event |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        f"Cost line (least squares) over the median service of 1-writer runs at {', '.join(map(str, FIT_EVENTS))} "
        f"engine events/txn ({', '.join(f'{statistics.median(fit[n].all_services) * 1e3:.2f}' for n in FIT_EVENTS)} ms): "
        f"service = "
        f"{costs.fixed_s * 1e3:.2f} ms + {costs.per_event_s * 1e6:.1f} µs × engine events "
        f"({costs.per_event_s / BLOCKS_PER_EVENT * 1e6:.2f} µs per block event); the server's share of it "
        f"{costs.server_share:.0%} (its CPU over its and the writer's). With the table lock the whole service time "
        f"is serial: the ledger's ceiling is about **{lock_cap:,.0f} block events/s whatever the number of "
        f"consumers**. Without it (per-stream order) the ceiling is the server's cores: "
        f"{args.server_cores} cores / the server's part per block event ≈ {server_cap:,.0f} block events/s.",
        "",
        f"## Simulated: M engines at {args.engine_rate:,.0f} block events/s each, {args.engines_per_consumer} engines per "
        f"consumer, ≤ {args.max_batch} engine events per transaction, {args.server_cores} server cores, "
        f"{args.sim_seconds:.0f} s simulated (first fifth warm-up)",
        "",
        "| engines | consumers | design | offered block events/s | committed | committed / offered "
        "| commit lag p50 / p99 (ms) | lock wait p99 (ms) |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
        *sims,
        "",
        "Not modelled: network round trips between consumer hosts and the server (each adds its RTT to every "
        "statement of a transaction; under the table lock they are serial too), WAL flush contention on the "
        "server (group commit helps both designs), row locks between a consumer and connectors writing the same "
        "engine's rows, and the readers' watermark cost. The measured rows above ran server and writers on the "
        "same 2 cores, so their block events/s cannot grow with writers here; the waits and the fitted costs are "
        "what the simulation takes from them.",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"saved {out}")


if __name__ == "__main__":
    main()

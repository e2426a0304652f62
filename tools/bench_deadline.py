"""The discovery hard deadline under load: caller-observed inline lookup time, before and after, in one run.

DESIGN §7: "semantic lookup on the hot path: hard timeout, default 2 ms, held with both cores busy
(caller p99 ≤ 3 ms)". Each variant runs in its own long-lived worker process (this file with
``--worker``) that builds one :class:`DiscoveryService` per provider set and then answers commands,
so every variant sees the same load at the same time; rounds interleave the variants:

* ``before``: the baseline commit (default e1e0f32, extracted with ``git archive`` into a temporary
  directory and imported from there), providers on threads;
* ``threads+fifo``: this tree, providers on threads, ``wait_priority = "fifo"``;
* ``process``: this tree, ``provider_isolation = "process"``, normal priority (what a deployment
  without CAP_SYS_NICE / RLIMIT_RTPRIO gets);
* ``process+fifo``: this tree, ``provider_isolation = "process"``, ``wait_priority = "fifo"`` (where
  this machine lets a process raise RLIMIT_RTPRIO, the worker runs WITHOUT CAP_SYS_NICE with
  ``RLIMIT_RTPRIO = 1``, the unprivileged deployment; else with root's CAP_SYS_NICE: the report says which);
* ``process+rt-engine``: as ``process+fifo``, but the calling (engine) thread is ``SCHED_FIFO``
  priority 1 for the whole run (a deployment that runs its executor loop real-time; the provider
  processes are started before, at normal priority), so no lookup switches its class back to
  normal (Linux's ``switched_to_fair`` reschedules a task switched back from real-time at once).

"work done, still SCHED_FIFO" is the time from the call to the end of the lookup's work, taken
inside the raised-priority block just before the caller's policy is put back (fifo variants only).

Provider sets: ``hung`` (one provider that never answers: the deadline alone) and ``real``
(``exact``, ``chunks``, ``minhash`` over ``--donors`` indexed donors: ``--real-donors`` of 1,024
random tokens, registered and saved in a real SQLite ledger, plus 256-token fillers; targets are
those donors with blocks reordered and 100 tokens replaced, half keeping an exact 512-token prefix,
then 1,024 new tokens). Loads: 0, 1 and 2 CPU burners (``python -c "while True: pass"`` at nice 0,
in this run's session). Each cell: ``--n`` lookups ``lookup(..., deadline_s=0.002)`` inline with a 2
ms pause between (a scheduler iteration), ``--rounds`` times. Reported: caller p50 / p99 / max, the
caller thread's run-queue wait (``run_delay`` of ``/proc/thread-self/schedstat``) p99, provider
timeouts, hits, and the 1-minute load average.

Usage: ``python tools/bench_deadline.py [--baseline e1e0f32] [--n 200] [--rounds 3] [--donors 20000]
[--variants before,threads+fifo,process,process+fifo,process+rt-engine] [--sets hung,real]
[--out tools/results/deadline-DATE-HHMM.md]``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TPB = 32
MODEL_ID = "bench-model"
NS = "0123456789abcdef0123456789abcdef"
VARIANTS = ("before", "threads+fifo", "process", "process+fifo", "process+rt-engine")
SETS = ("hung", "real")


class HungProvider:
    """A provider that never answers (stuck in C until its process or release ends it)."""

    name, generation, needs_text = "hung", 1, False

    def __init__(self, settings: Any = None, *, db: str | None = None) -> None:
        import threading

        self.release = threading.Event()

    def candidates(self, query: Any, limit: int) -> list:
        self.release.wait(3600)
        return []

    def index(self, donor: Any) -> None: ...
    def forget(self, donor_id: str) -> None: ...
    def prepare(self, query: Any) -> None: ...
    def flush(self, force: bool = True) -> None: ...

    def close(self) -> None:
        self.release.set()


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


# --------------------------------------------------------------------------------------------- worker
def _run_delay() -> float:
    with open("/proc/thread-self/schedstat") as f:
        return int(f.read().split()[1]) / 1e9


def worker(code_root: str, variant: str, db: str, donors: int, real_donors: int) -> None:
    """Serve ``{"set": name, "n": n}`` commands on stdin with JSON lines on the original stdout."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # the service's per-lookup log lines (structlog, stdout) go nowhere, for both trees
    sys.path.insert(0, code_root)
    from connector.discovery.service import DiscoveryService
    from connector.discovery.settings import DiscoverySettings
    from connector.discovery.types import DonorRecord, readonly_tokens

    extra: dict[str, Any] = {}
    marks = {"at_rt": 0.0}
    if variant != "before":
        extra["wait_priority"] = "fifo" if variant.endswith(("fifo", "rt-engine")) else "normal"
        extra["provider_isolation"] = "process" if variant.startswith("process") else "thread"
        import contextlib

        import connector.discovery.service as service_module

        raised = service_module.raised_priority

        @contextlib.contextmanager
        def timed(count: Any = None) -> Any:  # when the lookup's work ended, still at raised priority
            with raised(count) as result:
                yield result
                marks["at_rt"] = time.perf_counter()
        service_module.raised_priority = timed
    rng = np.random.default_rng(0)
    base = [rng.integers(1, 32000, 1024) for _ in range(real_donors)]
    services: dict[str, Any] = {}
    hung_spec = "tools.bench_deadline:HungProvider"
    hung_settings = DiscoverySettings(lookup_timeout_s=0.002, provider_queue_max=100_000,
                                      providers=(hung_spec,), **extra)
    if extra.get("provider_isolation") == "process":
        services["hung"] = DiscoveryService(hung_settings, db=db)
    else:
        services["hung"] = DiscoveryService(hung_settings, db=db, providers=[HungProvider()])
    services["real"] = svc = DiscoveryService(DiscoverySettings(
        lookup_timeout_s=0.002, providers=("exact", "chunks", "minhash"), max_indexed_donors=donors + 1, **extra), db=db)
    for i in range(donors):
        toks = base[i] if i < real_donors else rng.integers(1, 32000, 256)
        rec = DonorRecord(f"d{i}", "A", NS, MODEL_ID, readonly_tokens(toks), TPB)
        for p in svc.providers:  # straight into the indexes (fillers are not in the ledger, so not via the service)
            p.index(rec)
    for p in svc.providers:
        p.flush(True)
    targets = []
    for i in range(200):
        b = base[i % real_donors].copy()
        moved = b.reshape(8, 128)[rng.permutation(8)].ravel()
        moved[:100] = rng.integers(1, 32000, 100)
        if i % 2 == 0:
            moved[:512] = b[:512]  # an exact prefix too
        targets.append(np.concatenate([moved, rng.integers(1, 32000, 1024)]))
    for name, s in services.items():  # warm-up: ledger connections, metric labels
        for t in targets[:20]:
            s.lookup(t, None, MODEL_ID, NS)
    if variant.endswith("rt-engine"):  # the deployment's choice: the engine's thread real-time for good
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))  # (provider processes started before: normal)
    proto.write(json.dumps({"ready": variant}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        s = services[cmd["set"]]
        before = s.metrics.outcome_counts()
        times, delays, at_rt = [], [], []
        for i in range(cmd["n"]):
            t = targets[i % len(targets)]
            r0 = _run_delay()
            marks["at_rt"] = 0.0
            t0 = time.perf_counter()
            s.lookup(t, None, MODEL_ID, NS)
            t1 = time.perf_counter()
            times.append(t1 - t0)
            delays.append(_run_delay() - r0)
            if marks["at_rt"]:
                at_rt.append(marks["at_rt"] - t0)
            time.sleep(0.002)
        after = s.metrics.outcome_counts()
        delta: dict[str, float] = {}
        for (prov, outcome), v in after.items():
            d = v - before.get((prov, outcome), 0.0)
            if d:
                delta[f"{prov}:{outcome}"] = d
        proto.write(json.dumps({"times": times, "delays": delays, "at_rt": at_rt, "outcomes": delta,
                                "load": os.getloadavg()[0]}) + "\n")
    for s in services.values():
        for p in getattr(s, "providers", []):
            if isinstance(p, HungProvider):
                p.release.set()
        s.close()


# --------------------------------------------------------------------------------------------- orchestrator
def seed_ledger(db: str, real_donors: int) -> None:
    """The real donors (same rng as the workers) registered and saved, so exact answers and every
    candidate's ledger check is a real read."""
    sys.path.insert(0, str(ROOT))
    import xxhash

    from connector.namespace import Namespace, content_keys
    from ledger import events as ev
    from ledger.client import LedgerClient
    from ledger.migrate import upgrade

    upgrade(db)
    rng = np.random.default_rng(0)
    client = LedgerClient(db)
    try:
        for i in range(real_donors):
            toks = rng.integers(1, 32000, 1024).tolist()
            n = len(toks) // TPB
            client.register_donor(ev.DonorRegistered(
                donor_id=f"d{i}", namespace=NS, engine_id="A", generation=1,
                content_keys=content_keys(Namespace(NS, {}), toks, TPB, n),
                block_hashes=[xxhash.xxh64_intdigest(f"d{i}/{b}".encode()) for b in range(n)],
                num_tokens=n * TPB, tokens_per_block=TPB))
            client.mark_donor_saved(f"d{i}", store_ref=f"d{i}.kv", checksum="0" * 16, size_bytes=1)
    finally:
        client.close()


PERMISSION = {"how": "none"}


def _rtprio_one() -> None:
    resource.setrlimit(resource.RLIMIT_RTPRIO, (1, 1))


def fifo_permission() -> str:
    """How the ``fifo`` variants may use SCHED_FIFO here: the unprivileged way (RLIMIT_RTPRIO = 1,
    CAP_SYS_NICE dropped) where this process may raise that limit, else CAP_SYS_NICE as it has it."""
    probe = ("import resource, os; resource.setrlimit(resource.RLIMIT_RTPRIO, (1, 1)); "
             "os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))")
    if shutil.which("setpriv"):
        r = subprocess.run([sys.executable, "-c", probe], capture_output=True)
        if r.returncode == 0:
            return "RLIMIT_RTPRIO=1 without CAP_SYS_NICE"
    r = subprocess.run([sys.executable, "-c", "import os; os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))"],
                       capture_output=True)
    return "CAP_SYS_NICE (root; RLIMIT_RTPRIO could not be raised here)" if r.returncode == 0 else \
        "none (fifo variants fall back to normal priority)"


def start_worker(variant: str, code_root: Path, db: str, args: argparse.Namespace) -> subprocess.Popen:
    cmd = [sys.executable, str(ROOT / "tools" / "bench_deadline.py"), "--worker", variant, "--code-root", str(code_root),
           "--db", db, "--donors", str(args.donors), "--real-donors", str(args.real_donors)]
    preexec: Any = None
    if variant.endswith(("fifo", "rt-engine")) and PERMISSION["how"] == "RLIMIT_RTPRIO=1 without CAP_SYS_NICE":
        cmd = ["setpriv", "--bounding-set=-sys_nice", "--inh-caps=-sys_nice", *cmd]
        preexec = _rtprio_one
    env = dict(os.environ, PYTHONPATH=str(code_root))
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(code_root),
                            env=env, preexec_fn=preexec)


def ask(proc: subprocess.Popen, cmd: dict) -> dict:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(cmd) + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"worker exited ({proc.poll()})")
    return json.loads(line)


def burners(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen(["nice", "-n", "0", sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="e1e0f32", help="commit measured as 'before'")
    ap.add_argument("--n", type=int, default=200, help="lookups per cell and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--donors", type=int, default=20_000, help="indexed donors of the real providers")
    ap.add_argument("--real-donors", type=int, default=300, help="of which 1,024-token donors in the ledger")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--sets", default=",".join(SETS), help="provider sets: hung, real")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--code-root", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--db", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.code_root, args.worker, args.db, args.donors, args.real_donors)
        return
    started = dt.datetime.now(dt.timezone.utc)
    out = args.out or ROOT / "tools" / "results" / f"deadline-{started:%Y-%m-%d-%H%M}.md"
    load_start = os.getloadavg()
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    sets = tuple(v.strip() for v in args.sets.split(",") if v.strip())
    with tempfile.TemporaryDirectory(prefix="bench-deadline-") as tmp:
        base_root = Path(tmp) / "baseline"
        base_root.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.baseline], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(base_root)], input=archive.stdout, check=True)
        baseline_sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", args.baseline], check=True,
                                      capture_output=True, text=True).stdout.strip()
        head_sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], check=True, capture_output=True,
                                  text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True).stdout.strip())
        db = f"sqlite:///{Path(tmp) / 'ledger.db'}"
        seed_ledger(db, args.real_donors)
        PERMISSION["how"] = fifo_permission()
        workers = {v: start_worker(v, base_root if v == "before" else ROOT, db, args) for v in variants}
        try:
            for v, proc in workers.items():
                assert proc.stdout is not None
                ready = proc.stdout.readline()
                if not ready:
                    raise RuntimeError(f"worker {v} failed to start ({proc.poll()})")
                print(f"  worker {v} ready", file=sys.stderr)
            cells: dict[tuple[int, str, str], dict[str, Any]] = {}
            for busy in (0, 1, 2):
                procs = burners(busy)
                try:
                    time.sleep(0.5 if busy else 0.2)
                    for _ in range(args.rounds):
                        for v in variants:
                            for name in sets:
                                r = ask(workers[v], {"set": name, "n": args.n})
                                c = cells.setdefault((busy, v, name), {"times": [], "delays": [], "outcomes": {},
                                                                       "load": [], "at_rt": []})
                                c["times"] += r["times"]
                                c["at_rt"] += r["at_rt"]
                                c["delays"] += r["delays"]
                                c["load"].append(r["load"])
                                for k, n in r["outcomes"].items():
                                    c["outcomes"][k] = c["outcomes"].get(k, 0) + n
                    print(f"  {busy} burner(s) done, load {os.getloadavg()[0]:.2f}", file=sys.stderr)
                finally:
                    for p in procs:
                        p.kill()
                        p.wait(10)
        finally:
            for proc in workers.values():
                try:
                    ask(proc, {"quit": True})
                except Exception:  # noqa: BLE001 - it printed nothing more: it quit
                    pass
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    ended = dt.datetime.now(dt.timezone.utc)
    load_end = os.getloadavg()
    write_report(out, cells, variants, args, started, ended, load_start, load_end, baseline_sha, head_sha, dirty)
    print(out)


def write_report(out: Path, cells: dict, variants: tuple[str, ...], args: argparse.Namespace, started: dt.datetime,
                 ended: dt.datetime, load_start: tuple, load_end: tuple, baseline: str, head: str, dirty: bool) -> None:
    lines = [f"# Discovery hard deadline under load — {started:%Y-%m-%d}", "",
             f"- run: {started:%Y-%m-%d %H:%M:%S} UTC → {ended:%Y-%m-%d %H:%M:%S} UTC; load average at start "
             f"{' '.join(f'{x:.2f}' for x in load_start)}, at end {' '.join(f'{x:.2f}' for x in load_end)} "
             f"(1/5/15 min)",
             f"- command: `python tools/bench_deadline.py --n {args.n} --rounds {args.rounds} --donors {args.donors}"
             f" --baseline {args.baseline}`",
             f"- before: {baseline[:7]} (git archive, fresh process); after: {head[:7]}"
             f"{' + uncommitted changes' if dirty else ''}",
             f"- machine: {os.cpu_count()} CPUs ({platform.machine()}, Linux {platform.release()}), shared with other "
             f"helpers' work (see the load column); Python {sys.version.split()[0]}; burners: `nice -n 0 python -c "
             f"'while True: pass'` in this run's session",
             f"- deadline 2 ms, inline lookups, {args.n} per cell and round, {args.rounds} rounds interleaved; "
             f"real providers over {args.donors:,} donors ({args.real_donors} in the ledger)",
             f"- SCHED_FIFO permission of the fifo variants: {PERMISSION['how']}", "",
             "| providers | CPU burners | variant | lookups | caller p50 ms | caller p99 ms | max ms | "
             "work done, still SCHED_FIFO: p99 / max ms | run-queue wait p99 ms | timeouts | hits | load 1 min (max) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in SETS:
        for busy in (0, 1, 2):
            for v in variants:
                c = cells.get((busy, v, name))
                if c is None:
                    continue
                t = c["times"]
                timeouts = sum(n for k, n in c["outcomes"].items() if k.endswith(":timeout"))
                hits = sum(n for k, n in c["outcomes"].items() if k.endswith(":hit"))
                rt = f"{pct(c['at_rt'], 99) * 1e3:.3f} / {max(c['at_rt']) * 1e3:.2f}" if c["at_rt"] else "—"
                lines.append(f"| {name} | {busy} | {v} | {len(t)} | {pct(t, 50) * 1e3:.3f} | {pct(t, 99) * 1e3:.3f} | "
                             f"{max(t) * 1e3:.2f} | {rt} | {pct(c['delays'], 99) * 1e3:.3f} | {timeouts:.0f} | {hits:.0f} | "
                             f"{max(c['load']):.2f} |")
    lines += ["", "Outcomes per cell (provider:outcome → count):", ""]
    for (busy, v, name), c in sorted(cells.items()):
        lines.append(f"- {name}, {busy} burner(s), {v}: {json.dumps(c['outcomes'], sort_keys=True)}")
    out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

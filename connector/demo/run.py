"""``semkv-ledger demo``: the whole product on loopback, on embedded defaults, with real checks.

Steps (each shown as it runs):

1. a fresh directory with a SQLite ledger (migrated) and a donor store;
2. two REFERENCE ENGINE HARNESS processes A and B (``connector.demo.engine_process``), each loading
   the connector in ``exact_equivalent`` through ``KvCacheConnectorConfig`` + ``TRTLLM_SEMKV_CONFIG``
   and publishing its KV events through the publisher bridge;
3. the consumer daemon as its own process (``semkv-ledger consume --config``) subscribed to A, B and a
   third source: ``semkv-ledger publish`` replaying a recorded real engine stream (vLLM 0.32, three
   engine runs, restarts, salts, evictions, AllBlocksCleared, 32-byte hashes);
4. the RFC's document-reuse traffic: A serves document D + question 1; B serves D + question 2
   (materialized from A's donor), D under another cache salt (must not be), and D's chunks reordered
   (exact reuse impossible: must not be);
5. SIGTERM to the daemon (must exit 0), ``replay`` (projections must equal a rebuild of the log),
   then tables of what the ledger and the connectors saw, and a table of checks.

Exit status 0 only if every check held; 1 otherwise. ``fault`` (hidden option, for the tests that
prove the checks are real) breaks one thing on purpose.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from sqlalchemy import func, select, text

from connector.demo.engine_process import TOPIC, engine_main
from connector.demo.expected import RECORDING, recording_facts
from ledger.db import sync_engine
from ledger.migrate import upgrade
from ledger.replay import replay
from ledger.schema import LogRow, SourceRow
from ledger.stats import ledger_stats
from ledger.views import id_column, output_console, print_stats

FAULTS = ("tamper-projection", "drop-recorded-message")
RECORDED_ENGINE = "vllm-recorded"
TOKENS_PER_BLOCK = 32
SYNC_TIMEOUT_S = 90.0


@dataclasses.dataclass
class Check:
    name: str
    ok: bool
    detail: str


class DemoError(RuntimeError):
    """A step could not run at all (a process died, a timeout); reported as a failed check."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "ledger", *args]


class EngineHandle:
    """A harness engine process and the pipe that drives it."""

    def __init__(self, engine_id: str, workdir: Path, db: str, max_context: int) -> None:
        self.engine_id = engine_id
        config = workdir / f"connector-{engine_id}.toml"
        config.write_text(f'db = "{db}"\nmode = "exact_equivalent"\nengine_id = "{engine_id}"\n'
                          f'store_dir = "{workdir / "donors"}"\nlookup_timeout_s = 1.0\nlease_ttl_s = 120\n')
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=engine_main, args=(child, engine_id, str(config), max_context),
                                   name=f"semkv-demo-engine-{engine_id}", daemon=True)
        self.process.start()
        self.endpoint = self.replay_endpoint = ""

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        reply = self._recv(timeout_s)
        if reply[0] != "ready":
            raise DemoError(f"engine {self.engine_id} did not start:\n{reply[1]}")
        self.endpoint, self.replay_endpoint = reply[1], reply[2]

    def call(self, command: str, *args: Any, timeout_s: float = 120.0) -> Any:
        self.conn.send((command, *args))
        reply = self._recv(timeout_s)
        if reply[0] != "ok":
            raise DemoError(f"engine {self.engine_id} failed {command}:\n{reply[1]}")
        return reply[1]

    def _recv(self, timeout_s: float):  # noqa: ANN202
        if not self.conn.poll(timeout_s):
            raise DemoError(f"engine {self.engine_id} did not answer within {timeout_s:.0f} s")
        return self.conn.recv()

    @property
    def source_id(self) -> str:
        return f"{self.engine_id}@{self.endpoint}"

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(("stop",))
                self.conn.poll(30)
            except (BrokenPipeError, OSError):
                pass
            self.process.join(30)
        if self.process.is_alive():
            self.process.kill()


class Demo:
    def __init__(self, console: Console, workdir: Path, *, quick: bool, fault: str | None) -> None:
        self.console, self.workdir, self.quick, self.fault = console, workdir, quick, fault
        self.db = f"sqlite:///{workdir / 'ledger.db'}"
        self.checks: list[Check] = []
        self.engines: dict[str, EngineHandle] = {}
        self.processes: list[subprocess.Popen] = []
        self.results: dict[str, Any] = {}

    # -- plumbing ---------------------------------------------------------------------------

    def step(self, message: str) -> None:
        self.console.print(f"[bold cyan]▸[/bold cyan] {message}", highlight=False)

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append(Check(name, bool(ok), detail))

    def source_position(self, source_id: str) -> tuple[int, int] | None:
        engine = sync_engine(self.db)
        try:
            with engine.connect() as conn:
                row = conn.execute(select(SourceRow.__table__.c.epoch, SourceRow.__table__.c.last_seq)
                                   .where(SourceRow.__table__.c.source_id == source_id)).first()
        finally:
            engine.dispose()
        return None if row is None else (row.epoch, row.last_seq)

    def log_head(self) -> int:
        """The ledger's last log seq (-1: empty)."""
        engine = sync_engine(self.db)
        try:
            with engine.connect() as conn:
                return conn.execute(select(func.max(LogRow.__table__.c.seq))).scalar() or -1
        finally:
            engine.dispose()

    def wait_for(self, what: str, predicate: Callable[[], bool], timeout_s: float = SYNC_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if self.processes and self.processes[0].poll() is not None:
                raise DemoError(f"the consumer daemon exited early (code {self.processes[0].returncode}); "
                                f"see {self.workdir / 'consumer.log'}")
            if time.monotonic() > deadline:
                raise DemoError(f"timed out after {timeout_s:.0f} s waiting for {what}")
            time.sleep(0.05)

    def synced(self, engine: EngineHandle, last_seq: int) -> None:
        self.wait_for(f"engine {engine.engine_id}'s events in the ledger",
                      lambda: (self.source_position(engine.source_id) or (0, -1))[1] >= last_seq)

    # -- the run ----------------------------------------------------------------------------

    def run(self) -> None:
        self.step(f"ledger: {self.db}")
        upgrade(self.db)
        self.step("starting reference engine harness processes A and B (connector: exact_equivalent)")
        max_context = 2048
        for engine_id in ("A", "B"):
            self.engines[engine_id] = EngineHandle(engine_id, self.workdir, self.db, max_context)
        for engine in self.engines.values():
            engine.wait_ready()
        recorded_port, recorded_replay_port = free_port(), free_port()
        self.start_consumer(recorded_port, recorded_replay_port)
        self.publish_recording(recorded_port, recorded_replay_port)
        self.serve_traffic()
        self.stop_processes()
        self.audit()

    def start_consumer(self, port: int, replay_port: int) -> None:
        sources = [(RECORDED_ENGINE, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}")]
        sources += [(e.engine_id, e.endpoint, e.replay_endpoint) for e in self.engines.values()]
        config = self.workdir / "consumer.toml"
        config.write_text(f'db = "{self.db}"\nidle_replay_s = 0.5\nreplay_timeout_s = 2.0\nbatch_max_delay_ms = 5\n'
                          + "".join(f'\n[[sources]]\nengine_id = "{e}"\nendpoint = "{p}"\nreplay_endpoint = "{r}"\n'
                                    f'topic = "{TOPIC.decode()}"\n' for e, p, r in sources))
        self.step("starting the consumer daemon: semkv-ledger consume --config consumer.toml")
        log = open(self.workdir / "consumer.log", "wb")  # noqa: SIM115 - closed with the process
        self.processes.append(subprocess.Popen(cli("consume", "--config", str(config), "--log-level", "warning"),
                                               stdout=log, stderr=subprocess.STDOUT))

    def publish_recording(self, port: int, replay_port: int) -> None:
        capture = RECORDING
        if self.fault == "drop-recorded-message":
            capture = self.workdir / "recording-with-a-hole.frames.bin"
            _drop_one_message(RECORDING, capture, index=10)
        self.step("publishing a recorded real engine stream (vLLM 0.32: 3 runs, 62 messages) through ZMQ")
        log = open(self.workdir / "publish.log", "wb")  # noqa: SIM115
        self.processes.append(subprocess.Popen(
            cli("publish", "--from-file", str(capture), "--endpoint", f"tcp://127.0.0.1:{port}",
                "--replay-endpoint", f"tcp://127.0.0.1:{replay_port}", "--speed", "0", "--wait-for-subscriber",
                "--linger", "600"), stdout=log, stderr=subprocess.STDOUT))
        facts = recording_facts()
        self.results["recording"] = facts
        source_id = f"{RECORDED_ENGINE}@tcp://127.0.0.1:{port}"
        self.wait_for("the recorded stream in the ledger",
                      lambda: self.source_position(source_id) == (facts.restarts + 1, facts.last_seq))

    def serve_traffic(self) -> None:
        a, b = self.engines["A"], self.engines["B"]
        doc_blocks = 8 if self.quick else 24
        doc = _tokens(doc_blocks * TOKENS_PER_BLOCK, seed=1)
        q1, q2, q3 = (_tokens(40, seed=s) for s in (2, 3, 4))
        self.step(f"A serves document D ({len(doc)} tokens) + question 1")
        first = a.call("generate", doc + q1, 4, None)
        self.synced(a, first["last_seq"])
        head = self.log_head()  # A's donor and its blocks are in the ledger: B's connector must see them
        self.wait_for("B's donor view to reach the ledger's head (it refreshes in the background)",
                      lambda: _at_least(b.call("donor_view_seq"), head))
        self.step("B serves D + question 2 (the connector should materialize D from A's donor)")
        warm = b.call("generate", doc + q2, 4, None)
        parity = b.call("compare_with_native", doc + q1)
        self.step("B serves D under another cache salt, and D with its chunks reordered (must not reuse)")
        salted = b.call("generate", doc + q3, 4, "tenant-B")
        chunks = [doc[i:i + 4 * TOKENS_PER_BLOCK] for i in range(0, len(doc), 4 * TOKENS_PER_BLOCK)]
        reordered = b.call("generate", [t for c in reversed(chunks) for t in c] + q2, 4, None)
        for engine in self.engines.values():
            self.synced(engine, engine.call("pump"))
        self.results.update(doc_tokens=len(doc), first=first, warm=warm, parity=parity, salted=salted,
                            reordered=reordered, metrics={e: h.call("metrics") for e, h in self.engines.items()})

    def stop_processes(self) -> None:
        for engine in self.engines.values():
            engine.stop()
        consumer, publisher = self.processes
        publisher.terminate()
        publisher.wait(30)
        consumer.send_signal(signal.SIGTERM)
        try:
            self.results["consumer_exit"] = consumer.wait(60)
        except subprocess.TimeoutExpired:
            consumer.kill()
            self.results["consumer_exit"] = "killed after 60 s"

    def audit(self) -> None:
        if self.fault == "tamper-projection":
            engine = sync_engine(self.db, writer=True)
            with engine.begin() as conn:  # a projection changed behind the ledger's back
                conn.execute(text("UPDATE blocks SET state = 'live' WHERE state != 'live'"))
            engine.dispose()
        self.step("semkv-ledger replay: rebuilding every projection from the log")
        self.results["replay"] = replay(self.db)
        engine = sync_engine(self.db)
        try:
            with engine.connect() as conn:
                self.results["stats"] = ledger_stats(conn)
        finally:
            engine.dispose()

    def cleanup(self) -> None:
        for engine in self.engines.values():
            engine.stop()
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait(10)


def _at_least(view_seq: int | None, seq: int) -> bool:
    """A donor view at ``seq`` or later (None: no view, lookups read the ledger itself)."""
    return view_seq is None or view_seq >= seq


def _tokens(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(1, 512) for _ in range(n)]


def _drop_one_message(source: Path, target: Path, index: int) -> None:
    from consumer.capture import CaptureWriter, read_capture

    with CaptureWriter(target) as writer:
        for i, message in enumerate(read_capture(source)):
            if i != index:
                writer.write(message.frames, message.received_ns)


def evaluate(demo: Demo) -> None:
    """Turn the results into checks (each one can fail: see tests/demo)."""
    r, check = demo.results, demo.check
    stats = r["stats"]
    engines = {e["engine_id"]: e for e in stats["engines"]}
    facts = r["recording"]
    recorded = engines.get(RECORDED_ENGINE, {"events_by_type": {}, "counters": {}})
    check("recorded stream: every event in the log, per type", recorded["events_by_type"] == facts.events_by_type,
          f"ledger {recorded['events_by_type']} vs capture {facts.events_by_type}")
    bumps = recorded["counters"]
    check("recorded stream: restarts and AllBlocksCleared bump the generation",
          bumps.get("generation_bumps.seq_reset", 0) == facts.restarts
          and bumps.get("generation_bumps.all_blocks_cleared", 0) == facts.all_blocks_cleared
          and not any(k.startswith("gaps.") for k in bumps),
          f"seq_reset={bumps.get('generation_bumps.seq_reset', 0)} (capture: {facts.restarts} restarts), "
          f"all_blocks_cleared={bumps.get('generation_bumps.all_blocks_cleared', 0)}, "
          f"gaps={sum(v for k, v in bumps.items() if k.startswith('gaps.'))}")
    check("no dead letters", stats["dead_letters"] == 0, f"{stats['dead_letters']} dead letter(s)")
    warm, parity = r["warm"], r["parity"]
    check("B materialized D from A's donor", warm["num_connector_tokens"] == r["doc_tokens"],
          f"{warm['num_connector_tokens']} of {r['doc_tokens']} tokens of D loaded by the connector")
    check("materialized KV gives bit-identical logits", parity["bit_identical_to_native_reuse"] and parity["same_tokens"],
          f"equal to TensorRT-LLM-style native reuse: {parity['bit_identical_to_native_reuse']}; "
          f"max |Δ| vs cold dense prefill {parity['max_abs_diff_vs_cold']:.2e}")
    misses = r["metrics"]["B"]["misses"]
    check("another cache salt: nothing materialized", r["salted"]["num_connector_tokens"] == 0
          and misses.get("namespace_mismatch", 0) >= 1, f"0 tokens expected, got {r['salted']['num_connector_tokens']}; "
          f"misses {misses}")
    check("reordered chunks: nothing materialized (exact reuse only)", r["reordered"]["num_connector_tokens"] == 0,
          f"{r['reordered']['num_connector_tokens']} tokens")
    held = sum(m["leases_held"] for m in r["metrics"].values())
    ledger_leases = stats["leases_by_state"].get("held", 0)
    check("no lease left behind", held == 0 and ledger_leases == 0,
          f"connector gauges {held}, ledger leases held {ledger_leases}")
    check("experimental materializations", all(m["experimental_materialized"] == 0 for m in r["metrics"].values()),
          "always 0 (Mode 4 is refused)")
    check("consumer daemon stopped cleanly on SIGTERM", r["consumer_exit"] == 0, f"exit status {r['consumer_exit']}")
    report = r["replay"]
    check("replay: projections equal a rebuild of the log", report.compared and report.equal,
          f"{report.events} log rows, {report.events_per_second:,.0f} rows/s; differing tables: "
          f"{[d.table for d in report.diffs if d.count] or 'none'}")


def print_report(demo: Demo) -> None:
    console, r = demo.console, demo.results
    if "stats" in r:
        print_stats(console, r["stats"])
    if "metrics" in r:
        table = Table(title="connectors (reference engine harness, exact_equivalent)")
        id_column(table, "engine")
        for column in ("lookups", "promises", "materialized", "tokens materialized", "declines by reason"):
            table.add_column(column, overflow="fold")
        for engine_id, m in r["metrics"].items():
            table.add_row(engine_id, f"{m['lookups']:,.0f}", f"{m['promises']:,.0f}", f"{m['materialized']:,.0f}",
                          f"{m['materialized_tokens']:,.0f}",
                          ", ".join(f"{k}={v:,.0f}" for k, v in sorted(m["misses"].items())) or "none")
        console.print(table)
    table = Table(title="checks")
    for column in ("check", "result", "detail"):
        table.add_column(column, overflow="fold")
    for c in demo.checks:
        table.add_row(c.name, "[green]PASS[/green]" if c.ok else "[red]FAIL[/red]", c.detail)
    console.print(table)


def report_json(demo: Demo, ok: bool, seconds: float) -> dict[str, Any]:
    """``{"ok", "seconds", "workdir", "checks": [{"name", "ok", "detail"}], "stats", "connectors"}``:
    ``stats`` is ``semkv-ledger stats --json``'s object, ``connectors`` each engine's connector counters."""
    return {"ok": ok, "seconds": round(seconds, 3), "workdir": str(demo.workdir),
            "checks": [dataclasses.asdict(c) for c in demo.checks],
            "stats": demo.results.get("stats"), "connectors": demo.results.get("metrics")}


DETAIL_MAX_CHARS = 500
"""Longest reason a failed step shows in its check's detail (one line, in the table and in ``--json``)."""
_TRACEBACK_HEAD = "Traceback (most recent call last):"


def failure_detail(exc: BaseException, limit: int = DETAIL_MAX_CHARS) -> str:
    """Why a step failed, on one line of at most ``limit`` characters.

    The whole reason is kept (``engine A did not start: <why>``), not only its first line. A harness
    process reports a failure with its traceback (``engine_process``): its frames are dropped and the
    exception it ends with is kept, which is what the reader needs (the frames are noise in a table).
    """
    text = str(exc) or type(exc).__name__
    if _TRACEBACK_HEAD in text:
        head, _, trace = text.partition(_TRACEBACK_HEAD)
        lines = trace.splitlines()
        frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
        start = frames[-1] + 1 if frames else 0
        while start < len(lines) and (lines[start].startswith("    ") or not lines[start].strip()):
            start += 1  # the last frame's source line and its ^^^ markers
        text = head + " " + "\n".join(lines[start:])
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit - 1].rstrip() + "…"


class _Terminated(KeyboardInterrupt):
    """SIGTERM during the demo (``timeout``, a CI cancelling, systemd): handled as a Ctrl-C, exit 143."""


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises :class:`_Terminated` in the main thread while inside: by default it killed
    the demo at once and left its consumer, publisher and directory behind."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum: int, frame: object) -> None:
        raise _Terminated()

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _make_workdir(workdir: Path) -> None:
    """Create ``--dir`` (and its parents); refuse one that cannot be a directory with a ValueError
    (one ``error:`` line, exit 2, in ``connector.cli.demo``), not a traceback."""
    if workdir.exists() and not workdir.is_dir():
        raise ValueError(f"--dir {workdir} is not a directory: give a new or an empty directory")
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(workdir) else ""
        raise ValueError(f"--dir {workdir}: cannot create the directory: {exc.strerror or exc}{where}") from None


def run_demo(*, workdir: Path | None = None, keep: bool = False, quick: bool = False, fault: str | None = None,
             console: Console | None = None, json_out: bool = False) -> int:
    """Run the demo; returns the exit status (0: every check held). With ``json_out`` the progress goes
    to stderr and stdout holds one JSON object (:func:`report_json`) instead of the tables.

    Raises:
        ValueError: an unknown ``fault``, ``workdir`` already holds a demo run (its ledger would be
            reused and every count check would fail: the demo checks one fresh run), or ``workdir``
            is not a directory and cannot be created as one.
    """
    console = console or output_console(stderr=json_out)
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}: {', '.join(FAULTS)}")
    if workdir is not None and (workdir / "ledger.db").exists():
        raise ValueError(f"--dir {workdir} already holds a demo run ({workdir / 'ledger.db'}); the demo checks "
                         "one fresh run: remove the directory or give a new one")
    own_dir = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="semkv-demo-")) if own_dir else workdir
    _make_workdir(workdir)
    console.print(f"[bold]semkv-ledger demo[/bold] in {workdir}" + (f"  (fault injected: {fault})" if fault else ""))
    started = time.monotonic()
    demo = Demo(console, workdir, quick=quick, fault=fault)
    interrupted: int | None = None  # the exit status of an interrupted run
    try:
        with _sigterm_as_interrupt():
            demo.run()
            evaluate(demo)
    except DemoError as exc:
        demo.check("demo ran to the end", False, failure_detail(exc))
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: stop the engines and the consumer, leave nothing behind
        interrupted = 128 + (signal.SIGTERM if isinstance(exc, _Terminated) else signal.SIGINT)
    finally:
        demo.cleanup()
    if interrupted is not None:
        if own_dir and not keep:
            shutil.rmtree(workdir, ignore_errors=True)
        console.print("interrupted", highlight=False)
        return interrupted
    ok = bool(demo.checks) and all(c.ok for c in demo.checks)
    if json_out:
        print(json.dumps(report_json(demo, ok, time.monotonic() - started), default=str))
    else:
        print_report(demo)
    console.print(f"{'[green]all checks passed' if ok else '[red]some checks FAILED'}[/] in "
                  f"{time.monotonic() - started:.0f} s")
    if keep or not ok:
        console.print(f"ledger kept for inspection: semkv-ledger stats --db {workdir / 'ledger.db'}", highlight=False)
    elif own_dir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":  # pragma: no cover - spawned children re-import this module
    os.environ.setdefault("PYTHONUNBUFFERED", "1")

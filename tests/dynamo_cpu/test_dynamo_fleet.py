"""semkv-ledger's consumer on a real NVIDIA Dynamo 1.6.1 fleet (issue 22): the frontend with its KV
router (``--router-mode kv``) in front of NUM_WORKERS mocker workers, each publishing real KV events
with replay; two ``semkv-ledger consume`` processes (a SQLite ledger and a PostgreSQL one) and an
independent subscriber (``tests/dynamo_cpu/subscriber.py``: plain pyzmq + msgspec) on every worker.

Every test ends with the same check, :func:`assert_ledgers_equal_subscriber`: per worker, the
ledger's messages and events equal the subscriber's, its live blocks equal the subscriber's live
set of the worker's current run, and nothing was dead-lettered — on both ledgers.

The consumers' sources say ``block_key_scheme = "dynamo"``, so placement advice hashes requests
Dynamo's way: :func:`test_advice_agrees_with_dynamo_routing` checks the advice against Dynamo's
router request by request and joins advice, route and delivery (:mod:`connector.placement.route_join`).

The tests run in file order on one fleet. NUM_WORKERS = 4: enough for the router to spread a
workload and for one worker to restart while others serve; each worker is a process (~1 core-second
to start) on 2 shared cores, so more would add start-up time without adding a check.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import func, select

from connector.placement.advice import Advice, PlacementAdvisor
from connector.placement.route_join import RouteJoinLog, RouteRecord, read_records, route_totals
from ledger.db import sync_engine
from ledger.schema import BlockRow, DeadLetterRow, EngineRow, LogRow
from ledger.types import join_hash
from tests.conftest import scratch_pg_ledger
from tests.dynamo_cpu.subscriber import IndependentSubscriber
from tools.harness.consume_process import Consumer, consumer_toml, free_port, metric_sum, scrape, wait_for
from tools.harness.dynamo_fleet import BLOCK_SIZE, DynamoFleet, Traffic, TrafficReport, Worker, drive, seeded_prompts

pytestmark = pytest.mark.timeout(600)

NUM_WORKERS = 4
INGEST_REQUESTS = 480
OUTAGE_REQUESTS = 120
SYNC_TIMEOUT_S = 90.0
IDLE_RESTART_DEADLINE_S = 2.0  # issue 22: a restart bumps the generation within 2 s, default settings
ADVICE_REQUESTS = 800  # issue 22 asks 1,000: 103 s here (one at a time, ~40 ms a request + ~60 ms until the
# ledger holds its events, on 2 busy cores); 800 keeps the test within the group's 90 s budget for it
SAME_EVENTS_TIMEOUT_S = 2.0
TOP_SET_AGREEMENT = 0.95  # issue 22: the advice's top set holds Dynamo's choice on >= 95 % of same-events requests


class Ledger:
    """One ledger (SQLite or PostgreSQL) fed by its own ``semkv-ledger consume`` process."""

    def __init__(self, name: str, db: str, root: Path, config: Path) -> None:
        self.name, self.db, self.root, self.config = name, db, root, config
        self.engine = None
        self.consumer: Consumer | None = None
        self.start_consumer(wait=False)

    def start_consumer(self, *, wait: bool = True) -> None:
        """Start the consumer with every default setting (and a metrics port, to read its counters);
        with ``wait``, return once it is healthy (:meth:`wait_healthy`)."""
        self.consumer = Consumer(self.db, self.root / f"consumer-{self.name}.log", self.config,
                                 metrics_port=free_port(), args=())
        if wait:
            self.wait_healthy()

    def wait_healthy(self) -> None:
        assert self.consumer is not None
        wait_for(self.consumer.healthy, 60, f"the {self.name} consumer to be healthy")
        if self.engine is None:
            self.engine = sync_engine(self.db)  # the consumer migrated the ledger

    def stop_consumer(self) -> None:
        assert self.consumer is not None
        code = self.consumer.close()
        assert code == 0, f"{self.name} consumer exited {code}:\n{self.consumer.tail()}"

    def snapshot(self, engine_ids: list[str]) -> dict[str, tuple[int, int, frozenset[int]]]:
        """Per engine: (messages logged, engine events logged, live block hashes)."""
        log, blocks = LogRow.__table__.c, BlockRow.__table__.c
        out = {}
        with self.engine.connect() as conn:  # type: ignore[union-attr]
            for engine_id in engine_ids:
                messages = conn.execute(select(func.count()).where(
                    log.engine_id == engine_id, log.kind == "batch_received")).scalar_one()
                events = conn.execute(select(func.count()).where(
                    log.engine_id == engine_id, log.batch_index >= 0)).scalar_one()
                live = frozenset(join_hash(h, ext) for h, ext in conn.execute(select(
                    blocks.block_hash, blocks.block_hash_ext).where(blocks.engine_id == engine_id,
                                                                     blocks.state == "live")))
                out[engine_id] = (messages, events, live)
        return out

    def last_zmq_seq(self, engine_id: str) -> int:
        """The ZMQ seq of the newest message of ``engine_id`` the ledger holds (-1: none)."""
        log = LogRow.__table__.c
        with self.engine.connect() as conn:  # type: ignore[union-attr]
            seq = conn.execute(select(log.zmq_seq).where(log.engine_id == engine_id, log.kind == "batch_received")
                               .order_by(log.seq.desc()).limit(1)).scalar()
        return -1 if seq is None else seq

    def dead_letters(self) -> int:
        with self.engine.connect() as conn:  # type: ignore[union-attr]
            return conn.execute(select(func.count()).select_from(DeadLetterRow.__table__)).scalar_one()

    def generation(self, engine_id: str) -> int:
        with self.engine.connect() as conn:  # type: ignore[union-attr]
            return conn.execute(select(EngineRow.generation).where(EngineRow.engine_id == engine_id)).scalar() or 0

    def stale_live_blocks(self, engine_id: str) -> int:
        """Live blocks of ``engine_id`` from a generation before its current one."""
        blocks = BlockRow.__table__.c
        with self.engine.connect() as conn:  # type: ignore[union-attr]
            current = conn.execute(select(EngineRow.generation).where(EngineRow.engine_id == engine_id)).scalar_one()
            return conn.execute(select(func.count()).where(blocks.engine_id == engine_id, blocks.state == "live",
                                                           blocks.generation < current)).scalar_one()

    def replay_equal(self) -> dict:
        """``semkv-ledger replay --json`` (a rebuild of every projection from the log, diffed)."""
        done = subprocess.run([sys.executable, "-m", "ledger", "replay", "--db", self.db, "--json"],
                              capture_output=True, text=True, timeout=300, cwd=self.root)
        assert done.returncode == 0, f"{self.name} replay: exit {done.returncode}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        return json.loads(done.stdout)

    def close(self) -> None:
        if self.consumer is not None and self.consumer.proc.poll() is None:
            self.stop_consumer()
        if self.engine is not None:
            self.engine.dispose()


class Group:
    def __init__(self, fleet: DynamoFleet, subscriber: IndependentSubscriber, ledgers: list[Ledger]) -> None:
        self.fleet, self.subscriber, self.ledgers = fleet, subscriber, ledgers
        self.engine_ids = [w.engine_id for w in fleet.workers]
        self._seed = 0

    def prompts(self, count: int) -> Iterator[str]:
        """A new seeded slice of the workload (seeds 1, 2, …: the same prompts on every run)."""
        self._seed += 1
        return seeded_prompts(self._seed, count)

    def drive(self, count: int) -> TrafficReport:
        started = time.monotonic()
        report = drive(self.fleet, self.prompts(count))
        print(f"\n{count} requests in {time.monotonic() - started:.1f} s: {report.ok} answered, failed {dict(report.failed)}, "
              f"per worker {sorted(report.by_instance.values())}, cached {report.cached_tokens}/{report.prompt_tokens} tokens")
        return report

    def settled(self, ledger: Ledger) -> bool:
        """The ledger holds what the subscriber heard (messages, events, live blocks per engine)."""
        return ledger.snapshot(self.engine_ids) == self.subscriber.snapshot()


def assert_ledgers_equal_subscriber(group: Group) -> dict[str, tuple[int, int, int]]:
    """Wait until every ledger holds what the independent subscriber heard, then check it: per
    engine equal messages, events and live blocks, and no dead letter. Returns the subscriber's
    (messages, events, live blocks) per engine."""
    for ledger in group.ledgers:
        try:
            wait_for(lambda ledger=ledger: group.settled(ledger), SYNC_TIMEOUT_S, f"the {ledger.name} ledger to catch up")
        except AssertionError:
            pass  # the comparison below says what differs
        expected, got = group.subscriber.snapshot(), ledger.snapshot(group.engine_ids)
        for engine_id in group.engine_ids:
            (m, e, live), (lm, le, llive) = expected[engine_id], got[engine_id]
            assert (lm, le) == (m, e), f"{ledger.name} {engine_id}: ledger (messages, events) {(lm, le)}, subscriber {(m, e)}"
            assert llive == live, (f"{ledger.name} {engine_id}: live blocks differ: {len(llive - live)} only in the "
                                   f"ledger, {len(live - llive)} only in the subscriber's")
        assert ledger.dead_letters() == 0
    snapshot = group.subscriber.snapshot()
    return {engine_id: (m, e, len(live)) for engine_id, (m, e, live) in snapshot.items()}


@pytest.fixture(scope="module")
def group(dynamo_env, tmp_path_factory) -> Iterator[Group]:
    python, model = dynamo_env
    root = tmp_path_factory.mktemp("dynamo-fleet")
    fleet = DynamoFleet(root, python, model, num_workers=NUM_WORKERS)
    subscriber, ledgers = None, []
    with scratch_pg_ledger() as pg_url:
        try:
            started = time.monotonic()
            fleet.start()
            print(f"\nDynamo fleet of {NUM_WORKERS} workers up in {time.monotonic() - started:.1f} s")
            subscriber = IndependentSubscriber({w.engine_id: (w.endpoint, w.replay_endpoint) for w in fleet.workers})
            config = consumer_toml(root / "consume.toml", fleet.consumer_sources(), block_key_scheme="dynamo")
            ledgers.append(Ledger("sqlite", f"sqlite:///{root / 'ledger.db'}", root, config))
            ledgers.append(Ledger("postgresql", pg_url, root, config))
            for ledger in ledgers:
                ledger.wait_healthy()
            yield Group(fleet, subscriber, ledgers)
        finally:
            for ledger in ledgers:
                ledger.close()
            if subscriber is not None:
                subscriber.close()
            fleet.close()
    assert not fleet.stray_processes(), f"still running after the fleet closed: {fleet.stray_processes()}"


def test_ledgers_equal_an_independent_subscriber_on_every_worker(group: Group) -> None:
    """A seeded workload through the frontend's /v1/completions: both ledgers hold exactly what an
    independent subscriber heard from every worker, no dead letter, and replay rebuilds them equal."""
    report = group.drive(INGEST_REQUESTS)
    assert report.ok == INGEST_REQUESTS and not report.failed
    assert len(report.by_instance) == NUM_WORKERS, f"the router used only {len(report.by_instance)} workers"
    counts = assert_ledgers_equal_subscriber(group)
    print(f"per worker (messages, events, live blocks): {counts}; "
          f"total {sum(c[0] for c in counts.values())} messages, {sum(c[1] for c in counts.values())} events")
    for engine_id, (messages, events, live) in counts.items():
        assert messages > 0 and events >= messages and live > 0, (engine_id, messages, events, live)
    removed = sum(1 for r in group.subscriber.records.values() for evs in r.current.events.values()
                  for e in evs if e.get("type") == "BlockRemoved")
    assert removed > 0, "the workload should evict (BlockRemoved) on a 256-block pool"
    for ledger in group.ledgers:
        replay = ledger.replay_equal()
        assert replay["equal"] is True, (ledger.name, replay.get("diffs"))


def _ledger_holds_what_was_heard(group: Group, ledger: Ledger) -> bool:
    """Every worker's newest message the independent subscriber heard is in ``ledger``."""
    with group.subscriber.lock:
        heard = {e: r.current.last_seq for e, r in group.subscriber.records.items()}
    return all(ledger.last_zmq_seq(e) == seq for e, seq in heard.items())


def _same_events(group: Group, ledger: Ledger, advisor: PlacementAdvisor,
                 previous: tuple[list[int], str] | None) -> bool:
    """Wait (up to SAME_EVENTS_TIMEOUT_S) until the ledger and Dynamo's router have seen the same
    events, as far as this test can tell; False when that did not happen in time. Requests go one
    at a time, so the only events in flight are the previous request's: the condition is (1) the
    previous request's full prompt blocks are live in the ledger on the engine Dynamo routed it to
    (its worker published them and the consumer committed them) and (2) for every worker, the
    ledger holds the newest message the independent subscriber heard (nothing else on the way)."""
    deadline = time.monotonic() + SAME_EVENTS_TIMEOUT_S
    if previous is not None:
        tokens, engine_id = previous
        full = len(tokens) // BLOCK_SIZE
        while _live_blocks(advisor.advise(tokens), engine_id) != full:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
    while not _ledger_holds_what_was_heard(group, ledger):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def _overlaps(advice: Advice) -> dict[str, tuple[int | None, int, str]]:
    """Each engine's live overlap, generation and status: what two ledgers of one fleet must agree on."""
    return {a.engine_id: (a.live_blocks, a.generation, a.status) for a in advice.engines}


def _live_blocks(advice: Advice, engine_id: str) -> int | None:
    return next((a.live_blocks for a in advice.engines if a.engine_id == engine_id), None)


def test_advice_agrees_with_dynamo_routing(group: Group, tmp_path: Path) -> None:
    """ADVICE_REQUESTS seeded prompts through the frontend, one at a time. Before each, the SQLite
    ledger's advice (:meth:`PlacementAdvisor.advise` from the prompt's token ids; the consumer's
    ``block_key_scheme = "dynamo"`` makes it hash Dynamo's way); then the request (its token ids as
    the prompt), Dynamo's choice (``nvext.worker_id.decode_worker_id``, mapped to the ledger's
    engine_id through file discovery) and its ``cached_tokens``. On the requests where both saw the
    same events (:func:`_same_events`), the advice's top set holds Dynamo's choice on at least 95 %,
    and the ledger's overlap on the chosen worker times the block size is Dynamo's cached_tokens.
    Each request is a route record (:mod:`connector.placement.route_join`); ``semkv-ledger
    route-report`` on them gives the totals of the ledger's advice and Dynamo's responses. The
    PostgreSQL ledger, fed by its own consumer from the same workers, is asked too: where it also
    saw the same events, its advice's overlaps equal the SQLite ledger's."""
    sqlite, postgresql, fleet = group.ledgers[0], group.ledgers[1], group.fleet
    engine_of = {w.instance_id: w.engine_id for w in fleet.workers}
    token_ids = fleet.tokenize(list(group.prompts(ADVICE_REQUESTS)))
    advisor = PlacementAdvisor(sqlite.db, tokens_per_block=BLOCK_SIZE)
    pg_advisor = PlacementAdvisor(postgresql.db, tokens_per_block=BLOCK_SIZE)
    join = RouteJoinLog(tmp_path / "routes.jsonl")
    delivered, available, waited, advising, serving = [], [], 0.0, 0.0, 0.0
    pg_compared = pg_equal = 0
    previous = None
    started = time.monotonic()
    try:
        for i, tokens in enumerate(token_ids):
            t0 = time.monotonic()
            same = _same_events(group, sqlite, advisor, previous)
            pg_same = same and _same_events(group, postgresql, pg_advisor, previous)
            t1 = time.monotonic()
            advice = advisor.advise(tokens)
            t2 = time.monotonic()
            if pg_same:
                pg_compared += 1
                pg_equal += _overlaps(pg_advisor.advise(tokens)) == _overlaps(advice)
            response = fleet.complete(tokens, max_tokens=1)
            serving += time.monotonic() - t2
            waited, advising = waited + t1 - t0, advising + t2 - t1
            worker = response["nvext"]["worker_id"]["decode_worker_id"]
            assert worker in engine_of, f"Dynamo routed to worker {worker}, not one of the fleet's {engine_of}"
            usage = response["usage"]
            assert usage["prompt_tokens"] == len(tokens)
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            for a in advice.engines:  # the scheme is logged with an engine's first message: none yet, unknown
                assert (a.overlap, a.block_key_scheme) == ("known", "dynamo") or not group.subscriber.records[
                    a.engine_id].messages(), a
            join.record(RouteRecord.from_advice(f"advice-{i}", advice, routed_engine=engine_of[worker],
                                                router_worker=str(worker), delivered_tokens=cached,
                                                prompt_tokens=len(tokens), same_events=same))
            delivered.append(cached)
            available.append(max((a.live_tokens or 0 for a in advice.engines), default=0))
            previous = (tokens, engine_of[worker])
    finally:
        join.close()
        advisor.close()
        pg_advisor.close()
    elapsed = time.monotonic() - started
    records = read_records(join.path)
    same = [r for r in records if r.same_events]
    informed = [r for r in same if r.available_tokens > 0]
    to_top = sum(r.to_top for r in same)
    exact = sum(r.delivered_tokens == r.routed_tokens for r in same)
    print(f"\nadvice vs Dynamo: {len(records)} requests in {elapsed:.1f} s (per request: waiting for the same events "
          f"{1000 * waited / len(records):.1f} ms, advice {1000 * advising / len(records):.2f} ms, the request "
          f"{1000 * serving / len(records):.1f} ms); same events on {len(same)}; Dynamo's choice in the advice's top set "
          f"on {to_top}/{len(same)} ({100 * to_top / max(1, len(same)):.1f} %), on those where the ledger saw any "
          f"overlap {sum(r.to_top for r in informed)}/{len(informed)}; overlap x {BLOCK_SIZE} == cached_tokens on "
          f"{exact}/{len(same)}; on the others {sum(r.to_top for r in records if not r.same_events)} in the top set")
    print(f"PostgreSQL ledger's advice equal to SQLite's on {pg_equal}/{pg_compared} requests where both saw the "
          "same events")
    assert pg_compared >= 0.9 * len(records) and pg_equal == pg_compared
    assert len(same) >= 0.9 * len(records), f"the same-events condition held on only {len(same)} of {len(records)}"
    assert to_top >= TOP_SET_AGREEMENT * len(same)
    assert exact >= TOP_SET_AGREEMENT * len(same)

    # The route join: `semkv-ledger route-report` and the join's metrics agree with the test's own
    # sums of Dynamo's responses (delivered) and the ledger's advice (available, routed).
    done = subprocess.run([sys.executable, "-m", "ledger", "route-report", str(join.path), "--json"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    totals = json.loads(done.stdout)
    print(f"route-report: {totals}")
    assert totals == route_totals(records).to_dict()
    assert (totals["requests"], totals["delivered_tokens"], totals["available_tokens"]) == \
        (len(token_ids), sum(delivered), sum(available))
    assert totals["routed_tokens"] == sum(r.routed_tokens or 0 for r in records)
    sample = join.registry.get_sample_value
    assert [sample("semkv_route_tokens_total", {"kind": k}) for k in ("available", "routed", "delivered")] == \
        [totals["available_tokens"], totals["routed_tokens"], totals["delivered_tokens"]]
    assert sample("semkv_route_requests_total", {"to_top": "yes"}) == totals["routed_to_top"]
    assert_ledgers_equal_subscriber(group)


def test_consumer_outage_is_recovered_by_replay(group: Group) -> None:
    """The SQLite consumer stops (SIGTERM), traffic goes on, it starts again: what it missed comes
    back from the workers' replay buffers and its ledger equals the subscriber again."""
    sqlite = group.ledgers[0]
    before = group.subscriber.snapshot()
    sqlite.stop_consumer()
    group.drive(OUTAGE_REQUESTS)
    missed = sum(group.subscriber.snapshot()[e][0] - before[e][0] for e in group.engine_ids)
    sqlite.start_consumer()
    assert_ledgers_equal_subscriber(group)
    assert sqlite.consumer is not None and sqlite.consumer.metrics_port is not None
    replayed = metric_sum(scrape(sqlite.consumer.metrics_port), "semkv_consumer_replayed_batches_total")
    print(f"\nconsumer outage: {missed} messages published while it was down, {replayed:.0f} batches recovered by replay")
    assert missed > 0
    assert replayed >= missed


def _restart_with_traffic(group: Group, worker: Worker, sig: signal.Signals) -> None:
    """Stop ``worker`` with ``sig`` while requests keep coming, start it again, keep the traffic on
    until both ledgers bumped its generation; then its old blocks are out of the live set."""
    assert_ledgers_equal_subscriber(group)
    generations = [ledger.generation(worker.engine_id) for ledger in group.ledgers]
    traffic = Traffic(group.fleet, group.prompts(10_000))
    try:
        wait_for(lambda: traffic.report.ok >= 2 * NUM_WORKERS, 60, "traffic to flow before the stop")
        group.fleet.stop_worker(worker, sig)
        group.subscriber.stopped(worker.engine_id)
        group.fleet.start_worker(worker)
        restarted = time.monotonic()
        seen = []
        for ledger, generation in zip(group.ledgers, generations, strict=True):
            wait_for(lambda ledger=ledger, g=generation: ledger.generation(worker.engine_id) > g, 60,
                     f"{ledger.name}: {worker.engine_id}'s generation to bump after {sig.name}")
            seen.append(f"{ledger.name} {time.monotonic() - restarted:.2f} s")
        wait_for(lambda: group.subscriber.records[worker.engine_id].current.payloads, 60, "the new run's first message")
    finally:
        report = traffic.stop()
    print(f"\n{sig.name} of {worker.engine_id} under traffic: generation bump seen after the restart by {', '.join(seen)}; "
          f"requests {report.ok} answered, failed {dict(report.failed)}")
    assert_ledgers_equal_subscriber(group)
    for ledger, generation in zip(group.ledgers, generations, strict=True):
        assert ledger.generation(worker.engine_id) > generation
        assert ledger.stale_live_blocks(worker.engine_id) == 0, f"{ledger.name}: blocks of the old run still live"


def test_sigterm_restart_under_traffic_bumps_the_generation(group: Group) -> None:
    _restart_with_traffic(group, group.fleet.workers[1], signal.SIGTERM)


def test_sigkill_restart_under_traffic_bumps_the_generation(group: Group) -> None:
    _restart_with_traffic(group, group.fleet.workers[2], signal.SIGKILL)


def test_idle_restart_bumps_the_generation_within_2_s(group: Group) -> None:
    """A worker restarted (SIGTERM) with no traffic at all, consumers on their default settings:
    its generation bumps within 2 s of the new process being up (issue 22; before the fix the old
    run's blocks stayed live for tens of seconds)."""
    worker = group.fleet.workers[3]
    assert_ledgers_equal_subscriber(group)
    assert group.subscriber.records[worker.engine_id].current.payloads, "the worker had traffic before"
    generations = [ledger.generation(worker.engine_id) for ledger in group.ledgers]
    stopped = time.monotonic()
    group.fleet.stop_worker(worker, signal.SIGTERM)
    group.subscriber.stopped(worker.engine_id)
    group.fleet.start_worker(worker)
    restarted = time.monotonic()
    print(f"\nidle restart of {worker.engine_id}: {restarted - stopped:.2f} s from SIGTERM to the new process up")
    took: dict[str, float | None] = {ledger.name: None for ledger in group.ledgers}
    while time.monotonic() - restarted < 5 * IDLE_RESTART_DEADLINE_S and None in took.values():
        for ledger, generation in zip(group.ledgers, generations, strict=True):
            if took[ledger.name] is None and ledger.generation(worker.engine_id) > generation:
                took[ledger.name] = time.monotonic() - restarted
        time.sleep(0.05)
    print(f"idle restart of {worker.engine_id}: generation bump after the new process was up: "
          + ", ".join(f"{name} {'none in 10 s' if t is None else f'{t:.2f} s'}" for name, t in took.items()))
    for name, seconds in took.items():
        assert seconds is not None and seconds <= IDLE_RESTART_DEADLINE_S, \
            f"{name}: no generation bump within {IDLE_RESTART_DEADLINE_S} s of an idle restart ({seconds})"
    for ledger in group.ledgers:
        assert ledger.stale_live_blocks(worker.engine_id) == 0, f"{ledger.name}: blocks of the old run still live"
    assert_ledgers_equal_subscriber(group)

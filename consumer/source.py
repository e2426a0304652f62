"""One KV-event source: a SUB socket, a replay DEALER and the seq tracking between them (DESIGN §5, §6).

Per received message (``[topic, seq8, payload]``, decoded by :func:`consumer.wire.decode_message`),
:class:`SeqTracker` (no I/O) classifies the seq against ``last_seq`` — advanced on EVERY batch
passed on (STYLE anti-pattern 3) — and the recent (seq, payload digest) pairs:

``next``      seq = last + 1: pass it on.
``gap``       seq > last + 1: ask the replay endpoint for ``[last, …]`` (``last`` again: its
              digest proves the engine did not restart meanwhile; if it did, the new run is
              replayed from 0), pass the recovered batches on in order, then the live one. What
              replay cannot cover reaches the ledger as a seq jump, and the ledger records the
              gap, bumps the generation and quarantines.
``duplicate`` a seq already passed on with the same digest (replay overlap, a re-sent batch):
              dropped here and counted (the ledger would only ignore it).
``restart``   a seq at or below ``last`` with a new digest: the engine restarted (its seq starts
              again at 0), or an old batch arrives late. Replay from ``last`` tells which: another
              digest there proves a restart, and the new run is replayed from 0 and goes first;
              the same digest proves the engine did NOT restart, so the batch is ``late``
              (reordered after its gap was declared lost): it is passed on marked ``late`` (the
              ledger logs it once and never applies it) without moving ``last_seq``, so no batch
              of the current run can be fed to the ledger twice. Without an answer (no replay
              endpoint, a buffer that moved past ``last``) it is passed on as it is and the ledger
              judges it by its log (``ledger.decide.Decider._place``).
``first``     nothing known yet: a seq above 0 (a late joiner, or the ZMQ slow joiner) asks replay
              for ``[0, seq)``; what it cannot cover is reported as a :class:`GapReport`.

A restart proven by replay marks the first batch passed on of the new run ``new_run``: the ledger
then opens a new epoch whatever its seq (a new run first heard of past the old run's last seq
would otherwise look like its continuation) and logs a gap for the new run's seqs below it that
the engine's buffer no longer held.

Replay (reference/WIRE.md §B; shared/fixtures/README.md): DEALER sends ``[b"", start_seq8]``; replies
are ``[b"", topic, seq8, payload]`` (TensorRT-LLM native, our publisher, recorded vLLM 0.32) or
``[b"", seq8, payload]`` (older vLLM), until the end marker (seq -1). ``replay_timeout_s`` without a
reply fails the replay; the DEALER is then replaced so late replies cannot leak into the next one.
Replayed batches are passed on as they arrive (a long catch-up commits as it goes); the DEALER's
receive HWM is unlimited, so the rest of one replay waits in ZMQ, bounded by the engine's buffer.

On start, BEFORE its SUB is opened (so nothing queued live is older than the probe's answer), a
source with a ledger position ``L`` asks replay from ``L`` (not ``L + 1``). The position carries
the digest of the batch logged at ``L`` (:class:`~ledger.writer.SourcePosition`), so the source
judges the answer itself: the same digest at ``L`` proves the engine kept running (the copy is
dropped); another digest proves it restarted while the consumer was down, and its new run,
possibly already past ``L``, is replayed from 0 as above. (A position without a digest passes the
batch at ``L`` on, and the ledger judges it by digest.) A source without a position asks from 0.
After ``idle_replay_s`` (0: never) without a message or probe the same probe runs again, from
``last_seq`` (finds lost trailing batches, batches published before the SUB connected, and a
restart nothing was heard of). An engine's replay buffer always holds its newest batch, so a
complete answer with nothing at all (the end marker only) to a request for a ``last_seq`` whose
digest is known proves a restart just as another digest would: the engine no longer holds the
batch it published there (Dynamo's mocker and vLLM restart at seq 0 and answer so; issue #22).
The new run is then replayed from 0 as above; when it has published nothing yet, the restart is
reported at once (a :class:`~ledger.events.GapReport` with reason ``seq_reset``: the ledger bumps
the generation) and the new run's first batch, whenever it comes, is passed on ``new_run`` with
``restart_logged`` (no second bump). An engine whose replay buffer holds nothing (a buffer of 0
batches) cannot be told from a restarted one: do not give it a ``replay_endpoint``. A replay
endpoint that does not answer proves nothing (the probe times out after ``replay_timeout_s``, the
SUB is read again, and live messages waiting in ZMQ meanwhile are received then). An idle probe
yields to live traffic: a live message waiting before its first reply drops the probe (its DEALER
closed), since the answer may hold a run newer than those messages (an engine that restarted while
the probe waited, a multi-run capture published at once) and passing it on first would make the
older run's batches look late or like restarts.

``record``: every message passed on (live or recovered, in that order; duplicates excluded) is
appended to a capture file (``consumer/capture.py``), replayable by ``semkv-ledger publish``.

CURVE (``consumer/curve.py``): with keys, the SUB is a CURVE client pinning the engine's key (or,
with ``bind``, a CURVE server whose ZAP domain is the ``source_id``: the daemon authorizes the
engine's key there) and the replay DEALER a client pinning the same key. Both sockets carry a
socket monitor; a task counts their handshakes (``semkv_consumer_handshakes_total``) and refusals
(``semkv_consumer_curve_refused_total{socket, reason}``). A refused peer never delivers a frame.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Literal

import msgspec
import structlog
import xxhash
import zmq
import zmq.asyncio

from consumer.capture import CaptureWriter
from consumer.curve import CurveKeys, RefusalLogGate, classify, hint, monitor
from consumer.metrics import ConsumerMetrics
from consumer.settings import ConsumerSettings, SourceSettings, tcp_host_name
from consumer.wire import WireLimits, decode_message, is_end_marker, pack_seq
from ledger.events import DeadLetter, GapReport, ReceivedBatch
from ledger.types import GenerationReason
from ledger.writer import SourcePosition

RESOLVE_EVERY_S = 30.0
"""Seconds between tries to resolve an endpoint host name that did not resolve."""

__all__ = ["ReplayResult", "SeqTracker", "Source", "Submit"]

Item = ReceivedBatch | DeadLetter | GapReport
Submit = Callable[[Item], Awaitable[None]]
Kind = Literal["first", "next", "gap", "duplicate", "restart", "late"]
_POLL_MS = 100  # longest wait before the stop flag and the idle probe are looked at
_DRAIN_MAX = 256  # messages read per poll wake-up


REPLAY_TIMEOUT_LOG_EVERY_S = 60.0
"""``source.replay_timeout`` is logged for a source's first timeout, then at most once per this many
seconds while they go on (with ``in_a_row``): a stopped engine times out at every idle probe, every
``idle_replay_s`` + ``replay_timeout_s``; ``source.replay_answered`` says when it answers again."""

class SeqTracker:
    """``last_seq`` and the last ``window`` (seq, digest) pairs of one source. Pure; no I/O."""

    def __init__(self, last_seq: int | None, window: int, last_digest: int | None = None) -> None:
        self.last_seq = last_seq
        self._window = window
        self._recent: OrderedDict[int, int] = OrderedDict()
        if last_seq is not None and last_digest is not None:  # the ledger's last batch (SourcePosition)
            self._recent[last_seq] = last_digest

    def classify(self, seq: int, digest: int) -> Kind:
        last = self.last_seq
        if last is None:
            return "first"
        if seq == last + 1:
            return "next"
        if seq > last:
            return "gap"
        return "duplicate" if self._recent.get(seq) == digest else "restart"

    def seen(self, seq: int, digest: int) -> bool:
        return self._recent.get(seq) == digest

    def digest_at(self, seq: int) -> int | None:
        return self._recent.get(seq)

    def has(self, seq: int) -> bool:
        return seq in self._recent

    def verdict(self, seq: int, digest: int) -> Literal["same_run", "restart"] | None:
        """Judge a replayed batch: the run we know (same digest at that seq), a restart (another
        digest at a seq we know, or seq 0), or None (nothing to compare it with)."""
        known = self._recent.get(seq)
        if known == digest:
            return "same_run"
        return "restart" if known is not None or seq == 0 else None

    def is_resume_point(self, seq: int) -> bool:
        """True for the ledger's last seq right after a resume whose position carried no digest
        (its batch was not found in the log): the ledger judges that batch."""
        return seq == self.last_seq and not self._recent

    def accept(self, seq: int, digest: int, kind: Kind) -> None:
        """Record a batch passed on; a ``restart`` forgets the previous run's digests."""
        if kind == "restart":
            self._recent.clear()
        self.last_seq = seq
        self._recent[seq] = digest
        self._recent.move_to_end(seq)
        if len(self._recent) > self._window:
            self._recent.popitem(last=False)


class ReplayResult(msgspec.Struct, frozen=True):
    """What one replay request brought: batches received, how many distinct seqs of the wanted
    range they covered, whether the end marker arrived (False: timeout), and messages received
    before it (batches and undecodable messages alike)."""

    batches: int
    covered: int
    complete: bool
    messages: int = 0

    @property
    def empty(self) -> bool:
        """The end marker and nothing else came: the engine's buffer holds nothing from the start asked."""
        return self.complete and self.messages == 0


class Source:
    """Receives one source and passes decoded items to ``submit`` (the daemon's bounded queue).

    ``submit`` may block (back-pressure): the source then stops reading and ZMQ's receive HWM
    holds what arrives. Sockets are created by :meth:`run` and closed when it returns.

    Raises (from :meth:`run`): ``zmq.ZMQError`` if the endpoint cannot be bound/connected.
    """

    def __init__(self, source: SourceSettings, settings: ConsumerSettings, ctx: zmq.asyncio.Context,
                 submit: Submit, metrics: ConsumerMetrics, position: SourcePosition | None = None,
                 record: CaptureWriter | None = None, curve: CurveKeys | None = None) -> None:
        self.config = source
        self._curve = curve
        self._monitors: list[tuple[str, zmq.asyncio.Socket]] = []  # (socket label, monitor PAIR)
        self._retired: list[tuple[str, zmq.asyncio.Socket]] = []  # of closed sockets: drained, then closed
        self.handshakes_refused = 0
        self.refused_since_message = 0  # refusals since a message was last received: /healthz "degraded"
        self._refused_by_socket: dict[str, int] = {}
        self._refusal_log = RefusalLogGate()
        self._replay_timeout_log = RefusalLogGate(every_s=REPLAY_TIMEOUT_LOG_EVERY_S)
        self._replay_timeouts = 0  # replay requests in a row that timed out (a stopped engine: every probe)
        self._settings, self._ctx, self._submit, self._record = settings, ctx, submit, record
        self._limits = WireLimits(max_frame_bytes=settings.max_frame_bytes,
                                  max_events_per_message=settings.max_events_per_message,
                                  max_blocks_per_message=settings.max_blocks_per_message,
                                  max_tokens_per_message=settings.max_tokens_per_message)
        self._topic = source.topic.encode()
        self._known_to_ledger = position is not None
        self._resume_pending = position is not None
        self._verdict: Literal["pending", "same_run", "restart"] | None = None  # restart check by replay
        self._replay_start = 0
        self._new_run = False  # a restart was proven: the next batch passed on opens the new run
        self._restart_logged = False  # ...and the restart was already reported to the ledger (GapReport)
        self._describe = source.block_key_scheme  # carried by the first batch passed on, then None
        self._replayed = 0  # replayed batches passed on (not dropped as duplicates)
        self._probe_gaps: int | None = None  # during a probe: gaps its answer showed (no live batch counted them)
        self.tracker = SeqTracker(position.last_seq if position else None, settings.dedup_window_batches,
                                  position.last_digest if position else None)
        self._m = metrics
        self._labels = {"engine_id": source.engine_id}
        self.log = structlog.get_logger("consumer.source").bind(engine_id=source.engine_id,
                                                                 source_id=source.source_id)
        self._sub: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self.endpoint: str | None = None  # resolved after run() opened the SUB (bind to port 0)
        self.alive = False  # the task runs (probing or receiving)
        self.unresolved: dict[str, str] = {}  # endpoint host names that did not resolve at the last look
        self.running = False  # the SUB is open and read
        self.messages = 0
        self.last_message_at: float | None = None
        self.last_activity = 0.0  # monotonic time of the last message received (the daemon's idle clock)
        self._probed_at = 0.0  # monotonic time of the last replay probe (the idle probe's own clock)

    @property
    def source_id(self) -> str:
        return self.config.source_id

    def status(self) -> dict[str, object]:
        """For ``/healthz``: alive, last seq, messages, seconds since the last message, handshakes
        refused (in all, and since the last message), endpoint host names that do not resolve;
        ``degraded`` while handshakes are refused since the last message or a name does not resolve."""
        age = None if self.last_message_at is None else round(time.time() - self.last_message_at, 3)
        return {"engine_id": self.config.engine_id, "alive": self.alive, "receiving": self.running, "last_seq": self.tracker.last_seq,
                "messages": self.messages, "last_message_age_s": age,
                "handshakes_refused": self.handshakes_refused,
                "handshakes_refused_since_last_message": self.refused_since_message,
                "unresolved_hosts": sorted(self.unresolved),
                "degraded": self.refused_since_message > 0 or bool(self.unresolved)}

    # -- life cycle ---------------------------------------------------------------------------

    async def run(self, stopping: asyncio.Event) -> None:
        """Probe replay, open the SUB, receive until ``stopping`` is set; sockets closed on return.

        The start-up probe runs BEFORE the SUB exists, so no live message waiting in the SUB is
        older than what the probe returned (an engine restart in between cannot reorder runs);
        what is published between the two shows up as a gap and is replayed.
        """
        self.alive = True
        self._m.source_up.labels(**self._labels).set(1)
        watcher = asyncio.create_task(self._watch_handshakes(), name=f"semkv-handshakes-{self.source_id}")
        resolver = asyncio.create_task(self._watch_host_names(stopping), name=f"semkv-resolve-{self.source_id}")
        try:
            if self.config.replay_endpoint is not None:
                await self._probe()
            self._open_sub()
            self.running = True
            self.log.info("source.started", endpoint=self.endpoint, bind=self.config.bind,
                          replay_endpoint=self.config.replay_endpoint, last_seq=self.tracker.last_seq)
            await self._receive(stopping)
        finally:
            self.alive = self.running = False
            self._m.source_up.labels(**self._labels).set(0)
            watcher.cancel()
            resolver.cancel()
            await asyncio.wait([watcher, resolver])  # their own CancelledError stays inside; ours still propagates
            self._close()
            self.log.info("source.stopped", last_seq=self.tracker.last_seq, messages=self.messages)

    def _open_sub(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, self._settings.rcv_hwm)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        if self._curve is not None:  # the side that binds is the CURVE server (consumer/curve.py)
            self._curve.configure(sub, server=self.config.bind, domain=self.source_id)
        self._watch("sub", sub)
        try:
            (sub.bind if self.config.bind else sub.connect)(self.config.endpoint)
        except zmq.ZMQError:
            sub.close()
            raise
        self._sub = sub
        self.endpoint = sub.getsockopt(zmq.LAST_ENDPOINT).decode() or self.config.endpoint

    def _close(self) -> None:
        for sock in (self._sub, self._dealer):
            if sock is not None:
                sock.close(linger=0)
        self._sub = self._dealer = None
        if self._record is not None:
            self._record.flush()

    async def _receive(self, stopping: asyncio.Event) -> None:
        sub = self._sub
        assert sub is not None
        self.last_activity = time.monotonic()
        while not stopping.is_set():
            if not await sub.poll(_POLL_MS, zmq.POLLIN):
                await self._on_idle()
                continue
            for _ in range(_DRAIN_MAX):
                try:
                    frames = await sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                await self._on_live(frames)
            self.last_activity = time.monotonic()

    async def _on_idle(self) -> None:
        if self._record is not None:
            self._record.flush()
        idle_s = self._settings.idle_replay_s
        if not idle_s or self.config.replay_endpoint is None:  # 0 (or None): no idle probe
            return
        # Its own clock: a probe is not a message, so it must not reset the daemon's idle clock
        # (last_activity), or --exit-when-idle above idle_replay_s would never fire.
        if time.monotonic() - max(self.last_activity, self._probed_at) >= idle_s:
            await self._probe()

    # -- live messages ------------------------------------------------------------------------

    async def _on_live(self, frames: list[bytes]) -> None:
        if self._topic and frames[0] != self._topic:  # SUBSCRIBE matches a prefix; engines publish one topic
            self._m.foreign_topic_dropped.labels(**self._labels).inc()
            return
        if self._known_duplicate(frames):
            return
        item = self._decode(frames)
        if isinstance(item, DeadLetter):  # frame-level: no trustworthy seq, nothing to track
            await self._pass_on(item, frames)
            return
        kind = self.tracker.classify(item.seq, item.digest)
        if kind == "duplicate":
            self._drop_duplicate(item)
            return
        self._note(kind, item)
        if self.config.replay_endpoint is not None and (kind == "gap" or (kind != "next" and item.seq > 0)):
            known = self.tracker.digest_at(item.seq)
            same_run = await self._recover(kind, item)
            kind = self.tracker.classify(item.seq, item.digest)
            if kind == "duplicate":  # replay already delivered it
                return
            if kind == "restart" and (same_run or self.tracker.digest_at(item.seq) not in (known, None)):
                # The replay showed the run we know (an old batch, not a restart), or the engine's
                # buffer holds another payload at this seq (a batch of a run it has left): late.
                kind = "late"
        await self._admit(item, frames, kind)

    def _known_duplicate(self, frames: list[bytes]) -> bool:
        """A copy of a batch already passed on (typically the live copy of what replay brought):
        dropped by (seq, xxh3_64 of the payload) before any decoding."""
        last = self.tracker.last_seq
        if last is None or len(frames) != 3 or len(frames[1]) != 8:
            return False
        seq = int.from_bytes(frames[1], "big", signed=True)
        if not 0 <= seq <= last or not self.tracker.seen(seq, xxhash.xxh3_64_intdigest(frames[2])):
            return False
        self.messages += 1
        self.refused_since_message = 0
        self._m.messages_received.labels(**self._labels).inc()
        self._m.duplicates_dropped.labels(**self._labels).inc()
        return True

    def _note(self, kind: Kind, item: ReceivedBatch) -> None:
        if kind == "gap":
            self._m.gaps_seen.labels(**self._labels).inc()
            self.log.info("source.gap_seen", seq=item.seq, expected=self.tracker.last_seq + 1,  # type: ignore[operator]
                          reason=str(GenerationReason.SEQ_GAP))
        elif kind == "restart":  # a restart, or a late batch: replay tells (counted when passed on)
            self.log.info("source.restart_seen", seq=item.seq, last_seq=self.tracker.last_seq)

    async def _recover(self, kind: Kind, live: ReceivedBatch) -> bool:
        """Replay what precedes ``live``; True if the replay showed the run we know (no restart).

        A gap, or a seq that went back, re-requests ``last_seq`` itself when its digest is known:
        the same digest proves the engine did not restart (a seq that went back is then a late
        batch); another one proves it did, and the new run is replayed from 0
        (:meth:`_replay_new_run`). When nothing at ``last_seq`` tells (a restarted engine whose
        new run has not reached it yet), a seq that went back asks from 0, where the new run
        starts; its first batch then judges as it can (``SeqTracker.verdict``).
        """
        last = self.tracker.last_seq
        judge = kind in ("gap", "restart") and self.tracker.has(last)  # type: ignore[arg-type]
        if judge:
            start = last
        else:
            start = last + 1 if kind == "gap" else 0  # type: ignore[operator]
        self._verdict = "pending" if judge or kind == "restart" else None
        await self._recover_before(start, live.seq)  # type: ignore[arg-type]
        if self._verdict == "restart" and start > 0:
            await self._replay_new_run(live.seq)
        elif kind == "restart" and start > 0 and self._verdict != "same_run":
            self._verdict = "pending"
            await self._recover_before(0, live.seq)
        same_run, self._verdict = self._verdict == "same_run", None
        return same_run

    async def _replay_new_run(self, until: int | None) -> None:
        """The engine restarted (replay showed another digest at a seq passed on before): replay
        its new run from 0; the first batch passed on after this is marked ``new_run``, so the
        ledger opens a new epoch whatever its seq (a new run first heard of past the old run's
        last seq would otherwise look like its continuation) and logs a gap for the new run's
        seqs the engine's buffer no longer held."""
        self.log.warning("source.restart_found_by_replay", last_seq=self.tracker.last_seq, seq=until,
                         reason=str(GenerationReason.SEQ_RESET))
        self._verdict = None
        self._new_run = True
        await self._recover_before(0, until)

    async def _recover_before(self, start: int, until: int | None) -> None:
        """Replay from ``start`` (passing batches on as they arrive) and count whether it covered
        ``[start, until)``: ``ok`` all of it, ``partial`` some, ``failed`` none (or a timeout)."""
        self.log.info("source.replay_requested", seq=until, start_seq=start)
        result = await self.replay(start, until=until)
        wanted = max(0, until - start) if until is not None else 0
        if wanted:
            outcome = "ok" if result.covered == wanted else ("partial" if result.covered else "failed")
        else:
            outcome = "ok" if result.complete else "failed"
        self._m.replays.labels(**self._labels, outcome=outcome).inc()
        self.log.info("source.replay_done", seq=until, start_seq=start, outcome=outcome,
                      recovered=result.batches, complete=result.complete)

    async def _probe(self) -> None:
        """Ask replay for anything after what we know (start-up, and after idle_replay_s).

        The request starts at ``last_seq`` itself when its digest is known (at start-up, the
        ledger's last batch: :attr:`SourcePosition.last_digest`): the same digest proves the run
        we know (the copy is dropped); another one proves the engine restarted while nothing was
        heard from it, and its new run is replayed from 0 (:meth:`_replay_new_run`).
        """
        last = self.tracker.last_seq
        judge = last is not None and self.tracker.has(last)
        if last is None:
            start = 0
        else:
            start = last if judge or self._resume_pending else last + 1
        self._resume_pending = False  # without a digest, the ledger's last batch is re-requested once
        self._verdict = "pending" if judge else None
        replayed_before, self._probe_gaps = self._replayed, 0
        try:
            result = await self.replay(start, yield_to_live=True)
        finally:
            probe_gaps, self._probe_gaps = self._probe_gaps, None
        restarted, self._verdict = self._verdict == "restart" and start > 0, None
        self._probed_at = time.monotonic()
        self._m.replay_probes.labels(**self._labels).inc()
        if probe_gaps:  # what it was asked for (everything after last_seq) came with a hole: a partial replay
            self._m.replays.labels(**self._labels, outcome="partial").inc()
        gone = judge and result.empty  # the batch at last_seq, held before, is no longer held: a restart
        if gone:
            self.log.warning("source.restart_found_by_empty_replay", last_seq=last,
                             reason=str(GenerationReason.SEQ_RESET))
        if restarted or gone:
            await self._replay_new_run(None)
        if gone and self._new_run:  # the new run published nothing yet: no batch carried the news
            await self._report_restart_without_batches(last)  # type: ignore[arg-type]
        if self._replayed > replayed_before:
            self.log.info("source.probe_recovered", start_seq=start, batches=self._replayed - replayed_before,
                          complete=result.complete)

    async def _report_restart_without_batches(self, last: int) -> None:
        """An idle engine restarted and has published nothing since: the ledger bumps the
        generation now (its blocks are gone with the old run), and the tracker forgets the old
        run, so the new run's first batch, at any seq, is passed on ``new_run`` with
        ``restart_logged`` (the ledger opens its epoch without a second bump)."""
        await self._submit(GapReport(self.source_id, self.config.engine_id, last + 1, 0, GenerationReason.SEQ_RESET))
        self._m.restarts_seen.labels(**self._labels).inc()
        self._restart_logged = True
        self.tracker = SeqTracker(None, self._settings.dedup_window_batches)

    async def _feed_one(self, item: ReceivedBatch | DeadLetter, frames: list[bytes]) -> None:
        """Pass on one replayed message unless the source already has it."""
        if isinstance(item, DeadLetter):
            await self._pass_on(item, frames)
            return
        proof = self._verdict == "pending"  # does this first replayed batch show the run we know?
        if proof:
            self._verdict = self.tracker.verdict(item.seq, item.digest)
            if self._verdict == "restart" and self._replay_start == 0:
                self._new_run = True  # the new run replayed from its start: this batch opens it
        if self._verdict == "restart" and self._replay_start > 0:
            return  # a new run seen from the middle: dropped, replayed again from 0 (_replay_new_run)
        kind = self.tracker.classify(item.seq, item.digest)
        if kind == "duplicate":
            self._drop_duplicate(item, count=not proof)  # the proof was asked for, not re-sent
            return
        if kind == "restart" and self._verdict == "same_run":
            kind = "late"  # the run we know: a batch the ledger declared lost (or the window forgot)
        elif kind == "restart" and self.tracker.is_resume_point(item.seq):
            kind = "next"  # the ledger's last batch, digest unknown here: the ledger judges
        self._m.replayed_batches.labels(**self._labels).inc()
        self._replayed += 1
        if kind == "gap" and self._probe_gaps is not None:  # seen in a probe's answer, not by a live batch
            self._probe_gaps += 1
            self._m.gaps_seen.labels(**self._labels).inc()
        await self._admit(item, frames, kind)

    async def _admit(self, item: ReceivedBatch, frames: list[bytes], kind: Kind) -> None:
        """Advance the tracker and pass the batch on (with a GapReport first for a late joiner
        whose earlier batches replay could not give). The judgements replay proved travel with
        the batch: ``new_run`` (a restart) and ``late`` (an old batch of the run we know)."""
        counted = False  # a restart already counted when it was reported (_report_restart_without_batches)
        if self._new_run:
            counted = self._restart_logged
            self.log.warning("source.new_run", seq=item.seq, last_seq=self.tracker.last_seq,
                             reason=str(GenerationReason.SEQ_RESET), restart_logged=self._restart_logged)
            kind, item = "restart", msgspec.structs.replace(item, new_run=True, restart_logged=self._restart_logged)
            self._new_run = self._restart_logged = False
        if kind == "first" and item.seq > 0 and not self._known_to_ledger:
            await self._submit(GapReport(self.source_id, self.config.engine_id, 0, item.seq,
                                         GenerationReason.SEQ_GAP))
            self.log.warning("source.joined_late", seq=item.seq, reason=str(GenerationReason.SEQ_GAP))
        elif kind == "gap":
            self.log.warning("source.gap_unrecovered", seq=item.seq, expected=self.tracker.last_seq + 1,  # type: ignore[operator]
                             reason=str(GenerationReason.SEQ_GAP))
        elif kind == "late":
            self.log.warning("source.late_batch", seq=item.seq, last_seq=self.tracker.last_seq)
            item = msgspec.structs.replace(item, late=True)
        elif kind == "restart" and not counted:
            self._m.restarts_seen.labels(**self._labels).inc()
        if kind != "late":  # a late batch goes to the ledger (logged, never applied) but moves nothing here
            self.tracker.accept(item.seq, item.digest, kind)
        await self._pass_on(item, frames)

    def _drop_duplicate(self, item: ReceivedBatch, *, count: bool = True) -> None:
        if count:
            self._m.duplicates_dropped.labels(**self._labels).inc()
            self.log.debug("source.duplicate_dropped", seq=item.seq)

    # -- decoding and passing on --------------------------------------------------------------

    def _decode(self, frames: list[bytes]) -> ReceivedBatch | DeadLetter:
        self.messages += 1
        self.refused_since_message = 0
        self.last_message_at = now = time.time()
        self._m.messages_received.labels(**self._labels).inc()
        item = decode_message(frames, source_id=self.source_id, engine_id=self.config.engine_id,
                              received_at=now, limits=self._limits)
        return seq_carrying_letter_as_batch(item, frames)

    async def _pass_on(self, item: ReceivedBatch | DeadLetter, frames: list[bytes]) -> None:
        letters = [item] if isinstance(item, DeadLetter) else item.dead_letters
        if isinstance(item, ReceivedBatch):
            self._m.events_received.labels(**self._labels).inc(len(item.events))
        for letter in letters:
            self._m.dead_letters.labels(**self._labels, reason=str(letter.reason)).inc()
            self.log.warning("source.dead_letter", seq=letter.seq, batch_index=letter.batch_index,
                             reason=str(letter.reason), detail=letter.detail[:500])
        if self._record is not None:
            self._record.write(frames, time.time_ns())
        if self._describe is not None and isinstance(item, ReceivedBatch):
            item = msgspec.structs.replace(item, block_key_scheme=str(self._describe))
            self._describe = None
        await self._submit(item)

    # -- replay client ------------------------------------------------------------------------

    async def replay(self, start_seq: int, until: int | None = None, *, yield_to_live: bool = False) -> ReplayResult:
        """Request every buffered batch with seq >= ``start_seq`` and pass each on as it arrives
        (so a long catch-up commits as it goes, and memory stays bounded by back-pressure).

        Never raises on bad replies (they are decoded like live messages: dead letters). vLLM
        ``[seq8, payload]`` replies get this source's topic as their first frame. ``covered``
        counts distinct replayed seqs in ``[start_seq, until)``; ``complete`` is False when
        ``replay_timeout_s`` passed without a reply before the end marker.

        ``yield_to_live`` (the idle probe): when a live message is waiting before the first reply,
        the request is abandoned (not complete, nothing passed on): the answer may hold a newer run
        than the live messages queued before it, which would then look late or like restarts
        (an engine that restarted while the probe waited; a multi-run capture published at once).
        The live path judges those messages and replays what it needs itself.
        """
        endpoint = self.config.replay_endpoint
        if endpoint is None:
            return ReplayResult(0, 0, False)  # not complete: proves nothing
        started = time.perf_counter()
        self._replay_start = start_seq
        dealer = self._replay_socket(endpoint)
        await dealer.send_multipart([b"", pack_seq(start_seq)])
        timeout_ms = int(self._settings.replay_timeout_s * 1000)
        batches, covered, complete, previous, messages = 0, 0, False, None, 0
        first = await self._first_of(dealer, timeout_ms) if yield_to_live and self._sub is not None else "reply"
        if first == "live":
            self.log.info("source.probe_yielded_to_live", start_seq=start_seq)
            self._m.replay_seconds.labels(**self._labels).observe(time.perf_counter() - started)
            self._drop_dealer()  # its answer, if it comes, must not leak into the next replay
            return ReplayResult(0, 0, False)
        while first == "reply" and await dealer.poll(timeout_ms, zmq.POLLIN):
            frames = await dealer.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]
            if is_end_marker(frames):
                complete = True
                break
            messages += 1
            if len(frames) == 2:
                frames = [self._topic, *frames]
            item = self._decode(frames)
            if isinstance(item, ReceivedBatch):
                batches += 1
                if until is not None and start_seq <= item.seq < until and item.seq != previous:
                    covered += 1
                previous = item.seq
            await self._feed_one(item, frames)
        if not complete:
            self._replay_timeouts += 1
            if self._replay_timeout_log.allow("replay"):  # a stopped engine times out at every idle probe
                self.log.warning("source.replay_timeout", start_seq=start_seq, received=batches,
                                 in_a_row=self._replay_timeouts)
            self._drop_dealer()  # late replies must not leak into the next replay
        elif self._replay_timeouts:
            self.log.info("source.replay_answered", after_timeouts=self._replay_timeouts)
            self._replay_timeouts = 0
        self._m.replay_seconds.labels(**self._labels).observe(time.perf_counter() - started)
        return ReplayResult(batches, covered, complete, messages)

    async def _first_of(self, dealer: zmq.asyncio.Socket, timeout_ms: int) -> Literal["reply", "live", "timeout"]:
        """Wait up to ``timeout_ms`` for the replay's first reply or a live message, whichever is
        first; both waiting counts as live (their order cannot be told, and yielding is safe)."""
        poller = zmq.asyncio.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(self._sub, zmq.POLLIN)
        ready = dict(await poller.poll(timeout_ms))
        if self._sub in ready:
            return "live"
        return "reply" if dealer in ready else "timeout"

    def _drop_dealer(self) -> None:
        """Close the replay DEALER (unsent requests and unread replies with it); the next replay
        opens a new one."""
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None
            self._retire("replay")

    def _replay_socket(self, endpoint: str) -> zmq.asyncio.Socket:
        if self._dealer is None:
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.RCVHWM, 0)  # a whole replay buffer must fit
            if self._curve is not None:  # the engine's ROUTER binds: it is the server
                self._curve.configure(dealer, server=False)
            self._watch("replay", dealer)
            dealer.connect(endpoint)
            self._dealer = dealer
        return self._dealer


    # -- handshake counting (socket monitors) ---------------------------------------------------

    def _watch(self, label: str, sock: zmq.asyncio.Socket) -> None:
        self._monitors.append((label, monitor(sock)))  # type: ignore[arg-type]

    def _retire(self, label: str) -> None:
        """The socket ``label`` was closed: its monitor is drained and closed by the watcher."""
        self._retired += [m for m in self._monitors if m[0] == label]
        self._monitors = [m for m in self._monitors if m[0] != label]

    async def _watch_host_names(self, stopping: asyncio.Event) -> None:
        """Resolve the host names of the endpoints this source connects to, at start and every
        :data:`RESOLVE_EVERY_S` while one does not resolve: libzmq retries an unknown name silently,
        so a mistyped host would look like an engine with nothing to say. Logged on each change,
        and ``/healthz`` says ``degraded`` while a name does not resolve (the DNS may come later)."""
        endpoints = () if self.config.bind else (self.config.endpoint, self.config.replay_endpoint or "")
        names = {name for name in map(tcp_host_name, endpoints) if name is not None}
        loop = asyncio.get_running_loop()
        while names and not stopping.is_set():
            failed: dict[str, str] = {}
            for name in sorted(names):
                try:
                    await loop.getaddrinfo(name, None, type=socket.SOCK_STREAM)
                except (OSError, ValueError) as exc:  # ValueError: UnicodeError of a name IDNA refuses
                    failed[name] = str(exc)
            if failed != self.unresolved:
                if failed:
                    self.log.warning("source.host_unresolved", hosts=failed,
                                     hint="the endpoint's host name does not resolve: a typo, or DNS not ready")
                elif self.unresolved:
                    self.log.info("source.host_resolved", hosts=sorted(self.unresolved))
                self.unresolved = failed
            if not failed:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), RESOLVE_EVERY_S)

    async def _watch_handshakes(self) -> None:
        """Count handshake outcomes of this source's sockets until cancelled (by :meth:`run`)."""
        try:
            while True:
                for label, mon in self._retired:
                    await self._drain_monitor(label, mon)
                    mon.close(linger=0)
                self._retired.clear()
                watched = list(self._monitors)
                if not watched:
                    await asyncio.sleep(_POLL_MS / 1000)
                    continue
                poller = zmq.asyncio.Poller()
                for _, mon in watched:
                    poller.register(mon, zmq.POLLIN)
                await poller.poll(_POLL_MS)
                for label, mon in watched:
                    await self._drain_monitor(label, mon)
        finally:
            for _, mon in [*self._monitors, *self._retired]:
                mon.close(linger=0)  # the watched sockets close right after (Source._close)
            self._monitors, self._retired = [], []

    async def _drain_monitor(self, label: str, mon: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = classify(frames)
            if event is None:
                continue
            if event.ok:
                self._m.handshakes.labels(**self._labels, socket=label).inc()
                continue
            self.handshakes_refused += 1
            self.refused_since_message += 1
            on_socket = self._refused_by_socket[label] = self._refused_by_socket.get(label, 0) + 1
            self._m.curve_refused.labels(**self._labels, socket=label, reason=str(event.reason)).inc()
            if self._refusal_log.allow(label):  # peers retry every ~100 ms: first, then every 10 s, per socket
                self.log.warning("source.handshake_refused", socket=label, reason=event.reason,
                                 endpoint=event.endpoint, refused_on_socket=on_socket,
                                 refused_total=self.handshakes_refused,
                                 hint=hint(str(event.reason), curve=self._curve is not None))


def seq_carrying_letter_as_batch(item: ReceivedBatch | DeadLetter, frames: list[bytes]) -> ReceivedBatch | DeadLetter:
    """Work around ``consumer/wire.py`` returning a bare :class:`DeadLetter` for an oversized frame
    whose seq is valid: wrapped in an empty :class:`ReceivedBatch` (as wire.py does for payload-level
    failures), the seq is consumed, so neither the source nor the ledger sees a gap there, and a
    replayed copy is a duplicate (digest = xxh3_64 of the full payload frame)."""
    if not isinstance(item, DeadLetter) or item.seq is None or len(frames) != 3:
        return item
    return ReceivedBatch(item.source_id, item.engine_id, item.seq, 0.0, xxhash.xxh3_64_intdigest(frames[2]), [],
                         None, item.received_at, [item])

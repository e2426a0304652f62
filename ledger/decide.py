"""Decisions: turn what the consumer received into log entries (DESIGN §5).

:class:`Decider` is the only place where continuity is judged: duplicate batch vs. late batch
vs. engine restart (:meth:`Decider._place`), ZMQ sequence gaps, ``event_id`` order per stream,
generation bumps. It emits log
entries through :func:`ledger.apply.apply` one by one, so each decision sees the state left by
the previous one (a batch holding a store and then a removal of the same block applies both).

No I/O: the recorder loads the rows a transaction needs into the :class:`~ledger.apply.Projection`
beforehand and writes the entries afterwards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Literal

import msgspec

from ledger import events as ev
from ledger.apply import LogEntry, Projection, apply
from ledger.types import DeadLetterReason, EngineStatus, GenerationReason, StreamKey

# batch_index of the BatchReceived row; events use 0..n-1 (DESIGN §5 idempotency key).
BATCH_ROW_INDEX = -1
_new = tuple.__new__
DigestLookup = Callable[[str, int, int], int | None]
"""(source_id, source epoch, zmq seq) -> digest of the batch logged there, or None."""
EarlierDigests = Callable[[str, int, int], Iterable[int]]
"""(source_id, source epoch, zmq seq) -> digests of the batches logged at that seq in the
:data:`EARLIER_EPOCHS_CHECKED` epochs before that epoch."""
EARLIER_EPOCHS_CHECKED = 16
"""A batch at or below the source's last seq whose (seq, digest) is logged in one of this many
epochs before the current one is a duplicate, not a new run. Epochs end at engine restarts, and
a copy of an older run's batch can only come from the network or from a consumer that re-fed
what it had passed on (the engine's replay buffer holds only its current run), so the few epochs
just before the current one are where such a copy is found; the bound keeps the look-up at one
statement of at most this many index probes, however often the engine restarted."""


_ANOTHER_RUN = (0, True)
"""What :meth:`Decider._place` returns for a late batch of an engine run the ledger moved past."""


def _no_earlier_digests(source_id: str, epoch: int, seq: int) -> Iterable[int]:
    return ()


class Loss(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One loss of continuity a transaction logged, for the consumer's logs and labelled metrics.

    ``kind`` "gap": ``[expected, got)`` were lost (ZMQ seqs for ``seq_gap``, ``event_id``s for
    ``event_id_gap``; for ``event_id_regression`` ``got`` is the older ``event_id`` that arrived
    after ``expected - 1``). ``kind`` "bump": the engine's generation went to ``generation``.
    ``reason`` is an enum value (bounded: it labels metrics); ``source_id`` is None for a bump
    that no source caused (``engine_started``).
    """

    kind: Literal["gap", "bump"]
    engine_id: str
    source_id: str | None
    reason: GenerationReason
    expected: int | None = None
    got: int | None = None
    generation: int | None = None


@dataclasses.dataclass
class AppendResult:
    """What one transaction did, for the consumer's metrics. Counts are events unless named.

    Crosses the writer process's socket as msgpack (``ledger/writer_process.py``): fields must be
    types msgspec encodes and decodes.
    """

    batches: int = 0
    duplicate_batches: int = 0
    events_applied: int = 0
    events_stale: int = 0
    stale_batches: int = 0
    """Batches logged and not applied: late batches of the current run (see :meth:`Decider._place`)."""
    events_duplicate: int = 0
    dead_letters: int = 0
    gaps: int = 0
    generation_bumps: int = 0
    first_seq: int | None = None
    last_seq: int | None = None
    max_event_ts: float | None = None
    losses: list[Loss] = dataclasses.field(default_factory=list)
    """Each gap and generation bump, in the order logged (``gaps``/``generation_bumps`` count them)."""
    log_lock_wait_s: float | None = None
    """Seconds this transaction waited for the backend's log lock (PostgreSQL's ``LOCK TABLE log``,
    :meth:`ledger.backends.base.Backend.lock_log`): the time spent behind other writers' commits.
    None where the backend takes no such lock (SQLite: its one writer takes the write lock at
    ``BEGIN IMMEDIATE``, before the transaction is handed to the recorder); summed by :meth:`merge`."""

    def merge(self, other: AppendResult) -> None:
        """Add ``other``'s counts and losses to these (a subclass's own fields are its own)."""
        for field in dataclasses.fields(AppendResult):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if field.name == "losses":
                mine.extend(theirs)
            elif field.name == "log_lock_wait_s":
                if theirs is not None:
                    setattr(self, field.name, (mine or 0.0) + theirs)
            elif isinstance(mine, int) and field.name not in ("first_seq", "last_seq"):
                setattr(self, field.name, mine + theirs)


class Decider:
    """Turns inputs into log entries, applying each to ``proj`` as it is emitted."""

    def __init__(self, proj: Projection, next_seq: int, now: float, logged_digest: DigestLookup,
                 earlier_digests: EarlierDigests = _no_earlier_digests) -> None:
        self.proj = proj
        self.next_seq = next_seq
        self.now = now
        self.entries: list[LogEntry] = []
        self.result = AppendResult()
        self._logged_digest = logged_digest
        self._earlier_digests = earlier_digests
        self._digests: dict[tuple[str, int, int], int] = {}
        """(source_id, epoch, seq) -> digest of the batches logged by this transaction (not yet
        in the database, where the look-ups read)."""

    # -- emission --------------------------------------------------------------------------

    def emit(self, body: ev.AnyBody, type_name: str | None = None, **columns) -> LogEntry:
        entry = LogEntry(seq=self.next_seq, committed_at=self.now, body=body,
                         type_name=type_name or ev.kind_of(body), **columns)
        self._record(entry)
        return entry

    def _record(self, entry: LogEntry) -> None:
        self.next_seq += 1
        apply(self.proj, entry)
        self.entries.append(entry)
        if self.result.first_seq is None:
            self.result.first_seq = entry.seq
        self.result.last_seq = entry.seq

    def ensure_engine(self, engine_id: str) -> None:
        if engine_id not in self.proj.engines:
            self.emit(ev.EngineRegistered(engine_id=engine_id, generation=1), engine_id=engine_id)

    def bump(self, engine_id: str, reason: GenerationReason, source_id: str | None = None) -> None:
        """Bump the engine's generation; ``source_id`` is the source whose input showed the loss."""
        generation = self.proj.engines[engine_id].generation + 1
        self.emit(ev.GenerationBumped(engine_id=engine_id, generation=generation, reason=reason), engine_id=engine_id)
        self.result.generation_bumps += 1
        self.result.losses.append(Loss("bump", engine_id, source_id, reason, generation=generation))

    def gap(self, engine_id: str, source_id: str | None, reason: GenerationReason, expected: int, got: int,
            stream: StreamKey | None = None, *, bump: bool = True) -> None:
        """Log a gap and, unless ``bump`` is False (a bump for the same loss was just logged),
        bump the generation."""
        self.emit(ev.GapDetected(engine_id=engine_id, source_id=source_id, reason=reason, expected=expected, got=got,
                                 attention_dp_rank=stream.attention_dp_rank if stream else None,
                                 window_size=stream.window_size if stream else None), engine_id=engine_id)
        self.result.gaps += 1
        self.result.losses.append(Loss("gap", engine_id, source_id, reason, expected, got))
        if bump:
            self.bump(engine_id, reason, source_id)

    # -- inputs ----------------------------------------------------------------------------

    def handle(self, item: ev.ReceivedBatch | ev.DeadLetter | ev.GapReport) -> None:
        if isinstance(item, ev.ReceivedBatch):
            self.ingest(item)
        elif isinstance(item, ev.DeadLetter):
            self.ensure_engine(item.engine_id)
            self.dead_letter(item, epoch=None)
        elif isinstance(item, ev.GapReport):
            self.ensure_engine(item.engine_id)
            self.gap(item.engine_id, item.source_id, item.reason, item.from_seq, item.to_seq)
        else:
            raise TypeError(f"cannot append {type(item).__name__}")

    def ingest(self, batch: ev.ReceivedBatch) -> None:
        """Accept one ZMQ message: duplicate check, restart/gap detection, then its events."""
        self.ensure_engine(batch.engine_id)
        if batch.block_key_scheme is not None:
            self.emit(ev.EngineDescribed(engine_id=batch.engine_id, block_key_scheme=batch.block_key_scheme),
                      engine_id=batch.engine_id)
        placed = self._place(batch)
        if placed is None:
            self.result.duplicate_batches += 1
            self.result.events_duplicate += len(batch.events)
            return
        if placed is _ANOTHER_RUN:
            self._dead_letter_batch(batch, DeadLetterReason.LATE_FROM_ANOTHER_RUN,
                                    f"late batch at seq {batch.seq}, which the ledger holds another payload for: "
                                    "of an engine run the ledger has moved past (never applied)")
            return
        epoch, stale = placed
        source_cols = {"source_id": batch.source_id, "source_epoch": epoch, "zmq_seq": batch.seq}
        self.emit(ev.BatchReceived(source_id=batch.source_id, engine_id=batch.engine_id, source_epoch=epoch,
                                   seq=batch.seq, ts=batch.ts, digest=batch.digest, num_events=len(batch.events),
                                   attention_dp_rank=batch.attention_dp_rank),
                  engine_id=batch.engine_id, batch_index=BATCH_ROW_INDEX, **source_cols)
        self._digests[(batch.source_id, epoch, batch.seq)] = batch.digest
        self.result.batches += 1
        self.result.stale_batches += stale
        ts = self.result.max_event_ts
        self.result.max_event_ts = batch.ts if ts is None else max(ts, batch.ts)
        for index, event in enumerate(batch.events):
            self._engine_event(batch.engine_id, index if event.batch_index is None else event.batch_index,
                               event, source_cols, stale)
        for letter in batch.dead_letters:
            self.dead_letter(letter, epoch)

    def _dead_letter_batch(self, batch: ev.ReceivedBatch, reason: DeadLetterReason, detail: str) -> None:
        """Every event of a batch that cannot be logged as a batch into the dead-letter table
        (each with its raw bytes and index; one letter for an empty batch), and the batch's own
        dead letters as they are."""
        letters = [ev.DeadLetter(batch.source_id, batch.engine_id, reason, detail, event.raw, batch.seq,
                                 index if event.batch_index is None else event.batch_index)
                   for index, event in enumerate(batch.events)]
        if not batch.events and not batch.dead_letters:
            letters.append(ev.DeadLetter(batch.source_id, batch.engine_id, reason, detail, b"", batch.seq))
        for letter in [*letters, *batch.dead_letters]:
            self.dead_letter(letter, epoch=None)

    def dead_letter(self, letter: ev.DeadLetter, epoch: int | None) -> None:
        cols = {}
        if epoch is not None:
            cols = {"source_id": letter.source_id, "source_epoch": epoch, "zmq_seq": letter.seq,
                    "batch_index": letter.batch_index}
        self.emit(ev.EventDeadLettered(source_id=letter.source_id, engine_id=letter.engine_id, reason=letter.reason,
                                       detail=letter.detail, seq=letter.seq, batch_index=letter.batch_index),
                  engine_id=letter.engine_id, payload=letter.raw, **cols)
        self.result.dead_letters += 1

    # -- continuity ------------------------------------------------------------------------

    def _place(self, batch: ev.ReceivedBatch) -> tuple[int, bool] | None:
        """(source epoch, stale) for this batch, or None for a duplicate (a no-op).

        ``stale`` batches are logged and never applied: nothing in them may change a projection
        (DESIGN §5: a late Stored(A) must not resurrect A after Removed(A)). A batch whose seq is
        past the source's last one is new (a gap before it is logged, generation bumped), unless
        the consumer proved a restart (``new_run``). At or below the last seq, in this order:

        1. its digest is the logged batch's at that seq in this epoch: a duplicate (a re-sent or
           re-fed batch; the idempotency key is per epoch, the batch's identity is (source, seq, digest));
        2. ``new_run`` (the consumer proved a restart): a new epoch (:meth:`_new_epoch`), even when
           an earlier epoch logged the same (seq, digest): a run that publishes byte for byte what
           an earlier one did (a capture published again) is still a new run;
        2a. its digest is the logged batch's at that seq in one of the :data:`EARLIER_EPOCHS_CHECKED`
           epochs before: a duplicate (a copy of an earlier run's batch, re-sent or re-fed);
        3. nothing logged at that seq in this epoch (a seq declared lost, or before the first one
           received): a late batch of this run, logged stale in this epoch without moving the
           source position. ``late`` (the consumer proved the engine did not restart) needs no
           more; without that proof it may also be a restarted engine's batch landing on that seq,
           so the generation is bumped (fail closed);
        4. another digest logged at that seq: the engine restarted (its seq starts again at 0), a
           new epoch; unless the consumer says ``late`` (it proved the engine did not restart), or
           the batch was stamped (engine ``ts``) before the newest batch the ledger logged from
           this source (a stale one included: ``sources.last_ts``), which no first batch of a new run is (unless the engine's clock stepped back: then this fails
           closed too). One run publishes one payload per seq, so such a batch is of a run the
           ledger has moved past (a late batch of the current run whose seq the ledger holds
           another run's batch at, or a straggler of an earlier run). It cannot be logged at that
           seq in this epoch, must not be applied, and must not move the source position (the
           next batches of the current run would then be logged twice): its events go to the
           dead-letter table (``late_from_another_run``), and without the consumer's proof the
           generation is bumped (fail closed).
        """
        source = self.proj.sources.get(batch.source_id)
        if source is None:
            return 1, False
        epoch, last_seq = source.epoch, source.last_seq
        if source.engine_id != batch.engine_id:
            raise ValueError(f"source {batch.source_id!r} is bound to engine {source.engine_id!r}, "
                             f"not {batch.engine_id!r}")
        if batch.seq > last_seq and not batch.new_run:
            if batch.seq > last_seq + 1:
                self.gap(batch.engine_id, batch.source_id, GenerationReason.SEQ_GAP, last_seq + 1, batch.seq)
            return epoch, False
        logged = self._digest_at(batch.source_id, epoch, batch.seq)
        if logged == batch.digest:
            return None
        if batch.new_run:  # before the earlier epochs: a run may publish what an earlier one did
            return self._new_epoch(batch, epoch), False
        if self._logged_earlier(batch, epoch):
            return None
        if logged is None:
            if not batch.late:
                self.bump(batch.engine_id, GenerationReason.SEQ_RESET, batch.source_id)
            return epoch, True
        if batch.late or 0 < batch.ts < source.last_ts:
            if not batch.late:
                self.bump(batch.engine_id, GenerationReason.SEQ_RESET, batch.source_id)
            return _ANOTHER_RUN
        return self._new_epoch(batch, epoch), False

    def _new_epoch(self, batch: ev.ReceivedBatch, epoch: int) -> int:
        """An engine restart: bump the generation and, when the new run is first heard of past
        its seq 0, log the gap ``[0, seq)`` (what the engine's replay buffer no longer held).

        A restart the consumer already reported (``restart_logged``: an idle probe proved it
        before the new run published anything) is not bumped twice while the engine is still
        ``resyncing`` (no event applied since that bump: nothing was trusted in between)."""
        engine = self.proj.engines[batch.engine_id]
        if not (batch.restart_logged and engine.status == EngineStatus.RESYNCING):
            self.bump(batch.engine_id, GenerationReason.SEQ_RESET, batch.source_id)
        if batch.seq > 0:
            self.gap(batch.engine_id, batch.source_id, GenerationReason.SEQ_GAP, 0, batch.seq, bump=False)
        return epoch + 1

    def _digest_at(self, source_id: str, epoch: int, seq: int) -> int | None:
        logged = self._digests.get((source_id, epoch, seq))
        return self._logged_digest(source_id, epoch, seq) if logged is None else logged

    def _logged_earlier(self, batch: ev.ReceivedBatch, epoch: int) -> bool:
        """True if (seq, digest) is logged in one of the epochs just before ``epoch``."""
        if epoch <= 1:
            return False
        for earlier in range(max(1, epoch - EARLIER_EPOCHS_CHECKED), epoch):
            if self._digests.get((batch.source_id, earlier, batch.seq)) == batch.digest:
                return True
        return batch.digest in self._earlier_digests(batch.source_id, epoch, batch.seq)

    def _engine_event(self, engine_id: str, index: int, event: ev.EngineEvent, source_cols: dict,
                      stale: bool = False) -> None:
        stream = _new(StreamKey, (engine_id, event.attention_dp_rank, event.window_size))
        row = self.proj.streams.get(stream)
        has_baseline = row is not None and row.last_event_id is not None and not row.resync
        applied = not stale
        if stale:
            pass  # a late batch: logged as received, judged by nothing in it (see _place)
        elif isinstance(event.body, ev.EngineCreated):
            if has_baseline:
                self.bump(engine_id, GenerationReason.CREATED, source_cols["source_id"])
        elif event.event_id is not None and has_baseline:
            last = row.last_event_id  # type: ignore[union-attr]
            if event.event_id <= last:
                # An older event must not resurrect a removed block, so it is not applied. It is
                # also the trace of an engine restart whose `created` was lost (its event_ids start
                # again): we cannot tell which, so continuity is declared lost (fail closed).
                applied = False
                self.gap(engine_id, source_cols["source_id"], GenerationReason.EVENT_ID_REGRESSION, last + 1,
                         event.event_id, stream)
            elif event.event_id > last + 1:
                self.gap(engine_id, source_cols["source_id"], GenerationReason.EVENT_ID_GAP, last + 1,
                         event.event_id, stream)
        if applied and isinstance(event.body, ev.AllBlocksCleared):
            self.bump(engine_id, GenerationReason.ALL_BLOCKS_CLEARED, source_cols["source_id"])
        # Positional LogEntry (one per engine event on the ingest path; kwargs cost ~1 µs more):
        # seq, committed_at, body, type_name, engine_id, source_id, source_epoch, zmq_seq,
        # batch_index, event_id, attention_dp_rank, window_size, applied, payload.
        self._record(LogEntry(self.next_seq, self.now, event.body, event.type_name or ev.kind_of(event.body), engine_id,
                              source_cols["source_id"], source_cols["source_epoch"], source_cols["zmq_seq"], index,
                              event.event_id, event.attention_dp_rank, event.window_size, applied, event.raw))
        if applied:
            self.result.events_applied += 1
        else:
            self.result.events_stale += 1

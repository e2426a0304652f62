"""Decisions: turn what the consumer received into log entries (DESIGN §5).

:class:`Decider` is the only place where continuity is judged: duplicate batch vs. engine
restart, ZMQ sequence gaps, ``event_id`` order per stream, generation bumps. It emits log
entries through :func:`ledger.apply.apply` one by one, so each decision sees the state left by
the previous one (a batch holding a store and then a removal of the same block applies both).

No I/O: the recorder loads the rows a transaction needs into the :class:`~ledger.apply.Projection`
beforehand and writes the entries afterwards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ledger import events as ev
from ledger.apply import LogEntry, Projection, apply
from ledger.types import GenerationReason, StreamKey

# batch_index of the BatchReceived row; events use 0..n-1 (DESIGN §5 idempotency key).
BATCH_ROW_INDEX = -1
_new = tuple.__new__
DigestLookup = Callable[[str, int, int], int | None]


@dataclasses.dataclass
class AppendResult:
    """What one transaction did, for the consumer's metrics. Counts are events unless named."""

    batches: int = 0
    duplicate_batches: int = 0
    events_applied: int = 0
    events_stale: int = 0
    events_duplicate: int = 0
    dead_letters: int = 0
    gaps: int = 0
    generation_bumps: int = 0
    first_seq: int | None = None
    last_seq: int | None = None
    max_event_ts: float | None = None

    def merge(self, other: AppendResult) -> None:
        for field in dataclasses.fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if isinstance(mine, int) and field.name not in ("first_seq", "last_seq"):
                setattr(self, field.name, mine + theirs)


class Decider:
    """Turns inputs into log entries, applying each to ``proj`` as it is emitted."""

    def __init__(self, proj: Projection, next_seq: int, now: float, logged_digest: DigestLookup) -> None:
        self.proj = proj
        self.next_seq = next_seq
        self.now = now
        self.entries: list[LogEntry] = []
        self.result = AppendResult()
        self._logged_digest = logged_digest
        self._digests: dict[tuple[str, int, int], int] = {}

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

    def bump(self, engine_id: str, reason: GenerationReason) -> None:
        generation = self.proj.engines[engine_id]["generation"] + 1
        self.emit(ev.GenerationBumped(engine_id=engine_id, generation=generation, reason=reason), engine_id=engine_id)
        self.result.generation_bumps += 1

    def gap(self, engine_id: str, source_id: str | None, reason: GenerationReason, expected: int, got: int,
            stream: StreamKey | None = None) -> None:
        self.emit(ev.GapDetected(engine_id=engine_id, source_id=source_id, reason=reason, expected=expected, got=got,
                                 attention_dp_rank=stream.attention_dp_rank if stream else None,
                                 window_size=stream.window_size if stream else None), engine_id=engine_id)
        self.result.gaps += 1
        self.bump(engine_id, reason)

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
        epoch = self._source_epoch(batch)
        if epoch is None:
            self.result.duplicate_batches += 1
            self.result.events_duplicate += len(batch.events)
            return
        source_cols = {"source_id": batch.source_id, "source_epoch": epoch, "zmq_seq": batch.seq}
        self.emit(ev.BatchReceived(source_id=batch.source_id, engine_id=batch.engine_id, source_epoch=epoch,
                                   seq=batch.seq, ts=batch.ts, digest=batch.digest, num_events=len(batch.events),
                                   attention_dp_rank=batch.attention_dp_rank),
                  engine_id=batch.engine_id, batch_index=BATCH_ROW_INDEX, **source_cols)
        self._digests[(batch.source_id, epoch, batch.seq)] = batch.digest
        self.result.batches += 1
        ts = self.result.max_event_ts
        self.result.max_event_ts = batch.ts if ts is None else max(ts, batch.ts)
        for index, event in enumerate(batch.events):
            self._engine_event(batch.engine_id, index if event.batch_index is None else event.batch_index,
                               event, source_cols)
        for letter in batch.dead_letters:
            self.dead_letter(letter, epoch)

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

    def _source_epoch(self, batch: ev.ReceivedBatch) -> int | None:
        """The source epoch this batch belongs to, or None for a duplicate (a no-op).

        A seq at or below the last accepted one is a duplicate when its payload digest equals
        the logged batch's; otherwise the engine restarted (its seq starts again at 0), or a batch
        already declared lost arrived late — either way our knowledge is no longer continuous,
        so the generation is bumped (fail closed).
        """
        source = self.proj.sources.get(batch.source_id)
        if source is None:
            return 1
        epoch, last_seq = source["epoch"], source["last_seq"]
        if source["engine_id"] != batch.engine_id:
            raise ValueError(f"source {batch.source_id!r} is bound to engine {source['engine_id']!r}, "
                             f"not {batch.engine_id!r}")
        if batch.seq <= last_seq:
            key = (batch.source_id, epoch, batch.seq)
            logged = self._digests.get(key)
            if logged is None:
                logged = self._logged_digest(*key)
            if logged == batch.digest:
                return None
            self.bump(batch.engine_id, GenerationReason.SEQ_RESET)
            return epoch + 1
        if batch.seq > last_seq + 1:
            self.gap(batch.engine_id, batch.source_id, GenerationReason.SEQ_GAP, last_seq + 1, batch.seq)
        return epoch

    def _engine_event(self, engine_id: str, index: int, event: ev.EngineEvent, source_cols: dict) -> None:
        stream = _new(StreamKey, (engine_id, event.attention_dp_rank, event.window_size))
        row = self.proj.streams.get(stream)
        has_baseline = row is not None and row["last_event_id"] is not None and not row["resync"]
        applied = True
        if isinstance(event.body, ev.EngineCreated):
            if has_baseline:
                self.bump(engine_id, GenerationReason.CREATED)
        elif event.event_id is not None and has_baseline:
            last = row["last_event_id"]  # type: ignore[index]
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
            self.bump(engine_id, GenerationReason.ALL_BLOCKS_CLEARED)
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

"""Each gap and generation bump a transaction logs comes back in ``AppendResult.losses`` with its
engine, source, reason and seqs (ledger/decide.py ``Loss``), through every writer the daemon can run:
the SQLite writer process (msgpack across its socket), the writer thread, and PostgreSQL. The
consumer labels its continuity metrics and log lines with them (consumer/daemon.py)."""

from __future__ import annotations

import pytest

from ledger import events as ev
from ledger.decide import AppendResult, Loss
from ledger.types import GenerationReason
from ledger.writer import LedgerWriter
from tools.harness.builders import batch, stored


@pytest.fixture(params=["process", "thread", "postgresql"])
def writer_db(request, tmp_path) -> tuple[str, bool]:
    """(database URL, process) for each writer mode."""
    if request.param == "postgresql":
        return request.getfixturevalue("postgres_db"), False
    return request.getfixturevalue("sqlite_db"), request.param == "process"


async def test_each_loss_names_its_engine_source_reason_and_seqs(writer_db):
    db, process = writer_db
    writer = await LedgerWriter.open(db, process=process)
    try:
        first = await writer.append([batch(0, stored(1), engine_id="a", source_id="a-src"),
                                     batch(0, stored(2), engine_id="b", source_id="b-src")])
        assert first.losses == [] and first.gaps == first.generation_bumps == 0
        # engine b loses seqs 1..4; engine a goes on without a loss in the same transaction
        result = await writer.append([batch(1, stored(3), engine_id="a", source_id="a-src"),
                                      batch(5, stored(4), engine_id="b", source_id="b-src")])
        report = await writer.append([ev.GapReport(source_id="b-src", engine_id="b", from_seq=0, to_seq=7,
                                                   reason=GenerationReason.SEQ_GAP)])
    finally:
        await writer.close()
    assert result.losses == [Loss("gap", "b", "b-src", GenerationReason.SEQ_GAP, expected=1, got=5),
                             Loss("bump", "b", "b-src", GenerationReason.SEQ_GAP, generation=2)]
    assert (result.gaps, result.generation_bumps) == (1, 1)
    assert report.losses == [Loss("gap", "b", "b-src", GenerationReason.SEQ_GAP, expected=0, got=7),
                             Loss("bump", "b", "b-src", GenerationReason.SEQ_GAP, generation=3)]


def test_merge_keeps_every_loss_in_order():
    gap = Loss("gap", "a", "s", GenerationReason.EVENT_ID_GAP, expected=3, got=9)
    bump = Loss("bump", "a", "s", GenerationReason.EVENT_ID_GAP, generation=2)
    total, other = AppendResult(gaps=1, losses=[gap]), AppendResult(generation_bumps=1, losses=[bump])
    total.merge(other)
    assert total.losses == [gap, bump] and (total.gaps, total.generation_bumps) == (1, 1)
    assert other.losses == [bump]

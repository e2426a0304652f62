"""``replay`` of a ledger that consumers keep writing: the log it folds and the projections it
compares are read at ONE moment. On PostgreSQL each statement of a READ COMMITTED transaction sees
the latest commit, so a batch committed while the log was being folded showed up in the live
projections only, and a sound ledger was reported as differing (exit 1: "a bug")."""

from __future__ import annotations

import asyncio

import pytest

from ledger.replay import replay
from ledger.writer import LedgerWriter
from tools.harness.builders import batch, record, removed, stored


@pytest.mark.parametrize("ledger", ["sqlite_db", "postgres_db"])
def test_a_batch_committed_during_the_fold_does_not_make_the_audit_differ(ledger: str, request) -> None:
    db = request.getfixturevalue(ledger)
    record(db, *([batch(seq, stored(seq * 10 + 1, seq * 10 + 2), removed(seq * 10 - 9) if seq else stored(5))]
                 for seq in range(40)))
    written, calls = [], []

    def write_once(folded: int, total: int | None) -> None:
        calls.append(folded)
        if written or len(calls) < 2:  # the 2nd call: the fold's end (one page here), the log read
            return

        async def append() -> None:
            writer = await LedgerWriter.open(db)
            try:
                await writer.append([batch(40, stored(999_001, 999_002))])
            finally:
                await writer.close()
        asyncio.run(append())  # another writer commits while the audit folds
        written.append(folded)

    report = replay(db, progress=write_once)
    assert written, "the write during the fold did not happen"
    assert report.compared and report.equal, report.diffs
    assert replay(db).equal  # and the next audit sees the batch in both

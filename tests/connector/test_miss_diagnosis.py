"""A miss's diagnosis (``connector.lookup.MissDiagnosis``) runs in the background, after the lookup:
it explains what the lookup saw, not what the ledger gained since — e.g. the request's own donor,
registered when it finished (not saved yet), must not turn a ``no_donor`` miss into
``donor_not_saved`` (a TP=2/TP=1 harness test saw exactly that under load). Real SQLite ledger."""

from __future__ import annotations

from types import SimpleNamespace

from connector.donor_store import FileDonorStore
from connector.lookup import MissDiagnosis
from ledger import events as ev
from ledger.client import LedgerClient
from ledger.types import FreshnessPolicy

KEY = b"k" * 16


def test_a_donor_registered_after_the_lookup_does_not_explain_its_miss(sqlite_db: str, tmp_path) -> None:
    ledger = LedgerClient(sqlite_db)
    try:
        seen = ledger.last_seq()  # what the lookup saw: no donor of this key
        ledger.register_donor(ev.DonorRegistered(donor_id="own", namespace="ns", engine_id="C", generation=1,
                                                 content_keys=[KEY], block_hashes=[1], num_tokens=8,
                                                 tokens_per_block=8))  # then the request's own, unsaved
        diagnosis = MissDiagnosis(ledger, FileDonorStore(tmp_path, 2**20))
        ns = SimpleNamespace(digest="ns", fields={})
        explain = lambda as_of: diagnosis.explain(ns, [KEY], 0, None, FreshnessPolicy.STORE, as_of)  # noqa: E731
        assert explain(seen) == ("no_donor", None)
        assert explain(None) == ("donor_not_saved", None)  # without the lookup's seq: today's state
        assert explain(ledger.last_seq()) == ("donor_not_saved", None)  # seen by the lookup: it explains
    finally:
        ledger.close()

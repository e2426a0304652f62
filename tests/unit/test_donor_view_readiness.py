"""DonorView.ready: a catch-up that is late keeps the view in use longer than one that fails."""

from __future__ import annotations

import time

from ledger.donor_view import DonorView


def caught_up_view(**kw) -> DonorView:  # noqa: ANN003
    view = DonorView(**kw)
    view.changed(1, [], [], [], lambda row: ([], [], []))  # an empty ledger, read at seq 1
    return view


def test_a_late_catch_up_keeps_the_view_until_max_staleness() -> None:
    view = caught_up_view(max_staleness_s=30.0, max_failing_s=0.02)  # 30 s: a loaded machine's sleep overruns
    time.sleep(0.05)
    assert view.ready  # late (e.g. behind a lease write), not failing


def test_a_failing_catch_up_takes_the_view_out_of_use_after_max_failing() -> None:
    view = caught_up_view(max_staleness_s=0.3, max_failing_s=0.02)
    view.catch_up_failed()
    time.sleep(0.05)
    assert not view.ready
    view.changed(2, [], [], [], lambda row: ([], [], []))  # the ledger answers again
    assert view.ready


def test_a_view_never_loaded_is_not_ready() -> None:
    assert not DonorView().ready

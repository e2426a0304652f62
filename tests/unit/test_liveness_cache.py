"""LivenessCache on its own: what a block row does, what the cursor refuses, what is not decoded."""

from __future__ import annotations

import threading

from ledger import events as ev
from ledger.liveness import LivenessCache

STREAM = ("engine-a", 0, 0)


def removal(seq: int, *hashes: int, engine_id: str = "engine-a") -> tuple:
    body = ev.BODY_ENCODER.encode(ev.BlockRemoved(block_hashes=list(hashes)))
    return (seq, "block_removed", engine_id, 0, 0, body)


def store(seq: int, *hashes: int) -> tuple:
    body = ev.BODY_ENCODER.encode(ev.BlockStored(parent_hash=None, blocks=[
        ev.StoredBlock(block_hash=h, num_tokens=4, tokens_digest=0) for h in hashes]))
    return (seq, "block_stored", "engine-a", 0, 0, body)


def blocks(*hashes: int) -> list[tuple[int, bytes]]:
    return [(h, b"") for h in hashes]


def test_removed_and_stored_rows_move_the_live_prefix() -> None:
    cache = LivenessCache()
    assert cache.put("d1", STREAM, blocks(1, 2, 3, 4), [True] * 4, read_at_seq=10)
    assert cache.put("d2", STREAM, blocks(9, 3), [True, True], read_at_seq=10)  # shares block 3 (position 1)
    assert cache.live_prefix("d1", 4) == 4 and cache.live_prefix("d1", 9) == 4
    cache.apply([removal(11, 3)], upto_seq=12)
    assert cache.live_prefix("d1", 4) == 2 and cache.live_prefix("d2", 2) == 1
    assert cache.live_prefix("d1", 1) == 1  # fewer blocks asked: they are all live
    cache.apply([store(11, 3)], upto_seq=12)  # at or below the cursor: already applied, ignored
    assert cache.live_prefix("d1", 4) == 2
    cache.apply([removal(13, 1, engine_id="engine-b"), store(14, 3)], upto_seq=14)
    assert cache.live_prefix("d1", 4) == 4 and cache.live_prefix("d2", 2) == 2  # stored again: live again
    assert cache.live_prefix("unknown", 1) is None


def test_blocks_stored_after_the_donor_was_read_come_alive() -> None:
    """The consumer may commit a donor's blocks after the donor itself (the engine's events lag)."""
    cache = LivenessCache()
    cache.put("d1", STREAM, blocks(1, 2), [False, False], read_at_seq=5)
    assert cache.live_prefix("d1", 2) == 0
    cache.apply([store(6, 1, 2)], upto_seq=6)
    assert cache.live_prefix("d1", 2) == 2


def test_a_read_older_than_the_cursor_is_not_watched() -> None:
    cache = LivenessCache()
    cache.put("d0", STREAM, blocks(5), [True], read_at_seq=1)
    cache.apply([], upto_seq=20)
    assert not cache.put("d1", STREAM, blocks(1, 2), [True, True], read_at_seq=19)  # rows in (19, 20] unseen
    assert cache.live_prefix("d1", 2) is None
    assert cache.put("d1", STREAM, blocks(1, 2), [True, True], read_at_seq=20)


def test_a_clear_kills_the_engine_and_unwatched_engines_are_not_decoded() -> None:
    cache = LivenessCache()
    cache.put("d1", STREAM, blocks(1, 2), [True, True], read_at_seq=0)
    cache.put("d2", ("engine-b", 0, 0), blocks(1, 2), [True, True], read_at_seq=0)
    cache.apply([(1, "all_blocks_cleared", "engine-a", 0, 0, b""),
                 (2, "block_removed", "engine-c", 0, 0, b"not msgpack")], upto_seq=2)
    assert cache.live_prefix("d1", 2) == 0 and cache.live_prefix("d2", 2) == 2
    cache.forget("d1")
    cache.forget("d2")
    assert cache.stats() == {"donors": 0, "blocks": 0}
    cache.apply([removal(3, 1)], upto_seq=3)  # nothing watched on engine-a any more: not decoded
    assert cache.cursor == 3


class _GatedBody:
    """A row body whose bytes are handed over only when the test says so (a slow decode)."""

    def __init__(self, body: bytes) -> None:
        self.body, self.entered, self.release = body, threading.Event(), threading.Event()

    def __bytes__(self) -> bytes:
        self.entered.set()
        assert self.release.wait(10)
        return self.body


def test_lookups_do_not_wait_for_a_catch_up_decoding_its_rows() -> None:
    """A catch-up of many block rows decodes them before taking the lock: a lookup's
    ``live_prefix`` meanwhile answers from the state before the catch-up, at once."""
    cache = LivenessCache()
    cache.put("d1", STREAM, blocks(1, 2), [True, True], read_at_seq=1)
    seq, kind, engine_id, dp_rank, window, body = removal(2, 2)
    gated = _GatedBody(body)
    catch_up = threading.Thread(target=cache.apply, args=([(seq, kind, engine_id, dp_rank, window, gated)], 2))
    catch_up.start()
    try:
        assert gated.entered.wait(10)
        answered: list[int | None] = []
        lookup = threading.Thread(target=lambda: answered.append(cache.live_prefix("d1", 2)))
        lookup.start()
        lookup.join(5)
        assert answered == [2], "live_prefix waited for the catch-up's decoding"
    finally:
        gated.release.set()
        catch_up.join(10)
    assert cache.live_prefix("d1", 2) == 1 and cache.cursor == 2


def test_a_donor_put_during_a_catch_up_waits_for_it_and_is_refused_if_its_read_is_older() -> None:
    """A donor read at seq 1 and put while rows up to seq 2 are being decoded would miss the
    removal at seq 2 of a block only it holds: the put waits, then is refused (read older than the
    cursor), so the view never serves it on that read."""
    cache = LivenessCache()
    cache.put("d0", STREAM, blocks(5), [True], read_at_seq=1)  # makes engine-a's rows decoded
    seq, kind, engine_id, dp_rank, window, body = removal(2, 7)
    gated = _GatedBody(body)
    catch_up = threading.Thread(target=cache.apply, args=([(seq, kind, engine_id, dp_rank, window, gated)], 2))
    catch_up.start()
    accepted: list[bool] = []
    assert gated.entered.wait(10)
    put = threading.Thread(target=lambda: accepted.append(
        cache.put("d1", STREAM, blocks(7), [True], read_at_seq=1)))
    put.start()
    put.join(0.1)
    assert put.is_alive(), "put did not wait for the catch-up"
    gated.release.set()
    catch_up.join(10)
    put.join(10)
    assert accepted == [False] and cache.live_prefix("d1", 1) is None

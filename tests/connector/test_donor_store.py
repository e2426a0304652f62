"""The host-local donor store: verified reads, atomic publish (a crash mid-save leaves no entry),
capacity bound that never evicts a leased donor, lifecycle facts in the ledger."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from connector import donor_store
from connector.donor_store import ChecksumMismatch, EntryMissing, FileDonorStore, StoreFull
from ledger import events as ev
from ledger.client import LedgerClient

LAYERS, BLOCKS, ELEMS = 3, 4, 16


def layers(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((BLOCKS, 2, ELEMS), dtype=np.float32) for _ in range(LAYERS)]


def header(probe: str | None = None) -> dict:
    return {"namespace": "ns", "num_layers": LAYERS, "kv_factor": 2, "block_elems": ELEMS, "dtype": "float32",
            "itemsize": 4, "num_blocks": BLOCKS, "tokens_per_block": 8, "probe": probe,
            "namespace_fields": {"cache_salt": "none"}}


def test_put_open_read_verified_round_trip(tmp_path: Path) -> None:
    store = FileDonorStore(tmp_path, 2**20)
    data = layers(1)
    entry = store.put("d1", data, header(probe="p1"))
    assert entry.ref == "d1.kv" and entry.size_bytes == store.size_of("d1.kv")
    with store.open(entry.ref, entry.checksum) as reader:
        assert reader.header.num_blocks == BLOCKS and reader.header.layout().startswith("num_layers=3")
        for l in range(LAYERS):
            assert np.array_equal(np.frombuffer(reader.read_layer(l), np.float32).reshape(BLOCKS, 2, ELEMS), data[l])
    assert store.get(entry.ref, entry.checksum) == b"".join(d.tobytes() for d in data)
    assert store.donors_with_probe("p1") == ["d1"]
    with pytest.raises(ChecksumMismatch):
        store.open(entry.ref, "0" * 32)  # not the bytes the ledger recorded
    with pytest.raises(EntryMissing):
        store.open("nope.kv", entry.checksum)


def test_corruption_is_detected_per_layer_and_by_verify(tmp_path: Path, monkeypatch) -> None:
    store = FileDonorStore(tmp_path, 2**20)
    entry = store.put("d1", layers(2), header())
    monkeypatch.setattr(donor_store, "_VERIFIED", {})  # what another process remembers: nothing
    other = FileDonorStore(tmp_path, 2**20)  # another process: has not verified the entry yet
    assert other.verified(entry.ref, entry.checksum) is None
    path = tmp_path / entry.ref
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 4)
        f.write(b"\x00\x00\x80\x7f")
    with pytest.raises(ChecksumMismatch, match="layer 2"), other.open(entry.ref, entry.checksum) as reader:
        reader.read_layer(0)
        reader.read_layer(2)
    with pytest.raises(ChecksumMismatch):
        other.verify(entry.ref, entry.checksum)
    assert store.verified(entry.ref, entry.checksum) is None  # the file changed since it was verified


def test_known_verified_is_trusted_until_a_recheck_finds_the_file_changed_or_gone(tmp_path: Path) -> None:
    """The lookup's no-I/O check: the store's record of what it checksummed, which
    ``recheck_verified`` (one stat per entry, off the engine's path) drops once the file changes."""
    store = FileDonorStore(tmp_path, 2**20)
    kept, changed, removed = (store.put(name, layers(i), header()) for i, name in enumerate(("k", "c", "r")))
    assert all(store.known_verified(e.ref, e.checksum) for e in (kept, changed, removed))
    assert not store.known_verified(kept.ref, "0" * 32)  # another checksum: not what was verified
    # every store on the directory in this process shares the record (the scheduler's sees the worker's)
    assert FileDonorStore(tmp_path, 2**20).known_verified(kept.ref, kept.checksum)
    assert store.recheck_verified() == 0
    path = tmp_path / changed.ref
    time.sleep(0.02)  # file times tick once per jiffy (≤ 10 ms): a write in the save's own tick keeps its mtime
    with open(path, "r+b") as f:  # rewritten in place: same inode and size, new mtime
        f.seek(os.path.getsize(path) - 4)
        f.write(b"\x00\x00\x80\x7f")
    (tmp_path / removed.ref).unlink()
    assert store.known_verified(changed.ref, changed.checksum)  # no I/O: not noticed until the recheck
    assert store.recheck_verified() == 2
    assert store.known_verified(kept.ref, kept.checksum)
    assert not store.known_verified(changed.ref, changed.checksum) and not store.known_verified(removed.ref,
                                                                                                removed.checksum)
    assert store.verified(changed.ref, changed.checksum) is None  # the full check: verify again, which fails
    with pytest.raises(ChecksumMismatch):
        store.verify(changed.ref, changed.checksum)
    with pytest.raises(EntryMissing):
        store.verified(removed.ref, removed.checksum)
    other = FileDonorStore(tmp_path, 2**20)
    assert other.evict("k", "test") and not store.known_verified(kept.ref, kept.checksum)  # seen at once


def test_the_record_is_the_file_that_was_read_and_any_metadata_change_drops_it(tmp_path: Path, monkeypatch) -> None:
    """``verify`` records the file it read (its descriptor), not what the path names afterwards; a
    chmod (ctime) is a change too."""
    store = FileDonorStore(tmp_path, 2**20)
    entry = store.put("d1", layers(1), header())
    path = tmp_path / entry.ref
    monkeypatch.setattr(donor_store, "_VERIFIED", {})  # another process, which has not verified it
    other = FileDonorStore(tmp_path, 2**20)
    read_layer = donor_store.DonorReader.read_layer

    def replaced_after_the_last_layer(reader, layer_idx, **kw):  # noqa: ANN001, ANN202
        data = read_layer(reader, layer_idx, **kw)
        if layer_idx == LAYERS - 1:  # another writer swaps in a corrupt copy while verify finishes
            raw = bytearray(path.read_bytes())
            raw[-1] ^= 0xFF
            swap = tmp_path / "swap.tmp"
            swap.write_bytes(bytes(raw))
            os.rename(swap, path)
        return data

    monkeypatch.setattr(donor_store.DonorReader, "read_layer", replaced_after_the_last_layer)
    other.verify(entry.ref, entry.checksum)  # what it read was right
    monkeypatch.setattr(donor_store.DonorReader, "read_layer", read_layer)
    assert other.verified(entry.ref, entry.checksum) is None  # the path names another file now
    assert other.recheck_verified() == 1 and not other.known_verified(entry.ref, entry.checksum)
    kept = store.put("d2", layers(2), header())
    os.chmod(tmp_path / kept.ref, 0o400)
    assert store.recheck_verified() == 2  # d1 replaced (the writer's record too), d2 re-permissioned
    assert not store.known_verified(kept.ref, kept.checksum) and not store.known_verified(entry.ref, entry.checksum)


def test_a_bounded_recheck_goes_round_robin_and_finds_every_change(tmp_path: Path) -> None:
    store = FileDonorStore(tmp_path, 2**20)
    entries = [store.put(f"e{i}", layers(i), header()) for i in range(5)]
    (tmp_path / entries[3].ref).unlink()
    found = [store.recheck_verified(limit=2) for _ in range(3)]  # 3 calls x 2 stats cover all 5
    assert sum(found) == 1 and not store.known_verified(entries[3].ref, entries[3].checksum)
    assert all(store.known_verified(e.ref, e.checksum) for i, e in enumerate(entries) if i != 3)
    later = store.put("e5", layers(5), header())  # entries come and go between calls: still round robin
    assert store.evict("e0", "test")
    (tmp_path / entries[1].ref).unlink()
    (tmp_path / later.ref).unlink()
    assert sum(store.recheck_verified(limit=2) for _ in range(2)) == 2  # 4 known entries, 2 calls


CRASHING_SAVE = textwrap.dedent("""
    import os, sys
    import numpy as np
    from connector.donor_store import FileDonorStore
    store = FileDonorStore(sys.argv[1], 2**30)
    real_write, calls = os.write, []
    def write(fd, data):
        calls.append(1)
        if len(calls) == 3:          # header and the first layer are on disk: die here
            os.kill(os.getpid(), 9)
        return real_write(fd, data)
    os.write = write
    layers = [np.ones((4, 2, 16), np.float32) * i for i in range(3)]
    store.put("crashed", layers, {"namespace": "ns", "num_layers": 3, "kv_factor": 2, "block_elems": 16,
              "dtype": "float32", "itemsize": 4, "num_blocks": 4, "tokens_per_block": 8})
""")


def test_a_crash_mid_save_leaves_no_visible_entry(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", CRASHING_SAVE, str(tmp_path)], cwd=repo, capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()
    leftovers = [p.name for p in tmp_path.iterdir() if p.is_file()]
    assert len(leftovers) == 1 and leftovers[0].startswith(".tmp-")  # only the temp file exists
    store = FileDonorStore(tmp_path, 2**30)  # start-up sweeps temp files of dead processes
    assert store.entries() == []
    with pytest.raises(EntryMissing):
        store.open("crashed.kv", "x")
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())


def test_capacity_evicts_oldest_unleased_and_records_it_in_the_ledger(tmp_path: Path, sqlite_db: str) -> None:
    ledger = LedgerClient(sqlite_db)
    for donor_id in ("old", "leased", "new", "newest"):
        ledger.register_donor(ev.DonorRegistered(donor_id=donor_id, namespace="ns", engine_id="A", generation=1,
                                                 content_keys=[donor_id.encode()], block_hashes=[1], num_tokens=8,
                                                 tokens_per_block=8))
    size = FileDonorStore(tmp_path / "probe-size", 2**20).put("x", layers(0), header()).size_bytes
    store = FileDonorStore(tmp_path / "store", 3 * size, ledger=ledger)
    for donor_id in ("old", "leased", "new"):
        store.put(donor_id, layers(3), header())
        os.utime(store.root / f"{donor_id}.kv", (0, {"old": 1, "leased": 2, "new": 3}[donor_id]))
    lease = ledger.take_lease("leased", request_id="r", holder="B", namespace="ns", num_blocks=1, ttl_s=60,
                              policy="store")
    assert not isinstance(lease, str)
    store.put("newest", layers(4), header())  # full: "old" goes; "leased" is skipped
    assert [e[0] for e in store.entries()] == ["leased", "new", "newest"]
    assert ledger.donor_freshness("old", namespace="ns", policy="store") == "evicted"
    assert ledger.donor_freshness("newest", namespace="ns", policy="store") is None  # donor_saved recorded
    store.lease("new")  # pinned in this process
    store.lease("newest")
    with pytest.raises(StoreFull):
        store.put("too-much", layers(5), header())  # nothing unleased left to evict
    assert not store.evict("leased", "test") and not store.evict("new", "test")
    ledger.release_lease(lease.lease_id, "done")
    store.release("new")
    store.release("newest")
    assert store.evict("leased", "test") and store.evict("new", "test")
    ledger.close()


# -- secured entries: what a TensorRT-LLM promise holds ------------------------------------------------

def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def read_all(secured: donor_store.SecuredEntry) -> list[np.ndarray]:
    with secured.reader() as reader:
        return [np.frombuffer(reader.read_layer(l), np.float32).reshape(BLOCKS, 2, ELEMS) for l in range(LAYERS)]


def test_a_secured_entry_keeps_the_verified_bytes_whatever_happens_to_its_path(tmp_path: Path) -> None:
    """Evicted, replaced by another file under the same name: the secured file is still the one checksummed."""
    store = FileDonorStore(tmp_path, 2**20)
    data = layers(3)
    entry = store.put("d1", data, header())
    evicted, replaced = store.secure(entry.ref, entry.checksum), store.secure(entry.ref, entry.checksum)
    assert evicted is not None and replaced is not None
    assert store.evict("d1", "test", force=True) and not (tmp_path / entry.ref).exists()
    assert all(np.array_equal(got, want) for got, want in zip(read_all(evicted), data, strict=True))
    other = FileDonorStore(tmp_path, 2**20).put("d1", layers(4), header())  # a new file, same name
    assert other.checksum != entry.checksum
    assert all(np.array_equal(got, want) for got, want in zip(read_all(replaced), data, strict=True))
    assert store.secure(entry.ref, entry.checksum) is None  # the path names another file now
    evicted.release()
    replaced.release()
    replaced.release()  # idempotent


def test_a_file_written_in_place_fails_the_secured_read_the_residual_case(tmp_path: Path) -> None:
    store = FileDonorStore(tmp_path, 2**20)
    entry = store.put("d1", layers(5), header())
    secured = store.secure(entry.ref, entry.checksum)
    assert secured is not None
    path = tmp_path / entry.ref
    with open(path, "r+b") as f:  # same file, new bytes: only the checksums can tell
        f.seek(os.path.getsize(path) - 4)
        f.write(b"\x00\x00\x80\x7f")
    with pytest.raises(ChecksumMismatch, match="layer 2"), secured.reader() as reader:
        reader.read_layer(2)
    secured.release()
    assert store.recheck_verified() == 1 and store.secure(entry.ref, entry.checksum) is None


def test_descriptors_close_when_forgotten_and_unheld_and_stay_bounded(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(donor_store, "_VERIFIED", {})
    monkeypatch.setattr(donor_store, "_open_budget", lambda: 1)
    store = FileDonorStore(tmp_path, 2**20)
    before = open_fds()
    first = store.put("d1", layers(6), header())  # kept open
    second = store.put("d2", layers(7), header())  # over the budget: remembered, not kept open
    assert open_fds() == before + 1
    held = store.secure(first.ref, first.checksum)
    opened = store.secure(second.ref, second.checksum)  # secured by opening it: its own descriptor
    assert held is not None and opened is not None and open_fds() == before + 2
    store.forget_verified(first.ref)  # held: the descriptor stays until the holder lets go
    assert open_fds() == before + 2 and len(read_all(held)) == LAYERS
    held.release()
    opened.release()
    assert open_fds() == before
    os.utime(tmp_path / second.ref, ns=(1, 1))  # changed since its checksum: not secured by opening
    assert store.secure(second.ref, second.checksum) is None


def test_secured_entries_are_handed_over_once_and_dropped_if_unclaimed(tmp_path: Path) -> None:
    store, worker_store = FileDonorStore(tmp_path, 2**20), FileDonorStore(tmp_path, 2**20)
    entry = store.put("d1", layers(8), header())
    for lease_id in ("l1", "l2"):
        secured = store.secure(entry.ref, entry.checksum)
        assert secured is not None
        store.hand_over(lease_id, secured)
    assert store.handed_over() == 2
    claimed = worker_store.claim("l1")  # the worker's store on the same directory, in this process
    assert claimed is not None and worker_store.claim("l1") is None
    claimed.release()
    assert store.drop_unclaimed("l2") and not store.drop_unclaimed("l2") and store.handed_over() == 0

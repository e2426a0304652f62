"""The donor store: where a donor's KV bytes live between its save and a recipient's load (DESIGN §4).

:class:`DonorStore` is the small interface (put / open / get / verify / lease / release / evict)
that an LMCache or Mooncake backend can implement later; :class:`FileDonorStore` is the built-in
host-local implementation: one file per donor under ``store_dir`` (``/dev/shm`` works well), shared
by every engine process on the host.

Entry file ``<donor_id>.kv``::

    b"SEMKVDS1" | header_len: u32 LE | header: JSON (utf-8) | zero padding to 4096 | data

``data`` is layer-major: for each layer ``l``, ``[num_blocks, kv_factor, block_elems]`` elements of
the KV dtype (``layer_bytes`` bytes), i.e. the donor's pool blocks ``kv[block_ids][:, l]``. The header
holds the layout, ``layer_checksums`` (xxh3-128 hex of each layer's bytes), the namespace digest
and fields, and a probe key. The entry's **checksum** (what the ledger records in ``donor_saved``)
is xxh3-128 (hex) of the header bytes, so ledger → header → every layer is one chain of checksums.

Tensor parallelism: a donor of a TP engine is one SHARD per rank, each written by its rank's worker
as an ordinary entry ``<donor_id>.tp<rank>of<size>.kv`` (:meth:`FileDonorStore.put_shard`; header
field ``shard``), plus a MANIFEST ``<donor_id>.kv`` whose header lists every shard as ``(ref,
checksum)`` (field ``shards``) and which holds no data. Whichever rank publishes the last shard
writes the manifest (published with ``link``, so exactly one rank does, whatever the timing) and
appends the one ``donor_saved``, naming the manifest: ledger → manifest → shard headers → every
layer stays one chain of checksums, and a donor is complete only when every shard is. Verifying,
trusting (:meth:`FileDonorStore.known_verified`), securing and evicting a manifest covers every
shard; a shard missing or changed makes the whole donor unverified.

Guarantees:

* Atomic publish: bytes go to ``.tmp-*`` in the same directory, are fsynced, then renamed to the
  entry name and the directory is fsynced. A crash mid-save leaves only a temp file, which is not
  an entry (never listed, never opened) and is swept on the next start.
* Capacity: ``capacity_bytes`` bounds the entries; to make room, donors are evicted oldest first,
  skipping any that are pinned here (:meth:`lease`) or hold a lease in the ledger.
* Lifecycle facts go to the ledger: ``donor_saved`` after publish, ``donor_evicted`` on eviction.
* Reads verify: :meth:`open` checks the header against the expected checksum, and
  :meth:`DonorReader.read_layer` checks each layer before returning it
  (:meth:`DonorReader.read_layer_into`: in the caller's buffers, before returning).
* Secured entries (:meth:`FileDonorStore.secure`): the store keeps the file it checksummed open
  (one descriptor per verified entry, up to :data:`MAX_OPEN_VERIFIED`), so a promise can hold THAT
  file without a system call on the engine's thread; whatever happens to its path afterwards
  (eviction here or by another process, an operator's ``rm``, a new file renamed over it), the
  promise reads the bytes that were verified. Only a write into the same file (in place) can still
  change them, and the per-layer checksums catch that.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import struct
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import xxhash

from ledger.errors import EventRejected

__all__ = ["MAX_OPEN_VERIFIED", "ChecksumMismatch", "DonorReader", "DonorStore", "DonorStoreError", "EntryHeader",
           "EntryMissing", "FileDonorStore", "SecuredEntry", "SecuredShards", "StoreDirUnusable", "StoreFull",
           "StoreUnavailable", "StoredEntry", "open_donor_store", "shard_ref"]

log = logging.getLogger(__name__)
MAGIC = b"SEMKVDS1"
_ALIGN = 4096
_SUFFIX = ".kv"
_TMP_PREFIX = ".tmp-"
_TMP_MAX_AGE_S = 600.0
_SHARD_NAME = re.compile(r"\.tp\d+of\d+$")
MAX_OPEN_VERIFIED = 1024
"""Verified entries whose file a process keeps open (per store directory), so that securing one for a
promise costs no system call; an entry beyond it is secured by opening it (one ``open`` and one
``fstat`` on the engine's thread). A quarter of the process's soft descriptor limit when that is
smaller (:func:`_open_budget`)."""


class DonorStoreError(Exception):
    """Root of the donor store's errors."""


class StoreDirUnusable(OSError):
    """The donor store directory (``store_dir``) cannot be created; an ``OSError`` (errno kept)
    whose message names the setting."""

    def __str__(self) -> str:
        return f"donor store directory {self.filename} (store_dir): cannot create it: {self.strerror}"


class EntryMissing(DonorStoreError):
    """No published entry under that ref (evicted, never saved, or removed behind our back)."""


class ChecksumMismatch(DonorStoreError):
    """The entry's header or a layer does not match its checksum: the bytes are not the donor's."""


class StoreUnavailable(DonorStoreError):
    """A networked store could not be reached or answered with an error (connection refused or reset,
    timeout, out of memory): nothing is known about the entry, and nothing was read or written."""


class StoreFull(DonorStoreError):
    """Not enough unleased donors could be evicted to fit a new entry."""


@dataclasses.dataclass(frozen=True, slots=True)
class StoredEntry:
    """A published entry: ``ref`` (store-relative name), header ``checksum`` (hex), ``size_bytes``."""

    ref: str
    checksum: str
    size_bytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class EntryHeader:
    """Decoded header of an entry (see the module docstring)."""

    donor_id: str
    namespace: str
    num_layers: int
    kv_factor: int
    block_elems: int
    dtype: str
    itemsize: int
    num_blocks: int
    tokens_per_block: int
    layer_checksums: tuple[str, ...]
    probe: str | None = None
    namespace_fields: dict[str, str] = dataclasses.field(default_factory=dict)
    created_at: float = 0.0
    shard: tuple[int, int] | None = None
    """``(rank, size)`` of a tensor-parallel shard; None for a whole donor or a manifest."""
    shards: tuple[tuple[str, str], ...] = ()
    """A manifest's shards, ``(ref, header checksum)`` by rank; empty otherwise (see the module docstring)."""

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer: ``num_blocks * kv_factor * block_elems * itemsize``."""
        return self.num_blocks * self.kv_factor * self.block_elems * self.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in one layer."""
        return self.kv_factor * self.block_elems * self.itemsize

    def raw(self) -> bytes:
        """The header's bytes as stored (the fields tensor parallelism added are left out when unset,
        so a whole donor's header is what it always was)."""
        fields = dataclasses.asdict(self)
        if fields["shard"] is None:
            del fields["shard"]
        if not fields["shards"]:
            del fields["shards"]
        return json.dumps(fields, separators=(",", ":")).encode()

    def layout(self) -> str:
        return (f"num_layers={self.num_layers},kv_factor={self.kv_factor},block_elems={self.block_elems},"
                f"dtype={self.dtype}")


class DonorStore(Protocol):
    """The donor store interface the connector uses: :class:`FileDonorStore` (host-local) and
    :class:`connector.redis_store.RedisDonorStore` (networked) implement it."""

    local: bool
    """True: on this host (a lookup may checksum a small entry inline); False: never read on the engine's thread."""

    def ref_of(self, donor_id: str) -> str: ...

    def close(self) -> None: ...

    def secure(self, ref: str, checksum: str) -> Any: ...

    def hand_over(self, lease_id: str, entry: Any) -> None: ...

    def claim(self, lease_id: str) -> Any: ...

    def drop_unclaimed(self, lease_id: str) -> bool: ...

    def read_header(self, ref: str) -> EntryHeader: ...

    def donors_with_probe(self, probe: str, limit: int = 8) -> list[str]: ...

    def put(self, donor_id: str, layers: Sequence[Any], header: dict[str, Any]) -> StoredEntry: ...

    def put_shard(self, donor_id: str, rank: int, num_shards: int, layers: Sequence[Any],
                  header: dict[str, Any]) -> tuple[StoredEntry, StoredEntry | None]: ...

    def shards_of(self, ref: str) -> tuple[tuple[str, str], ...]: ...

    def open(self, ref: str, checksum: str) -> Any: ...

    def open_handle(self, handle: tuple[str, int, int], ref: str, checksum: str) -> Any: ...

    def get(self, ref: str, checksum: str) -> bytes: ...

    def verify(self, ref: str, checksum: str) -> None: ...

    def verified(self, ref: str, checksum: str) -> bool | None: ...

    def known_verified(self, ref: str, checksum: str) -> bool: ...

    def recheck_verified(self, limit: int | None = None) -> int: ...

    def forget_verified(self, ref: str) -> None: ...

    def size_of(self, ref: str) -> int: ...

    def lease(self, donor_id: str) -> None: ...

    def release(self, donor_id: str) -> None: ...

    def evict(self, donor_id: str, reason: str, *, force: bool = False) -> bool: ...


class DonorReader:
    """An open entry whose header matched its checksum; reads verified layers.

    ``source`` (``local_file``) labels ``semkv_load_seconds``: where a load's bytes came from.

    Raises (from :meth:`read_layer`):
        ChecksumMismatch: the layer's bytes do not match the header.
        EntryMissing: the file became unreadable.
    """

    source = "local_file"

    def __init__(self, path: Path, header: EntryHeader, data_offset: int, fd: int, *, owns_fd: bool = True) -> None:
        self.path, self.header, self._offset, self._fd = path, header, data_offset, fd
        self._owns_fd = owns_fd

    def read_layer(self, layer_idx: int, *, verify: bool = True, into: bytearray | None = None) -> bytearray | memoryview:
        """Bytes of layer ``layer_idx``: ``[num_blocks, kv_factor, block_elems]`` elements, verified.

        ``into``: a buffer of at least ``header.layer_bytes`` bytes the caller owns and reuses (a
        load reads every layer into the same one: no allocation, no page faults per layer); the
        layer is read into its start and a memoryview of exactly those bytes is returned. The
        bytes checked are the bytes returned — a private copy, never a mapping of the file, so a
        write into the file after the check cannot change what the caller copies.
        Without ``into``: a new ``bytearray``.
        """
        h = self.header
        if into is None:
            buf: bytearray | memoryview = bytearray(h.layer_bytes)
        elif len(into) < h.layer_bytes:
            raise ValueError(f"read buffer of {len(into)} bytes for a layer of {h.layer_bytes}")
        else:
            buf = memoryview(into)[: h.layer_bytes]
        try:
            got = os.preadv(self._fd, [buf], self._offset + layer_idx * h.layer_bytes)
        except OSError as exc:
            raise EntryMissing(f"{self.path.name}: {exc}") from exc
        if got != h.layer_bytes:
            raise ChecksumMismatch(f"{self.path.name}: layer {layer_idx} truncated ({got} of {h.layer_bytes} bytes)")
        if verify and xxhash.xxh3_128_hexdigest(buf) != h.layer_checksums[layer_idx]:
            raise ChecksumMismatch(f"{self.path.name}: layer {layer_idx} checksum mismatch")
        return buf

    def read_layer_into(self, layer_idx: int, pieces: Sequence[Any]) -> None:
        """Read layer ``layer_idx`` straight into ``pieces`` and verify it there.

        ``pieces``: writable byte buffers (``memoryview``, ``bytearray``, a uint8 array) whose
        lengths add up to ``header.layer_bytes``: the layer's bytes in file order are scattered
        over them with ONE ``preadv`` (no intermediate buffer, no second copy), then hashed where
        they landed (xxh3-128, streamed over the pieces: the same digest as the whole layer). As
        with :meth:`read_layer`, the bytes checked are the bytes the caller keeps — a write into
        the file after the read cannot change them — but they are in the caller's buffers BEFORE
        the check: on any exception here their contents are unverified and must not be used
        (the worker passes the target blocks of a load only where a failed load is recomputed,
        see ``connector/worker.py``).

        Raises:
            ValueError: the pieces do not add up to one layer.
            ChecksumMismatch: the layer's bytes do not match the header (or the file is short).
            EntryMissing: the file became unreadable.
        """
        h = self.header
        views = [memoryview(piece).cast("B") for piece in pieces]
        total = sum(len(view) for view in views)
        if total != h.layer_bytes:
            raise ValueError(f"read pieces of {total} bytes for a layer of {h.layer_bytes}")
        try:
            got = os.preadv(self._fd, views, self._offset + layer_idx * h.layer_bytes)
        except OSError as exc:
            raise EntryMissing(f"{self.path.name}: {exc}") from exc
        if got != h.layer_bytes:
            raise ChecksumMismatch(f"{self.path.name}: layer {layer_idx} truncated ({got} of {h.layer_bytes} bytes)")
        digest = xxhash.xxh3_128()
        for view in views:
            digest.update(view)
        if digest.hexdigest() != h.layer_checksums[layer_idx]:
            raise ChecksumMismatch(f"{self.path.name}: layer {layer_idx} checksum mismatch")

    def fileno(self) -> int:
        """The open entry's descriptor (the file that was checked, even if the path changed since)."""
        return self._fd

    def detach(self) -> int:
        """Give up the descriptor without closing it (the caller owns it now); the reader is closed."""
        fd, self._fd = self._fd, -1
        return fd

    def close(self) -> None:
        """Close the entry (a reader over a :class:`SecuredEntry` leaves its descriptor to it)."""
        if self._fd >= 0 and self._owns_fd:
            os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> DonorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_PINS: dict[str, dict[str, int]] = {}  # store directory -> donor id -> pins held in this process
_PINS_LOCK = threading.Lock()
_Identity = tuple[int, int, int, int]  # (st_ino, st_size, st_mtime_ns, st_ctime_ns)


def _identity(st: os.stat_result) -> _Identity:
    """A file as it was checksummed: a replaced, rewritten (even with its mtime restored), resized or
    re-permissioned file differs (ctime moves on any metadata change)."""
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _open_budget() -> int:
    """How many verified files one store directory may keep open (:data:`MAX_OPEN_VERIFIED`)."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return MAX_OPEN_VERIFIED
    if soft == resource.RLIM_INFINITY:
        return MAX_OPEN_VERIFIED
    return max(0, min(MAX_OPEN_VERIFIED, soft // 4))


@dataclasses.dataclass(slots=True, eq=False)
class _Verified:
    """One checksummed file: what it was (:data:`_Identity`), its checksum, and its open descriptor
    (None: over the open budget). ``holders`` counts the :class:`SecuredEntry` objects reading
    through ``fd``; a forgotten record closes ``fd`` when the last of them lets go."""

    identity: _Identity
    checksum: str
    fd: int | None
    holders: int = 0
    forgotten: bool = False


class _VerifiedFiles:
    """The entries of one store directory this process checksummed, as the file they were then,
    shared by every :class:`FileDonorStore` on the directory in the process (the worker's eviction
    is seen by the scheduler's store at once). ``get`` takes no lock (one dict read: the lookup's
    path); ``hold`` takes an uncontended lock, which does not release the GIL. Rechecks go round
    robin through a queue, so a bounded recheck reaches every entry within ``ceil(entries / limit)``
    calls. Descriptors are opened and closed only under :attr:`_lock`, and closed only when no
    :class:`SecuredEntry` reads through them, so a descriptor number is never reused under a reader."""

    def __init__(self) -> None:
        self._known: dict[str, _Verified] = {}
        self._shards: dict[str, tuple[tuple[str, str], ...]] = {}  # manifest ref -> its shards
        self._queue: deque[str] = deque()  # recheck order: every known entry once (forgotten ones until reached)
        self._queued: set[str] = set()
        self._lock = threading.Lock()
        self._open = 0
        self._budget = _open_budget()

    def get(self, ref: str) -> tuple[_Identity, str] | None:
        known = self._known.get(ref)
        return None if known is None else (known.identity, known.checksum)

    def shards_of(self, ref: str) -> tuple[tuple[str, str], ...]:
        return self._shards.get(ref, ())

    def remember(self, ref: str, identity: _Identity, checksum: str, fd: int | None = None,
                 shards: tuple[tuple[str, str], ...] = ()) -> None:
        """Record ``ref`` as checksummed; ``fd`` (open on that very file) is taken over: kept when the
        open budget allows, else closed. ``shards``: a manifest's, each verified before it."""
        with self._lock:
            if shards:
                self._shards[ref] = shards
            if ref not in self._queued:
                self._queue.append(ref)
                self._queued.add(ref)
            old = self._known.get(ref)
            if old is not None and old.identity == identity and old.checksum == checksum:
                if old.fd is None and fd is not None and self._open < self._budget:
                    old.fd, fd = fd, None
                    self._open += 1
                if fd is not None:  # the same file is open already: one descriptor is enough
                    os.close(fd)
                return
            if old is not None:
                self._retire(ref, old)
            keep = fd if fd is not None and self._open < self._budget else None
            if fd is not None and keep is None:
                os.close(fd)
            self._known[ref] = _Verified(identity, checksum, keep)
            self._open += keep is not None

    def forget(self, ref: str, identity: _Identity | None = None) -> bool:
        """Forget ``ref`` (only if it is still known as ``identity``, when given)."""
        with self._lock:
            known = self._known.get(ref)
            if known is None or (identity is not None and known.identity != identity):
                return False
            self._retire(ref, known)
            return True

    def hold(self, ref: str, checksum: str) -> _Verified | None:
        """The record of ``ref`` with one more holder, if it was verified with ``checksum`` and its
        file is open; None otherwise. No system call."""
        with self._lock:
            known = self._known.get(ref)
            if known is None or known.checksum != checksum or known.fd is None:
                return None
            known.holders += 1
            return known

    def let_go(self, record: _Verified) -> None:
        """A holder is done with ``record.fd``; the last one closes it if the record was forgotten."""
        with self._lock:
            record.holders -= 1
            self._close_if_unused(record)

    def next_to_recheck(self, limit: int | None) -> list[tuple[str, _Identity]]:
        """Up to ``limit`` known entries (None: all), each moved to the back of the queue; forgotten
        ones met on the way leave it."""
        with self._lock:
            out: list[tuple[str, _Identity]] = []
            for _ in range(len(self._queue)):
                if limit is not None and len(out) >= limit:
                    break
                ref = self._queue.popleft()
                known = self._known.get(ref)
                if known is None:
                    self._queued.discard(ref)
                    continue
                self._queue.append(ref)
                out.append((ref, known.identity))
            return out

    def _retire(self, ref: str, record: _Verified) -> None:
        """Under the lock: drop ``record`` from the known entries; its descriptor closes once unheld."""
        if self._known.get(ref) is record:
            del self._known[ref]
            self._shards.pop(ref, None)
        record.forgotten = True
        self._close_if_unused(record)

    def _close_if_unused(self, record: _Verified) -> None:
        """Under the lock."""
        if record.forgotten and record.holders <= 0 and record.fd is not None:
            os.close(record.fd)
            record.fd = None
            self._open -= 1


class SecuredEntry:
    """A donor store entry held for a promise: the file that was checksummed, open, whatever happens
    to its path from now on (see the module docstring). Read it with :meth:`reader`; :meth:`release`
    once (idempotent) when the load is done or abandoned.

    Args:
        ref, checksum: the entry and the header checksum the ledger recorded for it.
        path: where the entry was (for messages).
        fd: an open descriptor of the verified file.
        release: called once by :meth:`release` (gives the descriptor back).
    """

    __slots__ = ("ref", "checksum", "path", "fd", "_release")

    def __init__(self, ref: str, checksum: str, path: str, fd: int, release: Any) -> None:
        self.ref, self.checksum, self.path, self.fd, self._release = ref, checksum, path, fd, release

    def reader(self) -> DonorReader:
        """A reader over the secured file (its header checked against :attr:`checksum` again).

        Raises:
            ChecksumMismatch: the file was changed in place since it was checksummed.
            EntryMissing: it cannot be read any more.
        """
        if self._release is None:
            raise EntryMissing(f"secured entry {self.ref} was already released")
        try:
            header, data_offset = _read_header(self.fd, self.ref, self.checksum)
        except OSError as exc:
            raise EntryMissing(f"{self.ref}: {exc}") from exc
        return DonorReader(Path(self.path), header, data_offset, self.fd, owns_fd=False)

    def handle(self) -> tuple[str, int, int]:
        """``(path, st_dev, st_ino)``: a path another process of this host running as the same user
        opens to reach this very file (``/proc/<pid>/fd/<fd>``: the open descriptor's file, even
        after its name is unlinked or replaced), and the identity that open must find; valid while
        this entry is held. :meth:`FileDonorStore.open_handle` opens it.

        Raises:
            EntryMissing: already released.
        """
        if self._release is None:
            raise EntryMissing(f"secured entry {self.ref} was already released")
        st = os.fstat(self.fd)
        return f"/proc/{os.getpid()}/fd/{self.fd}", st.st_dev, st.st_ino

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


class SecuredShards:
    """Every shard of a tensor-parallel donor held for a promise (:meth:`FileDonorStore.secure` of its
    manifest): one :class:`SecuredEntry` per rank. The worker of rank 0, in the scheduler's process,
    reads its shard through :meth:`shard`; another rank's worker, in its own process, opens the file
    rank 0 holds through its :meth:`handles` (:meth:`FileDonorStore.open_handle`), so a shard evicted
    or replaced after the promise is still the checksummed file it reads. Rank 0's worker holds the
    shards until the iteration's forward has run (connector/worker.py): every rank's
    ``start_load_kv`` comes before that forward's collectives."""

    __slots__ = ("ref", "checksum", "shards")

    def __init__(self, ref: str, checksum: str, shards: list[SecuredEntry]) -> None:
        self.ref, self.checksum, self.shards = ref, checksum, shards

    def shard(self, rank: int) -> SecuredEntry:
        """Rank ``rank``'s shard."""
        return self.shards[rank]

    def handles(self) -> tuple[tuple[str, int, int], ...]:
        """Every shard's :meth:`SecuredEntry.handle`, by rank (rank 0's too: the plan is broadcast whole).

        Raises:
            EntryMissing: already released.
        """
        return tuple(entry.handle() for entry in self.shards)

    def release(self) -> None:
        """Give every shard back (idempotent)."""
        for entry in self.shards:
            entry.release()


_VERIFIED: dict[str, _VerifiedFiles] = {}  # store directory -> its verified entries in this process
_HANDED_OVER: dict[str, dict[str, SecuredEntry | SecuredShards]] = {}  # store directory -> lease id -> entry for the worker


class FileDonorStore:
    """Host-local donor store: one file per donor in ``root`` (see the module docstring).

    Args:
        root: directory (created 0700 if missing); every engine on the host may share it.
        capacity_bytes: bound on the published entries' total size.
        ledger: a :class:`ledger.client.LedgerClient` for ``donor_saved``/``donor_evicted`` facts and
            lease checks; None keeps the store ledger-free (unit tests).

    Raises:
        StoreDirUnusable: ``root`` cannot be created (an ``OSError`` naming ``store_dir``).
    """

    local = True
    """On this host: a lookup may read and checksum a small entry inline (``store_inline_verify_max_bytes``)."""

    def __init__(self, root: str | Path, capacity_bytes: int, ledger: Any = None) -> None:
        self.root = Path(root)
        self._root_str = str(self.root)
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            (self.root / "probe").mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:  # name the setting: "[Errno 2] … '/proc/semkv'" alone does not
            raise StoreDirUnusable(exc.errno, exc.strerror, str(self.root)) from exc
        self.capacity_bytes = capacity_bytes
        self.ledger = ledger
        # Pins are shared by every store on the same directory in this process: TensorRT-LLM's
        # scheduler pins before it answers, and its worker's saves evict (another instance).
        self._root_key = str(self.root.resolve())
        with _PINS_LOCK:
            self._pins = _PINS.setdefault(self._root_key, {})
            self._verified = _VERIFIED.setdefault(self._root_key, _VerifiedFiles())
        self._lock = _PINS_LOCK
        self.sweep_temp()

    def ref_of(self, donor_id: str) -> str:
        """The ``store_ref`` of ``donor_id``'s entry here."""
        return f"{donor_id}{_SUFFIX}"

    def close(self) -> None:
        """Nothing to close (the verified files stay open for the other stores of this directory)."""

    # -- write ---------------------------------------------------------------------------------

    def put(self, donor_id: str, layers: Sequence[Any], header: dict[str, Any]) -> StoredEntry:
        """Publish donor ``donor_id``: ``layers[l]`` is a bytes-like ``[num_blocks, kv_factor, block_elems]``.

        ``header`` supplies ``namespace``, ``num_layers``, ``kv_factor``, ``block_elems``, ``dtype``,
        ``itemsize``, ``num_blocks``, ``tokens_per_block`` (and optionally ``probe``,
        ``namespace_fields``). Appends ``donor_saved`` to the ledger when one is attached.

        Raises:
            ValueError: the layers do not match the header.
            StoreFull: no room even after evicting every unleased donor.
            OSError: the write failed (nothing was published).
        """
        stored, entry = self._publish(f"{donor_id}{_SUFFIX}", donor_id, layers, header)
        if entry.probe:
            self._link_probe(entry.probe, donor_id)
        if self.ledger is not None:
            self.ledger.mark_donor_saved(donor_id, store_ref=stored.ref, checksum=stored.checksum,
                                         size_bytes=stored.size_bytes)
        return stored

    def put_shard(self, donor_id: str, rank: int, num_shards: int, layers: Sequence[Any],
                  header: dict[str, Any]) -> tuple[StoredEntry, StoredEntry | None]:
        """Publish tensor-parallel rank ``rank``'s shard of donor ``donor_id`` (``layers`` and
        ``header`` as for :meth:`put`, for this rank's pool); when every one of the ``num_shards``
        shards is published, also the manifest and ``donor_saved`` (module docstring).

        Returns:
            ``(the shard, the manifest)``; the manifest is None while another rank's shard is
            missing, or when another rank published it.

        Raises:
            ValueError: ``rank`` is not one of ``num_shards``, or the layers do not match the header.
            StoreFull, OSError: as :meth:`put`.
        """
        if not 0 <= rank < num_shards:
            raise ValueError(f"shard rank {rank} is not one of {num_shards}")
        stored, _ = self._publish(shard_ref(donor_id, rank, num_shards), donor_id, layers,
                                  {**header, "shard": (rank, num_shards)})
        return stored, self._complete_shards(donor_id, num_shards)

    def _publish(self, name: str, donor_id: str, layers: Sequence[Any],
                 header: dict[str, Any]) -> tuple[StoredEntry, EntryHeader]:
        """Write one entry file atomically (temp file, fsync, rename, directory fsync)."""
        views = [memoryview(layer).cast("B") for layer in layers]
        entry = EntryHeader(donor_id=donor_id, created_at=time.time(),
                            layer_checksums=tuple(xxhash.xxh3_128_hexdigest(v) for v in views), **header)
        if len(views) != entry.num_layers or any(len(v) != entry.layer_bytes for v in views):
            raise ValueError(f"donor {donor_id}: layers do not match the header layout {entry.layout()}")
        raw = entry.raw()
        checksum = xxhash.xxh3_128_hexdigest(raw)
        prefix = MAGIC + struct.pack("<I", len(raw)) + raw
        data_offset = -(-len(prefix) // _ALIGN) * _ALIGN
        size = data_offset + entry.num_layers * entry.layer_bytes
        self._make_room(size)
        final = self.root / name
        tmp = self._temp_path()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, prefix + b"\0" * (data_offset - len(prefix)))
            for view in views:
                _write_all(fd, view)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        stored = StoredEntry(ref=final.name, checksum=checksum, size_bytes=size)
        self._remember_verified(final, stored.checksum)
        return stored, entry

    def _temp_path(self) -> Path:
        return self.root / f"{_TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}{_SUFFIX}"

    def _link_probe(self, probe: str, donor_id: str) -> None:
        probe_dir = self.root / "probe" / probe
        probe_dir.mkdir(mode=0o700, exist_ok=True)
        (probe_dir / donor_id).touch()

    def _complete_shards(self, donor_id: str, num_shards: int) -> StoredEntry | None:
        """The manifest of ``donor_id``, published here, when every shard is (None otherwise)."""
        shards: list[tuple[str, str]] = []
        first: EntryHeader | None = None
        size = 0
        for rank in range(num_shards):
            ref = shard_ref(donor_id, rank, num_shards)
            try:
                header, checksum = self._with_fd(ref, lambda fd, r=ref: _read_header_and_checksum(fd, r))
                size += self.size_of(ref)
            except DonorStoreError:
                return None  # not published yet (the rank that publishes it completes the donor), or gone
            first = first or header
            if header.shard != (rank, num_shards) or (header.donor_id, header.namespace, header.layout(),
                                                      header.num_blocks) != (donor_id, first.namespace,
                                                                             first.layout(), first.num_blocks):
                log.error("semkv: shard %s does not match the other shards of donor %s: the donor stays incomplete",
                          ref, donor_id)
                return None
            shards.append((ref, checksum))
        assert first is not None
        manifest = dataclasses.replace(first, layer_checksums=(), shard=None, shards=tuple(shards),
                                       created_at=time.time())
        raw = manifest.raw()
        prefix = MAGIC + struct.pack("<I", len(raw)) + raw
        final, tmp = self.root / f"{donor_id}{_SUFFIX}", self._temp_path()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            _write_all(fd, memoryview(prefix))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, final)  # exclusive publish: exactly one rank's manifest becomes the entry
        except FileExistsError:
            return None  # another rank completed the donor
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_dir(self.root)
        stored = StoredEntry(ref=final.name, checksum=xxhash.xxh3_128_hexdigest(raw), size_bytes=size + len(prefix))
        if manifest.probe:
            self._link_probe(manifest.probe, donor_id)
        if self.ledger is not None:
            self.ledger.mark_donor_saved(donor_id, store_ref=stored.ref, checksum=stored.checksum,
                                         size_bytes=stored.size_bytes)
        return stored

    # -- read ----------------------------------------------------------------------------------

    def open(self, ref: str, checksum: str) -> DonorReader:
        """Open an entry and check its header against ``checksum``.

        Raises:
            EntryMissing: no such entry.
            ChecksumMismatch: the header is not the one the ledger recorded.
        """
        path = self._path(ref)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError as exc:
            raise EntryMissing(f"donor store entry {ref} not found") from exc
        try:
            header, data_offset = _read_header(fd, ref, checksum)
        except BaseException:
            os.close(fd)
            raise
        return DonorReader(path, header, data_offset, fd)

    def open_handle(self, handle: tuple[str, int, int], ref: str, checksum: str) -> DonorReader:
        """Open the file another process of this host secured (:meth:`SecuredEntry.handle`) as entry
        ``ref`` and check its header against ``checksum``, as :meth:`open` does.

        Raises:
            EntryMissing: the handle cannot be opened (its holder let go or exited, another host,
                another user, no ``/proc``), or it opens a file that is not the one secured (the
                descriptor number was reused): open ``ref`` by name instead.
            ChecksumMismatch: the header is not the one the ledger recorded.
        """
        path, dev, ino = handle
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise EntryMissing(f"secured handle of {ref} cannot be opened: {exc}") from exc
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (dev, ino):
                raise EntryMissing(f"secured handle of {ref} is another file now (its holder let it go)")
            header, data_offset = _read_header(fd, ref, checksum)
        except BaseException:
            os.close(fd)
            raise
        return DonorReader(self._path(ref), header, data_offset, fd)

    def read_header(self, ref: str) -> EntryHeader:
        """The header of an entry WITHOUT checksum verification (telemetry only).

        Raises:
            EntryMissing, ChecksumMismatch: missing or unparseable entry.
        """
        return self._with_fd(ref, lambda fd: _read_header(fd, ref, None)[0])

    def get(self, ref: str, checksum: str) -> bytes:
        """Every layer's bytes, concatenated layer-major, after verifying all checksums."""
        with self.open(ref, checksum) as reader:
            return b"".join(bytes(reader.read_layer(l)) for l in range(reader.header.num_layers))

    def verify(self, ref: str, checksum: str) -> None:
        """Read and checksum the whole entry; remembered (per file identity) when it passes.

        Raises:
            EntryMissing, ChecksumMismatch.
        """
        reader = self.open(ref, checksum)
        try:
            for shard, shard_checksum in reader.header.shards:  # a manifest: every shard, in full
                self.verify(shard, shard_checksum)
            for layer in range(0 if reader.header.shards else reader.header.num_layers):
                reader.read_layer(layer)
            # the file that was read (its open descriptor), not whatever the path names by now;
            # the record keeps that descriptor (secure() hands it to promises)
            fd = reader.fileno()
            identity = _identity(os.fstat(fd))
        except BaseException:
            reader.close()
            raise
        self._verified.remember(reader.path.name, identity, checksum, reader.detach(), reader.header.shards)

    def verified(self, ref: str, checksum: str) -> bool | None:
        """Cheap check (one ``stat``): True if this process verified exactly this file with this
        checksum; None if not (verify it); raises EntryMissing if the entry is gone."""
        try:
            st = os.stat(self._path_str(ref))
        except FileNotFoundError as exc:
            raise EntryMissing(f"donor store entry {ref} not found") from exc
        if self._verified.get(ref) != (_identity(st), checksum):
            return None
        for shard, shard_checksum in self._verified.shards_of(ref):
            if not self.verified(shard, shard_checksum):
                return None
        return True

    def known_verified(self, ref: str, checksum: str) -> bool:
        """No I/O, no lock: did this process verify ``ref`` with ``checksum``, with no eviction here
        and no :meth:`recheck_verified` since finding the file changed or gone? The lookup's check
        on the engine's thread (an ``os.stat`` there releases the GIL to whichever thread waits
        for it); trust it only with :meth:`recheck_verified` running periodically. Readers verify
        every layer regardless."""
        known = self._verified.get(ref)
        return known is not None and known[1] == checksum and all(
            self.known_verified(shard, shard_checksum) for shard, shard_checksum in self._verified.shards_of(ref))

    def shards_of(self, ref: str) -> tuple[tuple[str, str], ...]:
        """The shards ``(ref, checksum)`` by rank of a manifest this process verified; ``()`` for a
        whole donor's entry, or a manifest not verified here. No I/O."""
        return self._verified.shards_of(ref)

    def forget_verified(self, ref: str) -> None:
        """Stop trusting ``ref`` without a full check (a load found it missing or corrupt)."""
        self._verified.forget(ref)

    def secure(self, ref: str, checksum: str) -> SecuredEntry | SecuredShards | None:
        """Hold the file this process checksummed as ``ref`` with ``checksum`` for a promise (a
        manifest: every shard, :class:`SecuredShards`).

        No system call while the file is among the :data:`MAX_OPEN_VERIFIED` this process keeps open
        (the lookup's path); otherwise one ``open`` and one ``fstat``, and the file must still be
        the one that was checksummed. None: not verified here, gone, or changed since.
        """
        shards = self._verified.shards_of(ref)
        if shards:
            return self._secure_shards(ref, checksum, shards)
        record = self._verified.hold(ref, checksum)
        path = self._path_str(ref)  # a str: pathlib costs microseconds on the lookup's path
        if record is not None:
            assert record.fd is not None  # held: it stays open until let go
            return SecuredEntry(ref, checksum, path, record.fd, lambda: self._verified.let_go(record))
        known = self._verified.get(ref)
        if known is None or known[1] != checksum:
            return None
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            same = _identity(os.fstat(fd)) == known[0]
        except OSError:
            same = False
        if not same:
            os.close(fd)
            return None
        return SecuredEntry(ref, checksum, path, fd, lambda: os.close(fd))

    def _secure_shards(self, ref: str, checksum: str, shards: tuple[tuple[str, str], ...]) -> SecuredShards | None:
        """Every shard of a verified manifest, held; None (nothing held) if one cannot be."""
        known = self._verified.get(ref)
        if known is None or known[1] != checksum:
            return None
        held: list[SecuredEntry] = []
        for shard, shard_checksum in shards:
            entry = self.secure(shard, shard_checksum)
            if entry is None:
                for taken in held:
                    taken.release()
                return None
            held.append(entry)
        return SecuredShards(ref, checksum, held)

    def hand_over(self, lease_id: str, entry: SecuredEntry | SecuredShards) -> None:
        """Leave ``entry`` for the worker of this process that will load the plan ``lease_id``
        (:meth:`claim`); the scheduler and the worker of one TensorRT-LLM engine share a process."""
        with _PINS_LOCK:
            _HANDED_OVER.setdefault(self._root_key, {})[lease_id] = entry

    def claim(self, lease_id: str) -> SecuredEntry | SecuredShards | None:
        """The entry handed over for plan ``lease_id`` (now the caller's to release), or None."""
        with _PINS_LOCK:
            return _HANDED_OVER.get(self._root_key, {}).pop(lease_id, None)

    def drop_unclaimed(self, lease_id: str) -> bool:
        """Release the entry handed over for ``lease_id`` if no worker claimed it; True if one was."""
        entry = self.claim(lease_id)
        if entry is None:
            return False
        entry.release()
        return True

    def handed_over(self) -> int:
        """Entries handed over and not yet claimed (tests count them: none may be left behind)."""
        with _PINS_LOCK:
            return len(_HANDED_OVER.get(self._root_key, {}))

    def recheck_verified(self, limit: int | None = None) -> int:
        """One ``stat`` per entry this process verified: forget those whose file is gone, cannot be
        read, or is not the one that was checksummed (:func:`_identity`), so the next lookup checks
        them in full. ``limit``: stat at most this many, round robin (the scheduler's periodic recheck
        bounds its cost); None: all. Returns how many were forgotten. Off the engine's path."""
        forgotten = 0
        for ref, identity in self._verified.next_to_recheck(limit):
            try:
                st = os.stat(self._path_str(ref))
                current: _Identity | None = _identity(st)
            except (OSError, EntryMissing):  # gone, or unreadable: not to be trusted without a full check
                current = None
            if current != identity and self._verified.forget(ref, identity):
                forgotten += 1
        return forgotten

    def size_of(self, ref: str) -> int:
        """Size of an entry file (bytes); of a manifest, with every shard's. Raises EntryMissing."""
        try:
            size = os.stat(self._path(ref)).st_size
        except FileNotFoundError as exc:
            raise EntryMissing(f"donor store entry {ref} not found") from exc
        shards = self._verified.shards_of(ref)
        # an entry with data is at least _ALIGN bytes; a manifest's header alone is far less (were one
        # larger, a lookup would only checksum it inline instead of in the background)
        if not shards and size < _ALIGN:  # a manifest this process has not verified yet
            try:
                shards = self.read_header(ref).shards
            except ChecksumMismatch:
                shards = ()
        return size + sum(self.size_of(shard) for shard, _ in shards)

    def donors_with_probe(self, probe: str, limit: int = 8) -> list[str]:
        """Donor ids whose entries were saved with ``probe`` (telemetry only)."""
        try:
            with os.scandir(self.root / "probe" / probe) as it:
                return [e.name for _, e in zip(range(limit), it, strict=False)]
        except (FileNotFoundError, NotADirectoryError):
            return []

    # -- pins and eviction ---------------------------------------------------------------------

    def lease(self, donor_id: str) -> None:
        """Pin a donor in this process (every store on this directory here sees the pin): capacity
        eviction skips it until :meth:`release`. Other processes see only ledger leases."""
        with self._lock:
            self._pins[donor_id] = self._pins.get(donor_id, 0) + 1

    def release(self, donor_id: str) -> None:
        with self._lock:
            count = self._pins.get(donor_id, 0) - 1
            if count > 0:
                self._pins[donor_id] = count
            else:
                self._pins.pop(donor_id, None)

    def evict(self, donor_id: str, reason: str, *, force: bool = False) -> bool:
        """Remove a donor's entry and append ``donor_evicted`` to the ledger.

        Refused (False) while the donor is pinned here or holds a ledger lease, unless ``force``
        (a corrupt entry must go whatever holds it: its readers fail closed anyway).
        """
        if not force and self._pinned(donor_id):
            return False
        if self.ledger is not None:
            try:
                if force:
                    self.ledger.evict_donor(donor_id, reason)
                elif not self.ledger.evict_donor_if_unleased(donor_id, reason):
                    return False  # a ledger lease holds it (checked and evicted in one transaction)
            except EventRejected:
                pass  # a donor the ledger never registered (orphan file): just remove the bytes
        path = self.root / f"{donor_id}{_SUFFIX}"
        try:
            header: EntryHeader | None = self.read_header(path.name)
        except DonorStoreError:  # already gone or unreadable: only its probe link may be left behind
            header = None
        path.unlink(missing_ok=True)
        if header is not None and header.probe:
            (self.root / "probe" / header.probe / donor_id).unlink(missing_ok=True)
        self._verified.forget(path.name)
        for shard in self.root.glob(f"{donor_id}.tp*of*{_SUFFIX}"):  # a tensor-parallel donor's shards
            shard.unlink(missing_ok=True)
            self._verified.forget(shard.name)
        return True

    def entries(self) -> list[tuple[str, int, float]]:
        """Published donors as ``(donor_id, size_bytes, mtime)``, oldest first; a tensor-parallel
        donor's shards and manifest count as one donor (their sizes summed, the oldest mtime)."""
        donors: dict[str, tuple[int, float]] = {}
        with os.scandir(self.root) as it:
            for e in it:
                if e.name.endswith(_SUFFIX) and not e.name.startswith(_TMP_PREFIX):
                    try:
                        st = e.stat()
                    except FileNotFoundError:
                        continue
                    donor_id = _SHARD_NAME.sub("", e.name[: -len(_SUFFIX)])
                    size, mtime = donors.get(donor_id, (0, st.st_mtime))
                    donors[donor_id] = (size + st.st_size, min(mtime, st.st_mtime))
        return sorted(((d, size, mtime) for d, (size, mtime) in donors.items()), key=lambda item: item[2])

    def used_bytes(self) -> int:
        return sum(size for _, size, _ in self.entries())

    def sweep_temp(self, max_age_s: float = _TMP_MAX_AGE_S) -> int:
        """Remove temp files of crashed saves (older than ``max_age_s`` or of a dead pid)."""
        removed, now = 0, time.time()
        with os.scandir(self.root) as it:
            for e in it:
                if not e.name.startswith(_TMP_PREFIX):
                    continue
                pid = e.name[len(_TMP_PREFIX):].split("-", 1)[0]
                try:
                    stale = now - e.stat().st_mtime > max_age_s or not _pid_alive(int(pid))
                except (FileNotFoundError, ValueError):
                    stale = True
                if stale:
                    Path(e.path).unlink(missing_ok=True)
                    removed += 1
        return removed

    # -- internals -----------------------------------------------------------------------------

    def _pinned(self, donor_id: str) -> bool:
        with self._lock:
            return bool(self._pins.get(donor_id))

    def _make_room(self, size: int) -> None:
        if size > self.capacity_bytes:
            raise StoreFull(f"entry of {size} bytes exceeds the store capacity {self.capacity_bytes}")
        entries = self.entries()
        used = sum(s for _, s, _ in entries)
        for donor_id, entry_size, _ in entries:
            if used + size <= self.capacity_bytes:
                return
            if self.evict(donor_id, "capacity"):
                used -= entry_size
        if used + size > self.capacity_bytes:
            raise StoreFull(f"store {self.root} full: {used} + {size} > {self.capacity_bytes} bytes (leased donors)")

    def _path_str(self, ref: str) -> str:
        """:meth:`_path` as a string (the lookup's stat; pathlib costs a few µs per join)."""
        if "/" in ref or ref.startswith(".") or not ref.endswith(_SUFFIX):
            raise EntryMissing(f"invalid donor store ref {ref!r}")
        return os.path.join(self._root_str, ref)

    def _path(self, ref: str) -> Path:
        return Path(self._path_str(ref))

    def _with_fd(self, ref: str, fn):  # noqa: ANN001, ANN202
        try:
            fd = os.open(self._path(ref), os.O_RDONLY)
        except FileNotFoundError as exc:
            raise EntryMissing(f"donor store entry {ref} not found") from exc
        try:
            return fn(fd)
        finally:
            os.close(fd)

    def _remember_verified(self, path: Path, checksum: str) -> None:
        """Remember a file this process just wrote and checksummed (kept open for :meth:`secure`)."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:  # evicted by another process already
            return
        try:
            identity = _identity(os.fstat(fd))
        except OSError:
            os.close(fd)
            return
        self._verified.remember(path.name, identity, checksum, fd)


def open_donor_store(settings: Any, ledger: Any = None, *, keep_bytes: bool = True) -> Any:
    """The donor store the connector settings choose (``donor_store``): the host-local
    :class:`FileDonorStore` (default) or :class:`connector.redis_store.RedisDonorStore`.
    ``keep_bytes``: the Redis store keeps verified donors' bytes in this process (an engine whose
    promises hold them: TensorRT-LLM); False for an engine that recomputes a failed load (vLLM).

    Raises:
        StoreDirUnusable: the file store's directory cannot be created.
        ValueError: ``redis_url`` is not a Redis URL.
    """
    if settings.donor_store == "redis":
        from connector.redis_store import RedisDonorStore, operator_warnings

        store = RedisDonorStore(settings.redis_url, settings.store_dir, key_prefix=settings.redis_key_prefix,
                                ttl_s=settings.redis_ttl_s, timeout_s=settings.redis_timeout_s,
                                stage_bytes=settings.redis_stage_bytes, ledger=ledger, keep_bytes=keep_bytes)
        for warning in operator_warnings(store, redis_ttl_s=settings.redis_ttl_s, donor_ttl_s=settings.donor_ttl_s):
            log.warning("semkv: %s", warning)
        return store
    return FileDonorStore(settings.store_dir, settings.store_capacity_bytes, ledger=ledger)


def _read_header(fd: int, ref: str, checksum: str | None) -> tuple[EntryHeader, int]:
    head = os.pread(fd, 12, 0)
    if len(head) != 12 or head[:8] != MAGIC:
        raise ChecksumMismatch(f"{ref}: not a donor store entry")
    (length,) = struct.unpack("<I", head[8:])
    raw = os.pread(fd, length, 12)
    if len(raw) != length:
        raise ChecksumMismatch(f"{ref}: truncated header")
    if checksum is not None and xxhash.xxh3_128_hexdigest(raw) != checksum:
        raise ChecksumMismatch(f"{ref}: header checksum does not match the ledger's")
    try:
        fields = json.loads(raw)
        fields["layer_checksums"] = tuple(fields["layer_checksums"])
        fields["shards"] = tuple((str(ref), str(sum_)) for ref, sum_ in fields.get("shards", ()))
        if fields.get("shard") is not None:
            fields["shard"] = tuple(int(v) for v in fields["shard"])
        header = EntryHeader(**fields)
    except (ValueError, TypeError, KeyError) as exc:
        raise ChecksumMismatch(f"{ref}: unreadable header: {exc}") from exc
    return header, -(-(12 + length) // _ALIGN) * _ALIGN


def _read_header_and_checksum(fd: int, ref: str) -> tuple[EntryHeader, str]:
    """The entry's header and its checksum (what the ledger, or a manifest, records for it)."""
    header, _ = _read_header(fd, ref, None)
    (length,) = struct.unpack("<I", os.pread(fd, 4, 8))
    return header, xxhash.xxh3_128_hexdigest(os.pread(fd, length, 12))


def shard_ref(donor_id: str, rank: int, num_shards: int) -> str:
    """The store ref of tensor-parallel rank ``rank``'s shard of ``donor_id``."""
    return f"{donor_id}.tp{rank}of{num_shards}{_SUFFIX}"


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

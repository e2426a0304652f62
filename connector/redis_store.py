"""The networked donor store: donor KV bytes on a Redis (or Valkey) server every host reaches, through redis-py.

:class:`RedisDonorStore` implements the :class:`~connector.donor_store.DonorStore` interface beside
the host-local :class:`~connector.donor_store.FileDonorStore` (the embedded default); it is chosen
with ``donor_store = "redis"`` (``connector/settings.py``). LMCache keeps KV chunks in Redis the same
way, one value per chunk (LMCache/LMCache ``lmcache/v1/storage_backend/connector/redis_connector.py``).

Keys (``P`` = ``redis_key_prefix``; values are raw bytes, every key carries a TTL)::

    P:b:<namespace>:<xxh3-128 of the block's bytes>   one donor block: every layer's [kv_factor, block_elems], layer-major
    P:m:<donor_id>                                    the donor's manifest (JSON): its EntryHeader and block addresses
    P:p:<probe>                                       set of donor ids saved with that probe key (telemetry only)

Content addressing: a block is stored under the namespace and the checksum of its own bytes, so
identical KV is stored once — two donors sharing a prefix (same namespace, same bytes) share those
block keys — and a key can never hold other bytes than its name says (an engine that computes
different bytes for the same tokens, e.g. a GPU kernel that depends on the batch, stores a second
block rather than overwrite the first one under another donor's manifest). The ledger's block key
names a token prefix, not bytes, which is why it is not the address.

Checksums, as in the file store, form one chain: the ledger's ``donor_saved`` checksum is xxh3-128
of the manifest bytes; the manifest names every block by the xxh3-128 of its bytes, and holds the
per-layer checksums of the assembled entry. Every block is checked against its address and every
layer against the manifest BEFORE any byte is copied into the KV pool.

TTL and eviction: each block and manifest expires ``redis_ttl_s`` after the last save that wrote or
shared it (a shared block's expiry only ever moves later: ``PEXPIRE ... GT``); the server may also
evict keys under ``maxmemory``. A manifest or block found missing — when a lookup checks a donor,
by the periodic recheck of the entries this process staged, or at load — is appended to the ledger
as ``donor_evicted`` (reason ``store_missing``, once per donor and process) and that load fails
closed (:class:`~connector.donor_store.EntryMissing`). Redis keyspace notifications are not used:
they need ``notify-keyspace-events`` set on the shared server, are fire-and-forget (lost while a
subscriber is down), and name one block key that many donors may share; the checks above see every
loss that matters, at the moment it matters.

Staging (host RAM): TensorRT-LLM cannot retract a promise (connector/engine_contract.py), so the
bytes a promise needs must be held before the answer. :meth:`RedisDonorStore.verify` — run off the
engine's path, by the scheduler's background checksum — fetches the whole entry, checks it and keeps
it in this process's memory (up to ``redis_stage_bytes``, least recently used unheld entries dropped
first); :meth:`RedisDonorStore.secure` holds that copy for a promise without any I/O, and the load
reads it (``semkv_load_seconds{source="host_ram"}``). A reader opened without a staged copy (vLLM's
worker, which may fail a plan after its promise: vLLM recomputes) fetches from Redis at load time
(``source="redis"``). The staged copies, pins and hand-overs are shared by every store of one
process with the same ``redis_url``, key prefix and ``store_dir`` (an engine's scheduler and
worker), never across ``store_dir``: two engines of one test process stay two hosts.

Redis unreachable: every call fails with :class:`StoreUnavailable` (a
:class:`~connector.donor_store.DonorStoreError`) after at most ``redis_timeout_s``; it is logged once
(ERROR) until a call succeeds again (INFO). Lookups then miss unless the bytes are staged already;
loads that need Redis fail closed; saves are dropped (counted).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import redis
import xxhash

from connector.donor_store import (ChecksumMismatch, DonorStoreError, EntryHeader, EntryMissing, StoredEntry,
                                   StoreUnavailable)
from ledger.errors import LedgerError

__all__ = ["REF_SUFFIX", "RedisDonorStore", "RedisMemory", "operator_warnings", "StagedEntry", "StagedReader", "StoreUnavailable"]

log = logging.getLogger(__name__)
REF_SUFFIX = ".redis"
"""A Redis store's ``store_ref`` is ``<donor_id>.redis`` (a file store's is ``<donor_id>.kv``): a
ledger shared by hosts with either store never sends one a ref of the other."""
_FETCH_CHUNK_BYTES = 8 * 2**20
"""Bytes of block values one pipelined round trip writes or asks for: bounds the client's buffers and
what one reply may take against ``redis_timeout_s`` (8 MiB at 0.1 GB/s, a busy loopback here: 80 ms)."""
_EVICTION_REASON = "store_missing"
_RECHECK_KEYS = 8192
"""Keys one bounded :meth:`RedisDonorStore.recheck_verified` run asks ``EXISTS`` about (the scheduler
runs it every ``store_recheck_s``): a 32K-token donor of 32-token blocks is 1,025 keys."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Manifest:
    header: EntryHeader
    blocks: tuple[str, ...]
    """Block addresses (xxh3-128 hex of each block's bytes), in block order."""
    size_bytes: int


@dataclasses.dataclass(slots=True, eq=False)
class _Staged:
    """A verified entry in this process's memory: ``data`` is ``[num_layers, num_blocks, block_bytes]``
    uint8, or None where the store keeps no bytes (``keep_bytes=False``: only that it was verified)."""

    checksum: str
    manifest: _Manifest
    data: np.ndarray | None
    holders: int = 0
    forgotten: bool = False


def _nbytes(entry: _Staged) -> int:
    """Memory an entry's bytes take here (0 for a record without them)."""
    return entry.data.nbytes if entry.data is not None else 0


class _Shared:
    """What every store of one process on one (Redis URL, key prefix, store_dir) shares: the staged
    entries, pins and hand-overs (see the module docstring)."""

    def __init__(self, stage_bytes: int) -> None:
        self.lock = threading.Lock()
        self.staged: OrderedDict[str, _Staged] = OrderedDict()  # ref -> entry, least recently used first
        self.staged_bytes = 0
        self.stage_bytes = stage_bytes
        self.pins: dict[str, int] = {}
        self.handed_over: dict[str, StagedEntry] = {}
        self.recheck_cursor = 0


_SHARED: dict[tuple[str, str, str], _Shared] = {}
_SHARED_LOCK = threading.Lock()
_OUTAGES: dict[str, float] = {}
"""Redis URL -> ``time.monotonic()`` when this process found it unreachable (every store on it logs
the outage once, together)."""


class StagedReader:
    """Reads the layers of an entry held in memory (staged, or fetched for this load); the checksum
    of each layer is checked again on every read.

    Attributes:
        header: the entry's header. source: where the bytes came from, for ``semkv_load_seconds``:
            ``host_ram`` (staged before the promise) or ``redis`` (fetched at load time).
    """

    def __init__(self, ref: str, header: EntryHeader, data: np.ndarray, source: str) -> None:
        self.ref, self.header, self._data, self.source = ref, header, data, source
        self.path = Path(ref)  # for messages, like DonorReader.path

    def read_layer(self, layer_idx: int, *, verify: bool = True, into: bytearray | None = None) -> np.ndarray:
        """Layer ``layer_idx``: ``num_blocks * kv_factor * block_elems`` elements as uint8 bytes (a
        read-only use of the staged array; the worker copies it into the pool). ``into`` is
        accepted for the file reader's signature and not used: the bytes are in memory already.

        Raises:
            ChecksumMismatch: the layer does not match the manifest.
        """
        layer = self._data[layer_idx]
        if verify and xxhash.xxh3_128_hexdigest(layer) != self.header.layer_checksums[layer_idx]:
            raise ChecksumMismatch(f"{self.ref}: layer {layer_idx} checksum mismatch")
        return layer

    def close(self) -> None:
        self._data = np.empty((0, 0, 0), dtype=np.uint8)

    def __enter__(self) -> StagedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StagedEntry:
    """A staged entry held for a promise (the counterpart of :class:`~connector.donor_store.SecuredEntry`):
    the verified bytes stay in memory whatever happens in Redis until :meth:`release` (idempotent)."""

    __slots__ = ("ref", "checksum", "_record", "_release")

    def __init__(self, ref: str, checksum: str, record: _Staged, release: Any) -> None:
        self.ref, self.checksum, self._record, self._release = ref, checksum, record, release

    def reader(self) -> StagedReader:
        """A reader over the held bytes (``source="host_ram"``).

        Raises:
            EntryMissing: the entry was already released.
        """
        if self._release is None:
            raise EntryMissing(f"staged entry {self.ref} was already released")
        return StagedReader(self.ref, self._record.manifest.header, self._record.data, "host_ram")

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


@dataclasses.dataclass(frozen=True, slots=True)
class RedisMemory:
    """What the server says of its memory (``INFO memory``): ``used_bytes``, ``max_bytes``
    (``maxmemory``; 0: no limit) and ``policy`` (``maxmemory-policy``)."""

    used_bytes: int
    max_bytes: int
    policy: str

    def warnings(self) -> list[str]:
        """What an operator must change for donors to come and go as designed: a server that refuses
        writes when full (``noeviction``: saves fail from then on, nothing makes room), or that has
        no memory limit (donor bytes grow until the host runs out of memory; keys expire only after
        ``redis_ttl_s``)."""
        out = []
        if self.policy == "noeviction":
            out.append("Redis maxmemory-policy is noeviction: once it is full every donor save fails; set "
                       "allkeys-lru or volatile-lru (every key of the donor store has a TTL)")
        if self.max_bytes == 0:
            out.append(f"Redis has no maxmemory ({self.used_bytes:,} bytes used): donor bytes grow until the host "
                       "runs out of memory (keys leave only when redis_ttl_s runs out); set maxmemory")
        return out


class RedisDonorStore:
    """Donor bytes on a Redis server (see the module docstring).

    Args:
        url: ``redis://host:port/db`` (``rediss://`` for TLS, ``unix://`` sockets; redis-py's URL forms).
        store_dir: this host's store directory: only scopes what stores of this process share.
        key_prefix: the first part of every key (fleets sharing a server use their own).
        ttl_s: seconds a block or manifest lives after the last save that wrote or shared it.
        timeout_s: connect and socket timeout of every Redis call (seconds).
        stage_bytes: bound on the verified entries this process keeps in memory.
        keep_bytes: keep a verified entry's bytes (TensorRT-LLM: a promise holds them); False keeps
            only that it was verified, and loads fetch from Redis (vLLM: its scheduler and workers
            are other processes, and a failed load is recomputed, so staged bytes would never be read).
        ledger: a :class:`ledger.client.LedgerClient` for ``donor_saved`` / ``donor_evicted``; None
            keeps the store ledger-free (unit tests).

    Raises:
        ValueError: ``url`` is not a Redis URL (nothing is connected at construction).
    """

    local = False
    """Not on this host: a lookup never reads it on the engine's thread (it checksums in the background)."""

    def __init__(self, url: str, store_dir: str | Path, *, key_prefix: str = "semkv", ttl_s: float = 3600.0,
                 timeout_s: float = 1.0, stage_bytes: int = 4 * 2**30, ledger: Any = None,
                 fetch_chunk_bytes: int = _FETCH_CHUNK_BYTES, keep_bytes: bool = True) -> None:
        self.url, self.prefix, self.ledger, self.keep_bytes = url, key_prefix, ledger, keep_bytes
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.fetch_chunk_bytes = fetch_chunk_bytes
        self.redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                          retry_on_timeout=False, decode_responses=False)
        self._key = (url, key_prefix, str(Path(store_dir).resolve()))
        with _SHARED_LOCK:
            self._shared = _SHARED.setdefault(self._key, _Shared(stage_bytes))
        self._reported: set[str] = set()
        self._reporter = ThreadPoolExecutor(1, thread_name_prefix="semkv-redis-evictions")
        self.blocks_written = 0
        """Blocks this store wrote (for tests and benchmarks); ``blocks_shared``: found stored already."""
        self.blocks_shared = 0

    # -- keys ----------------------------------------------------------------------------------

    def ref_of(self, donor_id: str) -> str:
        """The ``store_ref`` of ``donor_id``'s entry here."""
        return donor_id + REF_SUFFIX

    def _donor_of(self, ref: str) -> str:
        if not ref.endswith(REF_SUFFIX) or ":" in ref or len(ref) <= len(REF_SUFFIX):
            raise EntryMissing(f"{ref!r} is not a Redis donor store ref")
        return ref[: -len(REF_SUFFIX)]

    def _manifest_key(self, donor_id: str) -> str:
        return f"{self.prefix}:m:{donor_id}"

    def _block_key(self, namespace: str, address: str) -> str:
        return f"{self.prefix}:b:{namespace}:{address}"

    def _probe_key(self, probe: str) -> str:
        return f"{self.prefix}:p:{probe}"

    # -- availability --------------------------------------------------------------------------

    @contextmanager
    def _call(self, what: str) -> Iterator[None]:
        """Translate redis-py's errors into :class:`StoreUnavailable`, logged once per outage."""
        try:
            yield
        except redis.RedisError as exc:
            with _SHARED_LOCK:
                first = self.url not in _OUTAGES
                _OUTAGES.setdefault(self.url, time.monotonic())
            if first:
                log.error("semkv: the Redis donor store %s is unavailable (%s: %s); donors not staged on this host "
                          "miss and loads that need it fail closed until it answers again", self.where(), what, exc)
            raise StoreUnavailable(f"Redis donor store {self.where()}: {what}: {exc}") from exc
        if self.url not in _OUTAGES:  # the usual case: one dict read, no lock
            return
        with _SHARED_LOCK:
            down = _OUTAGES.pop(self.url, None)
        if down is not None:
            log.info("semkv: the Redis donor store %s answers again (after %.1f s)", self.where(),
                     time.monotonic() - down)

    def where(self) -> str:
        """``redis HOST:PORT/DB`` (or the socket path), without credentials, for messages."""
        kwargs = self.redis.connection_pool.connection_kwargs
        where = kwargs.get("path") or f"{kwargs.get('host')}:{kwargs.get('port')}"
        return f"redis {where}/{kwargs.get('db', 0)}"

    def ping(self) -> None:
        """One round trip (connector-check: its one error line is the report, nothing is logged).

        Raises:
            StoreUnavailable: no answer within ``timeout_s``, or an error reply.
        """
        try:
            self.redis.ping()
        except redis.RedisError as exc:
            raise StoreUnavailable(f"Redis donor store {self.where()}: ping: {exc}") from exc

    def memory(self) -> RedisMemory | None:
        """The server's memory use, limit and eviction policy; None when it does not say (``INFO``
        refused by its ACL, or a server that omits the fields).

        Raises:
            StoreUnavailable: no answer within ``timeout_s``.
        """
        try:
            info = self.redis.info("memory")
        except redis.ResponseError:  # e.g. -NOPERM: the ACL of this user does not allow INFO
            return None
        except redis.RedisError as exc:
            raise StoreUnavailable(f"Redis donor store {self.where()}: info memory: {exc}") from exc
        try:
            return RedisMemory(int(info["used_memory"]), int(info["maxmemory"]), str(info["maxmemory_policy"]))
        except (KeyError, TypeError, ValueError):
            return None

    # -- write ---------------------------------------------------------------------------------

    def put(self, donor_id: str, layers: Sequence[Any], header: dict[str, Any]) -> StoredEntry:
        """Publish donor ``donor_id``: ``layers[l]`` is a bytes-like ``[num_blocks, kv_factor, block_elems]``.

        Blocks already stored (same namespace, same bytes) are shared, their expiry extended; then
        the manifest is written, so a manifest never names a block that was not written. The entry
        is staged here (it is verified by construction) and ``donor_saved`` appended to the ledger.

        Raises:
            ValueError: the layers do not match the header.
            StoreUnavailable: Redis refused or is unreachable (nothing is recorded in the ledger).
        """
        views = [memoryview(layer).cast("B") for layer in layers]
        entry = EntryHeader(donor_id=donor_id, created_at=time.time(),
                            layer_checksums=tuple(xxhash.xxh3_128_hexdigest(v) for v in views), **header)
        if len(views) != entry.num_layers or any(len(v) != entry.layer_bytes for v in views):
            raise ValueError(f"donor {donor_id}: layers do not match the header layout {entry.layout()}")
        data = np.stack([np.frombuffer(v, dtype=np.uint8) for v in views]).reshape(
            entry.num_layers, entry.num_blocks, entry.block_bytes)
        blocks = np.ascontiguousarray(data.transpose(1, 0, 2))  # [num_blocks, num_layers, block_bytes]
        addresses = tuple(xxhash.xxh3_128_hexdigest(block) for block in blocks)
        raw = json.dumps({"header": dataclasses.asdict(entry), "blocks": addresses}, separators=(",", ":")).encode()
        checksum = xxhash.xxh3_128_hexdigest(raw)
        self._write_blocks(entry.namespace, addresses, blocks)
        with self._call("save"):
            pipe = self.redis.pipeline(transaction=False)
            pipe.set(self._manifest_key(donor_id), raw, px=self.ttl_ms)
            if entry.probe:
                pipe.sadd(self._probe_key(entry.probe), donor_id)
                pipe.pexpire(self._probe_key(entry.probe), self.ttl_ms)
            pipe.execute()
        manifest = _Manifest(entry, addresses, len(raw) + blocks.nbytes)
        stored = StoredEntry(ref=self.ref_of(donor_id), checksum=checksum, size_bytes=manifest.size_bytes)
        self._stage(stored.ref, _Staged(checksum, manifest, np.ascontiguousarray(data) if self.keep_bytes else None))
        if self.ledger is not None:
            self.ledger.mark_donor_saved(donor_id, store_ref=stored.ref, checksum=checksum, size_bytes=stored.size_bytes)
        return stored

    def _write_blocks(self, namespace: str, addresses: tuple[str, ...], blocks: np.ndarray) -> None:
        """Extend the expiry of the blocks stored already; write the others (``SET NX``: a block
        written meanwhile by another donor holds the same bytes)."""
        first: dict[str, int] = {}
        for idx, address in enumerate(addresses):
            first.setdefault(address, idx)
        keys = {address: self._block_key(namespace, address) for address in first}
        with self._call("save"):
            pipe = self.redis.pipeline(transaction=False)
            for address in first:
                pipe.pexpire(keys[address], self.ttl_ms, gt=True)
            extended = pipe.execute()
            # PEXPIRE ... GT is 0 for a missing key and for one expiring later already (then SET NX is a no-op)
            missing = [address for address, ok in zip(first, extended, strict=True) if not ok]
            per_round, newly_written = max(1, self.fetch_chunk_bytes // max(1, blocks[0].nbytes)), 0
            for start in range(0, len(missing), per_round):
                pipe = self.redis.pipeline(transaction=False)
                for address in missing[start : start + per_round]:
                    pipe.set(keys[address], blocks[first[address]].tobytes(), px=self.ttl_ms, nx=True)
                newly_written += sum(1 for ok in pipe.execute() if ok)
            self.blocks_written += newly_written
        # every block this put did not write was there already (a key extended within the same
        # millisecond it was written reads as "missing" to PEXPIRE GT, and its SET NX is a no-op)
        self.blocks_shared += len(addresses) - newly_written

    # -- read ----------------------------------------------------------------------------------

    def put_shard(self, donor_id: str, rank: int, num_shards: int, layers: Sequence[Any],
                  header: dict[str, Any]) -> tuple[StoredEntry, StoredEntry | None]:
        """Tensor-parallel shards are kept by the host-local file store only (their manifest is
        published with a hard link, which a Redis key cannot be).

        Raises:
            DonorStoreError: always: the rank's save fails and is counted, no donor is registered
                (never half a donor); set ``donor_store = "file"`` for tensor parallelism.
        """
        raise DonorStoreError(f"donor {donor_id}: the redis donor store keeps no tensor-parallel shards "
                              f"(rank {rank} of {num_shards}); tensor parallelism needs donor_store = \"file\"")

    def shards_of(self, ref: str) -> tuple[tuple[str, str], ...]:
        """A Redis entry is a whole donor: no shards."""
        return ()

    def open_handle(self, handle: tuple[str, int, int], ref: str, checksum: str) -> StagedReader:
        """No plan names a secured shard handle of this store (it keeps no shards).

        Raises:
            EntryMissing: always; the caller opens ``ref`` instead.
        """
        raise EntryMissing(f"{ref}: the redis donor store holds no secured shard handles")

    def open(self, ref: str, checksum: str) -> StagedReader:
        """A reader of the entry: its staged copy (``source="host_ram"``), else the entry fetched
        from Redis now and checked in full (``source="redis"``; not staged: a load reads it once).

        Raises:
            EntryMissing: the manifest or a block is gone (reported to the ledger as ``donor_evicted``).
            ChecksumMismatch: the manifest, a block or a layer does not match its checksum.
            StoreUnavailable: Redis unreachable (also midway through the fetch).
        """
        with self._shared.lock:
            staged = self._shared.staged.get(ref)
        if staged is not None and staged.checksum == checksum and staged.data is not None:
            return StagedReader(ref, staged.manifest.header, staged.data, "host_ram")
        manifest, data = self._fetch(ref, checksum)
        return StagedReader(ref, manifest.header, data, "redis")

    def get(self, ref: str, checksum: str) -> bytes:
        """Every layer's bytes, concatenated layer-major, after verifying all checksums."""
        with self.open(ref, checksum) as reader:
            return b"".join(reader.read_layer(l).tobytes() for l in range(reader.header.num_layers))

    def read_header(self, ref: str) -> EntryHeader:
        """The header of an entry WITHOUT checksum verification (telemetry only).

        Raises:
            EntryMissing, ChecksumMismatch, StoreUnavailable.
        """
        donor_id = self._donor_of(ref)
        with self._call("read manifest"):
            raw = self.redis.get(self._manifest_key(donor_id))
        if raw is None:
            raise EntryMissing(f"donor store entry {ref} not found")
        return _parse_manifest(raw, ref).header

    def verify(self, ref: str, checksum: str) -> None:
        """Fetch and check the whole entry, and stage it (off the engine's path: the scheduler's
        background checksum). Raises EntryMissing, ChecksumMismatch, StoreUnavailable."""
        with self._shared.lock:
            staged = self._shared.staged.get(ref)
            if staged is not None and staged.checksum == checksum:
                self._shared.staged.move_to_end(ref)
                return
        manifest, data = self._fetch(ref, checksum)
        self._stage(ref, _Staged(checksum, manifest, data if self.keep_bytes else None))

    def verified(self, ref: str, checksum: str) -> bool | None:
        """True if this process holds the entry staged with ``checksum``; None if not (or Redis is
        unreachable: verify it); raises EntryMissing when Redis says the manifest is gone (reported)."""
        if self.known_verified(ref, checksum):
            return True
        donor_id = self._donor_of(ref)
        try:
            with self._call("check"):
                exists = self.redis.exists(self._manifest_key(donor_id))
        except StoreUnavailable:
            return None
        if not exists:
            self._gone(donor_id, ref)
            raise EntryMissing(f"donor store entry {ref} not found (expired or evicted)")
        return None

    def known_verified(self, ref: str, checksum: str) -> bool:
        """No I/O, no lock: is ``ref`` staged here with ``checksum``?"""
        staged = self._shared.staged.get(ref)
        return staged is not None and staged.checksum == checksum

    def staged_entries(self) -> int:
        """Entries staged in this process's memory for this store (tests, benchmarks)."""
        return len(self._shared.staged)

    def forget_verified(self, ref: str) -> None:
        """Drop the staged copy of ``ref`` (held copies stay with their holders until released)."""
        with self._shared.lock:
            self._unstage(ref)

    def recheck_verified(self, limit: int | None = None) -> int:
        """Are the staged entries still in Redis (manifest and every block)? One pipelined ``EXISTS``
        per entry, up to ``limit`` entries round robin (None: all; with a limit also at most
        :data:`_RECHECK_KEYS` keys, but always one entry); an entry gone is unstaged and
        reported to the ledger as ``donor_evicted``. Returns how many were. Redis unreachable: 0
        (staged bytes are verified; they stay usable)."""
        with self._shared.lock:
            refs = list(self._shared.staged.items())
            if limit is not None and refs:
                start = self._shared.recheck_cursor % len(refs)
                refs, keys = (refs[start:] + refs[:start])[:limit], 0
                for count, (_, staged) in enumerate(refs):  # and at most _RECHECK_KEYS keys per run
                    keys += 1 + len(staged.manifest.blocks)
                    if keys > _RECHECK_KEYS and count:
                        refs = refs[:count]
                        break
                self._shared.recheck_cursor = start + len(refs)
        if not refs:
            return 0
        try:
            with self._call("recheck"):
                pipe = self.redis.pipeline(transaction=False)
                for ref, staged in refs:
                    keys = [self._block_key(staged.manifest.header.namespace, a) for a in staged.manifest.blocks]
                    pipe.exists(self._manifest_key(self._donor_of(ref)), *keys)
                counts = pipe.execute()
        except StoreUnavailable:
            return 0
        gone = 0
        for (ref, staged), count in zip(refs, counts, strict=True):
            if count < 1 + len(staged.manifest.blocks):
                gone += 1
                with self._shared.lock:
                    if self._shared.staged.get(ref) is staged:
                        self._unstage(ref)
                self._gone(self._donor_of(ref), ref)
        return gone

    def size_of(self, ref: str) -> int:
        """Size of the entry (bytes, as if no block were shared). Raises EntryMissing, StoreUnavailable."""
        staged = self._shared.staged.get(ref)
        if staged is not None:
            return staged.manifest.size_bytes
        donor_id = self._donor_of(ref)
        with self._call("read manifest"):
            raw = self.redis.get(self._manifest_key(donor_id))
        if raw is None:
            raise EntryMissing(f"donor store entry {ref} not found")
        return _parse_manifest(raw, ref).size_bytes

    def donors_with_probe(self, probe: str, limit: int = 8) -> list[str]:
        """Donor ids saved with ``probe`` (telemetry only; [] when Redis is unreachable)."""
        try:
            with self._call("probe"):
                members = self.redis.srandmember(self._probe_key(probe), limit) or []
        except StoreUnavailable:
            return []
        return [m.decode() for m in members]

    # -- promises (TensorRT-LLM) ---------------------------------------------------------------

    def secure(self, ref: str, checksum: str) -> StagedEntry | None:
        """Hold the staged entry for a promise (no I/O); None when it is not staged with ``checksum``."""
        shared = self._shared
        with shared.lock:
            staged = shared.staged.get(ref)
            if staged is None or staged.checksum != checksum or staged.data is None:
                return None
            staged.holders += 1
            shared.staged.move_to_end(ref)
        return StagedEntry(ref, checksum, staged, lambda: self._let_go(staged))

    def hand_over(self, lease_id: str, entry: StagedEntry) -> None:
        """Leave ``entry`` for this process's worker that loads plan ``lease_id`` (:meth:`claim`)."""
        with self._shared.lock:
            self._shared.handed_over[lease_id] = entry

    def claim(self, lease_id: str) -> StagedEntry | None:
        with self._shared.lock:
            return self._shared.handed_over.pop(lease_id, None)

    def drop_unclaimed(self, lease_id: str) -> bool:
        entry = self.claim(lease_id)
        if entry is None:
            return False
        entry.release()
        return True

    def handed_over(self) -> int:
        with self._shared.lock:
            return len(self._shared.handed_over)

    # -- pins and eviction ---------------------------------------------------------------------

    def lease(self, donor_id: str) -> None:
        """Pin a donor in this process: its staged copy is not dropped to make room until :meth:`release`."""
        with self._shared.lock:
            self._shared.pins[donor_id] = self._shared.pins.get(donor_id, 0) + 1

    def release(self, donor_id: str) -> None:
        with self._shared.lock:
            count = self._shared.pins.get(donor_id, 0) - 1
            if count > 0:
                self._shared.pins[donor_id] = count
            else:
                self._shared.pins.pop(donor_id, None)

    def evict(self, donor_id: str, reason: str, *, force: bool = False) -> bool:
        """Delete a donor's manifest (its blocks may be shared: they expire with their TTL) and append
        ``donor_evicted``; refused (False) while pinned here or leased in the ledger, unless ``force``.

        Raises:
            StoreUnavailable: the manifest could not be deleted (the ledger has the eviction already).
        """
        with self._shared.lock:
            if not force and self._shared.pins.get(donor_id):
                return False
        if self.ledger is not None:
            try:
                if force:
                    self.ledger.evict_donor(donor_id, reason)
                elif not self.ledger.evict_donor_if_unleased(donor_id, reason):
                    return False
            except LedgerError as exc:  # EventRejected: a donor the ledger never registered
                log.debug("semkv: evicting donor %s: %s", donor_id, exc)
        self.forget_verified(self.ref_of(donor_id))
        with self._call("evict"):
            self.redis.delete(self._manifest_key(donor_id))
        return True

    def close(self) -> None:
        """Wait for queued eviction reports and close the connection pool."""
        self._reporter.shutdown(wait=True)
        self.redis.close()

    # -- internals -----------------------------------------------------------------------------

    def _fetch(self, ref: str, checksum: str) -> tuple[_Manifest, np.ndarray]:
        """The manifest and every block, checked: data ``[num_layers, num_blocks, block_bytes]``."""
        donor_id = self._donor_of(ref)
        with self._call("read manifest"):
            raw = self.redis.get(self._manifest_key(donor_id))
        if raw is None:
            self._gone(donor_id, ref)
            raise EntryMissing(f"donor store entry {ref} not found (expired or evicted)")
        if xxhash.xxh3_128_hexdigest(raw) != checksum:
            raise ChecksumMismatch(f"{ref}: manifest checksum does not match the ledger's")
        manifest = _parse_manifest(raw, ref)
        h = manifest.header
        if len(manifest.blocks) != h.num_blocks:
            raise ChecksumMismatch(f"{ref}: manifest names {len(manifest.blocks)} blocks for {h.num_blocks}")
        data = np.empty((h.num_layers, h.num_blocks, h.block_bytes), dtype=np.uint8)
        per_round = max(1, self.fetch_chunk_bytes // max(1, h.num_layers * h.block_bytes))
        for start in range(0, h.num_blocks, per_round):
            addresses = manifest.blocks[start : start + per_round]
            values = self._fetch_blocks([self._block_key(h.namespace, a) for a in addresses])
            for offset, (address, value) in enumerate(zip(addresses, values, strict=True)):
                if value is None:
                    self._gone(donor_id, ref)
                    raise EntryMissing(f"{ref}: block {start + offset} expired or evicted")
                if len(value) != h.num_layers * h.block_bytes or xxhash.xxh3_128_hexdigest(value) != address:
                    raise ChecksumMismatch(f"{ref}: block {start + offset} checksum mismatch")
                data[:, start + offset, :] = np.frombuffer(value, dtype=np.uint8).reshape(h.num_layers, h.block_bytes)
        for layer, expected in enumerate(h.layer_checksums):
            if xxhash.xxh3_128_hexdigest(data[layer]) != expected:
                raise ChecksumMismatch(f"{ref}: layer {layer} checksum mismatch")
        return manifest, data

    def _fetch_blocks(self, keys: list[str]) -> list[bytes | None]:
        """One pipelined round trip of ``GET``s (raises StoreUnavailable)."""
        with self._call("read blocks"):
            pipe = self.redis.pipeline(transaction=False)
            for key in keys:
                pipe.get(key)
            return pipe.execute()

    def _stage(self, ref: str, entry: _Staged) -> None:
        """Keep ``entry`` in memory, dropping the least recently used unheld, unpinned entries to make room;
        an entry bigger than the whole budget is not kept."""
        shared, size = self._shared, _nbytes(entry)
        with shared.lock:
            old = shared.staged.get(ref)
            if old is not None and old.checksum == entry.checksum:  # staged already (a concurrent verify)
                shared.staged.move_to_end(ref)
                return
            # ``ref`` stays readable until replaced: lookups read ``staged`` without the lock
            room = shared.stage_bytes + (_nbytes(old) if old is not None else 0)
            for other in list(shared.staged):
                if shared.staged_bytes + size <= room:
                    break
                victim = shared.staged[other]
                if other != ref and victim.holders == 0 and not shared.pins.get(self._donor_of(other)):
                    self._unstage(other)
            if size > shared.stage_bytes or shared.staged_bytes + size > room:
                return
            if old is not None:
                old.forgotten = True
                shared.staged_bytes -= _nbytes(old)
            shared.staged[ref] = entry
            shared.staged.move_to_end(ref)
            shared.staged_bytes += size

    def _unstage(self, ref: str) -> None:
        """Under the lock."""
        entry = self._shared.staged.pop(ref, None)
        if entry is not None:
            entry.forgotten = True
            self._shared.staged_bytes -= _nbytes(entry)

    def _let_go(self, entry: _Staged) -> None:
        with self._shared.lock:
            entry.holders -= 1

    def _gone(self, donor_id: str, ref: str) -> None:
        """Redis no longer holds the entry: unstage it and append ``donor_evicted`` (once per donor
        in this process, on the reporter thread: never a ledger write on the engine's thread)."""
        self.forget_verified(ref)
        if self.ledger is None or donor_id in self._reported:
            return
        self._reported.add(donor_id)
        log.warning("semkv: donor %s is gone from the Redis donor store (expired or evicted); recording donor_evicted",
                    donor_id)

        def report() -> None:
            try:
                self.ledger.evict_donor(donor_id, _EVICTION_REASON)
            except LedgerError as exc:  # unknown donor, or the ledger is down: the next check reports again
                log.warning("semkv: could not record donor_evicted for %s: %s", donor_id, exc)
                self._reported.discard(donor_id)

        try:
            self._reporter.submit(report)
        except RuntimeError:  # closed
            self._reported.discard(donor_id)


def _parse_manifest(raw: bytes, ref: str) -> _Manifest:
    try:
        fields = json.loads(raw)
        header_fields = dict(fields["header"])
        header_fields["layer_checksums"] = tuple(header_fields["layer_checksums"])
        header = EntryHeader(**header_fields)
        blocks = tuple(str(b) for b in fields["blocks"])
    except (ValueError, TypeError, KeyError) as exc:
        raise ChecksumMismatch(f"{ref}: unreadable manifest: {exc}") from exc
    return _Manifest(header, blocks, len(raw) + header.num_blocks * header.num_layers * header.block_bytes)


def operator_warnings(store: RedisDonorStore, *, redis_ttl_s: float, donor_ttl_s: float | None) -> list[str]:
    """Settings and server state that make donors disappear or stop being saved (connector-check
    prints them; the connector logs them when it opens the store): ``redis_ttl_s`` shorter than
    ``donor_ttl_s`` (a donor's bytes expire while the ledger still offers it: every such lookup is
    a miss, recorded as evicted), and :meth:`RedisMemory.warnings`. Empty when the server cannot
    be asked (unreachable: reported where it is used)."""
    out = []
    if donor_ttl_s is not None and redis_ttl_s < donor_ttl_s:
        out.append(f"redis_ttl_s ({redis_ttl_s:g} s) is shorter than donor_ttl_s ({donor_ttl_s:g} s): a donor's "
                   "bytes expire in Redis while the ledger still offers it; raise redis_ttl_s")
    try:
        memory = store.memory()
    except StoreUnavailable:
        memory = None
    return out + (memory.warnings() if memory is not None else [])


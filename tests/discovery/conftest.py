"""Fixtures of the discovery tests: a real SQLite ledger seeded through the ledger's own write path,
the labelled RFC workload (``tools/workloads.py``, CPython stdlib text) at a small context, and
providers/services indexed with its donors."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator

import pytest
import xxhash

from connector.discovery.service import DiscoveryService
from connector.discovery.settings import DiscoverySettings
from connector.discovery.types import DonorRecord, readonly_tokens
from connector.namespace import Namespace, content_keys
from ledger import events as ev
from ledger.client import LedgerClient
from ledger.writer import LedgerWriter
from tools.harness.builders import batch, cleared, stored
from tools.workloads import Workload, build_workload

TPB = 32
MODEL_ID = "harness-model"
CTX = 512


def digest(label: str) -> str:
    """A namespace digest (32 hex chars) standing for one namespace, e.g. one cache salt."""
    return xxhash.xxh3_128_hexdigest(label.encode())


NS = digest("tenant-a")
NS_OTHER = digest("tenant-b")
_seq = itertools.count(1000)


def append(db: str, *items) -> None:
    async def run() -> None:
        writer = await LedgerWriter.open(db)
        try:
            await writer.append(list(items))
        finally:
            await writer.close()

    asyncio.run(run())


def seed_donor(db: str, donor_id: str, tokens, *, namespace: str = NS, engine_id: str = "A", saved: bool = True,
               expires_at: float | None = None) -> int:
    """Register ``donor_id`` over the whole blocks of ``tokens`` (content keys under ``namespace``)."""
    n = len(tokens) // TPB
    client = LedgerClient(db)
    try:
        engine = client.engine(engine_id)
        client.register_donor(ev.DonorRegistered(
            donor_id=donor_id, namespace=namespace, engine_id=engine_id, generation=engine.generation if engine else 1,
            content_keys=content_keys(Namespace(namespace, {}), list(tokens), TPB, n),
            block_hashes=[xxhash.xxh64_intdigest(f"{donor_id}/{i}".encode()) for i in range(n)],
            num_tokens=n * TPB, tokens_per_block=TPB, expires_at=expires_at))
        if saved:
            client.mark_donor_saved(donor_id, store_ref=f"{donor_id}.kv", checksum="0" * 16, size_bytes=1)
        return (client.engine(engine_id)).generation
    finally:
        client.close()


def bump_generation(db: str, engine_id: str = "A") -> None:
    """The engine cleared every block (``AllBlocksCleared``): its generation goes up, its donors go stale."""
    append(db, batch(next(_seq), stored(next(_seq)), engine_id=engine_id))
    append(db, batch(next(_seq), cleared(), engine_id=engine_id))


def record(key: str, tokens, *, namespace: str = NS, engine_id: str = "A", text: str | None = None,
           generation: int | None = None) -> DonorRecord:
    n = len(tokens) // TPB * TPB
    return DonorRecord(key, engine_id, namespace, MODEL_ID, readonly_tokens(list(tokens)[:n]), TPB,
                       generation=generation, text=text)


@pytest.fixture(scope="session")
def workload() -> Workload:
    return build_workload(CTX, load=2)


def donor_namespace(workload: Workload, key: str) -> str:
    return NS_OTHER if workload.prompt(key).cache_salt == "tenant-a" else NS


def seed_workload(db: str, workload: Workload, service: DiscoveryService | None = None) -> None:
    """Every donor of the workload in the ledger (saved) and, if given, queued to ``service``."""
    for key in workload.donors:
        p = workload.prompt(key)
        ns = donor_namespace(workload, key)
        seed_donor(db, key, p.tokens, namespace=ns)
        if service is not None:
            service.register_donor(record(key, p.tokens, namespace=ns, text=p.text))


def settings(**kw) -> DiscoverySettings:
    values = {"providers": ("exact", "chunks", "minhash"), "lookup_timeout_s": 0.5, **kw}
    return DiscoverySettings(**values)


@pytest.fixture
def service(sqlite_db: str, workload: Workload) -> Iterator[DiscoveryService]:
    svc = DiscoveryService(settings(), db=sqlite_db)
    seed_workload(sqlite_db, workload, svc)
    assert svc.flush(30)
    try:
        yield svc
    finally:
        svc.close()


def wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.005)

"""Cross-host reuse through the networked donor store: engine A saves a donor into Redis, engine B —
its own store directory (no file of A's), one PostgreSQL ledger — materializes it, with prefill
logits bit-identical to B's own native reuse. The same with the Redis server killed while B reads
the donor fails closed: B's lookup misses, B prefills the prompt itself (logits equal to a cold
prefill), its executor keeps running, one error is logged, and a donor found gone afterwards is
recorded in the ledger as ``donor_evicted``.

Real parts: the reference TensorRT-LLM harness engines, the consumer daemon over loopback ZMQ, the
PostgreSQL ledger on 127.0.0.1:5432, Redis (the shared server with a key prefix of the test's own,
or a private ``redis-server`` for the stop). The variant with B in its own network namespace is
tests/connector/test_cross_host_netns.py. In CI these fail, never skip, without PostgreSQL or Redis.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import require_redis
from tools.harness.fleet import MODEL, Fleet, doc_tokens, native_engine
from tools.harness.redis_server import SHARED_REDIS_URL, RedisServer

TPB = MODEL.tokens_per_block


@pytest.fixture
def pg_fleet(tmp_path: Path, postgres_db: str) -> Iterator[Fleet]:
    f = Fleet(tmp_path, ("A", "B"), db=postgres_db).start()
    try:
        yield f
    finally:
        f.stop()


def redis_engines(fleet: Fleet, root: Path, url: str, prefix: str, **overrides):
    """A and B on ``url``, each with a store directory of its own (two hosts)."""
    common = {"donor_store": "redis", "redis_url": url, "redis_key_prefix": prefix, "redis_timeout_s": 10.0,
              **overrides}
    return (fleet.engine("A", store_dir=root / "host-a", **common),
            fleet.engine("B", store_dir=root / "host-b", **common))


def test_b_materializes_a_donor_from_redis_bit_identical_to_native_reuse(
        pg_fleet: Fleet, tmp_path: Path, redis_prefix: str) -> None:
    a, b = redis_engines(pg_fleet, tmp_path, SHARED_REDIS_URL, redis_prefix)
    doc, question = doc_tokens(15 * TPB, seed=11), doc_tokens(40, seed=12)
    a.generate(doc)
    assert a.metrics.value("semkv_donor_saves_total", outcome="saved") == 1
    pg_fleet.sync()
    b.scheduler.flush()  # B's background checksum fetched the donor from Redis and staged it

    got = b.generate(doc + question, max_new_tokens=4)

    assert got.num_connector_tokens == len(doc) == 480
    native = native_engine()
    native.generate(doc, 1)
    reference = native.generate(doc + question, 4)
    assert reference.num_reused_tokens == got.num_connector_tokens
    assert torch.equal(got.prefill_logits, reference.prefill_logits)  # bit-identical
    assert got.token_ids == reference.token_ids
    blocks = len(doc) // TPB
    assert torch.equal(b.llm.kv_cache[got.block_ids[:blocks]], native.kv_cache[reference.block_ids[:blocks]])
    m = b.metrics
    assert m.value("semkv_exact_materialized_total") == 1
    assert m.value("semkv_load_seconds_count", source="host_ram") == 1  # staged from Redis before the promise
    assert m.value("semkv_load_seconds_count", source="local_file") == 0
    assert b.misses() == {}
    # the hosts share no file: neither store directory was even created, and B read every block through Redis
    assert not (tmp_path / "host-a").exists() and not (tmp_path / "host-b").exists()
    assert b.scheduler.store.blocks_written == 0
    # B's finished request is a donor in its turn: its first 15 blocks are A's bytes, stored once
    pg_fleet.sync()
    assert b.metrics.value("semkv_donor_saves_total", outcome="saved") == 1
    assert b.worker.store.blocks_shared == blocks


def test_redis_killed_while_b_reads_the_donor_fails_closed_and_b_keeps_serving(
        pg_fleet: Fleet, tmp_path: Path, caplog) -> None:
    require_redis()
    caplog.set_level(logging.INFO, logger="connector.redis_store")
    with RedisServer() as server:
        a, b = redis_engines(pg_fleet, tmp_path, server.url, "semkv")
        doc, question = doc_tokens(15 * TPB, seed=21), doc_tokens(40, seed=22)
        rounds: list[int] = []
        store = b.scheduler.store
        store.fetch_chunk_bytes = 4 * MODEL.num_layers * store_block_bytes()  # 4 blocks per round trip
        fetch = store._fetch_blocks

        def killed_after_the_first_round(keys):
            values = fetch(keys)
            rounds.append(len(values))
            if len(rounds) == 1:
                server.stop()
            return values

        store._fetch_blocks = killed_after_the_first_round  # before A saves: B's view may see it within 5 ms
        a.generate(doc)
        pg_fleet.sync()
        b.scheduler.flush()
        assert rounds == [4]  # the server died 4 blocks into the 15-block donor

        got = b.generate(doc + question, max_new_tokens=4)  # the executor keeps running

        assert got.num_connector_tokens == 0 and got.num_reused_tokens == 0
        cold = native_engine().generate(doc + question, 4)
        assert torch.equal(got.prefill_logits, cold.prefill_logits)
        assert got.token_ids == cold.token_ids
        assert b.misses().get("store_unverified", 0) >= 1
        assert b.metrics.value("semkv_exact_materialized_total") == 0
        assert b.metrics.counts_by_reason("semkv_load_failures") == {}
        again = b.generate(doc_tokens(3 * TPB, seed=23), max_new_tokens=2)  # and serves the next one
        assert len(again.token_ids) == 2
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name == "connector.redis_store"]
        assert len(errors) == 1 and "unavailable" in errors[0].getMessage()  # once per server and outage
        assert b.metrics.value("semkv_donor_saves_total", outcome="store_unavailable") >= 1

        # the server comes back empty (no persistence): the donor is found gone and recorded as evicted
        with RedisServer(port=server.port):
            b.scheduler.spans._verify_in_background(*donor_entry(pg_fleet))
            b.scheduler.store.close()  # waits for the report
            donor_id = donor_entry(pg_fleet)[0]
            ledger = pg_fleet.ledger()
            try:
                assert ledger.donor_freshness(donor_id, namespace=a_namespace(pg_fleet, donor_id),
                                              policy="store") == "evicted"
            finally:
                ledger.close()


def store_block_bytes() -> int:
    """Bytes of one block in one layer of the harness model's pool (float32 K and V)."""
    return 2 * MODEL.num_kv_heads * MODEL.head_dim * MODEL.tokens_per_block * 4


def donor_entry(fleet: Fleet) -> tuple[str, str, str]:
    """(donor_id, store_ref, checksum) of engine A's saved donor."""
    from sqlalchemy import select

    from ledger.schema import DonorRow

    t = DonorRow.__table__
    with fleet._reader.connect() as conn:
        row = conn.execute(select(t.c.donor_id, t.c.store_ref, t.c.checksum)
                           .where(t.c.engine_id == "A", t.c.store_ref.is_not(None))).first()
    assert row is not None
    return row[0], row[1], row[2]


def a_namespace(fleet: Fleet, donor_id: str) -> str:
    from sqlalchemy import select

    from ledger.schema import DonorRow

    t = DonorRow.__table__
    with fleet._reader.connect() as conn:
        return conn.execute(select(t.c.namespace).where(t.c.donor_id == donor_id)).scalar_one()


# -- vLLM: a promise may fail after the answer (vLLM recomputes), so its worker reads Redis at load time --

def vllm_recipient(fleet: Fleet, root: Path, url: str, prefix: str, **store_kw):
    """B's connector as the vLLM adapter builds it; its worker is another process in vLLM, modelled by a
    store of its own (another store_dir: nothing staged by the scheduler is shared with it)."""
    from connector.redis_store import RedisDonorStore
    from tests.connector.test_vllm_per_layer_liveness import VllmOrderWith

    order = VllmOrderWith(fleet, donor_store="redis", redis_url=url, redis_key_prefix=prefix,
                          store_dir=root / "host-b", redis_timeout_s=10.0)
    order.worker.store.close()
    order.worker.store = RedisDonorStore(url, root / "host-b-worker", key_prefix=prefix, timeout_s=10.0,
                                         ledger=order.worker.ledger, **store_kw)
    return order


def test_vllm_worker_loads_from_redis_at_load_time(pg_fleet: Fleet, tmp_path: Path, redis_prefix: str) -> None:
    from tests.connector.test_failure_injection import DOC

    pg_fleet.engine("A", store_dir=tmp_path / "host-a", donor_store="redis", redis_url=SHARED_REDIS_URL,
                    redis_key_prefix=redis_prefix).generate(DOC)
    pg_fleet.sync()
    order = vllm_recipient(pg_fleet, tmp_path, SHARED_REDIS_URL, redis_prefix)
    try:
        order.scheduler.flush()
        assert order.run() == list(range(MODEL.num_layers))
        m = order.worker.metrics
        assert m.value("semkv_exact_materialized_total") == 1
        assert m.value("semkv_load_seconds_count", source="redis") == 1
        assert m.value("semkv_load_seconds_count", source="host_ram") == 0
    finally:
        order.close()


def test_vllm_load_with_redis_killed_mid_load_fails_the_plan_and_vllm_recomputes(
        pg_fleet: Fleet, tmp_path: Path, caplog) -> None:
    from connector.worker import SemKvLoadError
    from tests.connector.test_failure_injection import DOC

    require_redis()
    caplog.set_level(logging.INFO, logger="connector.redis_store")
    with RedisServer() as server:
        pg_fleet.engine("A", store_dir=tmp_path / "host-a", donor_store="redis", redis_url=server.url,
                        redis_key_prefix="semkv", redis_timeout_s=10.0).generate(DOC)
        pg_fleet.sync()
        order = vllm_recipient(pg_fleet, tmp_path, server.url, "semkv",
                               fetch_chunk_bytes=2 * MODEL.num_layers * store_block_bytes())
        try:
            order.scheduler.flush()
            rounds: list[int] = []
            fetch = order.worker.store._fetch_blocks

            def killed_after_the_first_round(keys):
                values = fetch(keys)
                rounds.append(len(values))
                if len(rounds) == 1:
                    server.stop()
                return values

            order.worker.store._fetch_blocks = killed_after_the_first_round
            with pytest.raises(SemKvLoadError, match="store_unavailable"):
                order.run()
            assert rounds == [2]  # 2 of the donor's 10 blocks read when the server died; none copied
            order.assert_failed("store_unavailable")
        finally:
            order.close()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and r.name == "connector.redis_store"]
    assert len(errors) == 1

"""The networked donor store on a real Redis server: content-addressed blocks stored once, checksums
checked before any byte is handed out, TTL on every key, a donor gone from Redis recorded in the
ledger as ``donor_evicted``, and a server that stops in the middle of a read failing it closed.

The shared server (127.0.0.1:6379) is used with a key prefix of the test's own; the stop test
starts and kills its own ``redis-server`` (tools/harness/redis_server.py). In CI these fail, never
skip, when Redis is missing (tests/conftest.py ``require_redis``)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pytest
import redis

from connector.donor_store import ChecksumMismatch, EntryMissing, StoreUnavailable
from connector.redis_store import RedisDonorStore, RedisMemory, operator_warnings
from ledger import events as ev
from ledger.client import LedgerClient
from tests.conftest import require_redis
from tools.harness.redis_server import SHARED_REDIS_URL, RedisServer

LAYERS, BLOCKS, ELEMS = 3, 4, 16
BUSY_TIMEOUT_S = 10.0
"""Redis timeout of the stores that must not fail: a CI machine shared with other work can answer late."""


def layers(seed: int, blocks: int = BLOCKS) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((blocks, 2, ELEMS), dtype=np.float32) for _ in range(LAYERS)]


def header(blocks: int = BLOCKS, probe: str | None = None) -> dict:
    return {"namespace": "ns", "num_layers": LAYERS, "kv_factor": 2, "block_elems": ELEMS, "dtype": "float32",
            "itemsize": 4, "num_blocks": blocks, "tokens_per_block": 8, "probe": probe,
            "namespace_fields": {"cache_salt": "none"}}


def as_layers(reader, blocks: int = BLOCKS) -> list[np.ndarray]:
    return [np.frombuffer(reader.read_layer(l).tobytes(), np.float32).reshape(blocks, 2, ELEMS) for l in range(LAYERS)]


def register(ledger: LedgerClient, donor_id: str) -> None:
    ledger.register_donor(ev.DonorRegistered(donor_id=donor_id, namespace="ns", engine_id="A", generation=1,
                                             content_keys=[donor_id.encode()], block_hashes=[1], num_tokens=8,
                                             tokens_per_block=8))


def keys(prefix: str) -> list[bytes]:
    client = redis.Redis.from_url(SHARED_REDIS_URL)
    try:
        return sorted(client.scan_iter(match=f"{prefix}:*"))
    finally:
        client.close()


def test_round_trip_two_hosts_and_identical_blocks_stored_once(tmp_path: Path, redis_prefix: str) -> None:
    saver = RedisDonorStore(SHARED_REDIS_URL, tmp_path / "host-a", key_prefix=redis_prefix, ttl_s=120,
                            timeout_s=BUSY_TIMEOUT_S)
    reader_host = RedisDonorStore(SHARED_REDIS_URL, tmp_path / "host-b", key_prefix=redis_prefix, ttl_s=120,
                            timeout_s=BUSY_TIMEOUT_S)
    first = layers(1)
    entry = saver.put("d1", first, header(probe="p1"))
    assert entry.ref == "d1.redis" and saver.blocks_written == BLOCKS
    # a second donor whose first two blocks hold the same bytes shares them (stored once)
    second = [np.concatenate([l[:2], extra[2:]]) for l, extra in zip(first, layers(2), strict=True)]
    other = saver.put("d2", second, header())
    assert saver.blocks_written == BLOCKS + 2 and saver.blocks_shared == 2
    block_keys = [k for k in keys(redis_prefix) if b":b:" in k]
    assert len(block_keys) == 2 * BLOCKS - 2
    # host B never saw these donors: its reads come from Redis, checked in full
    assert not reader_host.known_verified(entry.ref, entry.checksum)
    assert reader_host.verified(entry.ref, entry.checksum) is None
    with reader_host.open(other.ref, other.checksum) as reader:
        assert reader.source == "redis"
        assert all(np.array_equal(a, b) for a, b in zip(as_layers(reader), second, strict=True))
    reader_host.verify(entry.ref, entry.checksum)  # staged in host B's memory now
    assert reader_host.known_verified(entry.ref, entry.checksum)
    with reader_host.open(entry.ref, entry.checksum) as reader:
        assert reader.source == "host_ram"
        assert all(np.array_equal(a, b) for a, b in zip(as_layers(reader), first, strict=True))
    assert reader_host.donors_with_probe("p1") == ["d1"]
    assert reader_host.read_header(entry.ref).num_blocks == BLOCKS
    with pytest.raises(ChecksumMismatch):
        reader_host.open(entry.ref, "0" * 32)  # not the manifest the ledger recorded
    # every key expires: TTL set on blocks, manifests and the probe index
    client = redis.Redis.from_url(SHARED_REDIS_URL)
    try:
        ttls = [client.pttl(k) for k in keys(redis_prefix)]
    finally:
        client.close()
    assert ttls and all(0 < ttl <= 120_000 for ttl in ttls)
    saver.close()
    reader_host.close()


def test_an_engine_that_recomputes_failed_loads_keeps_no_bytes_only_what_was_verified(
        tmp_path: Path, redis_prefix: str) -> None:
    from connector.engine_contract import VLLM
    from connector.harness import HarnessLlmArgs, KvCacheConfig, ModelConfig
    from connector.scheduler import SemKvScheduler
    from connector.settings import load_connector_settings

    saver = RedisDonorStore(SHARED_REDIS_URL, tmp_path / "a", key_prefix=redis_prefix, keep_bytes=False)
    entry = saver.put("d1", layers(3), header())
    # vLLM's scheduler: a lookup needs to know the entry was verified, never its bytes (its worker is
    # another process, and a failed load is recomputed)
    lookup = RedisDonorStore(SHARED_REDIS_URL, tmp_path / "b", key_prefix=redis_prefix, keep_bytes=False)
    lookup.verify(entry.ref, entry.checksum)
    assert lookup.known_verified(entry.ref, entry.checksum) and lookup.verified(entry.ref, entry.checksum)
    assert lookup._shared.staged_bytes == 0 and saver._shared.staged_bytes == 0  # noqa: SLF001 - the point
    assert lookup.secure(entry.ref, entry.checksum) is None  # nothing to hold: such an engine never binds
    with lookup.open(entry.ref, entry.checksum) as reader:
        assert reader.source == "redis"
        assert all(np.array_equal(a, b) for a, b in zip(as_layers(reader), layers(3), strict=True))
    saver.close()
    lookup.close()
    settings = load_connector_settings({"db": f"sqlite:///{tmp_path}/l.db", "donor_store": "redis",
                                        "redis_url": SHARED_REDIS_URL, "redis_key_prefix": redis_prefix,
                                        "store_dir": str(tmp_path / "c")}, environ={})
    from ledger.migrate import upgrade

    upgrade(settings.db)
    config = ModelConfig()
    args = HarnessLlmArgs(model=config.name, harness_model_config=config, kv_cache_config=KvCacheConfig(),
                          max_seq_len=4096, max_num_tokens=512)
    for engine, kept in ((VLLM, False), (None, True)):  # None: TensorRT-LLM, the default contract
        scheduler = SemKvScheduler(args, settings=settings, **({"engine": engine} if engine else {}))
        try:
            assert scheduler.store.keep_bytes is kept
        finally:
            scheduler.close()


def test_a_corrupt_block_is_caught_before_any_byte_is_handed_out(tmp_path: Path, redis_prefix: str) -> None:
    store = RedisDonorStore(SHARED_REDIS_URL, tmp_path / "a", key_prefix=redis_prefix, timeout_s=BUSY_TIMEOUT_S)
    entry = store.put("d1", layers(3), header())
    victim = next(k for k in keys(redis_prefix) if b":b:" in k)
    client = redis.Redis.from_url(SHARED_REDIS_URL)
    try:
        value = bytearray(client.get(victim))
        value[-1] ^= 0xFF
        client.set(victim, bytes(value), keepttl=True)
    finally:
        client.close()
    other_host = RedisDonorStore(SHARED_REDIS_URL, tmp_path / "b", key_prefix=redis_prefix, timeout_s=BUSY_TIMEOUT_S)
    with pytest.raises(ChecksumMismatch, match="block"):
        other_host.open(entry.ref, entry.checksum)
    with pytest.raises(ChecksumMismatch):
        other_host.verify(entry.ref, entry.checksum)
    assert not other_host.known_verified(entry.ref, entry.checksum)
    store.close()
    other_host.close()


def test_an_expired_donor_is_recorded_as_evicted_and_its_load_fails_closed(
        tmp_path: Path, redis_prefix: str, sqlite_db: str) -> None:
    ledger = LedgerClient(sqlite_db)
    register(ledger, "short")
    register(ledger, "long")
    saver = RedisDonorStore(SHARED_REDIS_URL, tmp_path / "a", key_prefix=redis_prefix, ttl_s=0.3, ledger=ledger,
                            timeout_s=BUSY_TIMEOUT_S)
    short = saver.put("short", layers(4), header())
    assert ledger.donor_freshness("short", namespace="ns", policy="store") is None  # donor_saved recorded
    recipient = RedisDonorStore(SHARED_REDIS_URL, tmp_path / "b", key_prefix=redis_prefix, ledger=ledger,
                                timeout_s=BUSY_TIMEOUT_S)
    time.sleep(0.5)  # Redis expires the keys (real TTL, no clock tricks)
    with pytest.raises(EntryMissing, match="expired or evicted"):
        recipient.open(short.ref, short.checksum)
    recipient.close()  # waits for the report
    assert ledger.donor_freshness("short", namespace="ns", policy="store") == "evicted"
    # the saver's own staged copy is found gone by its periodic recheck, reported once
    long_store = RedisDonorStore(SHARED_REDIS_URL, tmp_path / "c", key_prefix=redis_prefix, ttl_s=120, ledger=ledger,
                                 timeout_s=BUSY_TIMEOUT_S)
    long = long_store.put("long", layers(5), header())
    client = redis.Redis.from_url(SHARED_REDIS_URL)
    try:  # evicted by the server (as maxmemory would): one block key only
        client.delete(next(k for k in keys(redis_prefix) if b":b:" in k))
    finally:
        client.close()
    assert long_store.known_verified(long.ref, long.checksum)
    assert long_store.recheck_verified() == 1
    assert not long_store.known_verified(long.ref, long.checksum)
    long_store.close()
    assert ledger.donor_freshness("long", namespace="ns", policy="store") == "evicted"
    saver.close()
    ledger.close()


def test_redis_stopped_mid_read_fails_closed_with_one_error(tmp_path: Path, caplog) -> None:
    require_redis()
    with RedisServer() as server:
        blocks = 64
        saver = RedisDonorStore(server.url, tmp_path / "a", key_prefix="semkv", timeout_s=BUSY_TIMEOUT_S)
        entry = saver.put("big", layers(6, blocks), header(blocks))
        reader = RedisDonorStore(server.url, tmp_path / "b", key_prefix="semkv", timeout_s=BUSY_TIMEOUT_S,
                                 fetch_chunk_bytes=8 * LAYERS * 2 * ELEMS * 4)  # 8 blocks per round trip
        rounds = []
        fetch = reader._fetch_blocks

        def stop_after_first_round(block_keys):  # the server dies while the read is under way
            values = fetch(block_keys)
            rounds.append(len(values))
            if len(rounds) == 1:
                server.stop()
            return values

        reader._fetch_blocks = stop_after_first_round
        caplog.set_level(logging.INFO, logger="connector.redis_store")
        with pytest.raises(StoreUnavailable):
            reader.open(entry.ref, entry.checksum)
        assert rounds == [8]  # it stopped midway: 8 of 64 blocks read, none handed out
        for _ in range(3):  # still down: each call fails fast and closed, logged once
            with pytest.raises(StoreUnavailable):
                reader.verify(entry.ref, entry.checksum)
        assert reader.verified(entry.ref, entry.checksum) is None  # unknown, not "gone": nothing reported
        assert not reader.known_verified(entry.ref, entry.checksum)
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "unavailable" in errors[0].getMessage()
        reader.close()
        saver.close()


def test_connector_check_pings_the_redis_store_and_names_the_setting(tmp_path: Path, sqlite_db: str) -> None:
    import typer
    from typer.testing import CliRunner

    from connector.cli import register

    require_redis()
    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)  # a second command keeps typer in multi-command mode
    with RedisServer() as server:
        config = tmp_path / "redis.toml"
        config.write_text(f'db = "{sqlite_db}"\ndonor_store = "redis"\nredis_url = "{server.url}"\n')
        result = CliRunner().invoke(app, ["connector-check", "--config", str(config)])
        assert result.exit_code == 0, result.output
        assert f"store=redis redis 127.0.0.1:{server.port}/0" in result.output
    result = CliRunner().invoke(app, ["connector-check", "--config", str(config)])  # the server is gone
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: donor store (redis_url)") and "redis.toml" in lines[0]


def test_a_server_that_would_lose_or_refuse_donors_is_named_at_start(tmp_path: Path, sqlite_db: str) -> None:
    import typer
    from typer.testing import CliRunner

    from connector.cli import register

    require_redis()
    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        client.config_set("maxmemory-policy", "noeviction")  # and maxmemory 0: redis-server's defaults
        store = RedisDonorStore(server.url, tmp_path / "a")
        memory = store.memory()
        assert isinstance(memory, RedisMemory) and (memory.max_bytes, memory.policy) == (0, "noeviction")
        warned = operator_warnings(store, redis_ttl_s=600, donor_ttl_s=3600)
        assert [w.split(" ")[0:2] for w in warned] == [["redis_ttl_s", "(600"], ["Redis", "maxmemory-policy"],
                                                      ["Redis", "has"]]
        client.config_set("maxmemory", 64 * 2**20)
        client.config_set("maxmemory-policy", "allkeys-lru")
        assert operator_warnings(store, redis_ttl_s=3600, donor_ttl_s=3600) == []  # as designed: nothing to say
        client.config_set("maxmemory-policy", "noeviction")
        config = tmp_path / "redis.toml"
        config.write_text(f'db = "{sqlite_db}"\ndonor_store = "redis"\nredis_url = "{server.url}"\n'
                          'redis_ttl_s = 60\ndonor_ttl_s = 3600\n')
        result = CliRunner().invoke(app, ["connector-check", "--config", str(config)])
        assert result.exit_code == 0, result.output  # warnings, not errors: the connector runs
        warnings = [line for line in result.output.splitlines() if line.startswith("warning: ")]
        assert len(warnings) == 2 and "redis_ttl_s (60 s)" in warnings[0] and "noeviction" in warnings[1]
        store.close()
        client.close()


def test_a_bounded_recheck_goes_round_robin_within_its_key_budget(tmp_path: Path, redis_prefix: str,
                                                                  monkeypatch) -> None:
    from connector import redis_store

    monkeypatch.setattr(redis_store, "_RECHECK_KEYS", 2 * (1 + BLOCKS))  # two donors per run
    store = RedisDonorStore(SHARED_REDIS_URL, tmp_path / "a", key_prefix=redis_prefix, timeout_s=BUSY_TIMEOUT_S)
    entries = [store.put(f"d{i}", layers(10 + i), header()) for i in range(5)]
    client = redis.Redis.from_url(SHARED_REDIS_URL)
    try:
        for entry in entries:  # every manifest gone: each run finds exactly the donors it checked
            client.delete(f"{redis_prefix}:m:{entry.ref.removesuffix('.redis')}")
    finally:
        client.close()
    assert [store.recheck_verified(256) for _ in range(3)] == [2, 2, 1]
    assert store.staged_entries() == 0
    store.close()

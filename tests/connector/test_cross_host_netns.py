"""Cross-host reuse with the recipient on another network: engine B runs as a process of its own in
a Linux network namespace (tools/harness/netns.py), joined to this one by a veth pair only. The
Redis donor store is a private ``redis-server`` bound on this side's veth address; from inside, the
machine's loopback services (its Redis on 127.0.0.1:6379) do not answer. B reaches the PostgreSQL
ledger through its Unix socket (the machine's server listens on 127.0.0.1 only, and a namespace
does not separate filesystems) and runs its own consumer daemon on its own loopback. Engine A,
here, saves a donor into Redis over the veth address; B materializes it, logits bit-identical to
its own native reuse.

Needs root and iproute2: elsewhere it is skipped with the reason, also in CI (the same proof
without the namespace, tests/connector/test_cross_host.py, always runs there).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import require_redis
from tools.harness.fleet import MODEL, Fleet, doc_tokens
from tools.harness.netns import NetworkNamespace, netns_unavailable
from tools.harness.redis_server import RedisServer

REPO = Path(__file__).resolve().parents[2]
PG_SOCKET_DIR = Path("/var/run/postgresql")


def unix_socket_url(url: str) -> str:
    """The same PostgreSQL database through the server's Unix socket (reachable from any network namespace)."""
    user_host, name = url.rsplit("/", 1)
    user = user_host.split("//", 1)[1].split("@", 1)[0]
    return f"postgresql://{user}@/{name}?host={PG_SOCKET_DIR}"


def test_b_in_its_own_network_namespace_materializes_a_donor_through_redis(tmp_path: Path, postgres_db: str) -> None:
    require_redis()
    why_not = netns_unavailable()
    if why_not is not None:
        pytest.skip(why_not)
    if not (PG_SOCKET_DIR / ".s.PGSQL.5432").exists():
        pytest.skip(f"no PostgreSQL Unix socket in {PG_SOCKET_DIR}")
    doc_seed, question_seed, doc_blocks = 31, 32, 15
    with NetworkNamespace() as ns, RedisServer(ns.host_address) as server:
        fleet = Fleet(tmp_path / "host-a-side", ("A",), db=postgres_db).start()
        try:
            a = fleet.engine("A", store_dir=tmp_path / "host-a", donor_store="redis", redis_url=server.url,
                             redis_key_prefix="semkv", redis_timeout_s=10.0)
            a.generate(doc_tokens(doc_blocks * MODEL.tokens_per_block, seed=doc_seed))
            fleet.sync()
            assert a.metrics.value("semkv_donor_saves_total", outcome="saved") == 1
            run = subprocess.run(
                [*ns.exec_prefix, sys.executable, "-m", "tools.harness.cross_host_recipient",
                 "--db", unix_socket_url(postgres_db), "--redis-url", server.url, "--prefix", "semkv",
                 "--root", str(tmp_path / "b-side"), "--doc-seed", str(doc_seed),
                 "--question-seed", str(question_seed), "--doc-blocks", str(doc_blocks)],
                cwd=REPO, capture_output=True, text=True, timeout=300)
        finally:
            fleet.stop()
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["loopback_redis_answers"] is False  # B is on another network: only the veth reaches A's side
    assert result["connector_tokens"] == doc_blocks * MODEL.tokens_per_block == result["native_reused_tokens"]
    assert result["logits_equal"] and result["tokens_equal"] and result["kv_equal"]
    assert result["loads_host_ram"] == 1 and result["loads_local_file"] == 0
    assert result["misses"] == {}
    assert result["store_dir_exists"] is False

"""Helpers the tests and the benchmarks in ``tools/`` share. The dependency points one way: tests
import these, and nothing here imports ``tests/`` or pytest (a benchmark runs without the test tree).

* ``builders``: constructors for ledger inputs (normalized events, received batches);
* ``postgres``: scratch PostgreSQL databases, created and dropped;
* ``fleet``: :class:`~tools.harness.fleet.Fleet`, harness engines with their publishers and a
  consumer daemon on one SQLite ledger;
* ``discovery_fleet``: a fleet engine whose scheduler runs donor discovery;
* ``vllm_fleet``: real vLLM engine processes, the ``semkv-ledger consume`` process, a lossy relay.
"""

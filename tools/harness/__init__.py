"""Helpers the tests and the benchmarks in ``tools/`` share. The dependency points one way: tests
import these, and nothing here imports ``tests/`` or pytest (a benchmark runs without the test tree).

* ``builders``: constructors for ledger inputs (normalized events, received batches);
* ``postgres``: scratch PostgreSQL databases, created and dropped;
* ``fleet``: :class:`~tools.harness.fleet.Fleet`, harness engines with their publishers and a
  consumer daemon on one SQLite ledger;
* ``discovery_fleet``: a fleet engine whose scheduler runs donor discovery;
* ``consume_process``: the ``semkv-ledger consume`` process, free ports, metrics scrapes, waiting on a
  condition (both real-engine groups);
* ``vllm_fleet``: real vLLM engine processes and a lossy relay (tests/vllm_cpu);
* ``dynamo_fleet``: a real NVIDIA Dynamo fleet, mocker workers behind the frontend's KV router, and
  its seeded traffic (tests/dynamo_cpu);
* ``cached_env``: the build-once venvs of the real-engine groups (``tools/*_cpu/setup_env.py``;
  standard library only).
"""

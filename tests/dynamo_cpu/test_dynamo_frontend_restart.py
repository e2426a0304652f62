"""A restart of Dynamo's frontend (its KV router, whose radix index lives in memory), on a real
NVIDIA Dynamo 1.6.1 fleet of two mocker workers and a SQLite ledger fed by ``semkv-ledger consume``
(issue 22: a workload where the ledger might know more than Dynamo's router).

The ledger does not depend on the frontend: after the frontend is stopped with SIGTERM and a new one
started, the ledger's advice still names, for each prompt, the one worker that holds its blocks,
with every full block. And what Dynamo does (the fact the routing benchmark's
``--restart-frontend-after`` measures): 1.6.1's router does not start empty; it restores each
worker's blocks from the worker's own local KV indexer when it discovers the worker (ai-dynamo/dynamo
``lib/llm/src/kv_router/indexer/recovery/worker_query.rs``, ``WorkerQueryClient``; the worker's
``worker_kv_query_source_*`` endpoint, on by default: ``enable_local_indexer = True`` in the
installed wheel's ``dynamo/mocker/config.py``). So after the restart Dynamo alone routes each prompt
to its holder with every block cached, like the ledger's advice. That part fails the day a Dynamo
release restarts its router empty.

With the workers' local indexers off (a Dynamo setting, on by default; the mocker takes it from
``--extra-engine-args``: :func:`tools.harness.dynamo_fleet.mocker_config_without_local_indexer`), the
restarted router has nothing to restore from: the ledger's hint still names each prompt's holder,
and a request sent there with the hint is served with every block cached while Dynamo's own router
reports no overlap for it (``kv_hit_rate`` 0): the ledger knows what Dynamo's router has forgotten.
This is the workload of ``tools/dynamo_cpu/routing_compare.py --restart-frontend-after N
--no-worker-local-indexer``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from connector.placement.advice import PlacementAdvisor
from connector.placement.dynamo_hint import dynamo_hint, nvext_hint
from tools.harness.consume_process import wait_for
from tools.harness.dynamo_fleet import (
    BLOCK_SIZE, DynamoFleet, fleet_with_ledger, mocker_config_without_local_indexer, seeded_prompts)

pytestmark = pytest.mark.timeout(240)

SYNC_TIMEOUT_S = 30.0
APPLIED = re.compile(r'^dynamo_component_kv_cache_events_applied\{[^}]*event_type="stored"[^}]*status="ok"[^}]*\} (\S+)$',
                     re.MULTILINE)


def two_worker_fleet(dynamo_env, root, local_indexer: bool) -> Iterator[tuple[DynamoFleet, PlacementAdvisor]]:
    python, model = dynamo_env
    worker_args: tuple[str, ...] = ()
    if not local_indexer:
        config = mocker_config_without_local_indexer(python, model, 256, root / "mocker-no-local-indexer.json")
        worker_args = ("--extra-engine-args", str(config))
    fleet = DynamoFleet(root, python, model, num_workers=2, worker_args=worker_args)
    with fleet_with_ledger(fleet, root) as advisor:
        yield fleet, advisor
    assert not fleet.stray_processes(), f"still running after the fleet closed: {fleet.stray_processes()}"


@pytest.fixture(scope="module")
def restart_fleet(dynamo_env, tmp_path_factory) -> Iterator[tuple[DynamoFleet, PlacementAdvisor]]:
    yield from two_worker_fleet(dynamo_env, tmp_path_factory.mktemp("dynamo-frontend-restart"), local_indexer=True)


@pytest.fixture(scope="module")
def forgetful_fleet(dynamo_env, tmp_path_factory) -> Iterator[tuple[DynamoFleet, PlacementAdvisor]]:
    yield from two_worker_fleet(dynamo_env, tmp_path_factory.mktemp("dynamo-no-local-indexer"), local_indexer=False)


def stored_events_applied(fleet: DynamoFleet) -> float:
    """The frontend's count of stored KV events its router applied (``/metrics``, every worker)."""
    return sum(float(v) for v in APPLIED.findall(fleet.metrics_text()))


def place_and_restart(fleet: DynamoFleet, advisor: PlacementAdvisor) -> dict[str, list[int]]:
    """One prompt placed on each worker (targeted requests), the ledger caught up, then the frontend
    restarted (SIGTERM, a new one); asserts that the ledger's hint names each prompt's holder with
    every full block after the restart. The prompts by holder."""
    instance_of = {w.engine_id: w.instance_id for w in fleet.workers}
    engine_of = {i: e for e, i in instance_of.items()}
    prompts = fleet.tokenize(list(seeded_prompts(2205, 2, min_chars=1200)))
    prompts = [t if len(t) % BLOCK_SIZE else t[:-1] for t in prompts]  # a recomputed last token, not a whole block
    holders = {"dynamo-0": prompts[0], "dynamo-1": prompts[1]}

    def live(tokens: list[int], engine_id: str) -> int | None:
        return next((a.live_blocks for a in advisor.advise(tokens).engines if a.engine_id == engine_id), None)

    # Setup: each prompt placed on its own worker (targeted requests), the ledger caught up.
    for engine_id, tokens in holders.items():
        placed = fleet.complete(tokens, max_tokens=1, nvext={"backend_instance_id": instance_of[engine_id]})
        assert engine_of[placed["nvext"]["worker_id"]["decode_worker_id"]] == engine_id
        wait_for(lambda: live(tokens, engine_id) == len(tokens) // BLOCK_SIZE, SYNC_TIMEOUT_S,
                 f"the ledger to hold the prompt's blocks on {engine_id}")

    old_pid = fleet.frontend.proc.pid  # type: ignore[union-attr]
    fleet.restart_frontend()
    assert fleet.frontend_starts == 2 and fleet.frontend.proc.pid != old_pid  # type: ignore[union-attr]
    assert {w.engine_id: w.instance_id for w in fleet.workers} == instance_of  # the workers untouched

    # The ledger's advice, after the restart: the holder, alone, with every full block.
    for engine_id, tokens in holders.items():
        hint = dynamo_hint(advisor.advise(tokens), instance_of)
        full = len(tokens) // BLOCK_SIZE
        assert hint is not None and (hint.engine_id, hint.instance_id, hint.blocks) == (
            engine_id, instance_of[engine_id], full), (engine_id, hint)
    return holders


def test_after_a_frontend_restart_the_advice_still_names_the_holders(restart_fleet) -> None:
    fleet, advisor = restart_fleet
    holders = place_and_restart(fleet, advisor)
    engine_of = {w.instance_id: w.engine_id for w in fleet.workers}

    # Dynamo's router, after the restart: it has restored both workers' blocks (one stored event
    # applied per worker, the worker's tree dump) and routes each prompt, unhinted, to its holder.
    wait_for(lambda: stored_events_applied(fleet) >= len(holders), SYNC_TIMEOUT_S,
             "the new frontend's router to restore the workers' blocks")
    for engine_id, tokens in holders.items():
        answered = fleet.complete(tokens, max_tokens=1)
        assert engine_of[answered["nvext"]["worker_id"]["decode_worker_id"]] == engine_id, (
            f"after the restart Dynamo alone routed the prompt held by {engine_id} elsewhere: "
            "its router no longer restores the workers' blocks, and the ledger's hint would matter")
        assert answered["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(tokens) // BLOCK_SIZE) * BLOCK_SIZE
        assert answered["nvext"]["timing"]["kv_hit_rate"] > 0


def test_without_local_indexers_the_restarted_router_forgets_and_the_ledger_does_not(forgetful_fleet) -> None:
    fleet, advisor = forgetful_fleet
    holders = place_and_restart(fleet, advisor)
    instance_of = {w.engine_id: w.instance_id for w in fleet.workers}
    engine_of = {i: e for e, i in instance_of.items()}
    for engine_id, tokens in holders.items():
        hint = dynamo_hint(advisor.advise(tokens), instance_of)
        answered = fleet.complete(tokens, max_tokens=1, nvext=nvext_hint(hint))
        assert engine_of[answered["nvext"]["worker_id"]["decode_worker_id"]] == engine_id
        # the worker still holds every block (the mocker's cached tokens), as the ledger said ...
        assert answered["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(tokens) // BLOCK_SIZE) * BLOCK_SIZE
        # ... while Dynamo's restarted router knows of none of them
        assert answered["nvext"]["timing"]["kv_hit_rate"] == 0, (
            "Dynamo's restarted router knew the worker's blocks without its local indexer: "
            "it restores them some other way now, and this workload no longer shows the ledger knowing more")

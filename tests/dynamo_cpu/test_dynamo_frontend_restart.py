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
release (or a deployment with the workers' local indexers off) restarts its router empty, which is
when the ledger's evidence would be worth sending after a restart.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from connector.placement.advice import PlacementAdvisor
from connector.placement.dynamo_hint import dynamo_hint
from tools.harness.consume_process import wait_for
from tools.harness.dynamo_fleet import BLOCK_SIZE, DynamoFleet, fleet_with_ledger, seeded_prompts

pytestmark = pytest.mark.timeout(240)

SYNC_TIMEOUT_S = 30.0
APPLIED = re.compile(r'^dynamo_component_kv_cache_events_applied\{[^}]*event_type="stored"[^}]*status="ok"[^}]*\} (\S+)$',
                     re.MULTILINE)


@pytest.fixture(scope="module")
def restart_fleet(dynamo_env, tmp_path_factory) -> Iterator[tuple[DynamoFleet, PlacementAdvisor]]:
    python, model = dynamo_env
    root = tmp_path_factory.mktemp("dynamo-frontend-restart")
    fleet = DynamoFleet(root, python, model, num_workers=2)
    with fleet_with_ledger(fleet, root) as advisor:
        yield fleet, advisor
    assert not fleet.stray_processes(), f"still running after the fleet closed: {fleet.stray_processes()}"


def stored_events_applied(fleet: DynamoFleet) -> float:
    """The frontend's count of stored KV events its router applied (``/metrics``, every worker)."""
    return sum(float(v) for v in APPLIED.findall(fleet.metrics_text()))


def test_after_a_frontend_restart_the_advice_still_names_the_holders(restart_fleet) -> None:
    fleet, advisor = restart_fleet
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

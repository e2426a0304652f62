"""Dynamo routes with semkv-ledger's evidence (issue 22): on a real NVIDIA Dynamo 1.6.1 fleet (two
mocker workers, the frontend with ``--router-mode kv``) and a SQLite ledger fed by ``semkv-ledger
consume`` from the workers' KV events, the hint of :mod:`connector.placement.dynamo_hint`
(``nvext.backend_instance_id``) names the worker the ledger singles out, Dynamo serves the request
there and reports as cached what the ledger said that worker held, where Dynamo alone (the worker
busy) sends the same request elsewhere with nothing cached — the hint is what moved it; and an
instance Dynamo does not know is refused (Dynamo still decides which instances are eligible).

And the reason the evidence is a hint and not Dynamo's own overlap input: a KV indexer served from
Python for the router's ``--use-remote-indexer`` (tools/dynamo_cpu/python_remote_indexer.py) gets
the router's queries, in Dynamo's local block hashes, but its answers are refused by 1.6.1. That
test fails the day a Dynamo release accepts them.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from connector.block_keys import dynamo_block_hashes
from connector.placement.advice import EngineLoad, PlacementAdvisor
from connector.placement.dynamo_hint import dynamo_hint, frontend_engine_load, nvext_hint
from tools.harness.consume_process import free_port, wait_for
from tools.harness.dynamo_fleet import BLOCK_SIZE, MODEL_NAME, DynamoFleet, _Process, fleet_with_ledger, seeded_prompts

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
SYNC_TIMEOUT_S = 30.0
BUSY_OUTPUT_TOKENS = 300


@dataclass
class HintFleet:
    fleet: DynamoFleet
    advisor: PlacementAdvisor
    root: Path

    @property
    def instance_of(self) -> dict[str, int]:
        return {w.engine_id: w.instance_id for w in self.fleet.workers}  # type: ignore[misc]

    def engine_of(self, response: dict) -> str:
        worker = response["nvext"]["worker_id"]["decode_worker_id"]
        by_instance = {w.instance_id: w.engine_id for w in self.fleet.workers}
        assert worker in by_instance, f"Dynamo routed to {worker}, not one of {by_instance}"
        return by_instance[worker]

    def live_blocks(self, tokens: list[int], engine_id: str) -> int | None:
        """The ledger's live overlap of ``tokens`` on ``engine_id`` (None: not known yet)."""
        return next((a.live_blocks for a in self.advisor.advise(tokens).engines if a.engine_id == engine_id), None)


@pytest.fixture(scope="module")
def hint_fleet(dynamo_env, tmp_path_factory) -> Iterator[HintFleet]:
    python, model = dynamo_env
    root = tmp_path_factory.mktemp("dynamo-hint")
    fleet = DynamoFleet(root, python, model, num_workers=2)
    with fleet_with_ledger(fleet, root) as advisor:
        yield HintFleet(fleet, advisor, root)
    assert not fleet.stray_processes(), f"still running after the fleet closed: {fleet.stray_processes()}"


def prompt_tokens(fleet: DynamoFleet, seed: int) -> list[int]:
    """A seeded prompt's token ids, at least 4 full blocks and not a whole number of blocks (an engine
    recomputes at least one token, so a prompt of whole blocks would not be served all cached)."""
    tokens = fleet.tokenize(list(seeded_prompts(seed, 1, min_chars=1200)))[0]
    assert len(tokens) >= 4 * BLOCK_SIZE + 1, len(tokens)
    return tokens if len(tokens) % BLOCK_SIZE else tokens[:-1]


def test_the_hinted_worker_serves_what_the_ledger_said_it_holds(hint_fleet: HintFleet) -> None:
    """The prompt's blocks are on dynamo-1, which is busy decoding long requests: Dynamo alone sends
    the prompt to idle dynamo-0 (nothing cached); with the ledger's hint it goes to dynamo-1, which
    serves as cached exactly the ledger's overlap. So the hint is what moved the request. The
    frontend's per-worker load gauges show dynamo-1 busy, and the by-cost hint (Dynamo's trade-off on
    the ledger's overlap) names idle dynamo-0, as Dynamo itself does."""
    fleet, instance_of = hint_fleet.fleet, hint_fleet.instance_of
    tokens = prompt_tokens(fleet, 2201)
    full = len(tokens) // BLOCK_SIZE
    # Setup: dynamo-0 has served something else (the ledger learns of an engine from its first
    # message, and the hint names nobody while a worker is unheard of); the prompt's blocks on
    # dynamo-1 only (a targeted request, then the ledger catches up).
    elsewhere = prompt_tokens(fleet, 2204)
    fleet.complete(elsewhere, max_tokens=1, nvext={"backend_instance_id": instance_of["dynamo-0"]})
    wait_for(lambda: hint_fleet.live_blocks(elsewhere, "dynamo-0"), SYNC_TIMEOUT_S, "the ledger to hear of dynamo-0")
    placed = fleet.complete(tokens, max_tokens=1, nvext={"backend_instance_id": instance_of["dynamo-1"]})
    assert hint_fleet.engine_of(placed) == "dynamo-1"
    wait_for(lambda: hint_fleet.live_blocks(tokens, "dynamo-1") == full, SYNC_TIMEOUT_S,
             "the ledger to hold the prompt's blocks on dynamo-1")

    advice = hint_fleet.advisor.advise(tokens)
    hint = dynamo_hint(advice, instance_of)
    assert hint is not None and (hint.engine_id, hint.instance_id, hint.blocks) == (
        "dynamo-1", instance_of["dynamo-1"], full), (hint, advice.engines)

    # dynamo-1 busy: three long requests decoding there (each ~1,000 prompt tokens, 300 output
    # tokens: ~6 s each on the mocker), so Dynamo's own cost prefers idle dynamo-0.
    others = fleet.tokenize(list(seeded_prompts(2203, 3, min_chars=3000)))
    busy_blocks = sum(len(other) // BLOCK_SIZE for other in others)  # ~ what the router counts for them
    busy = [threading.Thread(target=fleet.complete, args=(other,),
                             kwargs={"max_tokens": BUSY_OUTPUT_TOKENS,
                                     "nvext": {"backend_instance_id": instance_of["dynamo-1"]}})
            for other in others]
    engine_of = {i: e for e, i in instance_of.items()}

    def all_busy() -> dict[str, EngineLoad] | None:
        load = frontend_engine_load(fleet.metrics_text(), engine_of)
        return load if load.get("dynamo-1", EngineLoad()).active_blocks >= 0.9 * busy_blocks else None

    for thread in busy:
        thread.start()
    try:
        loads = wait_for(all_busy, 30, f"Dynamo's frontend to report dynamo-1 busy (~{busy_blocks} blocks)", 0.05)
        assert loads.get("dynamo-0", EngineLoad()).active_blocks == 0, loads  # the gauges are per worker
        loaded = hint_fleet.advisor.advise(tokens, engine_load={e: loads.get(e, EngineLoad()) for e in instance_of})
        by_cost = dynamo_hint(loaded, instance_of, by_cost=True)
        # Dynamo's trade-off on the ledger's overlap: the idle worker, as Dynamo alone chooses below
        assert by_cost is not None and by_cost.engine_id == "dynamo-0", (by_cost, loads, busy_blocks)
        answered = fleet.complete(tokens, max_tokens=1, nvext=nvext_hint(hint))
        alone = fleet.complete(tokens, max_tokens=1)
    finally:
        for thread in busy:
            thread.join(120)
    assert hint_fleet.engine_of(answered) == "dynamo-1"
    cached = answered["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == hint.blocks * BLOCK_SIZE, f"Dynamo reported {cached} cached tokens, the ledger {hint.blocks} blocks"
    assert hint_fleet.engine_of(alone) == "dynamo-0", (
        "the control failed: Dynamo alone also chose busy dynamo-1, so this run does not show the hint moved anything")
    assert alone["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    # Dynamo keeps deciding what is eligible: an instance it does not know is refused.
    gone = max(instance_of.values()) + 1
    with pytest.raises(httpx.HTTPStatusError) as refused:
        fleet.complete(tokens, max_tokens=1, nvext={"backend_instance_id": gone})
    assert refused.value.response.status_code == 400


def test_a_python_served_remote_indexer_is_refused(hint_fleet: HintFleet) -> None:
    """Dynamo 1.6.1's router with ``--use-remote-indexer`` asks ``dynamo.backend.kv_indexer_query``
    for overlap scores; served from Python (the only way semkv-ledger could serve it without Rust),
    the query arrives in Dynamo's local block hashes, but the answer is refused (the binding's
    ``Annotated`` envelope) and the request fails with 500. When a release accepts it, this fails:
    then the ledger's evidence can become Dynamo's overlap input instead of a hint."""
    fleet, root = hint_fleet.fleet, hint_fleet.root
    target = fleet.workers[0]
    log = root / "remote-indexer-queries.jsonl"
    indexer = _Process([fleet.python, str(REPO / "tools" / "dynamo_cpu" / "python_remote_indexer.py"),
                        "--worker-id", str(target.instance_id), "--log", str(log)], fleet.env,
                       root / "remote-indexer.log")
    port = free_port()
    frontend = None
    try:
        wait_for(lambda: indexer.check_alive() or "serving" in indexer.log_path.read_text(), 60,
                 "the Python indexer to serve")
        frontend = _Process([fleet.python, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(port),
                             "--router-mode", "kv", "--discovery-backend", "file", "--kv-cache-block-size",
                             str(BLOCK_SIZE), "--use-remote-indexer"], fleet.env, root / "frontend-remote-indexer.log")
        tokens = prompt_tokens(fleet, 2202)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60.0) as http:
            def serves() -> bool:
                frontend.check_alive()
                try:
                    return any(m.get("id") == MODEL_NAME for m in http.get("/v1/models").json().get("data", []))
                except (httpx.HTTPError, ValueError):
                    return False

            wait_for(serves, 120, "the remote-indexer frontend to serve the model")
            response = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": tokens, "max_tokens": 1,
                                                          "nvext": {"extra_fields": ["worker_id"]}})
        queries = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        assert queries, f"the router never asked the Python indexer:\n{frontend.tail()}"
        query = queries[-1]
        assert query["model_name"] == MODEL_NAME and len(query["block_hashes"]) == len(tokens) // BLOCK_SIZE
        # Dynamo's local block hash of the first block is also its chained hash (connector/block_keys.py)
        assert query["block_hashes"][0] == dynamo_block_hashes(tokens, BLOCK_SIZE)[0]
        time.sleep(0.5)  # the frontend's warning line is written after the response
        assert response.status_code == 500, (f"Dynamo accepted the Python indexer's answer ({response.status_code}): "
                                             "its scores can now be semkv-ledger's evidence; revisit dynamo_hint.py")
        assert "unknown variant `data`" in frontend.log_path.read_text()
    finally:
        for process in (frontend, indexer):
            if process is not None:
                process.stop()

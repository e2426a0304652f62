"""Placement advice (Mode 3): the Python API over a harness fleet, and the HTTP service over a real
socket on 127.0.0.1 (FastAPI + uvicorn), including 4xx on malformed requests and the CLI command."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from connector.discovery.service import DiscoveryService
from connector.harness import LlmRequest
from connector.block_keys import block_hash_chain
from connector.placement.advice import PlacementAdvisor
from connector.placement.http import create_app
from tools.harness.builders import batch, stored
from tools.harness.fleet import Fleet
from tests.connector.conftest import fleet  # noqa: F401  (fixture)
from tests.discovery.conftest import MODEL_ID, NS, TPB, append, seed_donor, settings
from tools.workloads import Workload

REPO = Path(__file__).resolve().parents[2]


def test_advice_ranks_engines_by_fresh_live_overlap(fleet: Fleet, workload: Workload) -> None:  # noqa: F811
    lab = next(lab for lab in workload.labels if lab.scenario == "system_prompt")
    unrelated = next(lab for lab in workload.labels if lab.scenario == "unrelated")
    a, b = fleet.engine("A"), fleet.engine("B")
    a.generate(list(workload.prompt(lab.donor).tokens))
    b.generate(list(workload.prompt(unrelated.target).tokens))
    fleet.sync()
    target = list(workload.prompt(lab.target).tokens)
    namespace = a.scheduler.namespace.for_request(LlmRequest(0, target, 1)).digest
    advisor = PlacementAdvisor(fleet.db)
    try:
        advice = advisor.advise(target, namespace=namespace)
        first, second = advice.engines
        expected = lab.exact_prefix_tokens // TPB
        assert (first.engine_id, first.live_blocks, first.donor_blocks) == ("A", expected, expected)
        assert (second.engine_id, second.live_blocks, second.donor_blocks) == ("B", 0, 0)
        ledger = fleet.ledger()
        assert first.generation == ledger.engine("A").generation and first.fresh
        assert advice.ledger_seq > 0 and advice.num_tokens == len(target)
        assert advisor.advise(target, cache_salt="another-tenant").engines[0].live_blocks == 0  # salted hashes
        fleet.restart("A")  # A's new process: generation bumped, its blocks and donors are stale
        fleet.sync()
        after = {e.engine_id: e for e in advisor.advise(target, namespace=namespace).engines}
        assert after["A"].generation == ledger.engine("A").generation == first.generation + 1
        assert (after["A"].live_blocks, after["A"].donor_blocks) == (0, 0)
        ledger.close()
    finally:
        advisor.close()


@pytest.fixture
def server(sqlite_db: str, workload: Workload) -> Iterator[tuple[str, DiscoveryService, list[int]]]:
    """The app on a real loopback socket; engine A holds the system-prompt donor's blocks."""
    lab = next(lab for lab in workload.labels if lab.scenario == "agent_tools")
    donor = list(workload.prompt(lab.donor).tokens)
    hashes = block_hash_chain(donor, TPB)
    append(sqlite_db, batch(0, stored(*hashes, num_tokens=TPB), engine_id="A"))
    seed_donor(sqlite_db, "tools-donor", donor)
    discovery = DiscoveryService(settings(providers=("chunks",)), db=sqlite_db)
    advisor = PlacementAdvisor(sqlite_db, discovery=discovery, semantic_timeout_s=1.0)
    app = create_app(advisor, discovery=discovery, max_body_bytes=2**20)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # asyncio sets TCP_NODELAY
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", lifespan="off")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", discovery, donor
    finally:
        srv.should_exit = True
        thread.join(10)
        sock.close()
        advisor.close()
        discovery.close()


def test_http_placement_over_a_real_socket(server, workload: Workload) -> None:
    url, discovery, donor = server
    lab = next(lab for lab in workload.labels if lab.scenario == "agent_tools")
    target = list(workload.prompt(lab.target).tokens)
    with httpx.Client(base_url=url, timeout=10) as client:
        exact = client.post("/v1/placement", json={"token_ids": donor[:200] + [1, 2]})
        assert exact.status_code == 200
        top = exact.json()["engines"][0]
        assert (top["engine_id"], top["live_blocks"], top["fresh"], top["generation"]) == ("A", 200 // TPB, True, 1)
        assert client.post("/v1/donors", json={
            "donor_id": "tools-donor", "engine_id": "A", "namespace": NS, "model_id": MODEL_ID,
            "token_ids": donor, "tokens_per_block": TPB}).status_code == 202
        assert discovery.flush()
        body = client.post("/v1/placement", json={"token_ids": target, "namespace": NS, "model_id": MODEL_ID}).json()
        semantic = body["semantic"]
        assert semantic and semantic[0]["donor_id"] == "tools-donor" and semantic[0]["generation"] == 1
        assert semantic[0]["match_type"] == "semantic_candidate" and semantic[0]["provider"] == "chunks"
        assert body["engines"][0]["engine_id"] == "A" and body["engines"][0]["semantic_tokens"] > 0
        health = client.get("/healthz").json()
        assert health["status"] == "ok" and health["providers"] == ["chunks"] and health["ledger_seq"] > 0
        schema = client.get("/openapi.json").json()
        assert {"/v1/placement", "/v1/donors", "/healthz"} <= set(schema["paths"])
        assert "semkv_placement_requests_total" in client.get("/metrics").text


@pytest.mark.parametrize("body", [
    b"{not json", b"[]", json.dumps({"token_ids": [-1, 2]}).encode(), json.dumps({"token_ids": []}).encode(),
    json.dumps({"tokens": [1, 2]}).encode(), json.dumps({"token_ids": [1], "namespace": "xyz"}).encode(),
    json.dumps({"token_ids": [1], "surprise": True}).encode(), json.dumps({"token_ids": ["a"]}).encode(),
    json.dumps({"token_ids": [1], "tokens_per_block": 0}).encode(),
])
def test_http_rejects_malformed_placement_requests_with_4xx(server, body: bytes) -> None:
    url, _, _ = server
    response = httpx.post(f"{url}/v1/placement", content=body, headers={"content-type": "application/json"})
    assert 400 <= response.status_code < 500, response.text


@pytest.mark.parametrize("text", ["\\ud800", "x\\udbff!", "\\ud800\\u0041"])
def test_a_lone_surrogate_escape_is_named_not_called_truncated(server, text: str) -> None:
    """msgspec calls a lone high surrogate escape "Input data was truncated" (newcomer finding 14)."""
    url, _, _ = server
    body = b'{"token_ids": [1, 2], "text": "' + text.encode() + b'"}'
    response = httpx.post(f"{url}/v1/placement", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert "truncated" not in detail and "surrogate" in detail, detail
    truncated = httpx.post(f"{url}/v1/placement", content=b'{"token_ids": [1, 2]',
                           headers={"content-type": "application/json"})
    assert truncated.status_code == 422 and "truncated" in truncated.json()["detail"]
    escaped = httpx.post(f"{url}/v1/placement", content=b'{"token_ids": [1, 2], "text": "\\\\ud800"}',
                         headers={"content-type": "application/json"})
    assert escaped.status_code == 200, escaped.text  # an escaped backslash then "ud800": plain text


@pytest.mark.parametrize("path", ["/v1/placement", "/v1/donors"])
def test_a_chunked_body_past_the_limit_is_refused_without_content_length(server, path: str) -> None:
    # Content-Length is only the honest client's word: a chunked upload has none, and was read whole.
    url, _, _ = server

    def chunks():
        yield b'{"token_ids": [1], "text": "'
        for _ in range(40):
            yield b"x" * 65_536  # 2.5 MiB in all, past the fixture's 1 MiB
        yield b'"}'
    response = httpx.post(f"{url}{path}", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413, response.text
    small = httpx.post(f"{url}/v1/placement", content=iter([b'{"token_ids": ', b"[1, 2]}"]),
                       headers={"content-type": "application/json"})
    assert small.status_code == 200, small.text  # a chunked body within the limit is served


def test_http_rejects_oversized_bodies_and_bad_donors(server) -> None:
    url, _, _ = server
    big = httpx.post(f"{url}/v1/placement", json={"token_ids": [1], "text": "x" * 2**21})
    assert big.status_code == 413
    bad_donor = httpx.post(f"{url}/v1/donors", json={"donor_id": "x", "engine_id": "A", "namespace": "nope",
                                                     "token_ids": [1, 2]})
    assert bad_donor.status_code == 422


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_serve_starts_and_refuses_an_unmigrated_ledger(sqlite_db: str, tmp_path: Path) -> None:
    exe = [sys.executable, "-c", "from ledger.cli import main; main()"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    bad = subprocess.run([*exe, "serve", "--db", f"sqlite:///{tmp_path / 'empty.db'}"], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "error" in bad.stderr
    port = _free_port()
    proc = subprocess.Popen([*exe, "serve", "--db", sqlite_db, "--port", str(port), "--provider", "chunks",
                             "--log-level", "warning"], env=env, cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "serve did not come up"
                time.sleep(0.2)
        assert health.status_code == 200 and health.json()["providers"] == ["chunks"]
        assert httpx.post(f"http://127.0.0.1:{port}/v1/placement", json={"token_ids": [1, 2, 3]}).status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize(("missing", "stack"), [
    ((), {"http": "httptools", "loop": "uvloop"}),  # both in the [discovery] extra: what serve runs on
    (("uvloop",), {"http": "httptools", "loop": "asyncio"}),
    (("httptools", "uvloop"), {"http": "h11", "loop": "asyncio"}),
])
def test_serve_runs_on_httptools_and_uvloop_and_falls_back_without_them(
        sqlite_db: str, tmp_path: Path, missing: tuple[str, ...], stack: dict[str, str]) -> None:
    # a module that cannot be imported is shadowed by one first on PYTHONPATH that fails as a missing package does
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    for name in missing:
        (shadow / f"{name}.py").write_text(f"raise ModuleNotFoundError(\"No module named '{name}'\", name='{name}')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(shadow), str(REPO)))}
    proc = subprocess.Popen([sys.executable, "-c", "from ledger.cli import main; main()", "serve", "--db", sqlite_db,
                             "--port", "0", "--no-discovery"], env=env, cwd=REPO, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    try:
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if '"serve.started"' in line:
                break
        else:
            raise AssertionError(f"serve.started never came: {''.join(seen)[-4000:]}")
        started = json.loads(seen[-1])
        assert {key: started[key] for key in stack} == stack
        answer = httpx.post(f"http://127.0.0.1:{started['port']}/v1/placement", json={"token_ids": [1, 2, 3]},
                            timeout=30)
        assert answer.status_code == 200 and answer.json()["engines"] == []
    finally:
        proc.terminate()
        proc.wait(30)
        proc.stderr.close()

"""A KV indexer served from Python on Dynamo's request plane, for the 1.6.1 router's
``--use-remote-indexer`` (EXPERIMENTAL in Dynamo): the probe behind
``tests/dynamo_cpu/test_dynamo_routing_hint.py::test_a_python_served_remote_indexer_is_refused``.

Run in the Dynamo venv (``$SEMKV_DYNAMO_PYTHON``) with the fleet's ``DYN_*`` environment (file
discovery): ``python python_remote_indexer.py --worker-id ID --log FILE``. It serves
``dynamo.backend.kv_indexer_query`` (namespace and component of the mocker's ``generate`` endpoint:
the router asks the component of the workers it routes to; endpoint name ``KV_INDEXER_QUERY_ENDPOINT``
in ai-dynamo/dynamo lib/kv-router/src/indexer — the 1.6.1 wheel's strings hold ``kv_indexer_query``),
logs every query as one JSON line (``{"model_name", "block_hashes": [Dynamo's local block hashes],
"device_only"}`` as the router sends it) and answers that ``--worker-id`` holds every block, in
the wire form the router expects (``IndexerQueryResponse::TieredScores(WireTieredMatchDetails)``).

Dynamo 1.6.1 refuses the answer: its Python binding wraps each yielded item in an ``Annotated``
envelope (``{"data": ...}``; lib/bindings/python/rust/python_payload.rs ``parse_python_response``),
so the router reads ``unknown variant `data`, expected `TieredScores` or `Error``` and the request
fails with HTTP 500 "Indexer is offline". The probe exists so that the test notices when a Dynamo
release lets Python serve this endpoint: semkv-ledger's evidence could then be Dynamo's overlap input
instead of a targeted-request hint (connector/placement/dynamo_hint.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json

ENDPOINT = "dynamo.backend.kv_indexer_query"


async def serve(worker_id: int, log_path: str, endpoint_path: str) -> None:
    from dynamo.runtime import DistributedRuntime  # the Dynamo venv only

    runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp")
    endpoint = runtime.endpoint(endpoint_path)
    log = open(log_path, "a", buffering=1)  # noqa: SIM115 - lives as long as the server

    async def handler(request, context=None):  # noqa: ANN001, ANN202 - Dynamo's handler signature
        log.write(json.dumps(request) + "\n")
        blocks = len(request.get("block_hashes") or [])
        scores = [[{"worker_id": worker_id, "dp_rank": 0}, blocks]] if blocks else []
        yield {"TieredScores": {"device": {"scores": scores, "frequencies": [1] * blocks}, "lower_tier": []}}

    print(f"serving {endpoint_path}", flush=True)
    await endpoint.serve_endpoint(handler)


def main() -> None:
    parser = argparse.ArgumentParser(description="Serve a Python KV indexer for Dynamo's --use-remote-indexer (a probe).")
    parser.add_argument("--worker-id", type=int, required=True, help="the Dynamo instance id every answer names")
    parser.add_argument("--log", required=True, help="JSONL file of the queries received")
    parser.add_argument("--endpoint", default=ENDPOINT)
    args = parser.parse_args()
    asyncio.run(serve(args.worker_id, args.log, args.endpoint))


if __name__ == "__main__":
    main()

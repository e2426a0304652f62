"""Placement advice (Mode 3): a Python API and the ``semkv-ledger serve`` HTTP service.

    advice   PlacementAdvisor: engines ranked by exact live overlap and fresh donor spans, plus
             semantic candidates, all read from one ledger snapshot (generation per answer)
    http     FastAPI app: POST /v1/placement, POST /v1/donors, GET /healthz, GET /metrics, OpenAPI
    cli      ``semkv-ledger serve --db URL`` (uvicorn)
    route_join  available vs routed vs delivered reuse per request (``semkv-ledger route-report``)
    dynamo_hint  the worker to name in a Dynamo request (``nvext.backend_instance_id``) when the
             advice singles out one engine; otherwise Dynamo's router chooses

Advice only: nothing here promises or loads KV (DESIGN §3 modes).
"""

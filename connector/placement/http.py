"""HTTP face of placement advice (FastAPI; served by uvicorn from ``semkv-ledger serve``).

Endpoints (OpenAPI 3 schema at ``/openapi.json``; ``/docs`` is a page listing them, served from this
process: FastAPI's default Swagger UI and ReDoc pages load their scripts from a public CDN and are
blank on an offline host, so they are off):

* ``POST /v1/placement`` — :class:`PlacementRequest` → :class:`~connector.placement.advice.Advice`: engines ranked by exact
  live overlap (blocks) and fresh donor spans, semantic candidates, each with the generation it was
  read at, and ``ledger_seq`` (the log position the snapshot includes).
* ``POST /v1/donors`` — register a donor's tokens (and text) for the semantic index of this service
  (engines in other processes have their own index; see ``connector/discovery``): ``202`` queued,
  ``503`` queue full, ``501`` when the service runs without discovery providers.
* ``GET /healthz`` — ``200`` with the ledger's last sequence number, ``503`` when the ledger is unreachable.
* ``GET /metrics`` — Prometheus text: ``semkv_placement_*`` and ``semkv_discovery_*``.

Malformed input is rejected before anything runs: invalid JSON, a missing or unknown field, a
negative or out-of-range token id, an empty or oversized token list, neither or both of
``token_ids`` and ``token_ids_le32`` (the same ids packed: base64 of u32 little-endian), a packed
length that is not whole ids or hashes, a namespace that is not 32 hex characters → ``422``; a
body over ``max_body_bytes`` → ``413``. Ledger failures → ``503``.
"""

from __future__ import annotations

import html
import re
import time
from collections.abc import Callable, Coroutine
from typing import Annotated, Any

import msgspec
import numpy as np
from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from connector.discovery.types import DonorRecord, readonly_tokens
from connector.placement.advice import Advice, EngineLoad, PlacementAdvisor
from ledger.errors import LedgerError

__all__ = ["PlacementMetrics", "PlacementRequest", "RequestRoute", "create_app", "docs_page", "request_block_hashes",
           "request_tokens"]

MAX_TOKENS = 262_144
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
Digest = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


_U31 = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]


class EngineLoadIn(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One engine's load as the router knows it."""

    active_blocks: Annotated[int, msgspec.Meta(ge=0, le=2**40, description=(
        "KV blocks held by the engine's running requests (its decode load), in blocks"))] = 0
    prefill_tokens: Annotated[int, msgspec.Meta(ge=0, le=2**40, description=(
        "tokens waiting for or in prefill on the engine, in tokens"))] = 0


class PlacementRequest(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One request to place. ``namespace``: the connector's namespace digest for it (enables donor
    spans and semantic candidates); ``cache_salt``/``lora_task_id`` enter the engine block hashes.

    Decoded and validated by msgspec in one pass (the route's hot path: a 32K-token body is ~0.2 ms
    here, where pydantic's validation of it took ~3 ms; tools/results/placement-2026-12-05.md)."""

    token_ids: Annotated[list[_U31], msgspec.Meta(min_length=1, max_length=MAX_TOKENS)] | None = None
    """The request's token ids (each in [0, 2**31), 1 to ``MAX_TOKENS`` of them); exactly one of
    ``token_ids`` and ``token_ids_le32`` is given."""
    token_ids_le32: Annotated[bytes, msgspec.Meta(min_length=4, max_length=4 * MAX_TOKENS, description=(
        "the token ids packed: base64 (RFC 4648, standard alphabet, padded) of each id as an unsigned "
        "32-bit little-endian integer, in order; each id in [0, 2**31); instead of token_ids (exactly one "
        "of the two), the same answer"))] | None = None
    """``token_ids`` packed (see its description): decoded into a uint32 array without a Python int
    per token (decoding a 32K-token body: ~0.6 ms with the JSON list of Python ints, ~0.09 ms packed;
    tools/results/placement-2026-12-05-1935.md)."""
    text: Annotated[str, msgspec.Meta(max_length=4_000_000)] | None = None
    namespace: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{32}$")] | None = None
    cache_salt: Annotated[str, msgspec.Meta(max_length=400)] | None = None
    lora_task_id: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] | None = None
    model_id: Annotated[str, msgspec.Meta(max_length=400)] = ""
    tokens_per_block: Annotated[int, msgspec.Meta(ge=1, le=4096)] | None = None
    max_semantic: Annotated[int, msgspec.Meta(ge=0, le=64)] = 8
    block_hashes: Annotated[list[int | Annotated[str, msgspec.Meta(pattern=r"^[0-9a-fA-F]{64}$")]],
                            msgspec.Meta(max_length=MAX_TOKENS)] | None = None
    """The request's block hashes as the engines compute them (one per full block, in order: a
    64-bit integer, signed or not, or 64 hex characters), used for every engine instead of
    hashes computed from ``token_ids`` by each engine's scheme (the only way to get an overlap
    for vLLM and TensorRT-LLM v2 engines). An integer outside [-2**63, 2**64) is refused by
    :func:`~connector.placement.advice.canonical_hashes` (msgspec bounds stop at 64 signed bits)."""
    block_hashes_le64: Annotated[bytes, msgspec.Meta(max_length=8 * MAX_TOKENS, description=(
        "block_hashes packed: base64 (RFC 4648, standard alphabet, padded) of each 64-bit block hash as a "
        "little-endian integer (unsigned, or signed two's complement: the same bits), in order; instead of "
        "block_hashes (at most one of the two), the same answer"))] | None = None
    """``block_hashes`` of 64-bit integers packed (see its description)."""
    engine_load: Annotated[dict[Annotated[str, msgspec.Meta(max_length=200)], EngineLoadIn],
                           msgspec.Meta(max_length=4096, description=(
                               "per engine_id, its load as the router knows it; given for every engine, engines "
                               "are ranked by Dynamo's routing cost with the ledger's evidence as the overlap "
                               "(`cost` per engine, `load_aware` true)"))] | None = None
    """Per ``engine_id``, its load as the router knows it; given for every engine, engines are
    ranked by Dynamo's routing cost with our evidence as the overlap (``cost`` per engine,
    ``load_aware`` true)."""


_PLACEMENT_DECODER = msgspec.json.Decoder(PlacementRequest)
_LONE_HIGH_SURROGATE = re.compile(rb"(?<!\\)(?:\\\\)*\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])")
"""A JSON escape of a UTF-16 high surrogate (\\uD800-\\uDBFF) not followed by a low one's
(\\uDC00-\\uDFFF); the even run of backslashes before it keeps an escaped backslash out."""
_LE32 = np.dtype("<u4")
_LE64 = np.dtype("<u8")


def request_tokens(body: PlacementRequest) -> list[int] | np.ndarray:
    """The request's token ids: ``token_ids`` as decoded, or ``token_ids_le32`` as a read-only
    uint32 array (little-endian) over the decoded bytes.

    Raises:
        ValueError: neither or both given, a packed length not a multiple of 4, or a packed id
            outside [0, 2**31) (the bound ``token_ids`` has)."""
    if (body.token_ids is None) == (body.token_ids_le32 is None):
        raise ValueError("give exactly one of token_ids and token_ids_le32")
    if body.token_ids is not None:
        return body.token_ids
    packed = body.token_ids_le32
    if len(packed) % 4:
        raise ValueError(f"token_ids_le32: {len(packed)} bytes is not a whole number of 4-byte token ids")
    tokens = np.frombuffer(packed, dtype=_LE32)
    if int(tokens.max()) >= 2**31:
        raise ValueError("token_ids_le32: every token id must be in [0, 2**31)")
    return tokens


def request_block_hashes(body: PlacementRequest) -> list[int | str] | np.ndarray | None:
    """The caller's block hashes: ``block_hashes`` as decoded, or ``block_hashes_le64`` as a
    read-only uint64 array (little-endian) over the decoded bytes, or None.

    Raises:
        ValueError: both given, or a packed length not a multiple of 8."""
    if body.block_hashes_le64 is None:
        return body.block_hashes
    if body.block_hashes is not None:
        raise ValueError("give at most one of block_hashes and block_hashes_le64")
    if len(body.block_hashes_le64) % 8:
        raise ValueError(f"block_hashes_le64: {len(body.block_hashes_le64)} bytes is not a whole number of "
                         "8-byte hashes")
    return np.frombuffer(body.block_hashes_le64, dtype=_LE64)


_ENCODER = msgspec.json.Encoder()
(_REQUEST_REF, _ADVICE_REF), _SCHEMAS = msgspec.json.schema_components(
    (PlacementRequest, Advice), ref_template="#/components/schemas/{name}")


class DonorIn(BaseModel):
    """A donor for the semantic index (the connector registered it in the ledger already)."""

    model_config = ConfigDict(extra="forbid")
    donor_id: str = Field(min_length=1, max_length=200)
    engine_id: str = Field(min_length=1, max_length=200)
    namespace: Digest
    model_id: str = Field("", max_length=400)
    token_ids: list[TokenId] = Field(min_length=1, max_length=MAX_TOKENS)
    tokens_per_block: int = Field(32, ge=1, le=4096)
    text: str | None = Field(None, max_length=4_000_000)
    generation: int | None = Field(None, ge=0)


class _BodyTooLarge(Exception):
    """Raised from the wrapped ``receive`` once a request's body passed the limit."""


class BodyLimit:
    """Refuses (413) a request whose body is over ``max_body_bytes``: at once when its
    ``Content-Length`` says so (or is not a number), and, for a body without one (``Transfer-Encoding:
    chunked``), as soon as what was received passes the limit — nothing past it is buffered.
    A plain ASGI middleware: Starlette's ``@app.middleware("http")`` (BaseHTTPMiddleware) runs every
    request and response through an extra task and memory stream. Measured against it with
    tools/bench_placement_http.py: within this machine's noise at 2K and 32K tokens
    (tools/results/placement-http-2026-12-05-0859.md)."""

    def __init__(self, app: Any, *, max_body_bytes: int, on_refused: Any) -> None:
        self.app, self.max_body_bytes, self.on_refused = app, max_body_bytes, on_refused

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((value for name, value in scope["headers"] if name == b"content-length"), None)
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            await self._refuse(scope, receive, send)
            return
        received, started, refused = 0, False, False

        async def counted_receive() -> dict[str, Any]:
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    refused = True
                    raise _BodyTooLarge
            return message

        async def guarded_send(message: dict[str, Any]) -> None:
            nonlocal started
            if refused:  # the app's answer to a body cut short (FastAPI: 400 "error parsing the body") is replaced
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except _BodyTooLarge:
            pass
        if refused and not started:  # every endpoint reads its whole body before it answers
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.on_refused()
        await JSONResponse({"detail": f"body over {self.max_body_bytes} bytes"}, status_code=413)(scope, receive, send)



class RequestRoute(APIRoute):
    """A route documented from its arguments like any other, whose endpoint is called with the
    :class:`~starlette.requests.Request` alone and returns the :class:`~starlette.responses.Response`:
    FastAPI's per-request handler (dependency solving, body and response-model handling) is not run
    — nothing in it applies to an endpoint that reads and encodes its own body. ``get_route_handler``
    is FastAPI's extension point for this (fastapi.tiangolo.com/how-to/custom-request-and-route/).
    ~50 µs less per ``POST /v1/placement`` (2K tokens, in process; within noise over HTTP):
    tools/results/placement-http-2026-12-05-1715.md (issue 22)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        return self.endpoint


class PlacementMetrics:
    """The placement service's Prometheus metrics, in ``registry`` (a private one by default), served
    on ``serve``'s ``/metrics`` (docs/modes.md):

    * ``semkv_placement_requests_total{outcome="ok"|"rejected"|"ledger_error"|"too_large"}``;
    * ``semkv_placement_advice_seconds``: server-side time per answer.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.requests = Counter("semkv_placement_requests_total", "Placement requests by outcome", ("outcome",),
                                registry=self.registry)
        self.advice_seconds = Histogram("semkv_placement_advice_seconds", "Placement advice duration (server side)",
                                        buckets=_BUCKETS, registry=self.registry)


def create_app(advisor: PlacementAdvisor, *, discovery: Any = None, registry: CollectorRegistry | None = None,
               max_body_bytes: int = 64 * 2**20) -> FastAPI:
    """The FastAPI application over ``advisor`` (and ``discovery`` for ``/v1/donors``)."""
    app = FastAPI(title="semkv-ledger placement advice", version="1",
                  description="Mode 3: engines ranked by exact live overlap and semantic candidates, "
                              "from fresh ledger state only. Advice, never a promise.",
                  docs_url=None, redoc_url=None)  # both load a CDN's scripts: /docs below is self-contained
    metrics = PlacementMetrics(registry)
    reg, requests, seconds = metrics.registry, metrics.requests, metrics.advice_seconds
    registries = [reg] + ([discovery.metrics.registry] if discovery is not None
                          and discovery.metrics.registry is not reg else [])

    def too_large() -> None:
        requests.labels(outcome="too_large").inc()

    app.add_middleware(BodyLimit, max_body_bytes=max_body_bytes, on_refused=too_large)

    def advise(body: PlacementRequest) -> Advice:
        return advisor.advise(request_tokens(body), text=body.text, namespace=body.namespace,
                              cache_salt=body.cache_salt, lora_task_id=body.lora_task_id,
                              model_id=body.model_id, tokens_per_block=body.tokens_per_block,
                              max_semantic=body.max_semantic, block_hashes=request_block_hashes(body),
                              engine_load=None if body.engine_load is None else
                              {engine_id: EngineLoad(load.active_blocks, load.prefill_tokens)
                               for engine_id, load in body.engine_load.items()})

    async def placement(request: Request) -> Response:
        started = time.perf_counter()
        try:
            body_bytes = await request.body()
            body = _PLACEMENT_DECODER.decode(body_bytes)
            # off the event loop: advice may wait on the ledger or on semantic discovery's deadline
            advice = await run_in_threadpool(advise, body)
        except (msgspec.DecodeError, ValueError) as exc:  # msgspec.ValidationError is a DecodeError
            requests.labels(outcome="rejected").inc()
            raise HTTPException(422, _decode_error_text(exc, body_bytes)) from None
        except LedgerError as exc:  # PersistenceError: the ledger could not be read
            requests.labels(outcome="ledger_error").inc()
            raise HTTPException(503, f"ledger unavailable: {type(exc).__name__}") from None
        seconds.observe(time.perf_counter() - started)
        requests.labels(outcome="ok").inc()
        return Response(_ENCODER.encode(advice), media_type="application/json")

    app.router.add_api_route(
        "/v1/placement", placement, methods=["POST"], summary="Rank engines for a request",
        route_class_override=RequestRoute,
        openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": _REQUEST_REF}}}},
        responses={200: {"description": "Engines ranked, best first",
                         "content": {"application/json": {"schema": _ADVICE_REF}}},
                   422: {"description": "Malformed request"}, 503: {"description": "Ledger unavailable"}})

    @app.post("/v1/donors", status_code=202, summary="Queue a donor for the semantic index")
    def donors(body: DonorIn) -> dict[str, Any]:
        if discovery is None:
            raise HTTPException(501, "this service runs without discovery providers")
        record = DonorRecord(donor_id=body.donor_id, engine_id=body.engine_id, namespace=body.namespace,
                             model_id=body.model_id, token_ids=readonly_tokens(body.token_ids),
                             tokens_per_block=body.tokens_per_block, generation=body.generation, text=body.text)
        if not discovery.register_donor(record):
            raise HTTPException(503, "indexing queue full; retry later")
        return {"queued": True, "donor_id": body.donor_id}

    @app.get("/healthz", summary="Liveness and ledger reachability")
    def healthz() -> Any:
        try:
            seq = advisor.ledger_seq()
        except LedgerError as exc:
            return JSONResponse({"status": "ledger_unavailable", "detail": type(exc).__name__}, status_code=503)
        providers = [p.name for p in discovery.providers] if discovery is not None else []
        return {"status": "ok", "ledger_seq": seq, "providers": providers}

    @app.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics")
    def metrics() -> str:
        return "".join(generate_latest(r).decode() for r in registries)

    @app.get("/docs", response_class=HTMLResponse, include_in_schema=False)
    def docs() -> str:
        return docs_page(app.openapi())

    def openapi() -> dict[str, Any]:  # FastAPI's schema, with the msgspec types' components
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(_SCHEMAS)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def docs_page(schema: dict[str, Any]) -> str:
    """A self-contained HTML page (no script, style sheet or font from elsewhere) listing the
    operations of an OpenAPI ``schema`` with their summaries and response codes, and linking
    the schema itself (``/openapi.json``) for tools."""
    info = schema.get("info", {})
    rows = []
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            codes = ", ".join(sorted(operation.get("responses", {})))
            summary = html.escape(operation.get("summary", ""))
            rows.append(f"<tr><td><code>{html.escape(method.upper())}</code></td><td><code>{html.escape(path)}"
                        f"</code></td><td>{summary}</td><td>{html.escape(codes)}</td></tr>")
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>{html.escape(info.get('title', 'API'))}"
            f"</title></head><body><h1>{html.escape(info.get('title', 'API'))} (version "
            f"{html.escape(str(info.get('version', '')))})</h1><p>{html.escape(info.get('description', ''))}</p>"
            "<table border=\"1\" cellpadding=\"4\"><tr><th>method</th><th>path</th><th>what</th><th>responses</th></tr>"
            f"{''.join(rows)}</table><p>Request and response schemas: <a href=\"openapi.json\">/openapi.json</a> "
            "(OpenAPI 3).</p></body></html>")


def _decode_error_text(exc: Exception, body: bytes) -> str:
    """The 422 detail for a body that did not decode: msgspec's message, except where it misleads.

    msgspec 0.23 reports a lone high surrogate escape followed by anything but an escape (``"\\ud800"``)
    as "Input data was truncated"; the body is whole, so the detail names the escape instead."""
    text = str(exc)
    if text.startswith("Input data was truncated"):
        lone = _LONE_HIGH_SURROGATE.search(body)
        if lone is not None:
            escape = lone.group().lstrip(b"\\").decode()
            return (f"JSON is malformed: a lone UTF-16 surrogate escape \\{escape} at byte {lone.end() - 6} "
                    "(a high surrogate \\uD800-\\uDBFF must be followed by a low one \\uDC00-\\uDFFF)")
    return text

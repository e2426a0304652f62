"""The route join (issue #22, DESIGN §10): per request, what the ledger said was available, where the
router sent it, and what the engine delivered — so that an operator sees available vs routed vs
delivered reuse side by side.

One :class:`RouteRecord` per request, made from the :class:`~connector.placement.advice.Advice`
asked BEFORE the request was sent (:meth:`RouteRecord.from_advice`), the router's choice (its own
worker id, and the ledger's ``engine_id`` of that worker) and the engine's answer (the cached
tokens it reports: for Dynamo, ``usage.prompt_tokens_details.cached_tokens`` of the response).
:class:`RouteJoinLog` appends records to a JSONL file (one JSON object a line, the fields of
:class:`RouteRecord`) and counts them in Prometheus (``semkv_route_requests_total{to_top}``,
``semkv_route_tokens_total{kind}``); :func:`read_records` and :func:`route_totals` are what
``semkv-ledger route-report FILE`` prints.

Token figures (all tokens, ``overlap blocks × tokens_per_block``):

* ``available``: the best live overlap of any fresh engine with a known overlap (the advice's top
  set: every engine with that overlap);
* ``routed``: the ledger's live overlap on the engine the router chose (None when the ledger does
  not know that engine or its overlap);
* ``delivered``: what the engine reported as cached for the request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
from prometheus_client import CollectorRegistry, Counter

if TYPE_CHECKING:
    from connector.placement.advice import Advice

__all__ = ["RouteJoinLog", "RouteMetrics", "RouteRecord", "RouteTotals", "read_records", "route_totals"]


class RouteRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One request's join of advice, route and delivery (tokens; see the module docstring).

    ``same_events``: the caller's statement that the ledger and the router had seen the same
    engine events when the advice was asked (how it knows is the caller's; the Dynamo group's
    definition is in tests/dynamo_cpu/test_dynamo_fleet.py)."""

    request_id: str
    prompt_tokens: int
    ledger_seq: int
    available_tokens: int
    top_engines: list[str]
    routed_engine: str | None
    router_worker: str
    routed_tokens: int | None
    delivered_tokens: int
    same_events: bool = True

    @property
    def to_top(self) -> bool:
        """The router chose an engine of the advice's top set."""
        return self.routed_engine is not None and self.routed_engine in self.top_engines

    @classmethod
    def from_advice(cls, request_id: str, advice: Advice, *, routed_engine: str | None, router_worker: str,
                    delivered_tokens: int, prompt_tokens: int, same_events: bool = True) -> RouteRecord:
        """The record of one request: ``advice`` asked before it was sent, ``routed_engine`` the
        ledger's engine id of the router's choice (None: not an engine the ledger knows),
        ``router_worker`` the router's own id of it, ``delivered_tokens`` the engine's cached tokens."""
        known = {a.engine_id: a.live_tokens for a in advice.engines if a.fresh and a.live_tokens is not None}
        best = max(known.values(), default=0)
        top = sorted(e for e, tokens in known.items() if tokens == best)
        return cls(request_id, prompt_tokens, advice.ledger_seq, best, top, routed_engine, router_worker,
                   known.get(routed_engine) if routed_engine is not None else None, delivered_tokens, same_events)


@dataclasses.dataclass(frozen=True, slots=True)
class RouteTotals:
    """Sums over records (tokens) and counts (requests)."""

    requests: int = 0
    same_events: int = 0
    prompt_tokens: int = 0
    available_tokens: int = 0
    routed_tokens: int = 0
    delivered_tokens: int = 0
    routed_to_top: int = 0
    """Requests the router sent to an engine of the advice's top set."""
    delivered_as_advised: int = 0
    """Requests whose delivered tokens equal the ledger's overlap on the routed engine."""
    routed_unknown: int = 0
    """Requests routed to an engine whose overlap the ledger does not know (not in ``routed_tokens``)."""

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def route_totals(records: Iterable[RouteRecord]) -> RouteTotals:
    """:class:`RouteTotals` of ``records``."""
    counts = {f.name: 0 for f in dataclasses.fields(RouteTotals)}
    for r in records:
        counts["requests"] += 1
        counts["same_events"] += r.same_events
        counts["prompt_tokens"] += r.prompt_tokens
        counts["available_tokens"] += r.available_tokens
        counts["delivered_tokens"] += r.delivered_tokens
        counts["routed_to_top"] += r.to_top
        if r.routed_tokens is None:
            counts["routed_unknown"] += 1
        else:
            counts["routed_tokens"] += r.routed_tokens
            counts["delivered_as_advised"] += r.delivered_tokens == r.routed_tokens
    return RouteTotals(**counts)


def read_records(path: Path) -> list[RouteRecord]:
    """The records of a JSONL file written by :class:`RouteJoinLog` (blank lines skipped).

    Raises:
        OSError: the file cannot be read.
        ValueError: a line that is not a record, naming the file and line number.
    """
    decoder = msgspec.json.Decoder(RouteRecord)
    out = []
    with open(path, "rb") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    out.append(decoder.decode(line))
                except msgspec.DecodeError as exc:
                    raise ValueError(f"{path}:{number}: not a route record: {exc}") from None
    return out


class RouteMetrics:
    """The route join's Prometheus counters, in ``registry`` (a private one by default):

    * ``semkv_route_requests_total{to_top="yes"|"no"}``: requests routed to an engine of the
      advice's top set, or not;
    * ``semkv_route_tokens_total{kind="available"|"routed"|"delivered"}``: the record's tokens
      (``routed`` only where the ledger knew the routed engine's overlap).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.requests = Counter("semkv_route_requests_total", "Requests joined with their route, by whether the "
                                "router chose an engine of the advice's top set", ["to_top"], registry=self.registry)
        self.tokens = Counter("semkv_route_tokens_total", "Tokens of reuse per request: available (best live "
                              "overlap in the ledger), routed (the ledger's overlap on the chosen engine), "
                              "delivered (the engine's cached tokens)", ["kind"], registry=self.registry)


class RouteJoinLog:
    """Appends :class:`RouteRecord` lines to ``path`` (flushed per record) and counts them in
    :class:`RouteMetrics` on ``registry`` (a private one by default).

    Raises:
        OSError: ``path`` cannot be opened for appending.
    """

    def __init__(self, path: Path, *, registry: CollectorRegistry | None = None) -> None:
        self.path = path
        self.metrics = RouteMetrics(registry)
        self.registry = self.metrics.registry
        self._file = open(path, "ab")  # noqa: SIM115 - closed by close()
        self._encoder = msgspec.json.Encoder()

    def record(self, record: RouteRecord) -> None:
        self._file.write(self._encoder.encode(record) + b"\n")
        self._file.flush()
        self.metrics.requests.labels("yes" if record.to_top else "no").inc()
        self.metrics.tokens.labels("available").inc(record.available_tokens)
        if record.routed_tokens is not None:
            self.metrics.tokens.labels("routed").inc(record.routed_tokens)
        self.metrics.tokens.labels("delivered").inc(record.delivered_tokens)

    def close(self) -> None:
        self._file.close()

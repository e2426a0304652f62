"""Dynamo routing with semkv-ledger's evidence (issue 22, DESIGN §10 Mode 3): a targeted-request hint.

NVIDIA Dynamo 1.6.1 lets a request name the worker it must go to: ``nvext.backend_instance_id``
(or the ``x-worker-instance-id`` header) on ``/v1/completions`` and ``/v1/chat/completions``; the
KV router then skips its own selection for that request but still checks that the instance is one
of the model's live workers (an unknown id is answered 400 "Invalid request", seen on the 1.6.1
wheel) and still updates its load and cache state with the routed request (ai-dynamo/dynamo
docs/pages/components/frontend/nvext.md @ 00305114; ``KvRouter.generate(worker_id=...)`` in the
wheel's ``dynamo/_core.pyi``). This module decides, from one :class:`~connector.placement.advice.Advice`,
whether the ledger's evidence is decisive enough to name a worker, and which.

Why a targeted request and not Dynamo's own overlap input: 1.6.1's KV router can ask a remote
indexer for its overlap scores (``--use-remote-indexer``; it calls ``{namespace}.{worker
component}.kv_indexer_query``, e.g. ``dynamo.backend.kv_indexer_query``, with
``{"model_name", "block_hashes": [local block hashes], "device_only"}`` and expects the bare enum
``{"TieredScores": {"device": {"scores": [[{"worker_id", "dp_rank"}, blocks]], "frequencies": [...]},
"lower_tier": []}}``). An endpoint served from Python cannot answer it: the Python binding wraps
every yielded item in Dynamo's ``Annotated`` envelope (``{"data": ...}``; ai-dynamo/dynamo
lib/bindings/python/rust/python_payload.rs ``parse_python_response`` @ 025122bd), and the router
refuses it (``Remote indexer error: Internal: unknown variant `data`, expected `TieredScores` or
`Error``` from the 1.6.1 frontend, then HTTP 500 "Indexer is offline"). Worker taints
(``nvext`` routing constraints, a soft preference) need the workers to publish taints in their
model card, which the mocker and engines do not do by default. So the one outside input 1.6.1
takes without changing Dynamo or its workers is the targeted request, and this hint is kept to
the requests where the evidence is decisive; everything else is left to Dynamo's router.

The rule (:func:`dynamo_hint`): name a worker only when

* the advice is ``informed`` (some engine holds some of the request), not ranked by a load the
  caller supplied (a load-aware ranking is the caller's own routing, not evidence), every
  engine's overlap is known (one of unknown overlap may hold more), and every engine of
  ``instance_of`` is in the advice (the ledger learns of an engine from its first message: one it
  has not heard from is of unknown overlap, and unseen by the rule);
* exactly ONE fresh engine has the best reuse (``max(live_blocks,
  donor_blocks)``), at least ``min_margin_blocks`` more than any other engine's (a tie, or a
  lead smaller than the margin, is left to Dynamo, which weighs load); engines that are not
  fresh (resynchronising) are neither named nor rivals: their blocks are not trusted;
* that engine maps to a Dynamo instance id (``instance_of``: the caller's map from the ledger's
  ``engine_id`` to Dynamo's ``worker_id``, which changes at every worker start).

With ``by_cost=True`` the rule is Dynamo's trade-off instead: the advice must be load-aware
(``PlacementAdvisor.advise(engine_load=...)`` with every engine's load, e.g. from the frontend's
``/metrics``: :func:`frontend_engine_load`), every overlap known, every engine of ``instance_of``
in the advice (else a rival's cost is not seen: an idle worker the ledger has not heard from would
never be chosen), and exactly one engine must have
the lowest routing cost (the advisor's model of Dynamo's cost, with the ledger's reuse as the
overlap: :mod:`connector.placement.advice`, after Dynamo's ``DefaultWorkerSelector``; 1.6.1's policy
has more terms, e.g. ``--router-prefill-load-scale``); that engine is named, ties are left to Dynamo.
This approximates what Dynamo's remote-indexer input would have done (its cost, the ledger's
overlap), computed on the client side from the load Dynamo exports.

Nothing here calls Dynamo: :func:`nvext_hint` is the JSON to merge into a request's ``nvext``.
A caller that gets an error for a hinted request should send it again without the hint (the
worker may have just gone: Dynamo answers 400 for an instance it does not know).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from connector.placement.advice import Advice, EngineLoad

__all__ = ["DynamoHint", "dynamo_hint", "frontend_engine_load", "nvext_hint"]

_DECODE_BLOCKS = "dynamo_frontend_worker_active_decode_blocks"
_PREFILL_TOKENS = "dynamo_frontend_worker_active_prefill_tokens"


@dataclasses.dataclass(frozen=True, slots=True)
class DynamoHint:
    """The worker to name: the ledger's ``engine_id``, Dynamo's ``instance_id`` (its ``worker_id``),
    the engine's reuse and the best other engine's (blocks), and the ledger seq of the advice."""

    engine_id: str
    instance_id: int
    blocks: int
    runner_up_blocks: int
    ledger_seq: int


def dynamo_hint(advice: Advice, instance_of: Mapping[str, int], *, min_margin_blocks: int = 1,
                by_cost: bool = False) -> DynamoHint | None:
    """The worker the ledger's evidence singles out for this request, or None (let Dynamo choose);
    see the module docstring for the rule (``by_cost``: the lowest routing cost of a load-aware
    advice instead of the best reuse).

    ``instance_of``: ``engine_id`` → Dynamo instance id; engines missing from it are never named
    (their reuse still counts as a rival's). ``min_margin_blocks`` >= 1 (ValueError otherwise).
    """
    if min_margin_blocks < 1:
        raise ValueError(f"min_margin_blocks must be >= 1, not {min_margin_blocks!r}")
    if not set(instance_of) <= {a.engine_id for a in advice.engines}:
        return None  # a worker the ledger has not heard from: its overlap (and cost) is not known
    if by_cost:
        return _lowest_cost(advice, instance_of)
    if not advice.informed or advice.load_aware or any(a.overlap != "known" for a in advice.engines):
        return None  # an engine of unknown overlap may hold more than the best one we see
    reuse = sorted(((max(a.live_blocks or 0, a.donor_blocks), a.engine_id) for a in advice.engines
                    if a.fresh and a.overlap == "known"), reverse=True)
    if not reuse or reuse[0][0] == 0:
        return None
    best, engine_id = reuse[0]
    runner_up = reuse[1][0] if len(reuse) > 1 else 0
    if best - runner_up < min_margin_blocks or engine_id not in instance_of:
        return None
    return DynamoHint(engine_id, int(instance_of[engine_id]), best, runner_up, advice.ledger_seq)


def nvext_hint(hint: DynamoHint | None) -> dict[str, Any]:
    """The ``nvext`` fields of ``hint`` for a Dynamo request (``{}`` for None)."""
    return {} if hint is None else {"backend_instance_id": hint.instance_id}


def _lowest_cost(advice: Advice, instance_of: Mapping[str, int]) -> DynamoHint | None:
    if not advice.load_aware or any(a.overlap != "known" for a in advice.engines):
        return None
    ranked = sorted(advice.engines, key=lambda a: a.cost)  # type: ignore[arg-type,return-value]  # load_aware: all set
    best = ranked[0]
    if (len(ranked) > 1 and ranked[1].cost == best.cost) or best.engine_id not in instance_of:
        return None
    reuse = max(best.live_blocks or 0, best.donor_blocks)
    runner_up = max((max(a.live_blocks or 0, a.donor_blocks) for a in ranked[1:]), default=0)
    return DynamoHint(best.engine_id, int(instance_of[best.engine_id]), reuse, runner_up, advice.ledger_seq)


def frontend_engine_load(metrics_text: str, engine_of: Mapping[int, str]) -> dict[str, EngineLoad]:
    """Per ``engine_id``, the load Dynamo's frontend reports on its ``/metrics`` (Prometheus text):
    ``dynamo_frontend_worker_active_decode_blocks`` (→ ``active_blocks``) and
    ``dynamo_frontend_worker_active_prefill_tokens`` (→ ``prefill_tokens``), summed over a worker's
    DP ranks; ``engine_of``: Dynamo instance id → ``engine_id`` (workers not in it are left out).
    Gauges seen on the 1.6.1 frontend with ``--router-mode kv``; a worker with neither is absent
    from the result (so the advice is not load-aware, and :func:`dynamo_hint` ``by_cost`` names nobody).
    Parsed with prometheus_client's text parser.

    Raises:
        ValueError: ``metrics_text`` is not Prometheus text exposition format.
    """
    blocks: dict[str, int] = {}
    tokens: dict[str, int] = {}
    for family in text_string_to_metric_families(metrics_text):
        target = blocks if family.name == _DECODE_BLOCKS else tokens if family.name == _PREFILL_TOKENS else None
        if target is None:
            continue
        for sample in family.samples:
            worker = sample.labels.get("worker_id", "")
            if not worker.isdigit() or int(worker) not in engine_of or not math.isfinite(sample.value):
                continue
            engine_id = engine_of[int(worker)]
            target[engine_id] = target.get(engine_id, 0) + max(0, int(sample.value))
    return {e: EngineLoad(blocks.get(e, 0), tokens.get(e, 0)) for e in set(blocks) | set(tokens)}


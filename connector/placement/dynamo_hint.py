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
  caller supplied (a load-aware ranking is the caller's own routing, not evidence), and every
  engine's overlap is known (one of unknown overlap may hold more);
* exactly ONE fresh engine has the best reuse (``max(live_blocks,
  donor_blocks)``), at least ``min_margin_blocks`` more than any other engine's (a tie, or a
  lead smaller than the margin, is left to Dynamo, which weighs load); engines that are not
  fresh (resynchronising) are neither named nor rivals: their blocks are not trusted;
* that engine maps to a Dynamo instance id (``instance_of``: the caller's map from the ledger's
  ``engine_id`` to Dynamo's ``worker_id``, which changes at every worker start).

Nothing here calls Dynamo: :func:`nvext_hint` is the JSON to merge into a request's ``nvext``.
A caller that gets an error for a hinted request should send it again without the hint (the
worker may have just gone: Dynamo answers 400 for an instance it does not know).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from connector.placement.advice import Advice

__all__ = ["DynamoHint", "dynamo_hint", "nvext_hint"]


@dataclasses.dataclass(frozen=True, slots=True)
class DynamoHint:
    """The worker to name: the ledger's ``engine_id``, Dynamo's ``instance_id`` (its ``worker_id``),
    the engine's reuse and the best other engine's (blocks), and the ledger seq of the advice."""

    engine_id: str
    instance_id: int
    blocks: int
    runner_up_blocks: int
    ledger_seq: int


def dynamo_hint(advice: Advice, instance_of: Mapping[str, int], *, min_margin_blocks: int = 1) -> DynamoHint | None:
    """The worker the ledger's evidence singles out for this request, or None (let Dynamo choose);
    see the module docstring for the rule.

    ``instance_of``: ``engine_id`` → Dynamo instance id; engines missing from it are never named
    (their reuse still counts as a rival's). ``min_margin_blocks`` >= 1 (ValueError otherwise).
    """
    if min_margin_blocks < 1:
        raise ValueError(f"min_margin_blocks must be >= 1, not {min_margin_blocks!r}")
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

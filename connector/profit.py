"""Does a load pay? The profitability gate on the promise path (DESIGN §10: fall back when "the
estimated saved prefill work does not exceed lookup/load overhead"; DESIGN §7: no accepted
materialization slower than cold).

Pure module (no I/O). One :class:`ReuseCostModel` per engine pool, shared by the process's worker,
which teaches it, and scheduler, which asks it (:func:`cost_model_for`, keyed like the pool layout
registry in :mod:`connector.namespace`):

* **prefill cost** — the worker times every forward that computes prompt tokens (from the end of
  ``start_load_kv`` to ``wait_for_save``, less the layer copies it did inside the forward) and
  divides by the tokens the iteration scheduled (``ConnectorMetadata.scheduled_tokens``, from
  TensorRT-LLM's ``RequestData.num_scheduled_tokens``). Kept per context-length bucket (powers of
  two of the longest prompt in the iteration: attention makes a token dearer in a longer
  context), and measured under whatever else the engine runs, so the engine's current load is in
  the figure;
* **load cost** — the worker times its own work on every materialized plan (the first check,
  the store open and each layer's revalidation, read and copy, summed: not the engine's forward
  between ``wait_for_layer_load`` calls on vLLM, nor other plans' work), per memory level the bytes
  came from, and fits ``seconds = fixed + per_token × tokens`` over the last
  :attr:`~connector.settings.ProfitSettings.window` loads (least squares; a single size: per-token
  only).

A candidate pays when ``saved_s ≥ margin × load_s``: the prefill it saves beats the load by the
configured ``margin``. Without enough prefill samples at any context, or
without any load sample at its memory level, the gate cannot judge and lets the candidate through
(the first loads are what teach it). One declined candidate in ``explore_every`` goes through
anyway, so that a load path that got faster is seen again.

Cost on the engine's thread: :meth:`ReuseCostModel.forecast` is a dictionary read and a few float
operations (fits are recomputed when a sample arrives, never at lookup).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
import threading
from collections.abc import Iterable


__all__ = ["Forecast", "ReuseCostModel", "context_bucket", "cost_model_for", "forget_cost_models", "memory_level_of"]

_MIN_BUCKET = 7  # 128 tokens: shorter prompts share one bucket


def context_bucket(context_tokens: int) -> int:
    """The bucket of a context length: ``ceil(log2(tokens))``, at least 7 (≤ 128 tokens)."""
    return max(_MIN_BUCKET, math.ceil(math.log2(max(1, context_tokens))))


@dataclasses.dataclass(frozen=True, slots=True)
class Forecast:
    """What the gate predicted for one candidate (kept in :attr:`ReuseCostModel.declined` when it
    declined, and carried on the plan when it accepted).

    Attributes:
        tokens: tokens the load would provide.
        context_tokens: the prompt's length (tokens), which picks the prefill bucket.
        level: memory level the bytes would come from (``host_file``, ...).
        load_s: predicted load time (seconds); NaN when no load was seen at this level.
        saved_s: predicted prefill time the load saves (seconds); NaN without prefill samples.
        margin: the configured margin it was judged against.
        pays: the verdict (True also when it could not be judged).
        basis: ``measured``, ``no_load_samples``, ``no_prefill_samples`` or ``explore``.
    """

    tokens: int
    context_tokens: int
    level: str
    load_s: float
    saved_s: float
    margin: float
    pays: bool
    basis: str

    @property
    def predicted_saving_s(self) -> float | None:
        """:attr:`saved_s` when it was predicted (None: no prefill samples yet)."""
        return None if math.isnan(self.saved_s) else self.saved_s

    def describe(self) -> str:
        """One line for logs: ``512 tokens from host_file: load 3.1 ms vs prefill 1.2 ms saved (×1.2)``."""
        return (f"{self.tokens} tokens from {self.level}: load {self.load_s * 1e3:.2f} ms vs prefill "
                f"{self.saved_s * 1e3:.2f} ms saved (margin ×{self.margin:g}, {self.basis})")


@dataclasses.dataclass(frozen=True, slots=True)
class _LoadFit:
    fixed_s: float
    per_token_s: float

    def predict(self, tokens: int) -> float:
        return self.fixed_s + self.per_token_s * tokens


class ReuseCostModel:
    """Learned prefill and load costs of one engine pool; thread safe (the worker teaches it on the
    engine's thread, the scheduler reads it there or on a lookup thread).

    Args:
        margin: a load is accepted when ``saved_s ≥ margin × load_s`` (``margin`` ≥ 1; 1.0 accepts
            any load predicted not slower than the prefill it replaces).
        window: samples kept per context bucket and per memory level.
        min_prefill_samples: prefill samples needed (in all buckets together) before judging.
        explore_every: one declined candidate in this many is accepted anyway (0: never).
        declined_kept: how many recent declines :attr:`declined` keeps (bounded diagnostics).
    """

    def __init__(self, *, margin: float = 1.2, window: int = 64, min_prefill_samples: int = 8,
                 explore_every: int = 50, declined_kept: int = 64) -> None:
        self.margin, self.window = margin, window
        self.min_prefill_samples, self.explore_every = min_prefill_samples, explore_every
        self._lock = threading.Lock()
        self._prefill: dict[int, collections.deque[float]] = {}
        self._per_token: dict[int, float] = {}  # bucket -> median seconds per token (refit per sample)
        self._prefill_samples = 0
        self._loads: dict[str, collections.deque[tuple[int, float]]] = {}
        self._load_fits: dict[str, _LoadFit] = {}
        self._declines_since_explore = 0
        self.declined: collections.deque[Forecast] = collections.deque(maxlen=declined_kept)
        """The most recent declined forecasts, newest last (bounded)."""

    # ------------------------------------------------------------------ teaching (the worker)
    def observe_prefill(self, scheduled_tokens: int, context_tokens: int, seconds: float) -> None:
        """One forward that computed prompt tokens: ``seconds`` for ``scheduled_tokens`` tokens
        (every token of the iteration), the longest prompt among them ``context_tokens``."""
        if scheduled_tokens <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        bucket = context_bucket(context_tokens)
        with self._lock:
            samples = self._prefill.setdefault(bucket, collections.deque(maxlen=self.window))
            samples.append(seconds / scheduled_tokens)
            self._per_token[bucket] = statistics.median(samples)
            self._prefill_samples += 1

    def observe_load(self, level: str, tokens: int, seconds: float) -> None:
        """One materialized plan: ``tokens`` tokens from memory level ``level`` in ``seconds``."""
        if tokens <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        with self._lock:
            samples = self._loads.setdefault(level, collections.deque(maxlen=self.window))
            samples.append((tokens, seconds))
            self._load_fits[level] = _fit(samples)

    # ------------------------------------------------------------------ asking (the scheduler)
    def prefill_seconds(self, tokens: int, context_tokens: int) -> float:
        """Predicted prefill time of ``tokens`` tokens in a prompt of ``context_tokens`` (seconds),
        from the nearest bucket measured; NaN before ``min_prefill_samples`` forwards were seen."""
        per_token = self._per_token
        if self._prefill_samples < self.min_prefill_samples or not per_token:
            return math.nan
        bucket = context_bucket(context_tokens)
        rate = per_token.get(bucket)
        if rate is None:
            rate = per_token[min(per_token, key=lambda b: (abs(b - bucket), -b))]
        return rate * tokens

    def load_seconds(self, level: str, tokens: int) -> float:
        """Predicted load time of ``tokens`` tokens from ``level`` (seconds); NaN when none was seen."""
        fit = self._load_fits.get(level)
        return math.nan if fit is None else fit.predict(tokens)

    def forecast(self, tokens: int, context_tokens: int, level: str) -> Forecast:
        """Judge one candidate; a declined one is recorded in :attr:`declined`."""
        saved_s = self.prefill_seconds(tokens, context_tokens)
        load_s = self.load_seconds(level, tokens)
        if math.isnan(saved_s):
            return Forecast(tokens, context_tokens, level, load_s, saved_s, self.margin, True, "no_prefill_samples")
        if math.isnan(load_s):
            return Forecast(tokens, context_tokens, level, load_s, saved_s, self.margin, True, "no_load_samples")
        if saved_s >= self.margin * load_s:
            return Forecast(tokens, context_tokens, level, load_s, saved_s, self.margin, True, "measured")
        with self._lock:
            self._declines_since_explore += 1
            explore = bool(self.explore_every) and self._declines_since_explore >= self.explore_every
            if explore:
                self._declines_since_explore = 0
        forecast = Forecast(tokens, context_tokens, level, load_s, saved_s, self.margin, explore,
                            "explore" if explore else "measured")
        if not explore:
            self.declined.append(forecast)
        return forecast


def _fit(samples: Iterable[tuple[int, float]]) -> _LoadFit:
    """``seconds = fixed + per_token × tokens`` by least squares, both clamped at ≥ 0; one distinct
    size (or a negative slope): the median seconds per token, no fixed part.

    The closed form of the one-variable least squares (what ``np.polyfit(tokens, seconds, 1)``
    solves), in plain Python: it runs on the engine's thread at the end of every load, where
    ``polyfit``'s SVD cost ~0.2 ms for 64 samples and this ~20 µs."""
    pairs = [(float(t), float(s)) for t, s in samples]
    n = len(pairs)
    mean_t = math.fsum(t for t, _ in pairs) / n
    mean_s = math.fsum(s for _, s in pairs) / n
    spread = math.fsum((t - mean_t) ** 2 for t, _ in pairs)
    if spread > 0 and len({t for t, _ in pairs}) >= 2:
        per_token = math.fsum((t - mean_t) * (s - mean_s) for t, s in pairs) / spread
        if per_token > 0:
            return _LoadFit(max(0.0, mean_s - per_token * mean_t), per_token)
    return _LoadFit(0.0, statistics.median(s / t for t, s in pairs))


_models: dict[str, ReuseCostModel] = {}
_models_lock = threading.Lock()


def cost_model_for(pool_key: str, **settings: float | int) -> ReuseCostModel:
    """The process's cost model of the pool ``pool_key`` (:func:`connector.namespace.pool_key`),
    made on first use with ``settings`` (:class:`ReuseCostModel`'s keywords); the scheduler and the
    worker of one engine in one process get the same object. An engine whose worker lives in
    another process (a TensorRT-LLM rank > 0) has a model nobody teaches: its gate never judges."""
    with _models_lock:
        model = _models.get(pool_key)
        if model is None:
            model = _models[pool_key] = ReuseCostModel(**settings)  # type: ignore[arg-type]
        return model


def memory_level_of(store: object, *, binding: bool) -> str:
    """Where a load's bytes will come from, as ``semkv_load_seconds{source}`` and the cost model name
    it: ``local_file`` for a host-local store; for a networked one (``store.local`` False),
    ``host_ram`` under binding promises (TensorRT-LLM: the scheduler stages the entry in this
    process before it promises) and ``redis`` otherwise (the worker fetches at load time;
    :mod:`connector.redis_store`, the one networked store)."""
    if getattr(store, "local", True):
        return "local_file"
    return "host_ram" if binding else "redis"


def forget_cost_models() -> None:
    """Drop every process cost model (tests that build engines under reused pool keys)."""
    with _models_lock:
        _models.clear()

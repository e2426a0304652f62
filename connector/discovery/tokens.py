"""Vectorised token-window hashing and exact span alignment (numpy; pure, no I/O).

* :func:`window_hashes` — a 64-bit hash of every window of ``width`` consecutive tokens, in
  ``O(n * width)`` numpy operations (no Python loop over tokens): ``out[i]`` covers
  ``tokens[i : i + width]``. Position-independent: equal windows hash equally wherever they are.
  Used for block contents (``width = tokens_per_block``), MinHash shingles and alignment anchors.
* :func:`align_segments` — the token-exact spans shared by a target and a donor, found from
  window-hash anchors and then VERIFIED token for token (a hash collision never yields a segment).

Costs on the 2-core reference machine: ~0.2 ms for a 2K-token target, ~3 ms for 32K (width 32).
"""

from __future__ import annotations

import numpy as np

__all__ = ["align_segments", "mix64", "window_hashes"]

_P = np.uint64(0x100000001B3)  # FNV-64 prime: the polynomial's base
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def mix64(values: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser over a ``uint64`` array (spreads polynomial hashes over 64 bits)."""
    with np.errstate(over="ignore"):
        z = values ^ (values >> _S30)
        z = z * _M1
        z = z ^ (z >> _S27)
        z = z * _M2
        return z ^ (z >> _S31)


def window_hashes(tokens: np.ndarray, width: int, stride: int = 1) -> np.ndarray:
    """``uint64[(n - width) // stride + 1]`` hashes of ``tokens[i : i + width]`` for ``i = 0, stride, …``.

    Args:
        tokens: token ids, ``int64[n]``.
        width: window width (tokens, ≥ 1).
        stride: distance between window starts (``tokens_per_block`` hashes whole blocks only).

    Returns:
        an empty array when ``n < width``.
    """
    n = len(tokens) - width + 1
    if n <= 0 or width < 1:
        return np.empty(0, np.uint64)
    t = np.asarray(tokens).astype(np.uint64)
    h = np.zeros(n, np.uint64)
    with np.errstate(over="ignore"):
        for j in range(width):
            h = h * _P + t[j : j + n] + np.uint64(1)
    return mix64(h)[::stride] if stride > 1 else mix64(h)


def align_segments(target: np.ndarray, donor: np.ndarray, *, anchor: int, min_tokens: int,
                   max_segments: int = 256) -> list[tuple[int, int, int]]:
    """Token-exact spans shared by ``target`` and ``donor``: ``(target_start, donor_start, count)``.

    Each target window of ``anchor`` tokens is looked up among the donor's windows (first donor
    occurrence wins); where a run of anchors on one diagonal starts, the span is extended token by
    token to its first mismatch (so hash collisions never yield a span, and repeated phrases inside
    the donor do not cut a long span short). Spans are in target order, never overlap in the
    target, and each is at least ``min_tokens`` long.

    Args:
        target, donor: ``int64`` token arrays.
        anchor: anchor width (tokens); spans shorter than it are not found.
        min_tokens: shortest span returned (tokens).
        max_segments: most spans returned (the longest are kept, then re-sorted by target position).
    """
    th, dh = window_hashes(target, anchor), window_hashes(donor, anchor)
    if not len(th) or not len(dh):
        return []
    order = np.argsort(dh, kind="stable")
    sorted_dh = dh[order]
    idx = np.minimum(np.searchsorted(sorted_dh, th), len(sorted_dh) - 1)
    hit = sorted_dh[idx] == th
    if not hit.any():
        return []
    pos = np.where(hit, order[idx], -2)
    cont = np.zeros(len(th), dtype=bool)
    cont[1:] = hit[1:] & hit[:-1] & (pos[1:] == pos[:-1] + 1)
    starts = np.flatnonzero(hit & ~cont)
    out: list[tuple[int, int, int]] = []
    covered = 0
    for s in starts.tolist():
        t0, d0 = s, int(pos[s])
        if t0 < covered:  # starts inside the previous span: keep only what lies past it
            cut = covered - t0
            t0, d0 = t0 + cut, d0 + cut
        count = _match_length(target, donor, t0, d0)  # verified token for token, extended to its end
        if count < min_tokens:
            continue
        out.append((t0, d0, count))
        covered = t0 + count
    if len(out) > max_segments:
        out = sorted(sorted(out, key=lambda seg: -seg[2])[:max_segments])
    return out


def _match_length(target: np.ndarray, donor: np.ndarray, t0: int, d0: int) -> int:
    """Tokens ``target[t0:]`` and ``donor[d0:]`` share from their start (compared in doubling windows)."""
    limit = min(len(target) - t0, len(donor) - d0)
    done, window = 0, 64
    while done < limit:
        end = min(limit, done + window)
        diff = np.flatnonzero(target[t0 + done : t0 + end] != donor[d0 + done : d0 + end])
        if len(diff):
            return done + int(diff[0])
        done, window = end, window * 2
    return limit

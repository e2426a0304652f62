"""Engine block keys: how each engine names a block in its KV-cache events, computed without the engine.

One production module (Python with numpy, xxhash and blake3; no torch) used by the donor registration
(:mod:`connector.donors`: a donor's engine block hashes when the request does not carry them),
placement advice (:mod:`connector.placement.advice`: which engine holds a request's blocks) and the
reference engine harness (:mod:`connector.harness`, whose KV cache manager hashes with it).

Schemes:

* **TensorRT-LLM ``v1_block_key``** (:func:`v1_block_key`, :func:`block_hash_chain`,
  :func:`request_v1_hashes`): the hash its KV cache manager reports as ``block_hash`` in KV-cache
  events and in ``RequestData.block_hashes``. All arithmetic is unsigned 64-bit (mod 2**64).
  Sources (NVIDIA/TensorRT-LLM): ``cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp``
  (``BlockKeyHasher::hash``): seed = ``num_tokens ^ parent_hash * 0xbf58476d1ce4e5b9``; the cache
  salt id is mixed (``hash64Mix``) only into a root block (``parentHash == 0``); each token id is
  mixed with ``hash32Mix`` (and its extra id with ``hash64Mix`` when the request uses extra ids);
  then the LoRA task id (``hash64Mix``); then multimodal keys (not computed here: text only).
  ``tensorrt_llm/runtime/kv_cache_hash.py`` (``hash_v1_block_key``, ``get_cache_salt_id``) is the
  Python replica TensorRT-LLM tests bit-exact against the C++ hasher; in 1.1/1.2 the salt id is the
  first 8 bytes of BLAKE3(salt UTF-8), little-endian. Newer TensorRT-LLM C++ mixes
  ``std::hash<std::string>(cache_salt)`` instead, which Python cannot reproduce: connectors take
  salted hashes from events or ``RequestData.block_hashes`` when they have them.
* **vLLM** (:func:`vllm_event_block_hash`): a vLLM ``BlockHash`` (bytes) as its KV events publish it.
* **Dynamo** (:func:`dynamo_block_hashes`): the sequence hashes Dynamo's workers publish as
  ``block_hashes`` (and its KV router matches): per full block a local hash xxh3-64, seed 1337, over
  the block's token ids as u32 little-endian; the first block's sequence hash is its local hash,
  every later one xxh3-64, seed 1337, over ``le64(parent sequence hash) || le64(local hash)``.
  Sources (ai-dynamo/dynamo): the mocker's engine-local hashing (``compute_block_hash_for_tokens``,
  ``compute_next_sequence_hash``, ``XXH3_SEED = 1337``: "preserve the mocker's existing XXH3 wire
  values"), ``lib/llm/src/kv_router/indexer.rs`` (``compute_block_hash``, ``XXH3_SEED``; commit
  322fb3afc36e8427a5df6b871a00ecb679404050) and its guide "KV Events & Hashing Consistency"
  (xxh3-64, seed 1337, u32 tokens ``to_le_bytes``; reference vector ``[1, 2, 3, 4]``, block size 4
  -> 14643705804678351452, held in tests/unit/test_dynamo_block_keys.py). Seen equal to Dynamo 1.6.1's ``cached_tokens``
  on 200 of 200 requests (shared/reference/DYNAMO_CPU.md). No LoRA or multimodal salt.
* TensorRT-LLM ``v2_sha256`` hashes are read from events (``consumer/wire.py`` normalizes them,
  :func:`ledger.types.normalize_hash`), not computed here; nor are vLLM's, whose chain starts from
  a per-process random ``NONE_HASH`` unless ``PYTHONHASHSEED`` is set: advice takes the caller's.
"""

from __future__ import annotations

import os
import struct
import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import xxhash
from blake3 import blake3

__all__ = [
    "MASK32",
    "request_v1_hashes",
    "vllm_event_block_hash",
    "vllm_event_block_hashes",
    "MASK64",
    "block_hash_chain",
    "cache_salt_id",
    "chop_into_blocks",
    "DYNAMO_SEED",
    "dynamo_block_hashes",
    "mix32",
    "mix64",
    "v1_block_key",
    "v1_block_keys",
]

MASK32 = (1 << 32) - 1
MASK64 = (1 << 64) - 1
_HASH32_CONST = 0x45D9F3B
_HASH64_CONST_1 = 0xBF58476D1CE4E5B9
_HASH64_CONST_2 = 0x94D049BB133111EB
_COMBINE_CONST = 0x9E3779B9
_PARENT_CONST = 0xBF58476D1CE4E5B9


def mix32(value: int, seed: int) -> int:
    """``hash32Mix``: fold a 32-bit value into a 64-bit seed.

    The value is truncated to 32 bits; ``value + 0x9E3779B9`` wraps at 32 bits (both operands are
    ``uint32_t`` in C++) before the 64-bit ``(seed << 6) + (seed >> 2)`` terms are added.
    """
    return _fold_terms(seed & MASK64, (_scalar_term(value),))


def mix64(value: int, seed: int) -> int:
    """``hash64Mix``: fold a 64-bit value (splitmix64 finaliser) into a 64-bit seed."""
    v = value & MASK64
    v = ((v ^ (v >> 30)) * _HASH64_CONST_1) & MASK64
    v = ((v ^ (v >> 27)) * _HASH64_CONST_2) & MASK64
    v = (v ^ (v >> 31)) & MASK64
    combined = (v + _COMBINE_CONST + ((seed << 6) & MASK64) + (seed >> 2)) & MASK64
    return (seed ^ combined) & MASK64


def cache_salt_id(cache_salt: str) -> int:
    """Salt id of TensorRT-LLM 1.1/1.2: first 8 bytes of BLAKE3(salt UTF-8), little-endian, unsigned."""
    digest = blake3(cache_salt.encode("utf-8")).digest(length=8)
    return int.from_bytes(digest, "little", signed=False)


def _token_terms(token_ids: Sequence[int]) -> list[int]:
    """The token half of ``hash32Mix`` for every token at once: ``(f(id mod 2**32) + 0x9E3779B9) mod
    2**32``, which does not depend on the seed. numpy's uint32 arithmetic wraps as C++'s ``uint32_t``
    does; ids outside int64 (never real token ids) take the scalar path. ~0.2 µs per token cheaper
    than :func:`mix32` per token, which dominated hashing (tools/bench_block_keys.py)."""
    try:
        v = np.asarray(token_ids, dtype=np.int64).astype(np.uint32)  # the low 32 bits, as `& MASK32`
    except (OverflowError, TypeError, ValueError):
        return [_scalar_term(int(t)) for t in token_ids]
    v = ((v >> np.uint32(16)) ^ v) * np.uint32(_HASH32_CONST)
    v = ((v >> np.uint32(16)) ^ v) * np.uint32(_HASH32_CONST)
    return (((v >> np.uint32(16)) ^ v) + np.uint32(_COMBINE_CONST)).tolist()


def _scalar_term(value: int) -> int:
    """:func:`_token_terms` for one id (any Python int)."""
    v = value & MASK32
    v = (((v >> 16) ^ v) * _HASH32_CONST) & MASK32
    v = (((v >> 16) ^ v) * _HASH32_CONST) & MASK32
    return ((((v >> 16) ^ v) & MASK32) + _COMBINE_CONST) & MASK32


def _fold_terms(seed: int, terms: Sequence[int]) -> int:
    """``hash32Mix`` of every token term into ``seed``, in order (the seed-dependent half)."""
    for v in terms:
        seed ^= (v + ((seed << 6) & MASK64) + (seed >> 2)) & MASK64
    return seed


def _block_seed(num_tokens: int, parent_hash: int, cache_salt_id: int | None) -> int:
    """A block's seed before its tokens: ``num_tokens ^ parent_hash * 0xbf58476d1ce4e5b9``, the salt
    id mixed in at the root only."""
    seed = (num_tokens ^ ((parent_hash * _PARENT_CONST) & MASK64)) & MASK64
    if parent_hash == 0 and cache_salt_id is not None:
        seed = mix64(cache_salt_id, seed)
    return seed


def v1_block_key(
    token_ids: Sequence[int],
    parent_hash: int = 0,
    *,
    lora_task_id: int | None = None,
    cache_salt_id: int | None = None,
    token_extra_ids: Sequence[int] | None = None,
) -> int:
    """Hash one block exactly as ``BlockKeyHasher::hash(blockKey, parentHash)``.

    Args:
        token_ids: the block's token ids (``tokens_per_block`` of them, or fewer for a partial
            last block).
        parent_hash: the previous block's hash in the chain; 0 at the root.
        lora_task_id: mixed in after the tokens when not None (``std::optional`` set; 0 counts).
        cache_salt_id: mixed in before the tokens, only when ``parent_hash == 0``.
        token_extra_ids: per-token extra ids, mixed only when given (``usesExtraIds``).

    Returns:
        The unsigned 64-bit block hash (values above 2**63 occur).

    Raises:
        ValueError: ``token_extra_ids`` is given with a length different from ``token_ids``.
    """
    if token_extra_ids is not None and len(token_extra_ids) != len(token_ids):
        raise ValueError("token_extra_ids must have one entry per token id")
    seed = _block_seed(len(token_ids), parent_hash, cache_salt_id)
    if token_extra_ids is None:
        seed = _fold_terms(seed, _token_terms(token_ids))
    else:
        for token_id, extra_id in zip(token_ids, token_extra_ids):
            seed = mix64(int(extra_id), mix32(int(token_id), seed))
    if lora_task_id is not None:
        seed = mix64(lora_task_id, seed)
    return seed


def v1_block_keys(
    token_ids: Sequence[int],
    tokens_per_block: int,
    num_blocks: int,
    *,
    parent_hash: int = 0,
    lora_task_id: int | None = None,
    cache_salt_id: int | None = None,
) -> list[int]:
    """The chained :func:`v1_block_key` hashes of the first ``num_blocks`` full blocks of
    ``token_ids``, the first block's parent ``parent_hash`` (0: the root), the token terms computed
    in one numpy pass.

    Raises:
        ValueError: ``token_ids`` holds fewer than ``num_blocks * tokens_per_block`` ids.
    """
    if len(token_ids) < num_blocks * tokens_per_block:
        raise ValueError(f"{num_blocks} blocks of {tokens_per_block} need more than {len(token_ids)} token ids")
    terms = _token_terms(token_ids[: num_blocks * tokens_per_block])
    parent, hashes = parent_hash, []
    for start in range(0, num_blocks * tokens_per_block, tokens_per_block):
        parent = _fold_terms(_block_seed(tokens_per_block, parent, cache_salt_id),
                             terms[start : start + tokens_per_block])
        if lora_task_id is not None:
            parent = mix64(lora_task_id, parent)
        hashes.append(parent)
    return hashes


def chop_into_blocks(
    token_ids: Sequence[int], usable_size: int, tokens_per_block: int, *, allow_partial: bool
) -> list[list[int]]:
    """``chopVectorIntoBlocks``: split ``token_ids[:usable_size]`` into blocks of ``tokens_per_block``.

    A trailing block shorter than ``tokens_per_block`` is kept only when ``allow_partial``.

    Raises:
        ValueError: ``usable_size`` exceeds ``len(token_ids)`` or ``tokens_per_block`` < 1.
    """
    if usable_size > len(token_ids):
        raise ValueError(f"usable_size={usable_size} > len(token_ids)={len(token_ids)}")
    if tokens_per_block < 1:
        raise ValueError("tokens_per_block must be >= 1")
    blocks: list[list[int]] = []
    for start in range(0, max(usable_size, 0), tokens_per_block):
        block = list(token_ids[start : min(start + tokens_per_block, usable_size)])
        if len(block) == tokens_per_block or allow_partial:
            blocks.append(block)
    return blocks


def block_hash_chain(
    token_ids: Sequence[int],
    tokens_per_block: int,
    *,
    cache_salt: str | None = None,
    lora_task_id: int | None = None,
    allow_partial: bool = False,
) -> list[int]:
    """Chained ``v1_block_key`` hashes of ``token_ids`` split into blocks (root parent 0).

    Only full blocks unless ``allow_partial``. The salt (1.1/1.2 BLAKE3 id) enters the root block and,
    through the chain, every later hash.
    """
    if tokens_per_block < 1:
        raise ValueError("tokens_per_block must be >= 1")
    salt_id = cache_salt_id(cache_salt) if cache_salt is not None else None
    full = len(token_ids) // tokens_per_block
    hashes = v1_block_keys(token_ids, tokens_per_block, full, lora_task_id=lora_task_id, cache_salt_id=salt_id)
    if allow_partial and len(token_ids) % tokens_per_block:
        hashes.append(v1_block_key(token_ids[full * tokens_per_block :], hashes[-1] if hashes else 0,
                                   lora_task_id=lora_task_id, cache_salt_id=salt_id))
    return hashes


def request_v1_hashes(request: Any, tokens_per_block: int, num_blocks: int) -> list[int] | None:
    """TensorRT-LLM 1.2 fallback for a request that carries no ``block_hashes``: the ``v1_block_key``
    chain of its first ``num_blocks`` blocks (its ``lora_task_id`` and 1.1/1.2 ``cache_salt_id``
    mixed in). None for multimodal requests (their multimodal keys are not computed here).

    ``request`` is TensorRT-LLM's ``LlmRequest`` (``get_tokens(0)``, ``lora_task_id``,
    ``cache_salt_id``, ``multimodal_hashes``) or anything shaped like it.
    """
    if getattr(request, "multimodal_hashes", None):
        return None
    return v1_block_keys(request.get_tokens(0), tokens_per_block, num_blocks, lora_task_id=request.lora_task_id,
                         cache_salt_id=getattr(request, "cache_salt_id", None))


def vllm_event_block_hash(block_hash: bytes) -> int | bytes:
    """A vLLM ``BlockHash`` as its KV events publish it: ``int.from_bytes(h, "big") & (2**64 - 1)``,
    or the bytes themselves when ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` (vLLM 0.32,
    ``vllm/v1/core/kv_cache_utils.py: maybe_convert_block_hash``)."""
    return vllm_event_block_hashes((block_hash,))[0]


def vllm_event_block_hashes(block_hashes: Iterable[bytes]) -> list[int | bytes]:
    """:func:`vllm_event_block_hash` of each of ``block_hashes``, with the environment read once:
    ~10 µs for a 4,096-token request's 128 hashes where one call per hash took ~90-170 µs (the
    ``os.environ`` read is most of a call), on the vLLM scheduler's path in every
    ``build_connector_meta`` that reports a new request."""
    if os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") == "0":
        return [bytes(h) for h in block_hashes]
    return [int.from_bytes(h, "big") & MASK64 for h in block_hashes]


DYNAMO_SEED = 1337
_LE_PAIR = struct.Struct("<QQ")
_U32 = next(code for code in "IL" if array(code).itemsize == 4)
"""Dynamo's ``XXH3_SEED`` (ai-dynamo/dynamo ``lib/llm/src/kv_router/indexer.rs``)."""


def dynamo_block_hashes(token_ids: Sequence[int] | np.ndarray, tokens_per_block: int) -> list[int]:
    """Dynamo's sequence hashes of the full blocks of ``token_ids`` (see the module docstring).

    ``token_ids``: a sequence of ints, or a 1-D numpy array of an integer dtype (hashed from its
    buffer, without a Python int per token: a little-endian uint32 array, as ``token_ids_le32`` of
    ``POST /v1/placement`` decodes to, is copied once to bytes, whose slices xxhash reads ~5 %
    faster than a memoryview's; 32K tokens: ~0.31 ms, a list ~0.43 ms, 2026-12-05).

    Returns:
        One unsigned 64-bit hash per full block (a trailing partial block has none).

    Raises:
        ValueError: ``tokens_per_block`` < 1, a token id outside [0, 2**32), or an array that is not
            a 1-D array of integers.
    """
    if tokens_per_block < 1:
        raise ValueError("tokens_per_block must be >= 1")
    full = len(token_ids) - len(token_ids) % tokens_per_block
    if isinstance(token_ids, np.ndarray):
        data = _u32_le_bytes(token_ids[:full])  # slices of bytes hash faster than of a memoryview
    else:
        try:
            tokens = array(_U32, token_ids)  # the whole list (a slice first would copy it), then cut
        except OverflowError:
            raise ValueError("Dynamo hashes token ids as u32: every id must be in [0, 2**32)") from None
        del tokens[full:]
        if sys.byteorder == "big":
            tokens.byteswap()
        data = tokens.tobytes()  # a 128 KB copy at 32K tokens; its slices hash faster than a memoryview's
    step = 4 * tokens_per_block
    digest, pair = xxhash.xxh3_64_intdigest, _LE_PAIR.pack
    hashes: list[int] = []
    append = hashes.append
    parent = None
    for start in range(0, len(data), step):
        local = digest(data[start : start + step], DYNAMO_SEED)
        parent = local if parent is None else digest(pair(parent, local), DYNAMO_SEED)
        append(parent)
    return hashes


def _u32_le_bytes(tokens: np.ndarray) -> bytes:
    """A 1-D integer array's ids as u32 little-endian bytes.

    Raises:
        ValueError: not a 1-D integer array, or an id outside [0, 2**32)."""
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise ValueError(f"token ids must be a 1-D integer array, not {tokens.dtype} of shape {tokens.shape}")
    if tokens.dtype != np.dtype("<u4") and tokens.size and (tokens.min() < 0 or tokens.max() >= 2**32):
        raise ValueError("Dynamo hashes token ids as u32: every id must be in [0, 2**32)")
    return np.ascontiguousarray(tokens, dtype="<u4").tobytes()

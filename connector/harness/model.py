"""REFERENCE ENGINE HARNESS — a small decoder-only transformer that reads and writes a paged KV cache.

Test and demo infrastructure only; never an engine for serving. Llama-style: token embedding, per
layer RMSNorm → grouped-query attention with RoPE → residual → RMSNorm → SwiGLU (or GELU) MLP →
residual, final RMSNorm, untied LM head. fp32, weights drawn from a seeded ``torch.Generator`` so
every process that builds the same :class:`ModelConfig` gets bit-identical weights (two harness
engines in two processes compute the same KV).

Paged attention: the K/V of every token lives in the pool ``[num_blocks, num_layers, 2,
num_kv_heads * head_dim * tokens_per_block]`` (viewed per block as NHD ``[tokens_per_block,
num_kv_heads, head_dim]``); a chunk of queries at positions ``[start, start + T)`` writes its K/V
into the blocks of its block table, then gathers K/V for positions ``[0, start + T)`` through the
block table and attends causally. :meth:`HarnessTransformer.forward_paged_batch` runs one chunk per
request through every layer together, layer by layer, as an engine's batched forward does (the
connector's layer hooks run once per layer for the whole batch); :meth:`HarnessTransformer.forward_paged`
is a batch of one. :meth:`HarnessTransformer.forward_dense` is the single-pass reference the paged
path is tested against.

Tensor parallelism (:class:`TensorParallel`, Megatron-style as TensorRT-LLM's attention and MLP
layers split a model): rank ``r`` of ``size`` holds query heads and KV heads
``[r * n / size, (r + 1) * n / size)`` (contiguous, :meth:`TensorParallel.heads`), the matching
columns of the output projection, and a slice of the MLP; the partial outputs of the output
projection and of the MLP's down projection are summed across ranks with
``torch.distributed.all_reduce`` (gloo on the CPU). Each rank's KV pool holds only its KV heads:
``block_elems = num_kv_heads / size * head_dim * tokens_per_block``. Every rank builds the full
seeded weights and keeps its slices, so a TP engine computes the same bits on every run (the sum
of two partials is deterministic), but not the same bits as a TP = 1 engine.

Bit-identity: the same chunk (same tokens, same ``start``, same length) over the same KV values
produces the same bits whatever block ids hold the KV, so reuse can be checked bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["HarnessTransformer", "LayerHooks", "ModelConfig", "PagedChunk", "TensorParallel"]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the harness model. Defaults: a 2K-token prefill takes well under a second on 2 cores.

    Attributes:
        vocab_size: tokens.
        num_layers: decoder layers.
        num_heads: query heads; must be a multiple of ``num_kv_heads`` (GQA).
        num_kv_heads: KV heads.
        head_dim: per-head width (even, for RoPE).
        intermediate_size: MLP width.
        tokens_per_block: KV block size (tokens); also ``kv_cache_config.tokens_per_block``.
        max_context: longest sequence (tokens) the RoPE tables cover.
        mlp: ``"swiglu"`` or ``"gelu"``.
        seed: weight seed.
    """

    vocab_size: int = 512
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    tokens_per_block: int = 32
    max_context: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads or self.head_dim % 2:
            raise ValueError("num_heads must be a multiple of num_kv_heads and head_dim even")

    @property
    def hidden_size(self) -> int:
        """Residual width = ``num_heads * head_dim``."""
        return self.num_heads * self.head_dim

    @property
    def name(self) -> str:
        """A model id that changes whenever anything that changes the KV bytes changes."""
        return (f"semkv-harness-decoder-v{self.vocab_size}-l{self.num_layers}-h{self.num_heads}"
                f"-kv{self.num_kv_heads}-d{self.head_dim}-i{self.intermediate_size}-{self.mlp}"
                f"-rope{self.rope_theta:g}-s{self.seed}")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token across all layers (fp32)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * 4


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group (``torch.distributed``'s default group).

    Attributes:
        rank: this rank, ``0 <= rank < size``.
        size: ranks in the group (``llm_args.tensor_parallel_size``).
    """

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is not one of {self.size} ranks")

    def heads(self, num_heads: int) -> range:
        """The heads (query or KV) this rank holds: a contiguous ``num_heads / size`` of them.

        Raises:
            ValueError: ``num_heads`` is not a multiple of ``size``.
        """
        if num_heads % self.size:
            raise ValueError(f"{num_heads} heads cannot be split over {self.size} tensor-parallel ranks")
        per_rank = num_heads // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum ``partial`` over the group in place (no-op at size 1); returns it."""
        if self.size > 1:
            torch.distributed.all_reduce(partial)
        return partial


class LayerHooks(Protocol):
    """Callbacks around each decoder layer of a paged forward (the connector's layer hooks)."""

    def before_layer(self, layer_idx: int) -> None:
        """Called before the layer's work: ``wait_for_layer_load``."""

    def before_attention_read(self, layer_idx: int) -> None:
        """Called right before attention gathers the layer's K/V from the pool."""

    def after_layer(self, layer_idx: int) -> None:
        """Called after the layer's work: ``save_kv_layer``."""


class _RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class _DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden, kv_width = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
        self.cfg = cfg
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.tp = TensorParallel()
        self.attn_norm = _RMSNorm(hidden, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, kv_width, bias=False)
        self.v_proj = nn.Linear(hidden, kv_width, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = _RMSNorm(hidden, cfg.rms_norm_eps)
        self.up_proj = nn.Linear(hidden, cfg.intermediate_size, bias=False)
        self.gate_proj = nn.Linear(hidden, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, hidden, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Project ``x [T, hidden]`` to q ``[T, Hq, D]`` and k, v ``[T, Hkv, D]``; RoPE on q and k."""
        cfg, h = self.cfg, self.attn_norm(x)
        q = self.q_proj(h).view(-1, self.num_heads, cfg.head_dim)
        k = self.k_proj(h).view(-1, self.num_kv_heads, cfg.head_dim)
        v = self.v_proj(h).view(-1, self.num_kv_heads, cfg.head_dim)
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, MLP, residual (partial sums reduced across TP ranks)."""
        x = x + self.tp.all_reduce(self.o_proj(attn.reshape(x.shape[0], -1)))
        h = self.mlp_norm(x)
        if self.cfg.mlp == "swiglu":
            act = F.silu(self.gate_proj(h)) * self.up_proj(h)
        else:
            act = F.gelu(self.up_proj(h))
        return x + self.tp.all_reduce(self.down_proj(act))

    def shard(self, tp: TensorParallel) -> None:
        """Keep this rank's slices of the weights (see the module docstring)."""
        d, inter = self.cfg.head_dim, self.cfg.intermediate_size
        if inter % tp.size:
            raise ValueError(f"intermediate_size {inter} cannot be split over {tp.size} tensor-parallel ranks")
        q_heads, kv_heads = tp.heads(self.num_heads), tp.heads(self.num_kv_heads)
        q_cols = slice(q_heads.start * d, q_heads.stop * d)
        kv_rows = slice(kv_heads.start * d, kv_heads.stop * d)
        mlp = slice(tp.rank * inter // tp.size, (tp.rank + 1) * inter // tp.size)
        for proj, rows in ((self.q_proj, q_cols), (self.k_proj, kv_rows), (self.v_proj, kv_rows),
                           (self.up_proj, mlp), (self.gate_proj, mlp)):
            proj.weight = nn.Parameter(proj.weight[rows].clone(), requires_grad=False)
        for proj, cols in ((self.o_proj, q_cols), (self.down_proj, mlp)):
            proj.weight = nn.Parameter(proj.weight[:, cols].clone(), requires_grad=False)
        self.num_heads, self.num_kv_heads, self.tp = len(q_heads), len(kv_heads), tp


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


_SMALL_ATTENTION = 128 * 1024
"""Chunks with at most this many (query, key) pairs use plain matmul/softmax attention."""


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal GQA attention of queries at ``[start, start+T)`` over keys ``[0, S)``; ``[T, Hq, D]``.

    Small chunks (decode steps, short prompts) use plain matmul/softmax; larger ones PyTorch's fused
    CPU kernel with 4-D ``[1, H, T, D]`` inputs (3-D inputs take a far slower path). Queries go in row groups so the boolean mask stays under 64 Mi elements at 32K
    contexts; the path and grouping depend only on ``(T, S)``, so equal chunks give equal bits.
    """
    num_q, num_k = q.shape[0], k.shape[0]
    groups = q.shape[1] // k.shape[1]
    kh = k.transpose(0, 1).repeat_interleave(groups, dim=0).unsqueeze(0)
    vh = v.transpose(0, 1).repeat_interleave(groups, dim=0).unsqueeze(0)
    qh = q.transpose(0, 1).unsqueeze(0)
    key_pos = torch.arange(num_k)
    if num_q * num_k <= _SMALL_ATTENTION:  # plain matmul/softmax: less fixed cost than the fused kernel
        mask = key_pos[None, :] <= torch.arange(start, start + num_q)[:, None]
        scores = (qh[0] @ kh[0].transpose(1, 2)) * (q.shape[-1] ** -0.5)
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        return (probs @ vh[0]).transpose(0, 1)
    rows = max(1, min(num_q, (64 * 1024 * 1024) // max(1, num_k)))
    out = []
    for r0 in range(0, num_q, rows):
        r1 = min(num_q, r0 + rows)
        mask = key_pos[None, :] <= torch.arange(start + r0, start + r1)[:, None]
        out.append(F.scaled_dot_product_attention(qh[:, :, r0:r1], kh, vh, attn_mask=mask))
    return torch.cat(out, dim=2)[0].transpose(0, 1)


@dataclass(frozen=True)
class PagedChunk:
    """One request's chunk in a paged forward.

    Attributes:
        token_ids: the chunk's ``T`` tokens.
        start: position of the first token (tokens already in the cache before it).
        block_table: the sequence's block ids, covering at least ``start + T`` tokens.
    """

    token_ids: list[int] | torch.Tensor
    start: int
    block_table: list[int] | torch.Tensor


@dataclass(frozen=True)
class _ChunkPlan:
    ids: torch.Tensor
    start: int
    end: int
    write_blocks: torch.Tensor
    write_offsets: torch.Tensor
    read_blocks: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


@contextmanager
def _intra_op_threads(num_threads: int | None) -> Iterator[None]:
    previous = torch.get_num_threads()
    if num_threads and num_threads != previous:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != previous:
            torch.set_num_threads(previous)


class HarnessTransformer(nn.Module):
    """The harness model. Build with a :class:`ModelConfig`; weights are seeded and deterministic.

    Args:
        cfg: the model shape.
        num_threads: torch intra-op threads during a forward (restored afterwards); default 1,
            because on small shared CPUs the thread pool's synchronisation costs more than it gains
            at these sizes (a 2K prefill: ~0.35 s on 1 thread vs ~1.7 s on 2 contended threads).
            None keeps the process setting.
        tp: this process's tensor-parallel rank (default: no tensor parallelism); ``torch.distributed``
            must be initialized when ``tp.size > 1``.

    Raises:
        ValueError: heads or MLP width not divisible by ``tp.size``.
    """

    def __init__(self, cfg: ModelConfig, num_threads: int | None = 1, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_threads = num_threads
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(_DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._init_weights()
        self.tp = tp or TensorParallel()
        if self.tp.size > 1:
            for layer in self.layers:
                layer.shard(self.tp)
        self.num_kv_heads = cfg.num_kv_heads // self.tp.size
        """KV heads this rank's pool holds."""
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
        angles = torch.outer(torch.arange(cfg.max_context).float(), inv_freq)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)
        self.requires_grad_(False)
        self.eval()

    def _init_weights(self) -> None:
        gen = torch.Generator().manual_seed(self.cfg.seed)
        for name, param in sorted(self.named_parameters()):
            if name.endswith("norm.weight"):
                continue
            fan_in = param.shape[-1] if "embed" not in name else 1
            with torch.no_grad():
                param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(fan_in))

    def _rope_tables(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        if start + length > self.cfg.max_context:
            raise ValueError(f"position {start + length} exceeds max_context={self.cfg.max_context}")
        return self.rope_cos[start : start + length], self.rope_sin[start : start + length]

    @torch.inference_mode()
    def forward_dense(self, token_ids: list[int] | torch.Tensor) -> torch.Tensor:
        """Single-pass causal forward without any cache; logits ``[T, vocab]`` (the reference)."""
        with _intra_op_threads(self.num_threads):
            return self._forward_dense(torch.as_tensor(token_ids, dtype=torch.long))

    def _forward_dense(self, ids: torch.Tensor) -> torch.Tensor:
        cos, sin = self._rope_tables(0, ids.shape[0])
        x = self.embed(ids)
        for layer in self.layers:
            q, k, v = layer.qkv(x, cos, sin)
            groups = q.shape[1] // k.shape[1]
            attn = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0),
                k.transpose(0, 1).repeat_interleave(groups, 0).unsqueeze(0),
                v.transpose(0, 1).repeat_interleave(groups, 0).unsqueeze(0), is_causal=True,
            )[0].transpose(0, 1)
            x = layer.finish(x, attn)
        return self.lm_head(self.norm(x))

    @torch.inference_mode()
    def forward_paged(
        self,
        token_ids: list[int] | torch.Tensor,
        start: int,
        block_table: list[int] | torch.Tensor,
        kv_cache: torch.Tensor,
        hooks: LayerHooks | None = None,
    ) -> torch.Tensor:
        """Forward one chunk at positions ``[start, start+T)`` through the paged KV cache.

        Args:
            token_ids: the chunk's ``T`` tokens.
            start: position of the first token (tokens already in the cache before it).
            block_table: block ids of the sequence, covering at least ``start + T`` tokens.
            kv_cache: ``[num_blocks, num_layers, 2, num_kv_heads * head_dim * tokens_per_block]``;
                the chunk's K/V are written into it, and K/V of ``[0, start+T)`` are read from it.
            hooks: per-layer callbacks (connector ``wait_for_layer_load``/``save_kv_layer``).

        Returns:
            logits ``[T, vocab]`` (fp32).

        Raises:
            ValueError: the block table is too short or positions exceed ``max_context``.
        """
        return self.forward_paged_batch([PagedChunk(token_ids, start, block_table)], kv_cache, hooks)[0]

    @torch.inference_mode()
    def forward_paged_batch(
        self,
        items: list[PagedChunk],
        kv_cache: torch.Tensor,
        hooks: LayerHooks | None = None,
    ) -> list[torch.Tensor]:
        """One forward over a batch of chunks (one per request) through the paged KV cache.

        Layer-major like an engine's batched forward: per layer, ``hooks.before_layer`` once, every
        item's K/V written, ``hooks.before_attention_read`` once, every item's attention, then
        ``hooks.after_layer`` once. Each item is computed with exactly the operations and shapes
        of a single-item forward, so its logits are bit-identical to :meth:`forward_paged` of the
        same chunk over the same KV (items never share a block they write).

        Args:
            items: the chunks; each item's block table must cover ``start + T`` tokens.
            kv_cache: the pool (see :meth:`forward_paged`).
            hooks: per-layer callbacks for the whole batch.

        Returns:
            logits ``[T_i, vocab]`` per item, in order.

        Raises:
            ValueError: a block table is too short or positions exceed ``max_context``.
        """
        with _intra_op_threads(self.num_threads):
            return self._forward_paged_batch(items, kv_cache, hooks)

    def _forward_paged_batch(self, items, kv_cache, hooks) -> list[torch.Tensor]:
        cfg, tpb = self.cfg, self.cfg.tokens_per_block
        kv_heads = self.num_kv_heads
        pool = kv_cache.view(kv_cache.shape[0], cfg.num_layers, 2, tpb, kv_heads, cfg.head_dim)
        plans = [self._plan_chunk(item) for item in items]
        xs = [self.embed(plan.ids) for plan in plans]
        for layer_idx, layer in enumerate(self.layers):
            if hooks is not None:
                hooks.before_layer(layer_idx)
            queries = []
            for plan, x in zip(plans, xs):
                q, k, v = layer.qkv(x, plan.cos, plan.sin)
                pool[plan.write_blocks, layer_idx, 0, plan.write_offsets] = k
                pool[plan.write_blocks, layer_idx, 1, plan.write_offsets] = v
                queries.append(q)
            if hooks is not None:
                hooks.before_attention_read(layer_idx)
            for i, (plan, q) in enumerate(zip(plans, queries)):
                keys = pool[plan.read_blocks, layer_idx, 0].reshape(-1, kv_heads, cfg.head_dim)[:plan.end]
                values = pool[plan.read_blocks, layer_idx, 1].reshape(-1, kv_heads, cfg.head_dim)[:plan.end]
                xs[i] = layer.finish(xs[i], _attend(q, keys, values, plan.start))
            if hooks is not None:
                hooks.after_layer(layer_idx)
        return [self.lm_head(self.norm(x)) for x in xs]

    def _plan_chunk(self, item: PagedChunk) -> _ChunkPlan:
        tpb = self.cfg.tokens_per_block
        ids = torch.as_tensor(item.token_ids, dtype=torch.long)
        table = torch.as_tensor(item.block_table, dtype=torch.long)
        end = item.start + ids.shape[0]
        if table.shape[0] * tpb < end:
            raise ValueError(f"block table covers {table.shape[0] * tpb} tokens, need {end}")
        positions = torch.arange(item.start, end)
        cos, sin = self._rope_tables(item.start, ids.shape[0])
        return _ChunkPlan(ids, item.start, end, table[positions // tpb], positions % tpb,
                          table[: -(-end // tpb)], cos, sin)

"""The small causal language model of the offline quality evaluator (issue 24, DESIGN §10 Mode 4).

Offline evidence only: nothing here is on a serving path and nothing enables Mode 4.

* **Model**: :class:`connector.harness.model.HarnessTransformer` (Llama-style: RMSNorm, GQA, RoPE,
  SwiGLU), its weights TRAINED here (:func:`train`) instead of the harness's seeded random ones:
  random weights would make every quality number meaningless. The harness's own forwards run under
  ``inference_mode`` on one unbatched sequence, so this module adds a batched training forward
  (:func:`train_logits`) and a forward that mixes given K/V with recomputed rows
  (:func:`blended_forward`); both use the harness layers' own ``qkv`` and ``finish``.
* **Tokenizer**: :class:`WordVocab`, one id per piece of ``tools.discovery_pairs`` (a word or a
  punctuation character, case kept), the ``vocab_size - 1`` most frequent pieces of the training
  text, every other piece ``<unk>`` (id 0). One id per piece keeps the pairs' ``shared_spans``
  (piece offsets) valid as token offsets.
* **Text**: ``PairSet.rest`` of the default pair set (``build_pairs()``: 8 classes × 125, ctx 256,
  seed 0): the stdlib docstrings and tool schemas after the last piece any pair holds, so the model
  never saw the text it is evaluated on. The last ``val_share`` of each stream is held out.
* **Cache**: weights under ``~/.cache/semkv-ledger/quality-lm-<sha256(config, python version)>.pt``
  (``SEMKV_QUALITY_CACHE`` overrides the folder); the stdlib text depends on the Python version.
* **RoPE**: K is stored rotated at the position it was computed at (as in an engine's KV cache).
  :func:`rerotate` moves a key from donor position ``p_d`` to target position ``p_t`` by rotating it
  by ``p_t - p_d`` (RoPE rotations compose: R(p_t) = R(p_t - p_d) R(p_d); Su et al., RoFormer,
  arXiv:2104.09864 §3.4); V carries no position and is copied as is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from connector.harness.model import HarnessTransformer, ModelConfig

__all__ = ["LMConfig", "QualityLM", "WordVocab", "blended_forward", "load_or_train", "rerotate", "train_logits",
           "training_text", "unigram_ppl"]

UNK = "<unk>"


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """Model shape and training recipe (every field is part of the cache key).

    Attributes:
        vocab_size: ids, ``<unk>`` included. num_layers, num_heads, num_kv_heads, head_dim,
        intermediate_size, max_context: the :class:`ModelConfig` shape. seq_len, batch, steps: training
        windows (tokens), windows per step, optimizer steps. lr, weight_decay, warmup: AdamW with
        linear warm-up then cosine decay to 10 %. val_share: held-out tail of each text stream.
        eval_every: steps between held-out evaluations (the best checkpoint is kept). seed: weights,
        window sampling. threads: torch intra-op threads while training.
    """

    vocab_size: int = 4096
    num_layers: int = 4
    num_heads: int = 6
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 512
    max_context: int = 512
    seq_len: int = 256
    batch: int = 16
    steps: int = 500
    lr: float = 2e-3
    weight_decay: float = 0.1
    warmup: int = 60
    val_share: float = 0.05
    eval_every: int = 50
    seed: int = 0
    threads: int = 1

    def model_config(self) -> ModelConfig:
        return ModelConfig(vocab_size=self.vocab_size, num_layers=self.num_layers, num_heads=self.num_heads,
                           num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                           intermediate_size=self.intermediate_size, max_context=self.max_context, seed=self.seed)

    def key(self) -> str:
        fields = dataclasses.asdict(self) | {"python": sys.version.split()[0], "format": 1}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


QUICK_LM = LMConfig(vocab_size=1024, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32, intermediate_size=128,
                    max_context=512, seq_len=128, batch=8, steps=60, lr=3e-3, warmup=10, eval_every=30)
"""A model small enough to train in seconds (smoke tests); its numbers mean little."""


class WordVocab:
    """Pieces → ids: id 0 is ``<unk>``, then the most frequent training pieces (ties by first seen)."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces
        self.index = {p: i for i, p in enumerate(pieces)}

    @classmethod
    def build(cls, text: list[str], size: int) -> WordVocab:
        return cls([UNK] + [p for p, _ in Counter(text).most_common(size - 1)])

    def encode(self, pieces: tuple[str, ...] | list[str]) -> list[int]:
        return [self.index.get(p, 0) for p in pieces]


def training_text(val_share: float) -> tuple[list[str], list[str]]:
    """(train pieces, held-out pieces): prose then tool schemas of ``build_pairs().rest``, each stream's
    last ``val_share`` held out."""
    from tools.discovery_pairs import build_pairs

    rest = build_pairs().rest
    prose, schemas = _drain(rest.take), _drain(rest.tool_schema)
    train, val = [], []
    for stream in (prose, schemas):
        cut = int(len(stream) * (1 - val_share))
        train += stream[:cut]
        val += stream[cut:]
    return train, val


def _drain(take) -> list[str]:
    out: list[str] = []
    try:
        while True:
            out += take(4096)
    except RuntimeError:  # the stdlib is exhausted: what was handed out before stays
        return out


@dataclasses.dataclass
class QualityLM:
    """A trained model, its vocabulary and how it was trained.

    Attributes:
        model: the harness transformer (fp32, eval mode, no grad). vocab: its tokenizer.
        cfg: the recipe. info: training facts (held-out loss per evaluation, seconds, tokens seen,
        model and unigram held-out perplexity, ``<unk>`` share).
    """

    model: HarnessTransformer
    vocab: WordVocab
    cfg: LMConfig
    info: dict


def cache_dir() -> Path:
    return Path(os.environ.get("SEMKV_QUALITY_CACHE", Path.home() / ".cache" / "semkv-ledger"))


def load_or_train(cfg: LMConfig, log=print) -> QualityLM:
    """The cached model of ``cfg``, trained first when absent (minutes for the default config)."""
    path = cache_dir() / f"quality-lm-{cfg.key()}.pt"
    if path.exists():
        blob = torch.load(path, weights_only=False)
        model = HarnessTransformer(cfg.model_config(), num_threads=None)
        model.load_state_dict(blob["state"])
        return QualityLM(model, WordVocab(blob["vocab"]), cfg, blob["info"])
    lm = train(cfg, log)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"state": lm.model.state_dict(), "vocab": lm.vocab.pieces, "info": lm.info}, tmp)
    tmp.replace(path)
    return lm


def train_logits(model: HarnessTransformer, ids: torch.Tensor) -> torch.Tensor:
    """Causal logits ``[B, T, vocab]`` of ``ids [B, T]`` at positions ``0..T-1`` (with autograd)."""
    b, t = ids.shape
    cos, sin = model.rope_cos[:t].repeat(b, 1), model.rope_sin[:t].repeat(b, 1)
    x = model.embed(ids).reshape(b * t, -1)
    for layer in model.layers:
        q, k, v = layer.qkv(x, cos, sin)
        groups = q.shape[1] // k.shape[1]
        q, k, v = (z.view(b, t, z.shape[1], z.shape[2]).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                              is_causal=True)
        x = layer.finish(x, attn.transpose(1, 2).reshape(b * t, q.shape[1], q.shape[3]))
    return model.lm_head(model.norm(x)).view(b, t, -1)


def _windows(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    n = (ids.shape[0] - 1) // seq_len
    return torch.stack([ids[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)])


@torch.no_grad()
def _mean_nll(model: HarnessTransformer, windows: torch.Tensor, batch: int) -> float:
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i: i + batch]
        logits = train_logits(model, w[:, :-1])
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1), reduction="sum").item()
        count += w[:, 1:].numel()
    return total / count


def unigram_ppl(train_ids: np.ndarray, eval_ids: np.ndarray, vocab_size: int) -> float:
    """Perplexity of ``eval_ids`` under the add-one unigram distribution of ``train_ids``."""
    counts = np.bincount(train_ids, minlength=vocab_size) + 1.0
    logp = np.log(counts / counts.sum())
    return float(math.exp(-logp[eval_ids].mean()))


def train(cfg: LMConfig, log=print) -> QualityLM:
    """Train ``cfg`` on :func:`training_text`; keeps the weights of the best held-out evaluation."""
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    previous = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        train_text, val_text = training_text(cfg.val_share)
        vocab = WordVocab.build(train_text, cfg.vocab_size)
        train_ids = torch.tensor(vocab.encode(train_text))
        val_ids = torch.tensor(vocab.encode(val_text))
        val_windows = _windows(val_ids, cfg.seq_len)
        model = HarnessTransformer(cfg.model_config(), num_threads=None)
        model.requires_grad_(True).train()
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup) * (
            0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / cfg.steps)))))
        history, best, best_state, t0 = [], math.inf, None, time.perf_counter()
        for step in range(1, cfg.steps + 1):
            starts = torch.randint(0, train_ids.shape[0] - cfg.seq_len - 1, (cfg.batch,), generator=gen)
            w = torch.stack([train_ids[s: s + cfg.seq_len + 1] for s in starts.tolist()])
            logits = train_logits(model, w[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            if step % cfg.eval_every == 0 or step == cfg.steps:
                model.eval()
                val = _mean_nll(model, val_windows, cfg.batch)
                model.train()
                history.append((step, round(loss.item(), 4), round(val, 4)))
                log(f"step {step}/{cfg.steps} train loss {loss.item():.3f} held-out loss {val:.3f} "
                    f"(ppl {math.exp(val):.1f}) {time.perf_counter() - t0:.0f}s")
                if val < best:
                    best, best_state = val, {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.load_state_dict(best_state)
        model.requires_grad_(False).eval()
        info = {"history": history, "train_seconds": round(time.perf_counter() - t0, 1),
                "train_tokens": int(train_ids.shape[0]), "val_tokens": int(val_windows[:, 1:].numel()),
                "tokens_seen": cfg.steps * cfg.batch * cfg.seq_len, "val_ppl": math.exp(best),
                "unigram_val_ppl": unigram_ppl(train_ids.numpy(), val_windows[:, 1:].reshape(-1).numpy(),
                                               cfg.vocab_size),
                "val_unk_share": float((val_windows[:, 1:] == 0).float().mean()),
                "threads": cfg.threads}
        return QualityLM(model, vocab, cfg, info)
    finally:
        torch.set_num_threads(previous)


def rerotate(k: torch.Tensor, delta: torch.Tensor, model: HarnessTransformer) -> torch.Tensor:
    """Keys ``[N, Hkv, D]`` rotated at positions ``p`` → rotated at ``p + delta`` (``delta [N]``, any sign)."""
    d = model.cfg.head_dim
    inv_freq = 1.0 / (model.cfg.rope_theta ** (torch.arange(0, d, 2).float() / d))
    angles = delta.float()[:, None] * inv_freq[None, :]
    c, s = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = k[..., : d // 2], k[..., d // 2:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


@dataclasses.dataclass
class Blend:
    """What a :func:`blended_forward` computed.

    Attributes:
        rows: positions whose hidden states were computed to the last layer (ascending) ``[R]``.
        logits: their logits ``[R, vocab]``.
        keys, values: per layer ``[T, Hkv, D]``: given K/V where kept, recomputed elsewhere.
        recomputed_kept: kept positions recomputed anyway (the selective-recompute choice).
        layer_rows: sum over layers of rows computed (the prefill work done, in token-layers).
    """

    rows: torch.Tensor
    logits: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    recomputed_kept: torch.Tensor
    layer_rows: int


@torch.inference_mode()
def blended_forward(model: HarnessTransformer, ids: torch.Tensor, keep: torch.Tensor | None = None,
                    given: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None, *,
                    recompute: torch.Tensor | None = None, deviation_fraction: float = 0.0) -> Blend:
    """Prefill ``ids [T]`` at positions ``0..T-1`` taking the K/V of ``keep`` positions from ``given``.

    A kept position is not computed at all (no query, no MLP) in any layer: every other position
    attends to the given K/V there, as an engine does with loaded KV. ``keep=None`` is exact
    recompute (the reference). Selective recompute of kept positions, either:

    * ``recompute [T]`` bool: those kept positions are recomputed in every layer (e.g. the first
      tokens of each reused segment, EPIC's LegoLink: Hu et al., arXiv:2410.15332 §4); or
    * ``deviation_fraction`` f > 0 (CacheBlend's selection: Yao et al., EuroSys 2025, arXiv:2405.16444
      §4.3): layer 0 is computed for every position, layer 1's K/V for every position, and the
      ``ceil(f × kept)`` kept positions whose layer-1 K/V deviate most (squared L2 of K and V
      together) from the given ones are recomputed from layer 1 on; the others fall back to the
      given K/V. Selected once, at layer 1 (CacheBlend narrows the set gradually over layers).

    Args:
        given: per layer, K ``[T, Hkv, D]`` (rotated at positions ``0..T-1``) and V; needed with ``keep``.

    Raises:
        ValueError: ``keep`` without ``given``, or ``T`` beyond ``max_context``.
    """
    t = ids.shape[0]
    if t > model.cfg.max_context:
        raise ValueError(f"{t} tokens exceed max_context={model.cfg.max_context}")
    keep = torch.zeros(t, dtype=torch.bool) if keep is None else keep.clone()
    if keep.any() and given is None:
        raise ValueError("kept positions need given K/V")
    forced = torch.zeros(t, dtype=torch.bool) if recompute is None else recompute & keep
    keep &= ~forced
    by_deviation = deviation_fraction > 0 and bool(keep.any()) and model.cfg.num_layers > 1
    rows = torch.arange(t) if by_deviation else (~keep).nonzero().squeeze(1)
    positions = torch.arange(t)
    cos_all, sin_all = model.rope_cos[:t], model.rope_sin[:t]
    x = model.embed(ids[rows])
    keys, values, layer_rows = [], [], 0
    chosen = forced.clone()
    for li, layer in enumerate(model.layers):
        q, k, v = layer.qkv(x, cos_all[rows], sin_all[rows])
        if by_deviation and li == 1:
            dev = ((k - given[0][1]) ** 2).sum((1, 2)) + ((v - given[1][1]) ** 2).sum((1, 2))
            kept_idx = keep.nonzero().squeeze(1)
            n = math.ceil(deviation_fraction * kept_idx.shape[0])
            top = kept_idx[torch.topk(dev[kept_idx], n).indices] if n else kept_idx[:0]
            chosen[top] = True
            keep[top] = False
            stay = ~keep  # rows is arange(t) here
            rows, x, q, k, v = rows[stay], x[stay], q[stay], k[stay], v[stay]
        if given is not None:
            kl, vl = given[0][li].clone(), given[1][li].clone()
        else:
            kl = torch.empty(t, k.shape[1], k.shape[2])
            vl = torch.empty_like(kl)
        kl[rows], vl[rows] = k, v
        keys.append(kl)
        values.append(vl)
        x = layer.finish(x, _attend(q, kl, vl, rows, positions))
        layer_rows += rows.shape[0]
    return Blend(rows, model.lm_head(model.norm(x)), keys, values, chosen, layer_rows)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
            k_pos: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention of queries at ``q_pos`` over keys at ``k_pos``; ``[R, Hq, D]``."""
    groups = q.shape[1] // k.shape[1]
    kh = k.transpose(0, 1).repeat_interleave(groups, 0)
    vh = v.transpose(0, 1).repeat_interleave(groups, 0)
    scores = (q.transpose(0, 1) @ kh.transpose(1, 2)) * (q.shape[-1] ** -0.5)
    mask = k_pos[None, :] <= q_pos[:, None]
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return (probs @ vh).transpose(0, 1)

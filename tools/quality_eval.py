"""Offline quality of reusing a donor's KV instead of exact recompute, per discovery class (issue 24; DESIGN §10 Mode 4).

Evidence for the day Mode 4 (approximate donor KV) is allowed; it never enables Mode 4 and touches
no serving path. For each pair of :func:`tools.discovery_pairs.build_pairs`, on the small model of
:mod:`tools.quality_lm` (trained here; its held-out perplexity is reported beside a unigram's):

* **Prompt and continuation**: the target's last ``--cont`` tokens are the held-out continuation;
  the rest is the prompt. Its last token is always computed (engines recompute at least one token
  to get logits), so reuse covers at most ``prompt - 1`` tokens.
* **Reuse plan** (which target positions take which donor position's K/V): the pair's
  ``shared_spans`` (by construction) where it has them; else (paraphrase, near-miss ``shuffled`` /
  ``dense_edits``) the token-exact runs of ≥ ``--min-run`` tokens ``difflib.SequenceMatcher``
  finds between the prompt and the donor: what a Mode-4 system aligning the texts would reuse.
  Donor keys are re-rotated to the target position (:func:`tools.quality_lm.rerotate`).
  ``other_salt`` reuses the same model's KV (salt isolates tenants; quality cannot show it);
  ``other_adapter`` computes the donor with a stand-in LoRA adapter (rank 8 on ``q_proj`` and
  ``v_proj``, ``‖ΔW‖_F = 0.1 ‖W‖_F``, seeded from the namespace digest; random, not trained) and
  the target with the base model or a sibling adapter.
* **Variants** (:data:`VARIANTS`): ``exact`` (the reference: full recompute); ``control``: the
  target's OWN exact K/V at the plan's positions (must give Δ = 0 to float tolerance: checks the
  machinery); ``no_rerotate``: donor K/V placed without moving RoPE (what skipping position
  correction costs); ``reuse``: donor K/V, nothing recomputed; ``dev@f``: CacheBlend-style
  selective recompute of the fraction f of reused positions whose layer-1 K/V deviate most
  (Yao et al., arXiv:2405.16444 §4.3; costs layer 0 of every reused position too); ``first@f``:
  the first ``ceil(f × len)`` tokens of each reused segment recomputed (EPIC's LegoLink, Hu et al.,
  arXiv:2410.15332 §4, given the same budget as ``dev@f``).
* **Metrics** per pair and variant vs ``exact``: Δlogprob = mean log p(continuation token) under
  the variant minus under exact (nats/token; PPL ratio = exp(−Δ)), the mean of |Δ| per token (shifts
  both ways do not cancel) and KL(exact ‖ variant) of the next-token distribution over the
  continuation positions (nats); greedy continuations of
  ``--gen`` tokens from the prompt, compared by token F1 (multiset overlap) and ROUGE-L F1 (LCS,
  Lin 2004, β = 1), computed here (``rouge_score`` is not installed; they act on token ids).
  Per class: means with 95 % bootstrap percentile intervals (``scipy.stats.bootstrap``, 2,000
  resamples, seeded).

Usage: ``python tools/quality_eval.py [--per-class 125] [--fractions 0.15,0.3] [--quick] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import difflib
import hashlib
import math
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.discovery_pairs import PAIR_CLASSES, Pair, build_pairs  # noqa: E402
from tools.quality_lm import QUICK_LM, LMConfig, QualityLM, blended_forward, load_or_train, rerotate, \
    unigram_ppl  # noqa: E402

__all__ = ["PairResult", "evaluate_pair", "main", "reuse_plan", "rouge_l", "summarize", "token_f1"]

RESULTS = Path(__file__).parent / "results"
ADAPTER_RANK, ADAPTER_SCALE = 8, 0.1


def token_f1(a: list[int], b: list[int]) -> float:
    """Multiset token overlap F1 of two sequences (SQuAD's F1 without normalisation); 1.0 if both empty."""
    if not a and not b:
        return 1.0
    common = sum((Counter(a) & Counter(b)).values())
    if common == 0:
        return 0.0
    p, r = common / len(a), common / len(b)
    return 2 * p * r / (p + r)


def rouge_l(a: list[int], b: list[int]) -> float:
    """ROUGE-L F1 (β = 1): from the longest common subsequence (Lin, ACL 2004 workshop, §3.1); 1.0 if both empty."""
    if not a and not b:
        return 1.0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    p, r = lcs / len(a), lcs / len(b)
    return 2 * p * r / (p + r)


def reuse_plan(pair: Pair, prompt_len: int, min_run: int) -> tuple[list[tuple[int, int, int]], str]:
    """``[(target_start, donor_start, tokens)]`` inside ``[0, prompt_len - 1)``, and where it came from."""
    if pair.shared_spans:
        spans, source = pair.shared_spans, "constructed"
    else:
        sm = difflib.SequenceMatcher(None, pair.target.pieces[:prompt_len], pair.donor.pieces, autojunk=False)
        spans = [(m.a, m.b, m.size) for m in sm.get_matching_blocks() if m.size >= min_run]
        source = f"aligned (runs >= {min_run})"
    out = []
    for t0, d0, n in spans:
        n = min(n, prompt_len - 1 - t0, len(pair.donor.pieces) - d0)
        if n > 0:
            out.append((t0, d0, n))
    return out, source


@dataclasses.dataclass
class PairResult:
    """One pair: ``reused`` tokens of ``prompt`` tokens; per variant Δlogprob (signed mean, and mean |Δ|
    per token), KL(exact ‖ variant) of the next-token distribution (nats, mean over continuation
    positions), F1, ROUGE-L, recompute share."""

    pair_id: str
    cls: str
    variant: str
    prompt: int
    reused: int
    source: str
    dlogprob: dict[str, float]
    f1: dict[str, float]
    rouge: dict[str, float]
    recompute: dict[str, float]
    exact_logprob: float
    abs_dlogprob: dict[str, float] = dataclasses.field(default_factory=dict)
    kl: dict[str, float] = dataclasses.field(default_factory=dict)


def _adapter(lm: QualityLM, digest: str | None, cache: dict) -> torch.nn.Module:
    """The base model (``digest`` None) or a stand-in LoRA adapter seeded from ``digest`` (see module doc)."""
    if digest is None:
        return lm.model
    if digest not in cache:
        import copy
        gen = torch.Generator().manual_seed(int(digest[:8], 16))
        model = copy.deepcopy(lm.model)
        for layer in model.layers:
            for proj in (layer.q_proj, layer.v_proj):
                w = proj.weight
                delta = torch.randn(w.shape[0], ADAPTER_RANK, generator=gen) @ torch.randn(ADAPTER_RANK, w.shape[1],
                                                                                            generator=gen)
                w += delta * (ADAPTER_SCALE * w.norm() / delta.norm())
        cache.clear()  # at most one adapter kept: pairs use each once
        cache[digest] = model
    return cache[digest]


def _models(lm: QualityLM, pair: Pair, cache: dict):
    if pair.cls != "other_adapter":
        return lm.model, lm.model
    donor = _adapter(lm, pair.donor_namespace, cache)
    target = lm.model if pair.variant == "base_model" else _adapter(lm, pair.target_namespace, cache)
    return donor, target


def _place(plan, source_kv, t: int, model, rotate: bool):
    """Given K/V ``[T]`` per layer with ``source_kv``'s rows of each span moved to its target rows."""
    keys = [torch.zeros(t, *k.shape[1:]) for k in source_kv[0]]
    values = [torch.zeros(t, *v.shape[1:]) for v in source_kv[1]]
    keep = torch.zeros(t, dtype=torch.bool)
    for t0, d0, n in plan:
        delta = torch.full((n,), t0 - d0)
        for li in range(len(keys)):
            k = source_kv[0][li][d0: d0 + n]
            keys[li][t0: t0 + n] = rerotate(k, delta, model) if rotate and t0 != d0 else k
            values[li][t0: t0 + n] = source_kv[1][li][d0: d0 + n]
        keep[t0: t0 + n] = True
    return keep, (keys, values)


def _first_tokens(plan, t: int, fraction: float) -> torch.Tensor:
    out = torch.zeros(t, dtype=torch.bool)
    for t0, _, n in plan:
        out[t0: t0 + math.ceil(fraction * n)] = True
    return out


def _run(model, ids, prompt_len, gen, keep=None, given=None, **kw):
    """(continuation log-probs [C], next-token log-distributions [C, vocab], greedy tokens [gen],
    token-layers computed over the prompt)."""
    blend = blended_forward(model, ids, keep, given, **kw)
    rows = blend.rows.tolist()
    at = {p: i for i, p in enumerate(rows)}
    logp = torch.log_softmax(blend.logits, dim=-1)
    dist = logp[[at[p - 1] for p in range(prompt_len, ids.shape[0])]]
    cont = dist.gather(1, ids[prompt_len:, None])[:, 0].tolist()
    keys = [k[:prompt_len] for k in blend.keys]
    values = [v[:prompt_len] for v in blend.values]
    token = int(blend.logits[at[prompt_len - 1]].argmax())
    out = [token]
    for _ in range(gen - 1):  # greedy decode over the blended prompt KV: the new row is computed, the rest kept
        n = keys[0].shape[0]
        step_ids = torch.cat((ids[:prompt_len], torch.tensor(out)))[: n + 1]
        pad = [torch.cat((k, k[:1])) for k in keys], [torch.cat((v, v[:1])) for v in values]
        keep_all = torch.ones(n + 1, dtype=torch.bool)
        keep_all[n] = False
        step = blended_forward(model, step_ids, keep_all, pad)
        keys, values = step.keys, step.values
        out.append(int(step.logits[-1].argmax()))
    prompt_work = blend.layer_rows - (ids.shape[0] - prompt_len) * model.cfg.num_layers
    return np.array(cont), dist, out, prompt_work


def variant_names(fractions: list[float]) -> list[str]:
    return ["control", "no_rerotate", "reuse"] + [f"{s}@{f:g}" for f in fractions for s in ("dev", "first")]


def evaluate_pair(lm: QualityLM, pair: Pair, *, cont: int, gen: int, min_run: int, fractions: list[float],
                  adapters: dict | None = None) -> PairResult:
    """Every variant of one pair against exact recompute (see the module docstring)."""
    donor_model, target_model = _models(lm, pair, {} if adapters is None else adapters)
    ids = torch.tensor(lm.vocab.encode(pair.target.pieces))
    prompt_len = ids.shape[0] - cont
    plan, source = reuse_plan(pair, prompt_len, min_run)
    layers = target_model.cfg.num_layers
    full_work = prompt_len * layers
    ref_lp, ref_dist, ref_gen, _ = _run(target_model, ids, prompt_len, gen)
    exact = blended_forward(target_model, ids[:prompt_len])
    donor = blended_forward(donor_model, torch.tensor(lm.vocab.encode(pair.donor.pieces)))
    t = prompt_len
    own_keep, own = _place([(a, a, n) for a, _, n in plan], (exact.keys, exact.values), t, target_model, True)
    keep, placed = _place(plan, (donor.keys, donor.values), t, target_model, True)
    _, unrotated = _place(plan, (donor.keys, donor.values), t, target_model, False)
    pad = cont

    def padded(kv):
        return ([torch.cat((k, torch.zeros(pad, *k.shape[1:]))) for k in kv[0]],
                [torch.cat((v, torch.zeros(pad, *v.shape[1:]))) for v in kv[1]])

    keep_full = torch.cat((keep, torch.zeros(pad, dtype=torch.bool)))
    own_full = torch.cat((own_keep, torch.zeros(pad, dtype=torch.bool)))
    runs = {"control": dict(keep=own_full, given=padded(own)),
            "no_rerotate": dict(keep=keep_full, given=padded(unrotated)),
            "reuse": dict(keep=keep_full, given=padded(placed))}
    for f in fractions:
        runs[f"dev@{f:g}"] = dict(keep=keep_full, given=padded(placed), deviation_fraction=f)
        first = torch.cat((_first_tokens(plan, t, f), torch.zeros(pad, dtype=torch.bool)))
        runs[f"first@{f:g}"] = dict(keep=keep_full, given=padded(placed), recompute=first)
    res = PairResult(pair.pair_id, pair.cls, pair.variant, prompt_len, int(keep.sum()), source, {}, {}, {}, {},
                     float(ref_lp.mean()))
    reused_work = max(1, int(keep.sum()) * layers)
    for name, kw in runs.items():
        lp, dist, out, work = _run(target_model, ids, prompt_len, gen, **kw)
        res.dlogprob[name] = float(lp.mean() - ref_lp.mean())
        res.abs_dlogprob[name] = float(np.abs(lp - ref_lp).mean())
        res.kl[name] = float((ref_dist.exp() * (ref_dist - dist)).sum(-1).mean())
        res.f1[name], res.rouge[name] = token_f1(out, ref_gen), rouge_l(out, ref_gen)
        res.recompute[name] = (work - (full_work - reused_work)) / reused_work  # share of reused token-layers recomputed
    return res


def _interval(x: np.ndarray, seed: int) -> tuple[float, float, float]:
    from scipy.stats import bootstrap

    mean = float(x.mean())
    if len(x) < 2 or np.ptp(x) == 0:
        return mean, mean, mean
    ci = bootstrap((x,), np.mean, confidence_level=0.95, n_resamples=2000, method="percentile",
                   rng=np.random.default_rng(seed)).confidence_interval
    return mean, float(ci.low), float(ci.high)


def summarize(results: list[PairResult], variants: list[str], seed: int = 0, by_construction: bool = False) -> list[dict]:
    """One row per (class, variant): n, reused share, recompute share, Δlogprob / PPL ratio / F1 / ROUGE-L
    with 95 % CIs; ``by_construction``: per (class, the pair's construction variant) instead of per class."""
    rows = []
    groups = sorted({(r.cls, r.variant if by_construction else "") for r in results},
                    key=lambda g: (PAIR_CLASSES.index(g[0]), g[1]))
    for cls, construction in groups:
        rs = [r for r in results if r.cls == cls and (not by_construction or r.variant == construction)]
        with_reuse = [r for r in rs if r.reused]
        for v in variants:
            d = _interval(np.array([r.dlogprob[v] for r in rs]), seed)
            rows.append({"cls": cls, "construction": construction, "variant": v, "n": len(rs),
                         "reused": float(np.mean([r.reused / r.prompt for r in rs])),
                         "recompute": float(np.mean([r.recompute[v] for r in with_reuse])) if with_reuse else 0.0,
                         "dlogprob": d, "ppl_ratio": tuple(math.exp(-x) for x in (d[0], d[2], d[1])),
                         "abs_d": _interval(np.array([r.abs_dlogprob[v] for r in rs]), seed),
                         "kl": _interval(np.array([r.kl[v] for r in rs]), seed),
                         "f1": _interval(np.array([r.f1[v] for r in rs]), seed),
                         "rouge": _interval(np.array([r.rouge[v] for r in rs]), seed),
                         "max_abs_d": float(max(abs(r.dlogprob[v]) for r in rs)),
                         "source": ", ".join(sorted({r.source for r in rs}))})
    return rows


def _fmt(m: tuple[float, float, float], digits: int = 3) -> str:
    return f"{m[0]:.{digits}f} [{m[1]:.{digits}f}, {m[2]:.{digits}f}]"


def model_quality(lm: QualityLM, pairs: list[Pair], cont: int) -> dict:
    """Held-out PPL of the model and of a unigram on the training split; both on the pairs' continuations."""
    from tools.quality_lm import training_text

    train_text, _ = training_text(lm.cfg.val_share)
    train_ids = np.array(lm.vocab.encode(train_text))
    lps, conts = [], []
    for p in pairs:
        ids = torch.tensor(lm.vocab.encode(p.target.pieces))
        blend = blended_forward(lm.model, ids)
        lps.extend(torch.log_softmax(blend.logits[-cont - 1:-1], -1).gather(1, ids[-cont:, None])[:, 0].tolist())
        conts.extend(ids[-cont:].tolist())
    conts_arr = np.array(conts)
    return {"pairs_ppl": math.exp(-float(np.mean(lps))),
            "pairs_unigram_ppl": unigram_ppl(train_ids, conts_arr, lm.cfg.vocab_size),
            "pairs_unk_share": float((conts_arr == 0).mean()), "pairs_tokens": len(conts)}


def write_report(path: Path, args, lm: QualityLM, mq: dict, rows: list[dict], results: list[PairResult],
                 times: dict, variants: list[str]) -> None:
    info = lm.info
    lines = [f"# Quality of approximate KV reuse vs exact recompute ({times['date']}, issue 24, DESIGN §10 Mode 4)",
             "",
             "Offline evidence only: Mode 4 stays refused at start-up and nothing here is on a serving path.",
             f"Command: `{' '.join(sys.argv)}`. Started {times['start']} UTC (load average {times['load_start']}), "
             f"ended {times['end']} UTC (load average {times['load_end']}); the machine has 2 cores shared with "
             f"other agents; evaluation on 1 torch thread ({times['eval_s']:.0f} s for {len(results)} pairs). "
             "Method: tools/quality_eval.py's docstring.", "",
             "## The model", "",
             f"`connector.harness.model.HarnessTransformer` trained on these CPUs: {lm.cfg.num_layers} layers, "
             f"{lm.cfg.num_heads} query / {lm.cfg.num_kv_heads} KV heads × {lm.cfg.head_dim}, MLP "
             f"{lm.cfg.intermediate_size}, word-level vocabulary of {lm.cfg.vocab_size} (`<unk>` included), "
             f"RoPE θ = 10,000; {lm.cfg.steps} AdamW steps × {lm.cfg.batch} windows × {lm.cfg.seq_len} tokens "
             f"({info['tokens_seen']:,} tokens seen, {info['train_tokens']:,} distinct training tokens: the stdlib "
             f"docstrings and tool schemas no pair holds) in {info['train_seconds']:.0f} s on {info['threads']} "
             f"thread(s); config hash `{lm.cfg.key()}`.", "",
             "| text | tokens | model PPL | unigram PPL (add-one, training counts) | `<unk>` share |", "|---|---|---|---|---|",
             f"| held-out tail of the training streams | {info['val_tokens']:,} | **{info['val_ppl']:.1f}** | "
             f"{info['unigram_val_ppl']:.1f} | {info['val_unk_share']:.3f} |",
             f"| the evaluated targets' continuations (pydoc topics + stdlib docstrings) | {mq['pairs_tokens']:,} | "
             f"**{mq['pairs_ppl']:.1f}** | {mq['pairs_unigram_ppl']:.1f} | {mq['pairs_unk_share']:.3f} |", "",
             "Held-out loss during training (step, train loss, held-out loss): "
             + ", ".join(f"{s}: {a:.2f}/{b:.2f}" for s, a, b in info["history"]), "",
             "## Quality per class", "",
             f"Per pair: the target's last {args.cont} tokens are the continuation; greedy continuations of "
             f"{args.gen} tokens. Δlogprob in nats/token (variant − exact; 0 = no change, negative = worse); "
             "PPL ratio = exp(−Δ) (> 1 = worse); mean abs Δ = mean |Δ| per token (shifts in both directions do not "
             "cancel); KL = KL(exact ‖ variant) of the next-token distribution, nats, mean over continuation positions; F1 and ROUGE-L of the greedy continuation against exact "
             "recompute's (1 = identical). `reused` = share of prompt tokens given donor K/V; `recompute` = "
             "share of the reused token-layers computed anyway. Means with 95 % bootstrap intervals.", "",
             "| class | span source | variant | n | reused | recompute | Δlogprob | PPL ratio | mean abs Δ | KL | "
             "token F1 | ROUGE-L | max abs Δ |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['cls']} | {r['source']} | {r['variant']} | {r['n']} | {r['reused']:.2f} | "
                     f"{r['recompute']:.2f} | {_fmt(r['dlogprob'])} | {_fmt(r['ppl_ratio'])} | {_fmt(r['abs_d'], 4)} | "
                     f"{_fmt(r['kl'], 4)} | {_fmt(r['f1'], 2)} | "
                     f"{_fmt(r['rouge'], 2)} | {r['max_abs_d']:.2g} |")
    by_con = summarize(results, variants, by_construction=True)
    shown = [v for v in variants if v in ("reuse", "no_rerotate") or v.endswith(f"@{max(args.fraction_list):g}")]
    lines += ["", "## By construction variant (Δlogprob and ROUGE-L, means with 95 % intervals)", "",
              "| class | construction | n | reused | " + " | ".join(f"Δlogprob {v}" for v in shown)
              + " | " + " | ".join(f"ROUGE-L {v}" for v in shown) + " |",
              "|---|---|---|---|" + "---|" * (2 * len(shown))]
    for cls, con in dict.fromkeys((r["cls"], r["construction"]) for r in by_con):
        sel = {r["variant"]: r for r in by_con if (r["cls"], r["construction"]) == (cls, con)}
        first = sel[shown[0]]
        lines.append(f"| {cls} | {con} | {first['n']} | {first['reused']:.2f} | "
                     + " | ".join(_fmt(sel[v]["dlogprob"]) for v in shown) + " | "
                     + " | ".join(_fmt(sel[v]["rouge"], 2) for v in shown) + " |")
    lines += ["", "## What these numbers mean, and their limits", "", *LIMITS, ""]
    path.write_text("\n".join(lines))


LIMITS = [
    "- The model is tiny (a few million parameters, word-level, trained minutes on ~200k tokens of Python "
    "documentation). It has learnt something (its perplexity is far below the unigram's), but a real LLM "
    "attends differently (attention sinks, longer-range dependencies); the sizes of the effects here do "
    "not transfer, only their direction and the comparison between variants on one model.",
    "- Prompts are ~128–300 tokens (the pairs' ctx), not 8K–32K; continuations are short; one seed.",
    "- The continuation is the target's own last tokens (not a task answer), so Δlogprob measures language "
    "modelling of the next text, not answer correctness; no LLM-as-judge.",
    "- `control` reuses the target's own exact K/V: its Δ must be 0 up to float rounding (the blended "
    "forward computes fewer rows than the exact one, so the last bits may differ); a non-zero control "
    "would mean the machinery, not reuse, moved the numbers.",
    "- `other_salt` pairs share text and model, so their reuse is exact: the salt is a tenant boundary, "
    "which quality cannot show; reuse across it stays forbidden (DESIGN rule 9). `other_adapter` uses random "
    "stand-in adapters, not trained ones.",
    "- Selective recompute: `dev@f` pays one full layer (layer 0) of every reused token on top of f of the "
    "rest (the `recompute` column counts it); `first@f` pays f. Selected once at layer 1, not CacheBlend's "
    "gradual filtering.",
]


def main(argv: list[str] | None = None) -> int:
    """Evaluate and write the dated results file; exit 0, or 2 on bad arguments (argparse)."""
    ap = argparse.ArgumentParser(description="Offline quality of donor KV reuse vs exact recompute per discovery "
                                             "class, on a small LM trained here (issue 24; Mode 4 evidence only).")
    ap.add_argument("--per-class", type=int, default=125, help="pairs per class (default 125: 1,000 pairs)")
    ap.add_argument("--seed", type=int, default=0, help="pair construction seed")
    ap.add_argument("--fractions", default="0.15,0.3", help="selective-recompute fractions (comma-separated)")
    ap.add_argument("--cont", type=int, default=32, help="held-out continuation tokens per target")
    ap.add_argument("--gen", type=int, default=32, help="greedy tokens generated per variant")
    ap.add_argument("--min-run", type=int, default=4, help="shortest aligned run reused where a pair has no spans")
    ap.add_argument("--quick", action="store_true",
                    help="tiny model, at most 2 pairs per class, --cont and --gen 8, the first two fractions "
                         "(smoke test; default file tools/results/quality-DATE-quick.md)")
    ap.add_argument("--out", type=Path, default=None,
                    help="results file (default tools/results/quality-DATE-HHMM.md, HHMM the start, UTC)")
    args = ap.parse_args(argv)
    try:
        fractions = [float(x) for x in args.fractions.split(",") if x]
    except ValueError:
        ap.error(f"--fractions {args.fractions!r}: comma-separated numbers in (0, 1)")
    if args.per_class < 1 or not fractions or not all(0 < f < 1 for f in fractions) or args.cont < 1 or args.gen < 1 \
            or args.min_run < 1:
        ap.error("--per-class, --cont, --gen and --min-run must be >= 1 and --fractions one or more values in (0, 1)")
    if args.quick:
        args.per_class, args.cont, args.gen, fractions = min(args.per_class, 2), 8, 8, fractions[:2]
    args.fraction_list = fractions
    now = dt.datetime.now(dt.UTC)
    out = args.out or RESULTS / f"quality-{now:%Y-%m-%d}{'-quick' if args.quick else now.strftime('-%H%M')}.md"
    if not out.parent.is_dir():  # before the run, not after its quarter of an hour
        ap.error(f"--out {out}: no directory {out.parent}")
    times = {"date": now.strftime("%Y-%m-%d"), "start": now.strftime("%H:%M"), "load_start": _load()}
    torch.manual_seed(0)
    lm = load_or_train(QUICK_LM if args.quick else LMConfig(), log=lambda s: print(s, file=sys.stderr, flush=True))
    torch.set_num_threads(1)
    pairs = build_pairs(args.per_class, seed=args.seed, ctx=128 if args.quick else 256).pairs
    variants = variant_names(fractions)
    t0, results, adapters = time.perf_counter(), [], {}
    for i, pair in enumerate(pairs):
        results.append(evaluate_pair(lm, pair, cont=args.cont, gen=args.gen, min_run=args.min_run,
                                     fractions=fractions, adapters=adapters))
        if (i + 1) % 50 == 0:
            print(f"{i + 1}/{len(pairs)} pairs {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    times["eval_s"] = time.perf_counter() - t0
    mq = model_quality(lm, list(pairs), args.cont)
    rows = summarize(results, variants)
    end = dt.datetime.now(dt.UTC)
    times |= {"end": end.strftime("%H:%M"), "load_end": _load()}
    write_report(out, args, lm, mq, rows, results, times, variants)
    digest = hashlib.sha256(out.read_bytes()).hexdigest()[:12]
    print(f"wrote {out} ({digest})")
    return 0


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


if __name__ == "__main__":
    sys.exit(main())

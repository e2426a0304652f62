"""Labelled target/donor pairs for evaluating donor discovery at scale (issue 24, DESIGN §10).

Text source (offline, nothing downloaded): the help topics of ``pydoc_data.topics`` (the text
``help("FOR")`` prints; ~114k pieces) followed by the docstrings and tool schemas of the running
interpreter's standard library (:class:`tools.workloads.Corpus`: ``ast``-parsed, never imported).
Each piece of prose is handed out once, so two pairs share text only where a construction says so
(or where the sources themselves repeat a phrase, as real prompts do). Tool schemas repeat their
JSON boilerplate (``" name " : "``, ``" parameters " : [``) across pairs, like real tool lists.

Tokens: :class:`tools.workloads.WordTokenizer` (one token per word or punctuation character,
``1 + xxh32(piece) mod (vocab_size - 1)``) with a 32,000-token vocabulary by default, the size of
common LLM vocabularies, so that unrelated words rarely share an id (the harness's 512-token
vocabulary would make unrelated text look alike to the token providers).

Classes (``PAIR_CLASSES``; ``positive`` = discovery should attribute the target to the donor):

* ``other_instructions`` (+): the same document under other instructions. Variant ``before``:
  instruction A + document vs instruction B (another length) + document (the document moves and
  follows another prefix); variant ``after``: document + A vs document + B (an exact prefix).
* ``reordered_chunks`` (+): system prompt + three 64-token RAG chunks, the chunks in another order
  (a non-identity permutation), another closing question.
* ``tool_schema`` (+): system prompt 1 + a stdlib module's tool schema + turn 1 vs system prompt 2
  (another length) + the same schema + another turn.
* ``restatement`` (+): multi-turn restatement. Donor: system prompt + a user passage + an answer;
  target: the same system prompt, another user turn, then ``As I wrote earlier :`` and a verbatim
  restatement of 96 tokens of the donor's passage, then a question.
* ``paraphrase`` (+): the donor's document reworded by :func:`tools.workloads.paraphrase`
  (deterministic rules: synonym table, articles dropped, adjacent sentences swapped), another question.
* ``near_miss`` (−): looks close, nothing reusable (no shared run of 16 tokens, the default
  ``min_segment_tokens``: a pair whose texts happen to share one is drawn again). Variants: ``shared_header`` (the same 12-piece
  header, shorter than a block and than ``min_segment_tokens``, then the NEXT text of the same
  source: same topic, different content), ``shuffled`` (the donor's words shuffled within each
  sentence), ``dense_edits`` (every 8th piece of the donor replaced by another word: no 8-token run
  survives).
* ``other_salt`` (−): identical text, another ``cache_salt`` (another namespace: never reusable).
* ``other_adapter`` (−): identical text, another LoRA adapter (another namespace).

Namespaces: :func:`namespace_digest` of ``(model_id, cache_salt, lora_task_id)``, the fields
:meth:`connector.namespace.DeploymentNamespace.for_request` adds per request (a different value of
any one of them gives another digest, as in the product). Everything is deterministic given
``seed`` (the permutations, paraphrase choices, instruction lengths, adapters and edits).
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from collections.abc import Iterator

import numpy as np
import xxhash

from connector.discovery.tokens import align_segments
from tools.workloads import Corpus, Prompt, WordTokenizer, paraphrase

__all__ = ["NEGATIVE_CLASSES", "PAIR_CLASSES", "POSITIVE_CLASSES", "Pair", "PairCorpus", "PairSet", "build_pairs",
           "namespace_digest"]

POSITIVE_CLASSES = ("other_instructions", "reordered_chunks", "tool_schema", "restatement", "paraphrase")
NEGATIVE_CLASSES = ("near_miss", "other_salt", "other_adapter")
PAIR_CLASSES = POSITIVE_CLASSES + NEGATIVE_CLASSES
MODEL_ID = "eval-model"
_PIECE = re.compile(r"\w+|[^\w\s]")
_HEADER = tuple(_PIECE.findall("You are a helpful assistant . Answer from the text below ."))
_RESTATE = tuple(_PIECE.findall("As I wrote earlier :"))
_NEAR_MISS_MAX_RUN = 16  # a near miss shares no token run this long (DiscoverySettings.min_segment_tokens)
_EDIT_WORDS = ("zebra", "quartz", "lantern", "meadow", "violet", "harbor", "copper", "nimbus", "saddle", "tundra")


def namespace_digest(cache_salt: str = "none", lora_task_id: str = "none", model_id: str = MODEL_ID) -> str:
    """32 hex chars: xxh3_128 of the sorted JSON of the request-scoped namespace fields."""
    fields = {"model_id": model_id, "cache_salt": cache_salt, "lora_task_id": lora_task_id, "multimodal": "none"}
    return xxhash.xxh3_128_hexdigest(json.dumps(dict(sorted(fields.items())), separators=(",", ":")).encode())


@dataclasses.dataclass(frozen=True)
class Pair:
    """One labelled pair.

    Attributes:
        pair_id: ``CLASS/INDEX``; cls: one of :data:`PAIR_CLASSES`; variant: the construction's variant.
        positive: discovery should attribute ``target`` to ``donor`` (False: a negative control).
        donor, target: the prompts (pieces, token ids); donor_namespace, target_namespace: 32-hex digests.
        shared_spans: ``(target_start, donor_start, tokens)`` token-exact spans known by construction.
    """

    pair_id: str
    cls: str
    variant: str
    positive: bool
    donor: Prompt
    target: Prompt
    donor_namespace: str
    target_namespace: str
    shared_spans: tuple[tuple[int, int, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class PairSet:
    """Every pair of one :func:`build_pairs` call, in class order."""

    pairs: tuple[Pair, ...]
    seed: int
    ctx: int
    vocab_size: int
    rest: PairCorpus | None = dataclasses.field(default=None, compare=False, repr=False)
    """The corpus after the pairs: prose and tool schemas that no pair holds (tools/quality_eval.py
    trains its model on it, so the model never saw the text it is evaluated on)."""

    def by_class(self, cls: str) -> list[Pair]:
        return [p for p in self.pairs if p.cls == cls]

    def counts(self) -> dict[str, int]:
        return {c: len(self.by_class(c)) for c in PAIR_CLASSES}


class PairCorpus:
    """Prose pieces from ``pydoc_data.topics`` then the stdlib's docstrings; tool schemas from the stdlib."""

    def __init__(self) -> None:
        from pydoc_data.topics import topics

        self._topics: Iterator[str] = (piece for key in sorted(topics) for piece in _PIECE.findall(topics[key]))
        self._stdlib = Corpus()

    def take(self, n: int) -> tuple[str, ...]:
        """The next ``n`` prose pieces (never handed out twice)."""
        out = [piece for _, piece in zip(range(n), self._topics, strict=False)]
        if len(out) < n:
            out.extend(self._stdlib.take(n - len(out)))
        return tuple(out)

    def tool_schema(self, n: int) -> tuple[str, ...]:
        return self._stdlib.tool_schema(n)


class _Builder:
    def __init__(self, ctx: int, vocab_size: int, seed: int) -> None:
        self.ctx, self.rng, self.seed = ctx, random.Random(seed), seed
        self.corpus, self.tok = PairCorpus(), WordTokenizer(vocab_size)
        self.pairs: list[Pair] = []

    def prompt(self, key: str, *parts: tuple[str, ...]) -> Prompt:
        pieces = tuple(p for part in parts for p in part)
        return Prompt(key, pieces, tuple(self.tok.encode_pieces(pieces)))

    def add(self, cls: str, i: int, variant: str, donor_parts: list[tuple[str, ...]],
            target_parts: list[tuple[str, ...]], *, spans: tuple[tuple[int, int, int], ...] = (),
            donor_ns: str | None = None, target_ns: str | None = None) -> None:
        base = namespace_digest()
        pid = f"{cls}/{i:04d}"
        self.pairs.append(Pair(pid, cls, variant, cls in POSITIVE_CLASSES, self.prompt(f"{pid}/donor", *donor_parts),
                               self.prompt(f"{pid}/target", *target_parts), donor_ns or base, target_ns or base,
                               spans))


def _other_instructions(b: _Builder, i: int) -> None:
    take, ctx = b.corpus.take, b.ctx
    la = b.rng.randrange(ctx // 16, ctx // 8)
    lb = la + b.rng.randrange(5, ctx // 8)  # another length: the document moves in ``before``
    a, doc, instr_b = take(la), take(ctx * 3 // 4), take(lb)
    if i % 2 == 0:
        b.add("other_instructions", i, "before", [a, doc], [instr_b, doc], spans=((lb, la, len(doc)),))
    else:
        b.add("other_instructions", i, "after", [doc, a], [doc, instr_b], spans=((0, 0, len(doc)),))


def _reordered_chunks(b: _Builder, i: int) -> None:
    take, ctx = b.corpus.take, b.ctx
    sys_, chunks = take(ctx // 8), [take(ctx // 4) for _ in range(3)]
    order = [0, 1, 2]
    while order == [0, 1, 2]:
        b.rng.shuffle(order)
    donor_at, pos = [], len(sys_)
    for c in chunks:
        donor_at.append(pos)
        pos += len(c)
    spans, pos = [(0, 0, len(sys_))], len(sys_)
    for j in order:
        spans.append((pos, donor_at[j], len(chunks[j])))
        pos += len(chunks[j])
    b.add("reordered_chunks", i, "permuted", [sys_, *chunks, take(ctx // 16)],
          [sys_, *(chunks[j] for j in order), take(ctx // 16)], spans=tuple(spans))


def _tool_schema(b: _Builder, i: int) -> None:
    take, ctx = b.corpus.take, b.ctx
    schema = b.corpus.tool_schema(ctx // 2)
    s1 = take(ctx // 8)
    s2 = take(ctx // 8 + b.rng.randrange(3, ctx // 16))
    turn1, turn2 = take(ctx // 8), take(ctx // 8)
    b.add("tool_schema", i, "other_system_prompt", [s1, schema, turn1], [s2, schema, turn2],
          spans=((len(s2), len(s1), len(schema)),))


def _restatement(b: _Builder, i: int) -> None:
    take, ctx = b.corpus.take, b.ctx
    sys_, passage, answer = take(ctx // 8), take(ctx * 5 // 8), take(ctx // 8)
    turn2, question = take(ctx // 8), take(ctx // 16)
    start = b.rng.randrange(0, len(passage) - ctx * 3 // 8)
    quoted = passage[start : start + ctx * 3 // 8]
    at = len(sys_) + len(turn2) + len(_RESTATE)
    b.add("restatement", i, "verbatim", [sys_, passage, answer], [sys_, turn2, _RESTATE, quoted, question],
          spans=((0, 0, len(sys_)), (at, len(sys_) + start, len(quoted))))


def _paraphrase(b: _Builder, i: int) -> None:
    take, ctx = b.corpus.take, b.ctx
    doc = take(ctx * 7 // 8)
    b.add("paraphrase", i, "rules", [doc, take(ctx // 8)], [paraphrase(doc, b.seed * 100_003 + i), take(ctx // 8)])


def _near_miss(b: _Builder, i: int) -> None:
    variant = ("shared_header", "shuffled", "dense_edits")[i % 3]
    while True:  # the sources repeat some phrases (grammar rules, "See also"): draw again until nothing is shared
        donor, target, spans = _near_miss_texts(b, variant)
        d, t = (np.asarray(b.tok.encode_pieces(x), dtype=np.int64) for x in (donor, target))
        if not align_segments(t, d, anchor=8, min_tokens=_NEAR_MISS_MAX_RUN):
            break
    b.add("near_miss", i, variant, [donor], [target], spans=spans)


def _near_miss_texts(b: _Builder, variant: str) -> tuple[tuple[str, ...], tuple[str, ...], tuple]:
    take, ctx = b.corpus.take, b.ctx
    if variant == "shared_header":
        doc_a, doc_b = take(ctx - len(_HEADER)), take(ctx - len(_HEADER))  # consecutive: same source, same topic
        return _HEADER + doc_a, _HEADER + doc_b, ((0, 0, len(_HEADER)),)
    doc = take(ctx)
    if variant == "shuffled":
        out, sentence = [], []
        for piece in doc:
            sentence.append(piece)
            if piece in ".!?":
                b.rng.shuffle(sentence)
                out.extend(sentence)
                sentence = []
        b.rng.shuffle(sentence)
        return doc, tuple(out + sentence), ()
    offset = b.rng.randrange(8)
    return doc, tuple(b.rng.choice(_EDIT_WORDS) if (k + offset) % 8 == 0 else p for k, p in enumerate(doc)), ()


def _other_salt(b: _Builder, i: int) -> None:
    take, ctx = b.corpus.take, b.ctx
    doc = take(ctx * 7 // 8)
    b.add("other_salt", i, "cache_salt", [doc, take(ctx // 8)], [doc, take(ctx // 8)], spans=((0, 0, len(doc)),),
          donor_ns=namespace_digest(cache_salt=f"tenant-a-{i}"), target_ns=namespace_digest(cache_salt=f"tenant-b-{i}"))


def _other_adapter(b: _Builder, i: int) -> None:
    take, ctx = b.corpus.take, b.ctx
    doc = take(ctx * 7 // 8)
    adapter = b.rng.randrange(1, 1000)
    target_adapter = "none" if i % 2 == 0 else str(adapter + 1)  # base model, or a sibling adapter
    b.add("other_adapter", i, "base_model" if i % 2 == 0 else "other_lora", [doc, take(ctx // 8)],
          [doc, take(ctx // 8)], spans=((0, 0, len(doc)),), donor_ns=namespace_digest(lora_task_id=str(adapter)),
          target_ns=namespace_digest(lora_task_id=target_adapter))


_BUILDERS = {"other_instructions": _other_instructions, "reordered_chunks": _reordered_chunks,
             "tool_schema": _tool_schema, "restatement": _restatement, "paraphrase": _paraphrase,
             "near_miss": _near_miss, "other_salt": _other_salt, "other_adapter": _other_adapter}


def build_pairs(per_class: int = 125, *, seed: int = 0, ctx: int = 256, vocab_size: int = 32_000,
                classes: tuple[str, ...] = PAIR_CLASSES) -> PairSet:
    """``per_class`` pairs of each class (default 8 × 125 = 1,000), prompts of about ``ctx`` tokens.

    Classes are built round-robin (pair ``i`` of every class, then ``i + 1``), so each class draws
    text from every part of the corpus rather than one class taking all of pydoc's topics.

    Raises:
        ValueError: an unknown class, ``per_class < 1`` or ``ctx < 128``.
        RuntimeError: the corpus is exhausted (fewer pairs or a smaller ``ctx``).
    """
    unknown = set(classes) - set(PAIR_CLASSES)
    if unknown or per_class < 1 or ctx < 128:
        raise ValueError(f"unknown classes {sorted(unknown)}, per_class < 1 or ctx < 128")
    b = _Builder(ctx, vocab_size, seed)
    for i in range(per_class):
        for cls in classes:
            _BUILDERS[cls](b, i)
    order = {c: k for k, c in enumerate(PAIR_CLASSES)}
    pairs = sorted(b.pairs, key=lambda p: (order[p.cls], p.pair_id))
    return PairSet(tuple(pairs), seed, ctx, vocab_size, rest=b.corpus)

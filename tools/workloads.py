"""RFC scenario workloads over real text that ships offline, with ground-truth labels (issue 6).

Text source: the CPython standard library of the running interpreter (``sysconfig.get_paths()
["stdlib"]``, i.e. its ``Lib/`` directory; test suites and idlelib excluded), read with ``pathlib``
and parsed with ``ast`` (nothing is imported or executed):

* prose — module, class and function docstrings, in sorted file order;
* tool schemas — JSON descriptions of a module's public functions (name, first docstring line,
  parameter names), as an agent's tool list would carry them.

Text is cut into pieces (``\\w+`` or one punctuation character); a prompt's text is its pieces
joined by single spaces, so re-tokenizing the text gives the same pieces. :class:`WordTokenizer`
maps a piece to a token id in the reference harness's vocabulary (``1 + xxh32(piece) mod
(vocab - 1)``): equal text gives equal token ids, which is all the exact path and the token
providers need; the embedding provider reads the text.

Scenarios (each target labelled with its donor and the token-exact spans known by construction):
``system_prompt`` (exact repeated system prompt), ``partial_overlap`` (first half of a document,
then other text), ``paraphrase_qa`` (the document reworded: synonyms, sentence order, dropped
articles), ``rag_reordered`` (same system prompt, RAG chunks in another order), ``agent_tools``
(the same tool schema after another system prompt, next turn appended), ``host_offload`` (like
system_prompt; the benchmark offloads the donor's blocks to host memory), ``high_load`` (a burst of
targets sharing one donor's prefix), and the negative controls ``unrelated`` (no donor) and
``other_salt`` (same text, another cache salt: must never be reused).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import random
import re
import sysconfig
from pathlib import Path

import xxhash

__all__ = ["NEGATIVE_SCENARIOS", "SCENARIOS", "Corpus", "Label", "Prompt", "WordTokenizer", "Workload",
           "build_workload", "paraphrase"]

SCENARIOS = ("system_prompt", "partial_overlap", "paraphrase_qa", "rag_reordered", "agent_tools", "host_offload",
             "high_load", "unrelated", "other_salt")
NEGATIVE_SCENARIOS = ("unrelated", "other_salt")
_PIECE = re.compile(r"\w+|[^\w\s]")
_SKIP_PARTS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo"}


class WordTokenizer:
    """Pieces -> token ids in ``[1, vocab_size)`` (deterministic, many-to-one)."""

    def __init__(self, vocab_size: int = 512) -> None:
        self.vocab_size = vocab_size

    def encode_pieces(self, pieces: tuple[str, ...] | list[str]) -> list[int]:
        return [1 + xxhash.xxh32_intdigest(p.encode()) % (self.vocab_size - 1) for p in pieces]

    def encode(self, text: str) -> list[int]:
        return self.encode_pieces(_PIECE.findall(text))


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not _SKIP_PARTS & set(p.relative_to(root).parts))


class Corpus:
    """Sequential, never-reused streams of stdlib prose and tool schemas (parsed lazily, file by file)."""

    def __init__(self) -> None:
        self._files = _stdlib_files()
        self._prose: list[str] = []
        self._schemas: list[list[str]] = []
        self._next_file = 0
        self._cursor = 0

    def _parse_next(self) -> None:
        if self._next_file >= len(self._files):
            raise RuntimeError("the standard library's docstrings are exhausted; use smaller contexts")
        path = self._files[self._next_file]
        self._next_file += 1
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            return
        tools = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    self._prose.extend(_PIECE.findall(doc))
                if isinstance(node, ast.FunctionDef) and doc and not node.name.startswith("_"):
                    tools.append({"name": node.name, "description": doc.strip().splitlines()[0],
                                  "parameters": [a.arg for a in node.args.args if a.arg != "self"]})
        if len(tools) >= 4:
            self._schemas.append(_PIECE.findall(json.dumps({"module": path.stem, "tools": tools})))

    def take(self, n: int) -> tuple[str, ...]:
        """The next ``n`` prose pieces (never handed out twice)."""
        while len(self._prose) - self._cursor < n:
            self._parse_next()
        out = tuple(self._prose[self._cursor : self._cursor + n])
        self._cursor += n
        return out

    def tool_schema(self, n: int) -> tuple[str, ...]:
        """About ``n`` pieces of tool schemas (whole schemas, concatenated, cut at ``n``)."""
        out: list[str] = []
        while len(out) < n:
            while not self._schemas:
                self._parse_next()
            out.extend(self._schemas.pop(0))
        return tuple(out[:n])


_SYNONYMS = {
    "return": "give back", "returns": "gives back", "returned": "given back", "function": "routine",
    "functions": "routines", "object": "instance", "objects": "instances", "list": "sequence", "create": "make",
    "creates": "makes", "created": "made", "default": "standard", "optional": "not required", "specified": "given",
    "argument": "parameter", "arguments": "parameters", "raise": "throw", "raises": "throws", "error": "failure",
    "use": "employ", "used": "employed", "uses": "employs", "new": "fresh", "contains": "holds", "contain": "hold",
    "value": "quantity", "values": "quantities", "method": "procedure", "called": "invoked", "call": "invoke",
    "number": "count", "string": "text", "strings": "texts", "class": "type", "if": "when", "otherwise": "else",
    "must": "has to", "should": "ought to", "can": "is able to", "may": "might", "set": "assign", "get": "fetch",
    "all": "every", "each": "every", "file": "document", "files": "documents", "name": "label", "names": "labels",
    "first": "initial", "last": "final", "data": "information", "true": "truthy", "false": "falsy",
    "only": "solely", "also": "additionally", "given": "supplied", "specify": "indicate", "result": "outcome",
}
_DROP = {"the", "a", "an", "The"}


def paraphrase(pieces: tuple[str, ...], seed: int) -> tuple[str, ...]:
    """Reword ``pieces``: synonyms, articles dropped, adjacent sentences swapped (meaning kept)."""
    rng = random.Random(seed)
    sentences: list[list[str]] = [[]]
    for piece in pieces:
        sentences[-1].append(piece)
        if piece in ".!?":
            sentences.append([])
    for i in range(0, len(sentences) - 1, 2):
        if rng.random() < 0.5:
            sentences[i], sentences[i + 1] = sentences[i + 1], sentences[i]
    out: list[str] = []
    for sentence in sentences:
        for piece in sentence:
            if piece in _DROP and rng.random() < 0.7:
                continue
            swap = _SYNONYMS.get(piece.lower())
            out.extend(_PIECE.findall(swap) if swap and rng.random() < 0.85 else [piece])
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt: its pieces, token ids and cache salt."""

    key: str
    pieces: tuple[str, ...]
    tokens: tuple[int, ...]
    cache_salt: str | None = None

    @property
    def text(self) -> str:
        return " ".join(self.pieces)


@dataclasses.dataclass(frozen=True)
class Label:
    """Ground truth of one target.

    Attributes:
        scenario: one of :data:`SCENARIOS`.
        target: the target prompt's key; donor: the donor prompt's key, or None (no donor exists).
        related: discovery should attribute the target to ``donor``.
        negative: a negative control (nothing may be materialized; discovery must not report a hit).
        exact_prefix_tokens: the target's token-exact common prefix with the donor (tokens).
        relocated: ``(target_start, donor_start, tokens)`` spans equal in both at other positions.
        expected_providers: the providers designed to find this pair (recall is measured on these).
    """

    scenario: str
    target: str
    donor: str | None
    related: bool
    negative: bool
    exact_prefix_tokens: int
    relocated: tuple[tuple[int, int, int], ...] = ()
    expected_providers: frozenset[str] = frozenset()


@dataclasses.dataclass
class Workload:
    """Donor prompts (run first, in order), targets (run after) and their labels."""

    prompts: dict[str, Prompt]
    donors: list[str]
    labels: list[Label]
    context_tokens: int

    def prompt(self, key: str) -> Prompt:
        return self.prompts[key]


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class _Builder:
    def __init__(self, ctx: int, vocab_size: int) -> None:
        self.ctx, self.corpus, self.tok = ctx, Corpus(), WordTokenizer(vocab_size)
        self.prompts: dict[str, Prompt] = {}
        self.donors: list[str] = []
        self.labels: list[Label] = []

    def prompt(self, key: str, *parts: tuple[str, ...], salt: str | None = None) -> Prompt:
        pieces = tuple(p for part in parts for p in part)
        prompt = Prompt(key, pieces, tuple(self.tok.encode_pieces(pieces)), salt)
        self.prompts[key] = prompt
        return prompt

    def donor(self, key: str, *parts: tuple[str, ...], salt: str | None = None) -> Prompt:
        self.donors.append(key)
        return self.prompt(key, *parts, salt=salt)

    def target(self, scenario: str, key: str, donor: Prompt | None, *parts: tuple[str, ...], salt: str | None = None,
               related: bool = True, expected: tuple[str, ...] = (), relocated: tuple = ()) -> None:
        t = self.prompt(key, *parts, salt=salt)
        negative = scenario in NEGATIVE_SCENARIOS
        self.labels.append(Label(scenario, key, donor.key if donor else None, related and not negative, negative,
                                 _common_prefix(t.tokens, donor.tokens) if donor else 0, relocated,
                                 frozenset(expected)))


def build_workload(ctx: int = 1024, *, load: int = 8, seed: int = 0, vocab_size: int = 512,
                   scenarios: tuple[str, ...] = SCENARIOS) -> Workload:
    """Build every scenario with targets of about ``ctx`` tokens (``load`` targets for high_load).

    Raises:
        ValueError: unknown scenario, or ``ctx < 256``.
    """
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown or ctx < 256:
        raise ValueError(f"unknown scenarios {sorted(unknown)} or ctx < 256")
    b = _Builder(ctx, vocab_size)
    take = b.corpus.take
    for name in scenarios:
        _SCENARIO_BUILDERS[name](b, take, ctx, load, seed)
    return Workload(b.prompts, b.donors, b.labels, ctx)


def _system_prompt(b: _Builder, take, ctx: int, load: int, seed: int) -> None:
    sys_ = take(ctx * 3 // 4)
    d = b.donor("system_prompt/donor", sys_, take(ctx // 8))
    b.target("system_prompt", "system_prompt/target", d, sys_, take(ctx // 8), expected=("exact", "minhash"))


def _partial(b: _Builder, take, ctx: int, load: int, seed: int) -> None:
    doc = take(ctx)
    d = b.donor("partial_overlap/donor", doc)
    b.target("partial_overlap", "partial_overlap/target", d, doc[: ctx // 2], take(ctx // 2),
             expected=("exact", "minhash"))


def _paraphrase(b: _Builder, take, ctx: int, load: int, seed: int) -> None:
    doc = take(ctx * 7 // 8)
    d = b.donor("paraphrase_qa/donor", doc, take(ctx // 8))
    b.target("paraphrase_qa", "paraphrase_qa/target", d, paraphrase(doc, seed), take(ctx // 8),
             expected=("embedding",))


def _rag(b: _Builder, take, ctx: int, load: int, seed: int) -> None:
    sys_, c1, c2, c3 = take(ctx // 8), take(ctx // 4), take(ctx // 4), take(ctx // 4)
    d = b.donor("rag_reordered/donor", sys_, c1, c2, c3, take(ctx // 16))
    s = len(sys_)
    relocated = ((s, s + len(c1) + len(c2), len(c3)), (s + len(c3), s, len(c1)),
                 (s + len(c3) + len(c1), s + len(c1), len(c2)))
    b.target("rag_reordered", "rag_reordered/target", d, sys_, c3, c1, c2, take(ctx // 16),
             expected=("exact", "chunks", "minhash"), relocated=relocated)


def _agent(b: _Builder, take, ctx: int, load: int, seed: int) -> None:
    tools, turn1 = b.corpus.tool_schema(ctx // 2), take(ctx // 8)
    sys1, sys2 = take(ctx // 8), take(ctx // 6)
    d = b.donor("agent_tools/donor", sys1, tools, turn1)
    relocated = ((len(sys2), len(sys1), len(tools) + len(turn1)),)
    b.target("agent_tools", "agent_tools/target", d, sys2, tools, turn1, take(ctx // 8),
             expected=("chunks", "minhash"), relocated=relocated)


def _offload(b: _Builder, take, ctx: int, load: int, seed: int) -> None:
    doc = take(ctx * 7 // 8)
    d = b.donor("host_offload/donor", doc, take(ctx // 16))
    b.target("host_offload", "host_offload/target", d, doc, take(ctx // 8), expected=("exact", "minhash"))


def _high_load(b: _Builder, take, ctx: int, load: int, seed: int) -> None:
    sys_ = take(ctx * 3 // 4)
    d = b.donor("high_load/donor", sys_, take(ctx // 8))
    for i in range(load):
        b.target("high_load", f"high_load/target-{i}", d, sys_, take(ctx // 8), expected=("exact", "minhash"))


def _unrelated(b: _Builder, take, ctx: int, load: int, seed: int) -> None:
    b.target("unrelated", "unrelated/target", None, take(ctx))


def _other_salt(b: _Builder, take, ctx: int, load: int, seed: int) -> None:
    doc = take(ctx * 7 // 8)
    d = b.donor("other_salt/donor", doc, take(ctx // 8), salt="tenant-a")
    b.target("other_salt", "other_salt/target", d, doc, take(ctx // 8), salt="tenant-b")


_SCENARIO_BUILDERS = {"system_prompt": _system_prompt, "partial_overlap": _partial, "paraphrase_qa": _paraphrase,
                      "rag_reordered": _rag, "agent_tools": _agent, "host_offload": _offload,
                      "high_load": _high_load, "unrelated": _unrelated, "other_salt": _other_salt}

"""Build (once) and cache the NVIDIA Dynamo 1.6.1 environment of the ``dynamo_cpu`` real-engine group.

Run with any Python 3.11: ``python3 tools/dynamo_cpu/setup_env.py``. It prints two ``export`` lines
(``SEMKV_DYNAMO_PYTHON``, ``SEMKV_DYNAMO_MODEL``) for ``tests/dynamo_cpu``; ``--print-env`` prints
only those (for ``eval``).

What it does, each step skipped when its stamp says it is already done
(``tools/harness/cached_env.py``, shared with ``tools/vllm_cpu/setup_env.py``):

1. a venv under ``$SEMKV_DYNAMO_HOME`` (default ``~/.cache/semkv-ledger/dynamo-1.6.1``) with
   ``ai-dynamo-runtime==1.6.1`` (the Rust runtime, a manylinux wheel) and ``ai-dynamo==1.6.1``
   installed ``--no-deps``: ai-dynamo requires ``aisimulate==0.13.0``, a placeholder wheel that
   downloads from an index these machines cannot reach. Its other requirements are then read from
   the installed wheel's METADATA (``Requires-Dist``) and installed, less ``aisimulate`` and every
   requirement of an extra (the engines: vllm, sglang, trtllm). The mocker workers and the
   frontend need nothing more (``../shared/reference/DYNAMO_CPU.md``). Not this project: the
   consumer and the tests run in this project's own venv;
2. the tiny tokenizer, made offline (``tools/vllm_cpu/tiny_llama.py --tokenizer-only``: the same
   byte-level BPE as the vLLM group's model) with a ``config.json`` that names
   ``"architectures": ["LlamaForCausalLM"]`` — without it Dynamo's frontend refuses the model
   (``missing field 'architectures'``). The mocker has no weights: it reads only the tokenizer.

The stamps hash the pins and the tokenizer script, so editing either rebuilds what depends on it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script, with any python3: tools.harness from this checkout

from tools.harness.cached_env import cached_step, cli, digest, new_venv, offline_env, print_exports, run  # noqa: E402

DYNAMO_VERSION = "1.6.1"
RUNTIME = f"ai-dynamo-runtime=={DYNAMO_VERSION}"
DYNAMO = f"ai-dynamo=={DYNAMO_VERSION}"
UNREACHABLE_REQUIREMENTS = frozenset({"aisimulate"})
TINY_LLAMA = REPO / "tools" / "vllm_cpu" / "tiny_llama.py"


def requirement_name(requirement: str) -> str:
    """The normalized project name of a PEP 508 requirement (``"Foo_Bar>=1; extra == 'x'"`` → ``foo-bar``)."""
    name = requirement.split(";", 1)[0].strip()
    for stop in "[<>=!~ (@":
        name = name.split(stop, 1)[0]
    return name.strip().lower().replace("_", "-").replace(".", "-")


def runtime_requirements(requires_dist: list[str]) -> list[str]:
    """``Requires-Dist`` less the requirements of extras and the unreachable ``aisimulate``; other
    environment markers (``python_version``) are kept for pip to evaluate."""
    kept = []
    for requirement in requires_dist:
        marker = requirement.split(";", 1)[1] if ";" in requirement else ""
        if "extra" in marker or requirement_name(requirement) in UNREACHABLE_REQUIREMENTS:
            continue
        kept.append(requirement)
    return kept


def installed_requires(python: Path, distribution: str) -> list[str]:
    """``Requires-Dist`` of ``distribution`` as installed in the venv of ``python`` (its METADATA)."""
    code = f"import importlib.metadata as m, json; print(json.dumps(m.requires({distribution!r}) or []))"
    return json.loads(subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout)


def ensure_venv(home: Path) -> Path:
    python = home / "venv" / "bin" / "python"

    def build() -> None:
        new_venv(home / "venv")
        run(str(python), "-m", "pip", "install", "-q", RUNTIME)
        run(str(python), "-m", "pip", "install", "-q", "--no-deps", DYNAMO)
        requirements = runtime_requirements(installed_requires(python, "ai-dynamo"))
        run(str(python), "-m", "pip", "install", "-q", *requirements)
        run(str(python), "-c", "import dynamo.mocker, dynamo.frontend, dynamo.llm, importlib.metadata as m; "
            "print('ai-dynamo', m.version('ai-dynamo'), 'runtime', m.version('ai-dynamo-runtime'))")

    return cached_step(home, "venv", digest(RUNTIME, DYNAMO, *sorted(UNREACHABLE_REQUIREMENTS)), python, build)


def ensure_tokenizer(home: Path, python: Path) -> Path:
    model = home / "tiny-tokenizer"

    def build() -> None:
        shutil.rmtree(model, ignore_errors=True)
        run(str(python), str(TINY_LLAMA), "--tokenizer-only", str(model), env=offline_env())

    return cached_step(home, "model", digest(TINY_LLAMA.read_text()), model / "config.json", build).parent


def main() -> int:
    args = cli(f"Build and cache the Dynamo {DYNAMO_VERSION} venv and tiny tokenizer.",
               home_env="SEMKV_DYNAMO_HOME", home_name=f"dynamo-{DYNAMO_VERSION}")
    python = ensure_venv(args.home)
    model = ensure_tokenizer(args.home, python)
    print_exports({"SEMKV_DYNAMO_PYTHON": python, "SEMKV_DYNAMO_MODEL": model},
                  hint=None if args.print_env else ".venv/bin/python -m pytest tests/dynamo_cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())

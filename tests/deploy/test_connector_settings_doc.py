"""docs/connector-settings.md is generated from the connector's settings models
(``python -m connector.settings``): it must equal what the code generates today, name every setting,
and the environment variables it names must really set those settings (nested ones included)."""

from __future__ import annotations

from pathlib import Path

import pytest

from connector.discovery.settings import DiscoverySettings
from connector.settings import (ConnectorSettings, NamespaceOverrides, ProfitSettings, load_connector_settings,
                                settings_markdown)

DOC = Path(__file__).resolve().parents[2] / "docs" / "connector-settings.md"


def test_connector_settings_doc_is_generated_from_the_models() -> None:
    assert DOC.read_text() == settings_markdown(), "regenerate: python -m connector.settings > docs/connector-settings.md"


def test_connector_settings_doc_names_every_setting() -> None:
    text = DOC.read_text()
    names = [n for n in ConnectorSettings.model_fields if n not in ("namespace", "discovery", "profit")]
    names += [f"namespace.{n}" for n in NamespaceOverrides.model_fields]
    names += [f"discovery.{n}" for n in DiscoverySettings.model_fields]
    names += [f"profit.{n}" for n in ProfitSettings.model_fields]
    for name in names:
        assert f"| `{name}` |" in text, name


def test_the_environment_variables_named_set_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    text = DOC.read_text()
    values = {"TRTLLM_SEMKV_MODE": "exact_equivalent", "TRTLLM_SEMKV_LOOKUP_TIMEOUT_S": "0.004",
              "TRTLLM_SEMKV_NAMESPACE__KV_DTYPE": "bfloat16", "TRTLLM_SEMKV_DISCOVERY__ENABLED": "true", "TRTLLM_SEMKV_PROFIT__MARGIN": "1.5"}
    for key, value in values.items():
        assert f"`{key}`" in text, key
        monkeypatch.setenv(key, value)
    settings = load_connector_settings(environ={})
    assert (settings.mode, settings.lookup_timeout_s, settings.namespace.kv_dtype, settings.discovery.enabled,
            settings.profit.margin) == ("exact_equivalent", 0.004, "bfloat16", True, 1.5)

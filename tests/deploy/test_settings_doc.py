"""docs/consume-settings.md is the settings table of ``semkv-ledger consume``, generated from the model
(``python -m consumer.settings``): it must equal what the code generates today, name every setting and
every flag, and the environment variables it names must really set those settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from consumer.settings import ConsumerSettings, SourceSettings, _consume_flags, load_settings, settings_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "consume-settings.md"


def test_settings_doc_is_generated_from_the_model() -> None:
    assert DOC.read_text() == settings_markdown(), "regenerate: python -m consumer.settings > docs/consume-settings.md"


def test_settings_doc_names_every_setting_and_flag() -> None:
    text = DOC.read_text()
    for name in [*ConsumerSettings.model_fields, *SourceSettings.model_fields]:
        assert f"| `{name}` |" in text
    for name in ConsumerSettings.model_fields:
        assert f"`SEMKV_{name.upper()}`" in text
    for flag in _consume_flags().values():
        if flag != "--help":
            assert f"`{flag}`" in text, flag


def test_the_environment_variables_named_set_the_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    values = {"SEMKV_DB": "postgresql://semkv@ledger:5432/semkv", "SEMKV_BATCH_MAX_EVENTS": "77",
              "SEMKV_IDLE_REPLAY_S": "9.5", "SEMKV_METRICS_PORT": "9401", "SEMKV_LOG_LEVEL": "WARNING",
              "SEMKV_CURVE_SECRET_KEY": str(tmp_path / "c.key_secret"),
              "SEMKV_SOURCES": json.dumps([{"engine_id": "trt-9", "endpoint": "tcp://10.1.2.3:5557",
                                             "curve_publisher_key": str(tmp_path / "trt-9.key")}])}
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    settings = load_settings()
    assert (settings.db, settings.batch_max_events, settings.idle_replay_s, settings.metrics_port, settings.log_level) == (
        values["SEMKV_DB"], 77, 9.5, 9401, "warning")
    assert settings.curve_secret_key == tmp_path / "c.key_secret"
    assert [(s.engine_id, s.curve_publisher_key) for s in settings.sources] == [("trt-9", tmp_path / "trt-9.key")]

"""``semkv-ledger --help`` and every command's ``--help`` read as documentation: each summary is one
sentence on one line (rich keeps a docstring's line breaks, so a wrapped first paragraph is shown
cut mid-sentence in the command list), and flags show no value placeholder they do not take."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import typer

from ledger import commands  # noqa: F401  (registers the ledger's commands)
from ledger.cli import _register_plugins, app


def _commands() -> dict[str, object]:
    _register_plugins()
    return typer.main.get_command(app).commands  # type: ignore[attr-defined]


COMMANDS = sorted(_commands())


def help_text(*args: str) -> str:
    env = {**os.environ, "COLUMNS": "120", "NO_COLOR": "1"}
    result = subprocess.run([sys.executable, "-m", "ledger", *args, "--help"], capture_output=True, text=True,
                            timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_every_command_summary_is_one_line() -> None:
    for name, command in _commands().items():
        summary = (command.help or "").strip().split("\n\n")[0]  # type: ignore[attr-defined]
        assert summary and "\n" not in summary, f"{name}: first paragraph of its help spans lines: {summary!r}"


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_shows_no_placeholder_on_flags(command: str | None) -> None:
    text = help_text(*([command] if command else []))
    assert "<bool>" not in text, text

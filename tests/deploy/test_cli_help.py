"""``semkv-ledger --help`` and every command's ``--help`` read as documentation: each summary is one
sentence on one line (rich keeps a docstring's line breaks, so a wrapped first paragraph is shown
cut mid-sentence in the command list), flags show no value placeholder they do not take, help piped
off a terminal cuts no option name with ``…``, and every command's help states its exit codes."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import typer

from ledger import commands  # noqa: F401  (registers the ledger's commands)
from ledger.cli import _register_plugins, app


def _commands() -> dict[str, object]:
    _register_plugins()
    return typer.main.get_command(app).commands  # type: ignore[attr-defined]


_COMMAND_OBJECTS = _commands()
COMMANDS = sorted(_COMMAND_OBJECTS)


def help_text(*args: str) -> str:
    env = {**os.environ, "COLUMNS": "120", "NO_COLOR": "1"}
    result = subprocess.run([sys.executable, "-m", "ledger", *args, "--help"], capture_output=True, text=True,
                            timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_shows_no_rst_markup(command: str | None) -> None:
    # docstrings are reStructuredText for the API docs; a terminal shows ``x`` and :func:`y` as is
    text = help_text(*([command] if command else []))
    assert "``" not in text and ":func:`" not in text and ":class:`" not in text, text


def test_every_command_summary_is_one_line() -> None:
    for name, command in _commands().items():
        summary = (command.help or "").strip().split("\n\n")[0]  # type: ignore[attr-defined]
        assert summary and "\n" not in summary, f"{name}: first paragraph of its help spans lines: {summary!r}"


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_shows_no_placeholder_on_flags(command: str | None) -> None:
    text = help_text(*([command] if command else []))
    assert "<bool>" not in text, text


def _ellipses_in_its_own_text(command: str | None) -> int:
    """How many ``…`` the help page's own texts hold (e.g. ``inspect``'s ``0x…``): rendered, they are
    not a cut."""
    by_name = _COMMAND_OBJECTS
    if command is None:
        texts = [app.info.help or "", *(c.get_short_help_str(limit=10_000)  # type: ignore[attr-defined]
                                        for c in by_name.values())]
    else:
        cmd = by_name[command]
        texts = [cmd.help or "", *(getattr(p, "help", None) or "" for p in cmd.params)]  # type: ignore[attr-defined]
    return sum(text.count("…") for text in texts)


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_piped_help_cuts_nothing(command: str | None) -> None:
    """``semkv-ledger CMD --help | less`` (or a CI log): off a terminal with COLUMNS unset rich renders 80
    columns and cut the longest option names with ``…``; the help must be wide enough to show them."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "TERMINAL_WIDTH")}
    result = subprocess.run([sys.executable, "-m", "ledger", *([command] if command else []), "--help"],
                            capture_output=True, text=True, timeout=60, env={**env, "NO_COLOR": "1"},
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    cut = "\n".join(line for line in result.stdout.splitlines() if "…" in line)
    assert result.stdout.count("…") == _ellipses_in_its_own_text(command), cut


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_help_states_its_exit_codes(command: str) -> None:
    text = " ".join(help_text(command).split())
    assert re.search(r"Exit (codes: )?0\b.*\b2\b", text), f"{command} --help states no exit codes:\n{text}"


def test_version_is_the_installed_distributions() -> None:
    from importlib.metadata import version

    result = subprocess.run([sys.executable, "-m", "ledger", "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout == f"semkv-ledger {version('semkv-ledger')}\n", result.stderr

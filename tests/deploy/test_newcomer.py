"""The newcomer's path, checked cheaply: in a fresh ``git clone`` of this repository, the README's
first two commands are ``make demo`` and ``make test``, both are targets of the clone's Makefile,
and ``make -n demo`` / ``make -n test`` resolve (a dry run: print the recipe, run nothing) to creating
``.venv``, installing ``.[dev]`` and running ``semkv-ledger demo`` / ``pytest``.

What this does NOT do by default: create the virtual environment, install (PyTorch alone takes
minutes) or run the commands. ``SEMKV_NEWCOMER_FULL=1`` adds the real thing for ``make demo`` in the
clone (fresh ``.venv``; needs the package index). ``git clone`` copies COMMITTED files only: files not
yet committed in this checkout are absent from the clone, as they would be for a newcomer.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("git") is None or shutil.which("make") is None, reason="needs git and make"),
]


def _readme_commands(readme: Path) -> list[str]:
    block = re.search(r"```bash\n(.*?)```", readme.read_text(), re.DOTALL)
    assert block is not None, "README has no ```bash block"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()][:2]


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not (REPO / ".git").exists():
        pytest.skip(f"{REPO} is not a git checkout")
    target = tmp_path_factory.mktemp("newcomer") / "semkv-ledger"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(target)], check=True, timeout=120,
                   capture_output=True)
    return target


def test_readme_starts_with_the_two_commands(clone: Path) -> None:
    assert _readme_commands(clone / "README.md") == ["make demo", "make test"]


@pytest.mark.parametrize(("target", "runs"), [("demo", "/bin/semkv-ledger demo"), ("test", "-m pytest")])
def test_make_targets_resolve_in_a_fresh_clone(clone: Path, target: str, runs: str) -> None:
    assert not (clone / ".venv").exists()
    result = subprocess.run(["make", "-n", target], cwd=clone, capture_output=True, text=True, timeout=60,
                            env={k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "VIRTUAL_ENV"))})
    assert result.returncode == 0, result.stderr
    recipe = result.stdout
    assert "-m venv .venv" in recipe and "pip install -e '.[dev]'" in recipe, recipe  # first use installs
    assert "echo \"installing semkv-ledger" in recipe, recipe  # and says so before minutes of pip
    assert runs in recipe.splitlines()[-1], recipe


@pytest.mark.skipif(os.environ.get("SEMKV_NEWCOMER_FULL") != "1", reason="set SEMKV_NEWCOMER_FULL=1 to install "
                    "into a fresh .venv and run `make demo` in the clone (minutes; needs the package index)")
def test_make_demo_succeeds_in_a_fresh_clone(clone: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "VIRTUAL_ENV", "SEMKV_NEWCOMER"))}
    result = subprocess.run(["make", "demo"], cwd=clone, capture_output=True, text=True, timeout=3600, env=env)
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]

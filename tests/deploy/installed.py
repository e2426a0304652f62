"""semkv-ledger installed like any Python package, for tests that run the installed CLI.

:func:`install_wheel` copies the checkout (working tree, uncommitted files included; no ``.git``,
``.venv`` or build output, so no stale ``build/`` can leak into the wheel) to a temporary folder,
creates a fresh venv there (no system site-packages), builds the wheel with that venv's pip exactly
as ``pip install 'semkv-ledger[postgres] @ file:///path/to/clone'`` does (docs/deploy.md), and
installs ``WHEEL[postgres]``; dependencies come from pip's cache or the package index. Everything
then runs from a working directory outside the clone, with no ``PYTHONPATH``.

Reuse the module-scoped fixture with ``from tests.deploy.installed import installed_wheel  # noqa: F401``.
A missing package index skips outside CI and fails in CI (env ``CI`` set).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCUMENTED_EXIT_CODES = (0, 1, 2)  # ledger/cli.py: success, a check failed, usage/config/database/... error
_NOT_COPIED = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                     ".hypothesis", "*.db", "*.db-*", "*.sqlite*", "demo-*")
_NO_INDEX = ("NewConnectionError", "Failed to establish a new connection", "Temporary failure in name resolution",
             "No matching distribution found", "Could not find a version that satisfies", "ProxyError")


@dataclasses.dataclass(frozen=True)
class InstalledWheel:
    wheel: Path
    venv: Path
    workdir: Path
    """An empty folder outside the clone: the working directory of every command."""

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def env(self) -> dict[str, str]:
        """This environment without anything that could reach the checkout or steer the commands."""
        return {k: v for k, v in os.environ.items()
                if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV") and not k.startswith("SEMKV_")}

    def cli(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        """Run the installed ``semkv-ledger``; assert no traceback and a documented exit code."""
        result = subprocess.run([str(self.venv / "bin" / "semkv-ledger"), *args], cwd=self.workdir, env=self.env(),
                                capture_output=True, text=True, timeout=timeout)
        assert_clean_exit(result)
        return result

    def popen(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen([str(self.venv / "bin" / "semkv-ledger"), *args], cwd=self.workdir, env=self.env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def python_prints(self, code: str) -> str:
        result = subprocess.run([str(self.python), "-c", code], cwd=self.workdir, env=self.env(),
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout.strip()


def assert_clean_exit(result: subprocess.CompletedProcess[str]) -> None:
    shown = f"{result.args}: rc={result.returncode}\nstdout: {result.stdout[-2000:]}\nstderr: {result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr, shown
    assert result.returncode in DOCUMENTED_EXIT_CODES, shown


def missing(reason: str) -> None:
    """A piece the test needs is absent: fail in CI, skip elsewhere."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (required in CI)")
    pytest.skip(reason)


def _pip(venv: Path, *args: str, env: dict[str, str]) -> None:
    result = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", *args], env=env, capture_output=True,
                            text=True, timeout=900)
    if result.returncode != 0:
        output = result.stdout[-3000:] + result.stderr[-3000:]
        if any(marker in output for marker in _NO_INDEX):
            missing(f"pip {args[0]} could not reach the package index: {output.strip().splitlines()[-1]}")
        pytest.fail(f"pip {' '.join(args)} failed (rc={result.returncode}):\n{output}")


def install_wheel(root: Path) -> InstalledWheel:
    """Build the wheel from a copy of the checkout and install it into a fresh venv, all under ``root``
    (which must lie outside the clone)."""
    assert not root.resolve().is_relative_to(REPO), f"{root} is inside the clone"
    source, dist, venv, workdir = root / "source", root / "dist", root / "venv", root / "work"
    shutil.copytree(REPO, source, ignore=_NOT_COPIED)
    workdir.mkdir()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300)
    installed = InstalledWheel(wheel=dist, venv=venv, workdir=workdir)
    env = installed.env()
    _pip(venv, "wheel", "--no-deps", "--wheel-dir", str(dist), str(source), env=env)
    (wheel,) = dist.glob("semkv_ledger-*.whl")
    _pip(venv, "install", f"{wheel}[postgres]", env=env)
    return dataclasses.replace(installed, wheel=wheel)


@pytest.fixture(scope="module")
def installed_wheel(tmp_path_factory: pytest.TempPathFactory) -> InstalledWheel:
    return install_wheel(tmp_path_factory.mktemp("wheel-install"))

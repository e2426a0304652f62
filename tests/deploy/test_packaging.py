"""pyproject.toml packs what the commands need, and the migrations are found however semkv-ledger is run.

* the explicit ``packages`` list (``packages.find`` cannot see ``ledger.migrations``, mapped onto the
  repository's ``migrations/``) equals the packages on disk, so a new subpackage cannot be forgotten;
* every file inside a package that is neither Python nor Markdown is package data;
* the editable install (``make install``) imports ``ledger.migrations`` from the checkout, a checkout
  on ``PYTHONPATH`` without any install finds its ``migrations/``, and ``alembic`` from the repository
  root (alembic.ini) still works;
* an installation without its migrations fails with one line and exit 2 (not a traceback, and not
  advice to use ``pip install -e``).

The wheel itself is built and run in ``test_wheel_install.py``.
"""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
TOP_LEVEL = ("ledger", "consumer", "connector")


def _package_dirs() -> dict[str, Path]:
    """Each package named in pyproject.toml and the folder setuptools takes it from."""
    mapped = SETUPTOOLS.get("package-dir", {})

    def folder(name: str) -> Path:
        owner = max((m for m in mapped if name == m or name.startswith(m + ".")), key=len, default=None)
        if owner is None:
            return REPO.joinpath(*name.split("."))
        return REPO / mapped[owner] / Path(*name[len(owner):].split(".")[1:])

    return {name: folder(name) for name in SETUPTOOLS["packages"]}


def _packages_on_disk() -> dict[str, Path]:
    roots = {name: REPO / name for name in TOP_LEVEL} | {k: REPO / v for k, v in SETUPTOOLS["package-dir"].items()}
    found = {}
    for name, root in roots.items():
        for init in root.rglob("__init__.py"):
            found[".".join((name, *init.parent.relative_to(root).parts))] = init.parent
    return found


def test_the_explicit_package_list_is_every_package_on_disk() -> None:
    assert len(SETUPTOOLS["packages"]) == len(set(SETUPTOOLS["packages"]))
    assert _package_dirs() == _packages_on_disk()
    assert _package_dirs()["ledger.migrations"] == REPO / "migrations"


def test_every_data_file_in_a_package_is_package_data() -> None:
    patterns = SETUPTOOLS.get("package-data", {})
    packed: set[Path] = set()
    for name, folder in _package_dirs().items():
        for pattern in patterns.get("*", []) + patterns.get(name, []):
            packed |= {p for p in folder.glob(pattern) if p.is_file()}
    data = {p for folder in _package_dirs().values() for p in folder.rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc", ".md") and "__pycache__" not in p.parts}
    assert data, "expected the demo recording and script.py.mako at least"
    assert data <= packed, sorted(str(p.relative_to(REPO)) for p in data - packed)


def _run(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_editable_install_imports_ledger_migrations_from_the_checkout(tmp_path: Path) -> None:
    result = _run(sys.executable, "-c", "import ledger.migrations, ledger.migrate as m; "
                  "print(ledger.migrations.__path__[0]); print(m.migrations_dir())", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(REPO / "migrations")] * 2


def _bare_env(pythonpath: Path) -> dict[str, str]:
    """For ``python -S``: no site (so no editable-install finder), the dependencies from site-packages."""
    return {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{pythonpath}:{sysconfig.get_paths()['purelib']}"}


def test_a_checkout_on_pythonpath_finds_its_migrations(tmp_path: Path) -> None:
    """The vLLM engine processes of tests/vllm_cpu import the checkout through PYTHONPATH, uninstalled."""
    db = tmp_path / "ledger.db"
    result = _run(sys.executable, "-S", "-m", "ledger", "migrate", "--db", f"sqlite:///{db}", cwd=tmp_path,
                  env=_bare_env(REPO))
    assert result.returncode == 0, result.stderr
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchone() is not None


def test_an_install_without_its_migrations_fails_in_one_line(tmp_path: Path) -> None:
    site = tmp_path / "site"
    for name in TOP_LEVEL:  # the packages as a broken install would hold them: no ledger/migrations
        shutil.copytree(REPO / name, site / name, ignore=shutil.ignore_patterns("__pycache__"))
    result = _run(sys.executable, "-S", "-m", "ledger", "migrate", "--db", f"sqlite:///{tmp_path / 'l.db'}",
                  cwd=tmp_path, env=_bare_env(site))
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "ledger.migrations" in lines[0] and "docs/deploy.md" in lines[0] and "-e" not in lines[0].split(), lines


def test_alembic_from_the_repository_root_still_works(tmp_path: Path) -> None:
    alembic = Path(sys.executable).parent / "alembic"
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    upgraded = _run(str(alembic), "-x", f"db={db}", "upgrade", "head", cwd=REPO)
    assert upgraded.returncode == 0, upgraded.stderr
    heads = _run(str(alembic), "heads", cwd=REPO)
    revisions = sorted(p.name.split("_", 1)[0] for p in (REPO / "migrations" / "versions").glob("0*.py"))
    assert heads.returncode == 0 and heads.stdout.split()[0] == revisions[-1], heads.stdout + heads.stderr

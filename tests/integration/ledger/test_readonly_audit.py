"""Audits of a SQLite ledger that cannot be written (issue 23): ``stats``, ``inspect`` and ``replay``
open it read-only, say so in ONE ``note:`` line on stderr, and print exactly what they print for a
writable copy; ``migrate`` refuses it in one ``error:`` line (exit 2).

CI runs as root, where ``chmod a-w`` proves nothing: the ledger is put on a read-only bind mount in
a private mount namespace (``unshare --mount``; for a user other than root inside a user namespace),
where every write fails with EROFS, root's too. Those tests fail, not skip, when CI is set and no
such mount can be made. Another runs the CLI as user ``nobody`` on a ledger it may read but not
write, in a directory it may write: there a careless read-only open leaves ``-wal``/``-shm`` files
behind that the ledger's owner then cannot write. Real CLI processes, real SQLite files.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

from ledger import events as ev
from ledger.types import DeadLetterReason
from tools.harness.builders import batch, created, removed, stored, updated

CLI = Path(sys.executable).with_name("semkv-ledger")
CALL_TIMEOUT_S = 120  # a CLI start imports SQLAlchemy and pydantic: seconds on a loaded 2-core VM
MOUNT_THEN_RUN = 'mount --bind "$1" "$2" && mount -o remount,bind,ro "$2" && shift 2 && exec "$@"'
AUDITS = [("stats",), ("stats", "--json"), ("inspect", "engine", "engine-b"), ("inspect", "block", "7", "--json"),
          ("inspect", "donor", "d1"), ("replay", "--json")]
REPLAY_TIMINGS = ("rebuild_seconds", "events_per_second")


def fill_ledger(db: str) -> None:
    """Two engines' events (stores, removals, an update, an ``event_id`` jump that quarantines),
    a dead letter, and a donor saved and leased: every projection has rows."""
    from ledger.client import LedgerClient
    from ledger.migrate import upgrade
    from ledger.writer import LedgerWriter

    upgrade(db)

    async def feed() -> None:
        writer = await LedgerWriter.open(db)
        try:
            await writer.append([batch(0, created(), stored(*range(1, 120), event_id=1)),
                                 batch(0, created(), stored(*range(100, 260), event_id=1), engine_id="engine-b")])
            await writer.append([batch(1, removed(5, 6, event_id=2), updated(7, cache_level=(0, 1), event_id=3))])
            await writer.append([batch(1, stored(400, event_id=9), engine_id="engine-b")])  # jump: quarantine
            await writer.append([ev.DeadLetter(source_id="engine-a@tcp://127.0.0.1:5557", engine_id="engine-a",
                                               reason=DeadLetterReason.MALFORMED_MSGPACK, detail="test", raw=b"\xc1")])
        finally:
            await writer.close()

    asyncio.run(feed())
    client = LedgerClient(db)
    try:
        client.register_donor(ev.DonorRegistered(
            donor_id="d1", namespace="ns", engine_id="engine-a", generation=client.engine("engine-a").generation,
            content_keys=[b"k1", b"k2"], block_hashes=[1, 2], num_tokens=8, tokens_per_block=4))
        client.mark_donor_saved("d1", store_ref="file:d1", checksum="abc", size_bytes=100)
        client.take_lease("d1", request_id="r1", holder="engine-a", namespace="ns", num_blocks=2, ttl_s=3600)
    finally:
        client.close()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A filled ledger, closed (no ``-wal``/``-shm`` left: its last connection checkpointed them away)."""
    path = tmp_path_factory.mktemp("built") / "ledger.db"
    fill_ledger(str(path))
    assert sorted(p.name for p in path.parent.iterdir()) == ["ledger.db"]
    return path


@pytest.fixture
def ledger_dir(built: Path, tmp_path: Path) -> Path:
    """A directory holding a fresh copy of the built ledger (tests may change it)."""
    where = tmp_path / "ledger-dir"
    where.mkdir()
    shutil.copy2(built, where / "ledger.db")
    return where


def cli(*args: str, prefix: tuple[str, ...] = (), cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "COLUMNS": "200", "HOME": "/tmp"}
    return subprocess.run([*prefix, str(CLI), *args], capture_output=True, text=True, timeout=CALL_TIMEOUT_S,
                          env=env, cwd=cwd or "/", stdin=subprocess.DEVNULL)


@cache
def namespace_prefix() -> tuple[str, ...]:
    """``unshare`` arguments giving the command a private mount namespace in which it may mount."""
    base = ("unshare", "--mount", "--propagation", "private")
    return base if os.geteuid() == 0 else ("unshare", "--user", "--map-root-user", *base[1:])


@pytest.fixture(scope="module")
def read_only_mounts(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Prove that a read-only bind mount can be made here and that it stops writes (root's too);
    fail in CI when it cannot, skip elsewhere."""
    src, mnt = tmp_path_factory.mktemp("probe-src"), tmp_path_factory.mktemp("probe-mnt")
    why = None
    if shutil.which("unshare") is None:
        why = "no unshare(1)"
    else:
        try_write = 'touch "$0/probe" 2>/dev/null && echo writable || echo read-only'
        probe = subprocess.run([*namespace_prefix(), "sh", "-c", MOUNT_THEN_RUN, "sh", str(src), str(mnt),
                                "sh", "-c", try_write, str(mnt)], capture_output=True, text=True, timeout=CALL_TIMEOUT_S)
        if probe.stdout.strip() != "read-only":
            why = f"cannot make a read-only bind mount: {(probe.stdout + probe.stderr).strip()[-300:]}"
    if why is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the read-only audit tests: {why}")
        pytest.skip(why)


def on_read_only_mount(directory: Path, mount_point: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the CLI with ``directory`` bind-mounted read-only at ``mount_point`` (in a private mount
    namespace: nothing outside the command sees the mount)."""
    return cli(*args, prefix=(*namespace_prefix(), "sh", "-c", MOUNT_THEN_RUN, "sh", str(directory), str(mount_point)))


def comparable(args: tuple[str, ...], stdout: str) -> object:
    """What must be equal between two runs: the whole stdout, less replay's timings."""
    if args[0] != "replay":
        return stdout
    report = json.loads(stdout)
    return {k: v for k, v in report.items() if k not in REPLAY_TIMINGS}


def assert_same_audits(read_only_runs: dict, writable_runs: dict, note_start: str) -> None:
    for args, ro in read_only_runs.items():
        rw = writable_runs[args]
        assert rw.stderr == "" and rw.returncode == 0, (args, rw.stderr)
        assert ro.returncode == rw.returncode, (args, ro.stderr)
        [note] = ro.stderr.splitlines()  # ONE line, and nothing else on stderr
        assert note.startswith(note_start), (args, note)
        assert comparable(args, ro.stdout) == comparable(args, rw.stdout), args


def test_audits_on_a_read_only_mount_equal_those_of_a_writable_copy(read_only_mounts, ledger_dir: Path,
                                                                     tmp_path: Path, built: Path) -> None:
    mount_point = tmp_path / "mnt"
    mount_point.mkdir()
    ro = {args: on_read_only_mount(ledger_dir, mount_point, *args, "--db", str(mount_point / "ledger.db"))
          for args in AUDITS}
    rw = {args: cli(*args, "--db", str(built)) for args in AUDITS}
    note = f"note: ledger {mount_point / 'ledger.db'} opened read-only (cannot write: read-only file system)"
    assert_same_audits(ro, rw, note)
    assert all("snapshot" in run.stderr for run in ro.values())  # no -shm: read as a checked snapshot
    replayed = json.loads(ro[("replay", "--json")].stdout)
    assert replayed["equal"] is True and replayed["row_counts"]["leases"] == 1 and replayed["row_counts"]["donors"] == 1
    assert sorted(p.name for p in ledger_dir.iterdir()) == ["ledger.db"]


@pytest.fixture
def ledger_being_written(ledger_dir: Path) -> Iterator[Path]:
    """The ledger with a connection holding it open and transactions in its ``-wal`` (a running
    consumer's ledger seen through a read-only mount)."""
    from ledger.writer import LedgerWriter

    path = ledger_dir / "ledger.db"
    holder = sqlite3.connect(path)
    try:
        holder.execute("SELECT count(*) FROM log").fetchone()

        async def feed() -> None:
            writer = await LedgerWriter.open(str(path))
            try:
                await writer.append([batch(2, stored(500, 501, event_id=4), removed(1, event_id=5))])
            finally:
                await writer.close()

        asyncio.run(feed())
        assert Path(f"{path}-shm").exists() and Path(f"{path}-wal").stat().st_size > 0
        yield path
    finally:
        holder.close()


def test_audits_of_a_ledger_being_written_read_its_wal_through_a_read_only_mount(
        read_only_mounts, ledger_being_written: Path, tmp_path: Path) -> None:
    mount_point = tmp_path / "mnt"
    mount_point.mkdir()
    audits = [("stats", "--json"), ("inspect", "block", "500", "--json"), ("replay", "--json")]
    ro = {args: on_read_only_mount(ledger_being_written.parent, mount_point, *args, "--db",
                                   str(mount_point / "ledger.db")) for args in audits}
    rw = {args: cli(*args, "--db", str(ledger_being_written)) for args in audits}
    note = f"note: ledger {mount_point / 'ledger.db'} opened read-only (cannot write: read-only file system)"
    assert_same_audits(ro, rw, note)
    assert not any("snapshot" in run.stderr for run in ro.values())  # SQLite's own protocol, with the -shm
    assert json.loads(ro[("inspect", "block", "500", "--json")].stdout)["rows"]  # a transaction only in the WAL


def test_a_wal_without_its_shm_on_a_read_only_mount_is_refused_in_one_line(
        read_only_mounts, ledger_being_written: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy-without-shm"
    copy.mkdir()
    for name in ("ledger.db", "ledger.db-wal"):
        shutil.copy2(ledger_being_written.parent / name, copy / name)
    mount_point = tmp_path / "mnt"
    mount_point.mkdir()
    result = on_read_only_mount(copy, mount_point, "stats", "--db", str(mount_point / "ledger.db"))
    assert result.returncode == 2 and result.stdout == "", result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith(f"error: cannot read the ledger {mount_point / 'ledger.db'} read-only (read-only file "
                           "system): ledger.db-wal holds transactions and there is no ledger.db-shm"), line


def test_migrate_on_a_read_only_mount_is_one_line_and_exit_2(read_only_mounts, ledger_dir: Path,
                                                             tmp_path: Path) -> None:
    mount_point = tmp_path / "mnt"
    mount_point.mkdir()
    before = (ledger_dir / "ledger.db").read_bytes()
    result = on_read_only_mount(ledger_dir, mount_point, "migrate", "--db", str(mount_point / "ledger.db"))
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr.splitlines() == [f"error: cannot migrate the ledger {mount_point / 'ledger.db'}: it cannot "
                                          "be written here (read-only file system)"]
    assert (ledger_dir / "ledger.db").read_bytes() == before


@pytest.mark.parametrize(("command", "line"), [
    ("index", "cannot index the ledger {db}: it cannot be written here (read-only file system); `inspect block` "
              "reads it read-only and searches the log past the index"),
    ("snapshot", "cannot take a snapshot of the ledger {db}: it cannot be written here (read-only file system); "
                 "`replay --until SEQ` reads it read-only (folding from the start)"),
    ("serve", "cannot serve advice from the ledger {db}: it cannot be written here (read-only file system); serve "
              "follows the live ledger its consumer writes: run it where that ledger can be written")])
def test_writing_commands_on_a_read_only_mount_are_one_line_and_exit_2(read_only_mounts, ledger_dir: Path,
                                                                      tmp_path: Path, command: str, line: str) -> None:
    # the block index and snapshots are written into the ledger: say so, not the driver's "attempt to
    # write a readonly database" / "unable to open database file"
    mount_point = tmp_path / "mnt"
    mount_point.mkdir()
    result = on_read_only_mount(ledger_dir, mount_point, command, "--db", str(mount_point / "ledger.db"))
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr.splitlines() == ["error: " + line.format(db=mount_point / "ledger.db")]


SNAPSHOT_READER = """
import sys
from sqlalchemy import text
from ledger.db import audit_engine
try:
    with audit_engine(sys.argv[1]) as (engine, read_only):
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT count(*) FROM log")).scalar_one()
        print("read", rows, read_only.snapshot, flush=True)
        sys.stdin.readline()  # the test writes the ledger through its writable path meanwhile
except Exception as exc:
    print(type(exc).__name__, exc, flush=True)
else:
    print("unchanged", flush=True)
"""


def test_a_snapshot_written_while_it_is_read_is_refused(read_only_mounts, ledger_dir: Path, tmp_path: Path) -> None:
    """A ledger read without locks (immutable: no ``-shm``) that a writer changes meanwhile: the
    reading ends with an error instead of figures that may mix two states."""
    from ledger.writer import LedgerWriter

    mount_point = tmp_path / "mnt"
    mount_point.mkdir()
    reader = subprocess.Popen(
        [*namespace_prefix(), "sh", "-c", MOUNT_THEN_RUN, "sh", str(ledger_dir), str(mount_point),
         sys.executable, "-c", SNAPSHOT_READER, str(mount_point / "ledger.db")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parents[3])
    try:
        first = reader.stdout.readline().split()
        assert len(first) == 3 and first[0] == "read" and first[2] == "True", first + [reader.stderr.read()]

        async def feed() -> None:
            writer = await LedgerWriter.open(str(ledger_dir / "ledger.db"))
            try:
                await writer.append([batch(2, stored(600, event_id=4))])
            finally:
                await writer.close()  # the last connection: checkpoints into the file

        asyncio.run(feed())
        out, err = reader.communicate("\n", timeout=CALL_TIMEOUT_S)
    finally:
        reader.kill()
    assert out.startswith(f"LedgerError the ledger {mount_point / 'ledger.db'} changed while it was read as an "
                          "immutable snapshot"), out + err


@cache
def nobody_prefix() -> tuple[str, ...] | str:
    """``setpriv`` arguments running a command as user nobody, or why that cannot be done here."""
    if os.geteuid() != 0:
        return "not root: cannot run the CLI as another user"
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return "running as root without setpriv"
    prefix = (setpriv, "--reuid=65534", "--regid=65534", "--clear-groups")
    probe = cli("--help", prefix=prefix)
    if probe.returncode != 0:  # e.g. a checkout under a mode-0700 directory (CI's mktemp -d)
        return f"user nobody cannot run {CLI}: {probe.stderr.strip()[-200:]}"
    return prefix


def test_another_users_ledger_is_audited_without_leaving_files_beside_it(built: Path) -> None:
    """``nobody`` may read the ledger and write its directory, not the ledger: the audits work,
    say why, and create no ``-wal``/``-shm`` (which, owned by nobody, would stop the owner's writer)."""
    prefix = nobody_prefix()
    if isinstance(prefix, str):
        pytest.skip(prefix)
    where = Path(tempfile.mkdtemp(prefix="semkv-readonly-audit-"))  # not under tmp_path: nobody must reach it
    try:
        where.chmod(0o1777)  # like /tmp: anyone may create files here
        shutil.copy2(built, where / "ledger.db")
        (where / "ledger.db").chmod(0o644)
        audits = [("stats", "--json"), ("inspect", "engine", "engine-b"), ("replay", "--json")]
        ro = {args: cli(*args, "--db", str(where / "ledger.db"), prefix=prefix, cwd=where) for args in audits}
        rw = {args: cli(*args, "--db", str(built)) for args in audits}
        assert_same_audits(ro, rw, f"note: ledger {where / 'ledger.db'} opened read-only (cannot write: file "
                                   f"{where / 'ledger.db'} is not writable by this user)")
        assert sorted(p.name for p in where.iterdir()) == ["ledger.db"]
    finally:
        shutil.rmtree(where, ignore_errors=True)


def test_an_older_ledger_on_a_read_only_mount_says_to_migrate_a_copy(read_only_mounts, ledger_dir: Path,
                                                                     tmp_path: Path) -> None:
    # `migrate` is refused there, so "run semkv-ledger migrate" would be a dead end
    from ledger.migrate import head_revision
    from tools.harness.builders import downgrade

    downgrade(f"sqlite:///{ledger_dir / 'ledger.db'}", "0003")
    mount_point = tmp_path / "mnt"
    mount_point.mkdir()
    result = on_read_only_mount(ledger_dir, mount_point, "stats", "--db", str(mount_point / "ledger.db"))
    assert result.returncode == 2, result.stderr
    note, error = result.stderr.splitlines()
    assert note.startswith("note: ledger") and error == (
        f"error: ledger schema at {mount_point / 'ledger.db'} is 0003, expected {head_revision()}: it cannot be "
        "migrated here (read-only file system): copy it, with its -wal file if there is one, to a writable "
        "directory, run `semkv-ledger migrate --db COPY` and audit the copy")


def test_a_ledger_this_user_cannot_read_or_reach_is_one_line_that_says_permission(built: Path) -> None:
    prefix = nobody_prefix()
    if isinstance(prefix, str):
        pytest.skip(prefix)
    where = Path(tempfile.mkdtemp(prefix="semkv-unreadable-"))
    try:
        where.chmod(0o755)
        shutil.copy2(built, where / "ledger.db")
        (where / "ledger.db").chmod(0o600)  # as migrate creates it
        unreadable = cli("stats", "--db", str(where / "ledger.db"), prefix=prefix, cwd="/")
        (where / "inner").mkdir(mode=0o700)
        unreachable = cli("stats", "--db", str(where / "inner" / "ledger.db"), prefix=prefix, cwd="/")
    finally:
        shutil.rmtree(where, ignore_errors=True)
    assert unreadable.returncode == 2 and unreadable.stderr.splitlines() == [
        f"error: cannot read the ledger {where / 'ledger.db'}: permission denied for this user (mode 0600, owner "
        "uid 0); ledgers are created mode 0600: run as their owner or give this user read access"]
    assert unreachable.returncode == 2 and unreachable.stderr.splitlines() == [
        f"error: cannot reach the ledger {where / 'inner' / 'ledger.db'}: permission denied on a directory of its "
        "path for this user"]


def test_audits_of_a_writable_ledger_change_no_byte_of_it(built: Path, tmp_path: Path) -> None:
    """``stats``, ``inspect`` and ``replay`` only read (docs/operations.md): on a writable ledger in
    rollback-journal mode they used to switch it to WAL (a write in the file's header), and on a
    0-byte file they wrote a database."""
    import hashlib

    rollback = tmp_path / "rollback.db"
    shutil.copy(built, rollback)
    with sqlite3.connect(rollback) as db:
        assert db.execute("PRAGMA journal_mode=DELETE").fetchone() == ("delete",)
    digest = hashlib.sha256(rollback.read_bytes()).hexdigest()
    for args in AUDITS:
        result = cli(*args, "--db", str(rollback))
        assert result.returncode in (0, 1), result.stderr
    assert hashlib.sha256(rollback.read_bytes()).hexdigest() == digest
    empty = tmp_path / "empty.db"
    empty.touch()
    result = cli("stats", "--db", str(empty))
    assert result.returncode == 2 and empty.stat().st_size == 0, result.stderr


def test_replay_out_a_file_on_a_read_only_mount_names_out(read_only_mounts, ledger_dir: Path, tmp_path: Path) -> None:
    # an earlier --out file replay cannot rewrite was "--out …: not a SQLite file (unable to open database file)"
    assert cli("replay", "--db", str(ledger_dir / "ledger.db"), "--out", str(ledger_dir / "out.db")).returncode == 0
    out_dir = tmp_path / "outs"
    out_dir.mkdir()
    shutil.copy(ledger_dir / "out.db", out_dir / "out.db")
    mount_point = tmp_path / "mnt"
    mount_point.mkdir()
    result = on_read_only_mount(out_dir, mount_point, "replay", "--db", str(ledger_dir / "ledger.db"),
                                "--out", str(mount_point / "out.db"))
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert result.stderr.splitlines() == [f"error: --out {mount_point / 'out.db'}: it cannot be written here "
                                          "(read-only file system); give a file replay can write"]

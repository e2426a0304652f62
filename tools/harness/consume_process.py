"""The consumer daemon as a real process (``semkv-ledger consume``, from this project's venv) and
the small helpers the real-engine groups share around it: free loopback ports, a consumer TOML
for many engines, Prometheus scrapes, and waiting on a condition. Used by
``tools/harness/vllm_fleet.py`` (tests/vllm_cpu, tools/bench_vllm_cpu.py) and
``tools/harness/dynamo_fleet.py`` (tests/dynamo_cpu)."""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path


_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PORT = 10_000
_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port free on every address now, below the kernel's ephemeral range, and not handed
    out before by this process.

    A port the OS picks for a bind to port 0 comes from the ephemeral range, where any process's
    outgoing connection may take it before the engine binds it (seen: a Dynamo worker's ZMQ PUB
    "Address already in use" on a busy machine). Below that range only explicit binds compete.
    Falls back to the OS's choice where the range cannot be read or leaves no room.
    """
    try:
        ephemeral_low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = _LOWEST_PORT
    rng = random.SystemRandom()
    for _ in range(200 if ephemeral_low > _LOWEST_PORT else 0):
        port = rng.randrange(_LOWEST_PORT, ephemeral_low)
        if port not in _handed_out and _bindable(port):
            _handed_out.add(port)
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _bindable(port: int) -> bool:
    """Nothing listens on or holds ``port``, on 0.0.0.0 (engines bind ``tcp://*``) or 127.0.0.1."""
    for host in ("0.0.0.0", "127.0.0.1"):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                return False
    return True


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    """True when something accepts TCP connections on ``host:port``."""
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


class Consumer:
    """`semkv-ledger consume` for one or more engines, from this test venv.

    ``args`` are extra flags (the vLLM group commits every 5 ms; the Dynamo group keeps every
    default). With ``metrics_port`` the daemon serves /metrics and /healthz there."""

    def __init__(self, db: str, log_path: Path, config: Path, *, metrics_port: int | None = None,
                 args: Sequence[str] = ("--batch-max-delay-ms", "5")) -> None:
        self.log_path = log_path
        self.metrics_port = metrics_port
        self._log = open(log_path, "ab")  # noqa: SIM115
        command = [sys.executable, "-m", "ledger", "consume", "--db", db, "--config", str(config), "--migrate", *args]
        if metrics_port is not None:
            command += ["--metrics-port", str(metrics_port)]
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=self._log, cwd=str(log_path.parent))

    def healthy(self) -> bool:
        """/healthz answers ``ok`` (needs ``metrics_port``); False while it is not up yet."""
        assert self.metrics_port is not None, "healthy() needs a metrics_port"
        if self.proc.poll() is not None:
            raise RuntimeError(f"consumer exited ({self.proc.returncode}):\n{self.tail()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/healthz", timeout=5) as response:
                return json.loads(response.read()).get("status") == "ok"
        except (OSError, urllib.error.URLError, ValueError):
            return False

    def tail(self, chars: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def close(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._log.close()
        return self.proc.returncode


def consumer_toml(path: Path, sources: list[tuple[str, str, str | None, bool]], *,
                  block_key_scheme: str | None = None) -> Path:
    """``sources``: (engine_id, endpoint, replay_endpoint or None, bind the SUB socket);
    ``block_key_scheme``: every source's (``consumer.settings.SourceSettings.block_key_scheme``,
    e.g. ``dynamo``), None: not set."""
    parts = []
    for engine_id, endpoint, replay, bind in sources:
        parts.append(f'[[sources]]\nengine_id = "{engine_id}"\nendpoint = "{endpoint}"\n'
                     f'bind = {"true" if bind else "false"}\n'
                     + (f'replay_endpoint = "{replay}"\n' if replay else "")
                     + (f'block_key_scheme = "{block_key_scheme}"\n' if block_key_scheme else ""))
    path.write_text("\n".join(parts))
    return path


def scrape(port: int) -> dict[str, float]:
    """Prometheus text of ``127.0.0.1:port`` as ``{sample name with labels: value}`` (semkv_* only)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for line in text.splitlines():
        if line.startswith("semkv_"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def metric_sum(samples: dict[str, float], prefix: str, **labels: str) -> float:
    """Sum of the samples named ``prefix`` (any labels, or those given)."""
    total = 0.0
    for name, value in samples.items():
        base = name.split("{", 1)[0]
        if base != prefix:
            continue
        if all(f'{k}="{v}"' in name for k, v in labels.items()):
            total += value
    return total


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.2):  # noqa: ANN001, ANN201
    """Poll ``predicate`` until it returns something truthy (returned) or ``timeout_s`` passed.

    Raises:
        AssertionError: naming ``what``, after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")

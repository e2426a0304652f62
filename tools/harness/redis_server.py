"""Redis for the tests and benchmarks of the networked donor store (connector/redis_store.py).

* :data:`SHARED_REDIS_URL`: the server the machines and CI run on 127.0.0.1:6379 (``.ci/run`` starts
  one when none answers); ``SEMKV_TEST_REDIS_URL`` names another. Tests use their own key prefix
  and delete their keys afterwards; they never stop it.
* :class:`RedisServer`: a private ``redis-server`` process on a free port (no persistence), for what
  must not happen to the shared one: being stopped in the middle of a load.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

__all__ = ["SHARED_REDIS_URL", "RedisServer", "delete_prefix", "redis_answers", "redis_server_binary", "scratch_prefix"]

SHARED_REDIS_URL = os.environ.get("SEMKV_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def redis_answers(url: str = SHARED_REDIS_URL, timeout_s: float = 2.0) -> bool:
    """Does a Redis server answer PING at ``url``?"""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def redis_server_binary() -> str | None:
    """The ``redis-server`` executable (``/usr/bin/redis-server`` on these machines), or None."""
    return shutil.which("redis-server") or ("/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else None)


def scratch_prefix() -> str:
    """A key prefix of its own for one test or benchmark run."""
    return f"semkv-test-{uuid.uuid4().hex[:12]}"


def delete_prefix(url: str, prefix: str) -> int:
    """Delete every key under ``prefix:`` (SCAN, never KEYS); returns how many."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        for start in range(0, len(keys), 1000):
            client.delete(*keys[start : start + 1000])
        return len(keys)
    finally:
        client.close()


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class RedisServer:
    """A private ``redis-server`` on ``host`` and a free port, without persistence, until :meth:`stop`.

    Args:
        host: the address it binds (127.0.0.1, or a veth address inside a network namespace test).
        command_prefix: run it under this command (e.g. ``["ip", "netns", "exec", "ns"]``).

    Raises:
        FileNotFoundError: no ``redis-server`` executable.
        RuntimeError: it did not answer within 10 s.
    """

    def __init__(self, host: str = "127.0.0.1", *, port: int | None = None,
                 command_prefix: list[str] | None = None) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise FileNotFoundError("redis-server not found (apt-get install redis-server)")
        self.host, self.port = host, port or _free_port(host)
        self.url = f"redis://{host}:{self.port}/0"
        self.process = subprocess.Popen(
            [*(command_prefix or []), binary, "--bind", host, "--port", str(self.port), "--save", "",
             "--appendonly", "no", "--protected-mode", "no", "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not redis_answers(self.url, 0.2):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server on {host}:{self.port} did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        """Kill it (SIGKILL: connections drop as on a crash) and wait until it is gone; idempotent."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

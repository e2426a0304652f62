"""A Linux network namespace joined to this one by a veth pair, for the cross-host test
(tests/connector/test_cross_host_netns.py): a process run inside it (:attr:`NetworkNamespace.exec_prefix`)
has its own loopback and reaches this namespace only at :attr:`NetworkNamespace.host_address` over the
veth link — not 127.0.0.1 services such as the machine's Redis. Needs root and iproute2 (``ip``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

__all__ = ["NetworkNamespace", "netns_unavailable"]


def netns_unavailable() -> str | None:
    """Why a network namespace cannot be made here (None: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    probe = f"semkv-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class NetworkNamespace:
    """``ip netns add`` + a veth pair: ``host_address`` here, ``ns_address`` inside, a /30 of its own
    in 10.213.0.0/16; everything is deleted on :meth:`close` (deleting the namespace deletes the pair).

    Raises:
        subprocess.CalledProcessError: an ``ip`` command failed (what was made is removed).
    """

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.name, self._veth_host, self._veth_ns = f"semkv-{tag}", f"skh{tag}", f"skn{tag}"
        subnet = int(tag, 16) % 16_000
        base = 4 * subnet
        self.host_address = f"10.213.{base // 256}.{base % 256 + 1}"
        self.ns_address = f"10.213.{base // 256}.{base % 256 + 2}"
        self.exec_prefix = ["ip", "netns", "exec", self.name]
        _ip("netns", "add", self.name)
        try:
            _ip("link", "add", self._veth_host, "type", "veth", "peer", "name", self._veth_ns)
            _ip("link", "set", self._veth_ns, "netns", self.name)
            _ip("addr", "add", f"{self.host_address}/30", "dev", self._veth_host)
            _ip("link", "set", self._veth_host, "up")
            _ip("netns", "exec", self.name, "ip", "addr", "add", f"{self.ns_address}/30", "dev", self._veth_ns)
            _ip("netns", "exec", self.name, "ip", "link", "set", self._veth_ns, "up")
            _ip("netns", "exec", self.name, "ip", "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", self._veth_host], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)

    def __enter__(self) -> NetworkNamespace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

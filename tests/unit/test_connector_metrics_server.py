"""The connector's ``/metrics`` server listens on loopback unless told otherwise (docs/security.md:
"Defaults are loopback only"), and a port past 65535 is not served rather than raised into the engine."""

from __future__ import annotations

import socket
import urllib.request

from connector.metrics import ConnectorMetrics, serve_metrics
from connector.settings import load_connector_settings
from prometheus_client import CollectorRegistry


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening_addresses(port: int) -> set[str]:
    """Local addresses of the IPv4 sockets listening on ``port`` (/proc/net/tcp, state 0A)."""
    found = set()
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


def test_the_default_host_is_loopback_and_serves() -> None:
    assert load_connector_settings({}, environ={}).metrics_host == "127.0.0.1"
    port = _free_port()
    serve_metrics(ConnectorMetrics(CollectorRegistry()), port)
    assert _listening_addresses(port) == {"127.0.0.1"}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        assert b"semkv_lookups_total" in answer.read()


def test_a_port_past_65535_is_logged_not_raised(caplog) -> None:
    serve_metrics(ConnectorMetrics(CollectorRegistry()), 65536)
    assert "past 65535" in caplog.text


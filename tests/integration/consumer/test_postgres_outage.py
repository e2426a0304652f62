"""A fleet consumer on PostgreSQL whose database goes away while it runs: it retries
(``ledger.append_retry``, ``semkv_consumer_db_retries_total``) and commits what it holds once the
database is back, instead of crashing (asyncpg raised ``ConnectionRefusedError`` untranslated from a
new connection, and a database refusing connections answered SQLSTATE 55000: the consumer exited 1,
and under systemd a start while the database is still down exits 2, which is not restarted).

Two outages, real server: the server unreachable (a TCP relay on loopback in front of PostgreSQL,
stopped and started again: refused connections, existing ones cut) and the database refusing new
connections (``ALTER DATABASE … ALLOW_CONNECTIONS false`` and its backends terminated).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from tests.integration.consumer.daemon_support import (
    DaemonRun,
    FaultPublisher,
    PayloadMaker,
    settings_for,
    subscribed,
    wait_until,
)

ENGINE = "trt-0"
FIRST, LATER = 5, 5


class TcpRelay:
    """Loopback TCP relay to ``target`` on a fixed port, which can be stopped (listener closed,
    every relayed connection cut: the server is unreachable) and started again on the same port."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = 0
        self._listener: socket.socket | None = None
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(16)
        self.port, self._listener = listener.getsockname()[1], listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:  # shutdown first: a close alone leaves the blocked accept() listening
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            self._open.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # stopped
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


@contextlib.contextmanager
def relayed(url: str) -> Iterator[tuple[str, TcpRelay]]:
    parsed = make_url(url)
    relay = TcpRelay((parsed.host or "127.0.0.1", parsed.port or 5432))
    relay.start()
    try:
        yield parsed.set(port=relay.port).render_as_string(hide_password=False), relay
    finally:
        relay.stop()


def _admin(url: str, *statements: str) -> None:
    """Run ``statements`` on the server's ``postgres`` database (autocommit)."""
    admin = make_url(url).set(drivername="postgresql", database="postgres").render_as_string(hide_password=False)
    with psycopg.connect(admin, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)


def batches_logged(url: str) -> int:
    engine = create_engine(make_url(url).set(drivername="postgresql+psycopg"))
    try:
        with engine.connect() as conn:
            return conn.execute(text("SELECT count(*) FROM log WHERE kind = 'batch_received'")).scalar_one()
    finally:
        engine.dispose()


@pytest.mark.parametrize("outage", ["server_unreachable", "connections_refused"])
async def test_a_postgresql_outage_while_running_is_retried_and_nothing_is_lost(postgres_db: str, outage: str) -> None:
    database = make_url(postgres_db).database
    make = PayloadMaker()
    with relayed(postgres_db) as (db, relay), FaultPublisher() as pub:
        source = {"engine_id": ENGINE, "endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint}
        async with DaemonRun(settings_for(db, source, writer_process=False, db_retry_max_s=0.2)) as run:
            await subscribed(pub, run)
            for seq in range(FIRST):
                pub.publish(seq, make(seq))
            await wait_until(lambda: run.daemon.stats.batches == FIRST, what=f"{FIRST} batches")
            if outage == "server_unreachable":
                relay.stop()
            else:
                _admin(postgres_db, f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS false',
                       f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{database}'")
            try:
                for seq in range(FIRST, FIRST + LATER):
                    pub.publish(seq, make(seq))
                await wait_until(lambda: run.metric("semkv_consumer_db_retries_total") >= 3, 30, "retries")
                assert not run._task.done()  # type: ignore[union-attr]  # still up, retrying
                assert run.daemon.stats.batches == FIRST
            finally:
                if outage == "server_unreachable":
                    relay.start()
                else:
                    _admin(postgres_db, f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true')
            await wait_until(lambda: run.daemon.stats.batches == FIRST + LATER, 30, "the held batches committed")
            stats = await run.stop()
    assert stats.clean_exit and stats.dead_letters == 0
    assert batches_logged(postgres_db) == FIRST + LATER

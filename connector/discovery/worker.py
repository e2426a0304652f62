"""The child side of :mod:`.isolation`: one discovery provider in its own process.

Started as ``python -m connector.discovery.worker REQUEST_FD REPLY_FD`` by
:class:`~connector.discovery.isolation.ProcessProvider` (never by hand). The first frame is
``("init", spec, settings, db)``; the provider is built as in the parent
(:func:`~connector.discovery.registry.resolve_provider`) and ``("ready", name, generation,
needs_text)`` or ``("failed", why)`` is answered. Then three threads, as the provider contract
expects of a thread provider (index on one thread, lookups on another):

* the main thread only reads frames and routes them — lookups to the lookup thread, everything else
  (index, forget, prepare, flush) to the index thread — so the request pipe drains even while a
  provider call hangs;
* the lookup thread skips a lookup whose deadline (``time.monotonic()``) has passed, else runs
  ``candidates`` and the ledger's freshness check (:func:`~connector.discovery.runner.fresh_only`,
  stopped at the deadline) and answers ``("result", seq, fresh, drops, elapsed_s)`` or
  ``("error", seq, repr, not_prepared)``;
* the index thread applies the rest in order; ``("size", n)`` follows changes, ``("ack", token)``
  a forced flush; idle for 50 ms, it calls ``flush(False)`` itself (so the parent's indexer thread
  need not wake, and hold the GIL, 20 times a second).

End of file on the request pipe (the service closed it, or the parent died) ends the process.
"""

from __future__ import annotations

import gc
import os
import queue
import signal
import sys
import threading
import time
from typing import Any

from connector.discovery.isolation import FrameReader, encode

_IDLE_S = 0.05


def main(argv: list[str]) -> int:
    req_fd, rep_fd = int(argv[1]), int(argv[2])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's shutdown (end of file) stops us, not ^C
    reader, wlock = FrameReader(), threading.Lock()
    parent = os.getppid()

    def reply(obj: Any) -> None:
        data = memoryview(encode(obj))
        with wlock:
            while data:
                data = data[os.write(rep_fd, data):]

    def frames():
        while True:
            try:
                data = os.read(req_fd, 1 << 20)
            except OSError:
                data = b""
            if not data:
                return
            yield from reader.feed(data)

    stream = frames()
    init = next(stream, None)
    if init is None or init[0] != "init":
        return 2
    _, spec, settings_values, db = init
    try:
        from connector.discovery.registry import resolve_provider
        from connector.discovery.settings import DiscoverySettings
        from connector.discovery.types import readonly_tokens
        from connector.discovery.runner import fresh_only
        from ledger.client import LedgerClient

        settings = DiscoverySettings(**settings_values)
        provider = resolve_provider(spec)(settings, db=db)
        ledger = LedgerClient(db, check=False) if db else None
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises ConnectorConfigError
        reply(("failed", repr(exc)))
        return 1
    if hasattr(provider, "on_embed"):
        provider.on_embed = lambda seconds: reply(("embed", seconds))
    limit_default = settings.candidates_per_provider
    lookups: queue.SimpleQueue = queue.SimpleQueue()
    others: queue.SimpleQueue = queue.SimpleQueue()
    reply(("ready", provider.name, provider.generation, bool(provider.needs_text)))

    def lookup(item: tuple) -> None:
        _, seq, query, limit, deadline = item
        if time.monotonic() >= deadline:
            reply(("skipped", seq))
            return
        started = time.perf_counter()
        try:
            q = type(query)(readonly_tokens(query.token_ids), query.text, query.model_id, query.namespace,
                            query.tokens_per_block, query.inline)
            found = provider.candidates(q, limit or limit_default)
            if ledger is None:
                fresh, drops = list(found), {}
            else:
                fresh, drops = fresh_only(found, q.namespace, ledger, lambda: time.monotonic() > deadline)
            reply(("result", seq, fresh, drops, time.perf_counter() - started))
        except Exception as exc:  # noqa: BLE001 - an error miss in the parent
            reply(("error", seq, repr(exc), type(exc).__name__ == "NotPrepared"))

    def other_loop() -> None:
        dirty = False
        while True:
            try:
                item = others.get(timeout=_IDLE_S)
            except queue.Empty:  # idle: publish what was indexed (the thread service's indexer does the same)
                if os.getppid() != parent:  # the parent died while this process was stuck in a lookup
                    os._exit(0)
                if dirty:
                    gc.freeze()  # what was indexed since: out of the collector's reach too (see below)
                    dirty = False
                try:
                    provider.flush(False)
                except Exception as exc:  # noqa: BLE001
                    print(f"semkv discovery worker {spec}: flush failed: {exc!r}", file=sys.stderr)
                continue
            if item is None:
                return
            kind = item[0]
            dirty = True
            try:
                if kind == "index":
                    provider.index(item[1])
                elif kind == "forget":
                    provider.forget(item[1])
                elif kind == "prepare":
                    provider.prepare(item[1])
                elif kind == "flush":
                    provider.flush(item[1])
            except Exception as exc:  # noqa: BLE001 - the index of one donor failed; the provider goes on
                print(f"semkv discovery worker {spec}: {kind} failed: {exc!r}", file=sys.stderr)
            if kind == "flush" and item[1]:
                # this process keeps an index for good: move it out of the collector's reach, so that a
                # full collection does not rescan millions of long-lived objects in the middle of a lookup
                gc.freeze()
                reply(("size", int(getattr(provider, "size", 0))))  # before the ack: flush() returns with it
                reply(("ack", item[2]))
            if kind in ("index", "forget") and others.empty():
                reply(("size", int(getattr(provider, "size", 0))))

    def lookup_loop() -> None:
        while (item := lookups.get()) is not None:
            lookup(item)

    threads = [threading.Thread(target=lookup_loop, name="semkv-worker-lookup", daemon=True),
               threading.Thread(target=other_loop, name="semkv-worker-index", daemon=True)]
    for t in threads:
        t.start()
    for frame in stream:  # this thread only reads, so the request pipe drains even while a lookup hangs
        (lookups if frame[0] == "lookup" else others).put(frame)
    # end of file: the service is closing (or gone). A provider stuck in a call cannot be joined:
    # give the threads a moment, then leave without waiting for it.
    lookups.put(None)
    others.put(None)
    for t in threads:
        t.join(1.0)
    try:
        provider.close()
        if ledger is not None:
            ledger.close()
    except Exception:  # noqa: BLE001
        pass
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv))

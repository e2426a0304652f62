"""Donor saves off the engine's thread: copying a finished donor's blocks out of the KV pool.

The worker (:mod:`connector.worker`) hands a :class:`SaveCopy` to a :class:`SaveCopier` from
TensorRT-LLM's ``get_finished`` while another request of the engine is live, and returns; the
copier's thread copies the blocks into a reusable host buffer and calls back, and only then does the
worker report the request done — so the engine keeps the blocks allocated (``request_finished``
returned True) until the copy has read them, and nothing can overwrite them while the copy is queued
or running. When the engine may block after the iteration (no other request live), or the worker
cannot tell (vLLM, TensorRT-LLM ranks > 0), it runs :func:`copy_blocks` on the engine's thread
instead: it would have to wait for the copy there anyway.

* **On a GPU** (the pool's device is CUDA): the engine's thread records a CUDA event on the engine's
  stream (after the forward that wrote the blocks, in stream order) and returns. The copier's thread
  makes a side stream wait for that event, gathers each layer's blocks there (``index_select`` into
  device scratch) and copies them into a pinned host buffer (``non_blocking``), records an event on
  the side stream and waits for it — in the copier's thread, not the engine's. Then the host bytes
  are final.
* **On the CPU** (the reference harness): the copier's thread runs ``index_select(..., out=)`` into
  the host buffer (torch releases the GIL while it copies).

Host buffers are kept for reuse (:class:`HostBuffers`): pinned when CUDA is available (a pinned
buffer is what lets a device-to-host copy run asynchronously on a side stream; pinning costs a
system call per allocation, so buffers are reused), plain otherwise. A buffer goes back to the pool
once the store has written its bytes (the stores copy what they keep: checked in
``FileDonorStore._publish`` and ``RedisDonorStore.put``).

Only the CPU path runs on these machines (no GPU here); the CUDA path follows PyTorch's documented
stream semantics (``torch.cuda.Stream.wait_event``, ``Tensor.copy_(non_blocking=True)`` into pinned
memory, ``torch.cuda.Event.synchronize``; https://pytorch.org/docs/stable/notes/cuda.html, "CUDA
streams").
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from connector.plan import SaveInstruction

__all__ = ["HostBuffers", "SaveCopier", "SaveCopy", "copy_blocks"]

log = logging.getLogger(__name__)
_BUFFER_ALIGN = 1 << 20
"""Host buffers are allocated in whole MiB so that donors of nearby sizes reuse one."""


@dataclasses.dataclass(slots=True)
class SaveCopy:
    """One donor's copy out of the pool: ``instruction.block_ids[:num_blocks]`` of every layer view.

    Set by the copier: ``layers`` (per layer, the host bytes ``[num_blocks, kv_factor, block_elems]``
    as a uint8 array, views of ``buffer``), ``seconds`` (the copy's own time) or ``error``."""

    request_id: Any
    instruction: SaveInstruction
    views: list[torch.Tensor]
    enqueued: float
    ready: Any = None
    """CUDA: the event recorded on the engine's stream the side stream waits for; None on the CPU."""
    layers: list[np.ndarray] | None = None
    buffer: torch.Tensor | None = None
    seconds: float = 0.0
    error: BaseException | None = None


class HostBuffers:
    """Reusable host buffers (uint8 tensors), pinned when ``pinned``; at most ``keep`` are kept idle.

    Thread-safe: the copier takes, the store writer gives back."""

    def __init__(self, *, pinned: bool, keep: int = 4) -> None:
        self.pinned, self.keep = pinned, keep
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.allocated = 0
        """Buffers allocated so far (a benchmark's check that buffers are reused)."""

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` bytes (the smallest idle one that fits, else a new one)."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:  # by position: ``list.remove`` would compare tensors elementwise
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
            self.allocated += 1
        size = -(-max(nbytes, 1) // _BUFFER_ALIGN) * _BUFFER_ALIGN
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)

    def give(self, buf: torch.Tensor | None) -> None:
        """Return ``buf`` for reuse (the smallest idle buffers are dropped beyond ``keep``)."""
        if buf is None:
            return
        with self._lock:
            self._free.append(buf)
            if len(self._free) > self.keep:
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel()))


def copy_blocks(job: SaveCopy, buffers: HostBuffers, side_stream: Any = None) -> None:
    """Copy ``job``'s blocks of every layer view into a host buffer; sets ``job.layers``/``buffer``.

    ``side_stream``: a ``torch.cuda.Stream`` for a pool on a GPU (the copy is ordered after
    ``job.ready`` and waited for here); None: the copy runs synchronously on the calling thread (a
    CPU pool; or a GPU pool whose stream the caller synchronized: ``engine_thread``, or an engine
    about to idle).

    Raises:
        RuntimeError, IndexError: torch's, e.g. a block id outside the pool.
    """
    started = time.perf_counter()
    views, n = job.views, job.instruction.num_blocks
    first = views[0]
    per_layer = n * first[0].numel() * first.element_size() if n else 0
    buf = buffers.take(per_layer * len(views))
    try:
        dsts = [buf[i * per_layer:(i + 1) * per_layer].view(first.dtype).view(n, *first.shape[1:])
                for i in range(len(views))]
        if side_stream is None:
            ids = torch.tensor(job.instruction.block_ids[:n], dtype=torch.long, device=first.device)
            for view, dst in zip(views, dsts):
                if view.device.type == "cpu":
                    torch.index_select(view, 0, ids, out=dst)
                else:  # a GPU pool copied on the calling thread: gather there, then a blocking copy
                    dst.copy_(view.index_select(0, ids))
        else:
            with torch.cuda.stream(side_stream):
                if job.ready is not None:
                    side_stream.wait_event(job.ready)  # after the forward that wrote the blocks
                ids = torch.tensor(job.instruction.block_ids[:n], dtype=torch.long).to(first.device, non_blocking=True)
                for view, dst in zip(views, dsts):
                    dst.copy_(view.index_select(0, ids), non_blocking=True)  # device scratch -> pinned host
                done = torch.cuda.Event()
                done.record(side_stream)
            done.synchronize()  # this thread waits, not the engine's
    except BaseException:
        buffers.give(buf)
        raise
    job.buffer = buf
    job.layers = [buf[i * per_layer:(i + 1) * per_layer].numpy() for i in range(len(views))]
    job.seconds = time.perf_counter() - started


class SaveCopier:
    """A thread (plus, for a GPU pool, a side stream) that runs :func:`copy_blocks` for queued
    :class:`SaveCopy` jobs in order and calls ``on_done(job)`` after each, copied or failed
    (``job.error``). The worker bounds what it queues (``save_queue_max``)."""

    def __init__(self, on_done: Callable[[SaveCopy], None], *, buffers: HostBuffers,
                 name: str = "semkv-save-copy") -> None:
        self.on_done, self.buffers = on_done, buffers
        self._queue: queue.SimpleQueue[SaveCopy | None] = queue.SimpleQueue()
        self._side: dict[Any, Any] = {}  # CUDA device -> side stream (made on first use, in the thread)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: SaveCopy) -> None:
        """Queue ``job`` (the engine's thread: no copy here)."""
        self._queue.put(job)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop after the queued jobs."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                device = job.views[0].device
                side = None
                if device.type == "cuda":
                    side = self._side.get(device)
                    if side is None:
                        side = self._side[device] = torch.cuda.Stream(device=device)
                copy_blocks(job, self.buffers, side)
            except Exception as exc:  # boundary: a failed copy saves nothing; the worker releases the blocks
                job.error = exc
            try:
                self.on_done(job)
            except Exception:  # boundary: the thread must go on copying
                log.exception("semkv: handling the copied save of request %s failed", job.request_id)

"""Run a function on every rank of a tensor-parallel harness engine: one process per rank,
``torch.distributed`` on the gloo backend over 127.0.0.1 (a free port), as TensorRT-LLM runs one MPI
process per rank.

``run_tensor_parallel(fn, size)`` spawns ``size`` processes; each sets ``RANK`` / ``WORLD_SIZE``
(the connector reads its rank from them, ``connector.layouts.process_rank``), joins the process
group, calls ``fn(TensorParallel(rank, size), *args)`` and sends back what it returns (picklable).
``fn`` must be importable (a module-level function): the processes are spawned, not forked.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["free_port", "run_tensor_parallel"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(fn: Callable[..., Any], rank: int, size: int, port: int, args: tuple, timeout_s: float,
               results: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size))
    import torch
    import torch.distributed as dist

    from connector.harness import TensorParallel

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            # plain pickle: tensors travel as bytes, not as shared memory the exiting rank would take away
            results.put((rank, "ok", pickle.dumps(fn(TensorParallel(rank, size), *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # boundary: the parent reports it with the rank
        results.put((rank, "error", traceback.format_exc()))


def run_tensor_parallel(fn: Callable[..., Any], size: int = 2, args: tuple = (), timeout_s: float = 180.0) -> list[Any]:
    """``fn(tp, *args)`` on ``size`` ranks; their return values by rank.

    Raises:
        RuntimeError: a rank raised (its traceback in the message) or exited without a result.
        TimeoutError: no result from every rank within ``timeout_s`` seconds (the ranks are killed).
    """
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, rank, size, port, args, timeout_s, results),
                         name=f"tp-rank{rank}", daemon=True) for rank in range(size)]
    for proc in procs:
        proc.start()
    got: dict[int, Any] = {}
    try:
        while len(got) < size:
            try:
                rank, status, value = results.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"tensor-parallel ranks {sorted(set(range(size)) - set(got))} gave no result "
                                   f"within {timeout_s} s") from None
            if status == "error":
                raise RuntimeError(f"tensor-parallel rank {rank} failed:\n{value}")
            got[rank] = pickle.loads(value)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [got[rank] for rank in range(size)]

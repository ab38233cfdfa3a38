"""Fork launcher for multi-rank tests and demos on one machine.

``launch(fn, world_size, *args)`` forks ``world_size`` processes, each joins a gloo process group
(the rendezvous is a FileStore in a fresh temporary directory, so concurrent tests never collide),
runs ``fn(rank, world_size, *args, **kwargs)`` and sends its return value back. A rank that raises,
dies, or is still running when ``timeout_s`` passes makes ``launch`` kill every rank and raise
:class:`RankFailure` naming the rank(s) and carrying their tracebacks.

NOTES: never initialise CUDA in the parent before forking (a forked child cannot use it).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

from ..errors import MoEEPError

__all__ = ["launch", "RankFailure"]


class RankFailure(MoEEPError, RuntimeError):
    """One or more ranks of a :func:`launch` raised, died or timed out."""

    def __init__(self, message: str, failed_ranks: list[int]):
        super().__init__(message)
        self.failed_ranks = failed_ranks


def _child(conn, store_path: str, rank: int, world_size: int, backend: str, pg_timeout_s: float,
           fn: Callable, args: tuple, kwargs: dict, num_threads: int) -> None:
    status, payload = "ok", None
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(num_threads)
        store = dist.FileStore(store_path, world_size)
        store.set_timeout(timedelta(seconds=pg_timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout_s))
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        else:
            # Every pair is connected before any rank runs (and perhaps finishes and exits): gloo's full-mesh
            # connect on a slower rank would otherwise see the closed socket as a peer crash.
            dist.barrier()
        payload = fn(rank, world_size, *args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        status = "error"
        payload = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    try:
        conn.send_bytes(pickle.dumps((status, payload)))
    except Exception as exc:  # unpicklable result
        conn.send_bytes(pickle.dumps(("error", f"result of rank {rank} could not be sent back: {exc}")))
    conn.close()
    # Stay alive until every rank has finished ``fn``: a rank that exits closes its sockets, and a slower rank still
    # inside a gloo full-mesh connect (a process group made inside ``fn``) would see that as a peer crash. The parent
    # kills whoever is still waiting once it has every result (or a rank failed or died), so this never hangs it.
    try:
        store.add("moe_ep_launch_done", 1)
        deadline = time.monotonic() + pg_timeout_s
        while store.add("moe_ep_launch_done", 0) < world_size and time.monotonic() < deadline:
            time.sleep(0.005)
    except Exception:  # noqa: BLE001 - no store (init failed) or it is gone: nothing to wait for
        pass
    # Skip interpreter teardown: process-group destructors can block on peers that already left.
    os._exit(0)


def launch(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0,
           backend: str = "gloo", pg_timeout_s: float | None = None, num_threads: int = 1,
           allow_dead: tuple = (), **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` forked ranks.

    Arguments:
        fn: a module-level or nested function; it runs after ``torch.distributed`` is initialised
            (``backend`` gloo by default; nccl maps rank ``r`` to GPU ``r % device_count``).
        timeout_s: wall-clock bound for the whole run; past it the remaining ranks are killed.
        pg_timeout_s: timeout of the process group's own collectives (default ``timeout_s``).
        num_threads: torch intra-op threads per rank (1 keeps 8 ranks on 2 cores responsive).
        allow_dead: ranks that may die without a result (fault-injection tests kill them): their result is
            ``None`` and the others keep running; raising is still a failure.

    Returns:
        the list of the ranks' return values, indexed by rank.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    # NOTES: fork, except where this process has initialised CUDA already (a CUDA context cannot cross a fork:
    # "Cannot re-initialize CUDA in forked subprocess", seen on an H200 when an earlier test used the GPU in the
    # same pytest process); spawn then needs ``fn`` and its arguments to pickle (module-level functions do).
    import torch

    ctx = mp.get_context("spawn" if torch.cuda.is_initialized() else "fork")
    # NOTES: a FileStore, not a TCPStore hosted here: a TCPStore server runs a thread in this process,
    # and a child forked while that thread holds a lock (it serves the ranks already started) can
    # block forever on it (seen at 8 ranks: a child stuck in torch.set_num_threads). The parent runs
    # no thread while it forks.
    tmpdir = tempfile.mkdtemp(prefix="moe_ep_launch_")
    store_path = os.path.join(tmpdir, "store")
    procs, conns = [], []
    for rank in range(world_size):
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(child_conn, store_path, rank, world_size, backend,
                                             pg_timeout_s or timeout_s, fn, args, kwargs, num_threads),
                        daemon=True)
        p.start()
        child_conn.close()
        procs.append(p)
        conns.append(parent_conn)

    results: list[Any] = [None] * world_size
    done = [False] * world_size
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while not all(done):
            progressed = False
            for rank in range(world_size):
                if done[rank]:
                    continue
                if conns[rank].poll(0):
                    try:
                        status, payload = pickle.loads(conns[rank].recv_bytes())
                    except EOFError:
                        procs[rank].join(timeout=5)
                        status, payload = "error", (f"rank {rank} died (exit code {procs[rank].exitcode}) "
                                                    f"without a result")
                        if rank in allow_dead:
                            status, payload = "ok", None
                    done[rank] = True
                    progressed = True
                    if status == "ok":
                        results[rank] = payload
                    else:
                        errors[rank] = payload
                elif not procs[rank].is_alive() and not conns[rank].poll(0):
                    done[rank] = True
                    progressed = True
                    if rank not in allow_dead:
                        errors[rank] = f"rank {rank} died (exit code {procs[rank].exitcode}) without a result"
            if errors and not all(done):
                # Give the others a moment to report their own (often more informative) errors.
                grace = time.monotonic() + 5.0
                while time.monotonic() < grace and not all(
                        done[r] or conns[r].poll(0) or not procs[r].is_alive() for r in range(world_size)):
                    time.sleep(0.01)
                if not all(done[r] or conns[r].poll(0) or not procs[r].is_alive() for r in range(world_size)):
                    for r in range(world_size):
                        if not done[r]:
                            errors.setdefault(r, f"rank {r} was still running after rank(s) "
                                                 f"{sorted(errors)} failed; killed")
                            done[r] = True
            if time.monotonic() > deadline:
                for r in range(world_size):
                    if not done[r]:
                        errors[r] = f"rank {r} did not finish within {timeout_s:.1f} s; killed"
                        done[r] = True
            if not progressed:
                time.sleep(0.005)
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            p.join(timeout=5)
        for c in conns:
            c.close()
        shutil.rmtree(tmpdir, ignore_errors=True)
    if errors:
        ranks = sorted(errors)
        details = "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in ranks)
        raise RankFailure(f"rank(s) {ranks} failed:\n{details}", ranks)
    return results

"""Gloo ranks reused across tasks, for the test suite and the benchmarks.

:class:`GlooPool` starts ``world_size`` workers that join one gloo process group and then wait
for tasks, so that every ``pool.run(fn, ...)`` after the first costs a round trip (about 3 ms)
instead of a start (about 0.9 s with :func:`functional_hsdp.mesh.launch.run`; ``python -m
bench.mesh.startup`` measures both). Tasks and workers follow
:func:`~functional_hsdp.mesh.launch.run`'s rules (module-level functions, pickled by name;
tensors by value; forked from the forkserver; one thread each; ``rank``, ``world_size`` and
``device_mesh`` of :mod:`functional_hsdp.mesh.launch` usable in a task). Who keeps a pool:
:class:`GlooPool`.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ...mesh.launch import (
    DEFAULT_PRELOAD,
    WorkerError,
    describe_failure,
    dumps,
    forget_meshes,
    format_exc,
    join_group,
    load_task,
    starting_workers,
)

__all__ = ["GlooPool", "WorkerTimeout"]


class WorkerTimeout(WorkerError, TimeoutError):
    """``GlooPool.run`` exceeded its timeout."""


def _record_reply(
    r: int,
    reply: tuple[str, int, Any],
    task_id: int,
    *,
    results: dict[int, Any],
    errors: dict[int, tuple[str, str, str]],
) -> bool:
    """File rank ``r``'s reply under ``results`` or ``errors``; False if it is not for
    ``task_id`` (cannot happen: stale pools are restarted)."""
    kind, tid, data = reply
    if tid != task_id:
        return False
    if kind == "ok":
        # A result that does not unpickle here is that rank's failure, not the pool's.
        try:
            results[r] = pickle.loads(data)
        except Exception as exc:
            errors[r] = format_exc(exc)
    else:
        errors[r] = data
    return True


def _serve(
    task_conn: multiprocessing.connection.Connection,
    result_conn: multiprocessing.connection.Connection,
) -> None:
    """A pool worker's loop: run each task it is sent and send back its result or exception,
    until told to stop or the parent goes away."""
    while True:
        try:
            msg = pickle.loads(task_conn.recv_bytes())
        except (EOFError, OSError):  # parent went away
            return
        if msg[0] == "stop":
            return
        _, task_id, payload = msg
        try:
            fn, args, kwargs = load_task(payload)
            reply = ("ok", task_id, dumps(fn(*args, **kwargs)))
        except BaseException as exc:  # reported to the parent
            reply = ("err", task_id, format_exc(exc))
        try:
            result_conn.send_bytes(pickle.dumps(reply))
        except (BrokenPipeError, OSError):
            return


def _pool_worker_main(
    rank_: int,
    world_size_: int,
    port: int,
    timeout_s: float,
    task_conn: multiprocessing.connection.Connection,
    result_conn: multiprocessing.connection.Connection,
) -> None:
    # Ctrl-C in the terminal reaches the whole process group; let the parent handle it and
    # kill us, instead of printing one KeyboardInterrupt trace per rank.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size_, is_master=False)
        join_group(timeout_s, store=store, rank=rank_, world_size=world_size_)
    except BaseException as exc:  # reported to the parent
        result_conn.send_bytes(pickle.dumps(("start_error", format_exc(exc))))
        return
    result_conn.send_bytes(pickle.dumps(("ready", os.getpid())))
    _serve(task_conn, result_conn)
    forget_meshes()
    try:
        dist.destroy_process_group()
    except Exception:  # best effort at shutdown
        pass
    # Skip the slow interpreter teardown of a process that imported torch.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class GlooPool:
    """``world_size`` worker processes in one gloo process group, reused across tasks.

    The test modules that run on gloo ranks keep one pool each (``tests/conftest.py``'s
    ``pool`` fixture, or their own); the benchmarks' smoke test keeps one for all benchmarks,
    and a benchmark whose variants share a group makes one for its run (``bench/common.py``).

    Args:
        world_size: number of ranks.
        timeout: default per-``run`` timeout in seconds; also the process group (collective)
            timeout inside the workers.
        start_timeout: seconds allowed for starting the workers and joining the group.
        error_grace: once some rank has raised, how long to wait for the others before
            declaring them stuck (usually blocked in a collective the failed rank never
            joined) and breaking the pool.
        preload: modules the forkserver imports, if this pool starts it.

    Failures: an exception in ``fn`` on any rank makes ``run`` raise :class:`WorkerError`
    (``.errors[rank] == (exc_type_name, message, traceback_text)``); if all ranks answered,
    the pool stays as it is. A worker that dies, ranks still busy ``error_grace`` seconds
    after another raised, or a ``run`` past its timeout (:class:`WorkerTimeout`, also a
    ``TimeoutError``) break the pool: its processes are killed at once and the next ``run``
    restarts it (fresh processes and process group). ``close()``, or an interrupt during
    ``run`` or ``start``, terminates then kills leftover workers. Workers are daemonic (tasks
    cannot start processes); if the caller is SIGKILLed, idle workers exit (EOF on their
    task pipe). Not thread-safe: call ``run`` from one thread at a time.
    """

    def __init__(
        self,
        world_size: int = 4,
        timeout: float = 120.0,
        *,
        start_timeout: float = 60.0,
        error_grace: float = 5.0,
        preload: tuple[str, ...] = DEFAULT_PRELOAD,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout = timeout
        self.start_timeout = start_timeout
        self.error_grace = error_grace
        self.preload = tuple(preload)
        self._ctx = multiprocessing.get_context("forkserver")
        self._store: dist.TCPStore | None = None
        self._procs: list[Any] = []
        self._task_conns: list[multiprocessing.connection.Connection] = []
        self._result_conns: list[multiprocessing.connection.Connection] = []
        self._broken = False
        self._next_task_id = 0
        self.starts = 0  # how many times worker processes were (re)started

    # ---- lifecycle -------------------------------------------------------

    @property
    def started(self) -> bool:
        return bool(self._procs)

    @property
    def broken(self) -> bool:
        return self._broken

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self._procs]

    def __enter__(self) -> GlooPool:
        self.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._shutdown(graceful=False)
        except Exception:
            pass

    def start(self) -> None:
        """Start the workers (no-op if running and healthy)."""
        if self.started and not self._broken and self._all_alive():
            return
        self._shutdown(graceful=False)
        try:
            self._start_once()
        except BaseException:  # incl. KeyboardInterrupt: leave no workers behind
            self._shutdown(graceful=False)
            raise
        self._broken = False
        self.starts += 1

    def _start_once(self) -> None:
        # The group's rendezvous store lives here, on a port the OS picks: no port race.
        self._store = dist.TCPStore(
            "127.0.0.1", 0, self.world_size, is_master=True, wait_for_workers=False
        )
        port = self._store.port
        with starting_workers(self.preload):
            for r in range(self.world_size):
                self._spawn_worker(r, port)
        self._await_ready()

    def _spawn_worker(self, r: int, port: int) -> None:
        task_recv, task_send = self._ctx.Pipe(duplex=False)
        result_recv, result_send = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(
            target=_pool_worker_main,
            args=(r, self.world_size, port, float(self.timeout), task_recv, result_send),
            name=f"gloo-pool-rank{r}",
            daemon=True,
        )
        proc.start()
        # Close our copies of the child's ends so EOF is detectable.
        task_recv.close()
        result_send.close()
        self._procs.append(proc)
        self._task_conns.append(task_send)
        self._result_conns.append(result_recv)

    def _await_ready(self) -> None:
        """Wait until every worker has joined the group; raise if one fails, dies or is late."""
        deadline = time.monotonic() + self.start_timeout
        ready: set[int] = set()
        errors: dict[int, tuple[str, str, str]] = {}
        while True:
            self._wait_any(deadline)
            for r, msg in self._drain(exclude=ready | set(errors)):
                if msg[0] == "ready":
                    ready.add(r)
                else:
                    errors[r] = msg[1]
                    # The others usually wait for the failed rank; give them a moment to
                    # report their own errors, then give up.
                    deadline = min(deadline, time.monotonic() + 2.0)
            done = ready | set(errors)
            if len(done) == self.world_size and not errors:
                return
            self._raise_if_start_failed(done, errors, deadline)

    def _raise_if_start_failed(
        self, done: set[int], errors: dict[int, tuple[str, str, str]], deadline: float
    ) -> None:
        dead = self._dead(exclude=done)
        missing = sorted(set(range(self.world_size)) - done - set(dead))
        if dead or len(done) == self.world_size or (errors and time.monotonic() >= deadline):
            raise WorkerError(
                describe_failure(
                    "starting the gloo pool failed", errors, dead=dead, missing=missing
                ),
                errors=errors,
                exitcodes=dead,
                missing=missing,
            )
        if time.monotonic() >= deadline:
            raise WorkerTimeout(
                describe_failure(
                    f"starting the gloo pool timed out after {self.start_timeout}s",
                    errors,
                    dead={},
                    missing=missing,
                ),
                missing=missing,
            )

    def close(self) -> None:
        """Stop the workers; terminate/kill any that do not exit promptly."""
        self._shutdown(graceful=not self._broken)

    def _break(self) -> None:
        """Workers may be dead or stuck: kill them all; ``run`` restarts."""
        self._broken = True
        self._shutdown(graceful=False)

    def _shutdown(self, graceful: bool) -> None:
        procs = self._procs
        if graceful:
            for conn in self._task_conns:
                try:
                    conn.send_bytes(pickle.dumps(("stop",)))
                except (OSError, ValueError):
                    pass
            _join_all(procs, 5.0)
        for p in procs:
            if p.is_alive():
                p.terminate()
        _join_all(procs, 2.0)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(2.0)
        for conn in self._task_conns + self._result_conns:
            try:
                conn.close()
            except OSError:
                pass
        for p in procs:
            try:
                p.close()
            except ValueError:
                pass
        self._procs = []
        self._task_conns = []
        self._result_conns = []
        self._store = None

    # ---- running tasks ---------------------------------------------------

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return per-rank results.

        Raises ``WorkerError`` if any rank raised or a worker died, and ``WorkerTimeout`` (a
        ``WorkerError`` and ``TimeoutError``) if not all ranks finished within ``timeout``
        seconds (default: the pool's).
        """
        payload = dumps((fn, args, kwargs))  # pickling errors raise here
        if self._broken or not self.started or not self._all_alive():
            self.start()
        timeout = self.timeout if timeout is None else timeout
        task_id = self._next_task_id
        self._next_task_id += 1
        msg = pickle.dumps(("task", task_id, payload))
        for r, conn in enumerate(self._task_conns):
            try:
                conn.send_bytes(msg)
            except OSError as exc:
                code = self._procs[r].exitcode
                self._break()
                raise WorkerError(
                    f"could not send task to rank {r}: {exc!r} (pool will restart)",
                    exitcodes={r: code},
                ) from exc

        name = getattr(fn, "__qualname__", repr(fn))
        try:
            return self._collect(task_id, name, timeout)
        except WorkerError:
            raise
        except BaseException:
            # E.g. KeyboardInterrupt while the task runs: the workers are mid-task, so kill
            # them now rather than waiting on them later.
            self._break()
            raise

    def _collect(self, task_id: int, name: str, timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        errors: dict[int, tuple[str, str, str]] = {}
        while True:
            self._wait_any(deadline)
            for r, reply in self._drain(exclude=set(results) | set(errors)):
                if not _record_reply(r, reply, task_id, results=results, errors=errors):
                    continue
                # Ranks still busy after another raised are usually blocked in a collective
                # the failed rank never joined: wait error_grace for them, not the full timeout.
                if errors and len(results) + len(errors) < self.world_size:
                    deadline = min(deadline, time.monotonic() + self.error_grace)
            done = set(results) | set(errors)
            if len(done) == self.world_size:
                return self._all_answered(name, results, errors)
            self._raise_if_died(name, done, results=results, errors=errors)
            if time.monotonic() >= deadline:
                self._raise_overdue(name, timeout, done=done, results=results, errors=errors)

    def _all_answered(
        self, name: str, results: dict[int, Any], errors: dict[int, tuple[str, str, str]]
    ) -> list[Any]:
        # Every rank answered, so the pool is still usable: raise without breaking it.
        if errors:
            raise WorkerError(
                describe_failure(f"task {name} failed", errors, dead={}, missing=[]),
                errors=errors,
                results=results,
            )
        return [results[r] for r in range(self.world_size)]

    def _raise_if_died(
        self,
        name: str,
        done: set[int],
        *,
        results: dict[int, Any],
        errors: dict[int, tuple[str, str, str]],
    ) -> None:
        dead = self._dead(exclude=done)
        if not dead:
            return
        self._break()
        missing = sorted(set(range(self.world_size)) - done - set(dead))
        raise WorkerError(
            describe_failure(f"task {name}: worker died", errors, dead=dead, missing=missing),
            errors=errors,
            exitcodes=dead,
            missing=missing,
            results=results,
        )

    def _raise_overdue(
        self,
        name: str,
        timeout: float,
        *,
        done: set[int],
        results: dict[int, Any],
        errors: dict[int, tuple[str, str, str]],
    ) -> None:
        # Ranks that have not answered may be stuck mid-task: only a restart recovers them.
        self._break()
        missing = sorted(set(range(self.world_size)) - done)
        if errors:
            head = (
                f"task {name} failed; other ranks still busy "
                f"{self.error_grace}s later (stuck in a collective?)"
            )
            cls: type[WorkerError] = WorkerError
        else:
            head = f"task {name} timed out after {timeout}s"
            cls = WorkerTimeout
        raise cls(
            describe_failure(head, errors, dead={}, missing=missing),
            errors=errors,
            missing=missing,
            results=results,
        )

    # ---- helpers ---------------------------------------------------------

    def _all_alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def _dead(self, exclude: set[int]) -> dict[int, int | None]:
        return {
            r: p.exitcode
            for r, p in enumerate(self._procs)
            if r not in exclude and not p.is_alive()
        }

    def _wait_any(self, deadline: float) -> None:
        """Block until a result arrives, a worker exits, or 0.2 s / deadline."""
        wait_s = max(0.0, min(0.2, deadline - time.monotonic()))
        objs = list(self._result_conns) + [p.sentinel for p in self._procs]
        multiprocessing.connection.wait(objs, timeout=wait_s)

    def _drain(self, exclude: set[int]) -> list[tuple[int, Any]]:
        out = []
        for r, conn in enumerate(self._result_conns):
            if r in exclude:
                continue
            try:
                if conn.poll():
                    out.append((r, pickle.loads(conn.recv_bytes())))
            except (EOFError, OSError):
                pass  # worker gone; reported via its exit code
        return out


def _join_all(procs: list, seconds: float) -> None:
    """Join ``procs``, all of them within ``seconds`` together (not each)."""
    deadline = time.monotonic() + seconds
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))

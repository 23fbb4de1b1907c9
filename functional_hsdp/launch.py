"""Start N local gloo ranks: a one-shot run via torch's ``elastic_launch`` for the demo and
benchmarks, and a reusable pool for test modules where start-up cost matters.

Both run a task ``fn(*args, **kwargs)`` on every rank of one gloo process group over loopback
and return the per-rank return values (index = rank):

* :func:`run`, one-shot: ``torch.distributed.launcher.api.elastic_launch`` (what ``torchrun``
  runs) starts ``world_size`` workers, which rendezvous on a free port (``c10d``, as
  ``torchrun --standalone``), join the process group, run the task once and exit. A rank that
  raises or dies ends the run at once (the agent stops the others, even those blocked in a
  collective) with :class:`WorkerError`. Used by ``python -m functional_hsdp demo`` and
  ``python -m bench``.
* :class:`GlooPool`: workers that join one process group and then wait for tasks, so that
  every ``pool.run(fn, ...)`` after the first costs a round trip instead of a start. Used by
  the test modules (a module-scoped fixture) and the benchmark smoke test, which run dozens of
  tasks each.

Workers of both come from the multiprocessing *forkserver*, a fresh interpreter that imports
``preload`` (torch, and ``torch._dynamo``, which the first functional collective imports) once
per calling process and forks every worker from there: never a fork of the caller, whose
threads (pytest's, the elastic agent's store) could deadlock a forked child. ``preload`` only
takes effect for the call that starts the forkserver.

Start-up cost (measured)
------------------------
``python -m functional_hsdp.launch`` times each way of getting 4 gloo ranks to run a task, each
part in a fresh process (so that the first start also starts the forkserver); the "mesh task"
builds a 2x2 ``DeviceMesh`` (cached in a pool's workers) and runs one functional all-reduce,
like a typical test. 2-core CPU, torch 2.13 (CPU), 2026-12-03, load average about 6 (other
jobs were running):

=================================================  ==========
what (4 ranks)                                      seconds
=================================================  ==========
``run(rank)``, first call (starts the forkserver)     3.75
``run(rank)``, later calls (median of 5)              0.80
``run(mesh task)``, later calls (median of 5)         0.92
``elastic_launch``, its default ``spawn`` start      25.9
``GlooPool.start``, first (starts the forkserver)     3.61
``GlooPool.start``, later                             0.58
``pool.run(mesh task)``, first (builds the mesh)      0.21
``pool.run(rank)`` (median of 21)                     0.0001
``pool.run(mesh task)``, later (median of 21)         0.0028
=================================================  ==========

So a one-shot task costs about 0.9 s of start-up and teardown even with the forkserver running
(spawning each worker instead, torch's default, costs 26 s), and a pool task about 3 ms after a
0.6 s start. The test suite runs 96 tests on gloo ranks, at least one task each: about 90 s
one-shot against about 4 s with a pool per test module (6 modules). That is why the test
modules keep a pool, and the demo and the benchmarks (one to a few tasks of seconds to minutes
per run) use :func:`run`.

Tasks
-----
``fn``, its arguments and its return values are pickled with the standard pickle module
(tensors travel by value, as ``torch.save`` bytes of a detached CPU clone; no shared memory),
so ``fn`` must be a module-level function of a module the workers can import by the same
name. Workers get the caller's ``sys.path`` as of their start. Under pytest's default
``prepend`` import mode ``tests/`` is on it and ``tests/test_foo.py`` is the top-level module
``test_foo``, so test modules and helper modules beside them can hold tasks (importing one in a
worker runs its top level: keep that free of side effects; ``--import-mode=importlib`` is not
supported). Lambdas, closures and nested functions cannot be tasks. Workers see the
environment of the forkserver (the caller's when it started), run one thread each
(``torch.set_num_threads(1)``) and share the caller's stdout and stderr.
"""

from __future__ import annotations

import contextlib
import copyreg
import faulthandler
import io
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "DEFAULT_PRELOAD",
    "GlooPool",
    "WorkerError",
    "WorkerTimeout",
    "device_mesh",
    "rank",
    "run",
    "world_size",
]

# Imported once by the forkserver and inherited by every worker forked from it.
DEFAULT_PRELOAD: tuple[str, ...] = (
    "torch",
    "torch.distributed",
    "torch.distributed._functional_collectives",
    "torch.distributed.device_mesh",
    "torch._dynamo",
)

# Set while the forkserver starts (unless the caller set them): the C++ log level is read when
# torch is imported there, and each rank runs one thread.
_QUIET_ENV = {"TORCH_CPP_LOG_LEVEL": "ERROR", "OMP_NUM_THREADS": "1"}


class WorkerError(RuntimeError):
    """A task failed on at least one rank, or a worker died or did not answer.

    Attributes:
        errors: ``{rank: (exc_type_name, message, traceback_text)}`` for the ranks whose task
            raised an exception.
        exitcodes: ``{rank: exitcode}`` for workers that died.
        missing: ranks that gave no answer (timed out, or stuck after another rank failed).
        results: ``{rank: return_value}`` for the ranks that succeeded.
    """

    def __init__(
        self,
        message: str,
        errors: dict[int, tuple[str, str, str]] | None = None,
        exitcodes: dict[int, int | None] | None = None,
        missing: list[int] | None = None,
        results: dict[int, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.errors = dict(errors or {})
        self.exitcodes = dict(exitcodes or {})
        self.missing = list(missing or [])
        self.results = dict(results or {})


class WorkerTimeout(WorkerError, TimeoutError):
    """``GlooPool.run`` exceeded its timeout."""


# -- serialization: standard pickle, tensors by value ----------------------------------------


def _tensor_from_bytes(data: bytes) -> torch.Tensor:
    return torch.load(io.BytesIO(data), weights_only=True)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if type(obj).__name__ == "DTensor":
                raise TypeError(
                    "DTensor cannot cross the process boundary; return "
                    "dt.to_local() or dt.full_tensor() instead"
                )
            if type(obj) in (torch.Tensor, torch.nn.Parameter):
                t = obj.detach().cpu().clone()
                if obj.requires_grad:
                    t.requires_grad_(True)
                buf = io.BytesIO()
                torch.save(t, buf)
                return _tensor_from_bytes, (buf.getvalue(),)
        return NotImplemented


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    p = _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    p.dispatch_table = copyreg.dispatch_table.copy()
    p.dump(obj)
    return buf.getvalue()


def _load_task(payload: bytes) -> tuple[Callable[..., Any], tuple, dict]:
    try:
        return pickle.loads(payload)
    except BaseException as exc:
        raise RuntimeError(
            f"could not unpickle the task in the worker ({exc!r}); task functions must be "
            "module-level functions of modules importable in the worker (e.g. test modules or "
            "helper modules in tests/)"
        ) from exc


def _format_exc(exc: BaseException) -> tuple[str, str, str]:
    return (
        type(exc).__qualname__,
        str(exc),
        "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    )


def _describe(
    head: str,
    errors: dict[int, tuple[str, str, str]],
    dead: dict[int, int | None],
    missing: list[int],
) -> str:
    lines = [head]
    for r, code in sorted(dead.items()):
        lines.append(f"rank {r}: worker process died (exit code {code})")
    if missing:
        lines.append(f"ranks {missing}: no answer")
    for r, (tname, msg, _) in sorted(errors.items()):
        lines.append(f"rank {r}: {tname}: {msg}")
    for r, (_, _, tb) in sorted(errors.items()):
        lines.append(f"--- remote traceback (rank {r}) ---\n{tb.rstrip()}")
    return "\n".join(lines)


# -- in a worker ------------------------------------------------------------------------------


def rank() -> int:
    """The calling worker's rank (``torch.distributed.get_rank()``)."""
    return dist.get_rank()


def world_size() -> int:
    """The number of ranks (``torch.distributed.get_world_size()``)."""
    return dist.get_world_size()


_MESHES: dict[tuple[tuple[int, ...], tuple[str, ...]], Any] = {}


def device_mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    """A CPU ``DeviceMesh`` of ``shape`` with ``names``, cached per worker process.

    Creating a mesh creates process groups, which is collective: call this from a task (tasks
    run on all ranks, so all ranks call it in the same order). The same (shape, names) gives
    the same mesh object for the life of the worker.
    """
    from torch.distributed.device_mesh import init_device_mesh

    key = (tuple(int(s) for s in shape), tuple(names))
    mesh = _MESHES.get(key)
    if mesh is None:
        mesh = init_device_mesh("cpu", key[0], mesh_dim_names=key[1])
        _MESHES[key] = mesh
    return mesh


def _prepare_worker() -> None:
    """In a worker, before its task: loopback for gloo, one thread, stacks on a crash."""
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # A worker killed by a signal (a crash in C++) prints every thread's Python stack to the
    # shared stderr, so that a WorkerError "exit code -11" comes with where it happened.
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)


def _join_group(timeout_s: float, **init: Any) -> None:
    """In a worker: join the gloo process group (``init``: init_process_group's rendezvous)."""
    _prepare_worker()
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s), **init)
    # A rank can leave init_process_group while a slower one is still connecting to it; if
    # the fast rank then ends (a short task, an early error) before the slow one is through,
    # the slow one fails with "Gloo connectFullMesh failed ... Connection closed by peer"
    # (measured: 3 in 40 starts of 4 ranks on a loaded 2-core machine; none in 60 with this
    # barrier).
    dist.barrier()


@contextlib.contextmanager
def _forkserver(preload: tuple[str, ...]) -> Iterator[None]:
    """Around starting workers: the forkserver's preload and quiet environment, if this call
    starts it (os.environ is restored afterwards)."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(preload))
    saved = {k: os.environ.get(k) for k in _QUIET_ENV}
    try:
        for k, v in _QUIET_ENV.items():
            os.environ.setdefault(k, v)
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# -- one-shot: elastic_launch -----------------------------------------------------------------


def _one_shot_main(payload: bytes, timeout_s: float, error_dir: str, join: bool) -> bytes:
    """A worker of :func:`run` (the elastic agent has set RANK, MASTER_ADDR, ...)."""
    if join:
        _join_group(timeout_s)
    else:  # the task makes the group itself, as a torchrun script does
        _prepare_worker()
    try:
        fn, args, kwargs = _load_task(payload)
        result = _dumps(fn(*args, **kwargs))
    except BaseException as exc:  # for the caller's WorkerError; the agent sees the failure
        with open(os.path.join(error_dir, f"rank{os.environ['RANK']}"), "wb") as f:
            pickle.dump(_format_exc(exc), f)
        raise
    _MESHES.clear()
    if dist.is_initialized():
        dist.barrier()  # nobody closes its connections while another rank may still use them
        dist.destroy_process_group()
    return result


def run(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 4,
    timeout: float = 300.0,
    preload: tuple[str, ...] = DEFAULT_PRELOAD,
    join: bool = True,
    **kwargs: Any,
) -> list[Any]:
    """Start ``world_size`` local gloo ranks with ``elastic_launch``, run ``fn(*args,
    **kwargs)`` once on each, and return the per-rank results.

    ``timeout`` is the process group's collective timeout in seconds. ``join=False`` starts
    the workers as ``torchrun`` does, without a process group (the environment names the
    rendezvous): the task makes it, with ``init_device_mesh`` say, and should destroy it.
    Raises :class:`WorkerError` (with the remote tracebacks) when a rank raises or dies; the
    agent then stops the other ranks at once. (``world_size``, ``timeout``, ``preload`` and
    ``join`` are this function's: a task cannot take keyword arguments of those names
    through it.)
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    payload = _dumps((fn, args, kwargs))  # pickling errors raise here, before any start
    with tempfile.TemporaryDirectory(prefix="functional_hsdp_launch_") as tmp, _forkserver(preload):
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=world_size,
            rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:0",  # a free port, as torchrun --standalone
            run_id=f"functional_hsdp_{uuid.uuid4().hex[:8]}",
            max_restarts=0,
            monitor_interval=0.05,  # the agent polls its workers: short polls end runs sooner
            logs_specs=DefaultLogsSpecs(log_dir=os.path.join(tmp, "logs")),
            start_method="forkserver",
        )
        try:
            results = elastic_launch(config, _one_shot_main)(payload, float(timeout), tmp, join)
        except ChildFailedError as exc:
            errors, dead = {}, {}
            for r, failure in exc.failures.items():
                path = os.path.join(tmp, f"rank{r}")
                if os.path.exists(path):
                    with open(path, "rb") as f:
                        errors[r] = pickle.load(f)
                else:
                    dead[r] = failure.exitcode
            name = getattr(fn, "__qualname__", repr(fn))
            message = _describe(f"task {name} failed", errors, dead, [])
            raise WorkerError(message, errors=errors, exitcodes=dead) from exc
    return [pickle.loads(results[r]) for r in range(world_size)]


# -- the pool ---------------------------------------------------------------------------------


def _record_reply(
    r: int,
    reply: tuple[str, int, Any],
    task_id: int,
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
            errors[r] = _format_exc(exc)
    else:
        errors[r] = data
    return True


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
        _join_group(timeout_s, store=store, rank=rank_, world_size=world_size_)
    except BaseException as exc:  # reported to the parent
        result_conn.send_bytes(pickle.dumps(("start_error", _format_exc(exc))))
        return
    result_conn.send_bytes(pickle.dumps(("ready", os.getpid())))

    while True:
        try:
            msg = pickle.loads(task_conn.recv_bytes())
        except (EOFError, OSError):  # parent went away
            break
        if msg[0] == "stop":
            break
        _, task_id, payload = msg
        try:
            fn, args, kwargs = _load_task(payload)
            reply = ("ok", task_id, _dumps(fn(*args, **kwargs)))
        except BaseException as exc:  # reported to the parent
            reply = ("err", task_id, _format_exc(exc))
        try:
            result_conn.send_bytes(pickle.dumps(reply))
        except (BrokenPipeError, OSError):
            break

    _MESHES.clear()
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
        with _forkserver(self.preload):
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
                _describe("starting the gloo pool failed", errors, dead, missing),
                errors=errors,
                exitcodes=dead,
                missing=missing,
            )
        if time.monotonic() >= deadline:
            raise WorkerTimeout(
                _describe(
                    f"starting the gloo pool timed out after {self.start_timeout}s",
                    errors,
                    {},
                    missing,
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
            deadline = time.monotonic() + 5.0
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + 2.0
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
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
        payload = _dumps((fn, args, kwargs))  # pickling errors raise here
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
                if not _record_reply(r, reply, task_id, results, errors):
                    continue
                # Ranks still busy after another raised are usually blocked in a collective
                # the failed rank never joined: wait error_grace for them, not the full timeout.
                if errors and len(results) + len(errors) < self.world_size:
                    deadline = min(deadline, time.monotonic() + self.error_grace)
            done = set(results) | set(errors)
            if len(done) == self.world_size:
                return self._all_answered(name, results, errors)
            self._raise_if_died(name, done, results, errors)
            if time.monotonic() >= deadline:
                self._raise_overdue(name, timeout, done, results, errors)

    def _all_answered(
        self, name: str, results: dict[int, Any], errors: dict[int, tuple[str, str, str]]
    ) -> list[Any]:
        # Every rank answered, so the pool is still usable: raise without breaking it.
        if errors:
            raise WorkerError(
                _describe(f"task {name} failed", errors, {}, []),
                errors=errors,
                results=results,
            )
        return [results[r] for r in range(self.world_size)]

    def _raise_if_died(
        self,
        name: str,
        done: set[int],
        results: dict[int, Any],
        errors: dict[int, tuple[str, str, str]],
    ) -> None:
        dead = self._dead(exclude=done)
        if not dead:
            return
        self._break()
        missing = sorted(set(range(self.world_size)) - done - set(dead))
        raise WorkerError(
            _describe(f"task {name}: worker died", errors, dead, missing),
            errors=errors,
            exitcodes=dead,
            missing=missing,
            results=results,
        )

    def _raise_overdue(
        self,
        name: str,
        timeout: float,
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
            _describe(head, errors, {}, missing),
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


# -- measuring the start-up cost: python -m functional_hsdp.launch ----------------------------


def _measure(part: str) -> None:
    """Print the docstring's table rows for ``part`` ("run" or "pool"); call in a fresh
    process, so that the first start also starts the forkserver."""
    rows = _measure_run() if part == "run" else _measure_pool()
    for what, seconds in rows:
        print(f"{what:<48} {seconds:8.4f} s", flush=True)


def _timed(fn: Callable[[], Any], n: int = 1) -> float:
    """The median of ``n`` calls' wall times, in seconds."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[n // 2]


def _measure_run() -> list[tuple[str, float]]:
    # Set up before the first run(), which would otherwise also pay for importing the launcher.
    with _spawned_launch() as launch:
        rows = [
            ("run(rank), first call (starts the forkserver)", _timed(lambda: run(rank))),
            ("run(rank), later calls (median of 5)", _timed(lambda: run(rank), 5)),
            ("run(mesh task), later calls (median of 5)", _timed(lambda: run(_mesh_task), 5)),
            ("elastic_launch, its default spawn start", _timed(launch)),
        ]
    return rows


@contextlib.contextmanager
def _spawned_launch() -> Iterator[Callable[[], Any]]:
    """What ``run`` would cost without the forkserver: elastic_launch as torch configures it."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    with tempfile.TemporaryDirectory() as logs:
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=4,
            rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:0",
            run_id=f"functional_hsdp_{uuid.uuid4().hex[:8]}",
            max_restarts=0,
            logs_specs=DefaultLogsSpecs(log_dir=logs),
        )  # start_method "spawn": LaunchConfig's default
        yield lambda: elastic_launch(config, _spawned)()


def _measure_pool() -> list[tuple[str, float]]:
    pool = GlooPool(4)
    rows = [("GlooPool.start, first (starts the forkserver)", _timed(pool.start))]
    pool.close()
    rows.append(("GlooPool.start, later (forkserver running)", _timed(pool.start)))
    rows.append(
        ("pool.run(mesh task), first (builds the mesh)", _timed(lambda: pool.run(_mesh_task)))
    )
    rows.append(("pool.run(rank) (median of 21)", _timed(lambda: pool.run(rank), 21)))
    rows.append(
        ("pool.run(mesh task), later (median of 21)", _timed(lambda: pool.run(_mesh_task), 21))
    )
    pool.close()
    return rows


def _mesh_task() -> float:
    """A typical test task: a 2x2 DeviceMesh (cached in a pool) and one functional all-reduce."""
    import torch.distributed._functional_collectives as funcol

    mesh = device_mesh((2, 2), ("outer", "inner"))
    return funcol.all_reduce(torch.ones(4), "sum", (mesh, 1)).sum().item()


def _spawned() -> int:
    _join_group(60.0)
    r = rank()
    dist.barrier()
    dist.destroy_process_group()
    return r


if __name__ == "__main__":
    import subprocess

    print(
        f"load average {os.getloadavg()[0]:.2f}; {os.cpu_count()} CPUs; torch {torch.__version__}"
    )
    for part in ("run", "pool"):  # each in a fresh process; tasks pickled by module name
        code = f"from functional_hsdp import launch; launch._measure({part!r})"
        subprocess.run([sys.executable, "-c", code], check=True)

"""A pool of real ``torch.distributed`` gloo processes for tests.

The pool starts ``world_size`` worker processes that each join one gloo
process group over ``tcp://127.0.0.1:<free port>`` and then wait for tasks.
``GlooPool.run(fn, *args, **kwargs)`` runs ``fn`` on every rank concurrently
and returns the per-rank return values (index = rank).  Workers come from a
fresh interpreter, never from forking the pytest process: by default from the
multiprocessing "forkserver" (which imports torch once and forks workers from
there, so (re)starts are cheap), or with ``start_method="spawn"`` (each worker
imports torch itself: ~16 s per start of 4 workers on 2 cores).  Startup is
still the slow part, so a test module shares one pool::

    from gloo_pool import device_mesh, module_pool

    pool = module_pool(4)          # module-scoped fixture named ``pool``

    def _task(x):                  # module level: pickled by reference
        mesh = device_mesh((2, 2), ("dp", "tp"))
        ...
        return some_tensor

    def test_something(pool):
        results = pool.run(_task, 3)

Where task functions must live
------------------------------
``fn`` (and every argument / return value) is pickled with the standard pickle
module (tensors travel by value, as ``torch.save`` bytes of a detached CPU
clone; no shared memory), so ``fn`` must be a module-level function of a module the workers can
import by the same name.  ``tests/`` is deliberately *not* a package: under
pytest's default ``prepend`` import mode, pytest puts ``tests/`` on
``sys.path`` and imports ``tests/test_foo.py`` as module ``test_foo``.  Workers
get the parent's ``sys.path`` as of pool start (and this module additionally puts
``tests/`` and the repository root on it), so they can import ``test_foo``,
``gloo_pool`` and any other helper module in ``tests/``.  Lambdas, closures
and nested functions cannot be used as tasks.  Importing a test module in a
worker executes its top level, so keep that side-effect free.

Failure handling
----------------
* An exception in ``fn`` on any rank makes ``run`` raise :class:`WorkerError`
  (``.errors[rank] == (exc_type_name, message, traceback_text)``).  If some
  ranks raised and the others do not answer within ``error_grace`` seconds
  (typically because they are blocked in a collective), the pool gives up on
  them.
* A worker that dies, or a ``run`` that exceeds its timeout
  (:class:`WorkerTimeout`, also a :class:`TimeoutError`), raises promptly.
* In all cases where a worker may be dead or stuck, the pool marks itself
  broken and kills its processes at once; the next ``run`` restarts it (fresh
  processes and process group).  If all ranks answered (some with an
  exception), the pool stays as it is.  ``close()`` always terminates, then
  kills, leftover processes; so does an interrupt (e.g. Ctrl-C) during ``run``
  or ``start``.

Caveats
-------
* The forkserver is one per pytest process, shared by all pools; ``preload``
  only applies if this pool is the one that starts it.  Workers get the
  parent's ``os.environ`` as of pool start, but variables read when torch is
  imported (e.g. ``TORCH_CPP_LOG_LEVEL``, default ``ERROR`` here) come from the
  forkserver's environment.
* Workers are daemonic: tasks cannot start multiprocessing children.
* ``--import-mode=importlib`` is not supported (test modules must be
  importable by their module name).
* If the pytest process is SIGKILLed, idle workers exit (EOF on their task
  pipe); busy ones exit when their task ends or its collective times out.
* Worker stdout/stderr are the parent's (inherited), so pytest captures them
  like the test's own output (shown on failure, or live with ``-s``).
"""

from __future__ import annotations

import copyreg
import io
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

__all__ = [
    "GlooPool",
    "WorkerError",
    "WorkerTimeout",
    "device_mesh",
    "module_pool",
    "rank",
    "world_size",
]

# Imported once by the forkserver (and inherited by every worker forked from
# it): torch itself, and torch._dynamo, which the first functional collective
# imports lazily.
DEFAULT_PRELOAD: tuple[str, ...] = (
    "torch",
    "torch.distributed",
    "torch.distributed._functional_collectives",
    "torch.distributed.device_mesh",
    "torch._dynamo",
    "pytest",
)

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
_REPO_ROOT = os.path.dirname(_TESTS_DIR)


class WorkerError(RuntimeError):
    """A task failed on at least one rank, or a worker died / did not answer.

    Attributes:
        errors: ``{rank: (exc_type_name, message, traceback_text)}`` for the
            ranks whose task raised an exception.
        exitcodes: ``{rank: exitcode}`` for workers that died during the run.
        missing: ranks that gave no answer (timed out, or stuck after another
            rank failed).
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


# --------------------------------------------------------------------------
# Serialization.  Standard pickle (not multiprocessing's ForkingPickler), so
# tensors travel by value as bytes, never through shared memory / fds.
# --------------------------------------------------------------------------


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


# --------------------------------------------------------------------------
# Worker side.
# --------------------------------------------------------------------------


def rank() -> int:
    """The calling worker's rank (``torch.distributed.get_rank()``)."""
    return dist.get_rank()


def world_size() -> int:
    """The pool's world size (``torch.distributed.get_world_size()``)."""
    return dist.get_world_size()


_MESHES: dict[tuple[tuple[int, ...], tuple[str, ...]], Any] = {}


def device_mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    """A CPU ``DeviceMesh`` of ``shape`` with ``names``, cached per worker.

    Creating a mesh creates process groups, which is collective: call this
    from a task (tasks run on all ranks, so all ranks call it in the same
    order).  The same (shape, names) returns the same mesh object for the
    lifetime of the worker process.
    """
    from torch.distributed.device_mesh import init_device_mesh

    key = (tuple(int(s) for s in shape), tuple(names))
    mesh = _MESHES.get(key)
    if mesh is None:
        mesh = init_device_mesh("cpu", key[0], mesh_dim_names=key[1])
        _MESHES[key] = mesh
    return mesh


def _format_exc(exc: BaseException) -> tuple[str, str, str]:
    return (
        type(exc).__qualname__,
        str(exc),
        "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    )


def _worker_main(
    rank_: int,
    world_size_: int,
    init_method: str,
    timeout_s: float,
    task_conn: multiprocessing.connection.Connection,
    result_conn: multiprocessing.connection.Connection,
    extra_path: list[str],
    env: dict[str, str],
) -> None:
    # Ctrl-C in the terminal reaches the whole process group; let the parent
    # handle it and kill us, instead of printing 4 KeyboardInterrupt traces.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Forkserver children inherit the server's environment, not the parent's
    # current one: install the parent's environment as of pool start.
    for k in set(os.environ) - set(env):
        del os.environ[k]
    os.environ.update(env)
    for p in reversed(extra_path):
        if p not in sys.path:
            sys.path.insert(0, p)
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=rank_,
            world_size=world_size_,
            timeout=timedelta(seconds=timeout_s),
        )
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
            try:
                fn, args, kwargs = pickle.loads(payload)
            except BaseException as exc:
                raise RuntimeError(
                    f"could not unpickle the task in the worker ({exc!r}); task "
                    "functions must be module-level functions of modules importable "
                    "in the worker (e.g. test modules or helper modules in tests/)"
                ) from exc
            value = fn(*args, **kwargs)
            reply = ("ok", task_id, _dumps(value))
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


# --------------------------------------------------------------------------
# Parent side.
# --------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GlooPool:
    """``world_size`` worker processes in one gloo process group.

    Args:
        world_size: number of ranks.
        timeout: default per-``run`` timeout in seconds; also the process
            group (collective) timeout inside the workers.
        start_timeout: seconds allowed for starting the workers and
            initializing the process group.
        error_grace: once some rank has raised, how long to wait for the other
            ranks before declaring them stuck (they are usually blocked in a
            collective the failed rank never joined) and breaking the pool.
        start_method: ``"forkserver"`` (default) or ``"spawn"``.  Both start
            workers from a fresh interpreter, never by forking the pytest
            process.  With ``"spawn"`` every worker imports torch (~3.5 s CPU)
            and, on its first functional collective, ``torch._dynamo``
            (~4.5 s CPU) itself, i.e. ~16 s per (re)start of 4 workers on 2
            cores.  ``"forkserver"`` pays that once per pytest process: the
            server preloads ``preload`` and (re)starts fork from it in well
            under a second.
        preload: modules the forkserver imports before forking workers.

    Not thread-safe: call ``run`` from one thread at a time.
    """

    def __init__(
        self,
        world_size: int = 4,
        timeout: float = 120.0,
        *,
        start_timeout: float = 60.0,
        error_grace: float = 5.0,
        start_method: str = "forkserver",
        preload: tuple[str, ...] = DEFAULT_PRELOAD,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout = timeout
        self.start_timeout = start_timeout
        self.error_grace = error_grace
        self.start_method = start_method
        self.preload = tuple(preload)
        self._ctx = multiprocessing.get_context(start_method)
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
        attempts = 3
        for attempt in range(attempts):
            try:
                self._start_once()
                break
            except BaseException as exc:  # incl. KeyboardInterrupt: leave no workers behind
                self._shutdown(graceful=False)
                text = str(exc).lower()
                if (
                    isinstance(exc, WorkerError)
                    and attempt + 1 < attempts
                    and ("eaddrinuse" in text or "address already in use" in text)
                ):
                    continue  # lost a race for the free port: try another one
                raise
        self._broken = False
        self.starts += 1

    def _start_once(self) -> None:
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        extra_path = [_TESTS_DIR, _REPO_ROOT]
        env_defaults = {"TORCH_CPP_LOG_LEVEL": "ERROR", "OMP_NUM_THREADS": "1"}
        env = {**env_defaults, **os.environ}
        if self.start_method == "forkserver":
            # Only effective if this starts the (per-process) forkserver.
            self._ctx.set_forkserver_preload(list(self.preload))
        saved = {k: os.environ.get(k) for k in env_defaults}
        try:
            # Children (and the forkserver, if this starts it) copy os.environ
            # when started; give them quiet defaults (the C++ log level is read
            # when torch is imported), then restore ours.
            for k, v in env_defaults.items():
                os.environ.setdefault(k, v)
            for r in range(self.world_size):
                task_recv, task_send = self._ctx.Pipe(duplex=False)
                result_recv, result_send = self._ctx.Pipe(duplex=False)
                proc = self._ctx.Process(
                    target=_worker_main,
                    args=(
                        r,
                        self.world_size,
                        init_method,
                        float(self.timeout),
                        task_recv,
                        result_send,
                        extra_path,
                        env,
                    ),
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
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

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
                    # The others usually wait for the failed rank; give them
                    # a moment to report their own errors, then give up.
                    deadline = min(deadline, time.monotonic() + 2.0)
            done = ready | set(errors)
            if len(done) == self.world_size and not errors:
                return
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

    # ---- running tasks ---------------------------------------------------

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return per-rank results.

        Raises ``WorkerError`` if any rank raised or a worker died, and
        ``WorkerTimeout`` (a ``WorkerError`` and ``TimeoutError``) if not all
        ranks finished within ``timeout`` seconds (default: the pool's).
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
            # E.g. KeyboardInterrupt while the task runs: the workers are
            # mid-task, so kill them now rather than waiting on them later.
            self._break()
            raise

    def _collect(self, task_id: int, name: str, timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        errors: dict[int, tuple[str, str, str]] = {}
        while True:
            self._wait_any(deadline)
            for r, reply in self._drain(exclude=set(results) | set(errors)):
                kind, tid, data = reply
                if tid != task_id:  # cannot happen: stale pools are restarted
                    continue
                if kind == "ok":
                    try:
                        results[r] = pickle.loads(data)
                    except Exception as exc:
                        errors[r] = _format_exc(exc)
                else:
                    errors[r] = data
                if errors and len(results) + len(errors) < self.world_size:
                    deadline = min(deadline, time.monotonic() + self.error_grace)
            done = set(results) | set(errors)
            if len(done) == self.world_size:
                if errors:
                    raise WorkerError(
                        _describe(f"task {name} failed", errors, {}, []),
                        errors=errors,
                        results=results,
                    )
                return [results[r] for r in range(self.world_size)]
            dead = self._dead(exclude=done)
            if dead:
                self._break()
                missing = sorted(set(range(self.world_size)) - done - set(dead))
                raise WorkerError(
                    _describe(f"task {name}: worker died", errors, dead, missing),
                    errors=errors,
                    exitcodes=dead,
                    missing=missing,
                    results=results,
                )
            if time.monotonic() >= deadline:
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


def module_pool(world_size: int = 4, **pool_kwargs: Any):
    """A module-scoped pytest fixture yielding a started :class:`GlooPool`.

    Use at module top level; the fixture is named after the attribute::

        pool = module_pool(4)

        def test_x(pool): ...
    """

    @pytest.fixture(scope="module")
    def _pool():
        with GlooPool(world_size, **pool_kwargs) as p:
            yield p

    return _pool

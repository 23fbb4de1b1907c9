"""Start N local gloo ranks for one task: how ``python -m functional_hsdp demo`` gets its ranks.

:func:`run` runs a task ``fn(*args, **kwargs)`` on every rank of one gloo process group over
loopback and returns the per-rank return values (index = rank); a rank that raises or dies
ends the run at once with :class:`WorkerError`. In a worker, a task can call :func:`rank`,
:func:`world_size` and :func:`device_mesh`. Used by ``python -m functional_hsdp demo``,
``python -m bench`` and the tests that need fresh ranks; the training library itself never
imports this module. What a task may be: :func:`run`; where workers come from:
:func:`starting_workers`. Workers that stay up across tasks are
:class:`functional_hsdp.tools.testing.GlooPool`'s (it shares this module's worker set-up,
serialization and :class:`WorkerError`; this module does not import it).
"""

from __future__ import annotations

import contextlib
import copyreg
import faulthandler
import io
import multiprocessing
import os
import pickle
import sys
import tempfile
import traceback
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "DEFAULT_PRELOAD",
    "WorkerError",
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
    """A task failed on at least one rank, or a worker died or did not answer (raised by
    :func:`run` and by the test pool, ``functional_hsdp.tools.testing.GlooPool``).

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


# The helpers below (serialization, error reports, worker set-up, the forkserver, the mesh
# cache) are also the pool's (functional_hsdp.tools.testing.gloo_pool), so both kinds of worker
# behave alike: public for that reason, and left out of __all__ (not for a task's use).

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


def dumps(obj: Any) -> bytes:
    """``obj`` pickled for another process: standard pickle, tensors by value (a detached CPU
    clone as ``torch.save`` bytes); a DTensor is refused."""
    buf = io.BytesIO()
    p = _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    p.dispatch_table = copyreg.dispatch_table.copy()
    p.dump(obj)
    return buf.getvalue()


def load_task(payload: bytes) -> tuple[Callable[..., Any], tuple, dict]:
    """In a worker: the task ``(fn, args, kwargs)`` that :func:`dumps` made, or an error that
    says what a task function must be."""
    try:
        return pickle.loads(payload)
    except BaseException as exc:
        raise RuntimeError(
            f"could not unpickle the task in the worker ({exc!r}); task functions must be "
            "module-level functions of modules importable in the worker (e.g. test modules or "
            "helper modules in tests/)"
        ) from exc


def format_exc(exc: BaseException) -> tuple[str, str, str]:
    """``exc`` as ``(type name, message, traceback text)``: what a worker sends back."""
    return (
        type(exc).__qualname__,
        str(exc),
        "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    )


def describe_failure(
    head: str,
    errors: dict[int, tuple[str, str, str]],
    *,
    dead: dict[int, int | None],
    missing: list[int],
) -> str:
    """The message of a :class:`WorkerError`: ``head``, then the dead, silent and failed
    ranks, then the remote tracebacks."""
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


def forget_meshes() -> None:
    """In a worker, before it leaves its process group: drop the meshes :func:`device_mesh`
    cached (their groups go with the process group)."""
    _MESHES.clear()


def prepare_worker() -> None:
    """In a worker, before its task: loopback for gloo, one thread, stacks on a crash."""
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # A worker killed by a signal (a crash in C++) prints every thread's Python stack to the
    # shared stderr, so that a WorkerError "exit code -11" comes with where it happened.
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)


def join_group(timeout_s: float, **init: Any) -> None:
    """In a worker: join the gloo process group (``init``: init_process_group's rendezvous)."""
    prepare_worker()
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s), **init)
    # A rank can leave init_process_group while a slower one is still connecting to it; if
    # the fast rank then ends (a short task, an early error) before the slow one is through,
    # the slow one fails with "Gloo connectFullMesh failed ... Connection closed by peer"
    # (measured: 3 in 40 starts of 4 ranks on a loaded 2-core machine; none in 60 with this
    # barrier).
    dist.barrier()


@contextlib.contextmanager
def starting_workers(preload: tuple[str, ...]) -> Iterator[None]:
    """Around starting workers: the forkserver's preload and quiet environment, if this call
    starts it (os.environ is restored afterwards).

    Workers come from the multiprocessing *forkserver*, a fresh interpreter that imports
    ``preload`` (torch, and ``torch._dynamo``, which the first functional collective imports)
    once per calling process and forks every worker from there: never a fork of the caller,
    whose threads (pytest's, the elastic agent's store) could deadlock a forked child.
    ``preload`` only takes effect for the call that starts the forkserver."""
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
        join_group(timeout_s)
    else:  # the task makes the group itself, as a torchrun script does
        prepare_worker()
    try:
        fn, args, kwargs = load_task(payload)
        result = dumps(fn(*args, **kwargs))
    except BaseException as exc:  # for the caller's WorkerError; the agent sees the failure
        with open(os.path.join(error_dir, f"rank{os.environ['RANK']}"), "wb") as f:
            pickle.dump(format_exc(exc), f)
        raise
    forget_meshes()
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
    agent then stops the other ranks at once, even those blocked in a collective.
    (``world_size``, ``timeout``, ``preload`` and ``join`` are this function's: a task cannot
    take keyword arguments of those names through it.)

    ``torch.distributed.launcher.api.elastic_launch`` (what ``torchrun`` runs) starts
    ``world_size`` workers, which rendezvous on a free port (``c10d``, as ``torchrun
    --standalone``), join the process group, run the task once and exit. A one-shot run costs
    about 0.9 s of start-up and teardown; a :class:`functional_hsdp.tools.testing.GlooPool`
    task about 3 ms after a 0.6 s start (``python -m bench.mesh.startup`` measures both), which is
    why the test suite and the benchmarks, which run many short tasks, use the pool.

    Tasks: ``fn``, its arguments and its return values are pickled with the standard pickle module
    (tensors travel by value, as ``torch.save`` bytes of a detached CPU clone; no shared memory), so
    ``fn`` must be a module-level function of a module the workers can import by the same name.
    Workers get the caller's ``sys.path`` as of their start. Under pytest's default ``prepend``
    import mode a test's folder (``tests/<layer>/``) and ``tests/`` are on it and
    ``tests/<layer>/test_foo.py`` is the top-level module ``test_foo``, so test modules and helper
    modules beside them can hold tasks (importing one in a worker runs its top level: keep that free
    of side effects; ``--import-mode=importlib`` is not supported). Lambdas, closures and nested
    functions cannot be tasks. Workers see the environment of the forkserver (the caller's when it
    started), run one thread each (``torch.set_num_threads(1)``) and share the caller's stdout and
    stderr.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    payload = dumps((fn, args, kwargs))  # pickling errors raise here, before any start
    with (
        tempfile.TemporaryDirectory(prefix="functional_hsdp_launch_") as tmp,
        starting_workers(preload),
    ):
        config = _launch_config(world_size, tmp)
        try:
            results = elastic_launch(config, _one_shot_main)(payload, float(timeout), tmp, join)
        except ChildFailedError as exc:
            raise _run_failed(fn, exc, tmp) from exc
    return [pickle.loads(results[r]) for r in range(world_size)]


def _launch_config(world_size: int, tmp: str) -> Any:
    """:func:`run`'s ``LaunchConfig``: one node, a free port, no restarts, forkserver workers."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
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


def _run_failed(fn: Callable[..., Any], exc: Any, tmp: str) -> WorkerError:
    """The :class:`WorkerError` of a failed :func:`run`: the ranks that raised left their
    exception in ``tmp`` (see :func:`_one_shot_main`); the others died."""
    errors, dead = {}, {}
    for r, failure in exc.failures.items():
        path = os.path.join(tmp, f"rank{r}")
        if os.path.exists(path):
            with open(path, "rb") as f:
                errors[r] = pickle.load(f)
        else:
            dead[r] = failure.exitcode
    name = getattr(fn, "__qualname__", repr(fn))
    message = describe_failure(f"task {name} failed", errors, dead=dead, missing=[])
    return WorkerError(message, errors=errors, exitcodes=dead)

"""DistMesh: a real ``torch.distributed`` device mesh (gloo, NCCL; torchrun for many machines).

Collectives are ``torch.distributed._functional_collectives`` over ``(device_mesh, dim)``:
asynchronous and traceable by ``torch.compile``. On gloo, eager collectives are asynchronous
c10d calls with a ``Work`` handle instead: reductions are in-place all-reduces of the
library's own buffers (see ``_INPLACE``), all-gathers ``all_gather_into_tensor`` (see
``_C10D_GATHER``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ..errors import collective_error
from .protocol import Flight, MeshAxes

__all__ = ["DistMesh"]

# Backends whose all-reduce / reduce-scatter implement AVG themselves; any other backend gets
# an exact emulation: SUM, then divide by the group size.
_NATIVE_AVG = frozenset({"nccl", "gloo"})

# How reductions run, per backend (measured: bench/RESULTS.md, "gloo reduce-scatter
# implementations"). gloo has no native reduce-scatter: torch emulates one with an all-reduce
# into a new buffer and a copy of the chunk. All-reducing the library's own packing buffer in
# place and keeping the chunk moves the same bytes 1.6-2x faster at 10M-50M elements, with no
# full-size temporary; so on gloo both reductions are in-place c10d all-reduces, issued
# asynchronously, with the backend's own AVG (gloo's is SUM then divide: bitwise the same as
# the emulation). Other backends (NCCL), and every backend under torch.compile, use the
# functional collectives: a real reduce-scatter, asynchronous and traceable.
_INPLACE = frozenset({"gloo"})
assert _INPLACE <= _NATIVE_AVG, "the in-place path reduces with the backend's own AVG"

# Backends whose eager all-gathers are c10d ``all_gather_into_tensor(async_op=True)``, the
# output, input and Work held until waited, instead of the functional all_gather. On gloo
# (torch 2.13, CPU) several functional all-gathers in flight at once corrupt the heap now and
# then: 4 ranks of 3,000 rounds of 6 functional all-gathers each, waited after the round,
# crashed (SIGSEGV, "malloc(): unaligned tcache chunk detected") in 6 of 8 runs; the same
# rounds with c10d async all-gathers in none of 6 (a whole training step: every few hundred
# steps, and never with the all-gathers waited at issue; `python -m bench.gloo_allgather`
# reproduces it). Traced by torch.compile, an all-gather on these backends stays functional
# but is waited at issue.
_C10D_GATHER = frozenset({"gloo"})


class DistMesh(MeshAxes):
    """A real ``torch.distributed`` device mesh (gloo, NCCL; torchrun for many machines).

    Args:
        device_mesh: a ``DeviceMesh`` built with ``mesh_dim_names``; its dims are the axes,
            outer to inner.
        overlap: True (default): collectives are asynchronous; the library issues every
            bucket's collective before it waits on any, so buckets overlap each other and
            packing. False: each collective is waited for as soon as it is issued (for
            debugging, and to measure what overlap gains).
        timeout: the longest wait for one collective (seconds or a ``timedelta``), after
            which :class:`~functional_hsdp.CollectiveError` names it. Default: the timeout the
            default process group was made with (``init_process_group(timeout=...)``), which
            the groups ``init_device_mesh`` makes do not inherit. It bounds the library's own
            waits (gloo's in-place reductions, the cross-rank check); a functional
            collective's wait (NCCL) is bounded by its group's own timeout (watchdog).

    Example:
        >>> import functional_hsdp as fh
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> dm = init_device_mesh(  # doctest: +SKIP
        ...     "cuda", (2, 4), mesh_dim_names=("dp_outer", "dp_inner"))
        >>> mesh = fh.DistMesh(dm)  # doctest: +SKIP
    """

    batch_shape: tuple[int, ...] = ()

    def __init__(self, device_mesh: Any, *, overlap: bool = True, timeout: Any = None):
        if not isinstance(overlap, bool):
            raise TypeError(f"DistMesh: overlap must be a bool; got {overlap!r}")
        self.overlap = overlap
        self.timeout = _as_timedelta(timeout, device_mesh)
        names = getattr(device_mesh, "mesh_dim_names", None)
        if names is None:
            raise ValueError(
                "DistMesh needs a DeviceMesh with mesh_dim_names, e.g. "
                "init_device_mesh('cuda', (2, 4), mesh_dim_names=('dp_outer', 'dp_inner'))"
            )
        self.device_mesh = device_mesh
        self.axis_names = tuple(names)
        self.sizes = tuple(int(n) for n in device_mesh.shape)
        backends = [dist.get_backend(device_mesh.get_group(d)) for d in range(self.ndim)]
        self._native_avg = tuple(b in _NATIVE_AVG for b in backends)
        self._inplace = tuple(b in _INPLACE for b in backends)
        self._c10d_gather = tuple(b in _C10D_GATHER for b in backends)
        self._coords = tuple(int(device_mesh.get_local_rank(d)) for d in range(self.ndim))
        self.geometry = RankGeometry(self)
        self.diagnostics = DistDiagnostics(self)

    def __repr__(self) -> str:
        return f"DistMesh({self.shape}{'' if self.overlap else ', overlap=False'})"

    def coordinate(self, axis: str) -> int:
        """This rank's index along ``axis``."""
        return self._coords[self._dim(axis)]

    def group(self, axis: str) -> Any:
        """The process group of ``axis``."""
        return self.device_mesh.get_group(self._dim(axis))

    def _in_place(self, axis: str) -> bool:
        return self._inplace[self._dim(axis)] and not torch.compiler.is_compiling()

    def _funcol(self, name: str, fn, axis: str, op: str) -> torch.Tensor:
        """A functional reduction ``fn(op)``; AVG emulated where the backend lacks it."""
        with self.guard(name, axis):
            if op == "avg" and not self._native_avg[self._dim(axis)]:
                return fn("sum") / self.size(axis)
            return fn(op)

    def all_reduce(self, buf: torch.Tensor, axis: str, op: str) -> torch.Tensor | Flight:
        """All-reduce over ``axis`` (in place on gloo)."""
        if self._in_place(axis):
            return self._issue_in_place(buf, axis, op, "all_reduce")
        group = (self.device_mesh, self._dim(axis))
        reduce = lambda o: funcol.all_reduce(buf, o, group)  # noqa: E731
        out = self._funcol("all_reduce", reduce, axis, op)
        return self._flight(out, "all_reduce", axis)

    def reduce_scatter(self, buf: torch.Tensor, axis: str, op: str) -> torch.Tensor | Flight:
        """Reduce-scatter over ``axis``. On gloo an in-place all-reduce of ``buf`` whose
        waited result is this rank's chunk as a view of it (a borrowed result), so that a
        consumer that makes a new tensor anyway (adding acc, MainGrad's add) copies nothing."""
        if self._in_place(axis):
            return self._issue_in_place(buf, axis, op, "reduce_scatter")
        group = (self.device_mesh, self._dim(axis))
        reduce = lambda o: funcol.reduce_scatter_single(buf, o, 0, group)  # noqa: E731
        out = self._funcol("reduce_scatter", reduce, axis, op)
        return self._flight(out, "reduce_scatter", axis)

    def all_gather(self, buf: torch.Tensor, axis: str) -> torch.Tensor | Flight:
        """All-gather over ``axis`` (functional collective; c10d on gloo, see
        ``_C10D_GATHER``)."""
        d = self._dim(axis)
        if self._c10d_gather[d] and not torch.compiler.is_compiling():
            out = buf.new_empty(self.sizes[d] * buf.shape[0], *buf.shape[1:])
            if not out.numel():  # gloo divides by the size (SIGFPE); every rank skips alike
                return out
            with self.guard("all_gather", axis):
                work = dist.all_gather_into_tensor(
                    out, buf.contiguous(), group=self.group(axis), async_op=True
                )
            return self._issued(Flight("all_gather", axis, out, work, source=buf))
        with self.guard("all_gather", axis):
            out = funcol.all_gather_single(buf, 0, (self.device_mesh, d))
            if self._c10d_gather[d]:  # traced on gloo: waited at issue, never several in flight
                out = funcol.wait_tensor(out)
        return self._flight(out, "all_gather", axis)

    def _issue_in_place(self, buf: torch.Tensor, axis: str, op: str, name: str) -> Flight:
        # ``buf`` is always one of the library's own buffers (a fresh packing buffer, a
        # collective's result or MainGrad's buffer), never a caller's tensor.
        with self.guard(name, axis):
            work = dist.all_reduce(
                buf,
                op=dist.ReduceOp.AVG if op == "avg" else dist.ReduceOp.SUM,
                group=self.group(axis),
                async_op=True,
            )
        return self._issued(Flight(name, axis, buf, work, chunk=name == "reduce_scatter"))

    def _flight(self, out: torch.Tensor, name: str, axis: str) -> torch.Tensor | Flight:
        if torch.compiler.is_compiling():  # traced: funcol's own tensors, waited by wait()
            return out
        return self._issued(Flight(name, axis, out))

    def _issued(self, flight: Flight) -> torch.Tensor | Flight:
        """A collective just issued: held in flight, or waited at once without overlap."""
        return flight if self.overlap else self.wait(flight)

    def wait(self, x: torch.Tensor | Flight) -> torch.Tensor:
        """The result of ``x``; CollectiveError naming the collective if it failed."""
        if not isinstance(x, Flight):
            if isinstance(x, funcol.AsyncCollectiveTensor):  # traced code's results
                return funcol.wait_tensor(x)
            return x
        with self.guard(x.op, x.axis):
            if x.work is not None:
                x.work.wait(self.timeout) if self.timeout is not None else x.work.wait()
                buf = x.buffer
            else:
                buf = funcol.wait_tensor(x.buffer)
        if x.chunk:
            n = self.size(x.axis)
            return buf.view(n, buf.shape[-1] // n)[self.coordinate(x.axis)]
        return buf

    def abandon(self, x: torch.Tensor | Flight) -> None:
        """Drop our reference to a collective in flight; the backend still holds its buffer
        until it completes. Its error, if any, is not reported: the caller is already raising
        another."""

    # A failed or timed-out collective raises CollectiveError naming it (op, axis): at issue,
    # or (gloo, usually) at the wait.

    @contextlib.contextmanager
    def guard(self, op: str, axis: Any) -> Iterator[None]:
        """Turn a RuntimeError of collective ``op`` on ``axis`` into a CollectiveError."""
        try:
            yield
        except RuntimeError as e:
            timeout = self._timeout(axis)
            raise collective_error(op, axis, self, e, rank=dist.get_rank(), timeout=timeout) from e

    def _timeout(self, axis: Any) -> Any:
        """The wait bound named in errors: the mesh's, else the axis group's own."""
        if self.timeout is not None or not isinstance(axis, str):
            return self.timeout
        try:  # private API; the message just omits the timeout without it
            device = torch.device(self.device_mesh.device_type)
            return self.group(axis)._get_backend(device).options._timeout
        except Exception:
            return None


def _as_timedelta(timeout: Any, device_mesh: Any) -> timedelta | None:
    """``timeout`` as a timedelta; by default the default process group's."""
    if isinstance(timeout, timedelta):
        return timeout
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise TypeError(
                f"DistMesh: timeout must be a positive number of seconds; got {timeout!r}"
            )
        return timedelta(seconds=timeout)
    try:  # private API: without it, waits are bounded by each group's own timeout
        device = torch.device(device_mesh.device_type)
        return dist.group.WORLD._get_backend(device).options._timeout
    except Exception:
        return None


class RankGeometry:
    """Geometry on a DistMesh: coordinates are ints, pieces are exact-length views."""

    views = True

    def __init__(self, mesh: DistMesh):
        self._mesh = mesh

    def chunk(self, buf: torch.Tensor, axis: str) -> torch.Tensor:
        # A copy, so that a rank's shards do not keep the whole buffer alive.
        n = self._mesh.size(axis)
        return buf.view(n, buf.shape[-1] // n)[self._mesh.coordinate(axis)].clone()

    def pieces(self, start: int, ranges: list[tuple[int, int]], length: int) -> tuple[int, ...]:
        # Consecutive leaves' pieces tile the chunk from 0 (pieces outside it are empty).
        sizes = []
        for offset, numel in ranges:
            lo = min(max(offset - start, 0), length)
            sizes.append(max(lo, min(max(offset + numel - start, 0), length)) - lo)
        return (*sizes, length - sum(sizes))  # the last entry is the tail

    def piece_shapes(self, pieces: tuple[int, ...]) -> list[tuple[int, ...]]:
        return [(n,) for n in pieces[:-1]]

    def split(self, buf: torch.Tensor, pieces: tuple[int, ...]) -> list[torch.Tensor]:
        return list(torch.split(buf, pieces))[:-1]

    def join(self, values: list[torch.Tensor], pieces: tuple[int, ...]) -> torch.Tensor:
        dtype = values[0].dtype if values else torch.float32
        device = values[0].device if values else None
        return torch.cat([*values, torch.zeros(pieces[-1], dtype=dtype, device=device)])

    def chunk_length(self, total: int, size: int, axis: str) -> int:
        return min(max(total - self._mesh.coordinate(axis) * size, 0), size)

    def narrow(self, x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
        return x.narrow(dim, 0, length)

    def narrow_shape(self, shape: tuple[int, ...], dim: int, length: int) -> tuple[int, ...]:
        return tuple(length if k == dim else n for k, n in enumerate(shape))


class DistDiagnostics:
    """Descriptions and the validation exchange on a DistMesh."""

    def __init__(self, mesh: DistMesh):
        self._mesh = mesh
        # global ranks in row-major mesh order, if the mesh is the whole world
        ranks = mesh.device_mesh.mesh.flatten().tolist()
        whole = sorted(ranks) == list(range(dist.get_world_size()))
        self._world_order = ranks if whole else None

    def describe(self, op: str, axis: str, reduce: str | None) -> str:
        mesh = self._mesh
        d = mesh.axis_names.index(axis)
        if mesh._inplace[d] and op != "all_gather":
            return "c10d in-place " + ("all_reduce+slice" if op == "reduce_scatter" else op)
        if mesh._c10d_gather[d] and op == "all_gather":
            return "c10d all_gather_into_tensor"
        if reduce == "avg" and not mesh._native_avg[d]:
            return "sum+div"
        return "native"

    def exchange(self, t: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        # Plain c10d all-gathers (not functional collectives), so that profiles of the
        # gradient collectives stay exact. Over every axis of a mesh that spans the world:
        # one all-gather over the default group (the per-call agreement: one round trip).
        mesh = self._mesh
        out = t.to(torch.device(mesh.device_mesh.device_type))
        if set(axes) == set(mesh.axis_names) and self._world_order is not None:
            parts = self._gather(out, None, mesh.axis_names)
            return torch.stack([parts[r] for r in self._world_order]).cpu()
        for axis in sorted(axes, key=mesh.axis_names.index, reverse=True):  # inner first
            out = torch.stack(self._gather(out, mesh.group(axis), axis))
        return out.reshape(-1, t.shape[-1]).cpu()

    def _gather(self, t: torch.Tensor, group: Any, axis: Any) -> list[torch.Tensor]:
        mesh = self._mesh
        size = dist.get_world_size(group)
        parts = [torch.empty_like(t) for _ in range(size)]
        with mesh.guard("exchange", axis):
            work = dist.all_gather(parts, t.contiguous(), group=group, async_op=True)
            work.wait(mesh.timeout) if mesh.timeout is not None else work.wait()
        return parts

    def members(self, axes: tuple[str, ...]) -> list[tuple[str, ...]]:
        mesh = self._mesh
        dims = {mesh.axis_names.index(a) for a in axes}
        index = tuple(slice(None) if d in dims else c for d, c in enumerate(mesh._coords))
        return [tuple(str(r) for r in mesh.device_mesh.mesh[index].flatten().tolist())]

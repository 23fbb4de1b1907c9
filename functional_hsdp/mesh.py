"""The mesh protocol and its two implementations.

Library code talks to a mesh only through :class:`Mesh`; it never asks which mesh it has.

- :class:`SimMesh` simulates every rank in one process: a distributed value is a tensor whose
  leading dims are the mesh shape (rank ``(o, i)`` holds ``x[o, i]``), and collectives are einops
  reductions and rearranges over those dims.
- :class:`DistMesh` wraps a real ``torch.distributed`` ``DeviceMesh``; collectives are
  ``torch.distributed._functional_collectives`` over ``(device_mesh, dim)``: asynchronous and
  traceable by ``torch.compile``. On gloo, eager reductions are asynchronous in-place c10d
  all-reduces of the library's own buffers instead (see ``_INPLACE``); a collective's result
  may be pending until :meth:`Mesh.wait`.

A *bucket* is a tensor ``(*batch_shape, L)``: one flat buffer per rank. ``batch_shape`` is the
mesh shape on a SimMesh and ``()`` on a DistMesh, so the same code handles both.

*Ragged* pieces: under a Flat placement a leaf's local shard is its part of the rank's chunk,
whose length differs between ranks. On a DistMesh that is a 1-D tensor of exactly that
length. On a SimMesh the ranks' pieces are stacked, each zero-filled at its end to the longest
rank's length; the fill is ignored on input and zero on output.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import einops
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

__all__ = ["Mesh", "SimMesh", "DistMesh"]

Coord = Any  # an int on a DistMesh, an int tensor of the batch shape on a SimMesh


@runtime_checkable
class Mesh(Protocol):
    """What the library needs from a mesh of data-parallel ranks."""

    axis_names: tuple[str, ...]
    sizes: tuple[int, ...]
    batch_shape: tuple[int, ...]
    ragged_views: bool  # whether ragged_split and narrow return views of their input

    def size(self, axis: str) -> int: ...

    def coordinate(self, axis: str) -> Coord: ...

    def all_reduce(self, buf: torch.Tensor, axis: str, op: str) -> torch.Tensor: ...

    def reduce_scatter(self, buf: torch.Tensor, axis: str, op: str) -> torch.Tensor:
        """This rank's chunk of the reduction. It may be *borrowed*: a view into a larger
        buffer of the library's (``result._base`` is not None) that is otherwise dead; keep a
        copy of it, not the view, in anything that outlives the call."""

    def all_gather(self, buf: torch.Tensor, axis: str) -> torch.Tensor: ...

    def chunk(self, buf: torch.Tensor, axis: str) -> torch.Tensor: ...

    def ragged(self, lo: Coord, hi: Coord, length: int) -> Any: ...

    def ragged_shape(self, geom: Any) -> tuple[int, ...]: ...

    def ragged_split(self, buf: torch.Tensor, geoms: list) -> list[torch.Tensor]: ...

    def ragged_join(self, pieces: list[torch.Tensor], geoms: list, length: int) -> torch.Tensor: ...

    def chunk_length(self, total: int, size: int, axis: str) -> Coord: ...

    def narrow(self, x: torch.Tensor, dim: int, length: Coord) -> torch.Tensor: ...

    def narrow_shape(self, shape: tuple[int, ...], dim: int, length: Coord) -> tuple[int, ...]: ...

    def wait(self, buf: torch.Tensor) -> torch.Tensor: ...

    def abandon(self, buf: torch.Tensor) -> None:
        """Forget a pending result that will never be waited for (an error after its
        collective was issued), so that it does not keep its buffer alive."""

    def impl(self, op: str, axis: str, reduce: str | None) -> str: ...

    def exchange(self, t: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor: ...

    def member_names(self, axes: tuple[str, ...]) -> list[tuple[str, ...]]: ...


class _MeshBase:
    axis_names: tuple[str, ...]
    sizes: tuple[int, ...]

    def _dim(self, axis: str) -> int:
        try:
            return self.axis_names.index(axis)
        except ValueError:
            raise ValueError(
                f"axis {axis!r} is not in the mesh; its axes are {self.axis_names}"
            ) from None

    def size(self, axis: str) -> int:
        """Number of ranks along ``axis``."""
        return self.sizes[self._dim(axis)]

    @property
    def shape(self) -> dict[str, int]:
        """``{axis name: size}`` in axis order (outer to inner)."""
        return dict(zip(self.axis_names, self.sizes))

    @property
    def ndim(self) -> int:
        return len(self.axis_names)


@dataclass(frozen=True)
class _SimRagged:
    idx: torch.Tensor  # (*batch, maxlen) positions in the chunk; `length` marks fill
    valid: torch.Tensor  # (*batch, maxlen) bool
    maxlen: int


class SimMesh(_MeshBase):
    """All ranks of a mesh in one process; distributed values carry the mesh shape in front.

    Args:
        shape: ``{axis name: size}``, ordered outer to inner (like ``DeviceMesh`` dims).

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
        >>> x = torch.arange(4.0).reshape(2, 2, 1)        # rank (o, i) holds x[o, i]
        >>> fh.psum(x, "dp_inner", mesh)[:, :, 0]
        tensor([[1., 1.],
                [5., 5.]])
    """

    ragged_views = False  # ranks' pieces start at different offsets: gathered copies

    def __init__(self, shape: dict[str, int]):
        if not isinstance(shape, dict) or not shape:
            raise TypeError(f"SimMesh expects a non-empty dict {{axis name: size}}; got {shape!r}")
        for name, n in shape.items():
            if not isinstance(name, str) or not isinstance(n, int) or n < 1:
                raise ValueError(
                    f"SimMesh axis {name!r}: expected a str name and a positive int size; got {n!r}"
                )
        self.axis_names = tuple(shape)
        self.sizes = tuple(shape.values())
        self.batch_shape = self.sizes
        names = [f"m{k}" for k in range(len(self.sizes))]
        self._names = names
        self._coords: dict[str, torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"SimMesh({self.shape})"

    def _pattern(self, dim: int, repl: str) -> str:
        return " ".join(repl if k == dim else n for k, n in enumerate(self._names))

    def coordinate(self, axis: str) -> torch.Tensor:
        """Every rank's index along ``axis``, as an int64 tensor of the mesh shape."""
        if axis not in self._coords:
            d = self._dim(axis)
            view = [1] * self.ndim
            view[d] = self.sizes[d]
            self._coords[axis] = torch.arange(self.sizes[d]).reshape(view).expand(self.sizes)
        return self._coords[axis]

    def all_reduce(self, buf: torch.Tensor, axis: str, op: str) -> torch.Tensor:
        d, all_ = self._dim(axis), " ".join(self._names)
        kept = self._pattern(d, "1")
        red = einops.reduce(buf, f"{all_} l -> {kept} l", _EINOPS_REDUCE[op])
        return einops.repeat(red, f"{kept} l -> {all_} l", **{self._names[d]: self.sizes[d]})

    def reduce_scatter(self, buf: torch.Tensor, axis: str, op: str) -> torch.Tensor:
        d, all_ = self._dim(axis), " ".join(self._names)
        return einops.reduce(
            buf,
            f"{all_} (n c) -> {self._pattern(d, 'n')} c",
            _EINOPS_REDUCE[op],
            n=self.sizes[d],
        )

    def all_gather(self, buf: torch.Tensor, axis: str) -> torch.Tensor:
        d, all_ = self._dim(axis), " ".join(self._names)
        return einops.repeat(
            buf, f"{all_} c -> {self._pattern(d, 'r')} ({self._names[d]} c)", r=self.sizes[d]
        )

    def chunk(self, buf: torch.Tensor, axis: str) -> torch.Tensor:
        d, all_ = self._dim(axis), " ".join(self._names)
        split = einops.rearrange(buf, f"{all_} (n c) -> {all_} n c", n=self.sizes[d])
        index = self.coordinate(axis)[..., None, None]
        return torch.take_along_dim(split, index, dim=self.ndim).squeeze(self.ndim)

    def ragged(self, lo: Coord, hi: Coord, length: int) -> _SimRagged:
        lo = torch.as_tensor(lo).broadcast_to(self.batch_shape).clamp(0, length)
        hi = torch.as_tensor(hi).broadcast_to(self.batch_shape).clamp(0, length)
        hi = torch.maximum(hi, lo)
        maxlen = int((hi - lo).max()) if hi.numel() else 0
        idx = lo[..., None] + torch.arange(maxlen)
        valid = idx < hi[..., None]
        return _SimRagged(torch.where(valid, idx, length), valid, maxlen)

    def ragged_shape(self, geom: _SimRagged) -> tuple[int, ...]:
        return (*self.batch_shape, geom.maxlen)

    def ragged_split(self, buf: torch.Tensor, geoms: list) -> list[torch.Tensor]:
        # Pad once per bucket: index `length` (a rank's fill positions) reads the zero.
        padded = torch.nn.functional.pad(buf, (0, 1))
        return [torch.take_along_dim(padded, g.idx, dim=-1) for g in geoms]

    def ragged_join(self, pieces: list[torch.Tensor], geoms: list, length: int) -> torch.Tensor:
        dtype = pieces[0].dtype if pieces else torch.float32
        device = pieces[0].device if pieces else None
        out = torch.zeros((*self.batch_shape, length + 1), dtype=dtype, device=device)
        for piece, geom in zip(pieces, geoms):
            out.scatter_(-1, geom.idx, torch.where(geom.valid, piece, 0))
        return out[..., :length]

    def chunk_length(self, total: int, size: int, axis: str) -> torch.Tensor:
        """Each rank's torch.chunk length: chunks of ``size`` along ``axis`` of ``total``."""
        return (total - self.coordinate(axis) * size).clamp(0, size)

    def narrow(self, x: torch.Tensor, dim: int, length: torch.Tensor) -> torch.Tensor:
        """Zero everything past each rank's ``length`` along ``dim`` (ranks stay stacked)."""
        view = [1] * x.dim()
        view[dim] = x.shape[dim]
        index = torch.arange(x.shape[dim], device=x.device).view(view)
        lengths = length.reshape(*self.batch_shape, *[1] * (x.dim() - self.ndim))
        return torch.where(index < lengths.to(x.device), x, 0)

    def narrow_shape(self, shape: tuple[int, ...], dim: int, length: torch.Tensor) -> tuple:
        return (*self.batch_shape, *shape)

    def wait(self, buf: torch.Tensor) -> torch.Tensor:
        return buf

    def abandon(self, buf: torch.Tensor) -> None:
        pass

    def impl(self, op: str, axis: str, reduce: str | None) -> str:
        return "einops"

    def exchange(self, t: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        """Validation (not logged): each rank's group's rows of ``t`` ``(*batch, L)`` over
        ``axes``, as ``(*batch, G, L)``, G in row-major order of the group's coordinates."""
        dims = sorted(self._dim(a) for a in axes)
        all_, group = " ".join(self._names), " ".join(self._names[d] for d in dims)
        rest = " ".join(n for d, n in enumerate(self._names) if d not in dims)
        rows = einops.rearrange(t, f"{all_} l -> {rest} ({group}) l")
        sizes = {self._names[d]: self.sizes[d] for d in dims}
        return einops.repeat(rows, f"{rest} g l -> {all_} g l", **sizes)

    def member_names(self, axes: tuple[str, ...]) -> list[tuple[str, ...]]:
        """For each rank (row-major), its group's members over ``axes``, as coordinates."""
        dims = sorted(self._dim(a) for a in axes)
        out = []
        for coord in itertools.product(*map(range, self.sizes)):
            members = []
            for g in itertools.product(*(range(self.sizes[d]) for d in dims)):
                c = list(coord)
                for d, v in zip(dims, g):
                    c[d] = v
                members.append(str(c[0]) if self.ndim == 1 else str(tuple(c)))
            out.append(tuple(members))
        return out


_EINOPS_REDUCE = {"sum": "sum", "avg": "mean"}

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


class DistMesh(_MeshBase):
    """A real ``torch.distributed`` device mesh (gloo, NCCL; torchrun for many machines).

    Args:
        device_mesh: a ``DeviceMesh`` built with ``mesh_dim_names``; its dims are the axes,
            outer to inner.
        overlap: True (default): collectives are asynchronous; the library issues every
            bucket's collective before it waits on any, so buckets overlap each other and
            packing. False: each collective is waited for as soon as it is issued (for
            debugging, and to measure what overlap gains).

    Example:
        >>> import functional_hsdp as fh
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> dm = init_device_mesh(  # doctest: +SKIP
        ...     "cuda", (2, 4), mesh_dim_names=("dp_outer", "dp_inner"))
        >>> mesh = fh.DistMesh(dm)  # doctest: +SKIP
    """

    batch_shape: tuple[int, ...] = ()
    ragged_views = True

    def __init__(self, device_mesh: Any, *, overlap: bool = True):
        if not isinstance(overlap, bool):
            raise TypeError(f"DistMesh: overlap must be a bool; got {overlap!r}")
        self.overlap = overlap
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
        self._coords = tuple(int(device_mesh.get_local_rank(d)) for d in range(self.ndim))

    def __repr__(self) -> str:
        return f"DistMesh({self.shape}{'' if self.overlap else ', overlap=False'})"

    def _group(self, axis: str) -> tuple[Any, int]:
        return (self.device_mesh, self._dim(axis))

    def coordinate(self, axis: str) -> int:
        return self._coords[self._dim(axis)]

    def _reduce(self, fn, axis: str, op: str) -> torch.Tensor:
        if op == "avg" and not self._native_avg[self._dim(axis)]:
            return fn("sum") / self.size(axis)
        return fn(op)

    # Each collective first waits on its input (the previous step's collective on this
    # bucket): other buckets' collectives are already in flight, and handing an unwaited
    # result to the next collective would dispatch the op twice.

    def all_reduce(self, buf: torch.Tensor, axis: str, op: str) -> torch.Tensor:
        buf, group = self.wait(buf), self._group(axis)
        if self._inplace[self._dim(axis)] and not torch.compiler.is_compiling():
            return self._issue_inplace(buf, axis, op, "all_reduce")
        with self._guard("all_reduce", axis):
            out = self._reduce(lambda o: funcol.all_reduce(buf, o, group), axis, op)
        return self._pending(out, "all_reduce", axis)

    def reduce_scatter(self, buf: torch.Tensor, axis: str, op: str) -> torch.Tensor:
        buf, group = self.wait(buf), self._group(axis)
        if self._inplace[self._dim(axis)] and not torch.compiler.is_compiling():
            # The result is this rank's chunk as a view of the all-reduced buffer: a *borrowed*
            # result (see Mesh.reduce_scatter), so that a consumer that makes a new tensor
            # anyway (adding acc, MainGrad's add into its buffer) needs no copy of it.
            return self._issue_inplace(buf, axis, op, "reduce_scatter")
        with self._guard("reduce_scatter", axis):
            out = self._reduce(lambda o: funcol.reduce_scatter_single(buf, o, 0, group), axis, op)
        return self._pending(out, "reduce_scatter", axis)

    def all_gather(self, buf: torch.Tensor, axis: str) -> torch.Tensor:
        buf, group = self.wait(buf), self._group(axis)
        with self._guard("all_gather", axis):
            out = funcol.all_gather_single(buf, 0, group)
        return self._pending(out, "all_gather", axis)

    def _issue_inplace(self, buf: torch.Tensor, axis: str, op: str, name: str) -> torch.Tensor:
        """Start an asynchronous c10d all-reduce of ``buf`` in place and return ``buf``,
        pending: :meth:`wait` waits for it and returns the buffer (``name`` "all_reduce") or
        this rank's chunk of it ("reduce_scatter"). ``buf`` is always one of the library's
        own buffers (a fresh packing buffer, a collective's result or MainGrad's buffer),
        never a caller's tensor."""
        with self._guard(name, axis):
            work = dist.all_reduce(
                buf,
                op=dist.ReduceOp.AVG if op == "avg" else dist.ReduceOp.SUM,
                group=self.device_mesh.get_group(self._dim(axis)),
                async_op=True,
            )
        buf._fh_pending = (work, name, axis)
        return buf if self.overlap else self.wait(buf)

    # A failed or timed-out collective raises CollectiveError naming it (op, axis): at issue,
    # or (gloo, usually) at the wait, so a pending result remembers which collective it is.

    @contextlib.contextmanager
    def _guard(self, op: str, axis: str | None) -> Iterator[None]:
        try:
            yield
        except RuntimeError as e:
            raise self._failed(op, axis, e) from e

    def _pending(self, out: torch.Tensor, op: str, axis: str) -> torch.Tensor:
        if isinstance(out, funcol.AsyncCollectiveTensor):
            out._fh_collective = (op, axis)
        return out if self.overlap else self.wait(out)

    def _failed(self, op: str, axis: str | None, exc: BaseException) -> Exception:
        from .validate import collective_error

        timeout = None
        if axis is not None:
            try:
                group = self.device_mesh.get_group(self._dim(axis))
                device = torch.device(self.device_mesh.device_type)
                timeout = group._get_backend(device).options._timeout
            except Exception:  # private API; the message just omits the timeout
                pass
        return collective_error(op, axis, self, exc, rank=dist.get_rank(), timeout=timeout)

    def chunk(self, buf: torch.Tensor, axis: str) -> torch.Tensor:
        # A copy, so that a rank's shards do not keep the whole buffer alive.
        return self._chunk(self.wait(buf), axis).clone()

    def _chunk(self, buf: torch.Tensor, axis: str) -> torch.Tensor:
        n = self.size(axis)
        return buf.view(n, buf.shape[-1] // n)[self.coordinate(axis)]

    def ragged(self, lo: int, hi: int, length: int) -> tuple[int, int]:
        lo = min(max(lo, 0), length)
        return lo, max(lo, min(max(hi, 0), length))

    def ragged_shape(self, geom: tuple[int, int]) -> tuple[int, ...]:
        return (geom[1] - geom[0],)

    def ragged_split(self, buf: torch.Tensor, geoms: list) -> list[torch.Tensor]:
        # Consecutive leaves' pieces tile the chunk from 0 (pieces outside it are empty), so
        # one split gives every view.
        sizes = [hi - lo for lo, hi in geoms]
        return list(torch.split(buf, [*sizes, buf.shape[-1] - sum(sizes)]))[:-1]

    def ragged_join(self, pieces: list[torch.Tensor], geoms: list, length: int) -> torch.Tensor:
        # Pieces of consecutive leaves tile the chunk from 0; only the bucket tail is fill.
        used = sum(g[1] - g[0] for g in geoms)
        dtype = pieces[0].dtype if pieces else torch.float32
        device = pieces[0].device if pieces else None
        fill = torch.zeros(length - used, dtype=dtype, device=device)
        return torch.cat([*pieces, fill])

    def chunk_length(self, total: int, size: int, axis: str) -> int:
        return min(max(total - self.coordinate(axis) * size, 0), size)

    def narrow(self, x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
        return x.narrow(dim, 0, length)

    def narrow_shape(self, shape: tuple[int, ...], dim: int, length: int) -> tuple[int, ...]:
        return tuple(length if k == dim else n for k, n in enumerate(shape))

    def wait(self, buf: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # traced: funcol results only
            return funcol.wait_tensor(buf) if isinstance(buf, funcol.AsyncCollectiveTensor) else buf
        pending = buf.__dict__.pop("_fh_pending", None)
        if pending is not None:
            work, name, axis = pending
            with self._guard(name, axis):
                work.wait()
            return self._chunk(buf, axis) if name == "reduce_scatter" else buf
        if not isinstance(buf, funcol.AsyncCollectiveTensor):
            return buf
        with self._guard(*getattr(buf, "_fh_collective", ("a collective", None))):
            return funcol.wait_tensor(buf)

    def abandon(self, buf: torch.Tensor) -> None:
        # The c10d work still holds the tensor until it completes; dropping our reference
        # to the work lets both go then. Its error, if any, is not reported: the
        # caller is already raising another.
        if isinstance(buf, torch.Tensor):
            buf.__dict__.pop("_fh_pending", None)

    def impl(self, op: str, axis: str, reduce: str | None) -> str:
        d = self._dim(axis)
        if self._inplace[d] and op != "all_gather":
            return "c10d in-place " + ("all_reduce+slice" if op == "reduce_scatter" else op)
        if reduce == "avg" and not self._native_avg[d]:
            return "sum+div"
        return "native"

    def exchange(self, t: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        """Validation (not logged, not a functional collective): every rank's ``t`` ``(L,)``
        in this rank's group over ``axes``, as ``(G, L)`` in row-major coordinate order."""
        out = t.to(torch.device(self.device_mesh.device_type))
        for d in sorted((self._dim(a) for a in axes), reverse=True):  # inner axes first
            parts = [torch.empty_like(out) for _ in range(self.sizes[d])]
            with self._guard("exchange", self.axis_names[d]):
                dist.all_gather(parts, out.contiguous(), group=self.device_mesh.get_group(d))
            out = torch.stack(parts)
        return out.reshape(-1, t.shape[-1]).cpu()

    def member_names(self, axes: tuple[str, ...]) -> list[tuple[str, ...]]:
        """The global ranks of this rank's group over ``axes`` (one group: a DistMesh rank)."""
        dims = {self._dim(a) for a in axes}
        index = tuple(slice(None) if d in dims else c for d, c in enumerate(self._coords))
        return [tuple(str(r) for r in self.device_mesh.mesh[index].flatten().tolist())]

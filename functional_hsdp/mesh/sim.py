"""SimMesh: every rank of a mesh in one process.

A distributed value is a tensor whose leading dims are the mesh shape (rank ``(o, i)`` holds
``x[o, i]``); collectives are einops reductions and rearranges over those dims. Results never
alias across ranks: each rank's value is its own memory, as on a real mesh.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import einops
import numpy as np
import torch

from .protocol import Flight, MeshAxes

__all__ = ["SimMesh", "per_rank"]

_EINOPS_REDUCE = {"sum": "sum", "avg": "mean"}


class SimMesh(MeshAxes):
    """All ranks of a mesh in one process; distributed values carry the mesh shape in front.

    Args:
        shape: ``{axis name: size}``, ordered outer to inner (like ``DeviceMesh`` dims).
        replicas: a simulated quorum (:func:`~functional_hsdp.simulated_quorum`) for one
            axis: a mean over that axis is over the current quorum's participants.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
        >>> x = torch.arange(4.0).reshape(2, 2, 1)        # rank (o, i) holds x[o, i]
        >>> fh.psum(x, "dp_inner", mesh)[:, :, 0]
        tensor([[1., 1.],
                [5., 5.]])
    """

    def __init__(self, shape: dict[str, int], *, replicas: Any = None):
        if not isinstance(shape, dict) or not shape:
            raise TypeError(f"SimMesh expects a non-empty dict {{axis name: size}}; got {shape!r}")
        for name, n in shape.items():
            if not isinstance(name, str) or isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(
                    f"SimMesh axis {name!r}: expected a str name and a positive int size; got {n!r}"
                )
        self.axis_names = tuple(shape)
        self.sizes = tuple(shape.values())
        self.batch_shape = self.sizes
        self._names = [f"m{k}" for k in range(len(self.sizes))]
        self._coords = {a: _coordinates(self.sizes, d) for d, a in enumerate(self.axis_names)}
        self.geometry = SimGeometry(self)
        self.diagnostics = SimDiagnostics(self)
        self.replicas = replicas
        if replicas is not None:
            from .replicas import SimQuorum

            if not isinstance(replicas, SimQuorum):
                raise TypeError(
                    "SimMesh: replicas must be fh.simulated_quorum(axis=..., alive=...); got "
                    f"{replicas!r}"
                )
            replicas.bind(self)

    def __repr__(self) -> str:
        more = f", replicas={self.replicas!r}" if self.replicas is not None else ""
        return f"SimMesh({self.shape}{more})"

    @property
    def apart_axes(self) -> tuple[str, ...]:
        """Axes no cross-rank check crosses: a simulated quorum's replica axis."""
        return (self.replicas.axis,) if self.replicas is not None else ()

    def _only_reduce(self, op: str, axis: str) -> None:
        if self.replicas is not None and axis == self.replicas.axis:
            raise ValueError(
                f"{op} over the simulated fault-tolerant axis {axis!r}: only all-reduces run "
                "over a simulated quorum's axis (nothing sharded over it, no compressed route)"
            )

    def _pattern(self, dim: int, repl: str) -> str:
        return " ".join(repl if k == dim else n for k, n in enumerate(self._names))

    def coordinate(self, axis: str) -> np.ndarray:
        """Every rank's index along ``axis``: an int64 numpy array of the mesh shape (host
        data: layout arithmetic never touches a device, or a tensor)."""
        return self._coords[self.axis_names[self._dim(axis)]]

    def all_reduce(self, buf: torch.Tensor, axis: str, op: str) -> torch.Tensor:
        """Every rank gets the reduction over its group along ``axis``."""
        if self.replicas is not None and axis == self.replicas.axis:
            return self.replicas.all_reduce(self, buf, op)
        d, all_ = self._dim(axis), " ".join(self._names)
        kept = self._pattern(d, "1")
        red = einops.reduce(buf, f"{all_} l -> {kept} l", _EINOPS_REDUCE[op])
        # materialized: each rank's copy is its own memory, as on a real mesh
        return red.expand(buf.shape).contiguous()

    def reduce_scatter(self, buf: torch.Tensor, axis: str, op: str) -> torch.Tensor:
        """Every rank gets its chunk of the reduction over its group along ``axis``."""
        self._only_reduce("reduce_scatter", axis)
        d, all_ = self._dim(axis), " ".join(self._names)
        return einops.reduce(
            buf,
            f"{all_} (n c) -> {self._pattern(d, 'n')} c",
            _EINOPS_REDUCE[op],
            n=self.sizes[d],
        )

    def all_gather(self, buf: torch.Tensor, axis: str) -> torch.Tensor:
        """Every rank gets its group's chunks along ``axis``, concatenated."""
        self._only_reduce("all_gather", axis)
        d, all_ = self._dim(axis), " ".join(self._names)
        out = einops.repeat(
            buf, f"{all_} c -> {self._pattern(d, 'r')} ({self._names[d]} c)", r=self.sizes[d]
        )
        return out.contiguous()

    def all_to_all(self, buf: torch.Tensor, axis: str, *, counts: Any, length: int) -> torch.Tensor:
        """Every rank gets the blocks its group's members send it (``counts``), in order.
        Python ints only (no numpy): a traced program runs it."""
        self._only_reduce("all_to_all", axis)
        d, n = self._dim(axis), self.sizes[self._dim(axis)]
        parts = []
        for rank in itertools.product(*(range(size) for size in self.sizes)):
            got = 0
            for s in range(n):
                src = (*rank[:d], s, *rank[d + 1 :])
                row = counts[src]
                count = row[rank[d]]
                parts.append(buf[src].narrow(-1, sum(row[: rank[d]]), count))
                got += count
            parts.append(buf.new_zeros(length - got))
        return torch.cat(parts).view(*self.sizes, length)

    def wait(self, x: torch.Tensor | Flight) -> torch.Tensor:
        """SimMesh collectives finish at once: ``x`` is already the result."""
        return x

    def abandon(self, x: torch.Tensor | Flight) -> None:
        """Nothing is ever in flight on a SimMesh."""


def _coordinates(sizes: tuple[int, ...], d: int) -> np.ndarray:
    view = [1] * len(sizes)
    view[d] = sizes[d]
    return np.broadcast_to(np.arange(sizes[d], dtype=np.int64).reshape(view), sizes)


class _OnDevice:
    """Host integers (a numpy array) and their tensor on each device they were used on,
    copied there once (a plan's geometry is built once and used on every call)."""

    def __init__(self, values: np.ndarray):
        self.values = values
        self._on: dict[torch.device, torch.Tensor] = {}

    def on(self, device: torch.device) -> torch.Tensor:
        t = self._on.get(device)
        if t is None:
            t = self._on[device] = torch.from_numpy(np.array(self.values, copy=True)).to(device)
        return t


@dataclass(frozen=True)
class _Pieces:
    """Ragged pieces of a chunk, for every rank at once."""

    index: _OnDevice  # (*batch, total) positions in the chunk; `length` marks fill
    valid: _OnDevice  # (*batch, total) bool
    widths: tuple[int, ...]  # each piece's stacked width (the longest rank's length)
    length: int
    # No rank has fill (every piece is as wide on every rank, as when the chunk is the whole
    # bucket: a size-1 Flat axis): the pieces tile each rank's chunk from 0, the same way on
    # every rank, so they are views of the chunk's first `sum(widths)` elements.
    views: bool = False


class SimGeometry:
    """Geometry on a SimMesh: coordinates are numpy arrays of the mesh shape; pieces are
    stacked and zero-filled to the longest rank's length, so they are gathered copies, except
    where no rank needs fill (``_Pieces.views``, the plan's per-bucket answer): then they are
    views of each rank's own row of the chunk, so results still never alias across ranks.

    Layout arithmetic runs on the host (numpy) when a plan is built; the index tensors a call
    uses are made once per device, on the device of the buffers they index.
    """

    views = False  # in general; a plan reads each bucket's answer from its pieces

    def __init__(self, mesh: SimMesh):
        self._mesh = mesh
        self._chunk_index = {a: _OnDevice(c[..., None, None]) for a, c in mesh._coords.items()}

    def chunk(self, buf: torch.Tensor, axis: str) -> torch.Tensor:
        mesh = self._mesh
        d, all_ = mesh._dim(axis), " ".join(mesh._names)
        split = einops.rearrange(buf, f"{all_} (n c) -> {all_} n c", n=mesh.sizes[d])
        index = self._chunk_index[mesh.axis_names[d]].on(buf.device)
        return torch.take_along_dim(split, index, dim=mesh.ndim).squeeze(mesh.ndim)

    def pieces(self, start: np.ndarray, ranges: list[tuple[int, int]], length: int) -> _Pieces:
        batch = self._mesh.batch_shape
        start = np.broadcast_to(np.asarray(start, dtype=np.int64), batch)[..., None]
        offsets = np.array([o for o, _ in ranges], dtype=np.int64)
        ends = offsets + np.array([n for _, n in ranges], dtype=np.int64)
        lo = np.clip(offsets - start, 0, length)  # (*batch, K)
        hi = np.maximum(np.clip(ends - start, 0, length), lo)
        widths = (hi - lo).reshape(-1, len(ranges)).max(0) if ranges else np.zeros(0, np.int64)
        owner = np.repeat(np.arange(len(ranges)), widths)
        first = np.cumsum(widths) - widths
        within = np.arange(int(widths.sum())) - first[owner]
        index = lo[..., owner] + within
        valid = index < hi[..., owner]
        index = np.where(valid, index, length)
        views = bool(valid.all())
        return _Pieces(
            index=_OnDevice(index),
            valid=_OnDevice(valid),
            widths=tuple(widths.tolist()),
            length=length,
            views=views,
        )

    def piece_shapes(self, pieces: _Pieces) -> list[tuple[int, ...]]:
        return [(*self._mesh.batch_shape, w) for w in pieces.widths]

    def split(self, buf: torch.Tensor, pieces: _Pieces) -> list[torch.Tensor]:
        if pieces.views:  # no fill anywhere: each rank's pieces tile its row from 0
            total = sum(pieces.widths)
            if total != buf.shape[-1]:
                buf = buf.narrow(-1, 0, total)
            return list(buf.split_with_sizes(pieces.widths, -1))
        # one gather for the whole chunk: index `length` (a rank's fill) reads the zero pad
        index = pieces.index.on(buf.device)
        gathered = torch.take_along_dim(torch.nn.functional.pad(buf, (0, 1)), index, -1)
        return list(torch.split(gathered, pieces.widths, dim=-1))

    def join(
        self, values: list[torch.Tensor], pieces: _Pieces, *, dtype: torch.dtype, device: Any
    ) -> torch.Tensor:
        batch = self._mesh.batch_shape
        if pieces.views:  # no fill to drop: concatenate, and zero the chunk's tail
            tail = pieces.length - sum(pieces.widths)
            if tail or not values:
                values = [*values, torch.zeros((*batch, tail), dtype=dtype, device=device)]
            return torch.cat(values, dim=-1)
        out = torch.zeros((*batch, pieces.length + 1), dtype=dtype, device=device)
        if values:
            index = pieces.index.on(out.device)
            valid = pieces.valid.on(out.device)
            source = torch.where(valid, torch.cat(values, dim=-1), 0).to(dtype)
            out.scatter_(-1, index, source)  # fill lands on the dropped last column
        return out.narrow(-1, 0, pieces.length)

    def chunk_length(self, total: int, size: int, axis: str) -> _OnDevice:
        return _OnDevice(np.clip(total - self._mesh.coordinate(axis) * size, 0, size))

    def narrow(self, x: torch.Tensor, dim: int, length: _OnDevice) -> torch.Tensor:
        batch = self._mesh.batch_shape
        view = [1] * x.dim()
        view[dim] = x.shape[dim]
        index = torch.arange(x.shape[dim], device=x.device).view(view)
        lengths = length.on(x.device).reshape(*batch, *[1] * (x.dim() - len(batch)))
        return torch.where(index < lengths, x, 0)

    def narrow_shape(self, shape: tuple[int, ...], dim: int, length: _OnDevice) -> tuple:
        return (*self._mesh.batch_shape, *shape)


class SimDiagnostics:
    """Descriptions and the validation exchange on a SimMesh (einops, in one process)."""

    def __init__(self, mesh: SimMesh):
        self._mesh = mesh
        self._members: dict[tuple[str, ...], list[tuple[str, ...]]] = {}
        self._within: dict[tuple[str, ...], SimScope] = {}

    def describe(self, op: str, axis: str, reduce: str | None) -> str:
        return "einops"

    def start_max(self, t: torch.Tensor) -> Callable[[], torch.Tensor]:
        # every rank's row, then its maximum: what each rank of a real mesh ends up with
        # (a real mesh never gathers the rows; in one process they are all here anyway)
        wait = self.start_exchange(t)
        return lambda: wait().amax(-2)

    def start_exchange(self, t: torch.Tensor) -> Callable[[], torch.Tensor]:
        out = self.exchange(t, self._mesh.axis_names)  # in one process: done at once
        return lambda: out

    def exchange(self, t: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        # plain permute/reshape/expand (einops parses its patterns on every call, and this
        # runs once per library call)
        mesh = self._mesh
        sizes, nd = mesh.sizes, mesh.ndim
        dims = sorted(mesh._dim(a) for a in axes)
        rest = [d for d in range(nd) if d not in dims]
        group = 1
        for d in dims:
            group *= sizes[d]
        rows = t.permute(*rest, *dims, nd).reshape(*(sizes[d] for d in rest), group, t.shape[-1])
        # every rank of a group sees the group's rows: broadcast over the group's dims
        kept = [sizes[d] if d in rest else 1 for d in range(nd)]
        out = rows.reshape(*kept, group, t.shape[-1]).expand(*sizes, group, t.shape[-1])
        return out.contiguous()

    def within(self, axes: tuple[str, ...]) -> SimScope:
        """The exchange among each rank's group over ``axes`` only (made once per axes)."""
        scope = self._within.get(tuple(axes))
        if scope is None:
            scope = self._within[tuple(axes)] = SimScope(self, tuple(axes))
        return scope

    def members(self, axes: tuple[str, ...]) -> list[tuple[str, ...]]:
        known = self._members.get(tuple(axes))
        if known is None:  # the same for every call on this mesh: built once per axes
            known = self._members[tuple(axes)] = self._members_of(axes)
        return list(known)

    def _members_of(self, axes: tuple[str, ...]) -> list[tuple[str, ...]]:
        mesh = self._mesh
        dims = sorted(mesh._dim(a) for a in axes)
        out = []
        for coord in itertools.product(*map(range, mesh.sizes)):
            names = []
            for g in itertools.product(*(range(mesh.sizes[d]) for d in dims)):
                c = list(coord)
                for d, v in zip(dims, g):
                    c[d] = v
                names.append(str(c[0]) if mesh.ndim == 1 else str(tuple(c)))
            out.append(tuple(names))
        return out


def per_rank(fn: Callable, mesh: Any) -> Callable:
    """``fn`` applied to every rank's values: ``vmap`` over the mesh dims of a SimMesh (all
    arguments and results carry them), ``fn`` itself on a DistMesh.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> f = fh.per_rank(lambda w, x: w @ x, fh.SimMesh({"dp": 3}))
        >>> f(torch.ones(3, 2, 2), torch.ones(3, 2)).shape
        torch.Size([3, 2])
    """
    for _ in mesh.batch_shape:
        fn = torch.func.vmap(fn)
    return fn


class SimScope:
    """:class:`SimDiagnostics` whose summary and exchange span each rank's group over
    ``axes`` only (a replicas spec's agreement)."""

    def __init__(self, diagnostics: SimDiagnostics, axes: tuple[str, ...]):
        self._base, self._axes = diagnostics, axes

    def describe(self, op: str, axis: str, reduce: str | None) -> str:
        return self._base.describe(op, axis, reduce)

    def start_max(self, t: torch.Tensor) -> Callable[[], torch.Tensor]:
        out = self._base.exchange(t, self._axes).amax(-2)
        return lambda: out

    def start_exchange(self, t: torch.Tensor) -> Callable[[], torch.Tensor]:
        out = self._base.exchange(t, self._axes)
        return lambda: out

    def exchange(self, t: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        return self._base.exchange(t, axes)

    def members(self, axes: tuple[str, ...]) -> list[tuple[str, ...]]:
        return self._base.members(axes)

"""The mesh protocol: everything library code asks of a mesh.

Library code is written once against :class:`Mesh` and never asks which mesh it has.
:class:`Mesh` declares thirteen members: its axes (``axis_names``, ``sizes``, ``size``,
``batch_shape``), this rank's ``coordinate``, the four bucket collectives (``all_reduce``,
``reduce_scatter``, ``all_gather``, ``all_to_all``), ``wait`` and ``abandon``, and two
companions: ``mesh.geometry`` (a :class:`Geometry`: where each rank's piece of a bucket lies,
and slicing and joining pieces) and ``mesh.diagnostics`` (a :class:`Diagnostics`: how a
collective was carried out, and the uncounted host-side exchanges the cross-rank checks use).
Buckets and collectives in flight: :class:`Mesh`, :class:`Flight`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Coord", "Diagnostics", "Flight", "Geometry", "Mesh", "MeshAxes"]

Coord = Any  # an int on a DistMesh; an int64 numpy array of the mesh shape on a SimMesh


@dataclass(eq=False)
class Flight:
    """A collective in flight on one axis: the backend's handle, read by the mesh that
    issued it (:meth:`Mesh.wait`, :meth:`Mesh.abandon`).

    Not a :class:`~functional_hsdp.runtime.flight.InFlight`: only its mesh knows how to wait for it
    (library code waits a tensor and a Flight alike, ``mesh.wait(x)``, and a SimMesh never
    returns one), and it keeps no result or error of its own; the ``InFlight`` that holds it
    (a reduction issued and not yet waited for) keeps them, and waits for it once.

    A collective may return a Flight instead of a tensor: the collective is running and its
    result must not be read until :meth:`Mesh.wait` returns it. The record is explicit (no
    state hidden on tensors): whoever holds it either waits for it or abandons it.

    Attributes:
        op: the collective (``"all_reduce"``, ``"reduce_scatter"``, ``"all_gather"``,
            ``"all_to_all"``).
        axis: the mesh axis.
        buffer: the tensor the collective writes (the result, or for a reduce-scatter done as
            an in-place all-reduce, the whole buffer whose chunk is the result).
        work: the backend's handle (a c10d ``Work``), or None when ``buffer`` waits itself
            (a functional collective's result).
        chunk: whether the result is this rank's chunk of ``buffer`` along ``axis``.
        source: the input of a collective that does not write in place, held until the
            collective is waited (or abandoned), so that it outlives the backend's use of it.
        divide: for an AVG emulated as SUM, the group size the waited sum is divided by.
        release: for a functional collective, what waits for it if it is abandoned or
            dropped unwaited (a ``weakref.finalize``), so that torch's registry lets it go.
        length: for an all-to-all whose result may end early (a functional one), the length
            its waited result is zero-padded to.
    """

    op: str
    axis: str
    buffer: torch.Tensor
    work: Any = None
    chunk: bool = False
    source: torch.Tensor | None = None
    divide: int | None = None
    release: Any = None
    length: int | None = None


@runtime_checkable
class Mesh(Protocol):
    """What the library needs from a mesh of data-parallel ranks.

    Buckets: a bucket is a tensor ``(*batch_shape, L)``: one flat buffer per rank.
    ``batch_shape`` is the mesh shape on a :class:`~functional_hsdp.SimMesh` (rank ``(o, i)``
    holds ``x[o, i]``) and ``()`` on a :class:`~functional_hsdp.DistMesh`, so the same code
    serves both. A collective returns a tensor or, while it runs, a
    :class:`~functional_hsdp.mesh.protocol.Flight`."""

    axis_names: tuple[str, ...]
    """The axes, outer to inner (like ``DeviceMesh`` dims)."""

    sizes: tuple[int, ...]
    """Ranks along each axis, in axis order."""

    batch_shape: tuple[int, ...]
    """Leading dims of every distributed value: the mesh shape (SimMesh) or ``()``."""

    geometry: Geometry
    """Where each rank's piece of a bucket lies (see :class:`Geometry`)."""

    diagnostics: Diagnostics
    """Descriptions and the uncounted exchanges (see :class:`Diagnostics`)."""

    def size(self, axis: str) -> int:
        """Ranks along ``axis``; ValueError naming the mesh's axes if it has no such axis."""

    def coordinate(self, axis: str) -> Coord:
        """This rank's index along ``axis`` (every rank's, as a numpy array of the mesh
        shape, on a SimMesh). Host data: layout arithmetic never touches a device."""

    def all_reduce(self, buf: torch.Tensor, axis: str, op: str) -> torch.Tensor | Flight:
        """Reduce ``buf`` over ``axis`` with ``op`` (``"avg"``/``"sum"``); every rank gets the
        result. ``buf`` is the library's own buffer and may be reduced in place."""

    def reduce_scatter(self, buf: torch.Tensor, axis: str, op: str) -> torch.Tensor | Flight:
        """Reduce ``buf`` over ``axis`` and keep this rank's equal chunk of the last dim.

        The waited result may be *borrowed*: a view into a larger buffer of the library's
        that is otherwise dead (``result._base`` is not None); keep a copy of it, not the
        view, in anything that outlives the call."""

    def all_gather(self, buf: torch.Tensor, axis: str) -> torch.Tensor | Flight:
        """Concatenate every rank's ``buf`` along the last dim, in coordinate order."""

    def all_to_all(
        self, buf: torch.Tensor, axis: str, *, counts: Any, length: int
    ) -> torch.Tensor | Flight:
        """Exchange blocks of uneven sizes between the ranks of each group along ``axis``.

        ``counts`` covers the whole mesh: for every rank's coordinates ``r`` (a tuple over
        every mesh axis), ``counts[r]`` is a tuple of ``n`` Python ints (``n`` the axis size):
        ``counts[r][d]`` elements go from rank ``r`` to the member of its group whose
        coordinate along ``axis`` is ``d``, taken from the front of ``r``'s buffer in the
        order of ``d``. (Plain Python, no arrays: a program ``torch.compile`` traces reads
        it.) Each rank receives its blocks in the order of
        their sources at the front of a buffer of ``length`` elements: the waited result
        (zeros after the blocks)."""

    def wait(self, x: torch.Tensor | Flight) -> torch.Tensor:
        """The result of a collective (a tensor passes through). Raises
        :class:`~functional_hsdp.CollectiveError` naming the collective and axis if it
        failed or timed out."""

    def abandon(self, x: torch.Tensor | Flight) -> None:
        """Forget a result that will never be waited for (an error after its collective was
        issued), so that it does not keep its buffer alive."""


@runtime_checkable
class Geometry(Protocol):
    """Per-rank layout arithmetic of a mesh: chunks, ragged pieces and narrowed chunks.

    Under a Flat placement a leaf's local value is its part of the rank's chunk, whose length
    differs between ranks (*ragged*). On a DistMesh that is a 1-D tensor of exactly that
    length; on a SimMesh the ranks' pieces are stacked, each zero-filled at its end to the
    longest rank's length (the fill is ignored on input and zero on output).
    """

    views: bool
    """Whether :meth:`split` returns views of the chunk it splits (else new tensors)."""

    def chunk(self, buf: torch.Tensor, axis: str) -> torch.Tensor:
        """This rank's equal chunk of ``buf``'s last dim along ``axis`` (a new tensor)."""

    def pieces(self, start: Coord, ranges: list[tuple[int, int]], length: int) -> Any:
        """The geometry of a chunk of ``length`` that starts at ``start`` in its bucket, for
        the consecutive ranges ``(offset, numel)`` of the bucket (its leaves', and the
        alignment padding between them as ranges of their own): each range's piece is the
        part of it that falls in the chunk (possibly empty)."""

    def piece_shapes(self, pieces: Any) -> list[tuple[int, ...]]:
        """The shape of every piece (batch dims in front)."""

    def split(self, buf: torch.Tensor, pieces: Any) -> list[torch.Tensor]:
        """Every leaf's piece of a chunk ``buf``."""

    def join(
        self, values: list[torch.Tensor], pieces: Any, *, dtype: torch.dtype, device: Any
    ) -> torch.Tensor:
        """The inverse of :meth:`split`: a new chunk (zero tail) holding ``values``, of
        ``dtype`` on ``device`` (the bucket's: ``values`` may be empty)."""

    def chunk_length(self, total: int, size: int, axis: str) -> Coord:
        """This rank's ``torch.chunk`` length: chunks of ``size`` along ``axis`` of ``total``."""

    def narrow(self, x: torch.Tensor, dim: int, length: Coord) -> torch.Tensor:
        """``x`` cut (DistMesh) or zeroed (SimMesh) past ``length`` along ``dim``."""

    def narrow_shape(self, shape: tuple[int, ...], dim: int, length: Coord) -> tuple[int, ...]:
        """The shape :meth:`narrow` gives a value of per-rank ``shape`` (batch dims in front)."""


@runtime_checkable
class Diagnostics(Protocol):
    """What a mesh tells about itself, and the host exchanges the cross-rank checks use."""

    def describe(self, op: str, axis: str, reduce: str | None) -> str:
        """How ``op`` runs on ``axis`` (``"native"``, ``"sum+div"``, ``"einops"``, ...)."""

    def start_max(self, t: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Issue the elementwise maximum of ``t`` (a CPU int64 row ``(*batch, L)``) over every
        rank of the mesh and return at once; calling the result waits for it and gives the
        maximum, ``(*batch, L)``, the same on every rank. What each rank sends and receives
        is a few rows, whatever the mesh's size: the agreement's healthy path. Host data
        only, as :meth:`start_exchange`. Not logged."""

    def start_exchange(self, t: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Issue the exchange of ``t`` (a CPU row ``(*batch, L)``) over every axis of the mesh
        and return at once; calling the result waits for it and gives every rank's row,
        ``(*batch, G, L)`` in row-major mesh order. Host data only: never a device tensor,
        so the host never waits for the device. Not logged."""

    def exchange(self, t: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        """Every group member's row ``t`` ``(*batch, L)`` over ``axes``, as
        ``(*batch, G, L)`` in row-major order of the group's coordinates (waited). Not
        logged."""

    def members(self, axes: tuple[str, ...]) -> list[tuple[str, ...]]:
        """For each local group over ``axes``, its members' names, in exchange order."""

    def within(self, axes: tuple[str, ...]) -> Diagnostics:
        """The same exchanges over each rank's group over ``axes`` only, in place of the
        whole mesh (``start_max``, ``start_exchange``, and ``exchange`` for ``axes`` among
        them): the agreement of a replicas spec, which nothing crosses the replica axes for.
        On a DistMesh no rank outside the group sends or receives anything."""


class MeshAxes:
    """Axis lookup for a mesh with ``axis_names`` and ``sizes`` (both meshes build on it)."""

    axis_names: tuple[str, ...]
    sizes: tuple[int, ...]
    #: whether axes of one rank carry collectives too (``DistMesh(issue_size_one=True)``);
    #: otherwise a size-1 axis moves nothing
    issue_size_one: bool = False

    def moves(self, axis: str) -> bool:
        """Whether a placement change along ``axis`` issues a collective."""
        return self.size(axis) > 1 or self.issue_size_one

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
        """Number of axes."""
        return len(self.axis_names)

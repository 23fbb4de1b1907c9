"""Placements of a value along one mesh axis, and the collective behind every transition.

``Replicate``, ``Partial`` and ``Shard`` are ``torch.distributed.tensor``'s own classes;
:class:`Flat` (flattened, bucketed, evenly chunked) and :class:`Owner` (each leaf whole on one
rank) are this library's. A move changes one mesh axis at a time: :func:`transition` names the
collective, and its docstring has the table of every move. Invariant: within one multi-axis
move, reduce-scatters (and slices) come first, in the bucket's split order, then all-reduces on
the already-scattered chunk, then all-gathers in reverse split order, so that every all-reduce
runs on the smallest piece of data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..base.torch_releases import placement_class

__all__ = [
    "Flat",
    "Owner",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "Step",
    "is_sharded",
    "reduce_op",
    "transition",
]

Collective = Literal["reduce_scatter", "all_reduce", "all_gather", "all_to_all", "slice"]


@dataclass(frozen=True)
class Step:
    """One collective (or local slice) on one axis of ``size`` ranks: a transition's
    operation as a plan runs it (:mod:`functional_hsdp.plan.recipe` makes them, and the owner
    moves in :mod:`functional_hsdp.plan.owner` add their own)."""

    op: str  # "reduce_scatter" | "all_reduce" | "all_gather" | "slice" | "all_to_all" | ...
    axis: str
    reduce: str | None  # "avg" | "sum" for reductions
    size: int


#: Reduce ops a ``Partial`` placement may carry here.
REDUCE_OPS = ("avg", "sum")


@placement_class
class Flat(Placement):
    """Flattened, bucketed and evenly chunked along one mesh axis (Megatron-FSDP's layout).

    The leaves of a bucket are flattened and concatenated, each starting at a multiple of 16
    elements (16-byte aligned in any dtype, see :mod:`functional_hsdp.plan.buckets`), and each
    rank along the axis holds one contiguous, equal-size chunk of the bucket (zero padding
    between leaves and at the bucket's tail, never inside a leaf's range).

    Example:
        >>> from functional_hsdp import Flat, Replicate
        >>> (Replicate(), Flat())
        (Replicate(), Flat())
    """

    def __init__(self) -> None:
        # torch 2.11's Placement is a C++ class whose __init__ a subclass must call
        # (torch_releases); from 2.13 it is a Python class and this is a no-op
        super().__init__()

    def __eq__(self, other: object) -> bool:
        return type(other) is Flat

    def __hash__(self) -> int:
        return hash(Flat)

    def __repr__(self) -> str:
        return "Flat()"

    def __str__(self) -> str:
        return "F"

    def __reduce__(self):
        # Placement is a pybind11 class; pickle Flat by its constructor.
        return (Flat, ())


@placement_class
class Owner(Placement):
    """Each leaf whole on one rank: an optimizer placement for matrix optimizers.

    Along the axes it is given on (every data-parallel axis of a spec), a bucket's leaves are
    assigned to the ranks balanced by size, and a rank's chunk of the bucket is the whole
    leaves it owns, padded to the largest chunk. A spec with Owner lays its buckets out
    owner-major (the leaves of rank 0's chunk, then rank 1's, ...), so that its Flat chunks
    on the same axes are the owners' leaves too: Partial -> Owner is a reduce-scatter, Owner
    -> Replicate an all-gather. :func:`~functional_hsdp.owned` makes such a spec from a
    preset; ``owned(spec, "dp_outer")`` puts Owner on HSDP's outer axis only, where each
    rank keeps the pieces of its chunk its coordinate owns, in the spec's own layout
    (uneven all-to-alls of the data there, no padding).

    Example:
        >>> import functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
        >>> fh.owned(fh.hsdp(mesh, "dp_outer", "dp_inner")).optimizer
        (Owner(), Owner())
    """

    def __init__(self) -> None:
        super().__init__()  # see Flat

    def __eq__(self, other: object) -> bool:
        return type(other) is Owner

    def __hash__(self) -> int:
        return hash(Owner)

    def __repr__(self) -> str:
        return "Owner()"

    def __str__(self) -> str:
        return "O"

    def __reduce__(self):
        return (Owner, ())


def reduce_op(p: Placement) -> str:
    """The reduce op of a Partial placement (``"avg"`` or ``"sum"``)."""
    op = p.reduce_op
    if op not in REDUCE_OPS:
        raise NotImplementedError(
            f"Partial({op!r}) is not supported; Partial placements here reduce with one of "
            f"{REDUCE_OPS}"
        )
    return op


def is_sharded(p: Placement) -> bool:
    """Flat, Shard(d) or Owner: each rank along the axis holds one equal-size chunk of a
    bucket."""
    return isinstance(p, (Flat, Shard, Owner))


def transition(frm: Placement, to: Placement, axis: str) -> Collective | None:
    """The collective that moves a value from ``frm`` to ``to`` along ``axis`` (None: no-op).

    ``Shard(d)`` moves exactly like ``Flat``: each leaf is chunked on dim ``d`` with
    ``torch.chunk`` semantics and padded to equal chunks, and its buckets are laid out
    rank-major (FSDP2's layout: every leaf's chunk for rank 0, then for rank 1, ...), so a
    rank's shards of every leaf form one contiguous chunk of the bucket. ``Owner`` (an
    optimizer placement, on every data-parallel axis) keeps each leaf whole on one rank: a
    bucket's leaves are assigned to the ranks balanced by size, and a rank's chunk is the whole
    leaves it owns, padded to the largest chunk (see :mod:`functional_hsdp.plan.owner`). Such a
    spec lays its buckets out owner-major, so that its chunks are the owners' leaves; the
    collectives are then Flat's. ``Owner`` on some data-parallel axes only (HSDP's outer, where
    the parameter is Replicate) keeps the spec's own layout: along that axis each rank keeps
    the pieces of its chunk whose leaf its coordinate owns, and the moves there are uneven
    all-to-alls of the data. Those and the moves between layouts (the rows with all-to-alls
    below) are planned by :mod:`functional_hsdp.plan.owner`, not here.

    One mesh axis at a time:

    ===================  ===================  =============================================
    from                 to                   operation
    ===================  ===================  =============================================
    Partial(op)          Flat / Shard(d)      reduce-scatter with ``op``
    Partial(op)          Owner                reduce-scatter with ``op`` in the owner layout
    Partial(op)          Replicate            all-reduce with ``op``
    Flat / Shard(d)      Replicate            all-gather
    Owner                Replicate            all-gather
    Replicate            Flat / Shard(d)      local slice, no communication
    Replicate            Owner                local slice, no communication
    Flat                 Owner, same spec     nothing: that spec's Flat chunks are owned
    Flat (other layout)  Owner                all-to-all (``per_matrix`` of a spec without
                                              Owner: its buckets to the owner layout)
    Owner                Flat (other layout)  all-to-all (back)
    Shard(d)             Owner                all-to-all (``per_matrix``: each rank's chunks,
                                              joined along d at the owner)
    Owner                Shard(d)             all-to-all (back)
    Partial(op)          Owner, some axes     reduce-scatter-v: one all-to-all of the data
                                              (each piece to its leaf owner's coordinate),
                                              then a sum (``fh.owned(spec, "dp_outer")``)
    Owner, some axes     Replicate            all-gather-v: one all-to-all
    Replicate            Owner, some axes     local: the rank's owned pieces of its chunk
    Partial(op)          Partial(op)          nothing (the axis stays deferred)
    X                    X                    nothing
    Replicate / Flat     Partial              impossible: a reduced value cannot become a
                                              summand
    ===================  ===================  =============================================

    Raises ValueError for a move that cannot exist (anything to Partial, Partial ops that
    differ) and NotImplementedError between Flat and Shard or between two Shard dims.
    """
    if isinstance(to, Partial):
        if isinstance(frm, Partial):
            if reduce_op(frm) != reduce_op(to):
                raise ValueError(
                    f"axis {axis!r}: cannot turn {frm!r} into {to!r}: the reduce ops differ"
                )
            return None
        raise ValueError(
            f"axis {axis!r}: cannot move {frm!r} to {to!r}: a reduced value cannot become a "
            "summand again"
        )
    if isinstance(frm, Partial):
        return "reduce_scatter" if is_sharded(to) else "all_reduce"
    if is_sharded(frm):
        if is_sharded(to):
            if frm != to and {type(frm), type(to)} != {Flat, Owner}:
                raise NotImplementedError(f"axis {axis!r}: moving {frm!r} to {to!r}")
            return None  # Flat and Owner of one spec: the same owner-major chunks
        return "all_gather"
    if isinstance(frm, Replicate):
        return "slice" if is_sharded(to) else None
    raise TypeError(f"axis {axis!r}: unknown placement {frm!r}")

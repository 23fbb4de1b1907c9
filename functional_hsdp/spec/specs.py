"""Specs: where parameters, gradients and optimizer state live on each mesh axis; presets.

A :class:`Spec` holds one placement per mesh axis for each of three roles (as Megatron-FSDP's
``Placements``): ``parameter`` (weights between steps), ``gradient`` (gradients between
microbatches; its Partial axes are the *deferred* axes) and ``optimizer`` (final gradients,
main weights and optimizer state). A spec applies to a whole tree or is given as an optree
pytree prefix, so subtrees can differ.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import optree

from ..base.cache import lru
from ..base.tree import format_path
from ..mesh import Mesh
from .placement import REDUCE_OPS, Flat, Owner, Partial, Placement, Replicate, Shard, is_sharded
from .quantize import Compress

__all__ = ["Spec", "ddp", "fsdp", "hsdp", "hfsdp", "replicas", "resolve_specs"]


def _tuple(role: str, placements: Any, mesh: Mesh) -> tuple[Placement, ...]:
    if isinstance(placements, Placement) or not isinstance(placements, Sequence):
        raise TypeError(
            f"Spec.{role}: expected a sequence of placements, one per mesh axis "
            f"{mesh.axis_names}; got {placements!r}"
        )
    placements = tuple(placements)
    if len(placements) != len(mesh.axis_names):
        raise ValueError(
            f"Spec.{role}: expected {len(mesh.axis_names)} placements (one per mesh axis "
            f"{mesh.axis_names}); got {len(placements)}: {placements!r}"
        )
    for axis, p in zip(mesh.axis_names, placements):
        if not isinstance(p, Placement):
            raise TypeError(f"Spec.{role} on axis {axis!r}: expected a placement; got {p!r}")
        if isinstance(p, Partial) and p.reduce_op not in REDUCE_OPS:
            raise ValueError(
                f"Spec.{role} on axis {axis!r}: Partial({p.reduce_op!r}) is not supported; "
                f"use one of {REDUCE_OPS}"
            )
    return placements


@dataclass(frozen=True)
class Spec:
    """Placements of parameters, gradients and optimizer state, one per mesh axis.

    Args:
        mesh: a :class:`SimMesh` or :class:`DistMesh`.
        parameter: where weights rest between steps (Replicate or Flat per axis).
        gradient: where gradients rest between microbatches: ``Partial`` axes are deferred
            (reduced only when ``last=True``), ``Flat`` axes are reduce-scattered and
            ``Replicate`` axes all-reduced on every microbatch.
        optimizer: where final gradients, main weights and optimizer state live
            (Replicate or Flat per axis).
        dp_axes: the data-parallel axes, over which raw gradients arrive as Partial; None
            means every mesh axis. Other axes (say, tensor parallel) must be Replicate in
            all three roles and see no communication.
        reduce_op: ``"avg"`` or ``"sum"``: how raw gradients combine over DP axes whose
            gradient placement is not Partial (a Partial placement carries its own op).
        bucket_cap_mb: bucket size cap in MiB, counted as 4-byte elements whatever the
            dtype, so a tree's layout does not depend on its dtype (bf16 gradients line up
            with fp32 main weights). One collective per bucket per axis.
        replica_axes: axes of diverging replicas (made by :func:`replicas`): not
            data-parallel, Replicate in every role, never communicated over, but each
            coordinate holds its own values (checkpoints save every replica's).
        outer_compress: a :func:`~functional_hsdp.compress` policy for the outer axis (the
            first of ``dp_axes``), or None. That axis must be deferred (gradient
            ``Partial``); its reduction on the last microbatch then travels compressed
            (:func:`~functional_hsdp.compressed_all_reduce`: all-to-all, fp32 sum,
            all-gather; no all-gather where the optimizer is Flat on it). Other axes are
            untouched.

    Flat axes split a bucket one after another; the *split order* is the gradient's Flat
    axes, then the optimizer's other Flat axes, inner axes first within each group. Every
    role's Flat axes must be a prefix of that order, so that one layout serves them all.

    Example:
        >>> import functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
        >>> spec = fh.Spec(mesh, parameter=[fh.Replicate(), fh.Flat()],
        ...                gradient=[fh.Partial("avg"), fh.Flat()],
        ...                optimizer=[fh.Replicate(), fh.Flat()])
        >>> spec.deferred_axes
        ('dp_outer',)
    """

    mesh: Mesh
    parameter: tuple[Placement, ...]
    gradient: tuple[Placement, ...]
    optimizer: tuple[Placement, ...]
    dp_axes: tuple[str, ...] | None = None
    reduce_op: str = "avg"
    bucket_cap_mb: float = 25.0
    replica_axes: tuple[str, ...] = ()
    outer_compress: Compress | None = None
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        mesh = self.mesh
        if not isinstance(mesh, Mesh):
            raise TypeError(f"Spec: expected a SimMesh or DistMesh; got {type(mesh).__name__}")
        set_ = functools.partial(object.__setattr__, self)
        for role in ("parameter", "gradient", "optimizer"):
            set_(role, _tuple(role, getattr(self, role), mesh))
        axes = mesh.axis_names if self.dp_axes is None else _axes(self.dp_axes, mesh, "dp_axes")
        set_("dp_axes", axes)
        replica = _axes(self.replica_axes, mesh, "replica_axes") if self.replica_axes else ()
        if any(a in axes for a in replica):
            raise ValueError(
                f"Spec.replica_axes: {replica} must not be data-parallel axes (dp_axes={axes}): "
                "nothing is reduced over an axis of diverging replicas"
            )
        set_("replica_axes", replica)
        if self.reduce_op not in REDUCE_OPS:
            raise ValueError(
                f"Spec.reduce_op: expected one of {REDUCE_OPS}; got {self.reduce_op!r}"
            )
        if not (isinstance(self.bucket_cap_mb, (int, float)) and self.bucket_cap_mb > 0):
            raise ValueError(
                f"Spec.bucket_cap_mb: expected a positive number; got {self.bucket_cap_mb!r}"
            )
        for axis, p, g, o in zip(mesh.axis_names, self.parameter, self.gradient, self.optimizer):
            _check_axis(axis, dp=axis in axes, axes=axes, p=p, g=g, o=o)
        self._check_shard()
        self._check_owner()
        self._check_split()
        self._check_compress()
        self._check_apart()

    def _check_apart(self) -> None:
        """Nothing is sharded over a fault-tolerant replica axis (``mesh.apart_axes``): a group
        that dies would take its shard with it."""
        names = self.mesh.axis_names
        for axis in getattr(self.mesh, "apart_axes", ()):
            k = names.index(axis)
            for role in ("parameter", "gradient", "optimizer"):
                x = getattr(self, role)[k]
                if not isinstance(x, (Replicate, Partial)):
                    raise ValueError(
                        f"Spec.{role}: {x!r} on the fault-tolerant replica axis {axis!r}: nothing "
                        "can be sharded over replica groups that may fail (keep that axis "
                        "Replicate/Partial, e.g. fh.hsdp(mesh, outer, inner), not fh.hfsdp)"
                    )

    def _check_compress(self) -> None:
        policy = self.outer_compress
        if policy is None:
            return
        if not isinstance(policy, Compress):
            raise TypeError(
                f"Spec.outer_compress: expected a policy from fh.compress(...) or None; got "
                f"{policy!r}"
            )
        axis = self.compressed_axis
        names = self.mesh.axis_names
        g, o = self.gradient[names.index(axis)], self.optimizer[names.index(axis)]
        if not isinstance(g, Partial):
            raise ValueError(
                f"Spec.outer_compress: compresses the outer axis {axis!r}, whose gradient "
                f"placement is {g!r}: only a deferred axis (gradient Partial, reduced on the "
                "last microbatch) can be compressed"
            )
        if len(self.deferred_axes) > 1:
            raise NotImplementedError(
                f"Spec.outer_compress: the spec defers {self.deferred_axes}; compression is "
                "supported where the compressed axis is the only deferred one (hsdp, hfsdp)"
            )
        if not isinstance(o, (Replicate, Flat)):
            raise NotImplementedError(
                f"Spec.outer_compress: the optimizer placement {o!r} on axis {axis!r} is not "
                "supported with compression (Replicate, hsdp, or Flat, hfsdp, are)"
            )

    def _check_owner(self) -> None:
        names = self.mesh.axis_names
        for role in ("parameter", "gradient"):
            if any(isinstance(x, Owner) for x in getattr(self, role)):
                raise ValueError(f"Spec.{role}: Owner() is an optimizer placement only")
        owned = self.keep_axes
        if not owned:
            return  # no Owner, or owner-major over every data-parallel axis
        moving = [a for a in owned if self.mesh.moves(a)]
        if len(moving) > 1:
            raise NotImplementedError(
                f"Spec.optimizer: Owner() on some data-parallel axes only is supported on one "
                f"axis of size > 1; got it on {moving}"
            )
        for a in owned:
            k = names.index(a)
            p, g = self.parameter[k], self.gradient[k]
            if not isinstance(p, Replicate) or not isinstance(g, (Partial, Replicate)):
                raise ValueError(
                    f"Spec.optimizer: Owner() on {a!r} alone (not on every data-parallel axis "
                    f"{self.dp_axes}) needs parameter Replicate and gradient Partial or "
                    f"Replicate there, as HSDP's outer axis; got parameter={p}, gradient={g}"
                )
        # the kept pieces are of the gradient's chunk: the other axes chunk it as the
        # optimizer does, and at least one does
        rest = [
            (a, g, o) for a, g, o in zip(names, self.gradient, self.optimizer) if a not in owned
        ]
        flat = [a for a, g, o in rest if isinstance(o, Flat)]
        if not flat or any(isinstance(g, Flat) != isinstance(o, Flat) for _, g, o in rest):
            raise ValueError(
                f"Spec.optimizer: Owner() on {owned} alone keeps pieces of the gradient's Flat "
                "chunks: the other axes need the same Flat axes (at least one) in the gradient "
                f"and the optimizer placement, as HSDP's inner axis; got gradient="
                f"{list(map(str, self.gradient))}, optimizer={list(map(str, self.optimizer))}"
            )

    @property
    def owner_axes(self) -> tuple[str, ...]:
        """The axes of an owner-major optimizer placement (Owner on every data-parallel
        axis, or on some with Replicate on the others: owners within each replica), in
        split order (empty: none): a bucket of this spec is laid out owner-major over
        them."""

        # a keep spec's Owner axes chunk nothing: they are not in the split order
        names = self.mesh.axis_names
        return self._memo(
            "owner_axes",
            lambda: tuple(
                a for a in self.split_order if isinstance(self.optimizer[names.index(a)], Owner)
            ),
        )

    def _sharded(self, axis: str, x: Placement) -> bool:
        """Whether ``x`` on ``axis`` chunks a bucket: Flat, Shard(d), or an owner-major Owner
        (an Owner on some data-parallel axes only keeps the spec's chunks whole there)."""
        return is_sharded(x) and not (isinstance(x, Owner) and axis in self.keep_axes)

    @property
    def keep_axes(self) -> tuple[str, ...]:
        """The axes, in mesh order, of an Owner placement on only some data-parallel axes
        where the others are Flat (``fh.owned(spec, axes=...)``): the spec keeps its own
        layout, and along these axes a rank keeps only the pieces of its chunk whose leaf's
        owner has its coordinate there (see :mod:`functional_hsdp.plan.owner`). Empty for an
        Owner on every data-parallel axis, or on some with Replicate on the others: those
        are owner-major over their Owner axes (:attr:`owner_axes`)."""

        def axes() -> tuple[str, ...]:
            owned = [
                a for a, x in zip(self.mesh.axis_names, self.optimizer) if isinstance(x, Owner)
            ]
            rest = [
                x
                for a, x in zip(self.mesh.axis_names, self.optimizer)
                if a in self.dp_axes and a not in owned
            ]
            # Owner on every axis, or Replicate on the others: owner-major over the Owner axes
            return tuple(owned) if owned and any(isinstance(x, Flat) for x in rest) else ()

        return self._memo("keep_axes", axes)

    def _check_split(self) -> None:
        order = self.split_order
        for role in ("parameter", "gradient", "optimizer"):
            names = self.mesh.axis_names
            flat = {a for a, x in zip(names, getattr(self, role)) if self._sharded(a, x)}
            if flat != set(order[: len(flat)]):
                raise ValueError(
                    f"Spec.{role}: Flat axes {sorted(flat)} cannot be honoured: buckets are "
                    f"split in the order {order} (gradient Flat axes first, inner first), and "
                    f"every role's Flat axes must be a prefix of that order"
                )

    def _check_shard(self) -> None:
        placements = {
            (axis, x)
            for role in ("parameter", "gradient", "optimizer")
            for axis, x in zip(self.mesh.axis_names, getattr(self, role))
            if isinstance(x, Shard)
        }
        if not placements:
            return
        if len(placements) > 1:
            raise NotImplementedError(
                f"Spec: Shard(d) on more than one axis or with different dims "
                f"({sorted((a, str(x)) for a, x in placements)}) is not supported; FSDP2-style "
                "Shard(d) takes one mesh axis, use Flat() to shard over several"
            )
        if any(
            isinstance(x, (Flat, Owner))
            for r in (self.parameter, self.gradient, self.optimizer)
            for x in r
        ):
            raise NotImplementedError(
                "Spec: Flat and Shard(d) (or Owner and Shard(d)) in one spec is not supported; "
                "give the subtrees different specs (a spec may be a pytree prefix)"
            )

    @property
    def shard(self) -> tuple[str, int] | None:
        """(axis, dim) of this spec's Shard(dim) placement, or None."""
        for role in (self.optimizer, self.gradient, self.parameter):
            for axis, x in zip(self.mesh.axis_names, role):
                if isinstance(x, Shard):
                    return axis, x.dim
        return None

    # Derived, cached facts. The dataclass is frozen, so cache in a private dict.
    def _memo(self, key: str, fn):
        if key not in self._derived:
            self._derived[key] = fn()
        return self._derived[key]

    def __hash__(self) -> int:
        return self._memo(
            "hash",
            lambda: hash(
                (
                    id(self.mesh),
                    self.parameter,
                    self.gradient,
                    self.optimizer,
                    self.dp_axes,
                    self.reduce_op,
                    self.bucket_cap_mb,
                    self.replica_axes,
                    self.outer_compress,
                )
            ),
        )

    @property
    def split_order(self) -> tuple[str, ...]:
        """Flat axes in the order they split a bucket (outermost split first)."""

        def order() -> tuple[str, ...]:
            names = self.mesh.axis_names
            grad = [a for a, g in zip(names, self.gradient) if is_sharded(g)]
            rest = [
                a for a, o in zip(names, self.optimizer) if self._sharded(a, o) and a not in grad
            ]
            return tuple(reversed(grad)) + tuple(reversed(rest))

        return self._memo("split_order", order)

    def sharded_axes(self, role: str) -> tuple[str, ...]:
        """The Flat/Shard axes of ``role``, in split order (a prefix of it, by validation)."""

        def axes() -> tuple[str, ...]:
            names = self.mesh.axis_names
            placements = self.placements(role)
            return tuple(
                a for a in self.split_order if self._sharded(a, placements[names.index(a)])
            )

        return self._memo(f"sharded_axes:{role}", axes)

    @property
    def compressed_axis(self) -> str | None:
        """The axis ``outer_compress`` compresses (the first of ``dp_axes``), or None."""
        return None if self.outer_compress is None else self.dp_axes[0]

    @property
    def deferred_axes(self) -> tuple[str, ...]:
        """Axes whose gradient placement is Partial: reduced only on the last microbatch."""
        return tuple(
            a for a, g in zip(self.mesh.axis_names, self.gradient) if isinstance(g, Partial)
        )

    @property
    def input(self) -> tuple[Placement, ...]:
        """Placement of raw per-rank gradients: Partial on DP axes, Replicate elsewhere."""

        def placements() -> tuple[Placement, ...]:
            out = []
            for axis, g in zip(self.mesh.axis_names, self.gradient):
                if axis not in self.dp_axes:
                    out.append(Replicate())
                else:
                    out.append(g if isinstance(g, Partial) else Partial(self.reduce_op))
            return tuple(out)

        return self._memo("input", placements)

    @property
    def full(self) -> tuple[Placement, ...]:
        """All Replicate: what ``gather`` returns."""
        return tuple(Replicate() for _ in self.mesh.axis_names)

    def placements(self, role: str) -> tuple[Placement, ...]:
        """The placements of ``role``: parameter, gradient, optimizer, input or full."""
        return getattr(self, role)

    def __repr__(self) -> str:
        fmt = lambda ps: "[" + ", ".join(map(str, ps)) + "]"  # noqa: E731
        replicas = f", replica_axes={self.replica_axes}" if self.replica_axes else ""
        extra = "" if self.outer_compress is None else f", outer_compress={self.outer_compress!r}"
        return (
            f"Spec({self.mesh!r}, parameter={fmt(self.parameter)}, gradient={fmt(self.gradient)}"
            f", optimizer={fmt(self.optimizer)}{replicas}{extra})"
        )


def _check_axis(
    axis: str, *, dp: bool, axes: tuple, p: Placement, g: Placement, o: Placement
) -> None:
    """One axis's three placements (parameter, gradient, optimizer) make a valid spec."""
    if not dp:
        if not all(isinstance(x, Replicate) for x in (p, g, o)):
            raise ValueError(
                f"Spec: axis {axis!r} is not a data-parallel axis (dp_axes={axes}), so "
                f"it must be Replicate in every role; got parameter={p}, gradient={g}, "
                f"optimizer={o}"
            )
        return
    for role, x in (("parameter", p), ("optimizer", o)):
        if isinstance(x, Partial):
            raise ValueError(
                f"Spec.{role} on axis {axis!r}: {x!r} is not allowed; {role} values are "
                "fully reduced (Replicate, Flat or Shard)"
            )
    for role, x in (("gradient", g), ("parameter", p)):
        if is_sharded(x) and x != o and not (isinstance(x, Flat) and isinstance(o, Owner)):
            raise NotImplementedError(
                f"Spec on axis {axis!r}: {role} {x!r} with optimizer {o!r} is not "
                f"supported; a sharded {role} axis keeps its placement in the optimizer"
            )


def _axes(axis: str | Sequence[str] | None, mesh: Mesh, what: str) -> tuple[str, ...]:
    if axis is None:
        return mesh.axis_names
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    for a in axes:
        if a not in mesh.axis_names:
            raise ValueError(
                f"{what}: axis {a!r} is not in the mesh; its axes are {mesh.axis_names}"
            )
    if len(set(axes)) != len(axes):
        raise ValueError(f"{what}: axes repeat: {axes}")
    return axes


def _preset(mesh: Mesh, roles: dict[str, dict[str, Placement]], dp: tuple[str, ...], **kw) -> Spec:
    def row(role: str) -> list[Placement]:
        return [roles[role].get(a, Replicate()) for a in mesh.axis_names]

    return Spec(
        mesh,
        parameter=row("parameter"),
        gradient=row("gradient"),
        optimizer=row("optimizer"),
        dp_axes=dp,
        **kw,
    )


def ddp(
    mesh: Mesh,
    axis: str | Sequence[str] | None = None,
    *,
    reduce_op: str = "avg",
    bucket_cap_mb: float = 25.0,
) -> Spec:
    """DDP: replicated weights; gradients all-reduced once, on the last microbatch.

    Args:
        mesh: the mesh.
        axis: the data-parallel axis or axes (default: every mesh axis).
        reduce_op: ``"avg"`` (default) or ``"sum"``.
        bucket_cap_mb: bucket size cap (MiB of 4-byte elements).

    Returns:
        parameter ``[Replicate]``, gradient ``[Partial(op)]``, optimizer ``[Replicate]`` on
        each DP axis.

    Example:
        >>> import functional_hsdp as fh
        >>> fh.ddp(fh.SimMesh({"dp": 4}), "dp")
        Spec(SimMesh({'dp': 4}), parameter=[R], gradient=[P(avg)], optimizer=[R])
    """
    axes = _axes(axis, mesh, "ddp")
    roles = {
        "parameter": {a: Replicate() for a in axes},
        "gradient": {a: Partial(reduce_op) for a in axes},
        "optimizer": {a: Replicate() for a in axes},
    }
    return _preset(mesh, roles, axes, reduce_op=reduce_op, bucket_cap_mb=bucket_cap_mb)


def fsdp(
    mesh: Mesh,
    axis: str | Sequence[str] | None = None,
    *,
    reduce_op: str = "avg",
    bucket_cap_mb: float = 25.0,
) -> Spec:
    """FSDP (ZeRO-3): everything Flat; every microbatch reduce-scatters.

    Args: as :func:`ddp`.

    Returns:
        ``[Flat]`` in every role on each DP axis.

    Example:
        >>> import functional_hsdp as fh
        >>> fh.fsdp(fh.SimMesh({"dp": 4}))
        Spec(SimMesh({'dp': 4}), parameter=[F], gradient=[F], optimizer=[F])
    """
    axes = _axes(axis, mesh, "fsdp")
    flat = {a: Flat() for a in axes}
    roles = {"parameter": flat, "gradient": flat, "optimizer": flat}
    return _preset(mesh, roles, axes, reduce_op=reduce_op, bucket_cap_mb=bucket_cap_mb)


def _hybrid(name: str, opt_outer: type[Placement], doc: str):
    """The preset ``name`` on an ``(outer, inner)`` pair of axes, documented by ``doc``:
    parameter ``[Replicate, Flat]``, gradient ``[Partial(op), Flat]``, optimizer
    ``[opt_outer, Flat]``. :func:`hsdp` and :func:`hfsdp` differ only in ``opt_outer``."""

    def preset(
        mesh: Mesh,
        outer: str,
        inner: str,
        *,
        reduce_op: str = "avg",
        bucket_cap_mb: float = 25.0,
        outer_compress: Compress | None = None,
    ) -> Spec:
        axes = _axes((outer, inner), mesh, name)
        roles = {
            "parameter": {outer: Replicate(), inner: Flat()},
            "gradient": {outer: Partial(reduce_op), inner: Flat()},
            "optimizer": {outer: opt_outer(), inner: Flat()},
        }
        return _preset(
            mesh,
            roles,
            axes,
            reduce_op=reduce_op,
            bucket_cap_mb=bucket_cap_mb,
            outer_compress=outer_compress,
        )

    preset.__name__ = preset.__qualname__ = name
    preset.__doc__ = doc
    return preset


hsdp = _hybrid(
    "hsdp",
    Replicate,
    doc="""HSDP with deferred outer reduction (Megatron-LM PR 5743).

    Every microbatch reduce-scatters over ``inner`` and accumulates; only the last one
    all-reduces over ``outer``, on the 1/n_inner shard.

    Args:
        mesh: the mesh.
        outer: the replica axis (deferred).
        inner: the sharding axis.
        reduce_op: ``"avg"`` (default) or ``"sum"``.
        bucket_cap_mb: bucket size cap (MiB of 4-byte elements).
        outer_compress: a :func:`~functional_hsdp.compress` policy: the last microbatch's
            ``outer`` all-reduce travels compressed (all-to-all, fp32 sum, all-gather), its
            rounding loss fed back through the residual (``reduce_grads(..., residual=)``,
            :class:`MainGrad`). Default None: the reduce dtype on the wire.

    Returns:
        parameter ``[Replicate, Flat]``, gradient ``[Partial(op), Flat]``, optimizer
        ``[Replicate, Flat]``.

    Example:
        >>> import functional_hsdp as fh
        >>> spec = fh.hsdp(fh.SimMesh({"dp_outer": 2, "dp_inner": 2}), "dp_outer", "dp_inner")
        >>> spec.gradient
        (Partial(avg), Flat())
    """,
)

hfsdp = _hybrid(
    "hfsdp",
    Flat,
    doc="""HFSDP: like :func:`hsdp`, but the optimizer is ``[Flat, Flat]``.

    The last microbatch reduce-scatters over ``outer`` too; main weights and optimizer state
    are sharded over both axes.

    Args: as :func:`hsdp`; with ``outer_compress`` the ``outer`` reduce-scatter is a
    compressed all-to-all with the sum kept in fp32 (no all-gather leg).

    Returns:
        parameter ``[Replicate, Flat]``, gradient ``[Partial(op), Flat]``, optimizer
        ``[Flat, Flat]``.

    Example:
        >>> import functional_hsdp as fh
        >>> fh.hfsdp(fh.SimMesh({"dp_outer": 2, "dp_inner": 2}), "dp_outer", "dp_inner").split_order
        ('dp_inner', 'dp_outer')
    """,
)


def replicas(spec: Any, axis: str) -> Any:
    """``spec`` with ``axis`` made an axis of diverging replicas (DiLoCo's outer axis).

    Nothing is ever reduced or gathered over ``axis``: it leaves the data-parallel axes and
    is ``Replicate`` in every role, so gradients stay per replica, and parameters and
    optimizer state are per replica (each coordinate along ``axis`` trains its own copy).
    Every path (``reduce_grads``, ``MainGrad``, units, ``shard_module``/``functional_call``,
    the optimizers, ``per_matrix``, ``global_norm``, checkpoints) works on it unchanged and
    issues no collective on ``axis``. Checkpoints save every replica's values.

    Args:
        spec: a :class:`Spec` or a pytree prefix of Specs (one mesh).
        axis: a data-parallel mesh axis of ``spec`` (say HSDP's ``"dp_outer"``).

    Returns:
        The same kind of value: each Spec with ``axis`` turned into a replica axis.

    Example:
        >>> import functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
        >>> spec = fh.replicas(fh.hsdp(mesh, "dp_outer", "dp_inner"), "dp_outer")
        >>> spec.gradient, spec.dp_axes, spec.replica_axes
        ((Replicate(), Flat()), ('dp_inner',), ('dp_outer',))
    """
    if isinstance(spec, Spec):
        return _replicas(spec, axis)
    leaves, treedef = optree.tree_flatten(spec, is_leaf=_is_spec)
    if not leaves or not all(isinstance(x, Spec) for x in leaves):
        raise TypeError(f"replicas: spec must be a Spec or a pytree prefix of Specs; got {spec!r}")
    return optree.tree_unflatten(treedef, [_replicas(x, axis) for x in leaves])


def _replicas(spec: Spec, axis: str) -> Spec:
    if not isinstance(axis, str) or axis not in spec.mesh.axis_names:
        raise ValueError(
            f"replicas: axis {axis!r} is not in the mesh; its axes are {spec.mesh.axis_names}"
        )
    if axis in spec.replica_axes:
        return spec
    if axis not in spec.dp_axes:
        raise ValueError(
            f"replicas: axis {axis!r} is not a data-parallel axis of spec (dp_axes="
            f"{spec.dp_axes}); give the axis the replicas train apart along"
        )
    if spec.outer_compress is not None and spec.compressed_axis == axis:
        raise ValueError(
            f"replicas: spec compresses the outer axis {axis!r} (outer_compress="
            f"{spec.outer_compress!r}), which becomes an axis of replicas that nothing reduces "
            "over; compress DiLoCo's pseudo-gradient with fh.diloco(..., compress=) instead"
        )
    names = spec.mesh.axis_names
    row = lambda ps: [Replicate() if a == axis else x for a, x in zip(names, ps)]  # noqa: E731
    return Spec(
        spec.mesh,
        parameter=row(spec.parameter),
        gradient=row(spec.gradient),
        optimizer=row(spec.optimizer),
        dp_axes=tuple(a for a in spec.dp_axes if a != axis),
        reduce_op=spec.reduce_op,
        bucket_cap_mb=spec.bucket_cap_mb,
        replica_axes=tuple(a for a in names if a == axis or a in spec.replica_axes),
        outer_compress=spec.outer_compress,
    )


def _is_spec(x: Any) -> bool:
    return isinstance(x, Spec)


@lru(maxsize=1024)
def _broadcast(
    spec_def: optree.PyTreeSpec, specs: tuple[Spec, ...], tree_def: optree.PyTreeSpec, *, name: str
) -> tuple[tuple[Spec, ...], tuple[int, ...]]:
    units = optree.tree_unflatten(spec_def, list(range(len(specs))))
    full = optree.tree_unflatten(tree_def, list(range(tree_def.num_leaves)))
    errors = optree.prefix_errors(units, full)
    if errors:
        raise ValueError(f"spec is not a pytree prefix of {name}: {errors[0]('spec')}")
    owner = tuple(optree.tree_leaves(optree.tree_broadcast_prefix(units, full)))
    return tuple(specs[u] for u in owner), owner


def resolve_specs(
    spec: Any, tree_def: optree.PyTreeSpec, name: str
) -> tuple[tuple[Spec, ...], tuple[int, ...]]:
    """One Spec per leaf of a tree, and the *unit* of each leaf.

    ``spec`` is a Spec (the whole tree is one unit) or a pytree prefix of Specs: each prefix
    leaf is a unit (FSDP2's ``fully_shard`` granularity), whose leaves are bucketed apart
    from every other unit's. Units are numbered in prefix order.
    """
    if isinstance(spec, Spec):
        return (spec,) * tree_def.num_leaves, (0,) * tree_def.num_leaves
    spec_leaves, spec_def = optree.tree_flatten(spec, is_leaf=_is_spec)
    if not spec_leaves:
        raise TypeError(f"expected a Spec or a pytree prefix of Specs; got {spec!r}")
    paths = [format_path(p) for p in optree.tree_paths(spec, is_leaf=_is_spec)]
    for path, leaf in zip(paths, spec_leaves):
        if not isinstance(leaf, Spec):
            raise TypeError(f"spec{path}: expected a Spec (a pytree prefix of Specs); got {leaf!r}")
    for path, leaf in zip(paths, spec_leaves):
        if leaf.mesh is not spec_leaves[0].mesh:
            raise ValueError(
                f"spec{path}: uses {leaf.mesh!r}, but spec{paths[0]} uses "
                f"{spec_leaves[0].mesh!r}; every Spec of a spec tree must use the same mesh"
            )
    return _broadcast(spec_def, tuple(spec_leaves), tree_def, name=name)

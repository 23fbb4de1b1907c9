"""Checkpoints for ``torch.distributed.checkpoint`` (DCP) that reshard across meshes.

Every leaf is saved in a mesh-independent *per-leaf form*: a DTensor of the leaf's full shape,
``Shard(0)`` (``torch.chunk`` semantics) on each axis where the spec's optimizer placement is
sharded and ``Replicate()`` elsewhere, which DCP reshards (save on a 2x2 mesh, load on 1x4, 4x1
or another world size). Invariant: converting moves data only (bit-exact), one Flat bucket at a
time (memory beyond the shards stays within one bucket).

What a value saves is decided by its type, and this room lists no types: a type with the
checkpoint protocol saves itself (:func:`state_dict` says how), a NamedTuple state field by
field, anything else as a tree of local shards (the guide: ``docs/guides/checkpoints.md``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..base.tags import tag
from ..base.tree import flatten, is_masked, masked_like, paths_of, unmask
from ..plan.buckets import unpack_full
from ..plan.lookup import find_plan
from ..plan.owner import chunk_of, piece_of
from ..plan.recipe import Plan, Step, TreeMeta, get_plan
from ..runtime.agreement import agreement
from ..runtime.engine import remember_units
from ..runtime.scheduler import run
from ..spec.specs import Spec, resolve_specs

__all__ = ["empty_state_dict", "load_state_dict", "state_dict"]

ROLE = "optimizer"  # checkpoints hold (and loading returns) the optimizer placement


# -- public ---------------------------------------------------------------------------------


def state_dict(tree: Any, spec: Any = None, *, like: Any = None) -> dict[str, Any]:
    """This rank's part of a mesh-independent checkpoint, for ``dcp.save``.

    Args:
        tree: one of

            * local shards laid out like the params (``shard``/``reduce_grads`` results,
              optimizer moments, any elementwise function of those), at the optimizer
              (or parameter) placement of ``spec``;
            * a NamedTuple state: an optimizer's (:class:`ScaleByAdamState` of ``adamw``,
              :class:`SGDState`, :class:`MuonState`, ..., or your own transformation's),
              saved field by field: its trees as above, host scalars (a ``count``) as they
              are, None left out. A NamedTuple is taken for a state
              if a field holds a host value (bool, int, float, str) or it has no field
              (inside a :class:`ChainState` or :class:`PartitionState`: any NamedTuple);
              otherwise (a NamedTuple of tensors: params) it is a tree;
            * a value whose type has the checkpoint protocol (``__fh_state_dict__``; see
              below): a :class:`PartitionState` (each label's state; its trees'
              :class:`MaskedNode` leaves are another label's, saved there), a
              :class:`ChainState` (each transformation's state), a :class:`DiLoCoState` (at
              any step: its anchor, outer state, count, due steps, the averaged syncs in
              flight and, with ``compress=``, the error feedback's residual, each rank's
              own), a :class:`MainGrad` whose step is final (or zeroed; mid-accumulation it
              is refused: a Partial state has no mesh-independent form).
        spec: the :class:`Spec` or spec tree the shards were made with (optional for a
            MainGrad, which knows its own).
        like: a tree like ``tree`` of full-shape tensors, only if ``tree``'s layout was not
            made in this process (as in :func:`gather`).

    Returns:
        For a tree: ``{key: DTensor}``, one DTensor of the leaf's full shape per leaf, keyed
        by its path joined with ``"."`` (``"blocks.0.qkv"``). For a NamedTuple:
        ``{"count": int, "mu": {...}, "nu": {...}}``; for a PartitionState ``{label: ...}``;
        for a ChainState ``{"0": ..., "1": ...}``, one entry per transformation.
        For a MainGrad: ``{"state": str, "grads": {...}}`` (and ``"residual"``, per rank,
        under ``outer_compress`` with error feedback). Nest them in one dict for
        ``dcp.save``. Collective: every rank calls it (Flat trees all-gather one bucket at a
        time).

    The checkpoint protocol: a type saves itself where it is defined, with three methods and
    this module's helpers (``state_dict``, ``empty_state_dict`` and ``load_entry`` for what it
    holds, ``save_member``, ``empty_member`` and ``load_members`` for a combinator's states,
    ``load_tree``; the per-leaf form: ``to_checkpoint``, ``from_checkpoint``)::

        def __fh_state_dict__(self, spec, *, like=None) -> dict  # for dcp.save
        def __fh_empty_state_dict__(self, spec) -> dict  # placeholders for dcp.load
        def __fh_load_state_dict__(self, state, spec, *, name) -> value  # on the like; name: errors

    Example (every rank; tested in tests/io/test_checkpoint.py)::

        import torch.distributed.checkpoint as dcp
        dcp.save({"params": fh.state_dict(params, spec),
                  "optim": fh.state_dict(opt_state, spec)}, checkpoint_id=path)
    """
    return _save(tree, spec, like, member=False)


def empty_state_dict(like: Any, spec: Any = None) -> dict[str, Any]:
    """Placeholders for ``dcp.load`` on this mesh: what :func:`state_dict` would return, with
    this rank's chunk of every leaf allocated but not filled (no full tensor is made).

    Args:
        like: what to load, from metadata: a tree of tensors of the full shapes and dtypes
            (meta tensors are enough: ``torch.empty_like(p, device="meta")``), an
            optimizer state of such trees (``opt.init(like)``), or the :class:`MainGrad`
            to load into.
        spec: the :class:`Spec` or spec tree to load at (any mesh shape; optional for a
            MainGrad).

    Returns:
        A dict of the form :func:`state_dict` returns; pass it to ``dcp.load``, then to
        :func:`load_state_dict`. No communication.

    Example (every rank, on any mesh)::

        state = {"params": fh.empty_state_dict(like, spec)}
        dcp.load(state, checkpoint_id=path)
        params = fh.load_state_dict(state["params"], spec, like)
    """
    return _placeholders_of(like, spec, member=False)


def load_state_dict(state: dict[str, Any], spec: Any, like: Any) -> Any:
    """Local shards at ``spec``'s optimizer placement from a state ``dcp.load`` filled.

    Args:
        state: the dict :func:`empty_state_dict` made (or :func:`state_dict` returned on this
            mesh), filled by ``dcp.load``.
        spec: the Spec or spec tree it was made for.
        like: the ``like`` it was made from.

    Returns:
        A tree of local shards like ``shard(full, spec)`` returns (usable by ``gather``,
        ``reduce_grads``, the optimizers), an optimizer state of such trees, or, for a
        :class:`MainGrad`, that MainGrad with the loaded final gradients (or zeroed).
        Collective: Flat trees all-gather one bucket of chunks at a time. Keys, shapes and
        dtypes are checked first; errors name the path.

    Example: see :func:`empty_state_dict`.
    """
    if not isinstance(state, dict):
        raise TypeError(f"state: expected the dict empty_state_dict made; got {type(state)}")
    return load_entry(state, spec, like, name="state")


def load_entry(state: Any, spec: Any, like: Any, *, name: str) -> Any:
    """:func:`load_state_dict` of one entry of a state (what a protocol's
    ``__fh_load_state_dict__`` calls for what it holds): by ``like``'s protocol, its fields
    (a NamedTuple state) or as a tree. ``name``: the entry's path in errors
    (``"state['mu']"``)."""
    return _load(state, spec, like, name=name, member=False)


# -- a combinator's states (ChainState, PartitionState): any NamedTuple by its fields --------


def save_member(state: Any, spec: Any, *, like: Any = None) -> dict[str, Any]:
    """:func:`state_dict` of a combinator's member (a transformation's state), where any
    NamedTuple is a state, saved by its fields (as optax takes any for one)."""
    return _save(state, spec, like, member=True)


def empty_member(like: Any, spec: Any) -> dict[str, Any]:
    """:func:`empty_state_dict` of a combinator's member (see :func:`save_member`)."""
    return _placeholders_of(like, spec, member=True)


def load_members(state: dict, spec: Any, members: dict[str, Any], *, name: str, owner: str) -> dict:
    """A combinator's states loaded by key (a :class:`ChainState`'s, a
    :class:`PartitionState`'s; see :func:`save_member`): ``members`` maps each key to its
    ``like``; every key is checked present before any is loaded. ``owner``: the
    combinator's type, for errors."""
    for k in members:
        if k not in state:
            raise ValueError(f"{name}: has no entry {k!r} (for the {owner}'s {k!r})")
    return {
        k: _load(state[k], spec, x, name=f"{name}[{k!r}]", member=True) for k, x in members.items()
    }


# -- the dispatch: the protocol, a NamedTuple state field by field, else a tree --------------


def _save(tree: Any, spec: Any, like: Any, *, member: bool) -> dict[str, Any]:
    save = getattr(type(tree), "__fh_state_dict__", None)
    if save is not None:
        return save(tree, spec, like=like)
    if _by_fields(tree, member=member):
        convert = lambda sub, sub_like: _save(sub, spec, sub_like, member=False)  # noqa: E731
        return _as_dict(tree, like, convert)
    return _tree_state(tree, spec, like)


def _placeholders_of(like: Any, spec: Any, *, member: bool) -> dict[str, Any]:
    empty = getattr(type(like), "__fh_empty_state_dict__", None)
    if empty is not None:
        return empty(like, spec)
    if _by_fields(like, member=member):
        convert = lambda sub, _: _placeholders_of(sub, spec, member=False)  # noqa: E731
        return _as_dict(like, None, convert)
    return _tree_placeholders(like, spec)


def _load(state: Any, spec: Any, like: Any, *, name: str, member: bool) -> Any:
    load = getattr(type(like), "__fh_load_state_dict__", None)
    if load is not None:
        return load(like, state, spec, name=name)
    if _by_fields(like, member=member):
        return _load_fields(state, spec, like, name=name)
    return load_tree(state, spec, like, name=name)


def _by_fields(x: Any, *, member: bool) -> bool:
    """Saved field by field: a NamedTuple state, one with a field of a host value (a step
    count) or with no field, or (a combinator's ``member``) any NamedTuple; not a
    :class:`MaskedNode` leaf. A NamedTuple of trees of tensors elsewhere is a tree (params)."""
    if not (isinstance(x, tuple) and hasattr(type(x), "_fields")) or is_masked(x):
        return False
    return member or not x or any(_is_scalar(v) for v in x)


def _is_scalar(x: Any) -> bool:
    return isinstance(x, (bool, int, float, str))


def _as_dict(state: Any, like: Any, convert: Callable[[Any, Any], Any]) -> dict[str, Any]:
    """A NamedTuple as a dict: host scalars as they are, the rest converted (with ``like``'s
    field, if any), None left out."""
    out: dict[str, Any] = {}
    for name, value in zip(state._fields, state):
        if value is None:
            continue
        out[name] = value if _is_scalar(value) else convert(value, _field(like, name))
    return out


def _field(like: Any, name: str) -> Any:
    return None if like is None else getattr(like, name)


def _load_fields(state: dict, spec: Any, like: Any, *, name: str) -> Any:
    values = {}
    for field, value in zip(like._fields, like):
        if value is None:
            values[field] = None
            continue
        if field not in state:
            raise ValueError(f"{name}: has no entry {field!r} (for {type(like).__name__}.{field})")
        if _is_scalar(value):
            values[field] = state[field]
        else:
            values[field] = load_entry(state[field], spec, value, name=f"{name}[{field!r}]")
    return type(like)(**values)


# -- the per-leaf form ------------------------------------------------------------------------


@dataclass(frozen=True)
class Form:
    """How one leaf sits in a checkpoint on this rank.

    ``kind``: ``"whole"`` (Replicate: the local value is the leaf), ``"own"`` (a Shard(d)
    spec's shard, as it is) or ``"rows"`` (Flat: an even chunk of dim 0, converted per
    bucket). For ``"rows"``, ``chunks`` holds every group member's ``[lo, hi)`` row range,
    row-major over the sharded axes in mesh order, and ``mine`` this rank's index in it.
    """

    kind: str
    placements: tuple
    shape: tuple[int, ...]  # this rank's local shape in the checkpoint
    chunks: tuple[tuple[int, int], ...] = ()
    mine: int = 0
    full: tuple[int, ...] | None = None  # the DTensor's shape, if not the leaf's (replicas)

    def replicated_over(self, mesh: Any, axes: tuple[str, ...], shape: tuple) -> Form:
        """This form with a leading dim of one row per replica (``axes``: a spec's replica
        axes, whose coordinates hold their own values): ``Shard(0)`` there, the other
        placements' dims moved by one."""
        lead = math.prod(mesh.size(a) for a in axes)
        placed = tuple(
            Shard(0) if a in axes else Shard(p.dim + 1) if isinstance(p, Shard) else p
            for a, p in zip(mesh.axis_names, self.placements)
        )
        return Form(
            kind=self.kind,
            placements=placed,
            shape=(1, *self.shape),
            chunks=self.chunks,
            mine=self.mine,
            full=(lead, *shape),
        )


def even_chunks(n: int, sizes: Sequence[int]) -> list[tuple[int, int]]:
    """``[lo, hi)`` of every part when ``n`` rows are ``torch.chunk``-ed over each of
    ``sizes`` in turn (nested, as DTensor places several ``Shard(0)``), row-major."""
    parts = [(0, n)]
    for size in sizes:
        parts = [
            (min(lo + k * c, hi), min(lo + (k + 1) * c, hi))
            for lo, hi in parts
            for c in (-(-(hi - lo) // size),)
            for k in range(size)
        ]
    return parts


def forms(plan: Plan, role: str = ROLE) -> list[Form]:
    """Every leaf's :class:`Form` at ``role`` on this rank: ``Shard(0)`` over the axes where
    ``role`` is sharded, nested in mesh order (``torch.chunk`` semantics, uneven allowed), a
    ``Shard(d)`` spec's leaf on its own dim, 0-d and zero-size leaves whole. A spec with
    replica axes (:func:`~functional_hsdp.replicas`) saves every replica's values: one more
    leading dim, of one row per replica (a checkpoint loads on the same number of replicas)."""
    out = _forms(plan, role)
    mesh = plan.mesh
    # a fault-tolerant replica axis (``apart_axes``) is no DeviceMesh dim: each replica group
    # saves its own checkpoint on its own device mesh, its values as they are
    apart = tuple(getattr(mesh, "apart_axes", ()))
    out = [
        f.replicated_over(mesh, rows, tuple(shape)) if rows else f
        for f, spec, shape in zip(out, plan.specs, plan.shapes)
        for rows in (tuple(a for a in spec.replica_axes if a not in apart),)
    ]
    if not apart:
        return out
    kept = [k for k, a in enumerate(mesh.axis_names) if a not in apart]
    return [dataclasses.replace(f, placements=tuple(f.placements[k] for k in kept)) for f in out]


def _forms(plan: Plan, role: str) -> list[Form]:
    mesh, out = plan.mesh, []
    names = mesh.axis_names
    for i, (shape, spec) in enumerate(zip(plan.shapes, plan.specs)):
        axes = spec.sharded_axes(role)
        if not axes or math.prod(shape) == 0 or not shape:
            out.append(Form("whole", (Replicate(),) * len(names), tuple(shape)))
        elif spec.shard is not None:
            dim = spec.shard[1] % len(shape)
            placed = tuple(Shard(dim) if a in axes else Replicate() for a in names)
            out.append(Form("own", placed, plan.local_shapes[role][i]))
        else:
            ordered = [a for a in names if a in axes]
            chunks = even_chunks(shape[0], [mesh.size(a) for a in ordered])
            mine = 0
            for a in ordered:
                mine = mine * mesh.size(a) + mesh.coordinate(a)
            lo, hi = chunks[mine]
            placed = tuple(Shard(0) if a in axes else Replicate() for a in names)
            out.append(
                Form(
                    kind="rows",
                    placements=placed,
                    shape=(hi - lo, *shape[1:]),
                    chunks=tuple(chunks),
                    mine=mine,
                )
            )
    return out


def dtensor_mesh(plan_or_mesh: Any) -> Any:
    """The DeviceMesh of a plan's (or a mesh's) DistMesh, which checkpoints' DTensors live
    on; a TypeError for a SimMesh."""
    mesh = getattr(plan_or_mesh, "mesh", plan_or_mesh)
    device_mesh = getattr(mesh, "device_mesh", None)
    if device_mesh is None:
        raise TypeError(
            f"checkpoints need a DistMesh (DTensors live on a real DeviceMesh); got {mesh!r}"
        )
    return device_mesh


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (size-0 dims count as 1)."""
    stride, out = 1, []
    for n in reversed(shape):
        out.append(stride)
        stride *= max(n, 1)
    return tuple(reversed(out))


def _dtensor(plan: Plan, i: int, local: torch.Tensor, *, form: Form) -> DTensor:
    shape = tuple(plan.shapes[i]) if form.full is None else form.full
    if form.full is not None and local.dim() < len(form.shape):
        local = local.unsqueeze(0)  # this replica's row
    return DTensor.from_local(
        local,
        dtensor_mesh(plan),
        form.placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=contiguous_stride(shape),
    )


def leaf_keys(treedef: optree.PyTreeSpec, paths: Sequence[str]) -> list[str]:
    """Each leaf's checkpoint key: its path joined with '.' (torch's FQN style)."""
    keys = [".".join(map(str, p)) or "value" for p in treedef.paths()]
    seen: dict[str, str] = {}
    for key, path in zip(keys, paths):
        if key in seen:
            raise ValueError(
                f"{path}: its checkpoint key {key!r} is also {seen[key]}'s (keys join the "
                "path with '.'); rename one of them"
            )
        seen[key] = path
    return keys


def _flat_buckets(plan: Plan, role: str) -> list[int]:
    """The buckets whose leaves need converting: Flat at ``role`` on some axis."""
    return [
        b
        for b, bucket in enumerate(plan.buckets)
        if bucket.shard is None and plan.placed[b][role].axes
    ]


# -- saving: local pieces -> even chunks ------------------------------------------------------


def _tree_state(tree: Any, spec: Any, like: Any) -> dict[str, DTensor]:
    # MaskedNode leaves (another label's, in a PartitionState) stand in as zeros: not saved
    leaves, present, treedef, paths = unmask(tree, "tree")
    if not any(present):
        return {}
    with agreement(spec, "state_dict") as agreed:
        if spec is None:
            raise TypeError("state_dict: spec is required (the Spec the tree was made with)")
        roles, kinds = (ROLE, "parameter"), ("final", "weights")
        like = None if like is None else _with_stand_ins(like)
        plan, role = find_plan(
            leaves, treedef, paths, spec=spec, like=like, roles=roles, kinds=kinds, name="tree"
        )
        dtensor_mesh(plan)
        keys = leaf_keys(treedef, paths)
        agreed.check(plan, paths, options=(f"from {role}",))
    saved = zip(keys, to_checkpoint(plan, leaves, role), present)
    return {key: x for key, x, kept in saved if kept}


def _with_stand_ins(tree: Any) -> Any:
    """``tree`` with its MaskedNode leaves as zero stand-ins (see :func:`unmask`)."""
    leaves, _, treedef, _ = unmask(tree, "tree")
    return optree.tree_unflatten(treedef, leaves)


def to_checkpoint(plan: Plan, leaves: list, role: str = ROLE) -> list[DTensor]:
    """Local shards at ``role`` -> per-leaf DTensors, in leaf order.

    A Flat leaf's local piece is an arbitrary range of the flattened leaf (its part of the
    rank's bucket chunk), which no DTensor placement describes, so each Flat bucket is
    all-gathered (its ``role`` -> full program, through the scheduler), each leaf's dim-0
    chunk copied out and the bucket dropped: one bucket at a time. Whole and ``Shard(d)``
    leaves are their checkpoint chunks already. Collective."""
    shapes = forms(plan, role)
    local = list(leaves)
    for s in plan.empty:
        i = s.index
        local[i] = torch.empty(plan.shapes[i], dtype=plan.dtypes[i], device=plan.devices[i])
    flat = _flat_buckets(plan, role)

    def sink(j: int, full: torch.Tensor) -> None:
        bucket = plan.buckets[flat[j]]
        for s, x in zip(bucket.slots, unpack_full(bucket, full, ())):
            form = shapes[s.index]
            if form.kind == "rows":
                lo, hi = form.chunks[form.mine]
                x = x[lo:hi]
            local[s.index] = x.clone()  # a copy: the bucket is dropped

    programs = [plan.program(b, role, "full") for b in flat]
    source = lambda j: plan.pack(flat[j], leaves, role)  # noqa: E731
    run(plan.mesh, programs, source, depth=1, sink=sink)
    return [_dtensor(plan, i, x, form=f) for i, (x, f) in enumerate(zip(local, shapes))]


# -- loading: even chunks -> local pieces -----------------------------------------------------


def _tree_placeholders(like: Any, spec: Any) -> dict[str, DTensor]:
    _, present, _, _ = unmask(like, "like")
    if not any(present):
        return {}
    return placeholders(_like_plan(_with_stand_ins(like), spec)[0], present)


def placeholders(plan: Plan, present: list[bool] | None = None) -> dict[str, DTensor]:
    """``{key: DTensor}`` for ``dcp.load``: this rank's chunk of every leaf of ``plan``
    (``present``: which leaves; default all), allocated from metadata only, not filled."""
    keys = leaf_keys(plan.treedef, _paths(plan))
    out = {}
    for i, (key, form) in enumerate(zip(keys, forms(plan))):
        if present is None or present[i]:
            local = torch.empty(form.shape, dtype=plan.dtypes[i], device=plan.devices[i])
            out[key] = _dtensor(plan, i, local, form=form)
    return out


def _paths(plan: Plan, name: str = "like") -> tuple[str, ...]:
    return paths_of(plan.treedef, name)


def _device(mesh: Any) -> torch.device:
    """The device of the mesh's ranks (for leaves of a meta ``like``)."""
    kind = dtensor_mesh(mesh).device_type
    module = getattr(torch, kind, None)
    if kind != "cpu" and module is not None and hasattr(module, "current_device"):
        return torch.device(kind, module.current_device())
    return torch.device(kind)


def _like_plan(like: Any, spec: Any, *, kinds: tuple | None = None) -> tuple[Plan, tuple[str, ...]]:
    """The plan of local shards of ``like``'s full shapes and dtypes under ``spec``
    (``kinds``: which leaves may share a bucket, as :class:`TreeMeta`'s; default the
    dtypes)."""
    leaves, treedef, paths = flatten(like, "like")
    if spec is None:
        raise TypeError("spec is required (the Spec or spec tree to load at)")
    specs, units = resolve_specs(spec, treedef, "like")
    for leaf, path in zip(leaves, paths):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{path}: expected a tensor giving the full shape and dtype (a meta tensor is "
                f"enough); got {type(leaf).__name__}"
            )
    device = _device(specs[0].mesh)
    meta = TreeMeta(
        treedef=treedef,
        shapes=tuple(tuple(x.shape) for x in leaves),
        dtypes=tuple(x.dtype for x in leaves),
        devices=tuple(device if x.is_meta else x.device for x in leaves),
        specs=specs,
        units=units,
        kinds=kinds,
    )
    return get_plan(meta, paths), paths


def loaded_chunks(
    state: dict, plan: Plan, shapes: list[Form], *, name: str, present: list[bool] | None = None
) -> list[torch.Tensor]:
    """Each leaf's checkpoint chunk from ``state`` (a dict of ``{key: DTensor}`` that
    ``dcp.load`` filled), checked against ``plan`` and ``shapes`` (its :func:`forms`): keys,
    shapes, dtypes and placements, errors naming ``name[key]``. A leaf not ``present``
    (masked): zeros of its checkpoint shape, never read. Feed them to
    :func:`from_checkpoint`."""
    paths = _paths(plan)
    keys = leaf_keys(plan.treedef, paths)
    present = [True] * len(keys) if present is None else present
    for key, path, kept in zip(keys, paths, present):
        if kept and key not in state:
            raise ValueError(f"{name}: has no entry {key!r} for {path}")
    known = {key for key, kept in zip(keys, present) if kept}
    for key in state:
        if key not in known:
            raise ValueError(f"{name}[{key!r}]: is not a leaf of like")
    out = []
    for i, (key, path, form) in enumerate(zip(keys, paths, shapes)):
        if not present[i]:
            out.append(
                torch.zeros(
                    form.shape[1:] if form.full else form.shape,
                    dtype=plan.dtypes[i],
                    device=plan.devices[i],
                )
            )
            continue
        x, where = state[key], f"{name}[{key!r}]"
        if not isinstance(x, DTensor):
            raise TypeError(f"{where}: expected a DTensor; got {type(x).__name__}")
        want = tuple(plan.shapes[i]) if form.full is None else form.full
        if tuple(x.shape) != want:
            replicas = "" if form.full is None else " (a row per replica in front)"
            raise ValueError(
                f"{where}: holds shape {tuple(x.shape)}, but {path} has shape {want}{replicas}"
            )
        if x.dtype != plan.dtypes[i]:
            raise TypeError(f"{where}: holds {x.dtype}, but {path} is {plan.dtypes[i]}")
        _check_placed(x, plan, form, where=where)
        out.append(_own_local(x) if form.full is None else x.to_local()[0])
    return out


def _check_placed(x: DTensor, plan: Plan, form: Form, *, where: str) -> None:
    local = x.to_local()
    if (
        x.device_mesh != dtensor_mesh(plan)
        or tuple(x.placements) != form.placements
        or tuple(local.shape) != form.shape
    ):
        raise ValueError(
            f"{where}: placed {list(x.placements)} with local shape {tuple(local.shape)} on "
            f"{x.device_mesh}, but this spec and mesh want {list(form.placements)} with "
            f"{form.shape}; make the state with empty_state_dict(like, spec)"
        )


def _own_local(x: DTensor) -> torch.Tensor:
    """The DTensor's local tensor; the tensor it was made from when ``to_local`` gives a whole
    view of it (so loaded leaves are plain tensors, not views of placeholders)."""
    local = x.to_local()
    base = local._base
    if base is not None and base.shape == local.shape and base.stride() == local.stride():
        return base
    return local


def load_tree(state: dict, spec: Any, like: Any, *, name: str, kinds: tuple | None = None) -> Any:
    """A tree of local shards at ``spec``'s optimizer placement from ``state`` (``{key:
    DTensor}``), laid out as ``like``'s full shapes and dtypes (its :class:`MaskedNode` leaves
    loaded as MaskedNode at their local shapes); ``kinds``: which leaves may share a bucket, as
    :class:`TreeMeta`'s (default the dtypes). Tagged as weights, so the optimizers and
    ``gather`` find its layout. Collective."""
    _, present, treedef, _ = unmask(like, "like")
    if not any(present):
        return like
    like = _with_stand_ins(like)  # MaskedNode leaves: loaded as such, at their local shapes
    with agreement(spec, "load_state_dict") as agreed:
        plan, paths = _like_plan(like, spec, kinds=kinds)
        shapes = forms(plan)
        local = loaded_chunks(state, plan, shapes, name=name, present=present)
        agreed.check(plan, paths)
    out = from_checkpoint(plan, local, shapes)
    tag(out, plan, ROLE, kind="weights")
    if not isinstance(spec, Spec):
        remember_units(like, spec, plan)
    local_shapes = plan.local_shapes[ROLE]
    out = [
        x if kept else masked_like(local_shapes[i], plan.dtypes[i])
        for i, (x, kept) in enumerate(zip(out, present))
    ]
    return optree.tree_unflatten(treedef, out)


def from_checkpoint(plan: Plan, local: list, shapes: list[Form]) -> list[torch.Tensor]:
    """Per-leaf checkpoint chunks (:func:`loaded_chunks`) -> local shards at the optimizer
    placement, in leaf order.

    For each Flat bucket, this rank's chunks are packed into equal blocks, all-gathered over
    the sharded axes and this rank's Flat pieces copied out: one bucket at a time, no
    arithmetic (bit-exact). Collective."""
    out = list(local)  # whole and own leaves are their shards already
    for s in plan.empty:
        i = s.index
        shape = plan.local_shapes[ROLE][i]
        out[i] = torch.zeros(shape, dtype=plan.dtypes[i], device=plan.devices[i])
    flat = _flat_buckets(plan, ROLE)
    programs = [_gather_program(plan, b, shapes) for b in flat]

    def sink(j: int, gathered: torch.Tensor) -> None:
        for i, piece in _pieces(plan, flat[j], gathered, local=local, shapes=shapes):
            out[i] = piece

    source = lambda j: _blocks(plan, flat[j], local=local, shapes=shapes)  # noqa: E731
    run(plan.mesh, programs, source, depth=1, sink=sink)
    return out


def _block_widths(plan: Plan, b: int, shapes: list[Form]) -> list[int]:
    """Per slot of bucket ``b``: its width in a rank's block (the longest chunk; 0 for leaves
    every rank holds whole)."""
    widths = []
    for s in plan.buckets[b].slots:
        form = shapes[s.index]
        rows = max((hi - lo for lo, hi in form.chunks), default=0)
        widths.append(rows * math.prod(plan.shapes[s.index][1:]) if form.kind == "rows" else 0)
    return widths


def _gather_program(plan: Plan, b: int, shapes: list[Form]) -> tuple[Step, ...]:
    """All-gathers over bucket ``b``'s sharded axes, innermost first: blocks come out
    row-major in mesh order. None when no leaf is chunked (0-d leaves only)."""
    if not any(_block_widths(plan, b, shapes)):
        return ()
    mesh, axes = plan.mesh, plan.placed[b][ROLE].axes
    ordered = [a for a in mesh.axis_names if a in axes and mesh.size(a) > 1]
    return tuple(
        Step(op="all_gather", axis=a, reduce=None, size=mesh.size(a)) for a in reversed(ordered)
    )


def _blocks(plan: Plan, b: int, *, local: list, shapes: list[Form]) -> torch.Tensor:
    """This rank's block of bucket ``b``: each chunked leaf's chunk, zero-padded to its
    width."""
    bucket, parts = plan.buckets[b], []
    for s, width in zip(bucket.slots, _block_widths(plan, b, shapes)):
        if width:
            x = local[s.index].reshape(-1)
            parts.append(torch.nn.functional.pad(x, (0, width - x.numel())))
    if not parts:
        return torch.empty(0, dtype=bucket.dtype, device=bucket.device)
    return torch.cat(parts)


def _pieces(plan: Plan, b: int, gathered: torch.Tensor, *, local: list, shapes: list[Form]):
    """(leaf index, this rank's Flat piece) for the leaves of bucket ``b``, from the gathered
    blocks (or the whole leaf)."""
    bucket, widths = plan.buckets[b], _block_widths(plan, b, shapes)
    mesh = plan.mesh  # a DistMesh: this rank's coordinates
    rank = tuple(mesh.coordinate(a) for a in mesh.axis_names)
    start, length = chunk_of(mesh, bucket, axes=plan.placed[b][ROLE].axes, rank=rank)
    mine = _kept(plan, b)
    n_blocks = max((len(shapes[s.index].chunks) for s in bucket.slots), default=1)
    blocks = gathered.view(n_blocks, -1) if gathered.numel() else gathered
    offset = 0
    for s, width, kept in zip(bucket.slots, widths, mine):
        lo, hi = piece_of(s, start, length)
        if width:
            row = math.prod(plan.shapes[s.index][1:])
            piece = _piece(
                blocks[:, offset : offset + width], row, shapes[s.index].chunks, lo=lo, hi=hi
            )
        else:
            piece = local[s.index].reshape(-1)[lo:hi].clone()
        offset += width
        yield s.index, piece if kept else piece[:0]  # only the owner keeps it


def _kept(plan: Plan, b: int) -> list[bool]:
    """Per slot of bucket ``b``: whether this rank keeps its piece (always, but at a keep
    spec's optimizer placement, :class:`~functional_hsdp.plan.owner.KeptPieces`, where only
    the pieces
    its coordinate owns are kept)."""
    bucket, geometry = plan.buckets[b], plan.placed[b][ROLE].geometry
    if not getattr(geometry, "kept", False):
        return [True] * len(bucket.slots)
    mine = {j for _, at in geometry.items for j, *_ in at}  # a DistMesh: this rank's
    return [j in mine for j in range(len(bucket.slots))]


def _piece(blocks: torch.Tensor, row: int, chunks: Sequence, *, lo: int, hi: int) -> torch.Tensor:
    """Elements ``[lo, hi)`` of a flattened leaf whose k-th row chunk is at the front of
    ``blocks[k]`` (a new tensor)."""
    parts = []
    for k, (first, last) in enumerate(chunks):
        a, z = max(first * row, lo), min(last * row, hi)
        if a < z:
            parts.append(blocks[k, a - first * row : z - first * row])
    return torch.cat(parts) if parts else blocks.new_empty(0)

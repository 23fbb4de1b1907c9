"""``reduce_grads``, ``shard``, ``gather`` and ``sync_params``: pure functions from trees to trees.

Each is a composition of per-axis bucket collectives (see :mod:`functional_hsdp.plan`): pack
the leaves into buckets, move the buckets from one role's placements to another's one mesh
axis at a time, unpack. Inputs are never mutated; results are new trees of plain tensors.

Every result leaf carries a small state tag (which plan made it, at which role, accumulating
or final), the way JAX tracks which axes a value varies over, so that feeding a result back in
the wrong state is an error rather than silent corruption. A tensor made by the user (say by
``tree_map``, a copy or a load) has no tag and is checked by structure, dtype and shape only.
"""

from __future__ import annotations

import functools
import operator
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import count, repeat
from typing import Any

import optree
import torch

from . import validate
from .plan import Plan, get_plan, layouts_for, run
from .spec import Spec, format_path, resolve_specs

__all__ = ["reduce_grads", "shard", "gather", "sync_params"]


@dataclass(frozen=True, eq=False)
class _State:
    plan: Plan
    role: str  # the role whose placements the value is at
    kind: str  # "accumulating" | "final" | "weights"
    # Weak references to the bucket buffers the leaves view (None: that bucket's leaves are
    # copies). A later call given these very leaves back as acc reads a live buffer instead
    # of packing the leaves again; weak, so that a dead result's buffers are freed.
    bufs: tuple[weakref.ref | None, ...] | None = None
    refs: tuple[weakref.ref, ...] = ()  # the result's leaves, in order


# id(tensor) -> (weak reference to it, its state, its index in the result's leaves). Kept
# beside the tensors rather than on them, so that copying, pickling or torch.save of a result
# does not drag plans and meshes along. No per-tensor callback (the cost would be paid on
# every result leaf): dead entries are swept whenever the registry has doubled.
_STATES: dict[int, tuple[weakref.ref, _State, int]] = {}
_SWEEP_AT = [1 << 14]


def _tag(
    leaves: list[torch.Tensor], plan: Plan, role: str, kind: str, bufs: list | None = None
) -> None:
    """Register ``leaves`` (one result, in tree order) with their state; ``bufs``: the bucket
    buffers they were unpacked from, remembered (weakly) where the leaves are views."""
    if torch.compiler.is_compiling():  # a side registry dynamo cannot trace: results untagged
        return
    if bufs is not None:  # a same-shape view's base lives as long as the leaves do
        bufs = tuple(
            weakref.ref(x._base if x._base is not None and x._base.shape == x.shape else x)
            if plan.views(b, role)
            else None
            for b, x in enumerate(bufs)
        )
    refs = tuple(map(weakref.ref, leaves))
    state = _State(plan, role, kind, bufs, refs)
    _STATES.update(zip(map(id, leaves), zip(refs, repeat(state), count())))
    if len(_STATES) > _SWEEP_AT[0]:
        for key in [k for k, (ref, _, _) in _STATES.items() if ref() is None]:
            del _STATES[key]
        _SWEEP_AT[0] = max(1 << 14, 2 * len(_STATES))


def _state(leaf: Any) -> _State | None:
    """The state of a tagged leaf, else None. (Not under torch.compile: reading the registry
    would make dynamo guard on it; callers that can be traced check is_compiling first.)"""
    entry = _STATES.get(id(leaf))
    return entry[1] if entry is not None and entry[0]() is leaf else None


def _own_state(leaves: list, plan: Plan, role: str, kind: str) -> _State | None:
    """The state of ``leaves`` if they are, in order, exactly one result of ``plan`` at
    ``role`` and ``kind`` (so dtype, shape and placement are known right), else None."""
    state = _result_state(leaves)
    if state is None or state.plan is not plan or state.role != role or state.kind != kind:
        return None
    return state


def _result_state(leaves: list) -> _State | None:
    """The state of ``leaves`` if they are, in order, exactly the leaves of one result."""
    if torch.compiler.is_compiling():
        return None
    entry = _STATES.get(id(leaves[0])) if leaves else None
    if entry is None:
        return None
    state = entry[1]
    # every leaf is the live object the result held at that position (C-level loops)
    if len(state.refs) == len(leaves) and all(map(operator.is_, map(_deref, state.refs), leaves)):
        return state
    return None


_deref = weakref.ref.__call__


def _flatten(tree: Any, name: str) -> tuple[list, optree.PyTreeSpec, tuple[str, ...]]:
    leaves, treedef = optree.tree_flatten(tree)
    if torch.compiler.is_compiling():  # traced once per graph: skip the cache (keyed by treedef)
        return leaves, treedef, _paths.__wrapped__(treedef, name)
    return leaves, treedef, _paths(treedef, name)


@functools.lru_cache(maxsize=1024)
def _paths(treedef: optree.PyTreeSpec, name: str) -> tuple[str, ...]:
    # Paths depend on the structure alone: format them once per structure.
    return tuple(f"{name}{format_path(p)}" for p in treedef.paths())


def _check_tensors(
    leaves: list, paths: Sequence[str], mesh: Any, *, floating: bool, batched: bool
) -> None:
    batch = mesh.batch_shape
    for leaf, path in zip(leaves, paths):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"{path}: expected a torch.Tensor leaf; got {type(leaf).__name__}")
        if leaf.layout != torch.strided:
            raise TypeError(
                f"{path}: expected a dense (strided) tensor; got layout {leaf.layout}; "
                "call .to_dense() first"
            )
        if leaf.device.type == "meta":
            raise ValueError(f"{path}: is on the meta device and holds no data")
        if floating and not (leaf.is_floating_point() or leaf.is_complex()):
            raise TypeError(f"{path}: gradients must have a floating dtype; got {leaf.dtype}")
        if batched and tuple(leaf.shape[: len(batch)]) != batch:
            raise ValueError(
                f"{path}: on {mesh!r} a value's leading dims must be the mesh shape {batch} "
                f"(rank (i, j, ...) holds x[i, j, ...]); got shape {tuple(leaf.shape)}"
            )


def _check_last(last: Any) -> None:
    if not isinstance(last, bool):
        raise TypeError(
            f"last must be a bool (True on the final microbatch); got {type(last).__name__} "
            f"{last!r}"
        )


# (structure, every leaf's shape/dtype/device/layout, spec, name) -> plan, for gradient trees
# that passed _check_tensors: a later tree with the same metadata passes them too, so the
# per-leaf checks run once per layout, not once per call.
_CHECKED: dict[tuple, Plan] = {}
_META = operator.attrgetter("shape", "dtype", "device", "layout")


def _grads_plan(leaves: list, treedef: optree.PyTreeSpec, paths: tuple, spec: Any, name: str):
    """The plan of a tree of per-rank gradients, validated on its first use."""
    try:
        metas = tuple(map(_META, leaves))
        key = (
            treedef,
            metas,
            spec
            if isinstance(spec, Spec)
            else optree.tree_flatten(spec, is_leaf=lambda x: isinstance(x, Spec)),
            name,
        )
        plan = _CHECKED.get(key)
    except (AttributeError, TypeError):  # not tensors, or an unhashable spec: check below
        key = plan = None
    if plan is not None:
        return plan
    specs = resolve_specs(spec, treedef, name)
    mesh = specs[0].mesh
    _check_tensors(leaves, paths, mesh, floating=True, batched=True)
    nb = len(mesh.batch_shape)
    plan = _plan_from(leaves, treedef, paths, specs, (tuple(x.shape[nb:]) for x in leaves))
    if key is not None:
        if len(_CHECKED) >= 256:
            _CHECKED.pop(next(iter(_CHECKED)))
        _CHECKED[key] = plan
    return plan


# -- torch.compile ----------------------------------------------------------------------------
#
# Under torch.compile(fullgraph=True) dynamo traces reduce_grads, but cannot hash an optree
# PyTreeSpec (the plan caches' keys). So the traced call hands the tree's structure (as a
# skeleton of int leaves), each leaf's shape, dtype and device, and the Specs, all of which
# dynamo guards on, to a function dynamo runs as plain Python (assume_constant_result): the
# eager lookup, checks included, on stand-in tensors. It returns a key; the trace reads the
# plan under it. Results of traced calls are not tagged, nor logged in comm_log.

# id(plan) -> plan, for the plans that traced code uses (kept alive: graphs refer to them).
_TRACED_PLANS: dict[int, Plan] = {}


def _traced_grads_plan(grads: Any, leaves: list, spec: Any, name: str) -> Plan:
    """:func:`_grads_plan` under torch.compile."""
    # A plan is per shape: operator.index specializes any dynamic dim (with a guard).
    metas = tuple((tuple(map(operator.index, x.shape)), x.dtype, x.device) for x in leaves)
    skeleton = optree.tree_map(lambda _: 0, grads)
    if isinstance(spec, Spec):
        return _TRACED_PLANS[_traced_plan_key(skeleton, metas, name, None, spec)]
    # Specs only pass one by one (dynamo cannot make a constant of a container of them).
    specs = optree.tree_leaves(spec, is_leaf=lambda x: isinstance(x, Spec))
    spec_skeleton = optree.tree_map(lambda _: 0, spec, is_leaf=lambda x: isinstance(x, Spec))
    return _TRACED_PLANS[_traced_plan_key(skeleton, metas, name, spec_skeleton, *specs)]


@torch._dynamo.assume_constant_result
def _traced_plan_key(skeleton: Any, metas: tuple, name: str, spec_skeleton: Any, *specs) -> int:
    # Runs as plain Python at trace time (is_compiling() is still true, so this calls the
    # eager helpers directly). Every geometry the trace reads is computed here, so that the
    # trace does not fill the plan's caches.
    treedef = optree.tree_structure(skeleton)
    if spec_skeleton is None:
        spec = specs[0]
    else:
        spec = optree.tree_unflatten(optree.tree_structure(spec_skeleton), specs)
    stand_ins = [torch.empty((), dtype=d, device=v).expand(s) for s, d, v in metas]
    plan = _grads_plan(stand_ins, treedef, _paths(treedef, name), spec, name)
    for b in range(len(plan.buckets)):
        for role in ("gradient", "optimizer"):
            if plan.is_flat(plan.buckets[b], role):
                plan.geometry(b, role)
    _TRACED_PLANS[id(plan)] = plan
    return id(plan)


def _plan_from(leaves: list[torch.Tensor], treedef, paths, specs, shapes) -> Plan:
    return get_plan(
        treedef,
        paths,
        tuple(shapes),
        tuple(x.dtype for x in leaves),
        tuple(x.device for x in leaves),
        specs,
    )


def _structure_error(expected: optree.PyTreeSpec, tree: Any, name: str, what: str) -> ValueError:
    reference = optree.tree_unflatten(expected, [0] * expected.num_leaves)
    errors = optree.prefix_errors(reference, tree) or optree.prefix_errors(tree, reference)
    detail = errors[0](name) if errors else f"expected {expected}"
    return ValueError(f"{name} does not have the structure of {what}: {detail}")


def _check_local(
    leaves: list, paths: Sequence[str], plan: Plan, role: str, kinds: tuple[str, ...], what: str
) -> None:
    """Validate local values against ``plan`` at ``role``: dtype, shape and state tag."""
    compiling = torch.compiler.is_compiling()  # then nothing is tagged
    for (slot, b), leaf, path in zip(plan.slots(), leaves, paths):
        state = None if compiling else _state(leaf)
        if state is not None and state.plan is plan and state.role == role and state.kind in kinds:
            continue  # made by this very plan at this role: dtype and shape are right
        if state is not None:
            if (
                state.plan.treedef != plan.treedef
                or state.plan.shapes != plan.shapes
                or state.plan.specs != plan.specs
            ):
                raise ValueError(
                    f"{path}: was produced for another tree or spec ({state.plan!r}); it cannot "
                    f"be used as {what}"
                )
            if state.kind not in kinds:
                raise ValueError(_KIND_ERRORS[(state.kind, kinds)].format(path=path))
        if leaf.dtype != plan.dtypes[slot.index]:
            raise TypeError(
                f"{path}: expected dtype {plan.dtypes[slot.index]} (as {what}); got {leaf.dtype}"
            )
        want = plan.local_shape(slot, role, b)
        if tuple(leaf.shape) != want:
            raise ValueError(
                f"{path}: expected local shape {want} at the {role} placement "
                f"{list(map(str, plan.specs[slot.index].placements(role)))}; got "
                f"{tuple(leaf.shape)}"
            )


_KIND_ERRORS = {
    ("final", ("accumulating",)): (
        "{path}: is a finalized result (reduce_grads(..., last=True) returned it), not a "
        "running accumulation; start the next step with acc=None"
    ),
    ("weights", ("accumulating",)): (
        "{path}: holds weights (from shard/sync_params), not a running gradient accumulation"
    ),
    ("accumulating", ("final", "weights")): (
        "{path}: is an accumulating gradient, still Partial on the deferred axes; finish it "
        "with reduce_grads(..., last=True) first"
    ),
}


def reduce_grads(
    grads: Any, spec: Any, *, last: bool, acc: Any = None, check_finite: bool = False
) -> Any:
    """Reduce one microbatch's per-rank gradients and add them to the running sum.

    Reduces every DP axis whose gradient placement is not Partial (reduce-scatter to Flat,
    all-reduce to Replicate), adds ``acc``, and when ``last`` reduces the deferred (Partial)
    axes to the optimizer placement: reduce-scatters first, then all-reduces on the shard.
    Accumulation is a sum: scale the loss by 1/M for M microbatches.

    Args:
        grads: pytree of floating per-rank gradients, full shapes (on a SimMesh with the mesh
            shape in front), Partial over every DP axis.
        spec: a :class:`Spec`, or a pytree prefix of Specs (one mesh).
        last: keyword-only, required: True on the final microbatch of the step.
        acc: the previous call's result for this step (None on the first microbatch).
        check_finite: raise ValueError naming the first leaf of ``grads`` holding NaN or Inf
            (and the ranks), on every rank, before any collective. Costs one tiny
            all-gather per call on a DistMesh; must be the same on every rank.

    Returns:
        A new tree with the structure of ``grads``: local shards at the gradient placement
        (still Partial on the deferred axes) or, when ``last``, at the optimizer placement.
        A Flat leaf's local shard is its part of the rank's bucket chunk, 1-D.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
        >>> spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
        >>> g = {"w": torch.ones(2, 2, 3), "b": torch.ones(2, 2)}
        >>> acc = fh.reduce_grads(g, spec, last=False)
        >>> acc = fh.reduce_grads(g, spec, last=True, acc=acc)
        >>> fh.gather(acc, spec)["w"][0, 0]
        tensor([2., 2., 2.])
    """
    return _reduce(grads, spec, last, acc, "grads", check_finite=check_finite)


def _reduce(
    grads: Any, spec: Any, last: Any, acc: Any, name: str, *, check_finite: bool = False
) -> Any:
    _check_last(last)
    if not isinstance(check_finite, bool):
        raise TypeError(f"check_finite must be a bool; got {type(check_finite).__name__}")
    leaves, treedef, paths = _flatten(grads, name)
    if not leaves:
        resolve_specs(spec, treedef, name)
        if acc is not None and optree.tree_structure(acc) != treedef:
            raise _structure_error(treedef, acc, "acc", name)
        return optree.tree_unflatten(treedef, [])
    if torch.compiler.is_compiling():
        plan = _traced_grads_plan(grads, leaves, spec, name)
    else:
        plan = _grads_plan(leaves, treedef, paths, spec, name)
    mesh = plan.mesh
    nb = len(mesh.batch_shape)
    legs: list = [("input", "gradient")]
    if acc is not None:  # checked before any collective, so a bad acc cannot strand peers
        acc_leaves, acc_def, acc_paths = _flatten(acc, "acc")
        if acc_def != treedef:
            raise _structure_error(treedef, acc, "acc", name)
        state = _own_state(acc_leaves, plan, "gradient", "accumulating")
        if state is None:  # not the previous call's result as it was returned: check it all
            _check_tensors(acc_leaves, acc_paths, mesh, floating=True, batched=True)
            _check_local(
                acc_leaves, acc_paths, plan, "gradient", ("accumulating",), "a running accumulation"
            )
        known = state.bufs if state is not None and state.bufs else (None,) * len(plan.buckets)
        acc_bufs = []
        for b, ref in enumerate(known):
            buf = ref() if ref is not None else None
            acc_bufs.append(buf if buf is not None else plan.pack_bucket(b, acc_leaves, "gradient"))
        legs.append(lambda b, buf: _accumulate(buf, acc_bufs[b]))
    if last:
        legs.append(("gradient", "optimizer"))
    if check_finite:
        packed = plan.pack(leaves, "input")
        nonfinite = validate.nonfinite_index(leaves, nb, packed)
    else:  # packed bucket by bucket, each just before its first collective
        packed, nonfinite = functools.partial(plan.pack_bucket, leaves=leaves, role="input"), None
    validate.check(
        plan,
        "reduce_grads" if name == "grads" else "reduce",
        paths,
        last=last,
        options=(f"check_finite={check_finite}",),
        nonfinite=nonfinite,
    )
    bufs = [_owned(mesh.wait(b)) for b in run(plan, packed, *legs)]
    role = "optimizer" if last else "gradient"
    out = plan.unpack(bufs, role)
    if last:
        _tag(out, plan, role, "final")
    else:
        _tag(out, plan, role, "accumulating", bufs)
    return optree.tree_unflatten(treedef, out)


def _borrowed(x: torch.Tensor) -> bool:
    """Whether ``x`` is a view of part of a larger buffer (a borrowed reduce-scatter result,
    see ``Mesh.reduce_scatter``): keeping it would keep the whole buffer alive."""
    base = x._base
    return base is not None and x.numel() < base.numel()


def _owned(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a copy of it if it is borrowed."""
    return x.clone() if _borrowed(x) else x


def _accumulate(buf: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """``buf + acc``: in place when ``buf`` is a dense buffer of its own, into a new tensor
    when it is borrowed (which spares a separate copy of it). A bucket buffer at this point is
    always one the call made (a packing buffer or a collective's result), never a caller's
    tensor; SimMesh's all-reduce results are broadcast views, so those add out of place."""
    if buf.is_contiguous() and not _borrowed(buf):
        return buf.add_(acc)
    return torch.add(buf, acc)


def shard(tree: Any, spec: Any, *, to: str = "optimizer", stacked: bool | None = None) -> Any:
    """Full (replicated) values -> this rank's local shards at the optimizer placement.

    Replicate -> Flat is a local slice: no communication.

    Args:
        tree: pytree of full tensors, the same on every rank. On a SimMesh either stacked
            (the mesh shape in front of every leaf, as :func:`gather` returns) or plain
            (meaning the same value on every rank).
        spec: a :class:`Spec` or a pytree prefix of Specs.
        to: ``"optimizer"`` (default) or ``"parameter"``.
        stacked: SimMesh only: whether ``tree`` carries the mesh dims. By default a tree is
            taken as stacked when every leaf starts with the mesh shape and is the same on
            every rank (a full value is replicated), else as plain; pass it to be explicit.

    Returns:
        A new tree, same structure, of local shards (1-D pieces on Flat buckets).

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp": 2})
        >>> fh.shard({"w": torch.arange(5.0)}, fh.fsdp(mesh))["w"]
        tensor([[0., 1., 2.],
                [3., 4., 0.]])
    """
    if to not in ("optimizer", "parameter"):
        raise ValueError(f"shard: to must be 'optimizer' or 'parameter'; got {to!r}")
    leaves, treedef, paths = _flatten(tree, "tree")
    specs = resolve_specs(spec, treedef, "tree")
    if not leaves:
        return optree.tree_unflatten(treedef, [])
    mesh = specs[0].mesh
    batch, nb = mesh.batch_shape, len(mesh.batch_shape)
    if stacked is None:
        stacked = all(_replicated(x, batch) for x in leaves)
    _check_tensors(leaves, paths, mesh, floating=False, batched=stacked)
    if not stacked:
        leaves = [x.expand(*batch, *x.shape) for x in leaves]
    plan = _plan_from(leaves, treedef, paths, specs, (tuple(x.shape[nb:]) for x in leaves))
    pack = functools.partial(plan.pack_bucket, leaves=leaves, role="full")
    out = plan.unpack([mesh.wait(b) for b in run(plan, pack, ("full", to))], to)
    _tag(out, plan, to, "weights")
    return optree.tree_unflatten(treedef, out)


def _replicated(x: torch.Tensor, batch: tuple[int, ...]) -> bool:
    """Whether ``x`` reads as a stacked replicated value: mesh dims in front, equal slices."""
    if not batch:  # a real rank holds only its own value
        return True
    if not isinstance(x, torch.Tensor) or x.layout != torch.strided or x.is_meta:
        return False  # _check_tensors refuses it with a clear error
    if tuple(x.shape[: len(batch)]) != batch:
        return False
    flat = x.reshape(-1, *x.shape[len(batch) :])
    return bool((flat == flat[:1]).all()) if flat.numel() else True


def gather(tree: Any, spec: Any, *, like: Any = None, source: str | None = None) -> Any:
    """Local shards -> full values on every rank (all-gathers, reverse split order).

    Args:
        tree: local shards at the optimizer placement (from :func:`shard`, a final
            :func:`reduce_grads`, or any elementwise function of those) or at the parameter
            placement (from :func:`sync_params`).
        spec: a :class:`Spec` or a pytree prefix of Specs.
        like: optional pytree of tensors with the full per-rank shapes (no mesh dims), for a
            tree whose layout this process has not seen in shard/reduce_grads.
        source: ``"optimizer"`` or ``"parameter"``; by default taken from the leaves' state,
            else found from the local shapes (optimizer first).

    Returns:
        A new tree of full tensors (on a SimMesh with the mesh shape in front).

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp": 2})
        >>> spec = fh.fsdp(mesh)
        >>> fh.gather(fh.shard({"w": torch.arange(5.0)}, spec), spec)["w"][1]
        tensor([0., 1., 2., 3., 4.])
    """
    return _move(tree, spec, "full", source, like, "tree")


def sync_params(tree: Any, spec: Any, *, like: Any = None) -> Any:
    """Main weights at the optimizer placement -> the parameter placement (all-gathers).

    A no-op copy when the two placements agree (ddp, fsdp, hsdp); for hfsdp it all-gathers
    over the outer axis.

    Args:
        tree: local shards at the optimizer placement.
        spec: a :class:`Spec` or a pytree prefix of Specs.
        like: optional pytree with the full per-rank shapes (see :func:`gather`).

    Returns:
        A new tree of local shards at the parameter placement.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"o": 2, "i": 2})
        >>> spec = fh.hfsdp(mesh, "o", "i")
        >>> w = fh.shard({"w": torch.arange(8.0)}, spec)
        >>> fh.sync_params(w, spec)["w"][0, 1]
        tensor([4., 5., 6., 7.])
    """
    return _move(tree, spec, "parameter", "optimizer", like, "tree")


def _move(tree: Any, spec: Any, to: str, source: str | None, like: Any, name: str) -> Any:
    if source not in (None, "optimizer", "parameter"):
        raise ValueError(f"source must be 'optimizer' or 'parameter'; got {source!r}")
    leaves, treedef, paths = _flatten(tree, name)
    specs = resolve_specs(spec, treedef, name)
    if not leaves:
        return optree.tree_unflatten(treedef, [])
    mesh = specs[0].mesh
    plan, role = _find_layout(leaves, treedef, paths, specs, like, source, name)
    validate.check(plan, f"move {role} -> {to}", paths)
    pack = functools.partial(plan.pack_bucket, leaves=leaves, role=role)
    out = plan.unpack([mesh.wait(b) for b in run(plan, pack, (role, to))], to)
    if to != "full":
        _tag(out, plan, to, "weights")
    return optree.tree_unflatten(treedef, out)


def _find_layout(leaves, treedef, paths, specs, like, source, name) -> tuple[Plan, str]:
    """The plan and role that ``leaves`` (local shards) are laid out at; checks them."""
    roles = [source] if source else ["optimizer", "parameter"]
    state = _result_state(leaves)
    if (
        like is None
        and state is not None
        and state.kind in ("final", "weights")
        and state.role in roles
        and state.plan.treedef == treedef
        and state.plan.specs == specs
    ):  # exactly a result of this library at a known layout: nothing to check
        return state.plan, state.role
    _check_tensors(leaves, paths, specs[0].mesh, floating=False, batched=True)
    found = list(map(_state, leaves))
    for state, path in zip(found, paths):
        if state is not None and state.kind == "accumulating":
            raise ValueError(_KIND_ERRORS[("accumulating", ("final", "weights"))].format(path=path))
    states = {id(s.plan): s for s in found if s is not None}
    if len(states) == 1 and None not in found:
        state = next(iter(states.values()))
        if state.plan.treedef == treedef and state.plan.specs == specs and state.role in roles:
            return state.plan, state.role

    nb = len(specs[0].mesh.batch_shape)
    if like is not None:
        like_leaves, like_def, _ = _flatten(like, "like")
        if like_def != treedef:
            raise _structure_error(treedef, like, "like", name)
        known = [tuple(tuple(x.shape) for x in like_leaves)]
    else:
        known = layouts_for(treedef, specs)
    first_error = None
    for role in roles:
        candidates = list(known)
        if like is None and not any(s.sharded_axes(role) for s in specs):
            candidates.append(tuple(tuple(x.shape[nb:]) for x in leaves))  # local == full
        for shapes in candidates:
            plan = _plan_from(leaves, treedef, paths, specs, shapes)
            try:
                _check_local(leaves, paths, plan, role, ("final", "weights"), "local shards")
            except ValueError as e:
                first_error = first_error or e
                continue
            return plan, role
    hint = (
        ""
        if like is not None
        else "; if this tree's layout was not made by shard/reduce_grads in this process, pass "
        "like=<tree of full-shape tensors>"
    )
    raise ValueError(
        f"{name}: its local shapes match no known layout of this tree and spec at the "
        f"{' or '.join(roles)} placement ({first_error}){hint}"
    )

"""Plan lookup: which plan a tree of gradients or local shards belongs to, checked once.

- :func:`grads_plan`: per-rank full gradients (their shapes are the full shapes). The leaf
  checks run on the first tree of each metadata; later trees with the same metadata reuse
  the result.
- :func:`traced_grads_plan`: the same under ``torch.compile``.
- :func:`find_plan`: local shards (their shapes are pieces): the plan and role they are
  laid out at, from their state tags or the full shapes this process has seen;
  :func:`find_plan_at`: the plan of local shards at one known role.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import optree
import torch

from ..base.cache import Bounded
from ..base.tags import kind_error, result_state, state_of
from ..base.tree import check_tensors, paths_of, structure_error
from ..spec.specs import Spec, resolve_specs
from .recipe import Plan, TreeMeta, get_plan, layouts_for

__all__ = [
    "check_local",
    "find_plan",
    "find_plan_at",
    "grads_plan",
    "plan_for",
    "traced_grads_plan",
]


def _is_spec(x: Any) -> bool:
    return isinstance(x, Spec)


def plan_for(
    leaves: Sequence[torch.Tensor],
    treedef: optree.PyTreeSpec,
    paths: tuple[str, ...],
    *,
    specs: tuple[Spec, ...],
    units: tuple[int, ...],
    shapes: Any,
) -> Plan:
    """The plan of a tree with these leaves' dtypes and devices and per-rank ``shapes``."""
    meta = TreeMeta(
        treedef=treedef,
        shapes=tuple(map(tuple, shapes)),
        dtypes=tuple(x.dtype for x in leaves),
        devices=tuple(x.device for x in leaves),
        specs=specs,
        units=units,
    )
    return get_plan(meta, paths)


# (structure, spec, name) -> [(every leaf's (shape, dtype, device, layout), plan), ...], newest
# first: gradient trees that passed the leaf checks, so a later tree whose leaves have the same
# metadata passes them too. The metadata is read in one pass over the leaves and compared with
# ``==`` (no per-leaf hash); one pass matters more than the tuples it makes: after the
# ``gc.collect()`` of a training step the tensors are out of cache, and every further pass over
# them (a Python loop cannot overlap its cache misses as torch.cat's C++ loop does) costs about
# as much as the first.
_CHECKED: Bounded = Bounded(256)
_KNOWN_PER_KEY = 8
_META = operator.attrgetter("shape", "dtype", "device", "layout")


def _spec_key(spec: Any) -> Any:
    return spec if isinstance(spec, Spec) else optree.tree_flatten(spec, is_leaf=_is_spec)


def grads_plan(
    leaves: list, treedef: optree.PyTreeSpec, paths: tuple, *, spec: Any, name: str
) -> Plan:
    """The plan of a tree of per-rank full gradients, its leaves checked on first use."""
    try:
        key = (treedef, _spec_key(spec), name)
        known = _CHECKED.get(key)
        meta = tuple(map(_META, leaves))
    except (AttributeError, TypeError):  # not tensors, or an unhashable spec: check below
        key = known = meta = None
    if known is not None:
        for k_meta, plan in known:
            if k_meta == meta:
                return plan
    specs, units = resolve_specs(spec, treedef, name)
    mesh = specs[0].mesh
    check_tensors(leaves, paths, mesh, floating=True, batched=True)
    nb = len(mesh.batch_shape)
    shapes = tuple(tuple(x.shape[nb:]) for x in leaves)
    _refuse_per_example(shapes, layouts_for(treedef, specs, units), paths)
    plan = plan_for(leaves, treedef, paths, specs=specs, units=units, shapes=shapes)
    if key is not None:
        entries = [m for m in (known or ()) if m[1] is not plan]
        _CHECKED[key] = [(meta, plan), *entries][:_KNOWN_PER_KEY]
    return plan


def _refuse_per_example(shapes: tuple, known: list, paths: Sequence[str]) -> None:
    """A tree of per-example gradients passed by mistake: every leaf is a known layout's
    leaf with one more leading dim, the same on every leaf (a vmap over examples)."""
    if not shapes or shapes in known:
        return
    for full in known:
        if len(full) == len(shapes) and all(
            len(s) == len(f) + 1 and s[1:] == f and s[0] == shapes[0][0]
            for s, f in zip(shapes, full)
        ):
            raise ValueError(
                f"{paths[0]}: has shape {shapes[0]}, a leaf of this tree with a leading dim of "
                f"{shapes[0][0]} in front of its shape {full[0]}, as on every leaf: "
                "per-example gradients? Sum (or average) them over that dim first; the library "
                "reduces one gradient per rank"
            )


# -- torch.compile ----------------------------------------------------------------------------
#
# Under torch.compile(fullgraph=True) dynamo traces reduce_grads, but cannot hash an optree
# PyTreeSpec (the plan caches' keys). So the traced call hands the tree's structure (as a
# skeleton of int leaves), each leaf's shape, dtype and device, and the Specs, all of which
# dynamo guards on, to a function dynamo runs as plain Python (assume_constant_result): the
# eager lookup, checks included, on stand-in tensors. It returns a key; the trace reads the
# plan under it.

# id(plan) -> plan, for the plans that traced code uses (kept alive: graphs refer to them).
_TRACED_PLANS: Bounded = Bounded(256)


def traced_grads_plan(grads: Any, leaves: list, spec: Any, *, name: str) -> Plan:
    """:func:`grads_plan` under torch.compile."""
    # A plan is per shape: operator.index specializes any dynamic dim (with a guard).
    metas = tuple((tuple(map(operator.index, x.shape)), x.dtype, x.device) for x in leaves)
    skeleton = optree.tree_map(lambda _: 0, grads)
    if isinstance(spec, Spec):
        return _TRACED_PLANS[_traced_plan_key(skeleton, metas, spec, name=name, spec_skeleton=None)]
    # Specs only pass one by one (dynamo cannot make a constant of a container of them).
    specs = optree.tree_leaves(spec, is_leaf=_is_spec)
    spec_skeleton = optree.tree_map(lambda _: 0, spec, is_leaf=_is_spec)
    key = _traced_plan_key(skeleton, metas, *specs, name=name, spec_skeleton=spec_skeleton)
    return _TRACED_PLANS[key]


@torch._dynamo.assume_constant_result
def _traced_plan_key(skeleton: Any, metas: tuple, *specs, name: str, spec_skeleton: Any) -> int:
    # Runs as plain Python at trace time (is_compiling() is still true, so this calls the
    # uncached helpers directly).
    treedef = optree.tree_structure(skeleton)
    if spec_skeleton is None:
        spec = specs[0]
    else:
        spec = optree.tree_unflatten(optree.tree_structure(spec_skeleton), specs)
    stand_ins = [torch.empty((), dtype=d, device=v).expand(s) for s, d, v in metas]
    paths = paths_of.__wrapped__(treedef, name)
    plan = grads_plan(stand_ins, treedef, paths, spec=spec, name=name)
    _TRACED_PLANS[id(plan)] = plan
    return id(plan)


# -- local shards ----------------------------------------------------------------------------


def check_local(
    leaves: Sequence[Any],
    paths: Sequence[str],
    plan: Plan,
    *,
    role: str,
    kinds: tuple[str, ...],
    what: str,
) -> None:
    """Validate local values against ``plan`` at ``role``: dtype, shape and state tag."""
    compiling = torch.compiler.is_compiling()  # then nothing is tagged
    shapes = plan.local_shapes[role]
    for i, (leaf, path) in enumerate(zip(leaves, paths)):
        found = None if compiling else state_of(leaf)
        if found is not None and _made_here(found, i, plan=plan, role=role, kinds=kinds):
            continue  # made by this very plan, role and position: dtype and shape are right
        if found is not None:  # else checked by value below, like an untagged tensor
            _check_tag(found, i, plan=plan, kinds=kinds, paths=paths, what=what)
        if leaf.dtype != plan.dtypes[i]:
            raise TypeError(
                f"{path}: expected dtype {plan.dtypes[i]} (as {what}); got {leaf.dtype}"
            )
        if tuple(leaf.shape) != shapes[i]:
            raise ValueError(
                f"{path}: expected local shape {shapes[i]} at the {role} placement "
                f"{list(map(str, plan.specs[i].placements(role)))}; got {tuple(leaf.shape)}"
            )


def _made_here(found: tuple, i: int, *, plan: Plan, role: str, kinds: tuple[str, ...]) -> bool:
    """Whether tag ``found`` says: leaf ``i`` of a ``plan`` result at ``role``, of ``kinds``."""
    state, index = found
    return state.plan is plan and state.role == role and index == i and state.kind in kinds


def _check_tag(
    found: tuple, i: int, *, plan: Plan, kinds: tuple[str, ...], paths: Sequence[str], what: str
) -> None:
    """Refuse tagged leaf ``i``: another leaf, one made for another spec, or of another kind."""
    # a leaf of another result (a whole tree's, given a unit of it) is the same leaf only if
    # made with the same spec and full shape
    state, index = found
    path, made = paths[i], state.plan
    if made is plan and index != i and made.shapes[index] != plan.shapes[i]:
        raise ValueError(
            f"{path}: holds this tree's leaf {paths[index]} (full shape "
            f"{made.shapes[index]}), not its own (full shape {plan.shapes[i]}); it "
            f"cannot be used as {what}"
        )
    same = made is plan and index == i  # its own leaf, at another role or of another kind
    if not same and (made.specs[index] != plan.specs[i] or made.shapes[index] != plan.shapes[i]):
        raise ValueError(
            f"{path}: was produced for another tree or spec ({made!r}: spec "
            f"{made.specs[index]!r}, full shape {made.shapes[index]}); it cannot be used "
            f"as {what}"
        )
    if state.kind not in kinds:
        raise ValueError(kind_error(path, state.kind, kinds))


def find_plan(
    leaves: list,
    treedef: optree.PyTreeSpec,
    paths: tuple[str, ...],
    *,
    spec: Any,
    like: Any,
    roles: Sequence[str],
    kinds: tuple[str, ...],
    name: str,
) -> tuple[Plan, str]:
    """The plan and role (one of ``roles``) that ``leaves`` (local shards) are laid out at;
    checks them (dtype, shape, state)."""
    specs, units = resolve_specs(spec, treedef, name)
    state = result_state(leaves)
    known = like is None and state is not None
    if known and _matches(state, treedef, specs=specs, units=units, roles=roles):
        if state.kind in kinds:  # exactly a result of this library at a known layout
            return state.plan, state.role
    check_tensors(leaves, paths, specs[0].mesh, floating=False, batched=True)
    found = [state_of(_unwrapped(x)) for x in leaves]
    for f, path in zip(found, paths):
        if f is not None and f[0].kind not in kinds:
            raise ValueError(kind_error(path, f[0].kind, kinds))
    states = {id(f[0].plan): f[0] for f in found if f is not None}
    if len(states) == 1 and None not in found:  # every leaf from results of one plan
        state = next(iter(states.values()))
        if _matches(state, treedef, specs=specs, units=units, roles=roles):
            check_local(
                leaves, paths, state.plan, role=state.role, kinds=kinds, what="local shards"
            )
            return state.plan, state.role
    search = dict(specs=specs, units=units, like=like, roles=roles, kinds=kinds, name=name)
    if like is not None or any(f is not None for f in found):
        # every leaf tagged (a unit of a tagged tree, say): the full shapes its tags name come
        # first, since local shapes alone may fit several layouts (a rank holding no piece
        # of a unit: every local shape is (0,))
        hint = None if None in found else tuple(f[0].plan.shapes[f[1]] for f in found)
        return _by_shapes(leaves, treedef, paths, hint=hint, **search)
    # untagged local shards (an optimizer's new tensors, say): found once per metadata
    key = (treedef, tuple(map(_META, leaves)), specs, units, tuple(roles), kinds, name)
    if key not in _FOUND:
        _FOUND[key] = _by_shapes(leaves, treedef, paths, **search)
    return _FOUND[key]


def find_plan_at(
    leaves: list,
    treedef: optree.PyTreeSpec,
    paths: tuple[str, ...],
    *,
    spec: Any,
    role: str,
    kinds: tuple[str, ...] = ("final", "weights"),
    name: str,
) -> Plan:
    """The plan that ``leaves`` (local shards at ``role``, of a state among ``kinds``: by
    default weights, as shard, gather or an optimizer's update leaves them) are laid out by:
    :func:`find_plan` with one role and no ``like``."""
    roles = (role,)
    plan, _ = find_plan(
        leaves, treedef, paths, spec=spec, like=None, roles=roles, kinds=kinds, name=name
    )
    return plan


def _unwrapped(x: Any) -> Any:
    """``x`` seen through any torch.func transform's wrappers (a unit's shards under
    ``grad``), whose tags are the wrapped tensor's."""
    functorch = torch._C._functorch
    while isinstance(x, torch.Tensor) and functorch.is_functorch_wrapped_tensor(x):
        x = functorch.get_unwrapped(x)
    return x


# (structure, leaf metadata, specs, units, roles, kinds, name) -> (plan, role) of untagged
# local shards that passed the checks
_FOUND: Bounded = Bounded(256)


def _matches(state: Any, treedef, *, specs, units, roles: Sequence[str]) -> bool:
    meta = state.plan.meta
    return (
        state.role in roles
        and meta.treedef == treedef
        and meta.specs == specs
        and meta.units == units
    )


def _by_shapes(
    leaves, treedef, paths, *, specs, units, like, roles, kinds, name, hint=None
) -> tuple[Plan, str]:
    """The first layout whose local shapes the leaves have: from ``like``'s full shapes, or
    from ``hint`` and then the full shapes of trees of this structure this process has
    seen."""
    nb = len(specs[0].mesh.batch_shape)
    if like is not None:
        like_leaves, like_def = optree.tree_flatten(like)
        if like_def != treedef:
            raise structure_error(treedef, like, "like", what=name)
        known = [tuple(tuple(x.shape) for x in like_leaves)]
    else:
        known = layouts_for(treedef, specs, units)
        known = [hint, *(k for k in known if k != hint)] if hint is not None else known
    first_error = None
    for role in roles:
        candidates = list(known)
        if like is None and not any(s.sharded_axes(role) for s in specs):
            candidates.append(tuple(tuple(x.shape[nb:]) for x in leaves))  # local == full
        for shapes in candidates:
            plan = plan_for(leaves, treedef, paths, specs=specs, units=units, shapes=shapes)
            try:
                check_local(leaves, paths, plan, role=role, kinds=kinds, what="local shards")
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

"""What a unit call is checked against, and how messages name it.

The unit's plan, its place in the sharded tree, its description for the cross-rank checks,
and the ``MainGrad`` buckets a unit with ``into=`` adds into.

State: a block's descriptions are cached on it (``Gathered.descriptions``, one entry per plan
and place), and go with the block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..base.tags import state_of
from ..base.tree import flatten
from ..plan.lookup import find_plan_at
from ..plan.recipe import Plan
from ..spec.specs import Spec
from ..sync.maingrad import units_of
from .call import Call

__all__ = [
    "adopts",
    "check_spec",
    "describe",
    "differentiable",
    "sink_buckets",
    "unit_plan",
    "where",
]


def unit_plan(block: Any, shards: Any, name: str) -> tuple[list, Any, tuple, Plan]:
    """``shards`` flattened (leaves, treedef, paths) and the plan they are laid out by, at the
    parameter placement; errors name them ``name``."""
    leaves, treedef, paths = flatten(shards, name)
    if not leaves:
        raise ValueError(f"gathered: {block.name}'s shards are an empty tree")
    plan = find_plan_at(leaves, treedef, paths, spec=block.spec, role="parameter", name=name)
    return leaves, treedef, paths, plan


def adopts(block: Any, other: Any) -> bool:
    """Whether ``block`` can use a call record ``other`` made ahead (its all-gather, its wait
    node and the MainGrad buckets it adds into are the same)."""
    return other is block or (
        other.spec == block.spec
        and other.into is block.into
        and other.param_dtype == block.param_dtype
    )


def sink_buckets(call: Call, pieces: Sequence[torch.Tensor]) -> list[int]:
    """The buckets of ``call.block.into`` that hold this unit, found from the shards' tags."""
    mg, name = call.block.into, call.block.name
    found = state_of(pieces[0])
    made = found[0].plan.meta if found is not None else None
    mine = mg.plan.meta
    if made is None or (made.treedef, made.shapes, made.specs) != (
        mine.treedef,
        mine.shapes,
        mine.specs,
    ):
        raise ValueError(
            f"gathered({name}, into={mg!r}): these shards are not known as a unit of the tree "
            "the MainGrad was made for; pass the tensors fh.shard(full, spec_tree) made "
            "(updated in place by the optimizer), or leave into=None"
        )
    _check_one_unit(call, pieces, found)
    buckets = units_of(mg).buckets_of(made.units[found[1]])
    ours = [(b.padded, b.numel) for b in call.plan.buckets]
    if [(mg.plan.buckets[b].padded, mg.plan.buckets[b].numel) for b in buckets] != ours:
        raise ValueError(
            f"gathered({name}, into={mg!r}): the shards' unit is bucketed unlike the "
            "MainGrad's (another bucket_cap_mb or dtype split?)"
        )
    return buckets


def _check_one_unit(call: Call, pieces: Sequence[torch.Tensor], found: tuple) -> None:
    """Every shard is the leaf of one unit of the MainGrad's tree, in that unit's order: a
    unit given leaves of several units would add its gradient into another unit's buffer."""
    plan, first = found[0].plan, found[1]
    unit = plan.meta.units[first]
    want = [i for i, u in enumerate(plan.meta.units) if u == unit]
    got = []
    for p in pieces:
        tag = state_of(p)
        same = tag is not None and tag[0].plan.meta == plan.meta
        got.append(tag[1] if same else None)
    if got == want:
        return
    name = lambda i: plan.slot_of[i].path if i is not None else "a tensor of no unit"  # noqa: E731
    raise ValueError(
        f"gathered({call.block.name}, into={call.block.into!r}): its shards must be the "
        f"leaves of one unit of the MainGrad's tree, in order: got {[name(i) for i in got]}, "
        f"but the unit of {name(first)} is {[name(i) for i in want]} (its gradient would be "
        "added into another unit's buffer)"
    )


def where(pieces: Sequence[torch.Tensor], named: str) -> str:
    """Where a unit's shards are: the path of its first leaf in the tree ``fh.shard`` made
    (which tells apart the layers one block runs), else ``named`` (as the caller named it)."""
    found = state_of(pieces[0])
    if found is not None and found[1] < len(getattr(found[0].plan, "slot_of", ())):
        return f"{found[0].plan.slot_of[found[1]].path}"
    return named


def describe(block: Any, call: Call) -> tuple[str, str]:
    """The unit a call runs and the options its collectives and gradient depend on, as texts
    for the cross-rank checks (made once per block, layout and place)."""
    key = (call.plan, call.where)
    found = block.descriptions.get(key)
    if found is None:
        plan = call.plan
        options = (
            f"recompute={block.recompute}",
            f"reshard_after_forward={block.reshard_after_forward}",
            f"param_dtype={block.param_dtype}",
            f"reduce_dtype={block.reduce_dtype}",
            f"output_dtype={block.output_dtype}",
            f"shard_dtype={','.join(sorted({str(d) for d in plan.dtypes}))}",
            f"into={'a MainGrad' if block.into is not None else None}",
            f"buckets={[b.padded for b in plan.buckets]}",
        )
        found = block.descriptions[key] = (f"{block.name} on {call.where}", "; ".join(options))
    return found


def check_spec(spec: Any, name: str) -> None:
    if not isinstance(spec, Spec):
        raise TypeError(
            f"gathered({name}, spec): spec must be one Spec (the unit's); got {type(spec).__name__}"
        )
    if spec.sharded_axes("parameter") != spec.sharded_axes("gradient"):
        raise NotImplementedError(
            f"gathered({name}, spec): a parameter placement {list(map(str, spec.parameter))} "
            f"sharded over other axes than the gradient placement "
            f"{list(map(str, spec.gradient))}: the gradient of a shard must have its shape"
        )


def differentiable(x: Any) -> bool:
    """A floating argument that is tracked (by autograd or the transform being run): its
    gradient may be asked for. Constants (rotary tables, masks) are not differentiated."""
    return (
        isinstance(x, torch.Tensor)
        and (x.is_floating_point() or x.is_complex())
        and x.requires_grad
    )

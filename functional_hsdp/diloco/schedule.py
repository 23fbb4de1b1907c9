"""The fragment schedule: which leaves form each fragment, and after which steps each syncs.

Invariant: it reads the options and the params' full shapes only, never a rank's values, so
every rank computes the same labels and the same schedule. Fragment p of F syncs after inner
step t when t >= s_p and (t - s_p) % every == 0, s_p = floor((p + 1) * every / F): written
once, in :func:`syncs_after` (:func:`sync_steps` lists it, the outer step issues by it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import optree
import torch

from ..base.tags import result_state
from ..base.tree import flatten, structure_error
from ..plan.lookup import find_plan_at

__all__ = ["balanced_fragments", "sync_steps"]


def sync_steps(every: int, fragments: int, steps: int) -> list[list[int]]:
    """The schedule: for each inner step t = 1..``steps``, the fragments that sync after it.

    Args:
        every: steps between two syncs of one fragment (H).
        fragments: the number of fragments (F).
        steps: how many steps to list.

    Returns:
        A list of ``steps`` lists of fragment indices.

    Example:
        >>> import functional_hsdp as fh
        >>> fh.sync_steps(every=4, fragments=2, steps=8)
        [[], [0], [], [1], [], [0], [], [1]]
    """
    check_int("every", every, 1)
    check_int("fragments", fragments, 1)
    return [syncs_after(t, every=every, fragments=fragments) for t in range(1, steps + 1)]


def syncs_after(step: int, *, every: int, fragments: int) -> list[int]:
    """The fragments whose sync is issued after inner step ``step`` (counted from 1), in
    order: the schedule's one formula (:func:`sync_steps` lists it)."""
    starts = [(p + 1) * every // fragments for p in range(fragments)]
    return [p for p, s in enumerate(starts) if step >= s and (step - s) % every == 0]


def balanced_fragments(params: Any, fragments: int, *, spec: Any = None) -> Any:
    """A ``fragments=`` tree for :func:`diloco` whose fragments hold nearly equal bytes.

    ``fragments=F`` as an int cuts the leaves, in tree order, into F *contiguous* groups;
    a model whose largest leaves sit side by side (an embedding and an untied head) then
    has a fragment far above 1/F of the bytes, and Streaming DiLoCo's peak outer transfer
    with it. This groups the leaves by size instead (largest first, each into the fragment
    with the fewest bytes so far), so that no fragment holds more than 1/F of the bytes by
    more than its smallest leaf. Labels are numbered in tree order of each fragment's
    first leaf. The result depends on the full shapes only, so it is the same on every
    rank.

    Args:
        params: the params' tree: local shards as :func:`~functional_hsdp.shard` or
            :func:`~functional_hsdp.shard_module` return them (their full shapes are read
            from the placement they carry), local shards at ``spec``'s optimizer placement
            (pass ``spec``), or tensors of the full shapes (meta tensors are fine).
        fragments: F, an int from 1 to the number of leaves.
        spec: the spec ``params`` are sharded with (``dl.inner``, or
            ``fh.replicas(spec, axis)``), for local shards that carry no placement.

    Returns:
        A tree of ints in [0, F), each used, with the params' structure.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> params = {"embed": torch.zeros(64, 8), "head": torch.zeros(8, 64),
        ...           "l0": torch.zeros(16, 16), "l1": torch.zeros(16, 16)}
        >>> fh.balanced_fragments(params, 2)     # 1024 bytes each way
        {'embed': 0, 'head': 1, 'l0': 0, 'l1': 1}
        >>> fh.diloco(fh.hsdp(fh.SimMesh({"dp_outer": 2, "dp_inner": 2}),
        ...                   "dp_outer", "dp_inner"), axis="dp_outer", every=4,
        ...           outer=fh.sgd(0.7, momentum=0.9, nesterov=True),
        ...           fragments=fh.balanced_fragments(params, 2), delay=1).fragments
        {'embed': 0, 'head': 1, 'l0': 0, 'l1': 1}
    """
    if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1:
        raise ValueError(f"balanced_fragments: fragments must be an int >= 1; got {fragments!r}")
    leaves, treedef, paths = flatten(params, "params")
    if fragments > len(leaves):
        raise ValueError(
            f"balanced_fragments: fragments={fragments} is more than the params' "
            f"{len(leaves)} leaves; each fragment needs at least one leaf"
        )
    sizes = full_bytes(leaves, treedef, paths, spec=spec)
    load, label = [0] * fragments, [0] * len(leaves)
    for i in sorted(range(len(leaves)), key=lambda i: (-sizes[i], i)):
        p = min(range(fragments), key=lambda q: (load[q], q))
        load[p] += sizes[i]
        label[i] = p
    order = {p: k for k, p in enumerate(dict.fromkeys(label))}  # first leaf in tree order
    return optree.tree_unflatten(treedef, [order[p] for p in label])


def full_bytes(leaves: list, treedef: Any, paths: Sequence[str], *, spec: Any) -> list[int]:
    """Each leaf's full bytes: from the params' plan (:func:`params_plan`), else from their
    own shapes (full tensors)."""
    found = params_plan(leaves, treedef, paths, spec=spec)
    if found is None:
        return [_bytes(x.shape, x.dtype) for x in leaves]
    return plan_bytes(found[0])


def plan_bytes(plan: Any) -> list[int]:
    """Each leaf's full bytes, from ``plan``'s shapes and dtypes."""
    return [_bytes(s, d) for s, d in zip(plan.shapes, plan.dtypes)]


def params_plan(
    leaves: list, treedef: Any, paths: Sequence[str], *, spec: Any
) -> tuple[Any, str] | None:
    """The params' plan and role: the placement the leaves carry (a unit tree's, ...), else
    ``spec``'s layout of them at its optimizer placement; None without either."""
    made = result_state(leaves)
    if made is not None and made.role in ("optimizer", "parameter"):
        return made.plan, made.role
    if spec is None:
        return None
    plan = find_plan_at(leaves, treedef, paths, spec=spec, role="optimizer", name="params")
    return plan, "optimizer"


def check_int(name: str, value: Any, low: int) -> None:
    """``value``, diloco's option ``name``, is an int >= ``low`` (a bool is not), or raise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"diloco: {name} must be an int >= {low}; got {value!r}")


def leaf_fragments(
    fragments: Any, params: Any, *, treedef: Any, paths: Sequence[str], sizes: list[int]
) -> tuple[list[int], int]:
    """Each leaf's fragment, and F."""
    n_leaves = len(sizes)
    if isinstance(fragments, int) and not isinstance(fragments, bool):
        if fragments > n_leaves:
            raise ValueError(
                f"diloco: fragments={fragments} is more than the params' {n_leaves} leaves; "
                "each fragment needs at least one leaf"
            )
        return _contiguous(sizes, fragments), fragments
    try:
        labels = optree.tree_leaves(optree.tree_broadcast_prefix(fragments, params))
    except ValueError as e:
        raise ValueError(
            f"diloco: fragments is not a pytree prefix of the params' tree: "
            f"{structure_error(treedef, fragments, 'fragments', what='params')}"
        ) from e
    bad = [
        (path, x)
        for path, x in zip(paths, labels)
        if isinstance(x, bool) or not isinstance(x, int) or x < 0
    ]
    if bad:
        path, x = bad[0]
        raise ValueError(
            f"diloco: fragments{path[len('params') :]}: label {x!r} is not an int >= 0"
        )
    n = len(set(labels))
    for path, x in zip(paths, labels):
        if x >= n:
            raise ValueError(
                f"diloco: fragments{path[len('params') :]}: label {x} is out of range [0, {n}): "
                f"the labels must be 0 .. F-1, each used (got {sorted(set(labels))})"
            )
    return list(labels), n


def _contiguous(sizes: list[int], n: int) -> list[int]:
    """Contiguous groups of about equal bytes: group k starts at the first leaf whose middle
    byte lies past k/n of the total, kept to at least one leaf per group."""
    total, count = sum(sizes) or 1, len(sizes)
    middles, before = [], 0
    for s in sizes:
        middles.append(2 * before + s)
        before += s
    starts = [0]
    for k in range(1, n):
        at = next((i for i, m in enumerate(middles) if m * n >= 2 * k * total), count)
        starts.append(min(max(at, starts[-1] + 1), count - (n - k)))
    return [sum(1 for b in starts[1:] if b <= i) for i in range(count)]


def _bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize

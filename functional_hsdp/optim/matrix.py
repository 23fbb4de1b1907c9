"""Matrix optimizers on sharded trees: ``per_matrix``, ``muon`` and ``partition``.

Elementwise optimizers (SGD, AdamW, anything written with ``tree_map``) run on any local
shards; a matrix optimizer (Muon's Newton-Schulz iteration, Shampoo's preconditioners) needs
whole matrices, which a Flat shard splits across ranks. :func:`per_matrix` runs a function
on whole leaves at the owner placement (:mod:`functional_hsdp.plan.owner`), exactly once per leaf
over the whole data-parallel mesh, and hands the results back at the optimizer placement:

* on an Owner spec (:func:`~functional_hsdp.owned`), where the leaves already are: no
  communication;
* on any other spec, one all-to-all per bucket per Flat or ``Shard(d)`` axis (and per
  Replicate axis a local selection) to the owners, and back the reverse all-to-alls and one
  all-gather per Replicate axis (a ``Shard(d)`` leaf's chunks are joined along d at its
  owner, and its result split back).

:func:`muon` is ``torch.optim.Muon``'s math as a :class:`GradientTransformation` built on it;
:func:`partition` (optax's ``multi_transform``) gives each leaf its own transformation (Muon
for hidden matrices, AdamW for the rest).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import einops
import numpy as np
import optree
import torch

from ..base.tree import Masked, format_path, is_masked, masked, refuse_tracked, refuse_vmap, unmask
from ..io.checkpoint import empty_member, load_members, save_member
from ..plan.buckets import shard_dims, unpack_full
from ..plan.lookup import find_plan_at
from ..plan.owner import BucketRoute, chunk_rows, local_items, owner_of_slot, route
from ..plan.recipe import Plan
from ..runtime.agreement import agreement
from ..runtime.scheduler import run
from .schedules import Schedule, check_lr
from .transforms import (
    ChainState,
    EmptyState,
    GradientTransformation,
    ScaleByLearningRateState,
    add_decayed_weights,
    chain,
    scale_by_learning_rate,
)

__all__ = [
    "MuonState",
    "PartitionState",
    "muon",
    "newton_schulz",
    "partition",
    "per_matrix",
]


# -- per_matrix ---------------------------------------------------------------------------------


def per_matrix(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any, spec: Any) -> Any:
    """``fn`` of every whole leaf, with the result at the optimizer placement again.

    Each leaf is moved to its owner (one rank of the data-parallel mesh; see
    :mod:`functional_hsdp.plan.owner`): on an Owner spec (:func:`~functional_hsdp.owned`) it is
    there already; on another spec one all-to-all per bucket per Flat or ``Shard(d)`` axis
    takes it there (and back; a ``Shard(d)`` leaf's ``torch.chunk`` pieces are joined
    along d at its owner). ``fn`` runs exactly once per leaf over the whole mesh, outer
    replicas included. Leaves of equal shape and dtype are stacked: ``fn`` is given
    ``(k, *shape)`` for k leaves and must return that shape (a stack of 3-D leaves such as
    MoE experts' ``[E, M, N]`` is ``(k, E, M, N)``: act on the last two dims). Its result is
    cast to the leaf's dtype.

    Args:
        fn: a function of a batch of matrices ``(..., M, N)`` returning the same shape.
        tree: local shards at ``spec``'s optimizer placement (a final ``reduce_grads``
            result, ``shard``-ed weights, elementwise functions of those); leaves may be
            :class:`Masked` (left as they are).
        spec: the :class:`~functional_hsdp.Spec` or spec tree the shards were made with.

    Returns:
        A new tree like ``tree``: local shards of ``fn(whole leaf)``.

    Raises:
        ValueError: a leaf with fewer than 2 dims (naming its path), or shards of another
            layout.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
        >>> spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
        >>> w = fh.shard({"a": torch.eye(3), "b": torch.ones(2, 5)}, spec)
        >>> calls = []
        >>> out = fh.per_matrix(lambda x: calls.append(x.shape) or 2 * x, w, spec)
        >>> fh.gather(out, spec)["a"][1, 1], sorted(calls)
        (tensor([[2., 0., 0.],
                [0., 2., 0.],
                [0., 0., 2.]]), [torch.Size([1, 2, 5]), torch.Size([1, 3, 3])])
    """
    if not callable(fn):
        raise TypeError(f"per_matrix: fn must be callable; got {type(fn).__name__}")
    leaves, present, treedef, paths = unmask(tree, "tree")
    refuse_vmap([x for x, p in zip(leaves, present) if p], "per_matrix")
    with agreement(spec, "per_matrix") as agreed:
        if not any(present):
            return tree
        refuse_tracked(leaves, paths, "per_matrix")
        plan = find_plan_at(leaves, treedef, paths, spec=spec, role="optimizer", name="tree")
        _check_matrices(plan, present, paths)
        agreed.check(plan, paths, options=("per_matrix", str(tuple(present))), defer=True)
    out = list(leaves)
    in_owner = tuple(p and plan.specs[i].owner_axes != () for i, p in enumerate(present))
    elsewhere = tuple(p and not o for p, o in zip(present, in_owner))
    if any(elsewhere):
        routes = route(plan, elsewhere)
        _routed(
            fn, plan=plan, leaves=leaves, paths=paths, routes=routes, out=out, gate=agreed.settle
        )
    agreed.settle()
    if any(in_owner):
        _in_place(fn, plan=plan, leaves=leaves, paths=paths, which=in_owner, out=out)
    leaves_in = optree.tree_flatten(tree, is_leaf=is_masked)[0]
    out = [x if p else m for x, p, m in zip(out, present, leaves_in)]
    return optree.tree_unflatten(treedef, out)


def _check_matrices(plan: Plan, present: list[bool], paths: tuple[str, ...]) -> None:
    for i, p in enumerate(present):
        if not p:
            continue
        if len(plan.shapes[i]) < 2:
            raise ValueError(
                f"{paths[i]}: per_matrix needs matrices (2 or more dims); this leaf has shape "
                f"{tuple(plan.shapes[i])} (leave it to another transformation: fh.partition)"
            )


def _apply(fn: Callable, items: list[tuple[torch.Tensor, torch.Tensor, str]]) -> None:
    """``dst = fn(src)`` for every ``(src, dst, path)``, one ``fn`` call per shape and
    dtype (the sources stacked)."""
    groups: dict[tuple, list] = {}
    for item in items:
        groups.setdefault((tuple(item[0].shape), item[0].dtype), []).append(item)
    for (shape, _), group in groups.items():
        batch = torch.stack([src for src, _, _ in group])
        result = fn(batch)
        if not isinstance(result, torch.Tensor) or tuple(result.shape) != tuple(batch.shape):
            got = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result)
            raise ValueError(
                f"{group[0][2]}: per_matrix's fn must return the shape it was given "
                f"{tuple(batch.shape)} (a stack of {len(group)} leaves of shape {shape}); "
                f"got {got}"
            )
        for (_, dst, _), r in zip(group, result):
            dst.copy_(r)


def _in_place(fn, *, plan: Plan, leaves: list, paths, which: tuple, out: list) -> None:
    """Leaves of Owner specs: each is whole on its owner already."""
    mesh, items = plan.mesh, []
    names = mesh.axis_names
    for bucket in plan.buckets:
        for s in bucket.slots:
            if not which[s.index]:
                continue
            owner = owner_of_slot(bucket, s)
            per_rank = {
                r: all(r[names.index(a)] == c for a, c in owner.items()) for r in _ranks(mesh)
            }
            x = leaves[s.index]
            new = out[s.index] = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
            shape = tuple(plan.shapes[s.index])
            for idx, mine in local_items(mesh, per_rank):
                if mine:
                    items.append((x[idx].reshape(shape), new[idx].view(shape), paths[s.index]))
    _apply(fn, items)


def _ranks(mesh: Any) -> list[tuple]:
    return list(np.ndindex(*mesh.sizes))


def _routed(fn, *, plan: Plan, leaves: list, paths, routes: list, out: list, gate) -> None:
    """Leaves of other specs: to their owners and back, bucket by bucket (fn runs on a
    bucket as soon as it arrived, while later buckets are in flight)."""
    chosen = [b for b, r in enumerate(routes) if r is not None]
    programs = []
    for b in chosen:
        at_owner = functools.partial(_at_owner, fn=fn, plan=plan, b=b, r=routes[b], paths=paths)
        programs.append([*routes[b].there, at_owner, *routes[b].back])

    def source(k: int) -> torch.Tensor:
        compact = routes[chosen[k]].compact
        if compact is not None:  # a Shard(d) bucket: the ranks' chunks, data only
            return compact.pack(leaves)
        return plan.pack(chosen[k], leaves, "optimizer")

    results = run(plan.mesh, programs, source, gate=gate)
    for b, result in zip(chosen, results):
        slots = plan.buckets[b].slots
        for j, piece in _unpacked(plan, b, plan.mesh.wait(result), r=routes[b]).items():
            out[slots[j].index] = piece


def _unpacked(plan: Plan, b: int, buf: torch.Tensor, *, r: BucketRoute) -> dict[int, torch.Tensor]:
    """The routed leaves' local shards (by slot position) in bucket b's buffer come back."""
    bucket, placed, batch = plan.buckets[b], plan.placed[b]["optimizer"], plan.mesh.batch_shape
    if r.compact is not None:
        return {j: r.compact.unpack(buf, j, placed.shapes[j]) for j in sorted(r.routed)}
    if getattr(placed.geometry, "kept", False):  # a keep spec: its kept pieces
        pieces = placed.geometry.unpack(buf)
    elif not placed.axes:
        pieces = unpack_full(bucket, buf, batch)
    else:
        pieces = plan.mesh.geometry.split(buf, placed.geometry)
        pieces = bucket.leaves_of(pieces) if placed.zeros else pieces
    return {j: piece for j, piece in enumerate(pieces) if j in r.routed}


def _at_owner(_k: int, buf: torch.Tensor, *, fn, plan: Plan, b: int, r: BucketRoute, paths):
    bucket, items = plan.buckets[b], []
    for idx, mine in local_items(plan.mesh, r.leaves):
        row = buf[idx]
        for j, offset in mine:
            s = bucket.slots[j]
            flat = row.narrow(-1, offset, s.numel)
            if s.dim is None or math.prod(s.shape[: s.dim]) == 1:  # chunk order is the leaf's
                view = flat.view(tuple(plan.shapes[s.index]))
                items.append((view, view, paths[s.index]))
            else:
                chunks = _Chunks(flat, s, bucket.ranks)
                items.append((chunks.whole(), chunks, paths[s.index]))
    _apply(fn, items)
    return buf


class _Chunks:
    """A Shard(d) leaf in chunk order (its nonempty chunks' data end to end, each
    row-major) in a flat view: :meth:`whole` joins the chunks along d into the leaf (a new
    tensor), :meth:`copy_` writes a whole leaf back into the view in chunk order."""

    def __init__(self, flat: torch.Tensor, slot: Any, n: int):
        self.pre, self.post, self.sizes = shard_dims(slot)
        self.rows = [k for k in (chunk_rows(slot, c) for c in range(n)) if k]
        row = slot.numel // slot.shape[slot.dim]
        self.views = [
            einops.rearrange(
                p, f"({self.pre} c {self.post}) -> ({self.pre}) c ({self.post})", **self.sizes
            )
            for p in flat.split([k * row for k in self.rows])
        ]

    def whole(self) -> torch.Tensor:
        joined = torch.cat(self.views, dim=1)
        return einops.rearrange(
            joined, f"({self.pre}) c ({self.post}) -> {self.pre} c {self.post}", **self.sizes
        )

    def copy_(self, x: torch.Tensor) -> None:
        rows = einops.rearrange(x, f"{self.pre} c {self.post} -> ({self.pre}) c ({self.post})")
        for view, part in zip(self.views, rows.split(self.rows, dim=1)):
            view.copy_(part)


# -- Newton-Schulz and Muon ---------------------------------------------------------------------


def newton_schulz(
    x: torch.Tensor,
    *,
    coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration on a batch of matrices ``(..., M, N)``.

    ``torch.optim.Muon``'s orthogonalization, batched: in ``dtype``, each matrix transposed
    if it has more rows than columns, divided by its Frobenius norm (at least ``eps``), then
    ``steps`` times ``X <- a X + (b A + c A²) X`` with ``A = X Xᵀ``.

    Args:
        x: matrices, ``(..., M, N)``.
        coefficients: ``(a, b, c)``.
        steps: iterations.
        eps: the smallest norm divided by.
        dtype: the dtype of the iteration (bf16 as torch's; float32 for fp32 accuracy).

    Returns:
        The orthogonalized matrices, shape of ``x``, in ``dtype``.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> q = fh.newton_schulz(torch.randn(2, 8, 4), dtype=torch.float32)
        >>> s = torch.linalg.svdvals(q)
        >>> bool(((s > 0.6) & (s < 1.3)).all())
        True
    """
    a, b, c = coefficients
    y = x.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        y = y.mT
    y = y / y.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    shape = y.shape
    y = y.reshape(-1, *shape[-2:])
    for _ in range(steps):
        gram = torch.bmm(y, y.mT)
        update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        y = torch.baddbmm(y, update, y, beta=a)
    y = y.reshape(shape)
    return y.mT if tall else y


class MuonState(NamedTuple):
    """State of :func:`muon`.

    Attributes:
        count: number of updates so far (a host int, the same on every rank).
        momentum: tree like the params (local shards at the optimizer placement): torch's
            ``momentum_buffer``.
    """

    count: int
    momentum: Any


_ADJUST = (None, "original", "match_rms_adamw")


def _lr_ratio(adjust_lr_fn: str | None, m: int, n: int) -> float:
    """``torch.optim.Muon``'s learning-rate adjustment for an ``m x n`` matrix."""
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(m, n))
    return math.sqrt(max(1, m / n))


def _orthogonalized(x: torch.Tensor, *, ns: dict, adjust_lr_fn: str | None) -> torch.Tensor:
    ratio = _lr_ratio(adjust_lr_fn, x.shape[-2], x.shape[-1])
    return newton_schulz(x, **ns).to(x.dtype) * ratio


def _check_muon(*, lr, weight_decay, momentum, ns_coefficients, eps, ns_steps, adjust_lr_fn):
    check_lr(lr, "muon: lr")
    for name, value in (
        ("weight_decay", weight_decay),
        ("momentum", momentum),
        ("eps", eps),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"muon: {name} must be a number >= 0; got {value!r}")
    if len(tuple(ns_coefficients)) != 3:
        raise ValueError(f"muon: ns_coefficients must be 3 numbers; got {ns_coefficients!r}")
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or not 0 <= ns_steps < 100:
        raise ValueError(f"muon: ns_steps must be an int in [0, 100); got {ns_steps!r}")
    if adjust_lr_fn not in _ADJUST:
        raise ValueError(f"muon: adjust_lr_fn must be one of {_ADJUST}; got {adjust_lr_fn!r}")


def muon(
    spec: Any,
    lr: float | Schedule = 1e-3,
    *,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
    eps: float = 1e-7,
    ns_steps: int = 5,
    adjust_lr_fn: str | None = None,
    ns_dtype: torch.dtype = torch.bfloat16,
) -> GradientTransformation:
    """Muon with ``torch.optim.Muon``'s math, on local shards, each matrix orthogonalized
    once over the whole mesh (:func:`per_matrix`).

    With ``B`` the momentum buffer: ``B <- lerp(B, g, 1 - momentum)``; the direction is
    ``lerp(g, B, momentum)`` with ``nesterov``, else ``B``; ``O`` its Newton-Schulz
    orthogonalization (:func:`newton_schulz` in ``ns_dtype``); the update is
    ``-lr * weight_decay * p - lr * ratio * O``, ``ratio`` torch's ``adjust_lr_fn`` of the
    matrix's last two dims ``(M, N)``: ``sqrt(max(1, M / N))`` (None, ``"original"``) or
    ``0.2 * sqrt(max(M, N))`` (``"match_rms_adamw"``). The momentum lives at the optimizer
    placement (a tree like the params; checkpointed as AdamW's moments are).

    It is a chain (:func:`~functional_hsdp.chain`): the orthogonalized momentum ``ratio * O``,
    then :func:`~functional_hsdp.add_decayed_weights` and
    :func:`~functional_hsdp.scale_by_learning_rate`, its state kept as one :class:`MuonState`.

    Args:
        spec: the Spec (or spec tree) of the params; :func:`~functional_hsdp.owned` specs
            orthogonalize where the leaves are, others move them (see :func:`per_matrix`).
        lr: learning rate: a number, or a schedule ``step -> lr``
            (:mod:`~functional_hsdp.optim.schedules`; step counted from 0).
        weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn:
            as ``torch.optim.Muon``.
        ns_dtype: the dtype of the Newton-Schulz iteration (torch's is bf16; float32 gives
            fp32 accuracy).

    Returns:
        A :class:`~functional_hsdp.GradientTransformation`; its state is a
        :class:`MuonState`. Every leaf must have 2 or more dims (use :func:`partition` for
        the others); a 3-D leaf is a stack of matrices.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
        >>> spec = fh.owned(fh.hsdp(mesh, "dp_outer", "dp_inner"))
        >>> params = fh.shard({"w": torch.eye(4)}, spec)
        >>> opt = fh.muon(spec, lr=0.1, ns_dtype=torch.float32)
        >>> g = fh.reduce_grads({"w": torch.randn(2, 2, 4, 4)}, spec, last=True)
        >>> updates, state = opt.update(g, opt.init(params), params)
        >>> new = fh.apply_updates(params, updates)
        >>> fh.gather(new, spec)["w"].shape, isinstance(state, fh.MuonState), state.count
        (torch.Size([2, 2, 4, 4]), True, 1)
    """
    _check_muon(
        lr=lr,
        weight_decay=weight_decay,
        momentum=momentum,
        ns_coefficients=ns_coefficients,
        eps=eps,
        ns_steps=ns_steps,
        adjust_lr_fn=adjust_lr_fn,
    )
    ns = dict(coefficients=tuple(ns_coefficients), steps=ns_steps, eps=eps, dtype=ns_dtype)
    orthogonalize = functools.partial(_orthogonalized, ns=ns, adjust_lr_fn=adjust_lr_fn)
    parts = chain(
        _scale_by_muon(spec, momentum=momentum, nesterov=nesterov, orthogonalize=orthogonalize),
        add_decayed_weights(weight_decay),
        scale_by_learning_rate(lr),
    )

    def init(params: Any) -> MuonState:
        return parts.init(params).inner[0]

    def update(grads: Any, state: MuonState, params: Any) -> tuple[Any, MuonState]:
        if not isinstance(state, MuonState):
            raise TypeError(f"state: expected a MuonState (from init); got {type(state).__name__}")
        inner = (state, EmptyState(), ScaleByLearningRateState(state.count))
        updates, new = parts.update(grads, ChainState(inner), params)
        return updates, new.inner[0]

    return GradientTransformation(init, update)


def _scale_by_muon(
    spec: Any, *, momentum: float, nesterov: bool, orthogonalize: Callable
) -> GradientTransformation:
    """Muon's direction before the learning rate: ``ratio * O`` (see :func:`muon`)."""

    def init(params: Any) -> MuonState:
        return MuonState(0, optree.tree_map(torch.zeros_like, params))

    def update(grads: Any, state: MuonState, params: Any) -> tuple[Any, MuonState]:
        _same_layout(grads, params, "grads")
        _same_layout(state.momentum, params, "state.momentum")
        g = optree.tree_map(lambda g, p: g.to(p.dtype), grads, params)
        buf = optree.tree_map(lambda b, g: b.lerp(g, 1 - momentum), state.momentum, g)
        direction = optree.tree_map(lambda g, b: g.lerp(b, momentum), g, buf) if nesterov else buf
        return per_matrix(orthogonalize, direction, spec), MuonState(state.count + 1, buf)

    return GradientTransformation(init, update)


def _same_layout(tree: Any, params: Any, name: str) -> None:
    """``tree`` has the structure and local shapes of ``params`` (errors name the path)."""
    if optree.tree_structure(tree) != optree.tree_structure(params):
        raise ValueError(
            f"{name}: has structure {optree.tree_structure(tree)}, but params has "
            f"{optree.tree_structure(params)}"
        )
    for path, x, p in zip(
        optree.tree_paths(tree), optree.tree_leaves(tree), optree.tree_leaves(params)
    ):
        if x.shape != p.shape:
            raise ValueError(
                f"{name}{format_path(path)}: expected local shape {tuple(p.shape)} (as the "
                f"params'); got {tuple(x.shape)}: local shards at the params' placement?"
            )


# -- partition ----------------------------------------------------------------------------------


class PartitionState(NamedTuple):
    """State of :func:`partition`.

    Attributes:
        inner: ``{label: that transformation's state}`` (its trees hold :class:`Masked`
            leaves where other labels' leaves are).
    """

    inner: dict

    # checkpoints (functional_hsdp.io.checkpoint's protocol): each label's state under its label

    def __fh_state_dict__(self, spec: Any, *, like: Any = None) -> dict[str, Any]:
        """``{label: ...}``: each label's state as ``fh.state_dict`` saves it (its trees'
        Masked leaves are another label's, saved there)."""
        likes = like.inner if isinstance(like, PartitionState) else {}
        return {k: save_member(x, spec, like=likes.get(k)) for k, x in self.inner.items()}

    def __fh_empty_state_dict__(self, spec: Any) -> dict[str, Any]:
        """Placeholders for ``dcp.load``, one entry per label."""
        return {k: empty_member(x, spec) for k, x in self.inner.items()}

    def __fh_load_state_dict__(self, state: dict, spec: Any, *, name: str) -> PartitionState:
        """Each label's state loaded (this state the like)."""
        inner = dict(self.inner)
        return PartitionState(load_members(state, spec, inner, name=name, owner="PartitionState"))


def partition(transforms: dict[str, GradientTransformation], labels: Any) -> GradientTransformation:
    """A transformation per leaf, by label (optax's ``multi_transform``).

    Each transformation sees the params, gradients and its state with the other labels'
    leaves :class:`Masked` (empty subtrees: ``tree_map`` passes them by), and its updates
    fill its own leaves of the result.

    Args:
        transforms: ``{label: GradientTransformation}``.
        labels: a tree of labels with the params' structure (or a pytree prefix of it), or a
            callable ``(path, leaf) -> label``, ``path`` the tuple of keys to the leaf
            (``("layers", 0, "w")``) and ``leaf`` the params' leaf (a local shard: on a Flat
            placement 1-D, so decide by path, or by full shapes you hold).

    Returns:
        A :class:`~functional_hsdp.GradientTransformation`; its state is a
        :class:`PartitionState`.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp": 2})
        >>> spec = fh.ddp(mesh)
        >>> params = fh.shard({"w": torch.eye(3), "b": torch.zeros(3)}, spec)
        >>> opt = fh.partition({"muon": fh.muon(spec, lr=0.1), "adamw": fh.adamw(lr=0.1)},
        ...                    lambda path, leaf: "muon" if path[0] == "w" else "adamw")
        >>> g = fh.reduce_grads({"w": torch.ones(2, 3, 3), "b": torch.ones(2, 3)}, spec,
        ...                     last=True)
        >>> updates, state = opt.update(g, opt.init(params), params)
        >>> isinstance(state, fh.PartitionState), sorted(state.inner), updates["b"][0]
        (True, ['adamw', 'muon'], tensor([-0.1000, -0.1000, -0.1000]))
    """
    if not isinstance(transforms, dict) or not transforms:
        raise TypeError("partition: transforms must be a non-empty dict {label: transformation}")
    for label, tx in transforms.items():
        if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
            raise TypeError(f"partition: transforms[{label!r}] is not a GradientTransformation")

    def init(params: Any) -> PartitionState:
        of = _labels(labels, params, transforms)
        marks = [masked(x) for x in optree.tree_leaves(params)]
        inner = {k: tx.init(_mask(params, of, keep=k, marks=marks)) for k, tx in transforms.items()}
        return PartitionState(inner)

    def update(grads: Any, state: PartitionState, params: Any) -> tuple[Any, PartitionState]:
        if not isinstance(state, PartitionState) or set(state.inner) != set(transforms):
            raise TypeError("state: expected the PartitionState this partition's init made")
        of = _labels(labels, params, transforms)
        leaves, treedef = optree.tree_flatten(params)
        marks = [masked(x) for x in leaves]  # the params' metadata: one tree structure for all
        out, inner = list(leaves), {}
        for k, tx in transforms.items():
            masked_grads, masked_params = (
                _mask(grads, of, keep=k, marks=marks),
                _mask(params, of, keep=k, marks=marks),
            )
            u, inner[k] = tx.update(masked_grads, state.inner[k], masked_params)
            for i, x in enumerate(optree.tree_flatten(u, is_leaf=is_masked)[0]):
                if of[i] == k:
                    out[i] = x
        return optree.tree_unflatten(treedef, out), PartitionState(inner)

    return GradientTransformation(init, update)


def _labels(labels: Any, params: Any, transforms: dict) -> list[str]:
    """Every leaf's label, checked."""
    leaves, treedef = optree.tree_flatten(params)
    paths = treedef.paths()
    if callable(labels):
        out = [labels(path, leaf) for path, leaf in zip(paths, leaves)]
    else:
        try:
            out = optree.tree_leaves(optree.tree_broadcast_prefix(labels, params))
        except ValueError as e:
            raise ValueError(f"partition: labels is not a prefix of the params' tree: {e}") from e
    for path, label in zip(paths, out):
        if label not in transforms:
            raise ValueError(
                f"params{format_path(path)}: label {label!r} has no transformation; the labels "
                f"are {sorted(transforms)}"
            )
    return out


def _mask(tree: Any, of: list[str], *, keep: str, marks: list[Masked]) -> Any:
    """``tree`` with the leaves of other labels than ``keep`` replaced by ``marks`` (the
    params', so that the params, gradients and states of one label have one structure)."""
    leaves, treedef = optree.tree_flatten(tree, is_leaf=is_masked)
    if len(leaves) != len(of):
        raise ValueError(
            f"partition: a tree of {len(leaves)} leaves where the params have {len(of)}"
        )
    kept = [
        x if label == keep or is_masked(x) else mark for x, label, mark in zip(leaves, of, marks)
    ]
    return optree.tree_unflatten(treedef, kept)

"""Optimizers on sharded trees: global norm, clipping, and optax-style ``sgd`` and ``adamw``.

Everything here works on local shards at a spec's optimizer placement (a final
``reduce_grads`` result, ``shard``-ed weights, or any elementwise function of those):

- :func:`global_norm` is the one place that needs communication. Each rank sums the squares
  of its local pieces, then sums over the axes where the tree is *sharded* (the optimizer
  placement's Flat or Shard(d) axes) and only those: a value replicated over an axis is
  counted once, not once per replica. One small all-reduce per sharded axis, however many
  leaves.
- :func:`clip_by_global_norm` scales by ``min(1, max_norm / (norm + 1e-6))`` (as
  ``torch.nn.utils.clip_grad_norm_``), computed once from the global norm, so every rank
  scales by the same factor.
- :func:`sgd` and :func:`adamw` are pairs of pure functions ``(init, update)`` in optax's style,
  with the math of ``torch.optim.SGD`` / ``torch.optim.AdamW``. Updates are elementwise, so they
  run on local shards of any placement and need no communication.

Local shards are plain tensors, so ``torch.optim`` can update them too; only the norm needs the
library (``torch.nn.utils.clip_grad_norm_`` on shards would see one rank's part):

Example:
    >>> import optree, torch, functional_hsdp as fh
    >>> mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    >>> spec = fh.hfsdp(mesh, "dp_outer", "dp_inner")
    >>> params = fh.shard({"w": torch.linspace(-1, 1, 6), "b": torch.ones(3)}, spec)
    >>> g = {"w": torch.randn(2, 2, 6), "b": torch.randn(2, 2, 3)}     # 4 ranks' gradients
    >>> grads, norm = fh.clip_by_global_norm(fh.reduce_grads(g, spec, last=True), spec, 0.5)
    >>> opt = fh.adamw(lr=0.1)
    >>> updates, state = opt.update(grads, opt.init(params), params)
    >>> new = fh.apply_updates(params, updates)
    >>> local = [p.clone().requires_grad_() for p in optree.tree_leaves(params)]
    >>> torch_opt = torch.optim.AdamW(local, lr=0.1)                  # the same, by torch.optim
    >>> for p, g in zip(local, optree.tree_leaves(grads)):
    ...     p.grad = g
    >>> torch_opt.step()
    >>> all(torch.allclose(p, q) for p, q in zip(local, optree.tree_leaves(new)))
    True
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from ..base.errors import still_partial
from ..base.tags import result_state, state_of, tag
from ..base.tree import flatten, format_path, structure_error
from ..io.checkpoint import empty_member, load_members, save_member
from ..mesh import Mesh
from ..spec.placement import Flat
from ..spec.specs import Spec, resolve_specs
from ..sync.collectives import psum
from .schedules import Schedule, check_lr, value_at

__all__ = [
    "AdamWState",
    "ChainState",
    "EmptyState",
    "GradientTransformation",
    "SGDState",
    "ScaleByAdamState",
    "ScaleByLearningRateState",
    "add_decayed_weights",
    "adamw",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "clip_global_norm",
    "global_norm",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "sgd",
]

# torch.nn.utils.clip_grad_norm_'s epsilon, added once to the global norm (never per rank).
_CLIP_EPS = 1e-6


# -- global norm and clipping --------------------------------------------------------------


def _placement_str(spec: Spec, role: str) -> str:
    return "[" + ", ".join(map(str, spec.placements(role))) + "]"


def _spec_mesh(spec: Any) -> Mesh:
    return optree.tree_leaves(spec, is_leaf=lambda x: isinstance(x, Spec))[0].mesh


def _check_tagged(
    leaf: Any,
    index: int,
    treedef: optree.PyTreeSpec,
    *,
    path: str,
    axes: tuple[str, ...],
    spec: Spec,
) -> None:
    """Refuse a leaf whose state tag says it is Partial, or split over other axes than ``axes``."""
    found = state_of(leaf)
    if found is None:
        return
    state = found[0]
    if state.kind == "accumulating":
        why = f" {spec.deferred_axes}, so its norm is not defined yet"
        raise ValueError(still_partial(path, why))
    # The spec the leaf was made with: found by position when the tag's tree is this tree,
    # else known only when every spec of the tag's tree splits the same axes (say, a subtree
    # of a one-spec tree). Other specs with the same split axes give the same norm.
    made = [state.plan.specs[index]] if state.plan.treedef == treedef else state.plan.specs
    made_axes = {s.sharded_axes(state.role) for s in made}
    if len(made_axes) == 1 and made_axes != {axes}:
        raise ValueError(
            f"{path}: was made at the {state.role} placement "
            f"{_placement_str(made[0], state.role)} of another spec (split over "
            f"{made_axes.pop()}), but spec's optimizer placement "
            f"{_placement_str(spec, 'optimizer')} is split over {axes}, and a norm summed over "
            "the wrong axes is silently wrong; pass the spec the tree was made with"
        )


def global_norm(tree: Any, spec: Any) -> torch.Tensor:
    """The L2 norm of a whole sharded tree, as if it were gathered: the same on every rank.

    Each rank sums the squares of its local pieces (in float32, or in float64 when any leaf
    is float64); the sums are then added over the axes where the optimizer placement is Flat,
    Shard(d) or Owner, and only there: replicated axes hold copies, counted once. Leaves are
    grouped by the set of axes they are sharded on, so there is one all-reduce of a few
    scalars per sharded axis, however many leaves. On a SimMesh the zero fill of ragged
    pieces adds nothing.

    Args:
        tree: pytree of floating local shards at the optimizer placement of ``spec`` (a final
            :func:`reduce_grads` result, :func:`shard`-ed weights, or elementwise functions of
            those); on a SimMesh with the mesh shape in front. A Partial (accumulating) tree
            is refused.
        spec: a :class:`Spec`, or a pytree prefix of Specs (one mesh).

    Returns:
        The norm, float32 (float64 if any leaf is float64), not differentiable: a 0-d tensor
        on a DistMesh; on a SimMesh a tensor of the mesh shape (every rank's copy, all equal).

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
        >>> spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
        >>> fh.global_norm(fh.shard({"w": torch.full((5,), 2.0)}, spec), spec)  # sqrt(5 * 4)
        tensor([[4.4721, 4.4721],
                [4.4721, 4.4721]])
    """
    leaves, treedef, names = flatten(tree, "tree")
    specs, _ = resolve_specs(spec, treedef, "tree")
    mesh = _spec_mesh(spec)
    batch = mesh.batch_shape
    nb = len(batch)
    wide = any(x.dtype in (torch.float64, torch.complex128) for x in leaves if _is_tensor(x))
    acc = torch.float64 if wide else torch.float32
    groups: dict[tuple[str, ...], list[torch.Tensor]] = {}
    with torch.no_grad():
        for i, (leaf, s, path) in enumerate(zip(leaves, specs, names)):
            axes = s.sharded_axes("optimizer")
            flat = any(isinstance(p, Flat) for p in s.optimizer)
            _check_leaf(leaf, path, mesh, axes=axes if flat else ())
            _check_tagged(leaf, i, treedef, path=path, axes=axes, spec=s)
            v = torch.view_as_real(leaf) if leaf.is_complex() else leaf
            v = v.reshape(*batch, math.prod(v.shape[nb:])).to(acc)
            # keep axes (Owner on some axes): each value on its owner, zeros elsewhere
            groups.setdefault(axes + s.keep_axes, []).append(torch.linalg.vecdot(v, v))
        if not groups:
            return torch.zeros(batch, dtype=acc)
        keys = list(groups)
        sums = [torch.stack(groups[k]).sum(0) for k in keys]
        # Sum each group over its own sharded axes: one psum per axis carries every group
        # sharded on it, so the count of collectives follows the axes, not the leaves. The
        # groups' sums ride as one leaf, packed tight (separate leaves would each start at an
        # aligned offset of the bucket), in a tree of its own, so that its layout is never
        # taken for a user's tree of scalars with a batch dim in front.
        for axis in mesh.axis_names:
            which = [j for j, k in enumerate(keys) if axis in k]
            if which:
                stacked = {"global_norm": torch.stack([sums[j] for j in which], -1)}
                totals = psum(stacked, axis, mesh)["global_norm"]
                for n, j in enumerate(which):
                    sums[j] = totals[..., n]
        return torch.stack(sums).sum(0).sqrt()


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _check_leaf(leaf: Any, path: str, mesh: Mesh, *, axes: tuple[str, ...]) -> None:
    if not _is_tensor(leaf):
        raise TypeError(f"{path}: expected a torch.Tensor leaf; got {type(leaf).__name__}")
    if not (leaf.is_floating_point() or leaf.is_complex()):
        raise TypeError(f"{path}: expected a floating dtype; got {leaf.dtype}")
    batch = mesh.batch_shape
    if tuple(leaf.shape[: len(batch)]) != batch:
        raise ValueError(
            f"{path}: on {mesh!r} a value's leading dims must be the mesh shape {batch} "
            f"(rank (i, j, ...) holds x[i, j, ...]); got shape {tuple(leaf.shape)}"
        )
    if axes and leaf.dim() != len(batch) + 1:  # a Flat piece is 1-D (a Shard(d) chunk is not)
        raise ValueError(
            f"{path}: spec's optimizer placement splits this leaf over {axes}, so its local "
            f"value is a 1-D piece; got shape {tuple(leaf.shape)}. Pass local shards "
            "(from fh.shard or reduce_grads(..., last=True)), not full tensors"
        )


def clip_by_global_norm(tree: Any, spec: Any, max_norm: float) -> tuple[Any, torch.Tensor]:
    """Scale a sharded tree so that its global norm is at most ``max_norm``.

    The factor is ``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_``:
    computed once from the global norm, so it is the same on every rank.

    Args:
        tree: pytree of floating local shards at the optimizer placement of ``spec`` (see
            :func:`global_norm`).
        spec: a :class:`Spec`, or a pytree prefix of Specs.
        max_norm: the largest norm allowed (a number >= 0).

    Returns:
        ``(clipped, norm)``: a new tree, same structure, shapes and dtypes, and the global norm
        before clipping (see :func:`global_norm`).

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp": 2})
        >>> spec = fh.fsdp(mesh)
        >>> g = fh.shard({"w": torch.tensor([0.0, 3.0, 4.0])}, spec)
        >>> clipped, norm = fh.clip_by_global_norm(g, spec, max_norm=1.0)
        >>> norm, fh.gather(clipped, spec)["w"][0]
        (tensor([5., 5.]), tensor([0.0000, 0.6000, 0.8000]))
    """
    _check_max_norm(max_norm)
    norm = global_norm(tree, spec)
    factor = torch.clamp(max_norm / (norm + _CLIP_EPS), max=1.0)

    def scale(x: torch.Tensor) -> torch.Tensor:
        f = factor.to(x.device).reshape(*factor.shape, *[1] * (x.dim() - factor.dim()))
        # computed in the factor's precision, rounded once to x's dtype, as torch does
        return (x * f).to(x.dtype)

    return optree.tree_map(scale, tree), norm


def _check_max_norm(max_norm: Any) -> None:
    if (
        isinstance(max_norm, bool)
        or not isinstance(max_norm, (int, float))
        or not (max_norm >= 0 and math.isfinite(max_norm))
    ):
        raise ValueError(f"max_norm must be a finite number >= 0; got {max_norm!r}")


# -- optimizers ----------------------------------------------------------------------------


class GradientTransformation(NamedTuple):
    """A pair of pure functions, as optax's.

    Attributes:
        init: ``init(params) -> state``.
        update: ``update(grads, state, params) -> (updates, new_state)``; apply with
            :func:`apply_updates`.
    """

    init: Callable[[Any], Any]
    update: Callable[[Any, Any, Any], tuple[Any, Any]]


class SGDState(NamedTuple):
    """State of :func:`sgd`.

    Attributes:
        count: number of updates so far (a host int, the same on every rank).
        momentum: tree like the params (local shards) of momentum buffers; None without
            momentum.
    """

    count: int
    momentum: Any


class AdamWState(NamedTuple):
    """State of :func:`adamw`.

    Attributes:
        count: number of updates so far (a host int, the same on every rank).
        mu: tree like the params (local shards): first moments (torch's ``exp_avg``).
        nu: tree like the params (local shards): second moments (torch's ``exp_avg_sq``).
    """

    count: int
    mu: Any
    nu: Any


def _flat(tree: Any, name: str) -> tuple[list, optree.PyTreeSpec, tuple[str, ...]]:
    leaves, treedef, names = flatten(tree, name)
    for leaf, path in zip(leaves, names):
        if not _is_tensor(leaf):
            raise TypeError(f"{path}: expected a torch.Tensor leaf; got {type(leaf).__name__}")
    return leaves, treedef, names


def _like(
    tree: Any, name: str, *, params: list, params_def: optree.PyTreeSpec, hint: str
) -> tuple[list, list[str]]:
    """``tree``'s leaves and paths, checked to have the structure and local shapes of params."""
    leaves, treedef, names = _flat(tree, name)
    if treedef != params_def:
        error = structure_error(params_def, tree, name, what="params")
        raise ValueError(f"{error}; {hint}")
    for leaf, p, path in zip(leaves, params, names):
        if leaf.shape != p.shape:
            raise ValueError(
                f"{path}: expected local shape {tuple(p.shape)} (as params"
                f"{path[len(name) :]}); got {tuple(leaf.shape)}; {hint}"
            )
    return leaves, names


_STATE_HINT = (
    "this optimizer state was made for another spec or tree (its local shards are laid out "
    "differently); call init(params) with params at this spec's optimizer placement"
)
_GRAD_HINT = (
    "grads must be local shards at the placement of params (a final reduce_grads result, "
    "with the spec params were sharded with)"
)


def _grads(grads: Any, params: list, params_def: optree.PyTreeSpec) -> list[torch.Tensor]:
    for leaf, path in zip(*_flat(grads, "grads")[::2]):
        found = state_of(leaf)
        if found is not None and found[0].kind == "accumulating":
            raise ValueError(still_partial(path))
    leaves, _ = _like(grads, "grads", params=params, params_def=params_def, hint=_GRAD_HINT)
    return [g.to(p.dtype) for g, p in zip(leaves, params)]


def _moments(tree: Any, name: str, *, params: list, params_def: optree.PyTreeSpec) -> list:
    leaves, names = _like(tree, name, params=params, params_def=params_def, hint=_STATE_HINT)
    for leaf, p, path in zip(leaves, params, names):
        if leaf.dtype != p.dtype:
            raise TypeError(f"{path}: expected dtype {p.dtype} (as params); got {leaf.dtype}")
    return leaves


def _check_state(state: Any, cls: type) -> None:
    if not isinstance(state, cls):
        article = "an" if cls.__name__[0] in "AEIOU" else "a"
        raise TypeError(
            f"state: expected {article} {cls.__name__} (from this optimizer's init); got "
            f"{type(state).__name__}"
        )


def _check_hyper(**values: float) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{name} must be a number >= 0; got {value!r}")


def sgd(
    lr: float | Schedule,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    *,
    nesterov: bool = False,
) -> GradientTransformation:
    """Stochastic gradient descent with ``torch.optim.SGD``'s math, on local shards.

    ``d = g + weight_decay * p``; with momentum ``buf = momentum * buf + d`` (``buf = d`` on
    the first step) and ``d = buf``, or with ``nesterov`` ``d = d + momentum * buf``; the
    update is ``-lr * d``.

    Args:
        lr: learning rate: a number, or a schedule ``step -> lr``
            (:mod:`~functional_hsdp.optim.schedules`; step counted from 0, kept in the state's
            ``count``).
        momentum: momentum factor (0: none, no per-parameter state).
        weight_decay: L2 penalty added to the gradient (coupled, as torch.optim.SGD).
        nesterov: Nesterov momentum, as ``torch.optim.SGD(nesterov=True)`` (needs
            ``momentum > 0``). DiLoCo's outer optimizer is ``sgd(0.7, 0.9, nesterov=True)``.

    Returns:
        A :class:`GradientTransformation`; its state is an :class:`SGDState`.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> params = {"w": torch.ones(2)}
        >>> opt = fh.sgd(lr=0.1, momentum=0.9)
        >>> state = opt.init(params)
        >>> updates, state = opt.update({"w": torch.ones(2)}, state, params)
        >>> fh.apply_updates(params, updates)["w"], state.count
        (tensor([0.9000, 0.9000]), 1)
    """
    check_lr(lr)
    _check_hyper(momentum=momentum, weight_decay=weight_decay)
    if not isinstance(nesterov, bool):
        raise TypeError(f"nesterov must be a bool; got {nesterov!r}")
    if nesterov and not momentum:
        raise ValueError(
            f"nesterov=True needs momentum > 0 (as torch.optim.SGD); got momentum={momentum!r}"
        )

    def init(params: Any) -> SGDState:
        leaves, treedef, _ = _flat(params, "params")
        if not momentum:
            return SGDState(0, None)
        return SGDState(0, optree.tree_unflatten(treedef, [torch.zeros_like(p) for p in leaves]))

    def update(grads: Any, state: SGDState, params: Any) -> tuple[Any, SGDState]:
        _check_state(state, SGDState)
        p, treedef, _ = _flat(params, "params")
        g = _grads(grads, p, treedef)
        d = [gi + weight_decay * pi if weight_decay else gi for gi, pi in zip(g, p)]
        new_momentum = None
        if momentum:
            if state.momentum is None:
                raise ValueError(
                    "state.momentum is None: this state was made without momentum; "
                    "call init(params) with this optimizer"
                )
            buf = _moments(state.momentum, "state.momentum", params=p, params_def=treedef)
            # zero buffers make the first step buf = d, as torch's clone
            bufs = [momentum * b + di for b, di in zip(buf, d)]
            new_momentum = optree.tree_unflatten(treedef, bufs)
            d = [di + momentum * b for di, b in zip(d, bufs)] if nesterov else bufs
        step_lr = value_at(lr, state.count)
        updates = optree.tree_unflatten(treedef, [-step_lr * di for di in d])
        return updates, SGDState(state.count + 1, new_momentum)

    return GradientTransformation(init, update)


# -- combinators: optax's building blocks ---------------------------------------------------


class EmptyState(NamedTuple):
    """The state of a transformation that keeps none (:func:`scale`,
    :func:`add_decayed_weights`, :func:`clip_global_norm`)."""


class ChainState(NamedTuple):
    """State of :func:`chain`.

    Attributes:
        inner: a tuple of the chained transformations' states, in their order.
    """

    inner: tuple

    # checkpoints (functional_hsdp.io.checkpoint's protocol): each state under its index

    def __fh_state_dict__(self, spec: Any, *, like: Any = None) -> dict[str, Any]:
        """``{"0": ..., "1": ...}``: each transformation's state as ``fh.state_dict``
        saves it (a NamedTuple of your own field by field)."""
        likes = dict(enumerate(like.inner)) if isinstance(like, ChainState) else {}
        return {str(i): save_member(x, spec, like=likes.get(i)) for i, x in enumerate(self.inner)}

    def __fh_empty_state_dict__(self, spec: Any) -> dict[str, Any]:
        """Placeholders for ``dcp.load``, one entry per transformation."""
        return {str(i): empty_member(x, spec) for i, x in enumerate(self.inner)}

    def __fh_load_state_dict__(self, state: dict, spec: Any, *, name: str) -> ChainState:
        """Each transformation's state loaded (this state the like)."""
        members = {str(i): x for i, x in enumerate(self.inner)}
        loaded = load_members(state, spec, members, name=name, owner="ChainState")
        return ChainState(tuple(loaded.values()))


class ScaleByAdamState(NamedTuple):
    """State of :func:`scale_by_adam`.

    Attributes:
        count: number of updates so far (a host int, the same on every rank).
        mu: tree like the params (local shards): first moments (torch's ``exp_avg``).
        nu: tree like the params (local shards): second moments (torch's ``exp_avg_sq``).
    """

    count: int
    mu: Any
    nu: Any


class ScaleByLearningRateState(NamedTuple):
    """State of :func:`scale_by_learning_rate`.

    Attributes:
        count: number of updates so far (a host int): the step a schedule is evaluated at.
    """

    count: int


def _is_transformation(tx: Any) -> bool:
    return callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Transformations applied one after another (optax's ``chain``).

    ``update`` passes the updates through each transformation in turn, each with its own
    state and the same ``params``. Any ``(init, update)`` pair on local shards chains: the
    library's and your own (``update(updates, state, params) -> (updates, state)``; an
    elementwise function of local shards needs no communication).

    Args:
        *transforms: :class:`GradientTransformation` s (or any objects with ``init`` and
            ``update``).

    Returns:
        A :class:`GradientTransformation`; its state is a :class:`ChainState` of theirs.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> params = {"w": torch.ones(2)}
        >>> opt = fh.chain(fh.scale(0.5), fh.scale_by_learning_rate(0.1))
        >>> updates, state = opt.update({"w": torch.tensor([2.0, -4.0])}, opt.init(params), params)
        >>> updates["w"]
        tensor([-0.1000,  0.2000])
        >>> state.inner
        (EmptyState(), ScaleByLearningRateState(count=1))
    """
    for i, tx in enumerate(transforms):
        if not _is_transformation(tx):
            raise TypeError(
                f"chain: transforms[{i}] is not a GradientTransformation (an object with init "
                f"and update); got {type(tx).__name__}"
            )

    def init(params: Any) -> ChainState:
        return ChainState(tuple(tx.init(params) for tx in transforms))

    def update(updates: Any, state: ChainState, params: Any = None) -> tuple[Any, ChainState]:
        if not isinstance(state, ChainState) or len(state.inner) != len(transforms):
            got = len(state.inner) if isinstance(state, ChainState) else type(state).__name__
            raise TypeError(
                f"state: expected the ChainState of this chain's init ({len(transforms)} "
                f"states); got {got}"
            )
        new = []
        for i, (tx, s) in enumerate(zip(transforms, state.inner)):
            try:
                updates, s = tx.update(updates, s, params)
            except Exception as e:
                e.add_note(f"(in chain's transforms[{i}])")
                raise
            new.append(s)
        return updates, ChainState(tuple(new))

    return GradientTransformation(init, update)


def _empty_init(params: Any) -> EmptyState:
    return EmptyState()


def _check_empty(state: Any) -> None:
    if not isinstance(state, EmptyState):
        raise TypeError(f"state: expected an EmptyState (from init); got {type(state).__name__}")


def scale(step_size: float) -> GradientTransformation:
    """Multiply the updates by a constant (optax's ``scale``).

    Args:
        step_size: the factor (any finite number; negative flips the sign).

    Returns:
        A :class:`GradientTransformation`; its state is an :class:`EmptyState`.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> opt = fh.scale(-2.0)
        >>> opt.update({"w": torch.ones(2)}, opt.init(None))[0]
        {'w': tensor([-2., -2.])}
    """
    if (
        isinstance(step_size, bool)
        or not isinstance(step_size, (int, float))
        or not math.isfinite(step_size)
    ):
        raise ValueError(f"scale: step_size must be a finite number; got {step_size!r}")

    def update(updates: Any, state: EmptyState, params: Any = None) -> tuple[Any, EmptyState]:
        _check_empty(state)
        leaves, treedef, _ = _flat(updates, "updates")
        return optree.tree_unflatten(treedef, [step_size * u for u in leaves]), state

    return GradientTransformation(_empty_init, update)


def _adam_reference(grads: Any, params: Any) -> tuple[list, optree.PyTreeSpec, list]:
    """``(params or grads leaves, treedef, grads cast to their dtype)``."""
    if params is None:
        g, treedef, _ = _flat(grads, "grads")
        _grads(grads, g, treedef)  # refuses an accumulating gradient
        return g, treedef, g
    p, treedef, _ = _flat(params, "params")
    return p, treedef, _grads(grads, p, treedef)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adam's bias-corrected moment ratio (optax's ``scale_by_adam``), on local shards.

    With ``t`` the step count after this update: ``m = b1 m + (1 - b1) g``,
    ``v = b2 v + (1 - b2) g²``, and the update is
    ``(m / (1 - b1**t)) / (sqrt(v) / sqrt(1 - b2**t) + eps)`` (eps added as
    ``torch.optim.Adam`` adds it). Elementwise: no communication. Chain it with
    :func:`scale_by_learning_rate` (and :func:`add_decayed_weights` between: AdamW).

    Args:
        b1: decay rate of the first moment (torch's ``betas[0]``), in [0, 1).
        b2: decay rate of the second moment (torch's ``betas[1]``), in [0, 1).
        eps: added to the bias-corrected ``sqrt(v)``.

    Returns:
        A :class:`GradientTransformation`; its state is a :class:`ScaleByAdamState`. Its
        updates take the params' dtype (when ``params`` are passed).

    References:
        Kingma & Ba, *Adam: A Method for Stochastic Optimization*, ICLR 2015.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> params = {"w": torch.ones(2)}
        >>> opt = fh.scale_by_adam()
        >>> updates, state = opt.update({"w": torch.tensor([1.0, -3.0])}, opt.init(params), params)
        >>> updates["w"].round(decimals=6), state.count    # m / sqrt(v) = sign(g) at first
        (tensor([ 1., -1.]), 1)
    """
    _check_hyper(eps=eps)
    for name, b in (("b1", b1), ("b2", b2)):
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 <= b < 1:
            raise ValueError(f"{name} must be in [0, 1); got {b!r}")

    def init(params: Any) -> ScaleByAdamState:
        leaves, treedef, _ = _flat(params, "params")
        zeros = lambda: optree.tree_unflatten(treedef, [torch.zeros_like(p) for p in leaves])
        return ScaleByAdamState(0, zeros(), zeros())

    def update(grads: Any, state: Any, params: Any = None) -> tuple[Any, ScaleByAdamState]:
        _check_state(state, ScaleByAdamState)
        p, treedef, g = _adam_reference(grads, params)
        mu = _moments(state.mu, "state.mu", params=p, params_def=treedef)
        nu = _moments(state.nu, "state.nu", params=p, params_def=treedef)
        count = state.count + 1
        # host scalars, as torch's single-tensor Adam computes them
        bias_correction1 = 1 - b1**count
        bias_correction2_sqrt = (1 - b2**count) ** 0.5
        new_mu = [m.lerp(gi, 1 - b1) for m, gi in zip(mu, g)]
        new_nu = [torch.addcmul(v * b2, gi, gi, value=1 - b2) for v, gi in zip(nu, g)]
        updates = [
            (m / bias_correction1) / (v.sqrt() / bias_correction2_sqrt + eps)
            for m, v in zip(new_mu, new_nu)
        ]
        unflat = functools.partial(optree.tree_unflatten, treedef)
        return unflat(updates), ScaleByAdamState(count, unflat(new_mu), unflat(new_nu))

    return GradientTransformation(init, update)


def _mask_of(mask: Any, params: Any) -> list[bool]:
    """Every params leaf's mask value, checked (errors name the path)."""
    leaves, treedef = optree.tree_flatten(params)
    paths = treedef.paths()
    if mask is None:
        return [True] * len(leaves)
    if callable(mask):
        out, where = [mask(path, leaf) for path, leaf in zip(paths, leaves)], "mask(path, leaf)"
    else:
        errors = optree.prefix_errors(mask, params)
        if errors:
            raise ValueError(
                "add_decayed_weights: mask is not a tree of bools with the params' structure "
                f"(or a prefix of it): {errors[0]('mask')}"
            )
        out = optree.tree_leaves(optree.tree_broadcast_prefix(mask, params))
        where = "mask"
    for path, value in zip(paths, out):
        if not isinstance(value, bool):
            raise TypeError(
                f"{where} for params{format_path(path)}: expected a bool (True: decay this "
                f"leaf); got {type(value).__name__} {value!r}"
            )
    return out


def add_decayed_weights(weight_decay: float, mask: Any = None) -> GradientTransformation:
    """Add ``weight_decay * params`` to the updates (optax's ``add_decayed_weights``).

    Before :func:`scale_by_learning_rate` this is decoupled weight decay (AdamW's:
    ``p -= lr * weight_decay * p``). Elementwise: no communication.

    Args:
        weight_decay: the factor (a number >= 0).
        mask: which leaves to decay: None (all); a tree of bools with the params'
            structure, or a pytree prefix of it (``{"w": True, "b": False}``); or a callable
            ``(path, leaf) -> bool`` as :func:`~functional_hsdp.partition`'s labels
            (``path`` the tuple of keys to the leaf, ``leaf`` its local shard: decide by
            path, since a Flat shard is 1-D).

    Returns:
        A :class:`GradientTransformation`; its state is an :class:`EmptyState`. Its
        ``update`` needs ``params``.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> params = {"w": torch.ones(2), "b": torch.ones(1)}
        >>> opt = fh.add_decayed_weights(0.1, mask=lambda path, leaf: path[-1] != "b")
        >>> grads = {"w": torch.zeros(2), "b": torch.zeros(1)}
        >>> opt.update(grads, opt.init(params), params)[0]
        {'w': tensor([0.1000, 0.1000]), 'b': tensor([0.])}
    """
    _check_hyper(weight_decay=weight_decay)
    if not (mask is None or callable(mask)):
        optree.tree_leaves(mask)  # a tree; checked against the params at each call

    def update(updates: Any, state: EmptyState, params: Any = None) -> tuple[Any, EmptyState]:
        _check_empty(state)
        if params is None:
            raise ValueError("add_decayed_weights: update needs params (the weights to decay)")
        p, treedef, _ = _flat(params, "params")
        hint = "pass the updates of these params"
        u, _ = _like(updates, "updates", params=p, params_def=treedef, hint=hint)
        decay = _mask_of(mask, params)
        out = [
            torch.add(ui, pi, alpha=weight_decay) if d and weight_decay else ui
            for ui, pi, d in zip(u, p, decay)
        ]
        return optree.tree_unflatten(treedef, out), state

    return GradientTransformation(_empty_init, update)


def scale_by_learning_rate(
    learning_rate: float | Schedule, *, flip_sign: bool = True
) -> GradientTransformation:
    """Multiply the updates by ``-learning_rate`` (optax's ``scale_by_learning_rate``).

    Args:
        learning_rate: a number >= 0, or a schedule ``step -> lr``
            (:mod:`~functional_hsdp.optim.schedules`), evaluated at the state's ``count``: 0 on the
            first update, as optax's and as ``torch.optim.lr_scheduler.LambdaLR``'s
            ``lr_lambda(0)`` for the first ``optimizer.step()``.
        flip_sign: multiply by ``-lr`` (descent; default) or by ``lr``.

    Returns:
        A :class:`GradientTransformation`; its state is a :class:`ScaleByLearningRateState`
        (the step count, so a checkpoint resumes the schedule).

    Example:
        >>> import torch, functional_hsdp as fh
        >>> opt = fh.scale_by_learning_rate(fh.schedules.linear(1.0, 0.0, transition_steps=2))
        >>> state, g = opt.init(None), {"w": torch.ones(1)}
        >>> for _ in range(3):
        ...     updates, state = opt.update(g, state)
        ...     print(updates["w"])
        tensor([-1.])
        tensor([-0.5000])
        tensor([-0.])
    """
    check_lr(learning_rate, "learning_rate")

    def init(params: Any) -> ScaleByLearningRateState:
        return ScaleByLearningRateState(0)

    def update(
        updates: Any, state: Any, params: Any = None
    ) -> tuple[Any, ScaleByLearningRateState]:
        _check_state(state, ScaleByLearningRateState)
        lr = value_at(learning_rate, state.count, "learning_rate")
        factor = -lr if flip_sign else lr
        leaves, treedef, _ = _flat(updates, "updates")
        out = optree.tree_unflatten(treedef, [factor * u for u in leaves])
        return out, ScaleByLearningRateState(state.count + 1)

    return GradientTransformation(init, update)


def clip_global_norm(spec: Any, max_norm: float) -> GradientTransformation:
    """Clip the updates to a global norm of at most ``max_norm``: the transformation form of
    :func:`clip_by_global_norm` (optax's ``clip_by_global_norm``).

    The norm is the whole sharded tree's (:func:`global_norm`: one small all-reduce per
    sharded axis), so every rank scales by the same factor
    ``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_`` on the
    dense gradient. Put it first in a :func:`chain` to clip the gradient.

    Args:
        spec: the :class:`Spec` (or spec tree) of the updates' optimizer placement.
        max_norm: the largest norm allowed (a number >= 0).

    Returns:
        A :class:`GradientTransformation`; its state is an :class:`EmptyState`.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp": 2})
        >>> spec = fh.fsdp(mesh)
        >>> params = fh.shard({"w": torch.zeros(3)}, spec)
        >>> opt = fh.chain(fh.clip_global_norm(spec, 1.0), fh.scale_by_learning_rate(1.0))
        >>> g = fh.shard({"w": torch.tensor([0.0, 3.0, 4.0])}, spec)
        >>> updates, _ = opt.update(g, opt.init(params), params)
        >>> fh.gather(updates, spec)["w"][0]
        tensor([-0.0000, -0.6000, -0.8000])
    """
    _check_max_norm(max_norm)

    def update(updates: Any, state: EmptyState, params: Any = None) -> tuple[Any, EmptyState]:
        _check_empty(state)
        return clip_by_global_norm(updates, spec, max_norm)[0], state

    return GradientTransformation(_empty_init, update)


# -- AdamW: the chain of its parts ------------------------------------------------------------


def adamw(
    lr: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
) -> GradientTransformation:
    """Adam with decoupled weight decay, with ``torch.optim.AdamW``'s math, on local shards.

    ``chain(scale_by_adam(b1, b2, eps), add_decayed_weights(weight_decay),
    scale_by_learning_rate(lr))``, with the chain's state kept as one :class:`AdamWState`
    (its parts' step counts are the same count): with ``t`` the step count after this
    update, ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g²``, and the update is
    ``-lr * ((m / (1 - b1**t)) / (sqrt(v) / sqrt(1 - b2**t) + eps) + weight_decay * p)``.

    Args:
        lr: learning rate: a number, or a schedule ``step -> lr``
            (:mod:`~functional_hsdp.optim.schedules`; step counted from 0, as torch's ``LambdaLR``).
        b1: decay rate of the first moment (torch's ``betas[0]``).
        b2: decay rate of the second moment (torch's ``betas[1]``).
        eps: added to the bias-corrected ``sqrt(v)``, elementwise (no communication).
        weight_decay: decoupled weight decay, ``p -= lr * weight_decay * p``.

    Returns:
        A :class:`GradientTransformation`; its state is an :class:`AdamWState`.

    References:
        Loshchilov & Hutter, *Decoupled Weight Decay Regularization*, ICLR 2019.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> params = {"w": torch.ones(2)}
        >>> opt = fh.adamw(lr=0.1, weight_decay=0.0)
        >>> updates, state = opt.update({"w": torch.tensor([1.0, -3.0])}, opt.init(params), params)
        >>> updates["w"]
        tensor([-0.1000,  0.1000])
    """
    check_lr(lr)
    parts = chain(
        scale_by_adam(b1, b2, eps), add_decayed_weights(weight_decay), scale_by_learning_rate(lr)
    )

    def init(params: Any) -> AdamWState:
        return AdamWState(*parts.init(params).inner[0])

    def update(grads: Any, state: AdamWState, params: Any) -> tuple[Any, AdamWState]:
        _check_state(state, AdamWState)
        inner = (ScaleByAdamState(*state), EmptyState(), ScaleByLearningRateState(state.count))
        updates, new = parts.update(grads, ChainState(inner), params)
        return updates, AdamWState(*new.inner[0])

    return GradientTransformation(init, update)


def apply_updates(params: Any, updates: Any) -> Any:
    """``params + updates``, leaf by leaf (a new tree; nothing is mutated).

    Args:
        params: pytree of local shards.
        updates: a tree of the same structure and local shapes (from an ``update``).

    Returns:
        A new tree of ``p + u``, in each param's dtype. Where ``params`` is, as a whole, a
        tree the library returned (``shard``, ``sync_params``, an earlier
        ``apply_updates``), the new tree carries its state tag: later calls read it at the
        same placement without looking at shapes (which some layouts share between the
        optimizer and the parameter placement on some ranks).

    Example:
        >>> import torch, functional_hsdp as fh
        >>> fh.apply_updates({"w": torch.ones(2)}, {"w": torch.tensor([0.5, -1.0])})
        {'w': tensor([1.5000, 0.0000])}
    """
    p, treedef, _ = _flat(params, "params")
    hint = "pass the updates that update() returned for params"
    u, _ = _like(updates, "updates", params=p, params_def=treedef, hint=hint)
    out = [(pi + ui).to(pi.dtype) for pi, ui in zip(p, u)]
    made = result_state(p)
    if made is not None:  # the params' placement, kept: p + u has p's layout
        tag(out, made.plan, made.role, kind=made.kind)
    return optree.tree_unflatten(treedef, out)

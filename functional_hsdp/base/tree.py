"""Tree handling shared by every public function: flattening with paths, leaf checks, the
errors that name a pytree path (JAX style: ``grads['layers'][0]['w']``), and
:class:`MaskedNode` leaves (a leaf another transformation handles, as optax's ``MaskedNode``)."""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

import optree
import torch

from .cache import Bounded, lru

__all__ = [
    "MaskedNode",
    "check_bool",
    "check_tensors",
    "flatten",
    "format_path",
    "is_masked",
    "masked_like",
    "masked_node",
    "paths_of",
    "refuse_vmap",
    "structure_error",
    "unmask",
]


def format_path(path: tuple) -> str:
    """JAX-style key path: ``['layers'][0]['w']``."""
    return "".join(f"[{k}]" if isinstance(k, int) else f"[{k!r}]" for k in path)


@lru(maxsize=1024)
def paths_of(treedef: optree.PyTreeSpec, name: str) -> tuple[str, ...]:
    """Every leaf's path, prefixed with ``name``; formatted once per structure."""
    return tuple(f"{name}{format_path(p)}" for p in treedef.paths())


def flatten(tree: Any, name: str) -> tuple[list, optree.PyTreeSpec, tuple[str, ...]]:
    """``(leaves, treedef, paths)`` of ``tree``; paths start with ``name``.

    A flat dict of tensors (``dict(model.named_parameters())``, and what ``torch.func.grad``
    returns for it: the usual tree) is flattened without optree after the first time: its
    key tuple finds the treedef optree gave (a dict's treedef records its key order) and the
    order of its leaves, and the values are checked to be plain tensors, which are leaves.
    That costs about a sixth of ``optree.tree_flatten`` per leaf, whose C++ walk is the
    largest per-leaf cost of a cached call.
    """
    if torch.compiler.is_compiling():  # traced once per graph: no cache lookups in the trace
        leaves, treedef = optree.tree_flatten(tree)
        return leaves, treedef, paths_of.__wrapped__(treedef, name)
    flat = type(tree) is dict and tree
    if flat:
        keys = tuple(tree)
        known = _FLAT_DICTS.get(keys)
        if known is not None:
            leaves = list(known[1](tree))
            if _LEAF_TYPES.issuperset(map(type, leaves)):
                paths = known[2].get(name)
                if paths is None:
                    paths = known[2][name] = paths_of(known[0], name)
                return leaves, known[0], paths
    leaves, treedef = optree.tree_flatten(tree)
    if flat and _LEAF_TYPES.issuperset(map(type, tree.values())):
        order = treedef.entries()  # the keys in leaf order
        getter = operator.itemgetter(*order)
        pick = getter if len(order) > 1 else (lambda d: (getter(d),))
        _FLAT_DICTS[keys] = (treedef, pick, {})
    return leaves, treedef, paths_of(treedef, name)


# Types whose instances are always optree leaves (nothing registers tensors as nodes).
_LEAF_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})
# a flat dict's keys (insertion order) -> (its treedef, its values in leaf order, {name: paths})
_FLAT_DICTS: Bounded = Bounded(64)


def check_bool(name: str, value: Any, meaning: str = "") -> None:
    """TypeError unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool{meaning}; got {type(value).__name__} {value!r}")


def check_tensors(
    leaves: Sequence[Any], paths: Sequence[str], mesh: Any, *, floating: bool, batched: bool
) -> None:
    """Every leaf is a dense tensor with data (floating if asked) whose leading dims are the
    mesh's batch shape (if ``batched``); else an error naming its path."""
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
        if floating and leaf.is_complex():
            raise TypeError(
                f"{path}: complex gradients are not supported ({leaf.dtype}); pass "
                "torch.view_as_real(x), a real tensor of the same bytes"
            )
        if floating and not leaf.is_floating_point():
            raise TypeError(f"{path}: gradients must have a floating dtype; got {leaf.dtype}")
        if batched and tuple(leaf.shape[: len(batch)]) != batch:
            raise ValueError(
                f"{path}: on {mesh!r} a value's leading dims must be the mesh shape {batch} "
                f"(rank (i, j, ...) holds x[i, j, ...]); got shape {tuple(leaf.shape)}"
            )


def tracked(x: Any) -> bool:
    """Whether ``x`` is a tensor whose gradient may be asked for: it requires grad under
    autograd or a ``torch.func`` transform, with grad mode on."""
    return isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled()


def refuse_tracked(leaves: Sequence[Any], paths: Sequence[str], call: str) -> None:
    """TypeError naming the first leaf that a ``torch.func`` gradient transform tracks:
    ``call`` is not differentiable, and under the transform its result would silently carry
    no gradient back (a zero gradient). Under plain autograd its results are detached values,
    as a ``torch.no_grad`` block's are."""
    for x, path in zip(leaves, paths):
        if tracked(x) and torch._C._functorch.is_gradtrackingtensor(x):
            raise TypeError(
                f"{path}: requires a gradient, but {call} is not differentiable (its result "
                "would carry none back): gather weights inside the loss with fh.gathered "
                "units or fh.functional_call, reduce across ranks with fh.psum / fh.pmean "
                "(differentiable), or pass detached tensors"
            )


def refuse_vmap(leaves: Sequence[Any], call: str) -> None:
    """NotImplementedError if ``leaves`` are being vmapped (functorch batched tensors): the
    library's packing and collectives work on whole per-rank tensors, and a batched call would
    fail deep inside (no batching rule for packing) or reduce the wrong thing."""
    first = next((x for x in leaves if isinstance(x, torch.Tensor)), None)
    if first is not None and torch._C._functorch.is_batchedtensor(first):
        raise NotImplementedError(
            f"{call} under torch.func.vmap is not supported: call it outside the vmap, on the "
            "per-rank gradients (sum or average per-example gradients first; on a SimMesh the "
            "mesh dims already stand for the ranks)"
        )


def structure_error(expected: optree.PyTreeSpec, tree: Any, name: str, *, what: str) -> ValueError:
    """The error for ``tree`` (called ``name``) not having the structure ``expected``."""
    reference = optree.tree_unflatten(expected, [0] * expected.num_leaves)
    errors = optree.prefix_errors(reference, tree) or optree.prefix_errors(tree, reference)
    detail = errors[0](name) if errors else f"expected {expected}"
    return ValueError(f"{name} does not have the structure of {what}: {detail}")


# -- masked leaves ----------------------------------------------------------------------------


class MaskedNode(NamedTuple):
    """A leaf that another transformation of :func:`~functional_hsdp.partition` handles: an
    empty subtree (optax's ``MaskedNode``), so ``tree_map`` and the optimizers pass it by. It
    remembers the local shape and dtype of the leaf it stands for (in its class: a
    namedtuple's fields would be leaves), so that functions that need a tree's layout
    (:func:`~functional_hsdp.per_matrix`, checkpoints) still find it. Make one with
    :func:`masked_node` (``Masked`` is its deprecated name)."""

    def __repr__(self) -> str:
        shape, dtype = getattr(type(self), "meta", (None, None))
        return f"MaskedNode(shape={shape}, dtype={dtype})"

    def __reduce__(self):
        return (masked_like, type(self).meta)


@functools.cache  # kept, never cleared: a class is a tree node type, and a state masked before
# must have the structure of the trees masked after (one small class per local shape and dtype)
def _masked_class(shape: tuple[int, ...], dtype: torch.dtype) -> type:
    return type("MaskedNode", (MaskedNode,), {"__slots__": (), "meta": (shape, dtype)})


def masked_like(shape: tuple[int, ...], dtype: torch.dtype) -> MaskedNode:
    """A :class:`MaskedNode` standing for a leaf of local ``shape`` and ``dtype``."""
    return _masked_class(tuple(shape), dtype)()


def masked_node(leaf: torch.Tensor) -> MaskedNode:
    """A :class:`MaskedNode` standing for ``leaf`` (``masked`` is its deprecated name).

    Example:
        >>> import optree, torch, functional_hsdp as fh
        >>> tree = {"w": torch.ones(2, 3), "b": fh.masked_node(torch.ones(3))}
        >>> doubled = optree.tree_map(lambda x: 2 * x, tree)
        >>> doubled["b"], isinstance(doubled["b"], fh.MaskedNode)
        (MaskedNode(shape=(3,), dtype=torch.float32), True)
    """
    return masked_like(tuple(leaf.shape), leaf.dtype)


def is_masked(x: Any) -> bool:
    """Whether ``x`` is a :class:`MaskedNode` leaf (an ``is_leaf`` for optree)."""
    return isinstance(x, MaskedNode)


def unmask(tree: Any, name: str) -> tuple[list, list, optree.PyTreeSpec, tuple[str, ...]]:
    """``(leaves, present, treedef, paths)`` of a tree that may hold :class:`MaskedNode` leaves:
    ``treedef`` and ``paths`` are the whole tree's; a masked leaf is a zero stand-in of its
    local shape and dtype (no memory), ``present[i]`` False."""
    leaves, treedef = optree.tree_flatten(tree, is_leaf=is_masked)
    paths = tuple(f"{name}{format_path(p)}" for p in treedef.paths())
    present = [not is_masked(x) for x in leaves]
    device = next(
        (x.device for x, p in zip(leaves, present) if p and isinstance(x, torch.Tensor)), None
    )
    out = []
    for x, p in zip(leaves, present):
        if not p:
            shape, dtype = type(x).meta
            x = torch.zeros((), dtype=dtype, device=device).expand(shape)
        out.append(x)
    return out, present, treedef, paths

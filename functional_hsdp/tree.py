"""Tree handling shared by every public function: flattening with paths, leaf checks, and
the errors that name a pytree path (JAX style: ``grads['layers'][0]['w']``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optree
import torch

from .cache import lru

__all__ = [
    "check_bool",
    "check_tensors",
    "flatten",
    "format_path",
    "paths_of",
    "structure_error",
]


def format_path(path: tuple) -> str:
    """JAX-style key path: ``['layers'][0]['w']``."""
    return "".join(f"[{k}]" if isinstance(k, int) else f"[{k!r}]" for k in path)


@lru(maxsize=1024)
def paths_of(treedef: optree.PyTreeSpec, name: str) -> tuple[str, ...]:
    """Every leaf's path, prefixed with ``name``; formatted once per structure."""
    return tuple(f"{name}{format_path(p)}" for p in treedef.paths())


def flatten(tree: Any, name: str) -> tuple[list, optree.PyTreeSpec, tuple[str, ...]]:
    """``(leaves, treedef, paths)`` of ``tree``; paths start with ``name``."""
    leaves, treedef = optree.tree_flatten(tree)
    if torch.compiler.is_compiling():  # traced once per graph: no cache lookups in the trace
        return leaves, treedef, paths_of.__wrapped__(treedef, name)
    return leaves, treedef, paths_of(treedef, name)


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
        if floating and not (leaf.is_floating_point() or leaf.is_complex()):
            raise TypeError(f"{path}: gradients must have a floating dtype; got {leaf.dtype}")
        if batched and tuple(leaf.shape[: len(batch)]) != batch:
            raise ValueError(
                f"{path}: on {mesh!r} a value's leading dims must be the mesh shape {batch} "
                f"(rank (i, j, ...) holds x[i, j, ...]); got shape {tuple(leaf.shape)}"
            )


def structure_error(expected: optree.PyTreeSpec, tree: Any, name: str, what: str) -> ValueError:
    """The error for ``tree`` (called ``name``) not having the structure ``expected``."""
    reference = optree.tree_unflatten(expected, [0] * expected.num_leaves)
    errors = optree.prefix_errors(reference, tree) or optree.prefix_errors(tree, reference)
    detail = errors[0](name) if errors else f"expected {expected}"
    return ValueError(f"{name} does not have the structure of {what}: {detail}")

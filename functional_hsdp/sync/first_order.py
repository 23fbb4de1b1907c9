"""First-order gradients with ``torch.func``'s signature and autograd's memory.

:func:`grad_and_value` and :func:`grad` take and return what ``torch.func``'s do, and
differentiate the way ``loss.backward()`` does: once, freeing each backward node's saved
tensors and intermediates as they go, where ``torch.func.grad`` keeps them to the end of the
backward (why: :func:`grad_and_value`). Under another ``torch.func`` transform (``vmap`` of
it, ``grad`` of it, ``jvp``) or while ``torch.compile`` traces, they are ``torch.func``'s own,
so nothing composes differently.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import optree
import torch

from ..base.tree import flatten

__all__ = ["grad", "grad_and_value"]


def transformed() -> bool:
    """Whether a ``torch.func`` transform is running (its interpreter stack is not empty) or
    ``torch.compile`` is tracing: then ``torch.func``'s own transform runs."""
    return torch._C._functorch.peek_interpreter_stack() is not None or torch.compiler.is_compiling()


@contextlib.contextmanager
def requiring_grad(leaves: Sequence[torch.Tensor]) -> Iterator[None]:
    """``leaves`` require a gradient in the block; those that did not are reset after it,
    also when it raises (so that the library's shards stay the very tensors it knows)."""
    toggled = [x for x in leaves if not x.requires_grad]
    try:
        for x in toggled:
            x.requires_grad_(True)
        yield
    finally:
        for x in toggled:
            x.requires_grad_(False)


def _argnums(argnums: int | Sequence[int], n: int) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not nums or not all(isinstance(i, int) for i in nums):
        raise TypeError(f"argnums must be an int or a non-empty tuple of ints; got {argnums!r}")
    for i in nums:
        if not -n <= i < n:
            raise ValueError(
                f"argnums {i} is out of range for a call with {n} positional arguments"
            )
    nums = tuple(i % n for i in nums)
    if len(set(nums)) != len(nums):
        raise ValueError(f"argnums {argnums!r} names an argument twice")
    return nums


def _inputs(args: tuple, nums: tuple[int, ...]) -> tuple[list, list]:
    """The differentiated leaves (floating tensors, each once), and each argument's treedef
    with its number of leaves."""
    leaves: list = []
    trees: list = []
    seen: dict[int, str] = {}
    for i in nums:
        xs, treedef, paths = flatten(args[i], f"args[{i}]")
        for x, path in zip(xs, paths):
            if not isinstance(x, torch.Tensor) or not (x.is_floating_point() or x.is_complex()):
                what = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
                raise TypeError(
                    f"{path}: only floating (or complex) tensors can be differentiated; got {what}"
                )
            if id(x) in seen:
                raise ValueError(
                    f"{path}: the same tensor as {seen[id(x)]}; torch.func differentiates each "
                    "position on its own, autograd one tensor: pass it once"
                )
            seen[id(x)] = path
        leaves.extend(xs)
        trees.append((treedef, len(xs)))
    return leaves, trees


def _value(out: Any, has_aux: bool) -> tuple[torch.Tensor, Any]:
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                "has_aux=True: the function must return a tuple (output, aux); got "
                f"{type(out).__name__}"
            )
        value, aux = out
    else:
        value, aux = out, None
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        got = (
            f"a tensor of shape {tuple(value.shape)}"
            if isinstance(value, torch.Tensor)
            else (type(value).__name__)
        )
        raise TypeError(f"the function must return a scalar tensor to differentiate; got {got}")
    return value, aux


def _detached(tree: Any) -> Any:
    return optree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, tree)


def grad_and_value(
    fn: Callable, argnums: int | Sequence[int] = 0, *, has_aux: bool = False
) -> Callable:
    """``torch.func.grad_and_value(fn, argnums, has_aux)``, differentiated once, as
    ``loss.backward()`` does: each backward node's saved tensors and intermediates are freed
    as soon as it has run, where ``torch.func``'s are kept until its whole backward ends.

    ``torch.func.grad`` builds a graph of the backward itself (it differentiates with
    ``create_graph=True``, so that any transform may be stacked on top). The price is paid by
    first-order training: every tensor a backward node saved, and every intermediate of the
    backward, is kept until the whole backward ends. For a model run through
    :func:`functional_hsdp.functional_call` the units already free theirs (each unit's
    backward runs inside the unit), but what runs outside the units (an LLM's embedding, its
    head and its loss over the vocabulary) is held to the end.

    Args:
        fn: the function to differentiate; returns a scalar tensor (with ``has_aux``, a
            tuple ``(scalar, aux)``).
        argnums: which positional argument (an int) or arguments (a tuple of ints) to
            differentiate with respect to; each a pytree of floating tensors.
        has_aux: (by keyword) ``fn`` returns ``(value, aux)``; ``aux`` is returned, not
            differentiated.

    Returns:
        A function of ``fn``'s arguments that returns ``(grads, value)``, or
        ``(grads, (value, aux))`` with ``has_aux``; ``grads`` has the structure of the
        ``argnums`` argument (a tuple of them for a tuple). ``value`` and ``aux`` come back
        detached, as ``torch.func`` returns them.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> p = {"w": torch.tensor([1.0, 2.0])}
        >>> g, value = fh.grad_and_value(lambda p, x: (p["w"] * x).sum())(p, torch.ones(2))
        >>> g["w"], value, p["w"].requires_grad
        (tensor([1., 1.]), tensor(3.), False)

    The differentiated leaves must be floating tensors, each tensor once. For the call they
    are set to require a gradient (those that did not are reset afterwards, also when ``fn``
    raises), so that the library's shards stay the very tensors it knows: do not use the same
    tensors in another thread meanwhile. Their gradients are returned, never accumulated into
    ``.grad``. A leaf the value does not depend on gets zeros.

    Under another ``torch.func`` transform, or while ``torch.compile`` traces, this is
    ``torch.func.grad_and_value`` itself. First order only: ``grad`` of it, or ``vmap`` of
    it, is ``torch.func``'s (composable, with its memory).
    """

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if transformed():
            return torch.func.grad_and_value(fn, argnums, has_aux)(*args, **kwargs)
        nums = _argnums(argnums, len(args))
        leaves, trees = _inputs(args, nums)
        with requiring_grad(leaves):
            with torch.enable_grad():
                value, aux = _value(fn(*args, **kwargs), has_aux)
            if value.requires_grad:
                grads = torch.autograd.grad(
                    value, leaves, allow_unused=True, materialize_grads=True
                )
            else:  # nothing to differentiate: zeros, as torch.func gives
                grads = tuple(torch.zeros_like(x) for x in leaves)
        it = iter(grads)
        out = tuple(optree.tree_unflatten(t, [next(it) for _ in range(n)]) for t, n in trees)
        out = out[0] if isinstance(argnums, int) else out
        value = value.detach()
        return (out, (value, _detached(aux))) if has_aux else (out, value)

    return run


def grad(fn: Callable, argnums: int | Sequence[int] = 0, *, has_aux: bool = False) -> Callable:
    """``torch.func.grad(fn, argnums, has_aux)`` with :func:`grad_and_value`'s memory.

    Args:
        fn, argnums, has_aux: as :func:`grad_and_value`.

    Returns:
        A function of ``fn``'s arguments that returns ``grads``, or ``(grads, aux)`` with
        ``has_aux``.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> fh.grad(lambda w: (w**2).sum())(torch.tensor([1.0, -3.0]))
        tensor([ 2., -6.])
    """
    both = grad_and_value(fn, argnums, has_aux=has_aux)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        grads, value = both(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return run

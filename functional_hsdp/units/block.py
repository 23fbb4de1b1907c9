"""The user-facing block: :func:`gathered` makes a :class:`Gathered`; :func:`sequence` runs many.

A block's call makes (or takes from the registry) the call record, reads the call's arguments
and mode, and runs the unit on the first-order path (:mod:`~functional_hsdp.units.functions`)
or, under vmap, forward mode or a second derivative, on the composable path
(:mod:`~functional_hsdp.units.composable`). :func:`sequence` runs a stack of units with each
next one prefetched.

State: a block keeps the call declared by its ``prefetch`` until its next call (``_next``),
and its descriptions for the cross-rank checks (``descriptions``); both go with the block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from ..runtime import validate
from ..runtime.unit_calls import unit_log
from ..spec.precision import Precision, check_mp_policy
from ..spec.specs import Spec
from ..sync.ghost import current_pass
from ..sync.maingrad import MainGrad, units_of
from . import chain as chains
from . import functions, registry, transfers
from .call import Arguments, Call
from .checks import adopts, check_spec, describe, differentiable, unit_plan
from .composable import composable, composed

__all__ = ["Gathered", "gathered", "prefetch_named", "prepare", "sequence"]


class Gathered:
    """A function of one unit's full weights, called with the unit's local shards.

    Made by :func:`gathered`; see there. Calling it all-gathers the unit inside forward and
    reduce-scatters its gradient inside backward.
    """

    def __init__(
        self,
        fn: Callable,
        spec: Spec,
        *,
        reshard_after_forward: bool,
        into: Any,
        recompute: bool = False,
        mp_policy: Any = None,
        name: str | None = None,
    ):
        self.fn = fn
        self.spec = spec
        self.reshard_after_forward = reshard_after_forward
        self.into = into
        self.recompute = recompute
        self.mp_policy = mp_policy
        precision = Precision.of(mp_policy)  # see functional_hsdp.spec.precision
        self.param_dtype, self.reduce_dtype = precision.param_dtype, precision.reduce_dtype
        self.output_dtype, self.cast_inputs = precision.output_dtype, precision.cast_inputs
        self.name = name or getattr(fn, "__name__", repr(fn))
        #: how errors name the shards (``functional_call``'s units: ``shards['layers.0']``)
        self.shards_path = "shards"
        self._next: tuple | None = None
        self.descriptions: dict = {}  # (plan, where) -> checks.describe's texts (its cache)

    def __repr__(self) -> str:
        return f"gathered({self.name}, {self.spec!r})"

    def prefetch(self, shards: Any) -> None:
        """Declare ``shards`` the unit that runs after the next call: that call issues its
        all-gather before computing (forward) and makes its wait node first, so that its
        reduce-scatter overlaps the backward of the unit before it."""
        prefetch_named(self, shards, "shards")

    @torch.compiler.disable  # each unit runs eagerly under torch.compile (a graph break)
    def __call__(self, shards: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(gather(shards, spec), *args, **kwargs)``, differentiable (see :func:`gathered`).

        Args:
            shards: this unit's local shards at the spec's parameter placement (a subtree of
                ``fh.shard(full, spec_tree)``, or the same after an optimizer step).
            *args: the rest of ``fn``'s arguments; floating tensors among them are
                differentiated, anything else is passed through as a constant.
            **kwargs: as ``args``.

        Returns:
            ``fn``'s result (a pytree of tensors).
        """
        ghost = current_pass()
        if composed():
            if ghost is not None:
                raise ValueError(
                    f"ghost_grad_norms: the unit {self.name} runs under vmap, jvp or a second "
                    "derivative; ghost norms take one first-order backward of the batch's "
                    "losses (fh.per_example_grad_norms is the vmap path)"
                )
            nxt, self._next = self._next, None
            if nxt is not None:  # the composable path gathers each unit when it is called
                transfers.abandon_ahead(nxt[0])
            return composable(self, shards, args=args, kwargs=kwargs)
        call, wrapped = self._prepared(shards)
        # read here, in the caller's context, and carried on the record into backward
        chains.join(call, registry.current_chain(), validate.current_mode())
        if call.mode != "off":  # the step's running fingerprint, agreed where it exchanges
            unit_log(self.spec.mesh).record(*describe(self, call))
        call.ghost = ghost  # a ghost-norms pass: norms only, nothing reduced or added
        if call.sink is not None and ghost is None:  # one more gradient for the MainGrad
            units_of(self.into).called(call.sink)
        nxt, self._next = self._next, None
        call.arguments, tensors = _arguments(self, wrapped, (args, kwargs))
        extra = []
        if nxt is not None:  # the next unit's shards ride along so forward can gather them
            call.nxt, extra = nxt
        outs = functions.apply(call, wrapped, tensors=tensors, extra=extra)
        return optree.tree_unflatten(call.out_def, list(outs[: call.out_def.num_leaves]))

    def _prepared(self, shards: Any) -> tuple[Call, list]:
        """This call's record and its shards through their wait node (made ahead, or now)."""
        leaves = optree.tree_leaves(shards)
        found = registry.take(leaves)
        if found is not None and adopts(self, found.call.block):
            found.call.block = self  # prefetched by another block, gathered as this one would
            return found.call, found.wrapped
        if found is not None:  # made ahead for a block that gathers otherwise
            transfers.abandon_ahead(found.call)
        call, wrapped = prepare(self, shards, self.shards_path)
        registry.forget(leaves)
        return call, wrapped


def _arguments(block: Gathered, wrapped: list, given: tuple) -> tuple[Arguments, list]:
    """The call's :class:`~.call.Arguments` (``given``: its ``(args, kwargs)``), and its
    tensor argument leaves (the Function's inputs after the shards)."""
    arg_leaves, args_def = optree.tree_flatten(given)
    tensors = [i for i, x in enumerate(arg_leaves) if isinstance(x, torch.Tensor)]
    diff = [differentiable(arg_leaves[i]) for i in tensors]
    wanted = any(w.requires_grad for w in wrapped)
    needed = torch.is_grad_enabled() and (wanted or any(diff))
    arguments = Arguments(
        args=[None if i in tensors else x for i, x in enumerate(arg_leaves)],
        args_def=args_def,
        tensors=tensors,
        diff=diff,
        wanted=wanted,
        graph=needed and not block.recompute,
        replay=needed and block.recompute,
    )
    return arguments, [arg_leaves[i] for i in tensors]


def prefetch_named(block: Gathered, shards: Any, name: str) -> None:
    """:meth:`Gathered.prefetch`, errors naming the shards ``name`` (``functional_call``: the
    next unit's own path)."""
    if not composed():  # the composable path gathers each unit when it is called
        block._next = prepare(block, shards, name)


def prepare(block: Gathered, shards: Any, name: str) -> tuple[Call, list]:
    """A call record for ``shards`` and its wait node, made now (so, before the unit that runs
    first: autograd's engine then runs that unit's backward before this wait), kept in this
    thread's registry until the call of those shards takes it."""
    leaves, treedef, paths, plan = unit_plan(block, shards, name)
    call = Call(
        block=block, plan=plan, treedef=treedef, k=len(leaves), named=paths[0] if paths else name
    )
    wrapped = functions.wait_node(call, leaves)
    registry.remember(call, leaves, wrapped)
    return call, wrapped


def gathered(
    fn: Callable,
    spec: Spec,
    *,
    reshard_after_forward: bool = True,
    into: MainGrad | None = None,
    recompute: bool = False,
    mp_policy: Any = None,
) -> Gathered:
    """Make ``fn`` of a unit's full weights callable on the unit's local shards.

    ``gathered(fn, spec)(shards, *args) == fn(gather(shards, spec), *args)``, differentiable
    under ``torch.func.grad``/``vjp``/``grad_and_value``/``functional_call`` and plain
    autograd. Forward all-gathers the unit; backward reduces the unit's gradient to the
    gradient placement (reduce-scatter over the non-deferred axes; deferred axes stay
    Partial), issued as soon as it exists. So ``torch.func.grad(loss)(shards, x)`` returns
    local shards at the gradient placement: pass them to ``reduce_grads(..., at="gradient")``
    or ``MainGrad.accumulate(..., at="gradient")``.

    Args:
        fn: ``fn(weights, *args, **kwargs)``: a pure function of one unit's full weights (a
            pytree like the unit's shards). On a :class:`SimMesh` the weights carry the mesh
            dims in front: wrap a per-rank function with :func:`per_rank`.
        spec: the unit's :class:`Spec` (a leaf of the spec tree the shards were made with).
        reshard_after_forward: True (default): the gathered weights are not kept from forward
            to backward (re-gathered there, as FSDP2 does); False keeps them (one all-gather
            less per unit, the unit's full weights held until its backward).
        into: a :class:`MainGrad` of the whole tree the shards belong to: each unit's
            reduce-scattered gradient is added into its buffers during backward (no
            gradient tree is ever held: FSDP2's memory), and the gradient
            ``torch.func.grad`` returns for the shards is zero. Scale the loss by 1/M, and
            after the step's last microbatch call ``into.finish()``. The shards must be the
            tensors ``fh.shard`` made (updated in place by the optimizer), so that their
            unit is known.
        recompute: False (default, FSDP2 without activation checkpointing): forward keeps
            the unit's activations (its graph) until backward and frees only the gathered
            weights; backward re-gathers them (unless kept) and runs no second forward.
            True: per-unit activation checkpointing: forward keeps only its inputs, backward
            re-gathers and recomputes the unit (less memory, one more forward per unit), with
            the random numbers and the autocast state its forward ran with.
        mp_policy: a ``torch.distributed.fsdp.MixedPrecisionPolicy``, with FSDP2's meaning:
            ``param_dtype`` casts the shards before the all-gather (the wire and ``fn`` run in
            it); ``reduce_dtype`` (default: ``param_dtype``) is the dtype of the gradient's
            reduce-scatter, and of what ``into`` adds or ``grad`` returns;
            ``output_dtype`` casts floating outputs; ``cast_forward_inputs`` casts floating
            arguments to ``param_dtype``. The shards keep their dtype (the master weights).

    Returns:
        A :class:`Gathered` block: ``block(shards, *args, **kwargs)``; ``block.prefetch(next)``
        declares the unit that runs after the next call (see :func:`sequence`).

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp": 2})
        >>> spec = fh.fsdp(mesh)
        >>> shards = fh.shard({"w": torch.tensor([1.0, 2.0, 3.0])}, spec)
        >>> block = fh.gathered(fh.per_rank(lambda p, x: (p["w"] * x).sum(), mesh), spec)
        >>> x = torch.ones(2, 3)                          # each rank's input
        >>> g = torch.func.grad(lambda s: block(s, x).sum())(shards)
        >>> fh.gather(fh.reduce_grads(g, spec, last=True, at="gradient"), spec)["w"][0]
        tensor([1., 1., 1.])
    """
    if not callable(fn):
        raise TypeError(f"gathered: fn must be callable; got {type(fn).__name__}")
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(
            f"gathered: reshard_after_forward must be a bool; got {reshard_after_forward!r}"
        )
    check_spec(spec, getattr(fn, "__name__", "fn"))
    if into is not None and not isinstance(into, MainGrad):
        raise TypeError(f"gathered: into must be a MainGrad or None; got {type(into).__name__}")
    if not isinstance(recompute, bool):
        raise TypeError(f"gathered: recompute must be a bool; got {recompute!r}")
    check_mp_policy(mp_policy, f"gathered({getattr(fn, '__name__', 'fn')})")
    return Gathered(
        fn,
        spec,
        reshard_after_forward=reshard_after_forward,
        into=into,
        recompute=recompute,
        mp_policy=mp_policy,
    )


def sequence(block: Gathered, units: Sequence[Any], x: Any, *args: Any) -> Any:
    """``x = block(unit, x, *args)`` for each unit in turn, each next unit prefetched.

    The loop of a stack of identical layers, with the next unit's all-gather issued before
    the current unit computes and every reduce-scatter overlapping the backward of the unit
    before it.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp": 2})
        >>> spec = fh.fsdp(mesh)
        >>> layers = fh.shard([{"w": torch.full((2,), 2.0)}] * 3, [spec] * 3)
        >>> block = fh.gathered(fh.per_rank(lambda p, x: p["w"] * x, mesh), spec)
        >>> fh.sequence(block, layers, torch.ones(2, 2))[0]
        tensor([8., 8.])
    """
    for i, unit in enumerate(units):
        if i + 1 < len(units):
            block.prefetch(units[i + 1])
        x = block(unit, x, *args)
    return x

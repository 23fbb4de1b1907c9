"""The first-order path (``torch.func.grad``/``vjp``/``grad_and_value``, plain autograd).

Two ``torch.autograd.Function`` per unit call, functorch style (``setup_context``, and a
backward that is ``once_differentiable``, so that its collectives see plain tensors):
:class:`_Unit` is ``fn(gather(shards), *args)`` (gather in forward, reduce-scatter in
backward), and :class:`_Wait`, applied just before the unit, is the one consumer of that
pending gradient. Overlap comes from autograd's engine order (:class:`_Wait` says how). Only
floating arguments that require a gradient (tracked by autograd or by the ``torch.func``
transform being run) are differentiated: rotary tables, masks and other constants are not.

State: none of its own; each call's is on its record (:mod:`~functional_hsdp.units.call`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from torch.autograd.function import once_differentiable

from ..base.tree import paths_of
from ..sync.ghost import returned_weights, unit_scope
from ..sync.maingrad import units_of
from . import call as lifecycle
from . import chain as chains
from . import replay, storage, transfers
from .call import Call, Phase
from .chain import Kept
from .checks import sink_buckets, where

__all__ = ["apply", "wait_node"]


def wait_node(call: Call, leaves: list) -> list:
    """The shards through ``call``'s wait node (made now, before the unit that runs first:
    autograd's engine then runs that unit's backward before this wait)."""
    return list(_Wait.apply(call, *leaves))


def apply(call: Call, wrapped: list, *, tensors: list, extra: list) -> tuple[torch.Tensor, ...]:
    """The unit's outputs (flattened): ``fn`` on its gathered shards ``wrapped`` and its tensor
    arguments, the next unit's shards ``extra`` riding along so that forward can gather them.
    Every tensor argument is an input (so forward sees it unwrapped from any transform); only
    floating ones get gradients."""
    return _Unit.apply(call, *wrapped, *tensors, *extra)


def _run(call: Call, full: list, args: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``fn`` on full weights and the tensor argument leaves, its outputs flattened (the
    mixed-precision casts of inputs and outputs included, so that a vjp runs through them)."""
    block, arguments = call.block, call.arguments
    leaves = list(arguments.args)
    cast = block.param_dtype if block.cast_inputs else None
    for i, x in zip(arguments.tensors, args):
        leaves[i] = x.to(cast) if cast is not None and x.is_floating_point() else x
    fn_args, fn_kwargs = optree.tree_unflatten(arguments.args_def, leaves)
    with _ghost_scope(call, full):
        out = block.fn(optree.tree_unflatten(call.treedef, full), *fn_args, **fn_kwargs)
    outs, call.out_def = optree.tree_flatten(out)
    for x in outs:
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"gathered: {block.name} must return a pytree of tensors; got a "
                f"{type(x).__name__} leaf"
            )
    if block.output_dtype is not None:
        outs = [x.to(block.output_dtype) if x.is_floating_point() else x for x in outs]
    return tuple(outs)


def _ghost_scope(call: Call, full: list) -> contextlib.AbstractContextManager:
    """In a ghost-norms pass, ``fn`` runs with the gathered weights known to it (a
    recompute in backward registers them again, their uses counted once, in forward)."""
    if call.ghost is None:
        return contextlib.nullcontext()
    return unit_scope(
        call.ghost,
        full,
        labels=_ghost_labels(call),
        owners=call.pieces,
        recount=call.phase is not Phase.BACKWARD,
        unit=(call.plan, call.block.reduce_dtype),
    )


def _ghost_labels(call: Call) -> list[str]:
    """The unit's parameters' paths: the unit's first leaf as the caller named it
    (fh.functional_call: ``shards['layers.0']['w']``), else in the tree fh.shard made, less
    that leaf's own path, then each leaf's."""
    leaves = paths_of(call.treedef, "")
    unit = call.named if call.block.shards_path != "shards" else call.where or call.named
    if leaves and leaves[0] and unit.endswith(leaves[0]):
        unit = unit[: -len(leaves[0])]
    return [unit + leaf for leaf in leaves]


def _ghost_returned(call: Call, outs: tuple, full: list) -> None:
    """In a ghost-norms pass, the gathered weights a unit returns as they are (an identity
    unit: ``fh.functional_call``'s root) stay known for the rest of the pass's forward: the
    caller uses them outside the unit."""
    found = [(o, i) for o in outs for i, w in enumerate(full) if _is_weight(o, [w])]
    if found:
        labels = _ghost_labels(call)
        returned_weights(
            call.ghost,
            [o for o, _ in found],
            labels=[labels[i] for _, i in found],
            owners=[call.pieces[i] for _, i in found],
        )


def _vjp(
    call: Call, full: list, args: Sequence[torch.Tensor], *, weights: bool
) -> tuple[tuple, Callable]:
    """``fn``'s outputs and its ``torch.func.vjp`` closure, with respect to the gathered
    weights (if ``weights``: their gradient is asked for) and the differentiated arguments,
    in that order."""
    diff = call.arguments.diff

    def f(weights: list, *floating: torch.Tensor) -> tuple[torch.Tensor, ...]:
        it = iter(floating)
        return _run(call, weights, [next(it) if d else x for x, d in zip(args, diff)])

    floats = [x for x, d in zip(args, diff) if d]
    if weights:
        return torch.func.vjp(f, full, *floats)
    return torch.func.vjp(functools.partial(f, full), *floats)


def _outputs(outs: tuple, full: list, args: tuple) -> tuple[tuple[torch.Tensor, ...], frozenset]:
    """The unit's outputs as its Function returns them, and the storages of those that are
    gathered weights. One that is an argument (or a view of one) would alias it: a copy. The
    gathered weights returned as they are (an identity unit) are the call's own, and their
    memory is then never released. The others are returned detached (the same memory):
    autograd gives its node to the tensor returned, and one the record keeps (a gathered
    weight, an output held by forward's vjp closure) would then point back to the record: a
    cycle through autograd's nodes, which the garbage collector cannot see, keeping a graph
    whose backward never comes alive for good."""
    weights = [o for o in outs if _is_weight(o, full)]
    kept = frozenset(o.untyped_storage().data_ptr() for o in weights)
    copied = [
        (o._base is not None or any(o is a for a in args)) and not any(o is w for w in weights)
        for o in outs
    ]
    return tuple(o.clone() if copy else o.detach() for o, copy in zip(outs, copied)), kept


def _is_weight(x: torch.Tensor, full: list) -> bool:
    """Whether ``x`` is one of the gathered weights, returned as it is (an identity unit)."""
    return any(
        x.data_ptr() == w.data_ptr() and x.shape == w.shape and x.stride() == w.stride()
        for w in full
    )


def _gather_next(call: Call, nxt: Sequence[torch.Tensor]) -> None:
    """Forward: issue the next unit's all-gather now, so that it overlaps this unit's
    compute (its call joins this chain, in this call's validation mode)."""
    following = call.nxt
    following.pieces = tuple(p.detach() for p in nxt)
    chains.join(following, call.chain, call.mode)
    transfers.issue_ahead(following, "forward", nxt)
    chains.track_ahead(following)


def _forward_fn(call: Call, full: list, args: tuple) -> tuple[torch.Tensor, ...]:
    """``fn``'s outputs in forward: recompute=False keeps its graph (the vjp closure) until
    backward; recompute=True keeps the RNG and autocast state to recompute it in (on the
    record, not per thread: backward may run on another)."""
    arguments = call.arguments
    if arguments.graph:  # the unit's graph is built now and kept until backward
        outs, call.vjp = _vjp(call, full, args, weights=arguments.wanted)
        return outs
    if arguments.replay:  # backward runs fn again: with the same random numbers and dtypes
        call.replay = replay.capture(full, args)
    with torch.no_grad():
        return _run(call, full, args)


def _backward_vjp(call: Call, ctx: Any, *, kept: Kept | None, wanted: bool) -> tuple:
    """Backward: ``(vjp closure, whether it differentiates the weights)``: forward's graph,
    its weights refilled if released, or ``fn`` recomputed on the weights gathered again
    (or kept). Its gathered weights are no longer held by the call."""
    if call.arguments.graph:  # forward's graph: the weights back into it, no recompute
        if call.phase is Phase.RELEASED:
            storage.refill_weights(call)
        lifecycle.backward_began(call)
        vjp, call.vjp = call.vjp, None
        storage.drop(call)
        return vjp, call.arguments.wanted
    lifecycle.backward_began(call)
    if call.held.full is not None:
        full = call.held.full
    elif kept is not None and kept.call() is call:  # the forward's last unit: gathered
        full = kept.full
    else:
        full = transfers.gather(call, "backward", call.pieces)
    rng, autocast = call.replay if call.replay is not None else (None, ())
    with replay.replaying(rng, autocast):
        _, vjp = _vjp(call, full, ctx.saved_tensors, weights=wanted)
    storage.drop(call)
    return vjp, wanted


def _differentiate(
    call: Call, ctx: Any, grads: tuple, *, kept: Kept | None, wanted: bool
) -> tuple[Any, list]:
    """The unit's vjp (:func:`_backward_vjp`) run once, each node freeing its saved tensors
    as soon as it has run, and let go of before the gradient is reduced: ``(gradient of the
    weights or None, per tensor argument its gradient or None)``."""
    vjp, weights = _backward_vjp(call, ctx, kept=kept, wanted=wanted)
    results = list(vjp(tuple(grads), retain_graph=False))
    del vjp
    weight_grads = results.pop(0) if weights else None
    it = iter(results)
    return weight_grads, [next(it) if d else None for d in call.arguments.diff]


class _Unit(torch.autograd.Function):
    """fn(gather(shards), *args): gather in forward, (recompute +) reduce-scatter in backward.

    Its **forward** all-gathers the unit (:func:`~functional_hsdp.units.transfers.gather`),
    issues the next unit's all-gather ahead when one is declared, and runs ``fn``:

    - ``recompute=False`` (the default, FSDP2 without activation checkpointing): ``fn`` runs
      under ``torch.func.vjp`` on the Function's plain tensors and the closure, which holds
      the unit's activations, is kept on the call record until backward; the gathered
      weights are released once the next unit starts (:mod:`~functional_hsdp.units.storage`).
    - ``recompute=True`` (per-unit activation checkpointing): ``fn`` runs without recording
      a graph; only the shards and the arguments are saved, and backward gathers the unit
      again and recomputes ``fn`` under ``torch.func.vjp`` (less memory, one more forward per
      unit), in forward's RNG and autocast state (:mod:`~functional_hsdp.units.replay`).

    Its **backward** issues the backward prefetch of the unit called before it, runs the vjp,
    and issues the reduce-scatter of the weight gradient asynchronously
    (:func:`~functional_hsdp.units.transfers.start_reduce_scatter`).
    """

    @staticmethod
    def forward(call: Call, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = call.k + len(call.arguments.tensors)
        pieces, nxt = ts[: call.k], ts[n:]
        # Under autograd, what forward is given carries its graph, which leads back to this
        # record: the shards through their wait node, the arguments through the unit before
        # (whose node has an edge to this unit's wait node when it prefetched it). What the
        # record or forward's vjp closure keeps is detached: kept as given, they would form a
        # cycle through autograd's nodes, which the garbage collector cannot see, keeping the
        # graph and the shards alive for good when its backward never comes.
        call.pieces = tuple(p.detach() for p in pieces)
        args = tuple(a.detach() for a in ts[call.k : n])
        chain = call.chain
        chains.drop_kept(chain)  # the unit before keeps its weights no longer
        try:  # from the first collective (a strict agreement before it may raise too)
            full = transfers.gather(call, "forward", pieces)
            if call.nxt is not None:  # the next unit's all-gather overlaps this unit's compute
                _gather_next(call, nxt)
            chains.link(call)
            outs = _forward_fn(call, full, args)
        except BaseException:
            if call.nxt is not None:  # its call will not come (not from this forward)
                transfers.abandon_ahead(call.nxt)
            chains.abandon(chain)
            raise
        outs, kept = _outputs(outs, full, args)
        if kept and call.ghost is not None:
            _ghost_returned(call, outs, full)
        storage.hold(call, full, kept)
        chains.keep_last(chain, call, full)
        lifecycle.forward_ran(call)
        return outs

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        call = inputs[0]
        ctx.call = call
        n = 1 + call.k + len(call.arguments.tensors)
        if not call.arguments.graph:  # recompute: the arguments (the shards are on call)
            ctx.save_for_backward(*inputs[1 + call.k : n])
        ctx.n_extra = len(inputs) - n  # the next unit's shards ride along, not differentiated

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        call = ctx.call
        chain = call.chain
        chains.close_at_end_of_backward(chain)
        prev = chains.take_prev(call)
        if prev is not None and storage.regathers(prev) and prev.ahead is None:
            transfers.issue_ahead(prev, "backward", prev.pieces)  # backward prefetch
            chains.track_ahead(prev)
        del prev
        kept = chains.take_kept(chain)
        # the shards' gradient is wanted (a grad with respect to the inputs only is not)
        wanted = any(ctx.needs_input_grad[1 : 1 + call.k])
        weight_grads, arg_grads = _differentiate(call, ctx, grads, kept=kept, wanted=wanted)
        rest = (*arg_grads, *(None for _ in range(ctx.n_extra)))
        if not wanted or call.ghost is not None:  # a ghost-norms pass reduces nothing
            lifecycle.wanted_none(call)
            return (None, *(None for _ in call.pieces), *rest)
        # the unit before's reduce-scatter ran during this unit's backward: waited now, before
        # this one packs, so that one gradient-sized buffer is in flight at a time (as FSDP2)
        chains.settle(chain)
        transfers.start_reduce_scatter(call, weight_grads)
        chains.add_reducing(chain, call)  # abandoned at the end if never waited
        # the shards' gradient is handed on by the wait node, once the reduce-scatter is done
        dummies = [
            torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape) for p in call.pieces
        ]
        return (None, *dummies, *rest)


class _Wait(torch.autograd.Function):
    """Identity on a unit's shards; backward: wait for the unit's reduce-scatter, hand it on.

    Applied just before the unit, it is the one consumer of that pending gradient: its
    backward waits for the reduce-scatter and hands on a finished tensor (or adds it into the
    ``MainGrad``). So nothing (a tied weight's sum, a cast's backward, a second
    ``.backward()``) can read a gradient still in flight, whatever order autograd's engine
    picks.

    Overlap comes from that engine's order: it runs the most recently created ready node
    first, so when a unit's wait node was created one call early (by ``prefetch``, or
    ``sequence``), unit ``i``'s reduce-scatter runs during unit ``i-1``'s backward; and the
    all-gather of the next unit (forward) or of the previous unit (backward) is issued before
    this unit's compute.
    """

    @staticmethod
    def forward(call: Call, *pieces: torch.Tensor) -> tuple[torch.Tensor, ...]:
        call.where = where(pieces, call.named)  # here unwrapped from any transform
        if call.block.into is not None and call.sink is None:
            call.sink = sink_buckets(call, pieces)
        return tuple(p.view_as(p) for p in pieces)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.call = inputs[0]

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        call = ctx.call
        buffers = transfers.take_gradient(call)
        if buffers is None:  # the unit's backward did not run: no gradient
            return (None, *(torch.zeros_like(g) for g in grads))
        if call.sink is not None:  # added into the MainGrad; the shards' gradient is zero
            units = units_of(call.block.into)
            units.add(call.sink, buffers, by=f"the unit {call.block.name} on {call.where}")
            units.done(call.sink)  # its deferred reduction may start now
            zeros = lambda g: torch.zeros((), dtype=g.dtype, device=g.device).expand(g.shape)  # noqa: E731
            return (None, *map(zeros, grads))
        return (None, *call.plan.unpack(buffers, "gradient", call.block.reduce_dtype))

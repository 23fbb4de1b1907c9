"""Layer-wise HSDP: a unit's weights all-gathered inside the loss, its gradient reduce-scattered
during backward (FSDP2's memory, in a ``torch.func`` loop).

``gathered(fn, spec)(unit_shards, *args) == fn(gather(unit_shards, spec), *args)``, and it is
differentiable under ``torch.func.grad``/``vjp``/``grad_and_value`` and plain autograd: the
gradient with respect to ``unit_shards`` is the unit's gradient *at the gradient placement*
(reduce-scattered over the non-deferred axes; the deferred axes stay Partial). JAX's rule is
the picture: the transpose of an all-gather is a reduce-scatter.

How (one ``torch.autograd.Function`` per unit call, functorch style: ``setup_context``, and a
backward that is ``once_differentiable``, so its collectives see plain tensors):

- **forward** all-gathers the unit (parameter placement -> Replicate) through the engine (in
  ``mp_policy.param_dtype`` when one is given: the shards are cast before the all-gather, so
  the wire and the compute are in it), waits, and runs ``fn``:

  - ``recompute=False`` (the default, FSDP2 without activation checkpointing): ``fn`` runs
    under ``torch.func.vjp`` on the Function's plain tensors and the closure, which holds
    the unit's activations, is kept on the call record until backward. The gathered
    weights' storage is released (``untyped_storage().resize_(0)``) once the next unit
    starts, while the graph keeps its tensors; backward re-gathers into that same storage
    (the copy runs with functorch disabled and the version counter preserved, since the
    graph saved those tensors) and runs no second forward.
  - ``recompute=True`` (per-unit activation checkpointing): ``fn`` runs without recording a
    graph; only the shards and the arguments are saved, and backward re-gathers the unit and
    recomputes ``fn`` under ``torch.func.vjp``: less memory, one more forward per unit. The
    recompute draws forward's random numbers and runs under forward's autocast state (as
    ``torch.utils.checkpoint``), both kept on the call record.

  ``reshard_after_forward=False`` keeps the gathered weights from forward to backward instead
  (no re-gather). The forward's last unit keeps them either way: its backward comes next.
- **backward** issues the reduce-scatter of the weight gradient asynchronously, in
  ``mp_policy.reduce_dtype`` (default: the compute dtype).
- A second Function, an identity on the unit's shards applied just before the unit, is the one
  consumer of that pending gradient: its backward waits for the reduce-scatter and hands on a
  finished tensor. So nothing (a tied weight's sum, a cast's backward, a second ``.backward()``)
  can read a gradient still in flight, whatever order the autograd engine picks.

Only floating arguments that require a gradient (tracked by autograd or by the ``torch.func``
transform being run) are differentiated: rotary tables, masks and other constants are not.

Overlap comes from the engine's order: it runs the most recently created ready node first, so
when a unit's wait node was created one call early (by :meth:`Gathered.prefetch`, or
:func:`sequence`), unit ``i``'s reduce-scatter runs during unit ``i-1``'s backward; and the
all-gather of the next unit (forward) or of the previous unit (backward) is issued before this
unit's compute. A prefetch declared on one block is used by whichever block runs those shards
next (an embedding block prefetching the first layer, the last layer the head), as long as it
gathers them the same way (spec, ``into``, ``param_dtype``); else it is released unused.

That is the first-order path (``grad``, ``vjp``, ``grad_and_value``, plain autograd). Under
``vmap``, forward mode or a second derivative, a unit takes the composable path instead
(:meth:`Gathered._composable`: the differentiable moves of :mod:`functional_hsdp.autodiff`),
which keeps the gathered weights in the graph and adds into no ``MainGrad``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import optree
import torch
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import get_device_states, set_device_states

from . import engine, validate
from .autodiff import Move, collecting_norms, move
from .cache import register
from .lookup import find_layout
from .maingrad import MainGrad
from .plan import Plan
from .precision import Precision, check_mp_policy
from .spec import Spec
from .tags import state_of
from .tree import flatten

__all__ = ["Gathered", "gathered", "per_rank", "sequence"]


@dataclass(eq=False)
class _Chain:
    """The unit calls of one forward pass, until its backward ends: what they share.

    Every call record points to its chain, so that a backward run on another thread than its
    forward (autograd runs CUDA backward on its device threads) finds what the forward left:
    nothing a forward and its backward share is kept per thread.
    """

    last: Any = None  # weak reference to the last unit called (backward prefetch)
    # (weak reference to the call, its full weights): the last unit of a forward keeps them,
    # since its backward comes next (FSDP2 does not reshard its root either); the next unit's
    # forward drops them. The call weakly: a forward whose backward never comes (its output
    # dropped) would else keep its record, and through it its block, MainGrad and shards,
    # until this thread's next forward; only the weights stay until then
    kept: tuple | None = None
    ahead: list = field(default_factory=list)  # calls with an all-gather issued ahead
    reducing: list = field(default_factory=list)  # calls whose reduce-scatter was issued
    closing: bool = False  # an end-of-backward callback is queued
    task: int = -1  # the backward (autograd graph task) it is queued on
    closed: bool = False  # a backward ended: the next forward starts a new chain


@dataclass(eq=False)
class _Call:
    """One call of a gathered unit: what forward and backward share."""

    block: Gathered
    plan: Plan
    treedef: Any  # of the unit's shards
    k: int  # shard leaves
    args: list  # the call's argument leaves, tensors replaced by None (they are inputs)
    args_def: Any
    tensors: list[int]  # positions in ``args`` of the tensor leaves, passed as inputs
    diff: list[bool]  # per tensor leaf: differentiated (floating) or a constant (ints)
    chain: _Chain | None = None  # the forward pass this call is part of
    nxt: _Call | None = None  # the next unit to prefetch (its all-gather, its wait node)
    prev: Any = None  # weak reference to the unit called before this one (backward prefetch)
    pieces: tuple = ()  # the unit's shards as forward saw them (plain tensors, detached)
    full: list | None = None  # gathered weights kept for backward (reshard_after_forward=False)
    out_def: Any = None
    pending: list | None = None  # the gradient's reduce-scatter in flight
    waited: list | None = None  # its result, waited before its wait node ran (_settle)
    sink: list[int] | None = None  # into=MainGrad: its buckets of this unit
    ahead: dict = field(default_factory=dict)  # "forward"/"backward": all-gather in flight
    wanted: bool = True  # the shards are tracked: their gradient is asked for
    graph: bool = False  # recompute=False and a gradient is asked for: keep forward's graph
    replay: bool = False  # recompute=True and a gradient is asked for: fn runs again
    vjp: Any = None  # recompute=False: forward's torch.func.vjp closure, until backward
    weights: list | None = None  # recompute=False: the gathered weights that graph holds
    freed: tuple | None = None  # their storages released after forward: (storages, leaves)
    kept_storages: frozenset = frozenset()  # of outputs that are gathered weights: never freed
    rng: tuple | None = None  # recompute: the RNG states forward ran with (dropout alike)
    autocast: tuple = ()  # recompute: the autocast state forward ran under (_autocast_state)
    # the validation mode the call read in forward, for its collectives in backward too (which
    # may run on another thread, that does not see the caller's context)
    mode: str = "on"
    where: str = ""  # the shards' place in the tree they were sharded from, for messages


class _Forward(threading.local):
    """What a thread's forward passes keep between unit calls, and only there (backward
    never reads it): the chain they extend, and wait nodes made ahead by ``prefetch``."""

    def __init__(self) -> None:
        self.chain: _Chain | None = None
        self.prepared: dict[tuple[int, ...], tuple[_Call, list, list]] = {}
        self.resharded: Any = None  # weak reference to the composable path's last unit

    def cache_clear(self) -> None:
        """For :func:`~functional_hsdp.clear_caches`: forget what this thread's forwards keep
        (another thread's is its own): the last chain, whose last unit keeps its gathered
        weights for its backward (re-gathered there if it comes), and the wait nodes made
        ahead and never called, which hold their shards (their all-gathers released)."""
        chain, self.chain, self.resharded = self.chain, None, None
        if chain is not None:
            _drop_kept(chain)
        prepared, self.prepared = self.prepared, {}
        for call, _, _ in prepared.values():
            _release_ahead(call)


_FORWARD = _Forward()
register(_FORWARD)  # clear_caches forgets this thread's

#: Wait nodes made ahead (``prefetch``) and never called that a thread keeps, at most
_PREPARED = 4


def _chain() -> _Chain:
    """The chain this thread's next unit call joins: a new one after a backward ended."""
    chain = _FORWARD.chain
    if chain is not None and chain.closing and torch._C._current_graph_task_id() != chain.task:
        _abandon(chain)  # its backward raised: the end-of-backward callback never ran
    if chain is None or chain.closed:
        chain = _FORWARD.chain = _Chain()
    return chain


def _issue_ahead(call: _Call, when: str, pieces: Sequence[torch.Tensor]) -> None:
    """Issue ``call``'s all-gather ahead of its use (``when``: its forward or backward)."""
    _release_ahead(call)
    call.ahead[when] = _gather_start(call, pieces)
    if call.chain is not None:
        call.chain.ahead.append(weakref.ref(call))


def _release_ahead(call: _Call) -> None:
    """Release the all-gathers issued ahead for ``call`` and not used (every rank issued
    them alike, so they complete; nothing of theirs stays in flight or held)."""
    for pending in call.ahead.values():
        engine.release(call.plan, pending)
    call.ahead.clear()


def _gather_start(call: _Call, pieces: Sequence[torch.Tensor]) -> list:
    if call.mode == "strict":
        _agree_before(call, "all-gather")
    plan, dtype = call.plan, call.block.param_dtype
    pack = lambda b: plan.pack(b, list(pieces), "parameter", dtype)  # noqa: E731
    return engine.start(plan, pack, [("parameter", "full")])


def _gathered(call: _Call, when: str, pieces: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The unit's full weights: its all-gather issued ahead, or one issued now."""
    pending = call.ahead.pop(when, None)
    if pending is None:
        pending = _gather_start(call, pieces)
    full, _ = engine.finish(call.plan, pending, "full", call.block.param_dtype)
    return full


def _run(call: _Call, full: list, args: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``fn`` on full weights and the tensor argument leaves, its outputs flattened (the
    mixed-precision casts of inputs and outputs included, so that a vjp runs through them)."""
    block = call.block
    leaves = list(call.args)
    cast = block.param_dtype if block.cast_inputs else None
    for i, x in zip(call.tensors, args):
        leaves[i] = x.to(cast) if cast is not None and x.is_floating_point() else x
    fn_args, fn_kwargs = optree.tree_unflatten(call.args_def, leaves)
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


def _vjp(call: _Call, full: list, args: Sequence[torch.Tensor]) -> tuple[tuple, Callable]:
    """``fn``'s outputs and its ``torch.func.vjp`` closure, with respect to the weights (if
    their gradient is asked for) and the differentiated arguments, in that order."""

    def f(weights: list, *floating: torch.Tensor) -> tuple[torch.Tensor, ...]:
        it = iter(floating)
        return _run(call, weights, [next(it) if d else x for x, d in zip(args, call.diff)])

    floats = [x for x, d in zip(args, call.diff) if d]
    if call.wanted:
        return torch.func.vjp(f, full, *floats)
    return torch.func.vjp(functools.partial(f, full), *floats)


def _release(weights: Sequence[torch.Tensor], keep: set) -> tuple[list, list]:
    """Release the storage of ``weights`` (the tensors stay, with no memory), but for
    storage whose data pointer is in ``keep`` (shared with an input or an output). Returns
    ``(released storages with their sizes, indices of the weights released)``, for
    :func:`_refill`."""
    storages: dict[int, Any] = {}
    leaves = []
    for i, w in enumerate(weights):
        storage = w.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in keep or not storage.nbytes():
            continue
        storages.setdefault(ptr, (storage, storage.nbytes()))
        leaves.append(i)
    with torch._C._DisableFuncTorch(), torch.no_grad():
        for storage, _ in storages.values():
            storage.resize_(0)
    return list(storages.values()), leaves


def _refill(released: tuple[list, list], weights: Sequence[torch.Tensor], new: list) -> None:
    """Give :func:`_release`'s storages their memory back and copy ``new`` into the weights
    it released. A graph saved these tensors, so the copy keeps their version counter; it
    runs with functorch off (the tensors are the library's own, not values of the transform
    being run)."""
    storages, leaves = released
    with torch._C._DisableFuncTorch(), torch.no_grad():
        for storage, nbytes in storages:
            storage.resize_(nbytes)
        for i in leaves:
            old = weights[i]
            with torch.autograd._unsafe_preserve_version_counter(old):
                old.copy_(new[i])


def _free(call: _Call) -> None:
    """recompute=False: release the gathered weights that forward's graph holds, once the
    unit is not the forward's last one; backward re-gathers into them (:func:`_regrow`)."""
    if call.vjp is None or call.freed is not None or not call.block.reshard_after_forward:
        return
    keep = {p.untyped_storage().data_ptr() for p in call.pieces} | call.kept_storages
    call.freed = _release(call.weights, keep)


def _regrow(call: _Call) -> None:
    """Re-gather the weights :func:`_free` released into their own storage, so that the
    graph forward kept reads them."""
    pending = call.ahead.pop("backward", None)
    if pending is None:
        pending = _gather_start(call, call.pieces)
    new, _ = engine.finish(call.plan, pending, "full", call.block.param_dtype)
    released, call.freed = call.freed, None
    _refill(released, call.weights, new)


def _rng_states(full: list, args: Sequence[Any]) -> tuple:
    """The CPU and device RNG states now (what torch.utils.checkpoint saves), so that a
    recomputed unit draws the same random numbers (dropout) as its forward did."""
    tensors = [*full, *args]
    # one tensor per device: torch reads a device's generator once per tensor it is given
    ones = {t.device: t for t in tensors if t.device.type not in ("cpu", "meta")}
    devices, states = get_device_states(*ones.values())
    device = next((d.type for d in ones), None)
    return torch.get_rng_state(), devices, states, device


def _autocast_state(tensors: Sequence[torch.Tensor]) -> tuple[tuple[str, dict], ...]:
    """The autocast state now, for the CPU and each device type of ``tensors`` (what
    torch.utils.checkpoint saves): ``(device_type, torch.autocast's keyword arguments)``
    pairs, so that a recomputed unit runs in the dtypes its forward ran in."""
    cache, on = torch.is_autocast_cache_enabled(), torch.is_autocast_enabled
    kinds = dict.fromkeys(["cpu", *(t.device.type for t in tensors)])
    return tuple(
        (kind, dict(enabled=on(kind), dtype=torch.get_autocast_dtype(kind), cache_enabled=cache))
        for kind in kinds
        if torch.amp.is_autocast_available(kind)  # not "meta", say: it has no autocast
    )


@contextlib.contextmanager
def _replaying(rng: tuple | None, autocast: tuple) -> Iterator[None]:
    """Run the block as its forward ran: with the RNG states ``rng`` (the caller's states
    restored after it) and under the autocast state ``autocast`` (:func:`_autocast_state`),
    on or off whatever autocast region the backward was called in. Around the recompute
    only: ``fn``'s own backward runs, as with ``recompute=False``, in the backward's state."""
    with contextlib.ExitStack() as stack:
        for kind, kwargs in autocast:
            stack.enter_context(torch.autocast(kind, **kwargs))
        if rng is not None:
            cpu, devices, states, device = rng
            kwargs = {"device_type": device} if device is not None else {}
            stack.enter_context(torch.random.fork_rng(devices=devices, **kwargs))
            torch.set_rng_state(cpu)
            if devices:
                set_device_states(devices, states, **kwargs)
        yield


def _outputs(call: _Call, outs: tuple, full: list, args: tuple) -> tuple[torch.Tensor, ...]:
    """The unit's outputs as its Function returns them. One that is an argument (or a view
    of one) would alias it: a copy. The gathered weights returned as they are (an identity
    unit) are the call's own, and their memory is then never released. The others are
    returned detached (the same memory): autograd gives its node to the tensor returned, and
    one the record keeps (a gathered weight, an output held by forward's vjp closure) would
    then point back to the record: a cycle through autograd's nodes, which the garbage
    collector cannot see, keeping a graph whose backward never comes alive for good."""
    weights = [o for o in outs if _is_weight(o, full)]
    call.kept_storages = frozenset(o.untyped_storage().data_ptr() for o in weights)
    copied = [
        (o._base is not None or any(o is a for a in args)) and not any(o is w for w in weights)
        for o in outs
    ]
    return tuple(o.clone() if copy else o.detach() for o, copy in zip(outs, copied))


def _regathers(call: _Call) -> bool:
    """Whether ``call``'s backward needs its weights all-gathered again."""
    if call.vjp is not None:
        return call.freed is not None
    return call.block.reshard_after_forward


def _is_weight(x: torch.Tensor, full: list) -> bool:
    """Whether ``x`` is one of the gathered weights, returned as it is (an identity unit)."""
    return any(
        x.data_ptr() == w.data_ptr() and x.shape == w.shape and x.stride() == w.stride()
        for w in full
    )


class _Unit(torch.autograd.Function):
    """fn(gather(shards), *args): gather in forward, (recompute +) reduce-scatter in backward."""

    @staticmethod
    def forward(call: _Call, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = call.k + len(call.tensors)
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
        _drop_kept(chain)  # the unit before keeps its weights no longer
        full = _gathered(call, "forward", pieces)
        if call.nxt is not None:  # the next unit's all-gather overlaps this unit's compute
            call.nxt.pieces = tuple(p.detach() for p in nxt)
            call.nxt.chain, call.nxt.mode = chain, call.mode
            _issue_ahead(call.nxt, "forward", nxt)
        call.prev, chain.last = chain.last, weakref.ref(call)
        try:
            if call.graph:  # the unit's graph is built now and kept until backward
                outs, call.vjp = _vjp(call, full, args)
                call.weights = full
            else:
                if call.replay:  # backward runs fn again: with the same random numbers,
                    # in the same dtypes (kept here, not per thread: backward may run on another)
                    call.rng = _rng_states(full, args)
                    call.autocast = _autocast_state([*full, *args])
                with torch.no_grad():
                    outs = _run(call, full, args)
        except BaseException:
            if call.nxt is not None:  # its call will not come (not from this forward)
                _release_ahead(call.nxt)
            _abandon(chain)
            raise
        if not call.block.reshard_after_forward:
            call.full = full
        chain.kept = (weakref.ref(call), full)
        return _outputs(call, outs, full, args)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        call = inputs[0]
        ctx.call = call
        n = 1 + call.k + len(call.tensors)
        if call.vjp is None:  # recompute: the arguments (the shards are on call)
            ctx.save_for_backward(*inputs[1 + call.k : n])
        ctx.n_extra = len(inputs) - n  # the next unit's shards ride along, not differentiated

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        call = ctx.call
        chain = call.chain
        _end_of_backward_callback(chain)
        prev, call.prev = (call.prev() if call.prev is not None else None), None
        if prev is not None and _regathers(prev) and not prev.ahead:
            _issue_ahead(prev, "backward", prev.pieces)  # backward prefetch
        kept, chain.kept = chain.kept, None
        # the shards' gradient is wanted (a grad with respect to the inputs only is not)
        wanted = any(ctx.needs_input_grad[1 : 1 + call.k])
        if call.graph and call.vjp is None:  # released by an earlier backward
            raise RuntimeError(
                f"gathered({call.block.name}): a second backward through the same forward "
                "(retain_graph=True) needs recompute=True: with recompute=False the unit's "
                "graph is released by the first backward, as its activations are"
            )
        if call.vjp is not None:  # forward's graph: the weights back into it, no recompute
            if call.freed is not None:
                _regrow(call)
            vjp, call.vjp = call.vjp, None
            has_weights = call.wanted
        else:
            if call.full is not None:
                full = call.full
            elif kept is not None and kept[0]() is call:  # the forward's last unit: gathered
                full = kept[1]
            else:
                full = _gathered(call, "backward", call.pieces)
            call.wanted = has_weights = wanted
            with _replaying(call.rng, call.autocast):
                _, vjp = _vjp(call, full, ctx.saved_tensors)
            del full
        call.full = call.weights = None
        # the graph is used once: each node frees its saved tensors as soon as it has run
        results = list(vjp(tuple(grads), retain_graph=False))
        del vjp
        weight_grads = results.pop(0) if has_weights else None
        it = iter(results)
        arg_grads = [next(it) if d else None for d in call.diff]
        if not wanted:
            return (
                None,
                *(None for _ in call.pieces),
                *arg_grads,
                *(None for _ in range(ctx.n_extra)),
            )
        # the unit before's reduce-scatter ran during this unit's backward: waited now, before
        # this one packs, so that one gradient-sized buffer is in flight at a time (as FSDP2)
        _settle(chain)
        if call.mode == "strict":
            _agree_before(call, "reduce-scatter")
        plan, dtype = call.plan, call.block.reduce_dtype
        pack = lambda b: plan.pack(b, weight_grads, "input", dtype)  # noqa: E731
        call.pending = engine.start(plan, pack, [("input", "gradient")], wire=dtype)
        chain.reducing.append(weakref.ref(call))  # released at the end if never waited
        # the shards' gradient is handed on by the wait node, once the reduce-scatter is done
        dummies = [
            torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape) for p in call.pieces
        ]
        return (None, *dummies, *arg_grads, *(None for _ in range(ctx.n_extra)))


class _Wait(torch.autograd.Function):
    """Identity on a unit's shards; backward: wait for the unit's reduce-scatter, hand it on."""

    @staticmethod
    def forward(call: _Call, *pieces: torch.Tensor) -> tuple[torch.Tensor, ...]:
        call.where = _where(pieces, call.where)  # here unwrapped from any transform
        if call.block.into is not None and call.sink is None:
            call.sink = _sink_buckets(call, pieces)
        return tuple(p.view_as(p) for p in pieces)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.call = inputs[0]

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        call = ctx.call
        pending, call.pending = call.pending, None
        waited, call.waited = call.waited, None
        if waited is None and pending is None:  # the unit's backward did not run: no gradient
            return (None, *(torch.zeros_like(g) for g in grads))
        if waited is None:
            waited = engine.wait(call.plan, pending)
        if call.sink is not None:  # added into the MainGrad; the shards' gradient is zero
            mg = call.block.into
            mg.add_chunks(call.sink, waited)
            mg.unit_done(call.sink)  # its deferred reduction may start now
            zeros = lambda g: torch.zeros((), dtype=g.dtype, device=g.device).expand(g.shape)  # noqa: E731
            return (None, *map(zeros, grads))
        return (None, *call.plan.unpack(waited, "gradient", call.block.reduce_dtype))


def _settle(chain: _Chain) -> None:
    """Wait for the reduce-scatters of ``chain`` still in flight and keep their results
    (shard-sized, the call's own) for their wait nodes, so that their gradient-sized
    inputs are freed now. Nothing is handed on here: a wait node that never runs (a
    gradient not asked for) still gives nothing to a MainGrad."""
    for ref in chain.reducing:
        call = ref()
        if call is not None and call.pending is not None:
            pending, call.pending = call.pending, None
            call.waited = engine.wait(call.plan, pending)


def _abandon(chain: _Chain) -> None:
    """A forward or backward that raised: close ``chain`` now, so that the next forward
    starts a new one, and release what it held (the last unit's weights, the all-gathers
    issued ahead, the reduce-scatters in flight)."""
    _drop_kept(chain)
    chain.last, chain.closed, chain.closing = None, True, False
    _release_in_flight(chain)


def _drop_kept(chain: _Chain) -> None:
    """The last unit of ``chain`` keeps its gathered weights no longer: released now (a
    call record gone took its weights with it)."""
    kept, chain.kept = chain.kept, None
    call = kept[0]() if kept is not None else None
    if call is not None:
        _free(call)


def _release_in_flight(chain: _Chain) -> None:
    """Release what ``chain`` still has in flight and will not use: all-gathers issued ahead
    and reduce-scatters whose wait node never ran (every rank issued them alike)."""
    calls, chain.ahead = chain.ahead, []
    for ref in calls:
        call = ref()
        if call is not None:
            _release_ahead(call)
    reducing, chain.reducing = chain.reducing, []
    for ref in reducing:
        call = ref()
        if call is not None and call.pending is not None:
            pending, call.pending = call.pending, None
            engine.release(call.plan, pending)


def start_forward() -> None:
    """Begin a new forward pass on this thread: the unit calls from here on are one chain
    (what a model-level call, ``functional_call``, knows and a unit alone does not). A
    previous chain whose backward has not started is left to it, its last unit no longer
    kept."""
    chain = _FORWARD.chain
    if chain is not None and not chain.closed and not chain.closing:
        _drop_kept(chain)
    _FORWARD.chain = _Chain()


def _end_of_backward_callback(chain: _Chain) -> None:
    """At the end of this backward: close ``chain`` (the next forward starts a new one),
    drop what its last unit kept, and release prefetches never used."""
    if chain.closing:
        return
    chain.closing, chain.task = True, torch._C._current_graph_task_id()

    def done() -> None:
        chain.closing, chain.closed, chain.last, chain.kept = False, True, None, None
        # prefetches never used; a reduce-scatter whose wait node did not run (autograd.grad
        # asked for other inputs)
        _release_in_flight(chain)

    torch.autograd.Variable._execution_engine.queue_callback(done)


class Gathered:
    """A function of one unit's full weights, called with the unit's local shards.

    Made by :func:`gathered`; see there. Calling it all-gathers the unit inside forward and
    reduce-scatters its gradient inside backward.
    """

    def __init__(
        self,
        fn: Callable,
        spec: Spec,
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
        precision = Precision.of(mp_policy)  # see functional_hsdp.precision
        self.param_dtype, self.reduce_dtype = precision.param_dtype, precision.reduce_dtype
        self.output_dtype, self.cast_inputs = precision.output_dtype, precision.cast_inputs
        self.name = name or getattr(fn, "__name__", repr(fn))
        #: how errors name the shards (``functional_call``'s units: ``shards['layers.0']``)
        self.shards_path = "shards"
        self._next: tuple | None = None
        self._described: dict = {}  # (plan, where) -> _describe's texts

    def __repr__(self) -> str:
        return f"gathered({self.name}, {self.spec!r})"

    def prefetch(self, shards: Any) -> None:
        """Declare ``shards`` the unit that runs after the next call: that call issues its
        all-gather before computing (forward) and makes its wait node first, so that its
        reduce-scatter overlaps the backward of the unit before it."""
        self._prefetch(shards, "shards")

    def _prefetch(self, shards: Any, name: str) -> None:
        """:meth:`prefetch`, errors naming the shards ``name`` (``functional_call``: the
        next unit's own path)."""
        if not _composed():  # the composable path gathers each unit when it is called
            self._next = _prepare(self, shards, name)

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
        if _composed():
            return self._composable(shards, args, kwargs)
        call, wrapped = self._prepared(shards)
        call.chain = _chain()
        # read here, in the caller's context, and carried on the record into backward
        call.mode = validate.current_mode()
        if call.mode != "off":  # the step's running fingerprint, agreed where it exchanges
            validate.unit_log(self.spec.mesh).record(*_describe(self, call))
        if call.sink is not None:  # its backward's gradient is one more for the MainGrad
            self.into.unit_called(call.sink, self.name)
        nxt, self._next = self._next, None
        arg_leaves, args_def = optree.tree_flatten((args, kwargs))
        tensors = [i for i, x in enumerate(arg_leaves) if isinstance(x, torch.Tensor)]
        call.args = [None if i in tensors else x for i, x in enumerate(arg_leaves)]
        call.args_def, call.tensors = args_def, tensors
        call.diff = [_differentiable(arg_leaves[i]) for i in tensors]
        call.wanted = any(w.requires_grad for w in wrapped)
        needed = torch.is_grad_enabled() and (call.wanted or any(call.diff))
        call.graph, call.replay = needed and not self.recompute, needed and self.recompute
        extra = []
        if nxt is not None:  # the next unit's shards ride along so forward can gather them
            call.nxt, extra = nxt
        # every tensor argument is an input (so forward sees it unwrapped from any transform);
        # only floating ones get gradients
        outs = _Unit.apply(call, *wrapped, *(arg_leaves[i] for i in tensors), *extra)
        return optree.tree_unflatten(call.out_def, list(outs[: call.out_def.num_leaves]))

    def _composable(self, shards: Any, args: tuple, kwargs: dict) -> Any:
        """``fn`` on the unit all-gathered by a differentiable move (its backward a
        differentiable reduce-scatter, its jvp the all-gather of the tangent, its vmap one
        collective for the batch). No recompute, no prefetch; under vmap of one gradient
        level the gathered weights are released between forward and backward
        (:class:`_Resharded`), else they stay in the graph."""
        nxt, self._next = self._next, None
        if nxt is not None:
            _release_ahead(nxt[0])
        if self.into is not None:
            raise NotImplementedError(
                f"gathered({self.name}, into=...): under vmap, jvp or a second derivative "
                "the unit's gradients are returned, not added into a MainGrad (per-sample "
                "or higher-order gradients have no MainGrad buffer): leave into=None and "
                "reduce them with fh.reduce_grads(..., at='gradient')"
            )
        leaves, treedef, paths = flatten(shards, "shards")
        if not leaves:
            raise ValueError(f"gathered: {self.name}'s shards are an empty tree")
        plan, _ = find_layout(
            leaves, treedef, paths, self.spec, None, ("parameter",), ("final", "weights"), "shards"
        )
        record: list = []
        how = Move(
            plan,
            "parameter",
            "full",
            dtype=self.param_dtype,
            grad_dtype=self.reduce_dtype,
            record=record,
            norms=collecting_norms(),
        )
        # the unit before gives its gathered weights' memory back now (per-sample gradients)
        previous, _FORWARD.resharded = _FORWARD.resharded, None
        previous = previous() if previous is not None else None
        if previous is not None:
            previous.free()
        full = optree.tree_unflatten(treedef, move(how, leaves))
        cast = self.param_dtype if self.cast_inputs else None
        if cast is not None:
            args, kwargs = optree.tree_map(
                lambda x: x.to(cast) if _floating(x) else x, (args, kwargs)
            )
        out = self.fn(full, *args, **kwargs)
        if self.output_dtype is not None:
            out = optree.tree_map(lambda x: x.to(self.output_dtype) if _floating(x) else x, out)
        if self.reshard_after_forward and record and _per_sample_only():
            resharded = _Resharded(replace(how, record=None), *record[0])
            _FORWARD.resharded = weakref.ref(resharded)  # the graph keeps it, not the thread
            # once the unit's backward is over, released again: torch.func keeps the graph
            # (and the tensors it saved) until its whole backward ends
            record.append(resharded.free)
            out = optree.tree_map(lambda x: _Regrow.apply(resharded, x) if _floating(x) else x, out)
        return out

    def _prepared(self, shards: Any) -> tuple[_Call, list]:
        """This call's record and its shards through their wait node (made ahead, or now)."""
        leaves = optree.tree_leaves(shards)
        found = _FORWARD.prepared.pop(tuple(map(id, leaves)), None)
        if found is not None and _adopts(self, found[0].block):
            found[0].block = self  # prefetched by another block, gathered as this one would
            return found[0], found[2]
        if found is not None:  # made ahead for a block that gathers otherwise
            _release_ahead(found[0])
        call, wrapped = _prepare(self, shards, self.shards_path)
        del _FORWARD.prepared[tuple(map(id, leaves))]
        return call, wrapped


def _adopts(block: Gathered, other: Gathered) -> bool:
    """Whether ``block`` can use a call record ``other`` made ahead (its all-gather, its wait
    node and the MainGrad buckets it adds into are the same)."""
    return other is block or (
        other.spec == block.spec
        and other.into is block.into
        and other.param_dtype == block.param_dtype
    )


def _prepare(block: Gathered, shards: Any, name: str) -> tuple[_Call, list]:
    """A call record for ``shards`` and its wait node, made now (so, before the unit that runs
    first): the engine then runs that unit's backward before this wait."""
    leaves, treedef, paths = flatten(shards, name)
    if not leaves:
        raise ValueError(f"gathered: {block.name}'s shards are an empty tree")
    plan, _ = find_layout(
        leaves, treedef, paths, block.spec, None, ("parameter",), ("final", "weights"), name
    )
    call = _Call(block, plan, treedef, len(leaves), [], None, [], [])
    call.where = paths[0] if paths else name  # until its wait node finds the shards' tags
    wrapped = list(_Wait.apply(call, *leaves))
    prepared = _FORWARD.prepared
    key = tuple(map(id, leaves))
    if key in prepared:  # made ahead again before being called: the older one is unused
        _release_ahead(prepared.pop(key)[0])
    while len(prepared) >= _PREPARED:  # prepared but never called: forget the oldest
        _release_ahead(prepared.pop(next(iter(prepared)))[0])
    prepared[key] = (call, leaves, wrapped)
    return call, wrapped


def _sink_buckets(call: _Call, pieces: Sequence[torch.Tensor]) -> list[int]:
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
    buckets = mg.buckets_of(made.units[found[1]])
    ours = [(b.padded, b.numel) for b in call.plan.buckets]
    if [(mg.plan.buckets[b].padded, mg.plan.buckets[b].numel) for b in buckets] != ours:
        raise ValueError(
            f"gathered({name}, into={mg!r}): the shards' unit is bucketed unlike the "
            "MainGrad's (another bucket_cap_mb or dtype split?)"
        )
    return buckets


def _check_one_unit(call: _Call, pieces: Sequence[torch.Tensor], found: tuple) -> None:
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


def _where(pieces: Sequence[torch.Tensor], named: str) -> str:
    """Where a unit's shards are: the path of its first leaf in the tree ``fh.shard`` made
    (which tells apart the layers one block runs), else ``named`` (as the caller named it)."""
    found = state_of(pieces[0])
    if found is not None and found[1] < len(getattr(found[0].plan, "slot_of", ())):
        return f"{found[0].plan.slot_of[found[1]].path}"
    return named


def _describe(block: Gathered, call: _Call) -> tuple[str, str]:
    """The unit a call runs and the options its collectives and gradient depend on, as texts
    for the cross-rank checks (made once per block, layout and place)."""
    key = (call.plan, call.where)
    found = block._described.get(key)
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
        found = block._described[key] = (f"{block.name} on {call.where}", "; ".join(options))
    return found


def _agree_before(call: _Call, collective: str) -> None:
    """validation("strict"): every rank agrees on this unit collective before issuing it, so
    that a unit skipped or gathered otherwise on one rank raises on every rank instead of
    meeting another rank's collective (a crash or a hang)."""
    block = call.block
    unit, options = _describe(block, call)
    what = f"gathered: {collective} of {unit}"
    paths = [f"{call.where}[{i}]" for i in range(call.k)]
    try:  # in a backward under torch.func: the rows are the library's own plain tensors
        with torch._C._DisableFuncTorch(), torch.no_grad():
            with validate.agreement_in_mode(block.spec, what, "strict") as agreed:
                agreed.check(call.plan, paths, options=tuple(options.split("; ")))
    except ValueError as exc:
        raise ValueError(
            f"gathered({block.name}) on {call.where}, before its {collective} "
            f"(validation('strict')): the ranks differ: {exc}"
        ) from None


class _Resharded:
    """A unit's gathered weights on the composable path, released between its forward and
    its backward (as the first-order path does) when only vmap and one gradient level are
    at work: per-sample gradients, DP-SGD's norms. The first gradient to reach the unit's
    outputs (:class:`_Regrow`) gathers them again, into their own memory."""

    def __init__(self, how: Move, inputs: list, outputs: list):
        self.how, self.inputs, self.outputs = how, inputs, outputs
        self.freed: tuple | None = None  # what _release returned, until regrown

    def free(self) -> None:
        if self.freed is None:
            self.freed = _release(
                self.outputs, {x.untyped_storage().data_ptr() for x in self.inputs}
            )

    def regrow(self) -> None:
        released, self.freed = self.freed, None
        if released is not None and released[1]:
            _refill(released, self.outputs, self.how.run(self.inputs))


class _Regrow(torch.autograd.Function):
    """Identity on a unit's output; backward: the unit's released weights gathered again
    before the unit's own backward reads them."""

    generate_vmap_rule = True

    @staticmethod
    def forward(resharded: _Resharded, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.resharded = inputs[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        if ctx.resharded.freed is not None:
            ctx.resharded.regrow()
        return None, grad


def _per_sample_only() -> bool:
    """Whether only vmap and one level of reverse mode are at work (per-sample gradients):
    then the composable path can release a unit's weights between forward and backward."""
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    kinds = [i.key() for i in retrieve_all_functorch_interpreters()]
    return (
        kinds.count(TransformType.Grad) == 1
        and all(k in (TransformType.Grad, TransformType.Vmap) for k in kinds)
        and torch.autograd.forward_ad._current_level < 0
    )


def _composed() -> bool:
    """Whether this call runs under a transform the first-order path cannot honour: vmap,
    forward mode (jvp, or a ``torch.autograd.forward_ad`` dual level), or a second level of
    reverse mode (``grad`` of ``grad``, ``vjp`` of ``grad``). Its units then take the
    composable path (:func:`functional_hsdp.autodiff.move`)."""
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    grads = 0
    for interpreter in retrieve_all_functorch_interpreters():
        kind = interpreter.key()
        if kind in (TransformType.Vmap, TransformType.Jvp):
            return True
        grads += kind == TransformType.Grad
    return grads > 1 or torch.autograd.forward_ad._current_level >= 0


def _floating(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _differentiable(x: Any) -> bool:
    """A floating argument that is tracked (by autograd or the transform being run): its
    gradient may be asked for. Constants (rotary tables, masks) are not differentiated."""
    return (
        isinstance(x, torch.Tensor)
        and (x.is_floating_point() or x.is_complex())
        and x.requires_grad
    )


def _check_spec(spec: Any, name: str) -> None:
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
    _check_spec(spec, getattr(fn, "__name__", "fn"))
    if into is not None and not isinstance(into, MainGrad):
        raise TypeError(f"gathered: into must be a MainGrad or None; got {type(into).__name__}")
    if not isinstance(recompute, bool):
        raise TypeError(f"gathered: recompute must be a bool; got {recompute!r}")
    check_mp_policy(mp_policy, f"gathered({getattr(fn, '__name__', 'fn')})")
    return Gathered(fn, spec, reshard_after_forward, into, recompute, mp_policy)


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


def per_rank(fn: Callable, mesh: Any) -> Callable:
    """``fn`` applied to every rank's values: ``vmap`` over the mesh dims of a SimMesh (all
    arguments and results carry them), ``fn`` itself on a DistMesh.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> f = fh.per_rank(lambda w, x: w @ x, fh.SimMesh({"dp": 3}))
        >>> f(torch.ones(3, 2, 2), torch.ones(3, 2)).shape
        torch.Size([3, 2])
    """
    for _ in mesh.batch_shape:
        fn = torch.func.vmap(fn)
    return fn

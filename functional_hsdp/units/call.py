"""One call of a gathered unit: its record, and the phases it goes through.

A record is made with the call's wait node (:func:`~functional_hsdp.units.block.prepare`):
by ``prefetch`` before the unit that runs first, or at the call. Until it is called, a
record made ahead is held by this thread's registry and by the block that declared it; then
it lives in the autograd graph (the ``ctx`` of its two Functions) and goes with it (its
chain refers to it weakly). Invariant: its phase changes only through the transitions of
this module (:class:`Phase` draws them), each of which checks the phase it comes from (a
failed check is a bug of this package, not of the caller, but for the one documented error
of :func:`backward_began`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from ..plan.recipe import Plan

if TYPE_CHECKING:
    from .replay import Replay

# The record is the lowest room of the units: the fields that hold an object of a room above
# it (the block, the chain, the storage and transfer records) are typed ``Any``, their class
# named in the comment, so that no import, not even for annotations, runs upward.

__all__ = ["Arguments", "Call", "Held", "Phase"]


class Phase(enum.Enum):
    """Where a unit call is in its life, and the transitions between phases::

        PREPARED --forward_ran--> RAN --weights_released--> RELEASED --weights_refilled--> RAN
        RAN --backward_began--> BACKWARD --wanted_none--> DONE
                                BACKWARD --reduce_scatter_issued--> REDUCING
        REDUCING --reduce_scatter_waited--> REDUCED --gradient_handed_on--> DONE
        REDUCING --gradient_handed_on--> DONE
        REDUCING --reduce_scatter_abandoned--> ABANDONED

    ``RELEASED`` is reached only with ``recompute=False`` (forward's graph kept, its gathered
    weights' memory given back until backward). With ``recompute=True`` backward may run again
    through a retained graph: ``backward_began`` then also comes from ``BACKWARD``,
    ``REDUCING``, ``REDUCED``, ``DONE`` or ``ABANDONED``.
    """

    PREPARED = "prepared"  # record and wait node made; its all-gather may be issued ahead
    RAN = "ran"  # forward ran; recompute=False: its graph and gathered weights are held
    RELEASED = "released"  # recompute=False: those weights' storage released until backward
    BACKWARD = "backward"  # backward took forward's graph, or recomputed it
    REDUCING = "reducing"  # the gradient's reduce-scatter is in flight
    REDUCED = "reduced"  # it was waited early (a later unit's backward): its result is held
    DONE = "done"  # the wait node handed the gradient on, or backward wanted none
    ABANDONED = "abandoned"  # the backward ended before the wait node ran: released unread


class Arguments(NamedTuple):
    """What a call was given, read once at the call (:meth:`Gathered.__call__`)."""

    args: list  # the argument leaves, tensors replaced by None (they are inputs)
    args_def: Any
    tensors: list[int]  # positions in ``args`` of the tensor leaves, passed as inputs
    diff: list[bool]  # per tensor leaf: differentiated (floating) or a constant (ints)
    wanted: bool  # the shards are tracked: their gradient is asked for
    graph: bool  # recompute=False and a gradient is asked for: keep forward's graph
    replay: bool  # recompute=True and a gradient is asked for: fn runs again in backward


@dataclass(eq=False)
class Held:
    """The gathered weights a call holds from its forward to its backward (storage.py writes
    it; backward drops it before running the unit's vjp)."""

    full: list | None = None  # reshard_after_forward=False: kept whole for backward
    graph: list | None = None  # recompute=False: the gathered weights forward's graph holds
    released: Any = None  # their storage, released (phase RELEASED): a storage.Released
    kept: frozenset = frozenset()  # storages of outputs that are gathered weights: kept


@dataclass(eq=False)
class Call:
    """One call of a gathered unit: what its forward, its backward and its wait node share.

    Each group of fields is written by one module of this package, named in its comment
    (the others only read it); ``phase`` only by this module's transitions.
    """

    # block.py, when the record is made; ``block`` again when another block that gathers
    # alike adopts a record made ahead for it
    block: Any  # the block.Gathered called
    plan: Plan
    treedef: Any  # of the unit's shards
    k: int  # shard leaves
    named: str  # the shards as the caller named them, for messages until ``where`` is known
    phase: Phase = Phase.PREPARED
    # block.py, at the call
    arguments: Arguments | None = None
    nxt: Call | None = None  # the next unit to prefetch (its all-gather, its wait node)
    # chain.py: the forward pass this call is part of, and the validation mode read at the
    # call, for its collectives in backward too (which may run on another thread, that does
    # not see the caller's context)
    chain: Any = None  # its chain.Chain
    mode: str = "on"
    # block.py, at the call: the ghost-norms pass running then (sync.ghost), read in forward
    # on the caller's thread and carried into backward (a recompute registers again)
    ghost: Any = None
    prev: Any = None  # weak reference to the unit called before this one (backward prefetch)
    # functions.py: what the unit's Functions learn
    where: str = ""  # the shards' place in the tree they were sharded from, for messages
    sink: list[int] | None = None  # into=MainGrad: its buckets of this unit
    pieces: tuple = ()  # the unit's shards as forward saw them (plain tensors, detached)
    out_def: Any = None
    vjp: Any = None  # recompute=False: forward's torch.func.vjp closure, until backward
    replay: Replay | None = None  # recompute=True: the RNG and autocast state forward ran in
    # storage.py: the gathered weights held from forward to backward
    held: Held = field(default_factory=Held)
    # transfers.py: what is in flight for this call
    ahead: Any = None  # a transfers.AllGather issued ahead
    reduction: Any = None  # a transfers.ReduceScatter (waited early: phase REDUCED)


# -- transitions ------------------------------------------------------------------------------


def _move(call: Call, to: Phase, sources: tuple[Phase, ...]) -> None:
    if call.phase not in sources:
        raise RuntimeError(
            f"gathered({call.block.name}): a unit call cannot go from {call.phase.name} to "
            f"{to.name} (a bug of functional_hsdp.units)"
        )
    call.phase = to


def forward_ran(call: Call) -> None:
    """The unit's forward returned."""
    _move(call, Phase.RAN, (Phase.PREPARED,))


def weights_released(call: Call) -> None:
    """recompute=False: the gathered weights' storage was given back (another unit began)."""
    _move(call, Phase.RELEASED, (Phase.RAN,))


def weights_refilled(call: Call) -> None:
    """recompute=False: backward gathered the weights into their storage again."""
    _move(call, Phase.RAN, (Phase.RELEASED,))


#: Where a backward may begin: once after forward, again with recompute=True (retain_graph)
_BACKWARD_FROM = {
    "graph": (Phase.RAN,),
    "replay": (
        Phase.RAN,
        Phase.BACKWARD,
        Phase.REDUCING,
        Phase.REDUCED,
        Phase.DONE,
        Phase.ABANDONED,
    ),
}


def backward_began(call: Call) -> None:
    """The unit's backward took forward's graph (recompute=False) or is recomputing it.
    With recompute=False the graph is used once: a second backward through it is refused."""
    graph = call.arguments.graph
    if graph and call.phase is not Phase.RAN:
        raise RuntimeError(
            f"gathered({call.block.name}): a second backward through the same forward "
            "(retain_graph=True) needs recompute=True: with recompute=False the unit's "
            "graph is released by the first backward, as its activations are"
        )
    _move(call, Phase.BACKWARD, _BACKWARD_FROM["graph" if graph else "replay"])


def wanted_none(call: Call) -> None:
    """The backward ran, and no gradient of the shards is asked for: nothing to reduce."""
    _move(call, Phase.DONE, (Phase.BACKWARD,))


def reduce_scatter_issued(call: Call) -> None:
    _move(call, Phase.REDUCING, (Phase.BACKWARD,))


def reduce_scatter_waited(call: Call) -> None:
    """Waited before its wait node ran (a later unit's backward settles it)."""
    _move(call, Phase.REDUCED, (Phase.REDUCING,))


def gradient_handed_on(call: Call) -> None:
    """The wait node took the reduced gradient."""
    _move(call, Phase.DONE, (Phase.REDUCING, Phase.REDUCED))


def reduce_scatter_abandoned(call: Call) -> None:
    """The backward ended before the wait node ran (it asked for other inputs): released."""
    _move(call, Phase.ABANDONED, (Phase.REDUCING,))

"""The storage of a unit's gathered weights between its forward and its backward.

One name per act: *release* gives a storage's memory back (:func:`release_weights`: once the
next unit starts, with ``recompute=False``), *refill* takes it again and copies the weights in
(:func:`refill_weights`: in backward, no second forward), *hold* keeps the weights on the call
for backward (:func:`hold`: ``reshard_after_forward=False`` keeps them whole). The forward's
last unit keeps them either way: its backward comes next (:mod:`~functional_hsdp.units.chain`).

State: none of its own; what a call holds is its ``held`` record (:class:`~.call.Held`),
which goes with the call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from . import call as lifecycle
from . import transfers
from .call import Call, Phase

__all__ = [
    "Released",
    "drop",
    "hold",
    "refill_storage",
    "refill_weights",
    "regathers",
    "release_storage",
    "release_weights",
]


class Released(NamedTuple):
    """Storages :func:`release_storage` released, for :func:`refill_storage`."""

    storages: list  # (storage, its size in bytes), each once
    leaves: list[int]  # indices of the weights whose storage was released


def release_storage(weights: Sequence[torch.Tensor], keep: set) -> Released:
    """Release the storage of ``weights`` (the tensors stay, with no memory), but for
    storage whose data pointer is in ``keep`` (shared with an input or an output)."""
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
    return Released(list(storages.values()), leaves)


def refill_storage(released: Released, weights: Sequence[torch.Tensor], new: list) -> None:
    """Give :func:`release_storage`'s storages their memory back and copy ``new`` into the
    weights it released. A graph saved these tensors, so the copy keeps their version
    counter; it runs with functorch off (the tensors are the library's own, not values of
    the transform being run)."""
    with torch._C._DisableFuncTorch(), torch.no_grad():
        for storage, nbytes in released.storages:
            storage.resize_(nbytes)
        for i in released.leaves:
            old = weights[i]
            with torch.autograd._unsafe_preserve_version_counter(old):
                old.copy_(new[i])


def hold(call: Call, full: list, kept: frozenset) -> None:
    """Forward: keep what backward needs of the gathered weights ``full`` (``kept``: the
    storages of outputs that are gathered weights, never released)."""
    held = call.held
    if call.arguments.graph:
        held.graph = full
    if not call.block.reshard_after_forward:
        held.full = full
    held.kept = kept


def drop(call: Call) -> None:
    """Backward: the call holds its gathered weights no longer (the graph may)."""
    call.held.full = call.held.graph = None


def release_weights(call: Call) -> None:
    """recompute=False: release the gathered weights that forward's graph holds, once the
    unit is not the forward's last one; backward refills them (:func:`refill_weights`).

    With ``recompute=False`` (the default, FSDP2 without activation checkpointing) forward's
    graph holds the gathered weights. Once the next unit starts, their storage is released
    (``untyped_storage().resize_(0)``: the tensors stay, with no memory), while the graph keeps
    its tensors; backward gathers again into that same storage (the copy runs with functorch
    disabled and the version counter preserved, since the graph saved those tensors) and runs
    no second forward. ``reshard_after_forward=False`` keeps the gathered weights whole from
    forward to backward instead (no second all-gather)."""
    if (
        call.phase is not Phase.RAN
        or not call.arguments.graph
        or not call.block.reshard_after_forward
    ):
        return
    keep = {p.untyped_storage().data_ptr() for p in call.pieces} | call.held.kept
    call.held.released = release_storage(call.held.graph, keep)
    lifecycle.weights_released(call)


def refill_weights(call: Call) -> None:
    """Gather the weights :func:`release_weights` released into their own storage again, so
    that the graph forward kept reads them."""
    new = transfers.gather(call, "backward", call.pieces)
    released, call.held.released = call.held.released, None
    refill_storage(released, call.held.graph, new)
    lifecycle.weights_refilled(call)


def regathers(call: Call) -> bool:
    """Whether ``call``'s backward needs its weights all-gathered again."""
    if call.arguments.graph and call.phase in (Phase.RAN, Phase.RELEASED):
        return call.phase is Phase.RELEASED
    return call.block.reshard_after_forward

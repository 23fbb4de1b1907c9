"""Replay for ``recompute=True`` (per-unit activation checkpointing): ``fn`` again, as forward ran.

Backward runs ``fn`` again, and it must run as forward did. So forward captures the RNG states
(dropout draws the same random numbers) and the autocast state (the same dtypes), as
``torch.utils.checkpoint`` does, and the recompute runs under them (:func:`replaying`).

State: none of its own. What forward captured is kept on the call record
(``call.replay``), not per thread: backward may run on another thread (autograd runs CUDA
backward on its device threads).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch.utils.checkpoint import get_device_states, set_device_states

from ..base.autocast import autocast_state, autocasting

__all__ = ["Replay", "autocast_state", "capture", "replaying", "rng_states"]


class Replay(NamedTuple):
    """What a recomputed unit runs under: its forward's RNG states and autocast state."""

    rng: tuple  # rng_states()
    autocast: tuple  # autocast_state()


def capture(full: list, args: Sequence[torch.Tensor]) -> Replay:
    """The state forward runs ``fn`` in, on the gathered weights ``full`` and ``args``."""
    return Replay(rng_states(full, args), autocast_state([*full, *args]))


def rng_states(full: list, args: Sequence[Any]) -> tuple:
    """The CPU and device RNG states now (what torch.utils.checkpoint saves), so that a
    recomputed unit draws the same random numbers (dropout) as its forward did."""
    tensors = [*full, *args]
    # one tensor per device: torch reads a device's generator once per tensor it is given
    ones = {t.device: t for t in tensors if t.device.type not in ("cpu", "meta")}
    devices, states = get_device_states(*ones.values())
    device = next((d.type for d in ones), None)
    return torch.get_rng_state(), devices, states, device


@contextlib.contextmanager
def replaying(rng: tuple | None, autocast: tuple) -> Iterator[None]:
    """Run the block as its forward ran: with the RNG states ``rng`` (the caller's states
    restored after it) and under the autocast state ``autocast`` (:func:`autocast_state`),
    on or off whatever autocast region the backward was called in. Around the recompute
    only: ``fn``'s own backward runs, as with ``recompute=False``, in the backward's state."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(autocasting(autocast))
        if rng is not None:
            cpu, devices, states, device = rng
            kwargs = {"device_type": device} if device is not None else {}
            stack.enter_context(torch.random.fork_rng(devices=devices, **kwargs))
            torch.set_rng_state(cpu)
            if devices:
                set_device_states(devices, states, **kwargs)
        yield

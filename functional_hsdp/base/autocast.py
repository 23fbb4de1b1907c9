"""The autocast state, taken where a computation runs and put back where it is run again: a
recomputed unit (``units/replay.py``) and a ghost-norms op's backward (``sync/ghost.py``)
compute in the dtypes their forward computed in, whatever autocast region the backward was
called in (what ``torch.utils.checkpoint`` does).

State: none; what is taken is the caller's value.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

__all__ = ["autocast_state", "autocasting"]


def autocast_state(tensors: Sequence[torch.Tensor]) -> tuple[tuple[str, dict], ...]:
    """The autocast state now, for the CPU and each device type of ``tensors`` (what
    torch.utils.checkpoint saves): ``(device_type, torch.autocast's keyword arguments)``
    pairs, so that a computation run again runs in the dtypes it first ran in."""
    cache, on = torch.is_autocast_cache_enabled(), torch.is_autocast_enabled
    kinds = dict.fromkeys(["cpu", *(t.device.type for t in tensors)])
    return tuple(
        (kind, dict(enabled=on(kind), dtype=torch.get_autocast_dtype(kind), cache_enabled=cache))
        for kind in kinds
        if torch.amp.is_autocast_available(kind)  # not "meta", say: it has no autocast
    )


@contextlib.contextmanager
def autocasting(state: tuple[tuple[str, dict], ...]) -> Iterator[None]:
    """The block under the autocast state ``state`` (:func:`autocast_state`), on or off
    whatever autocast region it is run in."""
    with contextlib.ExitStack() as stack:
        for kind, kwargs in state:
            stack.enter_context(torch.autocast(kind, **kwargs))
        yield

"""``comm_log``: a record of every collective the library issues.

Events describe one rank's input to a collective, so a SimMesh and a DistMesh log the same
events for the same call.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

__all__ = ["Event", "CommLog", "comm_log", "record"]


@dataclass(frozen=True)
class Event:
    """One collective on one axis.

    Attributes:
        op: ``"reduce_scatter"``, ``"all_reduce"``, ``"all_gather"`` or ``"all_to_all"``
            (its ``numel``: the rank's buffer, as long as its group's longest).
        axis: the mesh axis name.
        dtype: dtype of one rank's input.
        numel: number of elements of one rank's input.
        reduce: ``"avg"``/``"sum"`` for reductions, None for all-gather.
        impl: how the mesh carried it out (``"native"``, ``"sum+div"``, ``"einops"``); not part
            of equality, so the two meshes' logs compare equal.
        sent: an all-to-all's elements that each rank this process holds sends to the
            others (its blocks are uneven), in rank order: one on a DistMesh, every rank's
            (row-major) on a SimMesh; None for the other ops. Not part of equality.
    """

    op: str
    axis: str
    dtype: torch.dtype
    numel: int
    reduce: str | None = None
    impl: str = field(default="", compare=False)
    sent: tuple[int, ...] | None = field(default=None, compare=False)

    @property
    def nbytes(self) -> int:
        """Bytes of one rank's input."""
        return self.numel * self.dtype.itemsize


@dataclass
class CommLog:
    """Collected :class:`Event` s; ``events`` in issue order."""

    events: list[Event] = field(default_factory=list)

    def count(self, op: str | None = None, axis: str | None = None) -> int:
        """Number of events matching ``op`` and ``axis`` (None matches any)."""
        return sum(1 for e in self._select(op, axis))

    def nbytes(self, op: str | None = None, axis: str | None = None) -> int:
        """Bytes of one rank's inputs over the matching events."""
        return sum(e.nbytes for e in self._select(op, axis))

    def sent_bytes(self, axis: str, size: int) -> float:
        """Bytes one rank sends to the others over ``axis`` (``size`` ranks) in the matching
        events, as bandwidth-optimal algorithms move them: an all-reduce ``2 (n-1)/n`` of its
        input, a reduce-scatter ``(n-1)/n``, an all-gather ``n-1`` times its input, an
        all-to-all what it sends to the others (its ``sent``; else ``(n-1)/n``). The measure
        that compares a compressed reduction (all-to-all + all-gather) with a plain one.

        Example:
            >>> import torch, functional_hsdp as fh
            >>> mesh = fh.SimMesh({"dp": 4})
            >>> with fh.comm_log() as log:
            ...     _ = fh.psum(torch.ones(4, 1024), "dp", mesh)
            >>> log.sent_bytes("dp", 4)
            6144.0
        """
        n, total = size, 0.0
        for e in self._select(None, axis):
            if e.op == "all_to_all" and e.sent:
                total += max(e.sent) * e.dtype.itemsize
                continue
            share = {"all_reduce": 2 * (n - 1) / n, "all_gather": n - 1}.get(e.op, (n - 1) / n)
            total += share * e.nbytes
        return total

    def summary(self) -> dict[tuple[str, str], tuple[int, int]]:
        """``{(axis, op): (count, bytes)}``."""
        counts: Counter = Counter()
        sizes: Counter = Counter()
        for e in self.events:
            counts[(e.axis, e.op)] += 1
            sizes[(e.axis, e.op)] += e.nbytes
        return {k: (counts[k], sizes[k]) for k in counts}

    def clear(self) -> None:
        """Forget the events recorded so far (recording goes on)."""
        self.events.clear()

    def _select(self, op: str | None, axis: str | None) -> Iterator[Event]:
        return (
            e
            for e in self.events
            if (op is None or e.op == op) and (axis is None or e.axis == axis)
        )


# The logs recording now. A plain module global, not a context variable: autograd runs
# backward (and so a gathered unit's reduce-scatter) on threads of its own on CUDA, which see
# no context variable of the thread that opened the log.
_ACTIVE: tuple[CommLog, ...] = ()
_LOCK = threading.Lock()


@contextlib.contextmanager
def comm_log() -> Iterator[CommLog]:
    """Record every collective issued inside the ``with`` block (nesting allowed), on any
    thread of the process (a backward on autograd's device threads too).

    Returns:
        A :class:`CommLog` whose ``events`` fill as collectives are issued.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp": 2})
        >>> with fh.comm_log() as log:
        ...     _ = fh.psum({"w": torch.ones(2, 3)}, "dp", mesh)
        >>> [(e.op, e.axis, e.numel) for e in log.events]
        [('all_reduce', 'dp', 3)]
    """
    global _ACTIVE
    log = CommLog()
    with _LOCK:
        _ACTIVE = (*_ACTIVE, log)
    try:
        yield log
    finally:
        with _LOCK:
            _ACTIVE = tuple(x for x in _ACTIVE if x is not log)


def record(event: Event) -> None:
    """Append ``event`` to every active log (none under torch.compile: traced collectives are
    not logged)."""
    if torch.compiler.is_compiling():
        return
    for log in _ACTIVE:
        log.events.append(event)

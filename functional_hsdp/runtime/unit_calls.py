"""The gathered units' running record: which unit calls one rank made since the last check.

Every :func:`~functional_hsdp.gathered` unit call, and every ``MainGrad.begin_microbatch``
declaration, adds its unit and options to an order-sensitive digest of its mesh's
:class:`UnitLog`; a checking call's agreement takes the log and compares the digests across
ranks. Invariant: the log is an explicit record per mesh (not per thread or context),
written in the caller's thread and read only by the checking call, never by a backward.
"""

from __future__ import annotations

import weakref
from typing import Any

from ..base.cache import Bounded
from .fingerprints import MASK, digest
from .span import Within

__all__ = ["UnitLog", "unit_log"]

_UNIT_LIMIT = 1 << 16  # unit calls whose digests a log keeps for the message (beyond: the digest)
_PRIME = 1_000_003
_UNIT_DIGESTS = Bounded(4096)  # (unit, options) -> (digest of the unit, of both)
_LOGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # mesh -> its UnitLog


class UnitLog:
    """The :func:`~functional_hsdp.gathered` unit calls one rank made on a mesh since the last
    call that checked them (``Agreement.check(units=True)``): a running, order-sensitive
    digest of every call's unit and options, and each call's digests for the message. A
    ``MainGrad.begin_microbatch`` declaration is recorded among them (its option: ``last``),
    since it decides when the units' deferred reductions are issued.

    An explicit record per mesh (not per thread or context), written by a unit call in the
    caller's thread and read by the checking call: a backward never reads it."""

    def __init__(self) -> None:
        self.digest, self.count = 0, 0
        self.entries: list[tuple[int, int]] = []  # per call: (unit digest, unit+options digest)
        self.texts: dict[int, str] = {}  # unit+options digest -> "unit | options"

    def record(self, unit: str, options: str) -> None:
        """One more unit call: ``unit`` names it, ``options`` what its collectives depend on."""
        key = (unit, options)
        digests = _UNIT_DIGESTS.get(key)
        if digests is None:
            digests = _UNIT_DIGESTS[key] = (digest(unit), digest(f"{unit} | {options}"))
        self.digest = (self.digest * _PRIME + digests[1]) & MASK  # the order counts
        self.count += 1
        if len(self.entries) < _UNIT_LIMIT:
            self.entries.append(digests)
            self.texts.setdefault(digests[1], f"{unit} | {options}")

    def take(self) -> UnitLog:
        """What was recorded, handed to a check; this log starts again empty."""
        taken = UnitLog()
        taken.digest, taken.count, taken.entries, taken.texts = (
            self.digest,
            self.count,
            self.entries,
            self.texts,
        )
        self.digest, self.count, self.entries, self.texts = 0, 0, [], {}
        return taken


def unit_log(mesh: Any) -> UnitLog:
    """The :class:`UnitLog` of ``mesh`` (made on first use; it goes with the mesh; a
    :class:`~functional_hsdp.runtime.span.Within`'s is its mesh's)."""
    if isinstance(mesh, Within):
        mesh = mesh.base
    log = _LOGS.get(mesh)
    if log is None:
        log = _LOGS[mesh] = UnitLog()
    return log

"""The library's own exception, and the messages shared by several modules.

Bad input raises ``ValueError``/``TypeError`` naming the pytree path; a collective that fails
or times out raises :class:`CollectiveError` naming the collective and mesh axis.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CollectiveError", "UnitsDiffer", "collective_error", "still_partial"]


class CollectiveError(RuntimeError):
    """A collective failed or timed out: a peer rank died, hung or issued another collective.

    Attributes:
        op: the collective (``"all_reduce"``, ``"reduce_scatter"``, ``"all_gather"``,
            ``"exchange"``).
        axis: the mesh axis (a tuple of axes for the cross-rank check's exchange over the
            whole mesh), or None if unknown.
    """

    def __init__(self, message: str, op: str, axis: str | tuple[str, ...] | None):
        super().__init__(message)
        self.op = op
        self.axis = axis


class UnitsDiffer(CollectiveError, ValueError):
    """``fh.validation("strict")``: the ranks were about to issue different collectives for
    their layer-wise units (a unit skipped, called in another order, or gathered with other
    options or another dtype on some rank), so none was issued. Raised on every rank at once.

    It is a :class:`CollectiveError` (the collective was refused: what a mismatched collective
    would otherwise have become, a crash or a wait until the timeout) and a ``ValueError`` (the
    ranks' calls differ, as every other cross-rank check reports): code catching either
    catches it.
    """


def collective_error(
    op: str, axis: Any, mesh: Any, *, exc: BaseException, rank: Any = None, timeout=None
) -> CollectiveError:
    """The :class:`CollectiveError` for ``exc`` raised by collective ``op`` on ``axis``."""
    if isinstance(axis, tuple):
        where = f"over mesh axes {', '.join(map(repr, axis))}"
    else:
        where = f"over mesh axis {axis!r}" if axis is not None else "(issued earlier)"
    who = f" on rank {rank}" if rank is not None else ""
    limit = f"; the group's timeout is {timeout}" if timeout is not None else ""
    return CollectiveError(
        f"{op} {where} failed{who} of {mesh!r}: a peer rank may have died, hung, raised an "
        f"error before joining, or issued a different collective{limit}. "
        f"Original error: {type(exc).__name__}: {exc}",
        op,
        axis,
    )


def still_partial(path: str, why: str = "") -> str:
    """The message for an accumulating (still Partial) value where a final one is needed."""
    return (
        f"{path}: is an accumulating gradient, still Partial on the deferred axes{why}; finish "
        "it with reduce_grads(..., last=True) first"
    )

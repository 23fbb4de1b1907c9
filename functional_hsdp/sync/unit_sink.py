"""UnitSink: what gathered units with ``into=mg`` may do to a MainGrad, and nothing else.

Not public API: :mod:`functional_hsdp.units` reaches it through ``maingrad.units_of(mg)``,
which makes one per use from the MainGrad's parts. Invariant: a unit adds into a bucket only
while the step accumulates and before the bucket's deferred reduction was issued (a gradient
after that is refused). State: none of its own; it holds the MainGrad's plan, its
:class:`~functional_hsdp.sync.deferred.Deferred` and two of its methods, and no MainGrad holds it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..base.tree import paths_of
from ..plan.recipe import Plan
from ..runtime.agreement import agreement
from .deferred import Deferred

__all__ = ["UnitSink"]


class UnitSink:
    """The private interface of gathered units (``gathered(..., into=mg)``, in
    :mod:`functional_hsdp.units`) to a MainGrad: what they do to it and nothing else. Made
    per use by ``maingrad.units_of``.

    Args:
        plan: the MainGrad's plan.
        deferred: its deferred reduction.
        check: ``check(what, by)`` raises unless its step accumulates (``by``: the call
            adding, named in the error).
        write: ``write(buckets, chunks)`` adds reduced chunks into the buffers of
            ``buckets`` (overwriting a bucket that holds nothing of this step).
    """

    __slots__ = ("plan", "_deferred", "_check", "_write")

    def __init__(
        self,
        plan: Plan,
        deferred: Deferred,
        *,
        check: Callable[[str, str], None],
        write: Callable[[list[int], list[torch.Tensor]], None],
    ):
        self.plan, self._deferred, self._check, self._write = plan, deferred, check, write

    def buckets_of(self, unit: int) -> list[int]:
        """The buckets of ``unit`` (a leaf of the spec prefix, numbered in prefix order)."""
        return [b for b, bucket in enumerate(self.plan.buckets) if bucket.unit == unit]

    def called(self, buckets: list[int]) -> None:
        """A unit holding ``buckets`` was called (forward)."""
        self._deferred.called(buckets)

    def add(self, buckets: list[int], chunks: list[torch.Tensor], *, by: str) -> None:
        """Add reduced chunks at the gradient placement into ``buckets`` (overwriting a
        bucket that holds nothing of this step). Safe inside a backward under ``torch.func``:
        the add is a custom op that declares its mutation. ``by``: the call adding, for
        errors."""
        self._check("gradients", by)
        issued = self._deferred.issued.intersection(buckets)
        if issued:
            raise ValueError(
                f"gradients: MainGrad buckets {sorted(issued)} were reduced over the deferred "
                "axes already in this step (their unit's backward ran after "
                "begin_microbatch(last=True)); a unit's gradient cannot arrive after that: "
                "declare last=True only before the step's final microbatch, and call finish() "
                "and zero_grad() before the next step"
            )
        self._write(buckets, chunks)

    def done(self, buckets: list[int]) -> None:
        """A call of the unit holding ``buckets`` added its gradient (backward): on the
        declared last microbatch, its deferred reduction may start."""
        self._deferred.done(buckets)

    def agree(self, where: str, *, local: Callable[[], None] | None = None) -> None:
        """Check now that every rank ran the same gathered units since the last check (the
        same order and options), as ``finish`` does; raise on every rank otherwise, the
        error starting with ``where``. ``local``: this rank's own checks, run first inside
        the agreement (a rank whose checks fail tells the others). Every rank must call it."""
        plan = self.plan
        with agreement(plan.specs, where) as agreed:
            if local is not None:
                local()
            agreed.check(plan, paths_of(plan.treedef, "grads"), units=True)

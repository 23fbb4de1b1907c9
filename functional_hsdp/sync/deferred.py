"""The deferred outer reduction of a MainGrad's buckets: when each is issued, what is in flight.

Invariant: a bucket's reduction (to the optimizer placement: HSDP's ``dp_outer`` all-reduce) is
issued once per step: in backward, as soon as every gathered unit holding it has added its
gradient of the microbatch declared last, or else by ``finish``. At most ``depth`` are in
flight, each landing in its bucket's buffer in the order issued, before the buffers are read,
zeroed, saved or finished. State: per MainGrad one :class:`Deferred` (the declaration, the unit
calls whose gradient is due, the buckets issued, the :class:`DeferredReduction` in flight).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from ..plan.recipe import Plan
from ..runtime import engine
from ..runtime.flight import InFlight

__all__ = ["Deferred", "DeferredReduction"]


class DeferredReduction(InFlight[torch.Tensor]):
    """One bucket's deferred reduction (to the optimizer placement: the ``dp_outer``
    all-reduce of HSDP) issued in backward, once every gathered unit holding the bucket has
    added its gradient of the step; its ``result()``
    (:class:`~functional_hsdp.runtime.flight.InFlight`'s, once) is the bucket's reduced buffer.

    Invariant: at most ``Deferred.depth`` are in flight; each lands in its bucket's
    buffer, in the order issued, before the buffers are read (``grads``), zeroed, saved or
    finished; a bucket's reduction is issued once per step.
    """

    __slots__ = ("bucket", "_mesh", "_pending")

    def __init__(self, bucket: int, pending: Any, *, mesh: Any):
        super().__init__()
        self.bucket, self._mesh = bucket, mesh
        self._pending = pending  # the mesh's collective in flight (Mesh.wait gives the result)

    def _wait(self) -> torch.Tensor:
        out = self._mesh.wait(self._pending)
        self._pending = None
        return out

    def _release(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._mesh.abandon(pending)


class Deferred:
    """The deferred reduction of a MainGrad's buckets, its one owner: when it is issued for
    each bucket (in backward, as soon as the bucket's gradient of the step is complete, or
    by ``finish`` for the rest) and what of it is in flight.

    It shares the MainGrad's buffer list and plan, and refers to no MainGrad (so none refers
    to itself through it).
    """

    #: the role change of the deferred reduction
    LEG = ("gradient", "optimizer")

    def __init__(
        self,
        plan: Plan,
        buffers: list,
        *,
        reduce_dtype: torch.dtype,
        mesh: Any,
        depth: int,
        residual: engine.Residual | None = None,
    ):
        self.plan, self.buffers, self.reduce_dtype, self.mesh = plan, buffers, reduce_dtype, mesh
        self.depth = depth  # at most this many reductions in flight (the MainGrad's DEPTH)
        self.residual = residual  # the MainGrad's residuals, if it compresses with feedback
        self.last = False  # the next backward is the step's last (begin_microbatch)
        self.uses: dict[tuple[int, ...], int] = {}  # per unit: calls whose gradient is due
        self.issued: set[int] = set()  # buckets whose deferred reduction was issued
        self.inflight: deque[DeferredReduction] = deque()

    def begin(self, last: bool) -> None:
        """A microbatch begins; ``last``: it is the step's last."""
        self.last, self.uses = last, {}

    def reset(self) -> None:
        """The step is finished or started again: nothing declared, nothing issued."""
        self.last, self.uses = False, {}
        self.issued.clear()

    def called(self, buckets: list[int]) -> None:
        """A unit holding ``buckets`` was called (forward): on the declared last microbatch,
        one more gradient of it is due in this backward."""
        key = tuple(buckets)
        if self.last and not self.issued.intersection(key):
            self.uses[key] = self.uses.get(key, 0) + 1

    def done(self, buckets: list[int]) -> None:
        """A call of the unit holding ``buckets`` added its gradient (backward): its
        deferred reduction starts once none is due."""
        key = tuple(buckets)
        if key not in self.uses:
            return
        self.uses[key] -= 1
        if not self.uses[key]:
            del self.uses[key]
            # In a backward under torch.func: the buffers are plain tensors of the library's,
            # reduced and written as such, not as values of the transform being run
            with torch._C._DisableFuncTorch(), torch.no_grad():
                self._issue(buckets)

    def _issue(self, buckets: list[int]) -> None:
        """Issue the deferred reduction of ``buckets`` now (their gradient of the step is
        complete); at most ``depth`` stay in flight, so the memory bound of ``finish`` holds (a
        reduction that is not in place holds a bucket-sized result)."""
        self.issued.update(buckets)
        todo = [b for b in buckets if self.plan.program(b, *self.LEG)]
        if not todo:
            return
        pending = engine.start(
            self.plan,
            self._source,
            [self.LEG],
            wire=self.reduce_dtype,
            buckets=todo,
            residual=self.residual,
        )
        self.inflight.extend(DeferredReduction(b, p, mesh=self.mesh) for b, p in zip(todo, pending))
        while len(self.inflight) > self.depth:
            self._land_oldest()

    def _source(self, b: int) -> torch.Tensor:
        # nothing deferred: the buffer is final as it is (no rounding to the wire dtype); else
        # the buffer itself when the wire dtype is its own
        buf = self.buffers[b]
        return buf.to(self.reduce_dtype) if self.plan.program(b, *self.LEG) else buf

    def _landed(self, b: int, result: torch.Tensor) -> None:
        """Bucket ``b``'s deferred reduction finished with ``result``: into its buffer."""
        buf = self.buffers[b]
        if result.data_ptr() != buf.data_ptr():  # else the result is in place already
            buf.narrow(-1, 0, result.shape[-1]).copy_(result)

    def _land_oldest(self) -> None:
        reduction = self.inflight.popleft()
        self._landed(reduction.bucket, reduction.result())

    def land_all(self) -> None:
        """Wait for every reduction in flight, each into its buffer."""
        while self.inflight:
            self._land_oldest()

    def finish(self) -> None:
        """The reduction of every bucket not issued in backward, ``depth`` at a time (those in
        flight landed first, by the caller)."""
        rest = [b for b in range(len(self.buffers)) if b not in self.issued]
        engine.start(
            self.plan,
            self._source,
            [self.LEG],
            depth=self.depth,
            wire=self.reduce_dtype,
            sink=self._landed,
            buckets=rest,
            residual=self.residual,
        )

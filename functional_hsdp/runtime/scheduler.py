"""The one bucket scheduler: every collective the library issues goes through :func:`run`.

A bucket's *program* is a sequence of :class:`~functional_hsdp.plan.recipe.Step` s (collectives, or
local slices) and local functions ``(bucket index, buffer) -> buffer`` (adding the running
accumulation, say). Invariant: at most ``depth`` buckets in flight, each packed just before
its first collective, collectives issued step-major across them (the order and why:
:func:`run`), so the extra memory stays within ``depth`` buckets however large the model.
fp16 on the wire is pre- and post-divided (:func:`divide_factors`), the one place where
divide factors are chosen.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..base.trace import Event, record
from ..plan.recipe import Step

__all__ = ["Local", "divide_factors", "expand", "issue", "run"]

Local = Callable[[int, torch.Tensor], torch.Tensor]
Item = Any  # a Step or a Local


def divide_factors(step: Step, wire: torch.dtype) -> tuple[float, str | None, float]:
    """(pre-divide, op on the wire, post-divide) for one reduction.

    fp32 and bf16 share fp32's exponent range, so they reduce with the placement's own op.
    fp16 overflows at 65504: a SUM of n large gradients (gloo's AVG sums first, too) can
    overflow before anything divides. As FSDP2 does, divide by f before the sum and the rest
    after, f a power of two near sqrt(n) (f doubles while n is divisible by f and n / f > f;
    power-of-two scaling is exact), and sum on the wire: avg = (sum of x / f) / (n / f);
    sum = (sum of x / f) * f.
    """
    if step.reduce is None or wire != torch.float16:
        return 1.0, step.reduce, 1.0
    n, f = step.size, 1
    while n % f == 0 and n / f > f:
        f *= 2
    return float(f), "sum", (n / f if step.reduce == "avg" else 1.0 / f)


def _divide(by: float) -> Local:
    # a new tensor: the buffer may be a collective's broadcast or borrowed result
    return lambda b, buf: buf / by


def expand(program: Sequence[Item], wire: torch.dtype) -> list[Item]:
    """``program`` with each fp16 reduction wrapped in its pre- and post-divide."""
    if wire != torch.float16:
        return list(program)
    out: list[Item] = []
    for item in program:
        if isinstance(item, Step) and item.reduce is not None:
            pre, op, post = divide_factors(item, wire)
            step = Step(op=item.op, axis=item.axis, reduce=op, size=item.size)
            out += [_divide(pre), step, _divide(post)]
        else:
            out.append(item)
    return out


def issue(mesh: Any, buf: torch.Tensor, step: Step) -> Any:
    """Issue one bucket collective (logged; ``buf`` already waited) or take the local chunk."""
    if step.op == "slice":
        return mesh.geometry.chunk(buf, step.axis)
    if not torch.compiler.is_compiling():  # traced collectives are not logged
        impl = mesh.diagnostics.describe(step.op, step.axis, step.reduce)
        # compressed bytes (a Wire step) are reported in the policy's wire dtype
        dtype = getattr(step, "wire", None) or buf.dtype
        record(
            Event(
                op=step.op,
                axis=step.axis,
                dtype=dtype,
                numel=buf.shape[-1] * buf.dtype.itemsize // dtype.itemsize,
                reduce=step.reduce,
                impl=impl,
                sent=getattr(step, "sent", None),
            )
        )
    if step.op == "reduce_scatter":
        return mesh.reduce_scatter(buf, step.axis, step.reduce)
    if step.op == "all_reduce":
        return mesh.all_reduce(buf, step.axis, step.reduce)
    if step.op == "all_to_all":  # an Exchange (owner) or Wire (compressed) step: its counts
        return mesh.all_to_all(buf, step.axis, counts=step.rows, length=step.length)
    return mesh.all_gather(buf, step.axis)


@dataclass(eq=False)
class _Bucket:
    index: int
    buf: Any  # a tensor or a collective in flight
    program: Sequence[Item]
    pc: int = 0


def _advance(mesh: Any, bucket: _Bucket, settle: Callable[[], None]) -> bool:
    """Run local items up to and including the next collective (``settle()`` first); True
    when the program ended."""
    program = bucket.program
    while bucket.pc < len(program):
        item = program[bucket.pc]
        bucket.pc += 1
        buf = mesh.wait(bucket.buf)
        if isinstance(item, Step):
            if item.op != "slice":
                settle()
            bucket.buf = issue(mesh, buf, item)
            if item.op != "slice":
                return False
        else:
            bucket.buf = item(bucket.index, buf)
    return True


def run(
    mesh: Any,
    programs: Sequence[Sequence[Item]],
    source: Callable[[int], torch.Tensor],
    *,
    depth: int | None = None,
    sink: Callable[[int, torch.Tensor], None] | None = None,
    gate: Callable[[], None] | None = None,
) -> list[Any]:
    """Move bucket ``b``'s buffer ``source(b)`` through ``programs[b]``, every bucket.

    At most ``depth`` buckets are in flight: a bucket is packed (``source``) just before its
    first collective, and collectives are issued step-major across the buckets in flight:
    every bucket's first collective before any bucket's second, and so on. So packing
    overlaps communication, buckets overlap each other, and the second axis's collective of
    one bucket runs while the first axis's collectives of later buckets are in flight. With a
    bounded ``depth`` (MainGrad's two) the oldest bucket is finished before a new one starts,
    so the extra memory stays within ``depth`` buckets however large the model.

    Args:
        mesh: the mesh.
        programs: per bucket, its steps and local functions.
        source: bucket index -> its input buffer, called just before its first collective.
        depth: the most buckets in flight (default: all).
        sink: if given, called with each bucket's waited result as soon as it is done (then
            nothing is returned); else the results are returned, the last collective of each
            possibly still in flight (``mesh.wait`` each before use).
        gate: called once, just before the first collective is issued (after the first
            bucket was packed), or at the end if none is: the call's cross-rank agreement
            (:meth:`~functional_hsdp.runtime.agreement.Agreement.settle`), whose exchange so
            overlaps the packing. Also called if anything raises before it was, so that every rank
            takes part in the exchange; an error it raises then is raised instead.

    Returns:
        Per bucket, its result (a tensor or a collective in flight), or Nones with ``sink``.

    If anything raises, the collectives still in flight are abandoned (``mesh.abandon``), so
    an error leaks no buffers.
    """
    n = len(programs)
    depth = n if depth is None else depth
    state = _RunState(mesh, sink, out=[None] * n, gates=[gate] if gate is not None else [])
    active = state.active
    try:
        for b in range(n):
            while len(active) >= depth:  # finish the oldest to make room
                state.run_to_end(active.popleft())
            bucket = _Bucket(b, source(b), programs[b])
            if _advance(mesh, bucket, state.call_gate):
                state.bucket_done(bucket)
            else:
                active.append(bucket)
        while active:  # every bucket started: step-major rounds
            for bucket in list(active):
                if _advance(mesh, bucket, state.call_gate):
                    active.remove(bucket)
                    state.bucket_done(bucket)
        state.call_gate()
    except BaseException as exc:
        state.abandon_in_flight()
        if state.gates and isinstance(exc, Exception):
            state.call_gate()  # an agreement error here is every rank's: raise it instead
        raise
    return state.out


@dataclass(eq=False)
class _RunState:
    """One :func:`run` call's state: buckets in flight (oldest first), results, uncalled gate."""

    mesh: Any
    sink: Callable[[int, torch.Tensor], None] | None
    out: list[Any]
    gates: list[Callable[[], None]]
    active: deque[_Bucket] = field(default_factory=deque)

    def call_gate(self) -> None:
        """Call the gate, the first time only."""
        if self.gates:
            self.gates.pop()()

    def bucket_done(self, bucket: _Bucket) -> None:
        """A bucket's program ended: keep its result, or hand it to the sink."""
        if self.sink is None:
            self.out[bucket.index] = bucket.buf
        else:  # the sink changes state that outlives the call: agree first
            result = self.mesh.wait(bucket.buf)
            self.call_gate()
            self.sink(bucket.index, result)

    def run_to_end(self, bucket: _Bucket) -> None:
        """Run a bucket's program to its end."""
        while not _advance(self.mesh, bucket, self.call_gate):
            pass
        self.bucket_done(bucket)

    def abandon_in_flight(self) -> None:
        """Abandon the collectives still in flight (an error leaks no buffers)."""
        for x in [*(bucket.buf for bucket in self.active), *self.out]:
            if x is not None:
                self.mesh.abandon(x)

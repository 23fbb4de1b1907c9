"""The compressed reduction on one axis: quantize, all-to-all, sum in fp32, quantize, all-gather.

One bucket of ``L`` elements on an axis of ``n`` ranks is cut into ``n`` pieces of ``P``
(``ceil(L / n)``, the last padded with zeros). Its program, run by the one scheduler
(:mod:`functional_hsdp.runtime.scheduler`), is:

==========================  ============================================================
item                        what it does
==========================  ============================================================
encode (local)              ``x = bucket + residual``; every piece quantized (its bytes)
all-to-all (``Wire``)       piece ``p`` of every rank goes to rank ``p``: a reduce-scatter
                            by pieces, in compressed bytes
reduce (local)              the ``n`` pieces decoded and summed in fp32 (in source order,
                            so every mesh gives the same bits), divided for ``avg``; the
                            sum quantized again (not with ``scatter``)
all-gather (``Wire``)       every rank gets every piece of the sum, compressed
decode (local)              the pieces decoded: the result, ``L`` long
==========================  ============================================================

With ``scatter=True`` (the optimizer is sharded over the axis, hfsdp) the sum's piece is the
result and the all-gather is not issued. Error feedback keeps what rounding lost on both
legs, on the rank that rounded it: ``x - decode(encode(x))`` of the sender, plus, on the
owner of piece ``p``, the loss of the sum's rounding (times ``n`` for ``avg``, since the
residual is averaged with the next contributions). So ``result + mean(new residual) ==
mean(x)`` (``sum`` alike): over K steps, what was sent plus the last residual is the sum of
the true contributions.

``comm_log`` reports each leg with the wire dtype of the policy (int4 as ``torch.uint8``) and
its numel in that dtype, the scales included; on the mesh the bytes travel as uint8.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import einops
import numpy as np
import torch

from ..mesh import Mesh
from ..plan.recipe import Step
from ..spec.quantize import Compress
from .scheduler import run

__all__ = ["CompressedInFlight", "Wire", "compressed_all_reduce", "program", "start"]

#: per bucket: its residual in (None: zeros), and where its new residual goes
ResidualIn = Callable[[int], "torch.Tensor | None"]
ResidualOut = Callable[[int, torch.Tensor], None]


@dataclass(frozen=True)
class Wire(Step):
    """A collective of compressed bytes (``all_to_all`` or ``all_gather``): ``wire`` is the
    dtype ``comm_log`` reports; an all-to-all carries ``rows`` and ``length`` as
    ``Mesh.all_to_all`` takes them, and ``sent`` as ``Event.sent``."""

    wire: torch.dtype | None = None
    rows: Any = None
    length: int = 0
    sent: tuple[int, ...] | None = None


def _exchange(mesh: Mesh, axis: str, *, nbytes: int, wire: torch.dtype) -> Wire:
    """The all-to-all of equal pieces of ``nbytes`` between the ranks of ``axis``."""
    n = mesh.size(axis)
    rows = {r: (nbytes,) * n for r in np.ndindex(*mesh.sizes)}
    per = (n - 1) * nbytes // wire.itemsize
    held = int(np.prod(mesh.batch_shape)) if mesh.batch_shape else 1
    return Wire(
        op="all_to_all",
        axis=axis,
        reduce=None,
        size=n,
        wire=wire,
        rows=rows,
        length=n * nbytes,
        sent=(per,) * held,
    )


def program(
    policy: Compress,
    axis: str,
    mesh: Mesh,
    *,
    op: str,
    scatter: bool,
    length: int,
    residual_in: ResidualIn,
    residual_out: ResidualOut,
) -> list[Any]:
    """The scheduler items of a compressed reduction over ``axis`` of a bucket of ``length``
    (per rank), for any bucket index (see the module docstring). The bucket arrives in any
    floating dtype and leaves in it; the work is fp32. With ``policy.error_feedback``,
    ``residual_in(b)`` (fp32, the bucket's shape, or None for zeros) is added first and
    ``residual_out(b, r)`` receives the new residual before the last item returns."""
    n = mesh.size(axis)
    if scatter and length % n:
        raise ValueError(
            f"compressed reduce-scatter over {axis!r}: the bucket's {length} elements do not "
            f"split into {n} equal chunks"
        )
    legs = _Legs(policy, axis, mesh, op=op, scatter=scatter, length=length)
    legs.residual_in, legs.residual_out = residual_in, residual_out
    items: list[Any] = [
        legs.encode,
        _exchange(mesh, axis, nbytes=legs.nbytes, wire=policy.wire),
        legs.reduce,
    ]
    if not scatter:
        gather = Wire(op="all_gather", axis=axis, reduce=None, size=n, wire=policy.wire)
        items += [gather, legs.decode]
    return items


class _Legs:
    """The local items of one compressed reduction, and what passes between them per bucket
    (the first leg's loss, the bucket's dtype) until its last item."""

    def __init__(
        self, policy: Compress, axis: str, mesh: Mesh, *, op: str, scatter: bool, length: int
    ):
        self.policy, self.axis, self.mesh, self.op = policy, axis, mesh, op
        self.scatter, self.length, self.n = scatter, length, mesh.size(axis)
        self.piece = -(-length // self.n)
        self.nbytes = policy.nbytes(self.piece)
        self.lost: dict[int, torch.Tensor] = {}  # per bucket: (*batch, n, piece)
        self.dtypes: dict[int, torch.dtype] = {}
        # where the bucket's residual comes from and goes (set by program)
        self.residual_in: ResidualIn = lambda b: None
        self.residual_out: ResidualOut = lambda b, r: None

    @torch.no_grad()
    def encode(self, b: int, buf: torch.Tensor) -> torch.Tensor:
        """Add the residual, cut into pieces, quantize: the all-to-all's bytes."""
        self.dtypes[b] = buf.dtype
        feedback = self.policy.error_feedback
        r = self.residual_in(b) if feedback else None
        x = self._padded(buf, r)  # never written: the codec reads it
        x = einops.rearrange(x, "... (n p) -> ... n p", n=self.n)
        if not feedback:
            return einops.rearrange(self.policy.encode(x), "... n c -> ... (n c)")
        data, approx = self.policy.code(x)
        self.lost[b] = torch.sub(x, approx, out=approx)  # this rank's loss, in approx's buffer
        return einops.rearrange(data, "... n c -> ... (n c)")

    def _padded(self, buf: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
        """``buf + r`` (``r`` None: ``buf``), fp32, padded with zeros to ``n`` whole pieces:
        ``buf`` itself where that is it already, else one new buffer written once."""
        total = self.n * self.piece
        if r is None and buf.dtype == torch.float32 and total == self.length:
            return buf
        x = buf.new_empty((*buf.shape[:-1], total), dtype=torch.float32)
        if r is None:
            x[..., : self.length] = buf
        else:
            torch.add(buf, r, out=x[..., : self.length])
        x[..., self.length :] = 0
        return x

    @torch.no_grad()
    def reduce(self, b: int, got: torch.Tensor) -> torch.Tensor:
        """Sum this rank's piece from every rank in fp32; the chunk (scatter) or its bytes."""
        n, feedback = self.n, self.policy.error_feedback
        got = einops.rearrange(got, "... (n c) -> ... n c", n=n)
        parts = self.policy.decode(got, self.piece)  # a new buffer: summed into its first row
        total = parts[..., 0, :]
        for s in range(1, n):  # in source order: the same bits on every mesh
            total += parts[..., s, :]
        if self.op == "avg":
            total /= n
        if self.scatter:
            if feedback:
                self.residual_out(b, self.lost.pop(b).flatten(-2)[..., : self.length])
            return total.to(self.dtypes.pop(b))
        data, approx = self.policy.code(total)
        if feedback:  # the sum's rounding, kept by the rank that owns the piece
            lost = torch.sub(total, approx, out=approx)
            if self.op == "avg":
                lost *= n
            loss = _add_own_piece(self.lost.pop(b), lost, mesh=self.mesh, axis=self.axis)
            self.residual_out(b, loss.flatten(-2)[..., : self.length])
        return data

    @torch.no_grad()
    def decode(self, b: int, got: torch.Tensor) -> torch.Tensor:
        """Every piece of the sum, decoded: the result."""
        got = einops.rearrange(got, "... (n c) -> ... n c", n=self.n)
        parts = self.policy.decode(got, self.piece)
        return parts.flatten(-2)[..., : self.length].to(self.dtypes.pop(b))


def _add_own_piece(
    lost: torch.Tensor, loss: torch.Tensor, *, mesh: Mesh, axis: str
) -> torch.Tensor:
    """``lost`` (``(*batch, n, piece)``) with ``loss`` (``(*batch, piece)``) added, in place,
    into piece ``p`` where ``p`` is this rank's coordinate on ``axis`` (every rank's, on a
    SimMesh); the other pieces are left as they are."""
    coord = np.asarray(mesh.coordinate(axis), dtype=np.int64)
    if coord.ndim == 0:
        lost[..., int(coord), :] += loss
        return lost
    rows = lost.view(-1, *lost.shape[-2:])
    mine = torch.tensor(coord.reshape(-1), device=lost.device)
    ranks = torch.arange(rows.shape[0], device=lost.device)
    rows.index_put_((ranks, mine), loss.reshape(-1, loss.shape[-1]), accumulate=True)
    return lost


def compressed_all_reduce(
    bucket: torch.Tensor,
    axis: str,
    mesh: Mesh,
    *,
    compress: Compress,
    op: str = "avg",
    residual: torch.Tensor | None = None,
    scatter: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """All-reduce one flat buffer over ``axis`` in a compressed format, summed in fp32.

    Each rank adds its residual and quantizes its contribution; ONE all-to-all moves the
    pieces (a reduce-scatter by pieces); each rank dequantizes its piece from every rank and
    sums in fp32; it quantizes the sum, and ONE all-gather returns it (not issued with
    ``scatter=True``). Both legs carry compressed bytes. Both collectives go through the mesh
    and are logged (``comm_log``: the wire dtype, numel with the scales).

    Args:
        bucket: this rank's flat buffer, ``(*mesh.batch_shape, L)`` (``(L,)`` on a
            DistMesh), floating. Not modified.
        axis: the mesh axis to reduce over.
        mesh: a :class:`SimMesh` or :class:`DistMesh`.
        compress: the policy (:func:`compress`).
        op: ``"avg"`` (default) or ``"sum"``.
        residual: the residual this call returned last time for this buffer (fp32, the
            bucket's shape), or None (zeros). Ignored without error feedback.
        scatter: return only this rank's chunk of the sum (``L / n`` long, uncompressed:
            a reduce-scatter, for an optimizer sharded over ``axis``); ``L`` must divide.

    Returns:
        ``(result, new_residual)``: ``result`` in the bucket's dtype, ``L`` long (or the
        chunk), the same on every rank of the group; ``new_residual`` what rounding lost on
        both legs (fp32, the bucket's shape), None without error feedback.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp": 2})
        >>> x = torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
        >>> out, res = fh.compressed_all_reduce(x, "dp", mesh, compress=fh.compress(torch.int8))
        >>> out[0]                                  # int8 rounding on both legs
        tensor([2.0039, 2.0039, 2.0000])
        >>> out[0] + res.mean(0)                    # what was lost is in the residual
        tensor([2., 2., 2.])
        >>> with fh.comm_log() as log:
        ...     _ = fh.compressed_all_reduce(x, "dp", mesh, compress=fh.compress(torch.int8))
        >>> [(e.op, str(e.dtype), e.numel) for e in log.events]
        [('all_to_all', 'torch.int8', 12), ('all_gather', 'torch.int8', 6)]
    """
    started = start(
        mesh, [bucket], axis=axis, compress=compress, op=op, scatter=scatter, residuals=[residual]
    )
    (out,), new = started.result()
    return out, (None if new is None else new[0])


def start(
    mesh: Mesh,
    buckets: list[torch.Tensor],
    *,
    axis: str,
    compress: Compress,
    op: str = "avg",
    scatter: bool = False,
    residuals: list[torch.Tensor | None] | None = None,
) -> CompressedInFlight:
    """:func:`compressed_all_reduce` of each of ``buckets`` (each checked as there), its
    first leg issued: every bucket encoded and its all-to-all in flight, not waited for.
    :meth:`CompressedInFlight.result` finishes (the fp32 sum, the all-gather, the decode),
    so the first leg's transfer overlaps whatever the caller does in between (DiLoCo's
    delayed compressed syncs). ``residuals``: per bucket, as ``residual``; ``op`` and
    ``scatter`` as there."""
    residuals = residuals or [None] * len(buckets)
    for x, r in zip(buckets, residuals, strict=True):
        _check(x, axis, mesh, compress=compress, op=op, residual=r)
    feedback = compress.error_feedback
    if not mesh.moves(axis):  # nothing travels, nothing is rounded
        outs = [
            (x + r.to(x.dtype) if feedback and r is not None else x).clone()
            for x, r in zip(buckets, residuals)
        ]
        kept = [torch.zeros_like(x, dtype=torch.float32) for x in buckets] if feedback else None
        return CompressedInFlight(mesh, done=(outs, kept))
    how = dict(axis=axis, compress=compress, op=op, scatter=scatter)
    return CompressedInFlight(mesh, **how).issue(buckets, residuals)


class CompressedInFlight:
    """A compressed all-reduce of some buckets with its first leg in flight (:func:`start`).
    :meth:`result` waits for the all-to-alls (an interrupt there leaves them to be waited
    for again), then runs the rest: the fp32 sums, the all-gathers and the decodes (not
    with ``scatter``). Once: a second call returns the same, or raises the same error."""

    def __init__(self, mesh: Mesh, *, done: tuple | None = None, **how: Any):
        self.mesh, self.how, self._out = mesh, how, done
        self._rest: list[list[Any]] = []
        self._first: list[Any] = []
        self._new: dict[int, torch.Tensor] = {}
        self._held: list[Any] = []  # the residuals in, until every bucket is encoded
        self._error: Exception | None = None

    @property
    def done(self) -> bool:
        """Whether the result is there (waited for, or nothing travelled)."""
        return self._out is not None

    def issue(self, buckets: list, residuals: list) -> CompressedInFlight:
        """Encode every bucket and issue its all-to-all (step-major, one scheduler run)."""
        self._held = list(residuals)
        for b, x in enumerate(buckets):
            items = program(
                self.how["compress"],
                self.how["axis"],
                self.mesh,
                op=self.how["op"],
                scatter=self.how["scatter"],
                length=x.shape[-1],
                residual_in=lambda b: self._held[b],
                residual_out=self._new.__setitem__,
            )
            self._first.append(items[:2])  # encode, the all-to-all
            self._rest.append(items[2:])  # the sum (and its encode), all-gather, decode
        self._first = run(self.mesh, self._first, lambda b: buckets[b])
        self._held = []  # read by the encodes only: not held while in flight
        return self

    def result(self) -> tuple[list, list | None]:
        """``(results, new residuals)``: per bucket, as :func:`compressed_all_reduce`'s
        (the residuals None without error feedback)."""
        if self._error is not None:
            raise self._error.with_traceback(None)
        if self._out is None:
            try:
                self._first = [self.mesh.wait(x) for x in self._first]  # an interrupt: again
            except Exception as exc:
                self._fail(exc)
                raise
            self._out = self._finish()
        return self._out

    def _fail(self, exc: Exception) -> None:
        """Keep ``exc`` for later calls and let go of whatever is still in flight (an
        error leaks no buffers)."""
        self._error = exc
        for x in self._first:
            self.mesh.abandon(x)
        self._first, self._rest = [], []

    def _finish(self) -> tuple[list, list | None]:
        """The second leg, from the first's waited results."""
        try:
            outs = run(self.mesh, self._rest, self._first.__getitem__)
            outs = [self.mesh.wait(x) for x in outs]
        except BaseException as exc:  # the legs' state is spent: this reduction cannot resume
            self._fail(
                exc
                if isinstance(exc, Exception)
                else RuntimeError(
                    f"a compressed reduction over {self.how['axis']!r} was interrupted in its "
                    "second leg (its collectives abandoned): it cannot be resumed"
                )
            )
            raise
        feedback = self.how["compress"].error_feedback
        new = [self._new[b] for b in range(len(outs))] if feedback else None
        self._first, self._rest = [], []
        return outs, new


def _check(bucket: Any, axis: str, mesh: Any, *, compress: Any, op: str, residual: Any) -> None:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"compressed_all_reduce: mesh must be a SimMesh or DistMesh; got {mesh!r}")
    mesh.size(axis)  # names the mesh's axes if it has no such axis
    if not isinstance(compress, Compress):
        raise TypeError(
            f"compressed_all_reduce: compress must be a policy from fh.compress(...); got "
            f"{compress!r}"
        )
    if op not in ("avg", "sum"):
        raise ValueError(f"compressed_all_reduce: op must be 'avg' or 'sum'; got {op!r}")
    batch = tuple(mesh.batch_shape)
    if (
        not isinstance(bucket, torch.Tensor)
        or not bucket.is_floating_point()
        or bucket.dim() != len(batch) + 1
        or tuple(bucket.shape[:-1]) != batch
    ):
        raise ValueError(
            f"compressed_all_reduce: bucket must be a floating tensor of shape "
            f"(*{batch}, L); got {getattr(bucket, 'shape', type(bucket).__name__)}"
        )
    if residual is not None and (
        not isinstance(residual, torch.Tensor) or residual.shape != bucket.shape
    ):
        raise ValueError(
            f"compressed_all_reduce: residual must be None or a tensor of the bucket's shape "
            f"{tuple(bucket.shape)}; got {getattr(residual, 'shape', type(residual).__name__)}"
        )

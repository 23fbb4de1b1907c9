"""The compressed reduction: quantize, all-to-all, sum in fp32, quantize, all-gather.

The one route to a compressed reduction over an axis, for the engine's ``outer_compress`` (a
plan bucket's deferred reduction, ``engine.start``) and DiLoCo's ``compress=`` (a fragment's
pieces side by side in a :class:`Packing`, :func:`start_packed`): both run the scheduler
items of :func:`program` (what each leg does); :func:`start` lets the first leg fly.

Invariant: the sum is in fp32, in source order, so every mesh gives the same bits; with error
feedback, what rounding lost stays with the rank that rounded it (the residual), so ``result +
mean(new residual) == mean(x)`` (``sum`` alike). The residual goes in and out as an argument:
this room keeps no state.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import einops
import numpy as np
import torch

from ..mesh import Mesh
from ..plan.recipe import Plan, Step
from ..spec.quantize import Compress
from .flight import InFlight
from .scheduler import run

__all__ = [
    "CompressedInFlight",
    "Packing",
    "Wire",
    "compressed_all_reduce",
    "program",
    "start",
    "start_packed",
]

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
    (per rank), for any bucket index. The bucket arrives in any floating dtype and leaves in
    it; the work is fp32. With ``policy.error_feedback``, ``residual_in(b)`` (fp32, the
    bucket's shape, or None for zeros) is added first and ``residual_out(b, r)`` receives the
    new residual before the last item returns.

    The bucket, ``L`` elements on an axis of ``n`` ranks, is cut into ``n`` pieces of ``P``
    (``ceil(L / n)``, the last padded with zeros); run by the one scheduler
    (:mod:`functional_hsdp.runtime.scheduler`), the items are:

    ==========================  ========================================================
    item                        what it does
    ==========================  ========================================================
    encode (local)              ``x = bucket + residual``; every piece quantized
    all-to-all (``Wire``)       piece ``p`` of every rank goes to rank ``p``: a
                                reduce-scatter by pieces, in compressed bytes
    reduce (local)              the ``n`` pieces decoded and summed in fp32 (in source
                                order, so every mesh gives the same bits), divided for
                                ``avg``; the sum quantized again (not with ``scatter``)
    all-gather (``Wire``)       every rank gets every piece of the sum, compressed
    decode (local)              the pieces decoded: the result, ``L`` long
    ==========================  ========================================================

    With ``scatter=True`` (the optimizer is sharded over the axis, hfsdp) the sum's piece is
    the result and the all-gather is not issued. Error feedback keeps what rounding lost on
    both legs, on the rank that rounded it: ``x - decode(encode(x))`` of the sender, plus, on
    the owner of piece ``p``, the loss of the sum's rounding (times ``n`` for ``avg``, since
    the residual is averaged with the next contributions). So over K steps, what was sent
    plus the last residual is the sum of the true contributions. ``comm_log`` reports each
    leg with the wire dtype of the policy (int4 as ``torch.uint8``) and its numel in that
    dtype, the scales included; on the mesh the bytes travel as uint8."""
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
    ``result()`` finishes (the fp32 sum, the all-gather, the decode), so the first leg's
    transfer overlaps whatever the caller does in between. ``residuals``: per bucket, as
    ``residual``; ``op`` and ``scatter`` as there."""
    how = dict(axis=axis, compress=compress, op=op, scatter=scatter)
    return _start(mesh, buckets, residuals or [None] * len(buckets), how=how)


def start_packed(
    pieces: list[torch.Tensor],
    packing: Packing,
    *,
    mesh: Mesh,
    axis: str,
    compress: Compress,
    cap: int,
    residual: list[torch.Tensor] | None = None,
) -> CompressedInFlight:
    """The average over ``axis`` of each rank's ``pieces`` (a tree's local leaves, as
    ``packing`` describes them), compressed, started: the pieces laid into ``packing``'s
    rows (fp32), cut into buckets of at most ``cap`` elements, and each bucket's first leg
    issued as by :func:`start`; ``residual`` (the pieces' fp32 residual, or None: zeros)
    added first. ``result()`` is ``(averages, new residual)``, per piece: the averages in
    the pieces' dtypes, the new residual fp32 (None without error feedback).

    DiLoCo's compressed sync (:mod:`functional_hsdp.diloco`) takes this route; the engine's
    ``outer_compress`` the plan's buckets (``engine.start``). Both run :func:`program`."""
    flat = packing.gather(pieces)
    res = None if residual is None else packing.gather(residual)
    cuts = [(lo, min(lo + cap, packing.length)) for lo in range(0, packing.length, cap)]
    dtypes = [x.dtype for x in pieces]

    def unpack(outs: list, kept: list | None) -> tuple[list, list | None]:
        avg = [x.to(d) for x, d in zip(packing.scatter(outs), dtypes)]
        return avg, None if kept is None else packing.scatter(kept)

    how = dict(axis=axis, compress=compress, op="avg", scatter=False)
    rows = [flat[..., lo:hi] for lo, hi in cuts]
    held = [None] * len(cuts) if res is None else [res[..., lo:hi] for lo, hi in cuts]
    return _start(mesh, rows, held, how=how, unpack=unpack)


def _start(mesh: Mesh, buckets: list, residuals: list, *, how: dict, unpack: Any = None):
    """:func:`start`, its ``result()`` given to ``unpack(results, new residuals)`` first."""
    axis, compress = how["axis"], how["compress"]
    for x, r in zip(buckets, residuals, strict=True):
        _check(x, axis, mesh, compress=compress, op=how["op"], residual=r)
    if not mesh.moves(axis):  # nothing travels, nothing is rounded
        feedback = compress.error_feedback
        outs = [
            (x + r.to(x.dtype) if feedback and r is not None else x).clone()
            for x, r in zip(buckets, residuals)
        ]
        kept = [torch.zeros_like(x, dtype=torch.float32) for x in buckets] if feedback else None
        done = (outs, kept) if unpack is None else unpack(outs, kept)
        return CompressedInFlight(mesh, how=how, waited=True, result=done)
    return CompressedInFlight(mesh, how=how, unpack=unpack).issue(buckets, residuals)


class CompressedInFlight(InFlight[tuple]):
    """A compressed all-reduce of some buckets with its first leg in flight (:func:`start`).
    Its ``result()`` (:class:`~functional_hsdp.runtime.flight.InFlight`'s: once, an error kept)
    waits for the all-to-alls (an interrupt there leaves them to be waited for again), then
    runs the rest: the fp32 sums, the all-gathers and the decodes (not with ``scatter``).
    An interrupt in that second leg, whose state is then spent, keeps a ``RuntimeError``
    saying so. ``unpack``: what the ``(results, new residuals)`` are given to (a packing's
    pieces, :func:`start_packed`)."""

    def __init__(
        self,
        mesh: Mesh,
        *,
        how: dict,
        unpack: Any = None,
        waited: bool = False,
        result: Any = None,
    ):
        super().__init__(waited=waited, result=result)
        self.mesh, self.how, self._unpack = mesh, how, unpack
        self._rest: list[list[Any]] = []
        self._first: list[Any] = []
        self._new: dict[int, torch.Tensor] = {}
        self._held: list[Any] = []  # the residuals in, until every bucket is encoded

    def issue(self, buckets: list, residuals: list) -> CompressedInFlight:
        """Encode every bucket and issue its all-to-all (step-major, one scheduler run)."""
        self._held = list(residuals)
        for x in buckets:
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

    def _wait(self) -> tuple[list, list | None]:
        """``(results, new residuals)``: per bucket, as :func:`compressed_all_reduce`'s
        (the residuals None without error feedback), or as ``unpack`` makes them."""
        self._first = [self.mesh.wait(x) for x in self._first]  # an interrupt: again
        outs, new = self._finish()
        return (outs, new) if self._unpack is None else self._unpack(outs, new)

    def _release(self) -> None:
        """Let go of whatever is still in flight (an error leaks no buffers)."""
        for x in self._first:
            self.mesh.abandon(x)
        self._first, self._rest = [], []

    def _finish(self) -> tuple[list, list | None]:
        """The second leg, from the first's waited results."""
        try:
            outs = run(self.mesh, self._rest, self._first.__getitem__)
            outs = [self.mesh.wait(x) for x in outs]
        except BaseException as exc:  # an error: kept by result(), which lets go of the rest
            if not isinstance(exc, Exception):  # the legs' state is spent: it cannot resume
                self._fail(
                    RuntimeError(
                        f"a compressed reduction over {self.how['axis']!r} was interrupted in "
                        "its second leg (its collectives abandoned): it cannot be resumed"
                    )
                )
            raise
        feedback = self.how["compress"].error_feedback
        new = [self._new[b] for b in range(len(outs))] if feedback else None
        self._first, self._rest = [], []
        return outs, new


class Packing:
    """Where a tree's local pieces sit in compressed buckets of their own (:func:`start_packed`):
    per rank, its elements of the pieces, in tree order, side by side (no alignment gaps, no
    SimMesh fill), each rank's row zero-padded to ``length``, the longest rank's, so that every
    group of the axis runs the same program and a SimMesh gives a DistMesh's bits. Built once
    per tree (:meth:`of`), from the plan's own geometry.

    Attributes:
        index: ``(*batch, length)`` int64: the position of each bucket element in the
            pieces laid end to end (their flattened local values, SimMesh fill included);
            the total width for padding (a zero appended there).
        shapes: the pieces' local shapes (batch dims in front).
        length: elements of every rank's row.
        whole: every element of the pieces is this rank's (a DistMesh: no fill), so the
            row is the pieces laid end to end, then zeros: copies and views, no index.
    """

    def __init__(self, index: torch.Tensor, shapes: list, length: int, *, whole: bool):
        self.index, self.shapes, self.length, self.whole = index, shapes, length, whole
        self.widths = [math.prod(s[index.dim() - 1 :]) for s in shapes]
        self.width = sum(self.widths)  # the pieces' elements laid end to end

    @classmethod
    def of(cls, plan: Plan, leaves: list[torch.Tensor], *, role: str, members: list) -> Packing:
        """The packing of the leaves ``members`` (tree indices) of ``leaves``, local values at
        ``role`` of ``plan``: which elements of each piece are this rank's (its mesh's fill
        is not) comes from packing ones and unpacking them; the longest row from the plan,
        for every rank of the mesh (:meth:`~functional_hsdp.plan.recipe.Plan.held`)."""
        with torch.no_grad():
            ones = [torch.ones_like(x) for x in leaves]
            bufs = [plan.pack(b, ones, role) for b in range(len(plan.buckets))]
            masks = plan.unpack(bufs, role)
        lead = plan.mesh.batch_shape
        real = torch.cat([masks[i].reshape(*lead, -1) != 0 for i in members], -1)
        width, length = real.shape[-1], int(plan.held(role, set(members)).max())
        real = torch.nn.functional.pad(real, (0, max(length - width, 0)))  # a short row
        first = torch.argsort((~real).to(torch.uint8), dim=-1, stable=True)[..., :length]
        mine = torch.arange(length, device=real.device) < real.sum(-1, keepdim=True)
        index = torch.where(mine, first, width)
        shapes = [tuple(masks[i].shape) for i in members]
        # a DistMesh's pieces hold no fill (checked: one host read, once per tree)
        whole = not lead and bool(real[..., :width].all())
        return cls(index, shapes, length, whole=whole)

    def gather(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The rows, fp32, from pieces of ``shapes``."""
        lead, width = self.index.shape[:-1], self.width
        flat = [x.reshape(*lead, w).float() for x, w in zip(pieces, self.widths)]
        if self.whole:  # one buffer, written once (gather and its index cost 3 passes)
            row = torch.empty(*lead, self.length, device=self.index.device)
            torch.cat(flat, -1, out=row.narrow(-1, 0, width))
            row.narrow(-1, width, self.length - width).zero_()
            return row
        row = torch.cat([*flat, torch.zeros(*lead, 1, device=self.index.device)], -1)
        return torch.gather(row, -1, self.index)  # (take_along_dim: a remainder pass more)

    def scatter(self, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """Pieces of ``shapes`` (fp32, zero fill) from the rows (cut in buckets, in order);
        ``whole``: views of the rows' buffer."""
        lead, width = self.index.shape[:-1], self.width
        if self.whole and rows:
            row = (torch.cat(rows, -1) if len(rows) > 1 else rows[0]).float()
            parts = row.narrow(-1, 0, width).split(self.widths, -1)
            return [x.reshape(s) for x, s in zip(parts, self.shapes)]
        out = torch.zeros(*lead, width + 1, device=self.index.device)
        if rows:
            out.scatter_(-1, self.index, torch.cat(rows, -1).float())
        parts = out.narrow(-1, 0, width).split(self.widths, -1)
        return [x.reshape(s) for x, s in zip(parts, self.shapes)]


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

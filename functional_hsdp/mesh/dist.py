"""DistMesh: a real ``torch.distributed`` device mesh (gloo, NCCL; torchrun for many machines).

Collectives are ``torch.distributed._functional_collectives`` over ``(device_mesh, dim)``:
asynchronous and traceable by ``torch.compile``. On gloo, eager collectives are asynchronous
c10d calls with a ``Work`` handle instead: reductions are in-place all-reduces of the
library's own buffers, all-gathers c10d's single-tensor all-gather (see ``BACKENDS``).
Names that differ between torch releases come from :mod:`functional_hsdp.base.torch_releases`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ..base.errors import collective_error
from ..base.torch_releases import (
    c10d_all_gather_single,
    funcol_all_gather_single,
    funcol_reduce_scatter_single,
)
from .protocol import Flight, MeshAxes

__all__ = ["DistMesh", "backend_of"]

#: the mesh ``DistMesh(device_mesh, replicas=ft)`` makes: :class:`~.replicas.ReplicaMesh`, which
#: registers itself here when :mod:`functional_hsdp.mesh` is imported (it builds on this module)
REPLICA_MESH: list = []


@dataclass(frozen=True)
class Carriage:
    """How one backend's groups carry the library's collectives in eager code.

    Attributes:
        native_avg: its all-reduce / reduce-scatter implement AVG; otherwise AVG is emulated
            exactly (SUM, then a division by the group size).
        in_place: reductions are asynchronous in-place c10d all-reduces of the library's own
            buffers (a reduce-scatter keeps this rank's chunk) instead of functional
            collectives.
        c10d_gather: all-gathers (and all-to-alls) are c10d ``all_gather_single`` (and
            ``all_to_all_single``) with ``async_op=True``, the output, input and Work held
            until waited, instead of the functional collectives.
    """

    native_avg: bool
    in_place: bool
    c10d_gather: bool


# Per backend, as ``dist.get_backend_config`` names it for the mesh's device type.
#
# gloo: it implements AVG (SUM then divide: bitwise the emulation). It has no native
# reduce-scatter: torch emulates one with an all-reduce into a new buffer and a copy of the
# chunk. All-reducing the library's own packing buffer in place and keeping the chunk moves
# the same bytes 1.6-2x faster at 10M-50M elements, with no full-size temporary (bench
# ``rsimpl``). And several functional all-gathers in flight at once corrupt the heap now and
# then (torch 2.13, CPU): 4 ranks of 3,000 rounds of 6 functional all-gathers each, waited
# after the round, crashed (SIGSEGV, "malloc(): unaligned tcache chunk detected") in 6 of 8
# runs; the same rounds with c10d async all-gathers in none of 6 (``python -m
# bench.mesh.gloo_allgather`` reproduces it). Traced by torch.compile, collectives on gloo stay
# functional and an all-gather is waited at issue.
#
# nccl, and every backend under torch.compile: the functional collectives (a real
# reduce-scatter, asynchronous and traceable). Any other backend: functional collectives with
# AVG emulated.
BACKENDS: dict[str, Carriage] = {
    "gloo": Carriage(native_avg=True, in_place=True, c10d_gather=True),
    "nccl": Carriage(native_avg=True, in_place=False, c10d_gather=False),
}
OTHER = Carriage(native_avg=False, in_place=False, c10d_gather=False)
assert all(c.native_avg for c in BACKENDS.values() if c.in_place), (
    "the in-place path reduces with the backend's own AVG"
)


def backend_of(group: Any, device_type: str) -> str:
    """The backend that carries ``device_type`` tensors on ``group``, however the group was
    made: ``init_process_group("gloo")`` names one backend (``"gloo"``), while the default
    group that ``init_device_mesh`` makes has a backend per device (``"cpu:gloo,cuda:nccl"``,
    for which ``dist.get_backend`` says ``"undefined"``). ``"undefined"`` if none is found."""
    try:
        config = str(dist.get_backend_config(group))
    except (AttributeError, RuntimeError, ValueError):  # torch without per-device configs
        return str(dist.get_backend(group)).lower()
    for part in config.split(","):
        device, sep, name = part.strip().partition(":")
        if not sep:  # one backend for every device
            return device.lower()
        if device == device_type:
            return name.lower()
    return "undefined"


def _release_functional(out: torch.Tensor) -> None:
    try:  # torch keeps an unwaited functional result (and its Work) until it is waited
        funcol.wait_tensor(out)
    except Exception:  # noqa: BLE001 - released on an error path: the caller reports that
        pass


def _functional(flight: Flight) -> Flight:
    """``flight`` (a functional collective's result) released when it is abandoned, or
    dropped without a wait (a finalizer: no path leaves it in torch's registry)."""
    flight.release = weakref.finalize(flight, _release_functional, flight.buffer)
    flight.release.atexit = False
    return flight


def _carries_cpu(group: Any) -> bool:
    """Whether ``group`` can all-gather CPU tensors (a gloo backend for the CPU)."""
    return backend_of(group, "cpu") == "gloo"


class DistMesh(MeshAxes):
    """A real ``torch.distributed`` device mesh (gloo, NCCL; torchrun for many machines).

    Args:
        device_mesh: a ``DeviceMesh`` built with ``mesh_dim_names``; its dims are the axes,
            outer to inner.
        overlap: True (default): collectives are asynchronous; the library issues every
            bucket's collective before it waits on any, so buckets overlap each other and
            packing. False: each collective is waited for as soon as it is issued (for
            debugging, and to measure what overlap gains).
        timeout: the longest wait for one collective (seconds or a ``timedelta``), after
            which :class:`~functional_hsdp.CollectiveError` names it. Default: the timeout the
            default process group was made with (``init_process_group(timeout=...)``), which
            the groups ``init_device_mesh`` makes do not inherit. It bounds the library's own
            waits (gloo's in-place reductions, the cross-rank check); a functional
            collective's wait (NCCL) is bounded by its group's own timeout (watchdog).
        issue_size_one: False (default): an axis of one rank moves nothing (its collectives
            would be identities). True: they are issued anyway (a reduction there with SUM,
            the identity on one rank, where AVG would divide by 1), so that one GPU runs the
            whole communication path: NCCL's streams, the waits, the buffers' lifetimes.
            For checking a device, not for training (it only adds work).
        replicas: a fault-tolerant replica axis (:func:`~functional_hsdp.fault_tolerant`):
            the mesh is then a :class:`~functional_hsdp.mesh.replicas.ReplicaMesh`, that axis
            first (its size the quorum's participants), then ``device_mesh``'s axes, which
            span this replica group only.

    Example:
        >>> import functional_hsdp as fh
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> dm = init_device_mesh(  # doctest: +SKIP
        ...     "cuda", (2, 4), mesh_dim_names=("dp_outer", "dp_inner"))
        >>> mesh = fh.DistMesh(dm)  # doctest: +SKIP
    """

    batch_shape: tuple[int, ...] = ()

    def __new__(cls, device_mesh: Any = None, *, replicas: Any = None, **options: Any) -> Any:
        if replicas is not None:  # the replica axis of fh.fault_tolerant first, then the group's
            return REPLICA_MESH[0](device_mesh, replicas=replicas, **options)
        return super().__new__(cls)

    def __init__(
        self,
        device_mesh: Any,
        *,
        overlap: bool = True,
        timeout: Any = None,
        issue_size_one: bool = False,
        replicas: Any = None,
    ):
        for name, flag in (("overlap", overlap), ("issue_size_one", issue_size_one)):
            if not isinstance(flag, bool):
                raise TypeError(f"DistMesh: {name} must be a bool; got {flag!r}")
        self.overlap, self.issue_size_one = overlap, issue_size_one
        self.timeout = _as_timedelta(timeout, device_mesh)
        names = getattr(device_mesh, "mesh_dim_names", None)
        if names is None:
            raise ValueError(
                "DistMesh needs a DeviceMesh with mesh_dim_names, e.g. "
                "init_device_mesh('cuda', (2, 4), mesh_dim_names=('dp_outer', 'dp_inner'))"
            )
        self.device_mesh = device_mesh
        self.axis_names = tuple(names)
        self.sizes = tuple(int(n) for n in device_mesh.shape)
        device_type = device_mesh.device_type
        #: per axis: the backend of its group for the mesh's device type
        self.backends = tuple(
            backend_of(device_mesh.get_group(d), device_type) for d in range(self.ndim)
        )
        self._carriage = tuple(BACKENDS.get(b, OTHER) for b in self.backends)
        self._coords = tuple(int(device_mesh.get_local_rank(d)) for d in range(self.ndim))
        self.geometry = RankGeometry(self)
        self.diagnostics = DistDiagnostics(self)

    def __repr__(self) -> str:
        options = ("" if self.overlap else ", overlap=False") + (
            ", issue_size_one=True" if self.issue_size_one else ""
        )
        return f"DistMesh({self.shape}{options})"

    def coordinate(self, axis: str) -> int:
        """This rank's index along ``axis``."""
        return self._coords[self._dim(axis)]

    def group(self, axis: str) -> Any:
        """The process group of ``axis``."""
        return self.device_mesh.get_group(self._dim(axis))

    def carriage(self, axis: str) -> Carriage:
        """How ``axis``'s backend carries collectives in eager code (see :data:`BACKENDS`)."""
        return self._carriage[self._dim(axis)]

    def _in_place(self, axis: str) -> bool:
        return self.carriage(axis).in_place and not torch.compiler.is_compiling()

    def _reduction(self, name: str, fn: Callable[[str], torch.Tensor], *, axis: str, op: str):
        """A functional reduction ``fn(op)``. Where the backend lacks AVG it is emulated
        exactly: SUM on the wire, and the division applied when the result is waited (eager:
        the sum stays in flight) or at once (traced)."""
        emulate = op == "avg" and not self.carriage(axis).native_avg
        with self.guard(name, axis):
            out = fn("sum" if emulate else op)
        n = self.size(axis) if emulate else None
        if torch.compiler.is_compiling():  # traced: funcol's own tensors, waited by wait()
            return out / n if n else out
        return self._issued(_functional(Flight(name, axis, buffer=out, divide=n)))

    def _op(self, axis: str, op: str) -> str:
        # one rank's AVG is its SUM: issued as SUM (size-1 axes carry collectives only with
        # issue_size_one, for a device check), so no backend divides by 1
        return "sum" if self.size(axis) == 1 else op

    def all_reduce(self, buf: torch.Tensor, axis: str, op: str) -> torch.Tensor | Flight:
        """All-reduce over ``axis`` (in place on gloo)."""
        op = self._op(axis, op)
        if self._in_place(axis):
            return self._issue_in_place(buf, axis, op=op, name="all_reduce")
        group = (self.device_mesh, self._dim(axis))
        reduce = lambda o: funcol.all_reduce(buf, o, group)  # noqa: E731
        return self._reduction("all_reduce", reduce, axis=axis, op=op)

    def reduce_scatter(self, buf: torch.Tensor, axis: str, op: str) -> torch.Tensor | Flight:
        """Reduce-scatter over ``axis``. On gloo an in-place all-reduce of ``buf`` whose
        waited result is this rank's chunk as a view of it (a borrowed result), so that a
        consumer that makes a new tensor anyway (adding acc, MainGrad's add) copies nothing."""
        op = self._op(axis, op)
        if self._in_place(axis):
            return self._issue_in_place(buf, axis, op=op, name="reduce_scatter")
        group = (self.device_mesh, self._dim(axis))
        reduce = lambda o: funcol_reduce_scatter_single(buf, o, 0, group)  # noqa: E731
        return self._reduction("reduce_scatter", reduce, axis=axis, op=op)

    def all_gather(self, buf: torch.Tensor, axis: str) -> torch.Tensor | Flight:
        """All-gather over ``axis`` (functional collective; c10d on gloo, see
        :data:`BACKENDS`)."""
        d = self._dim(axis)
        gloo_like = self.carriage(axis).c10d_gather
        if gloo_like and not torch.compiler.is_compiling():
            out = buf.new_empty(self.sizes[d] * buf.shape[0], *buf.shape[1:])
            if not out.numel():  # gloo divides by the size (SIGFPE); every rank skips alike
                return out
            with self.guard("all_gather", axis):
                work = c10d_all_gather_single(
                    out, buf.contiguous(), group=self.group(axis), async_op=True
                )
            return self._issued(Flight("all_gather", axis, buffer=out, work=work, source=buf))
        with self.guard("all_gather", axis):
            out = funcol_all_gather_single(buf, 0, (self.device_mesh, d))
            if gloo_like:  # traced on gloo: waited at issue, never several in flight
                out = funcol.wait_tensor(out)
        if torch.compiler.is_compiling():
            return out
        return self._issued(_functional(Flight("all_gather", axis, out)))

    def all_to_all(
        self, buf: torch.Tensor, axis: str, *, counts: Any, length: int
    ) -> torch.Tensor | Flight:
        """All-to-all over ``axis`` with uneven blocks (c10d's ``all_to_all_single`` on gloo,
        the functional collective elsewhere; see :class:`~functional_hsdp.Mesh`)."""
        d, me = self._dim(axis), self._coords
        send = [int(c) for c in counts[me]]
        recv = [int(counts[(*me[:d], s, *me[d + 1 :])][me[d]]) for s in range(self.sizes[d])]
        src = buf.narrow(-1, 0, sum(send))
        if self.carriage(axis).c10d_gather and not torch.compiler.is_compiling():
            out = buf.new_empty(length)
            out.narrow(0, sum(recv), length - sum(recv)).zero_()
            with self.guard("all_to_all", axis):
                work = dist.all_to_all_single(
                    out.narrow(0, 0, sum(recv)),
                    src,
                    output_split_sizes=recv,
                    input_split_sizes=send,
                    group=self.group(axis),
                    async_op=True,
                )
            return self._issued(Flight("all_to_all", axis, out, work=work, source=buf))
        with self.guard("all_to_all", axis):  # its result ends after the blocks
            out = funcol.all_to_all_single(src, recv, send, (self.device_mesh, d))
        if torch.compiler.is_compiling():
            return torch.nn.functional.pad(out, (0, length - sum(recv)))
        return self._issued(_functional(Flight("all_to_all", axis, buffer=out, length=length)))

    def _issue_in_place(self, buf: torch.Tensor, axis: str, *, op: str, name: str) -> Flight:
        # ``buf`` is always one of the library's own buffers (a fresh packing buffer, a
        # collective's result or MainGrad's buffer), never a caller's tensor.
        with self.guard(name, axis):
            work = dist.all_reduce(
                buf,
                op=dist.ReduceOp.AVG if op == "avg" else dist.ReduceOp.SUM,
                group=self.group(axis),
                async_op=True,
            )
        return self._issued(
            Flight(name, axis, buffer=buf, work=work, chunk=name == "reduce_scatter")
        )

    def _issued(self, flight: Flight) -> torch.Tensor | Flight:
        """A collective just issued: held in flight, or waited at once without overlap."""
        return flight if self.overlap else self.wait(flight)

    def wait(self, x: torch.Tensor | Flight) -> torch.Tensor:
        """The result of ``x``; CollectiveError naming the collective if it failed."""
        if not isinstance(x, Flight):
            if isinstance(x, funcol.AsyncCollectiveTensor):  # traced code's results
                return funcol.wait_tensor(x)
            return x
        with self.guard(x.op, x.axis):
            if x.work is not None:
                x.work.wait(self.timeout) if self.timeout is not None else x.work.wait()
                buf = x.buffer
            else:
                if x.release is not None:
                    x.release.detach()
                buf = funcol.wait_tensor(x.buffer)
        x.source = None
        if x.divide:  # AVG emulated: the sum arrived; the buffer is the collective's own
            buf, x.divide = buf.div_(x.divide), None  # once: a second wait returns it as is
        if x.length is not None and buf.shape[-1] < x.length:  # an all-to-all's blocks only
            buf = torch.nn.functional.pad(buf, (0, x.length - buf.shape[-1]))
        if x.chunk:
            n = self.size(x.axis)
            return buf.view(n, buf.shape[-1] // n).select(0, self.coordinate(x.axis))
        return buf

    def abandon(self, x: torch.Tensor | Flight) -> None:
        """Release a collective whose result will never be read. A c10d collective (gloo) is
        dropped: the backend holds its buffers until it completes. A functional collective is
        waited (on NCCL that only makes the current stream wait; the host goes on), since
        torch keeps every unwaited functional result alive until the process exits. Its
        error, if any, is not reported: the caller is raising another, or none is owed."""
        if not isinstance(x, Flight):
            return
        if x.release is not None and x.release.alive:
            x.release()
        x.source = None

    # A failed or timed-out collective raises CollectiveError naming it (op, axis): at issue,
    # or (gloo, usually) at the wait.

    @contextlib.contextmanager
    def guard(self, op: str, axis: Any) -> Iterator[None]:
        """Turn a RuntimeError of collective ``op`` on ``axis`` into a CollectiveError."""
        try:
            yield
        except RuntimeError as e:
            timeout = self._timeout(axis)
            rank = dist.get_rank()
            raise collective_error(op, axis, self, exc=e, rank=rank, timeout=timeout) from e

    def _timeout(self, axis: Any) -> Any:
        """The wait bound named in errors: the mesh's, else the axis group's own."""
        if self.timeout is not None or not isinstance(axis, str):
            return self.timeout
        try:  # private API; the message just omits the timeout without it
            device = torch.device(self.device_mesh.device_type)
            return self.group(axis)._get_backend(device).options._timeout
        except Exception:
            return None


def _as_timedelta(timeout: Any, device_mesh: Any) -> timedelta | None:
    """``timeout`` as a timedelta; by default the default process group's."""
    if isinstance(timeout, timedelta):
        return timeout
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise TypeError(
                f"DistMesh: timeout must be a positive number of seconds; got {timeout!r}"
            )
        return timedelta(seconds=timeout)
    try:  # private API: without it, waits are bounded by each group's own timeout
        device = torch.device(device_mesh.device_type)
        return dist.group.WORLD._get_backend(device).options._timeout
    except Exception:
        return None


class RankGeometry:
    """Geometry on a DistMesh: coordinates are ints, pieces are exact-length views."""

    views = True

    def __init__(self, mesh: DistMesh):
        self._mesh = mesh

    def chunk(self, buf: torch.Tensor, axis: str) -> torch.Tensor:
        # A copy, so that a rank's shards do not keep the whole buffer alive.
        n = self._mesh.size(axis)
        return buf.view(n, buf.shape[-1] // n).select(0, self._mesh.coordinate(axis)).clone()

    def pieces(self, start: int, ranges: list[tuple[int, int]], length: int) -> tuple[int, ...]:
        # Consecutive leaves' pieces tile the chunk from 0 (pieces outside it are empty).
        sizes = []
        for offset, numel in ranges:
            lo = min(max(offset - start, 0), length)
            sizes.append(max(lo, min(max(offset + numel - start, 0), length)) - lo)
        return (*sizes, length - sum(sizes))  # the last entry is the tail

    def piece_shapes(self, pieces: tuple[int, ...]) -> list[tuple[int, ...]]:
        return [(n,) for n in pieces[:-1]]

    def split(self, buf: torch.Tensor, pieces: tuple[int, ...]) -> list[torch.Tensor]:
        return list(torch.split(buf, pieces))[:-1]

    def join(
        self,
        values: list[torch.Tensor],
        pieces: tuple[int, ...],
        *,
        dtype: torch.dtype,
        device: Any,
    ) -> torch.Tensor:
        return torch.cat([*values, torch.zeros(pieces[-1], dtype=dtype, device=device)])

    def chunk_length(self, total: int, size: int, axis: str) -> int:
        return min(max(total - self._mesh.coordinate(axis) * size, 0), size)

    def narrow(self, x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
        return x.narrow(dim, 0, length)

    def narrow_shape(self, shape: tuple[int, ...], dim: int, length: int) -> tuple[int, ...]:
        return tuple(length if k == dim else n for k, n in enumerate(shape))


class DistDiagnostics:
    """Descriptions, and the cross-rank check's exchange, on a DistMesh.

    The exchange runs on the host: its rows are CPU tensors, all-gathered over a gloo group
    that spans the mesh, so it never touches device data and the host never waits for the
    device. That group is the default group when the mesh is the whole world and the default
    group has a gloo backend for CPU tensors (``init_process_group("gloo")``, or the
    ``"cpu:gloo,cuda:nccl"`` group that ``init_device_mesh`` makes); otherwise a gloo group
    made once, when the mesh is (a flattened view of the ``DeviceMesh`` with backend
    ``"gloo"``, as torch's checkpointing keeps a gloo group for its metadata beside NCCL).

    :meth:`start_max` runs over the same group in point-to-point messages of its own tags
    (from ``TAG``); a collective's messages never carry them.
    """

    TAG = 0x6668_0000

    def __init__(self, mesh: DistMesh):
        self._mesh = mesh
        dm = mesh.device_mesh
        ranks = dm.mesh.flatten().tolist()  # global ranks, in row-major mesh order
        if sorted(ranks) == list(range(dist.get_world_size())) and _carries_cpu(dist.group.WORLD):
            self.group = None  # the default group
        else:
            self.group = _host_group(dm, ranks)
        # the group gathers in global-rank order; rows are handed out in mesh order
        place = {r: k for k, r in enumerate(sorted(ranks))}
        self._order = torch.tensor([place[r] for r in ranks])
        self._size = len(ranks)
        self._rounds = self._doubling(ranks.index(dist.get_rank()), ranks)
        self._axes = mesh.axis_names
        self._within: dict[tuple[str, ...], DistScope] = {}

    def within(self, axes: tuple[str, ...]) -> DistScope:
        """The exchange among this rank's group over ``axes`` only (made once per axes)."""
        scope = self._within.get(tuple(axes))
        if scope is None:
            scope = self._within[tuple(axes)] = DistScope(self, tuple(axes))
        return scope

    @staticmethod
    def _doubling(k: int, ranks: list[int]) -> list[tuple[int | None, int | None, int]]:
        """The rounds of :meth:`start_max` for the ``k``-th rank of ``ranks``: (send to,
        receive from, tag offset) each, as global ranks. Recursive doubling among the first
        ``m`` (the largest power of two <= n): in round i, rank k and rank k ^ 2**i swap
        their maxima so far. Each of the other n - m ranks first hands its row to a twin
        among the first and gets the maximum back from it at the end."""
        n = len(ranks)
        m = 1 << (n.bit_length() - 1)
        last = m.bit_length()  # the tag offset of the twin's answer
        if k >= m:
            return [(ranks[k - m], None, 0), (None, ranks[k - m], last)]
        twin = ranks[k + m] if k + m < n else None
        rounds = [(None, twin, 0)] if twin is not None else []
        rounds += [(ranks[k ^ (1 << i)], ranks[k ^ (1 << i)], 1 + i) for i in range(last - 1)]
        return rounds + ([(twin, None, last)] if twin is not None else [])

    def describe(self, op: str, axis: str, reduce: str | None) -> str:
        carriage = self._mesh.carriage(axis)
        if op in ("all_gather", "all_to_all"):
            return f"c10d {op}_single" if carriage.c10d_gather else "native"
        if carriage.in_place:
            return "c10d in-place " + ("all_reduce+slice" if op == "reduce_scatter" else op)
        if reduce == "avg" and not carriage.native_avg:
            return "sum+div"
        return "native"

    def start_max(self, t: torch.Tensor) -> Callable[[], torch.Tensor]:
        # Recursive doubling in point-to-point messages (see _doubling): every rank sends and
        # receives one row per round, in log2(mesh size) rounds (two more on a mesh whose
        # size is not a power of two), where gloo's all-gather and all-reduce take as many
        # steps as the mesh has ranks (rings) and the all-gather moves a row per rank. The
        # first round is issued now; the others, which need its result, when waited for.
        mesh, axes, rounds = self._mesh, self._axes, self._rounds
        acc = t.reshape(-1).to("cpu", copy=True)  # this rank's maximum so far
        with mesh.guard("exchange", axes):
            first = self._post(acc, *rounds[0]) if rounds else None

        def wait() -> torch.Tensor:
            with mesh.guard("exchange", axes):
                for r, step in enumerate(rounds):
                    self._fold(acc, first if r == 0 else self._post(acc, *step))
            return acc.view(t.shape)

        return wait

    def _post(self, acc: torch.Tensor, to: int | None, frm: int | None, tag: int) -> tuple:
        """Issue one round: send ``acc`` to ``to``, receive a row from ``frm`` (either None)."""
        works, got = [], None
        if to is not None:
            works.append(dist.isend(acc, to, group=self.group, tag=self.TAG + tag))
        if frm is not None:
            got = torch.empty_like(acc)
            works.append(dist.irecv(got, frm, group=self.group, tag=self.TAG + tag))
        return works, got

    def _fold(self, acc: torch.Tensor, posted: tuple) -> None:
        """Wait for a round (its send too: ``acc`` is not changed while it is read) and fold
        the row received into ``acc``."""
        works, got = posted
        timeout = self._mesh.timeout
        for work in works:
            if not (work.wait(timeout) if timeout is not None else work.wait()):
                raise RuntimeError(f"no answer within the timeout ({timeout})")
        if got is not None:
            torch.maximum(acc, got, out=acc)

    def start_exchange(self, t: torch.Tensor) -> Callable[[], torch.Tensor]:
        # The list form of the c10d all-gather (c10d::allgather_), which no gradient
        # collective uses, so that profiles of the gradient collectives stay exact;
        # asynchronous, so that the caller packs meanwhile.
        mesh, axes = self._mesh, self._mesh.axis_names
        row = t.reshape(-1).cpu().contiguous()  # host data already: no copy
        parts = [torch.empty_like(row) for _ in range(self._size)]
        with mesh.guard("exchange", axes):
            work = dist.all_gather(parts, row, group=self.group, async_op=True)

        def wait() -> torch.Tensor:
            with mesh.guard("exchange", axes):
                work.wait(mesh.timeout) if mesh.timeout is not None else work.wait()
            return torch.stack(parts)[self._order]

        return wait

    def exchange(self, t: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        # One all-gather over the whole mesh, then this rank's group over ``axes``: every
        # rank of the mesh takes part whatever ``axes`` are (all ranks take the same path).
        mesh = self._mesh
        table = self.start_exchange(t)().view(*mesh.sizes, -1)
        index = tuple(
            slice(None) if a in axes else c for a, c in zip(mesh.axis_names, mesh._coords)
        )
        return table[index].reshape(-1, table.shape[-1])

    def members(self, axes: tuple[str, ...]) -> list[tuple[str, ...]]:
        mesh = self._mesh
        dims = {mesh.axis_names.index(a) for a in axes}
        index = tuple(slice(None) if d in dims else c for d, c in enumerate(mesh._coords))
        return [tuple(str(r) for r in mesh.device_mesh.mesh[index].flatten().tolist())]


class DistScope(DistDiagnostics):
    """The validation exchange among the ranks of this rank's group over ``axes`` only: a
    replicas spec's agreement (:func:`~functional_hsdp.replicas`), which nothing may carry
    across the replica axes. The same point-to-point messages as :meth:`start_max`, over the
    mesh's host group (no group of its own is made), with tags of their own; the exchange of
    rows is a maximum too, each rank's row in its own place of a table filled with the
    smallest int64 (the rows are int64)."""

    TAG = DistDiagnostics.TAG + 0x100

    def __init__(self, diagnostics: DistDiagnostics, axes: tuple[str, ...]):
        mesh = diagnostics._mesh
        self._mesh, self.group, self._axes = mesh, diagnostics.group, axes
        dims = [mesh.axis_names.index(a) for a in axes]
        index = tuple(slice(None) if d in dims else c for d, c in enumerate(mesh._coords))
        sub = mesh.device_mesh.mesh[index]
        self._sizes = tuple(sub.shape)
        self._ranks = sub.flatten().tolist()  # global ranks, in row-major order of axes
        self._size = len(self._ranks)
        self._rounds = self._doubling(self._ranks.index(dist.get_rank()), self._ranks)
        self._within = {}

    def start_exchange(self, t: torch.Tensor) -> Callable[[], torch.Tensor]:
        row = t.reshape(-1).cpu()
        if row.dtype != torch.int64:
            raise TypeError(f"DistScope.start_exchange: int64 rows only; got {row.dtype}")
        table = torch.full((self._size, row.numel()), torch.iinfo(torch.int64).min)
        table[self._ranks.index(dist.get_rank())] = row
        return self.start_max(table)

    def exchange(self, t: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        mesh = self._mesh
        table = self.start_exchange(t)().view(*self._sizes, -1)
        mine = [c for a, c in zip(mesh.axis_names, mesh._coords) if a in self._axes]
        index = tuple(slice(None) if a in axes else c for a, c in zip(self._axes, mine))
        return table[index].reshape(-1, table.shape[-1])


def _host_group(device_mesh: Any, ranks: list[int]) -> Any:
    """A gloo group over the mesh's ranks, for a mesh that is not the whole world or whose
    default group has no gloo backend (``init_process_group("nccl")``). Collective: every
    rank of the world makes its DistMesh at the same point, as it makes its DeviceMesh."""
    name = "fh_host_" + "_".join(device_mesh.mesh_dim_names)
    try:  # every sibling sub-mesh's group at once, as DeviceMesh makes its dim groups
        flat = device_mesh._flatten(name, backend_override="gloo")
        return flat.get_group(0)
    except (AttributeError, TypeError, NotImplementedError):  # a torch without it
        return dist.new_group(sorted(ranks), backend="gloo", use_local_synchronization=True)

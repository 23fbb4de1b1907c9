"""A fault-tolerant replica axis: replica groups that fail, leave and come back, and the mesh
that carries the collectives over them.

Replica groups along the outer axis sit in different racks, buildings or datacenters. Here a
dead or stalled group stops no one: each step (each DiLoCo sync) starts with a quorum of the
groups alive, the collectives over the replica axis run among that quorum's participants, a
failed collective is reported (never raised mid-step, never waited on past the timeout), a step
that failed anywhere commits nowhere, and a group that is behind (restarted, or it missed a
commit) receives the live trees from a peer at its next quorum, with no checkpoint.

- :class:`FaultTolerant` (``fh.fault_tolerant(manager, axis=...)``): membership by torchft (a
  ``torchft.Manager``: its lighthouse forms the quorum, its process group is reconfigured per
  quorum, its checkpoint transport carries the healing trees). ``fh.DistMesh(device_mesh,
  replicas=ft)`` is a :class:`ReplicaMesh`: the replica axis first, then the group's own axes.
- :class:`SimQuorum` (``fh.simulated_quorum(axis=..., alive=...)``): the same contract on a
  :class:`~functional_hsdp.SimMesh` (``fh.SimMesh(shape, replicas=sim)``), from a schedule of
  who is alive at each quorum: the math, tests and notebooks in one process, without torchft.

Invariants: a mean over the replica axis is over the participants of the quorum (the sum
divided by their number); no cross-rank check ever crosses the replica axis (the agreement
spans the group: :mod:`~functional_hsdp.runtime.span`); a quorum is committed (or not) before
the next one starts.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import optree
import torch

from ..base.tree import format_path
from .dist import REPLICA_MESH, DistMesh, RankGeometry
from .protocol import Flight, MeshAxes

__all__ = [
    "FaultTolerant",
    "QuorumRecord",
    "ReplicaMesh",
    "SimQuorum",
    "fault_tolerant",
    "simulated_quorum",
]

#: the key fh's trees travel under in torchft's state dict (one key on every group)
STATE_KEY = "functional_hsdp"


@dataclass(frozen=True)
class QuorumRecord:
    """One quorum as a group saw it (``ft.log``): the reference a test or a benchmark
    recomputes the math from.

    Attributes:
        index: the quorum's number on this group, from 0.
        step: torchft's committed-step count when the quorum formed (after a heal: the
            peer's).
        participants: the replica groups taking part (the replica axis's size).
        rank: this group's coordinate along the replica axis.
        healed: whether this group received its trees from a peer at this quorum.
        committed: the step's commit decision (None until :meth:`FaultTolerant.commit`).
        alive: on a :class:`SimQuorum`, the replicas taking part; else None.
    """

    index: int
    step: int
    participants: int
    rank: int
    healed: Any
    committed: bool | None = None
    alive: tuple[int, ...] | None = None


def _check_axis(axis: Any, who: str) -> None:
    if not isinstance(axis, str) or not axis:
        raise TypeError(f"{who}: axis must be the replica axis's name (a str); got {axis!r}")


class _Quorums:
    """What both kinds of quorum share: the open/committed bookkeeping and the log."""

    axis: str
    log: list[QuorumRecord]
    _open: bool

    def _start_check(self, who: str) -> None:
        if self._open:
            raise RuntimeError(
                f"{who}: the last quorum (#{self.log[-1].index}) has not committed: call "
                "ft.commit() once per quorum, after the step's collectives and before the next "
                "quorum (a DiLoCo update commits its own syncs)"
            )

    @property
    def open(self) -> bool:
        """Whether a quorum started and its step has not committed yet."""
        return self._open

    def _committed(self, *, ok: bool) -> bool:
        self._open = False
        self.log[-1] = _replace(self.log[-1], committed=bool(ok))
        return bool(ok)

    def commit(self) -> bool:  # pragma: no cover - each kind has its own
        raise NotImplementedError


def _replace(record: QuorumRecord, **changes: Any) -> QuorumRecord:
    return QuorumRecord(**{**record.__dict__, **changes})


# --------------------------------------------------------------------------------------------
# torchft
# --------------------------------------------------------------------------------------------


class FaultTolerant(_Quorums):
    """The replica axis of a torchft ``Manager``: made by :func:`fault_tolerant`."""

    def __init__(self, manager: Any, *, axis: str):
        _check_axis(axis, "fault_tolerant")
        needed = ("start_quorum", "should_commit", "num_participants", "participating_rank")
        missing = [m for m in needed if not callable(getattr(manager, m, None))]
        if missing or not hasattr(manager, "_pg"):
            raise TypeError(
                f"fault_tolerant: manager must be a torchft.Manager; got {manager!r} "
                f"(it lacks {', '.join(missing) or '_pg'})"
            )
        if getattr(manager, "_use_async_quorum", False):
            raise ValueError(
                "fault_tolerant: manager was made with use_async_quorum=True; fh needs "
                "use_async_quorum=False (a quorum that ends before the step's first collective: "
                "a healing group gets its trees from ft.quorum, and DiLoCo's syncs are gated on "
                "the quorum they were issued in)"
            )
        self.manager, self.axis = manager, axis
        self.log: list[QuorumRecord] = []
        self._open = False
        self._sending: tuple[tuple[str, ...], list] | None = None
        self._group: Any = None  # the group's own mesh (set by the ReplicaMesh made on it)
        self._received: Any = None
        manager.register_state_dict_fn(STATE_KEY, self._load, self._save)

    def __repr__(self) -> str:
        return f"fault_tolerant({type(self.manager).__name__}, axis={self.axis!r})"

    # the replica axis as the mesh sees it --------------------------------------------------

    @property
    def size(self) -> int:
        """Replica groups in the current quorum (1 before the first): its record's."""
        return self.log[-1].participants if self.log else 1

    @property
    def rank(self) -> int:
        """This group's place in the current quorum (0 before the first): its record's."""
        return self.log[-1].rank if self.log else 0

    @property
    def healed(self) -> bool:
        """Whether this group received its trees from a peer at the current quorum."""
        return bool(self.log and self.log[-1].healed)

    def contributes(self) -> float:
        """1.0, or 0.0 for a group that healed at this quorum (it has no progress of its own
        to contribute to a DiLoCo sync)."""
        return 0.0 if self.healed else 1.0

    def errored(self) -> bool:
        """Whether a collective of this step failed (reported to the manager)."""
        return self.manager.errored() is not None

    def report(self, exc: BaseException) -> None:
        """Report a failed collective: the step will not commit anywhere."""
        self.manager.report_error(exc)

    # the loop's calls ---------------------------------------------------------------------

    def quorum(self, trees: Any) -> Any:
        """Start this step's quorum (torchft's ``start_quorum``). A group that is behind
        receives ``trees`` from a live peer and gets them back (see :func:`fault_tolerant`)."""
        self._start_check("ft.quorum")
        leaves, treedef = optree.tree_flatten(trees, none_is_leaf=True)
        paths = tuple("trees" + format_path(p) for p in optree.tree_paths(trees, none_is_leaf=True))
        for path, x in zip(paths, leaves):
            if getattr(x, "done", True) is False:  # an InFlight: a delayed sync in flight
                raise ValueError(
                    f"ft.quorum: {path} is still in flight ({x!r}); on a fault-tolerant axis a "
                    "quorum starts only when no sync is in flight"
                )
        self._sending, self._received = (paths, leaves), None
        try:
            self.manager.start_quorum()
        finally:
            self._sending = None
        received, self._received = self._received, None
        healed = self._agree_healed(received is not None)
        if healed:
            trees = optree.tree_unflatten(treedef, _healed(paths, leaves, received))
        self._open = True
        size = max(int(self.manager.num_participants()), 1)
        rank = self.manager.participating_rank()
        rank = 0 if rank is None else int(rank)
        self.log.append(
            QuorumRecord(
                index=len(self.log),
                step=int(self.manager.current_step()),
                participants=size,
                rank=rank,
                healed=healed,
            )
        )
        return trees

    def _agree_healed(self, got: bool) -> bool:
        """Whether every rank of this group received its trees at this quorum (a host
        exchange over the group's ranks, when the mesh was made). A heal is per rank (each
        rank from the same coordinates of a peer group); where some ranks of the group got
        theirs and others did not, none takes them: the group stays consistent, the failure
        is reported (this step does not commit) and the group heals at its next quorum."""
        group = self._group
        if group is None or all(n == 1 for n in group.sizes):
            return got
        failed = not got and self.manager.errored() is not None
        row = torch.tensor([int(got), int(failed)], dtype=torch.int64)
        mine = torch.cat([row, -row])
        both = group.diagnostics.start_max(mine)()
        anyone, everyone = bool(both[0] > 0), bool(-both[2] > 0)
        if anyone and not everyone:
            if self.manager.errored() is None:
                self.report(RuntimeError("ft.quorum: a rank of this group failed to heal"))
            return False
        return everyone

    def commit(self) -> bool:
        """torchft's ``should_commit``: True when every collective of this step succeeded on
        every rank of this group (and enough groups took part)."""
        if not self._open:
            raise RuntimeError("ft.commit(): no quorum is open; call ft.quorum(trees) first")
        try:
            ok = self.manager.should_commit()
        except BaseException:
            self._committed(ok=False)
            raise
        return self._committed(ok=ok)

    # torchft's state-dict callbacks (its quorum thread) -----------------------------------

    def _save(self) -> dict:
        """What a healing peer receives: this group's trees at this quorum, copied now (the
        transport serializes them only when asked, after the step has gone on)."""
        if self._sending is None:
            raise RuntimeError(
                "functional_hsdp: a peer asked for state outside ft.quorum (the state-dict "
                f"key {STATE_KEY!r} is fh's; start quorums with ft.quorum(trees))"
            )
        paths, leaves = self._sending
        return {"paths": list(paths), "leaves": [_sendable(p, x) for p, x in zip(paths, leaves)]}

    def _load(self, state: Any) -> None:
        self._received = state


def fault_tolerant(manager: Any, *, axis: str) -> FaultTolerant:
    """A fault-tolerant replica axis run by a torchft ``Manager``.

    ``fh.DistMesh(device_mesh, replicas=ft)`` then has ``axis`` first, then the device mesh's
    axes (the device mesh spans this replica group's ranks only). Along ``axis`` its size is
    the current quorum's participant count and its coordinate this group's place in it. Every
    collective over ``axis`` runs on the manager's process group: a failure is reported to the
    manager (the step will not commit), never raised mid-step, never waited on past the
    manager's timeout. The cross-rank check of each call spans the group only.

    The loop, per step (DiLoCo: per sync, see ``dl.sync_due``)::

        params, opt_state, position = ft.quorum((params, opt_state, position))
        grads = ...                                    # reductions over axis: the quorum's mean
        if ft.commit():
            params, opt_state = ...                    # only a committed step changes anything

    Args:
        manager: a ``torchft.Manager`` made with ``use_async_quorum=False`` and no state-dict
            callbacks of its own for fh's trees: fh registers its own under the key
            ``"functional_hsdp"`` now, before the first quorum (``init_sync=False`` lets the
            first quorum start without a peer).
        axis: the replica axis's name.

    Returns:
        A ``FaultTolerant``: ``quorum(trees)``, ``commit()``, ``log`` (one
        ``QuorumRecord`` per quorum).

    ``ft.quorum(trees)``: starts this step's quorum. If this group is behind, it receives
    ``trees`` from the live peer group (each rank from the rank with its coordinates on the
    other axes: its local shards, whatever the pytree holds: params, optimizer state, a DiLoCo
    state, residuals, a data position): the peer's tensors are copied into this group's own
    tensors of ``trees`` (modules and shards keep their identity) and the other leaves (ints,
    floats) replaced; the trees are returned. Their structure must be the peer's (a
    ValueError names the first path that differs).
    """
    return FaultTolerant(manager, axis=axis)


def _sendable(path: str, x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return _Kept(type(x).__name__)  # a leaf the healing group keeps its own of (MaskedNode)


@dataclass(frozen=True)
class _Kept:
    """A leaf that does not travel: the healing group keeps its own (of this type)."""

    kind: str


def _healed(paths: tuple[str, ...], leaves: list, received: Any) -> list:
    """This group's leaves with the peer's values: tensors copied in place, the rest replaced."""
    if not isinstance(received, dict) or "paths" not in received or "leaves" not in received:
        raise ValueError(f"ft.quorum: the peer sent no functional_hsdp trees ({received!r:.80})")
    theirs = tuple(received["paths"])
    if theirs != paths:
        first = next(
            (k for k, (a, b) in enumerate(zip(paths, theirs)) if a != b),
            min(len(paths), len(theirs)),
        )
        mine = paths[first] if first < len(paths) else "(nothing)"
        peer = theirs[first] if first < len(theirs) else "(nothing)"
        raise ValueError(
            f"ft.quorum: the healing trees' structure differs from the peer's: leaf {first} is "
            f"{mine} here and {peer} on the peer ({len(paths)} leaves here, {len(theirs)} there)"
        )
    out = []
    with torch.no_grad():
        for path, mine, got in zip(paths, leaves, received["leaves"]):
            if isinstance(mine, torch.Tensor):
                if (
                    not isinstance(got, torch.Tensor)
                    or got.shape != mine.shape
                    or got.dtype != mine.dtype
                ):
                    what = (
                        f"{tuple(got.shape)} {got.dtype}"
                        if isinstance(got, torch.Tensor)
                        else repr(got)
                    )
                    raise ValueError(
                        f"ft.quorum: {path} is {tuple(mine.shape)} {mine.dtype} here and {what} "
                        "on the peer"
                    )
                mine.copy_(got)
                out.append(mine)
            elif isinstance(got, _Kept):
                if type(mine).__name__ != got.kind:
                    raise ValueError(
                        f"ft.quorum: {path} is a {type(mine).__name__} here and a {got.kind} on "
                        "the peer"
                    )
                out.append(mine)
            else:
                out.append(got)
    return out


# --------------------------------------------------------------------------------------------
# the mesh over a torchft replica axis
# --------------------------------------------------------------------------------------------


class _Future:
    """A torchft-wrapped future (errors swallowed and reported, bounded by the manager's
    timeout) with a c10d ``Work``'s ``wait``."""

    def __init__(self, future: Any):
        self.future = future

    def wait(self, timeout: Any = None) -> bool:
        self.future.wait()
        return True


class _Done:
    """A collective that was never issued (the step already failed): nothing to wait for."""

    def wait(self, timeout: Any = None) -> bool:
        return True


class ReplicaMesh(MeshAxes):
    """``fh.DistMesh(device_mesh, replicas=ft)``: the replica axis of ``ft`` first, then the
    device mesh's axes (this replica group's ranks).

    Collectives over the group's axes are the group's :class:`~functional_hsdp.DistMesh`'s;
    over the replica axis they run on the manager's process group: an all-reduce (SUM, the
    division by the quorum's participants when waited, as gloo's AVG), an all-gather and an
    all-to-all; a reduce-scatter is refused (nothing can be sharded over groups that may die).
    A failure is reported to the manager, and the waited result is then meaningless: the
    step does not commit. After a failure nothing more is issued over the axis this step.
    """

    batch_shape: tuple[int, ...] = ()

    def __init__(self, device_mesh: Any, *, replicas: FaultTolerant, **options: Any):
        if not isinstance(replicas, FaultTolerant):
            raise TypeError(
                f"DistMesh: replicas must be fh.fault_tolerant(manager, axis=...); got {replicas!r}"
            )
        self.group_mesh = DistMesh(device_mesh, **options)
        if replicas.axis in self.group_mesh.axis_names:
            raise ValueError(
                f"DistMesh: the replica axis {replicas.axis!r} is also an axis of the device mesh "
                f"{self.group_mesh.axis_names}; the device mesh spans one replica group only"
            )
        self.replicas = replicas
        replicas._group = self.group_mesh  # a heal is agreed within the group
        self.device_mesh = device_mesh
        self.axis_names = (replicas.axis, *self.group_mesh.axis_names)
        self.overlap = self.group_mesh.overlap
        self.timeout = self.group_mesh.timeout
        self.issue_size_one = False
        self.geometry = RankGeometry(self)  # reads this mesh's sizes and coordinates
        self.diagnostics = _ReplicaDiagnostics(self)

    def __repr__(self) -> str:
        return f"DistMesh({self.shape}, replicas={self.replicas!r})"

    @property
    def apart_axes(self) -> tuple[str, ...]:
        """Axes no cross-rank check crosses (the replica axis)."""
        return (self.replicas.axis,)

    @property
    def sizes(self) -> tuple[int, ...]:  # type: ignore[override]
        return (self.replicas.size, *self.group_mesh.sizes)

    @property
    def _coords(self) -> tuple[int, ...]:
        return (self.replicas.rank, *self.group_mesh._coords)

    def coordinate(self, axis: str) -> int:
        return self._coords[self._dim(axis)]

    def moves(self, axis: str) -> bool:
        """The replica axis always carries its collectives (a plan is made once, and the
        quorum's size changes: one participant all-reduces with itself); the group's axes as
        the group's mesh says."""
        return self._ft(axis) or self.group_mesh.moves(axis)

    def _ft(self, axis: str) -> bool:
        self._dim(axis)  # names the mesh's axes if it has no such axis
        return axis == self.replicas.axis

    # collectives ---------------------------------------------------------------------------

    def all_reduce(self, buf: torch.Tensor, axis: str, op: str) -> torch.Tensor | Flight:
        if not self._ft(axis):
            return self.group_mesh.all_reduce(buf, axis, op)
        if buf.dtype == torch.float16:
            raise ValueError(
                f"all_reduce over the fault-tolerant axis {axis!r} in float16: an fp16 "
                "reduction is scaled by the axis size the plan was made with, and a quorum "
                "changes it; reduce in bfloat16 or float32 over this axis"
            )
        from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp

        n = self.size(axis)

        def issue(pg: Any) -> Any:
            opts = AllreduceOptions()
            opts.reduceOp = ReduceOp.SUM
            return pg.allreduce([buf], opts)

        flight = Flight("all_reduce", axis, buffer=buf, divide=n if op == "avg" else None)
        return self._issue(flight, issue)

    def reduce_scatter(self, buf: torch.Tensor, axis: str, op: str) -> torch.Tensor | Flight:
        if not self._ft(axis):
            return self.group_mesh.reduce_scatter(buf, axis, op)
        raise ValueError(
            f"reduce_scatter over the fault-tolerant axis {axis!r}: nothing can be sharded over "
            "replica groups that may fail (keep the replica axis Replicate/Partial in the spec, "
            "e.g. fh.hsdp(mesh, outer, inner))"
        )

    def all_gather(self, buf: torch.Tensor, axis: str) -> torch.Tensor | Flight:
        if not self._ft(axis):
            return self.group_mesh.all_gather(buf, axis)
        from torch.distributed.distributed_c10d import AllgatherOptions

        n = self.size(axis)
        out = buf.new_empty(n * buf.shape[0], *buf.shape[1:])
        source = buf.contiguous()
        parts = list(out.view(n, -1).unbind(0)) if out.numel() else []

        def issue(pg: Any) -> Any:
            return pg.allgather([parts], [source], AllgatherOptions())

        if not out.numel():
            return out
        return self._issue(Flight("all_gather", axis, buffer=out, source=source), issue)

    def all_to_all(
        self, buf: torch.Tensor, axis: str, *, counts: Any, length: int
    ) -> torch.Tensor | Flight:
        if not self._ft(axis):  # the counts of this group's ranks, by their group coordinates
            mine = self.replicas.rank
            own = {r[1:]: row for r, row in counts.items() if r[0] == mine}
            return self.group_mesh.all_to_all(buf, axis, counts=own, length=length)
        from torch.distributed.distributed_c10d import AllToAllOptions

        d, me = self._dim(axis), self._coords
        send = [int(c) for c in counts[me]]
        recv = [int(counts[(*me[:d], s, *me[d + 1 :])][me[d]]) for s in range(self.sizes[d])]
        src = buf.narrow(-1, 0, sum(send)).contiguous()
        out = buf.new_zeros(length)

        def issue(pg: Any) -> Any:
            return pg.alltoall_base(out.narrow(0, 0, sum(recv)), src, recv, send, AllToAllOptions())

        return self._issue(Flight("all_to_all", axis, buffer=out, source=src), issue)

    def _issue(self, flight: Flight, issue: Callable[[Any], Any]) -> torch.Tensor | Flight:
        """Issue on the manager's process group; a failure (or an earlier one this step) is
        reported to the manager and the collective is not issued (its waited result is then
        the buffer as it is: the step will not commit)."""
        manager = self.replicas.manager
        if manager.errored() is not None:
            flight.work = _Done()
        else:
            try:
                work = issue(manager._pg)
                flight.work = _Future(manager.wrap_future(work.get_future(), None))
            except Exception as exc:  # noqa: BLE001 - reported: the step does not commit
                self.replicas.report(exc)
                flight.work = _Done()
        return flight if self.overlap else self.wait(flight)

    def wait(self, x: torch.Tensor | Flight) -> torch.Tensor:
        if not isinstance(x, Flight) or x.axis != self.replicas.axis:
            return self.group_mesh.wait(x)
        x.work.wait()
        x.source = None
        buf = x.buffer
        if x.divide:
            buf, x.divide = buf.div_(x.divide), None
        return buf

    def abandon(self, x: torch.Tensor | Flight) -> None:
        if isinstance(x, Flight) and x.axis == self.replicas.axis:
            x.source = None  # torchft's future holds what it needs until it completes
            return
        self.group_mesh.abandon(x)

    # what DistMesh offers beside the protocol -----------------------------------------------

    def group(self, axis: str) -> Any:
        if self._ft(axis):
            return self.replicas.manager._pg
        return self.group_mesh.group(axis)

    def carriage(self, axis: str) -> Any:
        return self.group_mesh.carriage(axis) if not self._ft(axis) else None


class _ReplicaDiagnostics:
    """The group's diagnostics: no cross-rank exchange crosses the replica axis. The agreement
    always spans the group (``apart_axes``); a whole-mesh exchange is the group's."""

    def __init__(self, mesh: ReplicaMesh):
        self._mesh = mesh

    @property
    def _group(self) -> Any:
        return self._mesh.group_mesh.diagnostics

    def _own(self, axes: Sequence[str]) -> tuple[str, ...]:
        return tuple(a for a in axes if a != self._mesh.replicas.axis)

    def describe(self, op: str, axis: str, reduce: str | None) -> str:
        if axis == self._mesh.replicas.axis:
            return f"torchft {op}" + (" (sum+div)" if reduce == "avg" else "")
        return self._group.describe(op, axis, reduce)

    def within(self, axes: tuple[str, ...]) -> Any:
        return self._group.within(self._own(axes))

    def start_max(self, t: torch.Tensor) -> Any:
        return self._group.start_max(t)

    def start_exchange(self, t: torch.Tensor) -> Any:
        return self._group.start_exchange(t)

    def exchange(self, t: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        return self._group.exchange(t, self._own(axes))

    def members(self, axes: tuple[str, ...]) -> list[tuple[str, ...]]:
        return self._group.members(self._own(axes))


# --------------------------------------------------------------------------------------------
# the simulated quorum (SimMesh)
# --------------------------------------------------------------------------------------------


class SimQuorum(_Quorums):
    """A simulated quorum on a :class:`~functional_hsdp.SimMesh`: made by
    :func:`simulated_quorum`."""

    def __init__(self, *, axis: str, alive: Any, fail: Iterable[int] = ()):
        _check_axis(axis, "simulated_quorum")
        if not (callable(alive) or isinstance(alive, Sequence)):
            raise TypeError(
                "simulated_quorum: alive must be a sequence (per quorum, the replicas alive) or "
                f"a function of the quorum's index; got {alive!r}"
            )
        fail = tuple(fail)
        if any(isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0 for k in fail):
            raise ValueError(
                f"simulated_quorum: fail must hold quorum indices (ints >= 0); got {fail!r}"
            )
        self.axis, self._alive, self.fail = axis, alive, frozenset(int(k) for k in fail)
        self.log: list[QuorumRecord] = []
        self._open = False
        self._mesh: Any = None
        self._steps: np.ndarray | None = None  # per replica: commits taken part in
        self._now: tuple[int, ...] = ()
        self._healed: tuple[int, ...] = ()

    def __repr__(self) -> str:
        return f"simulated_quorum(axis={self.axis!r})"

    def bind(self, mesh: Any) -> None:
        """Drive ``mesh``'s replica axis (the SimMesh made with ``replicas=self``)."""
        if self._mesh is not None and self._mesh is not mesh:
            raise ValueError("simulated_quorum: this quorum already drives another SimMesh")
        self._mesh = mesh
        mesh.size(self.axis)  # names the mesh's axes if it lacks this one
        self._steps = np.zeros(mesh.size(self.axis), dtype=np.int64)

    @property
    def slots(self) -> int:
        return 0 if self._steps is None else len(self._steps)

    def alive_at(self, k: int) -> tuple[int, ...]:
        """The replicas alive at quorum ``k`` (checked)."""
        got = self._alive(k) if callable(self._alive) else self._alive[min(k, len(self._alive) - 1)]
        alive = tuple(sorted({int(r) for r in got}))
        if not alive or alive[0] < 0 or alive[-1] >= self.slots:
            raise ValueError(
                f"simulated_quorum: quorum {k}'s alive replicas must be a non-empty subset of "
                f"range({self.slots}); got {got!r}"
            )
        return alive

    @property
    def alive(self) -> tuple[int, ...]:
        """The current quorum's participants (every replica before the first quorum)."""
        return self._now if self.log else tuple(range(self.slots))

    @property
    def healed(self) -> tuple[int, ...]:
        """The replicas that received their trees from a peer at the current quorum."""
        return self._healed

    def mask(self) -> torch.Tensor:
        """Per replica slot: 1.0 for a participant of the current quorum, else 0.0."""
        m = torch.zeros(self.slots)
        m[list(self.alive)] = 1.0
        return m

    def contributes(self) -> Any:
        """Per replica slot, of the mesh's batch shape: 1.0 for a participant that did not
        heal at this quorum, else 0.0 (the float 1.0 when no replica healed)."""
        if not self._healed:
            return 1.0
        m = self.mask()
        if self._healed:
            m[list(self._healed)] = 0.0
        return self._along(m)

    def _along(self, per_slot: torch.Tensor) -> torch.Tensor:
        mesh = self._mesh
        d = mesh._dim(self.axis)
        view = [1] * mesh.ndim
        view[d] = self.slots
        return per_slot.view(view).expand(mesh.sizes)

    def errored(self) -> bool:
        return False

    def quorum(self, trees: Any) -> Any:
        """Start the next quorum: the replicas the schedule says are alive take part; those
        behind (they missed a commit, or they were absent from the last quorum: a restarted
        process, whose state died with it) receive the trees of the first up-to-date
        participant, copied into their slots along the axis (in place). Only tensors with
        the mesh's batch dims travel: a Python int in the trees is one value for every
        replica already."""
        if self._mesh is None:
            raise RuntimeError(
                "simulated_quorum: make the mesh first, fh.SimMesh(shape, replicas=sim)"
            )
        self._start_check("sim.quorum")
        k = len(self.log)
        alive = self.alive_at(k)
        for r in set(alive) - set(self.alive):  # restarted: a process that died lost its state
            self._steps[r] = -1
        steps = self._steps[list(alive)]
        top = int(steps.max())
        if top < 0:  # every participant restarted: they start afresh together
            self._steps[list(alive)] = top = 0
            steps = self._steps[list(alive)]
        behind = tuple(r for r, s in zip(alive, steps) if s < top)
        if behind:
            src = next(r for r, s in zip(alive, steps) if s == top)
            trees = self._copy(trees, src, behind)
            self._steps[list(behind)] = top
        self._now, self._healed, self._open = alive, behind, True
        self.log.append(
            QuorumRecord(
                index=k, step=top, participants=len(alive), rank=0, healed=behind, alive=alive
            )
        )
        return trees

    def _copy(self, trees: Any, src: int, dst: tuple[int, ...]) -> Any:
        mesh = self._mesh
        d = mesh._dim(self.axis)
        batch = tuple(mesh.batch_shape)

        def heal(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and tuple(x.shape[: len(batch)]) == batch:
                with torch.no_grad():
                    for r in dst:
                        x.select(d, r).copy_(x.select(d, src))
            return x

        return optree.tree_map(heal, trees, none_is_leaf=True)

    def commit(self) -> bool:
        """Whether this quorum's step commits: False for a quorum the schedule's ``fail``
        names (a failure mid-step: no participant commits), else True."""
        if not self._open:
            raise RuntimeError("sim.commit(): no quorum is open; call sim.quorum(trees) first")
        ok = self.log[-1].index not in self.fail
        if ok:
            self._steps[list(self._now)] += 1
        return self._committed(ok=ok)

    # the SimMesh's collectives over the axis ----------------------------------------------

    def all_reduce(self, mesh: Any, buf: torch.Tensor, op: str) -> torch.Tensor:
        """Every slot gets the reduction over the current participants only."""
        d = mesh._dim(self.axis)
        w = self.mask().to(buf.device, buf.dtype)
        view = [1] * buf.dim()
        view[d] = self.slots
        total = (buf * w.view(view)).sum(d, keepdim=True)
        if op == "avg":
            total = total / len(self.alive)
        return total.expand(buf.shape).contiguous()


def simulated_quorum(*, axis: str, alive: Any, fail: Iterable[int] = ()) -> SimQuorum:
    """A simulated quorum for a SimMesh's replica axis: ``fh.SimMesh(shape, replicas=sim)``.

    The same loop as on a torchft axis (``sim.quorum(trees)``, ``sim.commit()``,
    ``dl.sync_due``), in one process: the schedule says which replicas are alive at each
    quorum. A mean over ``axis`` is over that quorum's participants (every slot of the mesh
    gets it; a dead replica's slot is meaningless until it heals). A replica behind the others
    (it missed a commit) receives the first up-to-date participant's values in its slots at the
    quorum. Over ``axis`` only all-reduces run (no compressed route on a simulated axis).

    Args:
        axis: the replica axis.
        alive: per quorum (its index k = 0, 1, ...), the replicas alive: a sequence (its last
            entry holds for every later quorum) or a function of k.
        fail: quorum indices whose step fails mid-step (a group dies after the quorum):
            ``commit()`` is False for every participant.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> sim = fh.simulated_quorum(axis="r", alive=[(0, 1, 2), (0, 2)])
        >>> mesh = fh.SimMesh({"r": 3, "dp": 1}, replicas=sim)
        >>> x = torch.tensor([1.0, 2.0, 6.0]).view(3, 1, 1)
        >>> x = sim.quorum(x)
        >>> fh.pmean({"x": x}, "r", mesh)["x"].flatten()      # all three
        tensor([3., 3., 3.])
        >>> sim.commit()
        True
        >>> x = sim.quorum(x)
        >>> fh.pmean({"x": x}, "r", mesh)["x"].flatten()      # replica 1 is gone
        tensor([3.5000, 3.5000, 3.5000])
    """
    return SimQuorum(axis=axis, alive=alive, fail=fail)


def replica_quorum(mesh: Any, axis: str) -> Any:
    """The quorum driving ``axis`` of ``mesh`` (a FaultTolerant or SimQuorum), or None."""
    ft = getattr(mesh, "replicas", None)
    return ft if ft is not None and ft.axis == axis else None


REPLICA_MESH.append(ReplicaMesh)

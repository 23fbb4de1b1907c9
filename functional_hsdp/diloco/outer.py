"""Semi-synchronous outer: DiLoCo and Streaming DiLoCo as pure functions on the placements.

HSDP defers the outer reduction to the last microbatch of a step. DiLoCo defers it further:
the replicas along the outer axis train apart (:func:`~functional_hsdp.replicas`: nothing is
reduced or gathered over that axis) for ``every`` inner steps, then meet once, and an outer
optimizer steps on the *pseudo-gradient* ``anchor - mean over the axis of params``.
Streaming DiLoCo cuts the parameters into ``F`` fragments that sync at staggered steps
(the peak outer transfer is 1/F of a whole-model sync), lets a fragment's reduction land
``delay`` steps after it was issued, and merges ``mix * anchor + (1 - mix) * params``.

Inner steps are counted t = 1, 2, ... Fragment p syncs after step t when t >= s_p and
(t - s_p) % every == 0, with s_p = floor((p + 1) * every / F). At a sync, for the fragment's
leaves:

=====================  ======================================================================
step                   what happens (local shards at the inner spec's optimizer placement)
=====================  ======================================================================
issue (after t)        ``delta = anchor - params``: one all-reduce (AVG) per bucket over
                       ``axis``, on the shard each rank holds (never a full tensor)
land (after t + tau)   ``updates, s = outer.update(delta, s, anchor)``;
                       ``anchor = apply_updates(anchor, updates)``;
                       ``params = mix * anchor + (1 - mix) * params`` (of step t + tau)
=====================  ======================================================================

At one step, syncs landing there are merged before the syncs issued there read the params.
The inner optimizer's state stays per replica, untouched by syncs. The pseudo-gradient's
reduction is :func:`~functional_hsdp.sync.collectives.start_pmean` of the fragment's leaves
(one all-reduce per bucket), or with ``compress=`` :func:`_start_compressed` (one
all-to-all, an fp32 sum and one all-gather per bucket).

A sync issued with ``delay > 0`` overlaps the next ``delay`` inner steps: its all-reduces
are issued (:func:`~functional_hsdp.sync.collectives.start_pmean`) and ``update`` returns at
once; the state holds them in flight (``DiLoCoState.flight``: one ``SyncInFlight`` per
fragment in flight), and the ``update`` where the sync lands waits for them: the transfer
runs while the next ``delay`` inner steps compute. Before its collectives the sync agrees
across the whole mesh, as every call does (the replicas issue the same sync of the same
tree, else every rank raises a ``ValueError`` naming the difference: mismatched
collectives would abort gloo and hang NCCL), in a few small host messages; so a replica
that reaches the issue first waits there for the others' summaries, not for the transfer.
Under ``fh.validation("off")`` the issue waits for nobody, and a replica that is late by
less than ``delay`` steps delays no other. :func:`~functional_hsdp.state_dict` waits for
what is in flight and saves it averaged in ``pending`` (resharded like AdamW's moments), so
a checkpoint at any step loads into a state with nothing in flight that lands alike. A
compressed sync (``compress=``) is two dependent collectives with an fp32 sum between
them: its first leg (the quantized all-to-all of every bucket) is what flies, issued after
an agreement of its own (:func:`~functional_hsdp.sync.collectives.agree_pmean`: the same
message as an uncompressed sync's); the ``update`` where it lands waits for it, sums and
runs the all-gather (the second leg: as many bytes reach each rank as in the first; not
overlapped), and takes the new
residual of error feedback. A checkpoint or a copy finishes it (both legs, so every rank
of the replica group takes part, as in ``fh.state_dict``) and saves its new residual in
its fragment's place (:func:`~functional_hsdp.diloco.residual_tree`).

With ``compress=fh.compress(...)`` the pseudo-gradient travels compressed
(:func:`~functional_hsdp.compressed_all_reduce`: one all-to-all and one all-gather per
bucket, summed in fp32). A fragment's buckets hold this rank's elements of the fragment's
local shards, in tree order, side by side in fp32 (no alignment gaps, no SimMesh fill),
each rank's row zero-padded to the longest rank's, so that every group of ``axis`` runs the
same program and a SimMesh gives a DistMesh's bits. With error feedback the residual of
what rounding lost is ``DiLoCoState.residual``, a tree like the params (fp32): a fragment's
leaves hold its own, added into its next sync.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import optree
import torch

from ..base.tags import result_state, tag
from ..base.tree import MaskedNode, flatten, format_path, masked_node, structure_error
from ..io.checkpoint import empty_state_dict, load_state_dict, load_tree, state_dict
from ..mesh import Mesh
from ..optim.combine import PartitionState
from ..optim.transformation import GradientTransformation, apply_updates
from ..plan.lookup import find_layout
from ..plan.recipe import get_plan
from ..runtime.compressed import start as start_compressed
from ..runtime.engine import InFlight
from ..spec.quantize import Compress
from ..spec.specs import Spec, replicas
from ..sync.collectives import agree_pmean, start_pmean

__all__ = ["DiLoCo", "DiLoCoState", "SyncInFlight", "balanced_fragments", "diloco", "sync_steps"]


class DiLoCoState(NamedTuple):
    """State of :func:`diloco` (a pytree: tensors and host ints).

    Attributes:
        anchor: tree like the params (local shards at the inner spec's optimizer placement):
            the weights of the last sync, equal on every replica.
        outer: a :class:`PartitionState` with one outer-optimizer state per fragment
            (labels ``"0"``, ``"1"``, ...; other fragments' leaves :class:`MaskedNode`).
        count: inner steps seen so far (a host int, the same on every rank).
        due: per fragment, the step after which its sync in flight lands (0: none).
        pending: tree like the params: for a fragment whose sync was reduced but has not
            landed (a sync in a state loaded from a checkpoint), its averaged
            pseudo-gradient (equal on every replica); :class:`MaskedNode`
            elsewhere (a sync in ``flight`` too), so that only what is held takes memory.
            None when ``delay == 0`` (nothing is ever in flight between calls). A
            checkpoint saves it whole (the syncs in flight waited for, zeros for the other
            MaskedNode leaves: ``functional_hsdp.diloco.pending_tree``); after a load, the next
            ``update`` masks the leaves of the fragments not due again.
        residual: with ``compress=`` and error feedback, tree like the params (fp32, local
            shards): what rounding lost of each rank's part of its fragment's last compressed
            sync that landed, added into the next (per rank: it differs between replicas);
            a sync in flight holds its fragment's new one (``residual_tree`` gives the tree
            with it in place, what a checkpoint saves). None otherwise.
        flight: per fragment, its sync in flight (a ``functional_hsdp.diloco.SyncInFlight``:
            a host object, not a tensor; the ``update`` where it lands waits for it), or
            None; ``()``: none anywhere. A sync is in flight from its issue to its landing
            when ``delay > 0`` (compressed: its first leg); checkpoints wait for it and save
            it in ``pending``, and pickling (``torch.save``, ``copy.deepcopy``) waits for it
            and keeps its result.
    """

    anchor: Any
    outer: PartitionState
    count: int
    due: tuple[int, ...]
    pending: Any
    residual: Any = None
    flight: tuple = ()

    # -- checkpoints: functional_hsdp.checkpoint's protocol ------------------------------

    def __fh_state_dict__(self, spec: Any, *, like: Any = None) -> dict[str, Any]:
        """This state in a mesh-independent checkpoint (``fh.state_dict(state, spec)``), at
        any step: see :func:`_as_dict`."""
        field = lambda name: None if like is None else getattr(like, name)  # noqa: E731
        return _as_dict(self, lambda sub, name: state_dict(sub, spec, like=field(name)))

    def __fh_empty_state_dict__(self, spec: Any) -> dict[str, Any]:
        """Placeholders for ``dcp.load`` (``fh.empty_state_dict(like, spec)``)."""
        return _as_dict(self, lambda sub, _: empty_state_dict(sub, spec))

    def __fh_load_state_dict__(self, state: dict, spec: Any, *, name: str) -> DiLoCoState:
        """The state :meth:`__fh_state_dict__` saved, loaded on ``spec``'s mesh (this state
        the like): nothing in flight, each saved sync held in ``pending``."""
        return _loaded(state, spec, self, name=name)


class SyncInFlight:
    """One fragment's delayed sync in flight (an entry of ``DiLoCoState.flight``): its
    all-reduces issued (:func:`~functional_hsdp.sync.collectives.start_pmean`), or compressed,
    its all-to-alls (the rest run by :meth:`result`), waited for by :meth:`result` once
    (the update where it lands, or a checkpoint, whichever comes first: both get the same
    tensors).

    Attributes:
        fragment: the fragment's index.
        leaves: the fragment's leaves (indices in the params' tree order).
    """

    __slots__ = ("fragment", "leaves", "_keys", "_reduction")

    def __init__(self, fragment: int, leaves: tuple[int, ...], *, keys: tuple, reduction: Any):
        self.fragment, self.leaves, self._keys, self._reduction = fragment, leaves, keys, reduction

    def result(self) -> list[torch.Tensor]:
        """The fragment's averaged pseudo-gradient, one tensor per leaf of ``leaves``."""
        out = self._reduction.result()
        return [out[k] for k in self._keys]

    def residual(self) -> list[torch.Tensor] | None:
        """A compressed sync with error feedback: the fragment's new residual (fp32, one
        tensor per leaf of ``leaves``), waited for; else None."""
        get = getattr(self._reduction, "residual", None)
        return None if get is None else get()

    def __reduce__(self) -> tuple:
        """Pickled (``torch.save``, ``copy.deepcopy``) waited for: its result travels, its
        collectives do not (a copy lands alike)."""
        out = [x.clone() for x in self.result()]
        new = self.residual()
        new = None if new is None else [x.clone() for x in new]
        return (_waited_sync, (self.fragment, self.leaves, self._keys, out, new))

    def __repr__(self) -> str:
        how = "waited" if self._reduction.done else "in flight"
        return f"SyncInFlight(fragment={self.fragment}, {len(self.leaves)} leaves, {how})"


def _waited_sync(
    fragment: int, leaves: tuple, keys: tuple, out: list, residual: list | None = None
) -> SyncInFlight:
    """A :class:`SyncInFlight` whose result, ``out`` (and ``residual``), is already there
    (unpickled)."""
    named = dict(zip(keys, out))
    done = InFlight.of(named) if residual is None else _CompressedSync.of(named, residual)
    return SyncInFlight(fragment, leaves, keys=keys, reduction=done)


class _CompressedSync:
    """A fragment's compressed sync (the ``reduction`` of its :class:`SyncInFlight`): its
    buckets' first leg in flight (:func:`~functional_hsdp.runtime.compressed.start`); ``result()``
    finishes it once: ``{key: averaged pseudo-gradient}``, and ``residual()`` the new
    residual pieces (None without error feedback)."""

    __slots__ = ("_flight", "_packing", "_keys", "_dtypes", "_out")

    def __init__(self, flight: Any, *, packing: _Packing | None, keys: tuple, dtypes: list):
        self._flight, self._packing, self._keys, self._dtypes = flight, packing, keys, dtypes
        self._out: tuple | None = None

    @classmethod
    def of(cls, named: dict, residual: list) -> _CompressedSync:
        """One already done (unpickled)."""
        done = cls(None, packing=None, keys=tuple(named), dtypes=[])
        done._out = (named, residual)
        return done

    @property
    def done(self) -> bool:
        return self._out is not None

    def result(self) -> dict:
        if self._out is None:
            outs, kept = self._flight.result()
            avg = [x.to(d) for x, d in zip(self._packing.scatter(outs), self._dtypes)]
            new = None if kept is None else self._packing.scatter(kept)
            self._out, self._flight = (dict(zip(self._keys, avg)), new), None
        return self._out[0]

    def residual(self) -> list | None:
        self.result()
        return self._out[1]


def sync_steps(every: int, fragments: int, steps: int) -> list[list[int]]:
    """The schedule: for each inner step t = 1..``steps``, the fragments that sync after it.

    Args:
        every: steps between two syncs of one fragment (H).
        fragments: the number of fragments (F).
        steps: how many steps to list.

    Returns:
        A list of ``steps`` lists of fragment indices.

    Example:
        >>> import functional_hsdp as fh
        >>> fh.sync_steps(every=4, fragments=2, steps=8)
        [[], [0], [], [1], [], [0], [], [1]]
    """
    _check_int("every", every, 1)
    _check_int("fragments", fragments, 1)
    starts = [(p + 1) * every // fragments for p in range(fragments)]
    return [
        [p for p, s in enumerate(starts) if t >= s and (t - s) % every == 0]
        for t in range(1, steps + 1)
    ]


def balanced_fragments(params: Any, fragments: int, *, spec: Any = None) -> Any:
    """A ``fragments=`` tree for :func:`diloco` whose fragments hold nearly equal bytes.

    ``fragments=F`` as an int cuts the leaves, in tree order, into F *contiguous* groups;
    a model whose largest leaves sit side by side (an embedding and an untied head) then
    has a fragment far above 1/F of the bytes, and Streaming DiLoCo's peak outer transfer
    with it. This groups the leaves by size instead (largest first, each into the fragment
    with the fewest bytes so far), so that no fragment holds more than 1/F of the bytes by
    more than its smallest leaf. Labels are numbered in tree order of each fragment's
    first leaf. The result depends on the full shapes only, so it is the same on every
    rank.

    Args:
        params: the params' tree: local shards as :func:`~functional_hsdp.shard` or
            :func:`~functional_hsdp.shard_module` return them (their full shapes are read
            from the placement they carry), local shards at ``spec``'s optimizer placement
            (pass ``spec``), or tensors of the full shapes (meta tensors are fine).
        fragments: F, an int from 1 to the number of leaves.
        spec: the spec ``params`` are sharded with (``dl.inner``, or
            ``fh.replicas(spec, axis)``), for local shards that carry no placement.

    Returns:
        A tree of ints in [0, F), each used, with the params' structure.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> params = {"embed": torch.zeros(64, 8), "head": torch.zeros(8, 64),
        ...           "l0": torch.zeros(16, 16), "l1": torch.zeros(16, 16)}
        >>> fh.balanced_fragments(params, 2)     # 1024 bytes each way
        {'embed': 0, 'head': 1, 'l0': 0, 'l1': 1}
        >>> fh.diloco(fh.hsdp(fh.SimMesh({"dp_outer": 2, "dp_inner": 2}),
        ...                   "dp_outer", "dp_inner"), axis="dp_outer", every=4,
        ...           outer=fh.sgd(0.7, momentum=0.9, nesterov=True),
        ...           fragments=fh.balanced_fragments(params, 2), delay=1).fragments
        {'embed': 0, 'head': 1, 'l0': 0, 'l1': 1}
    """
    if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1:
        raise ValueError(f"balanced_fragments: fragments must be an int >= 1; got {fragments!r}")
    leaves, treedef, paths = flatten(params, "params")
    if fragments > len(leaves):
        raise ValueError(
            f"balanced_fragments: fragments={fragments} is more than the params' "
            f"{len(leaves)} leaves; each fragment needs at least one leaf"
        )
    sizes = _full_bytes(leaves, treedef, paths, spec=spec)
    load, label = [0] * fragments, [0] * len(leaves)
    for i in sorted(range(len(leaves)), key=lambda i: (-sizes[i], i)):
        p = min(range(fragments), key=lambda q: (load[q], q))
        load[p] += sizes[i]
        label[i] = p
    order = {p: k for k, p in enumerate(dict.fromkeys(label))}  # first leaf in tree order
    return optree.tree_unflatten(treedef, [order[p] for p in label])


def _full_bytes(leaves: list, treedef: Any, paths: Sequence[str], *, spec: Any) -> list[int]:
    """Each leaf's full bytes: from the params' plan (:func:`_params_plan`), else from their
    own shapes (full tensors)."""
    found = _params_plan(leaves, treedef, paths, spec=spec)
    if found is None:
        return [_bytes(x.shape, x.dtype) for x in leaves]
    return _plan_bytes(found[0])


def _plan_bytes(plan: Any) -> list[int]:
    """Each leaf's full bytes, from ``plan``'s shapes and dtypes."""
    return [_bytes(s, d) for s, d in zip(plan.shapes, plan.dtypes)]


def _params_plan(
    leaves: list, treedef: Any, paths: Sequence[str], *, spec: Any
) -> tuple[Any, str] | None:
    """The params' plan and role: the placement the leaves carry (a unit tree's, ...), else
    ``spec``'s layout of them at its optimizer placement; None without either."""
    made = result_state(leaves)
    if made is not None and made.role in ("optimizer", "parameter"):
        return made.plan, made.role
    if spec is None:
        return None
    plan, _ = find_layout(
        leaves,
        treedef,
        paths,
        spec=spec,
        like=None,
        roles=("optimizer",),
        kinds=("weights", "final"),
        name="params",
    )
    return plan, "optimizer"


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"diloco: {name} must be an int >= {low}; got {value!r}")


#: the pseudo-gradient's bucket cap (as pmean's default): 25 MiB of fp32
_CAP_MB = 25.0


def _start_compressed(
    local: list[torch.Tensor],
    *,
    mesh: Mesh,
    axis: str,
    compress: Compress,
    packing: _Packing,
    keys: tuple,
    residual: list[torch.Tensor] | None = None,
) -> _CompressedSync:
    """The average over ``axis`` of each rank's pseudo-gradient pieces ``local``, compressed,
    started: the fragment's ``packing`` rows cut into buckets of the pmean's cap, every
    bucket's first leg issued (quantize, all-to-all;
    :func:`~functional_hsdp.runtime.compressed.start`),
    ``residual`` (the pieces' fp32 residual, or None: zeros) added first. Its ``result()``
    sums in fp32 and runs the all-gathers: the averages (the pieces' dtypes) by ``keys``,
    and ``residual()`` the new residual pieces (fp32; None without error feedback)."""
    cap = max(1, int(_CAP_MB * 2**20) // 4)
    flat = packing.gather(local)
    res = None if residual is None else packing.gather(residual)
    cuts = [(lo, min(lo + cap, packing.length)) for lo in range(0, packing.length, cap)]
    flight = start_compressed(
        mesh,
        [flat[..., lo:hi] for lo, hi in cuts],
        axis=axis,
        compress=compress,
        residuals=None if res is None else [res[..., lo:hi] for lo, hi in cuts],
    )
    return _CompressedSync(flight, packing=packing, keys=keys, dtypes=[x.dtype for x in local])


class _Packing:
    """Where a fragment's pseudo-gradient sits in its compressed buckets, built once per tree
    and fragment (:func:`_packing`): per rank, its elements of the fragment's local pieces, in
    tree order, side by side; each row zero-padded to ``length``, the longest rank's.

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


def _packing(plan: Any, leaves: list[torch.Tensor], *, role: str, members: list[int]) -> _Packing:
    """The :class:`_Packing` of the leaves ``members`` (tree indices) of ``leaves``, local
    values at ``role`` of ``plan``: which elements of each piece are this rank's (its mesh's
    fill is not) comes from packing ones and unpacking them; the longest row from the
    plan's layout, for every rank of the mesh (:func:`_longest`)."""
    with torch.no_grad():
        ones = [torch.ones_like(x) for x in leaves]
        bufs = [plan.pack(b, ones, role) for b in range(len(plan.buckets))]
        masks = plan.unpack(bufs, role)
    lead = plan.mesh.batch_shape
    real = torch.cat([masks[i].reshape(*lead, -1) != 0 for i in members], -1)
    width, length = real.shape[-1], _longest(plan, role, set(members))
    real = torch.nn.functional.pad(real, (0, max(length - width, 0)))  # a DistMesh's short row
    first = torch.argsort((~real).to(torch.uint8), dim=-1, stable=True)[..., :length]
    mine = torch.arange(length, device=real.device) < real.sum(-1, keepdim=True)
    index = torch.where(mine, first, width)
    shapes = [tuple(masks[i].shape) for i in members]
    # a DistMesh's pieces hold no fill (checked: one host read, once per tree and fragment)
    whole = not lead and bool(real[..., :width].all())
    return _Packing(index, shapes, length, whole=whole)


def _longest(plan: Any, role: str, members: set[int]) -> int:
    """The most elements of the leaves ``members`` any rank holds at ``role``: from the
    plan's buckets, for every coordinate of the mesh (a DistMesh rank sees only its own
    pieces, and every rank must agree on the buckets' length)."""
    mesh = plan.mesh
    coords = dict(zip(mesh.axis_names, np.indices(mesh.sizes).reshape(len(mesh.sizes), -1)))
    total = np.zeros(math.prod(mesh.sizes), dtype=np.int64)
    for bucket, placed in zip(plan.buckets, plan.placed):
        placed, slots = placed[role], [s for s in bucket.slots if s.index in members]
        if not slots:
            continue
        if getattr(placed.geometry, "kept", False):  # Owner on some axes: each rank's pieces
            at = placed.geometry.at  # for every rank of the mesh, in coordinate order
            for k, rank in enumerate(np.ndindex(*mesh.sizes)):
                total[k] += sum(
                    hi - lo for j, lo, hi, _ in at[rank] if bucket.slots[j].index in members
                )
        elif not placed.axes:  # whole leaves on every rank
            total += sum(s.numel for s in slots)
        elif bucket.shard is not None:  # torch.chunk along the shard dim
            axis, dim = bucket.shard
            for s in slots:
                along = np.clip(s.shape[dim] - coords[axis] * s.size, 0, s.size)
                total += s.numel // s.shape[dim] * along
        else:  # Flat: each leaf's range cut by the rank's chunk of the bucket
            start, stride = 0, bucket.padded
            for a in placed.axes:
                stride //= mesh.size(a)
                start = start + coords[a] * stride
            for s in slots:
                lo = np.clip(s.offset - start, 0, placed.length)
                total += np.maximum(np.clip(s.offset + s.numel - start, 0, placed.length), lo) - lo
    return int(total.max())


class DiLoCo(NamedTuple):
    """What :func:`diloco` returns.

    Attributes:
        inner: the inner loop's spec, ``fh.replicas(spec, axis)``.
        init: ``init(params) -> DiLoCoState``; on meta tensors of the full shapes, the
            ``like`` that :func:`~functional_hsdp.empty_state_dict` and
            :func:`~functional_hsdp.load_state_dict` take.
        update: ``update(params, state) -> (params, state)``, once after every inner step.
        axis: the replica axis.
        every: H, steps between two syncs of a fragment.
        fragments: as given: F, or the tree of labels.
        delay: tau, steps between a sync's issue and its merge.
        mix: the merge factor.
        compress: the pseudo-gradient's compression policy, or None.
    """

    inner: Any
    init: Any
    update: Any
    axis: str
    every: int
    fragments: int
    delay: int
    mix: float
    compress: Compress | None = None


def _mesh(spec: Any) -> Mesh:
    leaves = optree.tree_leaves(spec, is_leaf=lambda x: isinstance(x, Spec))
    if not leaves or not all(isinstance(x, Spec) for x in leaves):
        raise TypeError(f"diloco: spec must be a Spec or a pytree prefix of Specs; got {spec!r}")
    return leaves[0].mesh


def diloco(
    spec: Any,
    *,
    axis: str,
    every: int,
    outer: GradientTransformation,
    fragments: Any = 1,
    delay: int = 0,
    mix: float = 1.0,
    compress: Any = None,
) -> DiLoCo:
    """DiLoCo and Streaming DiLoCo: replicas along ``axis`` train apart and meet every
    ``every`` steps, fragment by fragment, with an outer optimizer on the pseudo-gradient.

    The inner loop trains on ``.inner`` (``fh.replicas(spec, axis)``: every path works on
    it, none communicates over ``axis``); after each inner optimizer step,
    ``params, state = dl.update(params, state)`` issues the syncs due (see the module
    docstring for the math and the schedule, :func:`sync_steps`). Steps without a sync issue
    no collective at all.

    Args:
        spec: a :class:`Spec` or spec tree (say ``fh.hsdp(mesh, "dp_outer", "dp_inner")``).
        axis: the replica axis (a data-parallel axis of ``spec``).
        every: H >= 1, inner steps between two syncs of one fragment.
        outer: the outer optimizer, any GradientTransformation; the papers' is
            ``fh.sgd(0.7, momentum=0.9, nesterov=True)``.
        fragments: an int F (leaves in tree-flatten order cut into F contiguous groups of
            about equal bytes), or a tree of ints in [0, F), each used, with the params'
            structure (or a prefix of it: one label per unit of a spec tree);
            :func:`balanced_fragments` makes one whose fragments hold nearly equal bytes
            (Streaming DiLoCo's peak transfer 1/F of a whole sync where contiguous groups
            cannot reach it).
        delay: tau in [0, every): a fragment's sync issued after step t merges after step
            t + tau, with that step's params.
        mix: merge factor in (0, 1]: a synced fragment becomes
            ``mix * anchor + (1 - mix) * params`` (1: the anchor).
        compress: the pseudo-gradient's compression, a policy from ``fh.compress(...)``
            (None: the reduce dtype, uncompressed). Each rank quantizes its part, an
            all-to-all moves the pieces, each rank sums its piece in fp32 and quantizes the
            sum, an all-gather returns it: one all-to-all and one all-gather per bucket over
            ``axis``, nothing else. With error feedback the rounding's residual is the
            state's ``residual``, added into the fragment's next sync (and checkpointed).

    Returns:
        A :class:`DiLoCo` with ``.inner``, ``.init(params)`` and ``.update(params, state)``.
        ``update`` returns new trees (a leaf that did not sync is the same tensor); shards
        that must stay the same tensors (``MainGrad``, ``functional_call(into=...)``) take
        the new values with ``copy_``.

    References:
        Douillard et al., *DiLoCo: Distributed Low-Communication Training of Language
        Models*, arXiv 2311.08105, 2023; Douillard et al., *Streaming DiLoCo with
        overlapping communication*, arXiv 2501.18512, 2025.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
        >>> dl = fh.diloco(fh.hsdp(mesh, "dp_outer", "dp_inner"), axis="dp_outer", every=2,
        ...                outer=fh.sgd(0.7, momentum=0.9, nesterov=True))
        >>> params = fh.shard({"w": torch.zeros(4)}, dl.inner)
        >>> state = dl.init(params)
        >>> for step in range(2):                       # each replica its own "gradient"
        ...     params = {"w": params["w"] - torch.tensor([1.0, 3.0]).view(2, 1, 1)}
        ...     params, state = dl.update(params, state)
        >>> fh.gather(params, dl.inner)["w"][:, 0]      # met: -4 * 0.7 * (1 + 0.9)
        tensor([[-5.3200, -5.3200, -5.3200, -5.3200],
                [-5.3200, -5.3200, -5.3200, -5.3200]])

        The same, with the pseudo-gradient sent as int8 (one fp32 scale per block):

        >>> dl = fh.diloco(fh.hsdp(mesh, "dp_outer", "dp_inner"), axis="dp_outer", every=1,
        ...                outer=fh.sgd(1.0), compress=fh.compress(torch.int8))
        >>> params = fh.shard({"w": torch.zeros(4)}, dl.inner)
        >>> state = dl.init(params)
        >>> params = {"w": params["w"] - torch.tensor([0.3, 1.0]).view(2, 1, 1)}
        >>> with fh.comm_log() as log:
        ...     params, state = dl.update(params, state)
        >>> [(e.op, e.axis, str(e.dtype)) for e in log.events]
        [('all_to_all', 'dp_outer', 'torch.int8'), ('all_gather', 'dp_outer', 'torch.int8')]
        >>> fh.gather(params, dl.inner)["w"][0, 0]      # the mean, -0.65, within int8's step
        tensor([-0.6500, -0.6500, -0.6500, -0.6500])
        >>> fh.gather(state.residual, dl.inner)["w"].shape   # per rank: what rounding lost
        torch.Size([2, 2, 4])
    """
    mesh = _mesh(spec)
    _check_options(mesh, axis=axis, every=every, outer=outer, delay=delay, mix=mix)
    if compress is not None and not isinstance(compress, Compress):
        raise TypeError(
            f"diloco: compress must be a policy from fh.compress(...) (say "
            f"fh.compress(torch.int8)) or None; got {compress!r}"
        )
    if isinstance(fragments, int) and not isinstance(fragments, bool):
        _check_int("fragments", fragments, 1)
    options = dict(axis=axis, every=every, fragments=fragments, delay=delay, mix=float(mix))
    run = _Outer(replicas(spec, axis), mesh, outer=outer, compress=compress, **options)
    return DiLoCo(inner=run.inner, init=run.init, update=run.advance, compress=compress, **options)


def _check_options(mesh: Mesh, *, axis: Any, every: Any, outer: Any, delay: Any, mix: Any):
    if not isinstance(axis, str) or axis not in mesh.axis_names:
        raise ValueError(
            f"diloco: axis {axis!r} is not in the mesh; its axes are {mesh.axis_names}"
        )
    _check_int("every", every, 1)
    _check_int("delay", delay, 0)
    if delay >= every:
        raise ValueError(
            f"diloco: delay must be < every (a fragment's sync lands before its next one is "
            f"issued); got delay={delay}, every={every}"
        )
    if isinstance(mix, bool) or not isinstance(mix, (int, float)) or not 0 < mix <= 1:
        raise ValueError(f"diloco: mix must be in (0, 1]; got {mix!r}")
    if not (callable(getattr(outer, "init", None)) and callable(getattr(outer, "update", None))):
        raise TypeError(f"diloco: outer must be a GradientTransformation; got {outer!r}")


class _Layout(NamedTuple):
    """What ``_Outer.layout`` keeps per params treedef: each leaf's fragment, F, the
    params' plan and role, the residual's plan (fp32) and the leaves' paths."""

    of: list[int]
    n: int
    plan: Any
    role: str
    residual_plan: Any
    paths: tuple[str, ...]


class _Step:
    """One call of ``update``: the trees' leaves, changed in place of the lists."""

    def __init__(self, params: list, state: DiLoCoState, treedef: Any):
        self.like, self.treedef = params, treedef
        self.new, self.anchor = list(params), list(optree.tree_leaves(state.anchor))
        self.pending = None if state.pending is None else _pending_leaves(state.pending)
        self.residual = None if state.residual is None else list(optree.tree_leaves(state.residual))
        self.outer, self.due = dict(state.outer.inner), list(state.due)
        self.flight = list(state.flight) or [None] * len(self.due)
        self.touched = False

    def result(self, params: Any, t: int) -> tuple[Any, DiLoCoState]:
        tree = lambda xs: optree.tree_unflatten(self.treedef, xs)  # noqa: E731
        if self.touched:  # the new trees are at the params' placement: tagged so
            for xs in (self.new, self.anchor):  # pending: MaskedNode leaves, tagged when saved
                if xs is not None:
                    _tag_like(xs, self.like)
            params = tree(self.new)
        state = DiLoCoState(
            anchor=tree(self.anchor),
            outer=PartitionState(self.outer),
            count=t,
            due=tuple(self.due),
            pending=None if self.pending is None else tree(self.pending),
            residual=None if self.residual is None else tree(self.residual),
            flight=tuple(self.flight) if any(self.flight) else (),
        )
        return params, state


class _Outer:
    """The outer loop of one :func:`diloco` (its ``init`` and ``update``)."""

    def __init__(self, inner, mesh, *, axis, every, outer, fragments, delay, mix, compress):
        self.inner, self.mesh, self.axis, self.every = inner, mesh, axis, every
        self.outer, self.fragments, self.delay, self.mix = outer, fragments, delay, mix
        self.compress = compress
        self._cache: dict[Any, _Layout] = {}
        self._packings: dict = {}  # (treedef, fragment) -> its _Packing, for compress=

    def layout(self, params: Any) -> tuple[list, Any, list[int], int]:
        """params' leaves, treedef, each leaf's fragment and F (checked once per treedef)."""
        leaves, treedef, paths = flatten(params, "params")
        if treedef not in self._cache and leaves and all(x.is_meta for x in leaves):
            # a like for loading a checkpoint: full shapes (fh.empty_state_dict's like)
            sizes = _full_bytes(leaves, treedef, paths, spec=None)
            return (
                leaves,
                treedef,
                *_fragments(self.fragments, params, treedef=treedef, paths=paths, sizes=sizes),
            )
        if treedef not in self._cache:
            plan, role = self._plan(leaves, treedef, paths)
            sizes = _plan_bytes(plan)
            self._cache.clear()
            self._packings.clear()
            of, n = _fragments(self.fragments, params, treedef=treedef, paths=paths, sizes=sizes)
            self._cache[treedef] = _Layout(
                of=of,
                n=n,
                plan=plan,
                role=role,
                residual_plan=_residual_plan(plan, paths),
                paths=tuple(paths),
            )
        layout = self._cache[treedef]
        return leaves, treedef, layout.of, layout.n

    def _packing_of(self, treedef: Any, leaves: list, *, of: list[int], p: int) -> _Packing:
        """Fragment ``p``'s :class:`_Packing` (made by ``init``, or at the first sync)."""
        key = (treedef, p)
        if key not in self._packings:
            plan, role = self._cache[treedef].plan, self._cache[treedef].role
            members = [i for i, f in enumerate(of) if f == p]
            self._packings[key] = _packing(plan, leaves, role=role, members=members)
        return self._packings[key]

    def _plan(self, leaves: list, treedef: Any, paths: Sequence[str]) -> tuple[Any, str]:
        """The params' plan and role (their placement)."""
        plan, role = _params_plan(leaves, treedef, paths, spec=self.inner)
        wrong = [s for s in plan.specs if self.axis not in s.replica_axes]
        if wrong:
            raise ValueError(
                f"diloco: params were sharded with {wrong[0]!r}, which reduces over "
                f"{self.axis!r}; shard them with the inner spec (dl.inner: replicas on "
                f"{self.axis!r})"
            )
        return plan, role

    def init(self, params: Any) -> DiLoCoState:
        leaves, treedef, of, n = self.layout(params)
        anchor = [x.detach().clone() for x in leaves]
        _tag_like(anchor, leaves)
        outer_states = {
            str(p): self.outer.init(_masked(treedef, anchor, of=of, p=p, like=leaves))
            for p in range(n)
        }
        pending = residual = None
        if self.delay:
            pending = optree.tree_unflatten(treedef, [masked_node(x) for x in leaves])
        if self.compress is not None and treedef in self._cache:  # not for a meta like
            for p in range(n):  # every layout the wire cannot take is refused here
                self._packing_of(treedef, leaves, of=of, p=p)
        if self.compress is not None and self.compress.error_feedback:
            residual = _zeros(treedef, leaves, dtype=torch.float32)
            self._tag_residual(treedef, residual)
        return DiLoCoState(
            anchor=optree.tree_unflatten(treedef, anchor),
            outer=PartitionState(outer_states),
            count=0,
            due=(0,) * n,
            pending=pending,
            residual=residual,
        )

    def advance(self, params: Any, state: DiLoCoState) -> tuple[Any, DiLoCoState]:
        leaves, treedef, of, n = self.layout(params)
        feedback = self.compress is not None and self.compress.error_feedback
        _check_state(state, treedef, leaves=leaves, n=n, delay=self.delay, feedback=feedback)
        t, step = state.count + 1, _Step(leaves, state, treedef)
        for p in (q for q in range(n) if step.due[q] == t):  # syncs issued tau steps ago land
            if step.flight[p] is not None:
                self._land(step, of=of, sync=step.flight[p])
            else:  # held in pending (a state loaded from a checkpoint)
                self._merge(step, of=of, p=p, delta=_held(step, of=of, p=p, t=t))
            for i, f in enumerate(of):
                if f == p and isinstance(step.pending[i], torch.Tensor):
                    step.pending[i] = masked_node(step.pending[i])
            step.due[p], step.flight[p], step.touched = 0, None, True
        if step.pending is not None:  # loaded whole from a checkpoint: mask what is not in flight
            for i, f in enumerate(of):
                if not step.due[f] and isinstance(step.pending[i], torch.Tensor):
                    step.pending[i] = masked_node(step.pending[i])
        for p, s in enumerate((q + 1) * self.every // n for q in range(n)):
            if t >= s and (t - s) % self.every == 0:
                self._issue(step, of=of, p=p, t=t)
        params, state = step.result(params, t)
        if step.touched and state.residual is not None:
            self._tag_residual(treedef, state.residual)
        return params, state

    def _tag_residual(self, treedef: Any, residual: Any) -> None:
        """Tag the residual at the params' layout in fp32 (:func:`_residual_plan`), where
        :func:`~functional_hsdp.state_dict` finds and saves it (not for a meta ``like``)."""
        if treedef in self._cache:
            layout = self._cache[treedef]
            role, plan = layout.role, layout.residual_plan
            tag(optree.tree_leaves(residual), plan, role, kind="weights")

    def _issue(self, step: _Step, *, of: list[int], p: int, t: int) -> None:
        step.touched = True
        sync = self._start(step, of=of, p=p)
        if not self.delay:
            self._land(step, of=of, sync=sync)
        else:  # in flight until it lands
            step.flight[p], step.due[p] = sync, t + self.delay

    def _start(self, step: _Step, *, of: list[int], p: int) -> SyncInFlight:
        """Fragment ``p``'s sync started: uncompressed, one all-reduce (AVG) per bucket in flight;
        compressed, every bucket's first leg (after an agreement of its own)."""
        idx = tuple(i for i, f in enumerate(of) if f == p)
        local = [(step.anchor[i] - step.new[i]).detach() for i in idx]
        keys = tuple(self._cache[step.treedef].paths[i] for i in idx)  # named in errors
        named = dict(zip(keys, local))
        if self.compress is None:
            reduction = start_pmean(
                named, self.axis, self.mesh, bucket_cap_mb=_CAP_MB, name="pseudo_gradient"
            )
            return SyncInFlight(p, idx, keys=keys, reduction=reduction)
        agree_pmean(  # before the compressed legs: ranks that differ raise, all alike
            named,
            self.axis,
            self.mesh,
            bucket_cap_mb=_CAP_MB,
            name="pseudo_gradient",
            options=(f"compress={self.compress!r}",),
        )
        reduction = _start_compressed(
            local,
            mesh=self.mesh,
            axis=self.axis,
            compress=self.compress,
            packing=self._packing_of(step.treedef, step.like, of=of, p=p),
            keys=keys,
            residual=None if step.residual is None else [step.residual[i] for i in idx],
        )
        return SyncInFlight(p, idx, keys=keys, reduction=reduction)

    def _land(self, step: _Step, *, of: list[int], sync: SyncInFlight) -> None:
        """A sync lands: the outer step and merge with its result, and its new residual."""
        self._merge(step, of=of, p=sync.fragment, delta=sync.result())
        new = sync.residual()
        for i, r in zip(sync.leaves, new or ()):
            step.residual[i] = r

    def _merge(self, step: _Step, *, of: list[int], p: int, delta: list[torch.Tensor]) -> None:
        """The outer step on fragment ``p`` with its averaged pseudo-gradient, and the merge."""
        idx = [i for i, f in enumerate(of) if f == p]
        full = list(step.anchor)
        for i, d in zip(idx, delta):
            full[i] = d
        g = _masked(step.treedef, full, of=of, p=p, like=step.like)
        a = _masked(step.treedef, step.anchor, of=of, p=p, like=step.like)
        updates, step.outer[str(p)] = self.outer.update(g, step.outer[str(p)], a)
        mix = self.mix
        for i, x in zip(idx, optree.tree_leaves(apply_updates(a, updates))):
            step.anchor[i] = x
            old = step.new[i]
            step.new[i] = x.clone() if mix == 1 else (mix * x + (1 - mix) * old).to(old.dtype)


def _bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _residual_plan(plan: Any, paths: Sequence[str]) -> Any:
    """``plan``'s layout in fp32: the leaves' dtypes still choose which share a bucket (as
    a MainGrad's fp32 buffers keep the parameters' layout), so the residual's local shapes
    are the params', and a checkpoint packs it in fp32."""
    meta = plan.meta
    kinds = meta.kinds if meta.kinds is not None else meta.dtypes
    fp32 = dataclasses.replace(meta, dtypes=(torch.float32,) * len(meta.dtypes), kinds=kinds)
    return get_plan(fp32, tuple(paths))


def _zeros(treedef: Any, leaves: list, *, dtype: torch.dtype | None) -> Any:
    """A tree of zeros like the params' ``leaves`` (in ``dtype``, default theirs), tagged
    with their placement."""
    zeros = [torch.zeros_like(x, dtype=dtype) for x in leaves]
    _tag_like(zeros, leaves)
    return optree.tree_unflatten(treedef, zeros)


def _masked(treedef: Any, leaves: list, *, of: list[int], p: int, like: list) -> Any:
    """The tree with fragment ``p``'s leaves from ``leaves`` and the others MaskedNode (marked
    from the params' leaves ``like``, so that every tree of one fragment has one structure)."""
    return optree.tree_unflatten(
        treedef, [x if f == p else masked_node(m) for x, f, m in zip(leaves, of, like)]
    )


def _held(step: _Step, *, of: list[int], p: int, t: int) -> list[torch.Tensor]:
    """Fragment ``p``'s averaged pseudo-gradient, landing after step ``t`` with nothing in
    flight: what ``pending`` holds (a state loaded from a checkpoint)."""
    held = [step.pending[i] for i, f in enumerate(of) if f == p]
    if any(isinstance(x, MaskedNode) for x in held):
        raise ValueError(
            f"state: fragment {p}'s sync lands after step {t}, but it is neither in flight "
            "(state.flight) nor held (state.pending): this state lost it (a state from a "
            "checkpoint holds it in pending; build states with init, update and load_state_dict)"
        )
    return held


def _pending_leaves(pending: Any) -> list:
    """``pending``'s leaves in tree order, a :class:`MaskedNode` one included."""
    return optree.tree_leaves(pending, is_leaf=lambda x: isinstance(x, MaskedNode))


def pending_tree(state: DiLoCoState) -> Any:
    """``state.pending`` whole: the syncs in flight waited for and in their place, zeros
    (like the anchor's leaves, and at their placement) in place of the other
    :class:`MaskedNode` leaves; what a checkpoint saves. None without a delay."""
    if state.pending is None:
        return None
    anchor, treedef = optree.tree_flatten(state.anchor)
    held = _pending_leaves(state.pending)
    for i, x in _flown(state, SyncInFlight.result).items():
        held[i] = x
    full = [x if isinstance(x, torch.Tensor) else torch.zeros_like(a) for x, a in zip(held, anchor)]
    _tag_like(full, anchor)
    return optree.tree_unflatten(treedef, full)


def residual_tree(state: DiLoCoState) -> Any:
    """``state.residual`` with the new residual of each compressed sync in flight in its
    fragment's place (the sync finished now: the update where it lands reuses it); what a
    checkpoint saves. None without error feedback."""
    if state.residual is None:
        return None
    leaves, treedef = optree.tree_flatten(state.residual)
    new = _flown(state, SyncInFlight.residual)
    if not new:
        return state.residual
    out = [new.get(i, x) for i, x in enumerate(leaves)]
    _tag_like(out, leaves)
    return optree.tree_unflatten(treedef, out)


def _flown(state: DiLoCoState, which: Any) -> dict[int, torch.Tensor]:
    """Leaf index -> a copy of what the sync in flight on it brings (``which(sync)``: its
    result or its new residual, one tensor per leaf, or None), waited for now (the update
    where it lands reuses it). Copies: the originals are views of the reduction's buckets,
    and a checkpoint tags what it saves."""
    out = {}
    for sync in state.flight:
        got = None if sync is None else which(sync)
        if got is not None:
            out.update((i, x.clone()) for i, x in zip(sync.leaves, got))
    return out


def _tag_like(out: list[torch.Tensor], leaves: list[torch.Tensor]) -> None:
    made = result_state(leaves)
    if made is not None:  # the params' placement, kept (as apply_updates does)
        tag(out, made.plan, made.role, kind=made.kind)


def _fragments(
    fragments: Any, params: Any, *, treedef: Any, paths: Sequence[str], sizes: list[int]
) -> tuple[list[int], int]:
    """Each leaf's fragment, and F."""
    n_leaves = len(sizes)
    if isinstance(fragments, int) and not isinstance(fragments, bool):
        if fragments > n_leaves:
            raise ValueError(
                f"diloco: fragments={fragments} is more than the params' {n_leaves} leaves; "
                "each fragment needs at least one leaf"
            )
        return _contiguous(sizes, fragments), fragments
    try:
        labels = optree.tree_leaves(optree.tree_broadcast_prefix(fragments, params))
    except ValueError as e:
        raise ValueError(
            f"diloco: fragments is not a pytree prefix of the params' tree: "
            f"{structure_error(treedef, fragments, 'fragments', what='params')}"
        ) from e
    bad = [
        (path, x)
        for path, x in zip(paths, labels)
        if isinstance(x, bool) or not isinstance(x, int) or x < 0
    ]
    if bad:
        path, x = bad[0]
        raise ValueError(
            f"diloco: fragments{path[len('params') :]}: label {x!r} is not an int >= 0"
        )
    n = len(set(labels))
    for path, x in zip(paths, labels):
        if x >= n:
            raise ValueError(
                f"diloco: fragments{path[len('params') :]}: label {x} is out of range [0, {n}): "
                f"the labels must be 0 .. F-1, each used (got {sorted(set(labels))})"
            )
    return list(labels), n


def _contiguous(sizes: list[int], n: int) -> list[int]:
    """Contiguous groups of about equal bytes: group k starts at the first leaf whose middle
    byte lies past k/n of the total, kept to at least one leaf per group."""
    total, count = sum(sizes) or 1, len(sizes)
    middles, before = [], 0
    for s in sizes:
        middles.append(2 * before + s)
        before += s
    starts = [0]
    for k in range(1, n):
        at = next((i for i, m in enumerate(middles) if m * n >= 2 * k * total), count)
        starts.append(min(max(at, starts[-1] + 1), count - (n - k)))
    return [sum(1 for b in starts[1:] if b <= i) for i in range(count)]


def _check_flight(state: DiLoCoState, n: int) -> None:
    """``state.flight``: ``()``, or per fragment None or its own :class:`SyncInFlight`, due."""
    if state.flight and (
        len(state.flight) != n
        or any(x is not None and not isinstance(x, SyncInFlight) for x in state.flight)
    ):
        raise ValueError(
            f"state.flight: expected {n} entries (None or a SyncInFlight, per fragment); "
            f"got {state.flight!r}"
        )
    for p, sync in enumerate(state.flight):
        if sync is not None and (sync.fragment != p or state.due[p] <= state.count):
            raise ValueError(
                f"state.flight[{p}]: {sync!r} does not match fragment {p}'s schedule (due "
                f"after step {state.due[p]}, the state at step {state.count}): this state was "
                "not made by init and update"
            )


def _check_state(
    state: Any, treedef: Any, *, leaves: list, n: int, delay: int, feedback: bool
) -> None:
    if not isinstance(state, DiLoCoState):
        raise TypeError(
            f"state: expected a DiLoCoState (from this diloco's init); got {type(state).__name__}"
        )
    if len(state.due) != n or (state.pending is None) != (delay == 0):
        raise ValueError("state: was made by another diloco (fragments or delay differ)")
    if (state.residual is None) == feedback:
        raise ValueError(
            "state: was made by another diloco (compress differs: the residual of error "
            f"feedback is {'missing' if feedback else 'there'})"
        )
    _check_flight(state, n)
    held = None if state.pending is None else len(_pending_leaves(state.pending))
    if held is not None and held != len(leaves):
        raise ValueError(
            f"state.pending: {held} leaves, the params {len(leaves)}: this state was made "
            "for another tree"
        )
    for name in ("anchor", "residual"):
        tree = getattr(state, name)
        if tree is None:
            continue
        got, got_def = optree.tree_flatten(tree)
        if got_def != treedef:
            raise ValueError(structure_error(treedef, tree, f"state.{name}", what="params"))
        for i, (a, p) in enumerate(zip(got, leaves)):
            if a.shape != p.shape:  # the path only for the message: not on every call
                path = format_path(treedef.paths()[i])
                raise ValueError(
                    f"state.{name}{path}: local shape {tuple(a.shape)}, params{path} "
                    f"{tuple(p.shape)}: this state was made for another spec or tree"
                )


# -- checkpoints ------------------------------------------------------------------------------


def _as_dict(state: DiLoCoState, convert: Any) -> dict[str, Any]:
    """A DiLoCoState as a dict: its trees (anchor, pending, residual) and outer state
    converted (``convert(value, field name)``), the step count and each fragment's due step
    as host values. A sync in flight (``state.flight``) is waited for and saved averaged in
    ``pending`` (the update where it lands gets the same tensors), so any step saves;
    ``pending`` is saved whole (:func:`pending_tree`: zeros where it is MaskedNode), so every
    step's checkpoint has one structure, and the state it loads into has nothing in
    flight. The residual of a compressed sync's error feedback is per rank: a tree at the
    params' placement, saved like them (one row per replica, each replica's own), with the
    new residual of a compressed sync in flight in its fragment's place
    (:func:`residual_tree`)."""
    out = {
        "anchor": convert(state.anchor, "anchor"),
        "outer": convert(state.outer, "outer"),
        "count": state.count,
        "due": list(state.due),
    }
    trees = {"pending": pending_tree(state), "residual": residual_tree(state)}
    for name, tree in trees.items():
        if tree is not None:
            out[name] = convert(tree, name)
    return out


def _loaded(state: dict, spec: Any, like: DiLoCoState, *, name: str) -> DiLoCoState:
    """What :func:`_as_dict` saved, loaded at ``like``'s layout (``name``: for errors)."""
    trees = [key for key in ("pending", "residual") if getattr(like, key) is not None]
    for key in ("anchor", "outer", "count", "due", *trees):
        if key not in state:
            raise ValueError(f"{name}: has no entry {key!r} (for DiLoCoState.{key})")
    if len(state["due"]) != len(like.due):
        raise ValueError(
            f"{name}['due']: {len(state['due'])} fragments, but like has {len(like.due)}: "
            "load with the diloco (fragments) the checkpoint was saved with"
        )
    # the residual (fp32) sits at the params' layout: their dtypes choose its buckets
    kinds = dict(residual=tuple(x.dtype for x in optree.tree_leaves(like.anchor)))
    loaded = dict.fromkeys(("pending", "residual"))
    likes = {"pending": pending_tree(like), "residual": like.residual}
    for key in trees:
        loaded[key] = load_tree(
            state[key], spec, likes[key], name=f"{name}[{key!r}]", kinds=kinds.get(key)
        )
    return DiLoCoState(
        anchor=load_tree(state["anchor"], spec, like.anchor, name=f"{name}['anchor']"),
        outer=load_state_dict(state["outer"], spec, like.outer),
        count=int(state["count"]),
        due=tuple(int(x) for x in state["due"]),
        **loaded,
    )

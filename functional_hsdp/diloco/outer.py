"""DiLoCo's outer step: :func:`diloco` -> :class:`DiLoCo`, its ``init`` and ``update``.

Invariant: a fragment's sync is one reduction of its leaves' local shards over the axis
(:func:`~functional_hsdp.sync.collectives.start_pmean`'s, or with ``compress=`` the
compressed route's, :func:`~functional_hsdp.runtime.compressed.start_packed`), agreed by the
replicas before its first collective, issued by the ``update`` after its step and waited for
once by the one where it lands; steps without a sync issue no collective. The state is the
caller's; this room keeps per params tree its cut only (``cut.TreeCuts``).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import optree
import torch

from ..base.cache import lru
from ..base.tree import MaskedNode, masked_node
from ..mesh import Mesh
from ..mesh.replicas import replica_quorum
from ..optim.combine import PartitionState
from ..optim.transformation import GradientTransformation, apply_updates
from ..runtime.compressed import start_packed
from ..spec.quantize import Compress
from ..spec.specs import Spec, replicas
from ..sync.collectives import agree_pmean, start_pmean
from .cut import TreeCuts
from .schedule import check_int, syncs_after
from .state import DiLoCoState, check_state, pending_leaves, tag_like
from .syncs import SyncInFlight

__all__ = ["DiLoCo", "diloco"]


#: the pseudo-gradient's bucket cap (as pmean's default): 25 MiB of fp32
_CAP_MB = 25.0


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
        sync_due: ``sync_due(state) -> bool``: whether the next ``update`` issues a sync (on
            a fault-tolerant axis the loop starts a quorum, ``ft.quorum``, on those steps).
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
    sync_due: Any = None


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
    ``params, state = dl.update(params, state)`` issues the syncs due. Steps without a sync
    issue no collective at all.

    Inner steps are counted t = 1, 2, ... Fragment p syncs after step t when t >= s_p and
    (t - s_p) % every == 0, with s_p = floor((p + 1) * every / F) (:func:`sync_steps`). At a
    sync, for the fragment's leaves (local shards at the inner spec's optimizer placement):

    =====================  ==================================================================
    step                   what happens
    =====================  ==================================================================
    issue (after t)        ``delta = anchor - params``: one all-reduce (AVG) per bucket over
                           ``axis``, on the shard each rank holds (never a full tensor)
    land (after t + tau)   ``updates, s = outer.update(delta, s, anchor)``;
                           ``anchor = apply_updates(anchor, updates)``;
                           ``params = mix * anchor + (1 - mix) * params`` (of step t + tau)
    =====================  ==================================================================

    At one step, syncs landing there are merged before the syncs issued there read the
    params. The inner optimizer's state stays per replica, untouched by syncs. A sync with
    ``delay > 0`` is held in flight (``DiLoCoState.flight``) and overlaps the next ``delay``
    inner steps; compressed, its first leg flies (the quantized all-to-all), and the update
    where it lands sums in fp32 and runs the all-gather. A checkpoint (``fh.state_dict``),
    ``copy.deepcopy`` or ``torch.save`` waits for what is in flight and keeps its result.

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
        check_int("fragments", fragments, 1)
    options = dict(axis=axis, every=every, fragments=fragments, delay=delay, mix=float(mix))
    run = _Outer(replicas(spec, axis), mesh, outer=outer, compress=compress, **options)
    return DiLoCo(
        inner=run.inner,
        init=run.init,
        update=run.advance,
        compress=compress,
        sync_due=run.sync_due,
        **options,
    )


def _check_options(mesh: Mesh, *, axis: Any, every: Any, outer: Any, delay: Any, mix: Any):
    if not isinstance(axis, str) or axis not in mesh.axis_names:
        raise ValueError(
            f"diloco: axis {axis!r} is not in the mesh; its axes are {mesh.axis_names}"
        )
    check_int("every", every, 1)
    check_int("delay", delay, 0)
    if delay >= every:
        raise ValueError(
            f"diloco: delay must be < every (a fragment's sync lands before its next one is "
            f"issued); got delay={delay}, every={every}"
        )
    if isinstance(mix, bool) or not isinstance(mix, (int, float)) or not 0 < mix <= 1:
        raise ValueError(f"diloco: mix must be in (0, 1]; got {mix!r}")
    if not (callable(getattr(outer, "init", None)) and callable(getattr(outer, "update", None))):
        raise TypeError(f"diloco: outer must be a GradientTransformation; got {outer!r}")


class _Step:
    """One call of ``update``: the trees' leaves, changed in place of the lists."""

    def __init__(self, params: list, state: DiLoCoState, treedef: Any):
        self.like, self.treedef = params, treedef
        self.new, self.anchor = list(params), list(optree.tree_leaves(state.anchor))
        self.pending = None if state.pending is None else pending_leaves(state.pending)
        self.residual = None if state.residual is None else list(optree.tree_leaves(state.residual))
        self.outer, self.due = dict(state.outer.inner), list(state.due)
        self.flight = list(state.flight) or [None] * len(self.due)
        self.touched = False

    def end(self, params: Any, t: int) -> tuple[Any, DiLoCoState]:
        """The call's returns: the params and the new state after step ``t``."""
        tree = lambda xs: optree.tree_unflatten(self.treedef, xs)  # noqa: E731
        if self.touched:  # the new trees are at the params' placement: tagged so
            for xs in (self.new, self.anchor):  # pending: MaskedNode leaves, tagged when saved
                if xs is not None:
                    tag_like(xs, self.like)
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
        self.outer, self.delay, self.mix = outer, delay, mix
        self.compress = compress
        self.cuts = TreeCuts(inner, axis=axis, fragments=fragments)
        self.ft = replica_quorum(mesh, axis)  # a fault-tolerant replica axis, or None
        if self.ft is not None:
            if compress is not None and not hasattr(self.ft, "manager"):
                raise ValueError(
                    f"diloco: compress= on the simulated quorum's axis {axis!r}: a simulated "
                    "axis carries all-reduces only (compress runs on a torchft axis)"
                )
            if isinstance(fragments, int):
                check_gaps(every=every, fragments=fragments, delay=delay, axis=axis)

    def sync_due(self, state: DiLoCoState) -> bool:
        """Whether the next ``update`` issues a sync (after step ``state.count + 1``)."""
        if not isinstance(state, DiLoCoState):
            raise TypeError(f"sync_due: state must be a DiLoCoState (dl.init's); got {state!r}")
        return bool(syncs_after(state.count + 1, every=self.every, fragments=len(state.due)))

    def init(self, params: Any) -> DiLoCoState:
        leaves, treedef, of, n = self.cuts.cut(params)
        anchor = [x.detach().clone() for x in leaves]
        tag_like(anchor, leaves)
        outer_states = {
            str(p): self.outer.init(_masked(treedef, anchor, of=of, p=p, like=leaves))
            for p in range(n)
        }
        pending = residual = None
        if self.delay:
            pending = optree.tree_unflatten(treedef, [masked_node(x) for x in leaves])
        if self.compress is not None and treedef in self.cuts:  # not for a meta like
            for p in range(n):  # every layout the wire cannot take is refused here
                self.cuts.packing(treedef, leaves, of=of, p=p)
        if self.compress is not None and self.compress.error_feedback:
            residual = _zeros(treedef, leaves, dtype=torch.float32)
            self.cuts.tag_residual(treedef, residual)
        return DiLoCoState(
            anchor=optree.tree_unflatten(treedef, anchor),
            outer=PartitionState(outer_states),
            count=0,
            due=(0,) * n,
            pending=pending,
            residual=residual,
        )

    def advance(
        self, params: Any, state: DiLoCoState, *, weight: Any = None
    ) -> tuple[Any, DiLoCoState]:
        leaves, treedef, of, n = self.cuts.cut(params)
        feedback = self.compress is not None and self.compress.error_feedback
        check_state(state, treedef, leaves=leaves, n=n, delay=self.delay, feedback=feedback)
        if self.ft is not None:
            check_gaps(every=self.every, fragments=n, delay=self.delay, axis=self.axis)
        t, step = state.count + 1, _Step(leaves, state, treedef)
        step.weight = check_weight(weight, self.mesh)
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
        for p in syncs_after(t, every=self.every, fragments=n):
            self._issue(step, of=of, p=p, t=t)
        params, state = step.end(params, t)
        if step.touched and state.residual is not None:
            self.cuts.tag_residual(treedef, state.residual)
        return params, state

    def _issue(self, step: _Step, *, of: list[int], p: int, t: int) -> None:
        if self.ft is not None and not self.ft.open:
            late = bool(self.ft.log) and self.ft.log[-1].committed is not None
            raise ValueError(
                f"dl.update: fragment {p}'s sync is due after step {t} on the fault-tolerant "
                f"axis {self.axis!r}, but no quorum is open: start one when dl.sync_due(state) "
                "says so, trees = ft.quorum(trees), before this update"
                + (
                    " (the last quorum was committed already: a DiLoCo update commits its own "
                    "syncs, so do not call ft.commit() on a DiLoCo loop's quorums)"
                    if late
                    else ""
                )
            )
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
        weight = self._weight(step)  # None: the plain mean
        if weight is not None:
            local = [x * _along(weight, x, self.mesh) for x in local]
        keys = tuple(self.cuts[step.treedef].paths[i] for i in idx)  # named in errors
        named = dict(zip(keys, local))
        total = None
        if step.weight is not None:  # the weights' mean: the pseudo-gradients' divisor
            total = start_pmean(
                {"weight": _row(weight, self.mesh)}, self.axis, self.mesh, name="weight"
            )
        if self.compress is None:
            reduction = start_pmean(
                named, self.axis, self.mesh, bucket_cap_mb=_CAP_MB, name="pseudo_gradient"
            )
            return SyncInFlight(p, idx, keys=keys, reduction=reduction, total=total)
        agree_pmean(  # before the compressed legs: ranks that differ raise, all alike
            named,
            self.axis,
            self.mesh,
            bucket_cap_mb=_CAP_MB,
            name="pseudo_gradient",
            options=(f"compress={self.compress!r}",),
        )
        reduction = start_packed(
            local,
            self.cuts.packing(step.treedef, step.like, of=of, p=p),
            mesh=self.mesh,
            axis=self.axis,
            compress=self.compress,
            cap=max(1, int(_CAP_MB * 2**20) // 4),  # in fp32 elements
            residual=None if step.residual is None else [step.residual[i] for i in idx],
        )
        return SyncInFlight(p, idx, keys=keys, reduction=reduction, total=total)

    def _weight(self, step: _Step) -> Any:
        """This replica's weight in the merge (None: equal weights, no healed group): the
        caller's ``weight=``, times 0 for a group that healed at this quorum (its progress is
        a peer's copy)."""
        healed = self.ft.contributes() if self.ft is not None else None
        if step.weight is None:
            if healed is None or (isinstance(healed, float) and healed == 1.0):
                return None
            return healed  # a healed group sends zeros; the mean stays over the participants
        if healed is None:
            return step.weight
        return step.weight * healed

    def _land(self, step: _Step, *, of: list[int], sync: SyncInFlight) -> None:
        """A sync lands: the outer step and merge with its result, and its new residual. On a
        fault-tolerant axis only if it commits: a failed sync changes nothing (the anchor, the
        outer state, the residual and the params stay; the fragment's next sync carries its
        progress)."""
        delta = sync.result()
        if self.ft is not None:
            if not self.ft.open:
                raise RuntimeError(
                    f"dl.update: fragment {sync.fragment}'s sync lands, but its quorum was "
                    "committed already (DiLoCo commits its own syncs: do not call ft.commit() "
                    "on a DiLoCo loop's quorums)"
                )
            if not self.ft.commit():
                return
        if sync.empty:  # every weight was 0: nothing to merge
            return
        self._merge(step, of=of, p=sync.fragment, delta=delta)
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


def _zeros(treedef: Any, leaves: list, *, dtype: torch.dtype | None) -> Any:
    """A tree of zeros like the params' ``leaves`` (in ``dtype``, default theirs), tagged
    with their placement."""
    zeros = [torch.zeros_like(x, dtype=dtype) for x in leaves]
    tag_like(zeros, leaves)
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


def check_weight(weight: Any, mesh: Mesh) -> Any:
    """``update``'s ``weight=``: None, or a finite number >= 0 (a tensor of the mesh's batch
    shape on a SimMesh: one per rank), as a float or a float64 tensor."""
    if weight is None:
        return None
    if isinstance(weight, torch.Tensor):
        batch = tuple(mesh.batch_shape)
        if weight.dim() and tuple(weight.shape) != batch:
            raise ValueError(
                f"dl.update: weight must be a number (or a tensor of the mesh's batch shape "
                f"{batch}); got a tensor of shape {tuple(weight.shape)}"
            )
        w = weight.detach().to("cpu", torch.float64)
        if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
            raise ValueError(f"dl.update: weight must be finite and >= 0; got {weight!r}")
        return w
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise TypeError(
            f"dl.update: weight must be a number (tokens since the last sync); got {weight!r}"
        )
    if not math.isfinite(weight) or weight < 0:
        raise ValueError(f"dl.update: weight must be finite and >= 0; got {weight!r}")
    return float(weight)


def _along(weight: Any, x: torch.Tensor, mesh: Mesh) -> Any:
    """``weight`` shaped to multiply ``x`` (a local value: the mesh's batch dims in front)."""
    if not isinstance(weight, torch.Tensor) or not weight.dim():
        return float(weight)
    batch = tuple(mesh.batch_shape)
    w = weight.expand(batch) if tuple(weight.shape) != batch else weight
    return w.reshape(*batch, *([1] * (x.dim() - len(batch)))).to(x.device, x.dtype)


def _row(weight: Any, mesh: Mesh) -> torch.Tensor:
    """``weight`` as the one-element local value the weights' all-reduce carries (fp64)."""
    batch = tuple(mesh.batch_shape)
    w = torch.as_tensor(weight, dtype=torch.float64)
    return w.expand(batch).reshape(*batch, 1).clone() if batch else w.reshape(1).clone()


def check_gaps(*, every: int, fragments: int, delay: int, axis: str) -> None:
    """On a fault-tolerant axis, a sync is committed before the next one's quorum: every sync
    must land before (or at the step where) no other is issued while it flies."""
    gap = _least_gap(every, fragments)
    if gap is not None and delay >= gap:
        raise ValueError(
            f"diloco: delay={delay} on the fault-tolerant axis {axis!r}: a sync must land before "
            f"the next is issued (each sync's quorum commits when it lands), and two syncs are "
            f"{gap} steps apart here (every={every}, fragments={fragments}); use "
            f"delay < {gap}"
        )


@lru(maxsize=64)
def _least_gap(every: int, fragments: int) -> int | None:
    """The fewest steps between two syncs' issues (None: one sync per period, F=1, H=1...),
    from the schedule's formula over three periods; once per (every, fragments), since every
    update on a fault-tolerant axis asks."""
    issued = [
        t for t in range(1, 3 * every + 1) if syncs_after(t, every=every, fragments=fragments)
    ]
    gaps = [b - a for a, b in zip(issued, issued[1:])]
    return min(gaps) if gaps else None

"""The engine under every public function: pack -> run -> wait -> unpack.

Each operation (reduce, shard, gather, sync_params) is a composition of role changes (see
:mod:`functional_hsdp.plan.recipe`; each operation's, in :func:`start`) run bucket by bucket
by the one scheduler (:mod:`functional_hsdp.runtime.scheduler`). Invariant: inputs are never
mutated: buffers are packed anew, and only buffers the call made are reduced or added into
in place. Results are new trees of plain tensors, tagged with their state. A reduction that
outlives its call (``reduce(wait=False)``) is a :class:`ReduceInFlight`, waited for once
(:mod:`functional_hsdp.runtime.flight`).
"""

from __future__ import annotations

import functools
from typing import Any

import optree
import torch

from ..base.tags import result_state, tag, untouched
from ..base.tree import (
    check_bool,
    check_tensors,
    flatten,
    refuse_tracked,
    refuse_vmap,
    structure_error,
)
from ..plan.lookup import (
    check_local,
    find_plan,
    find_plan_at,
    grads_plan,
    plan_for,
    traced_grads_plan,
)
from ..plan.recipe import Plan, remember_layout
from ..spec.specs import Spec, resolve_specs
from . import compressed
from .agreement import agreement, agreement_in_mode
from .fingerprints import nonfinite_index
from .flight import InFlight
from .scheduler import expand, run

__all__ = [
    "AT",
    "DEFERRED",
    "ReduceInFlight",
    "Residual",
    "agree",
    "finish",
    "move",
    "reduce",
    "release",
    "remember_units",
    "shard",
    "start",
    "wait",
]

#: where gradients may arrive: raw (Partial on every DP axis), or at the gradient placement
AT = ("input", "gradient")


# -- plan level: the pipeline ------------------------------------------------------------------


def start(
    plan: Plan,
    source: Any,
    legs: list,
    *,
    depth: int | None = None,
    wire: torch.dtype | None = None,
    sink: Any = None,
    gate: Any = None,
    buckets: Any = None,
    residual: Residual | None = None,
) -> list[Any]:
    """Issue every bucket's role changes ``legs``; returns per bucket its result, the last
    collective possibly in flight (:func:`finish` waits and unpacks).

    Each operation's role changes, per bucket:

    =====================  ============================================================
    operation              role changes per bucket
    =====================  ============================================================
    reduce (at="input")    input -> gradient, + acc, [gradient -> optimizer if last]
    reduce (at="gradient") + acc, [gradient -> optimizer if last]
    shard                  full -> optimizer (or parameter): local slices only
    gather                 optimizer (or parameter) -> full
    sync_params            optimizer -> parameter
    =====================  ============================================================

    A bucket whose spec has ``outer_compress`` runs its deferred reduction (the leg
    ``gradient -> optimizer``) on that axis compressed (:mod:`functional_hsdp.runtime.compressed`).

    Args:
        plan: the plan.
        source: bucket index -> its input buffer (packed just before its first collective).
        legs: ``(from role, to role)`` pairs and local functions ``(bucket, buf) -> buf``,
            in order.
        depth: the most buckets in flight (default: all).
        wire: the dtype the buffers are reduced in (default: each bucket's own), which
            decides the fp16 pre- and post-divides.
        sink: as in :func:`~functional_hsdp.runtime.scheduler.run`: each bucket's waited result, as
            soon as it is done (then nothing is returned).
        gate: as in :func:`~functional_hsdp.runtime.scheduler.run`: the call's agreement, settled
            just before the first collective.
        buckets: the buckets to run (default: every one); the results are theirs, in order.
        residual: the error-feedback residuals of compressed buckets (:class:`Residual`),
            read and written by plan bucket index; None: start from zeros, keep nothing.
    """
    if buckets is not None:  # the scheduler counts from 0: name the plan's buckets for it
        chosen = list(buckets)
        legs = [leg if isinstance(leg, tuple) else _renumbered(leg, chosen) for leg in legs]
        source = _renumbered(source, chosen)
        sink = None if sink is None else _renumbered(sink, chosen)
    else:
        chosen = list(range(len(plan.buckets)))
    programs = []
    for b in chosen:
        items: list = []
        for leg in legs:
            if not isinstance(leg, tuple):
                items.append(leg)
            elif leg == DEFERRED and plan.buckets[b].spec.outer_compress is not None:
                items.extend(_compressed(plan, b, residual))
            else:
                items.extend(plan.program(b, *leg))
        programs.append(expand(items, wire or plan.buckets[b].dtype))
    return run(plan.mesh, programs, source, depth=depth, sink=sink, gate=gate)


#: the role change of the deferred reduction: the one ``outer_compress`` compresses
DEFERRED = ("gradient", "optimizer")


class Residual:
    """Error-feedback residuals by plan bucket index, ``bufs[b]``: fp32 at the gradient
    placement (None: zeros). Its owner (a MainGrad, or ``reduce_grads`` for the tree it takes
    and returns) keeps the list; a compressed reduction reads ``get(b)`` and replaces it with
    ``put(b, r)``."""

    def __init__(self, bufs: list):
        self.bufs = bufs

    def get(self, b: int) -> torch.Tensor | None:
        return self.bufs[b]

    def put(self, b: int, r: torch.Tensor) -> None:
        self.bufs[b] = r


def _compressed(plan: Plan, b: int, residual: Residual | None) -> list[Any]:
    """Bucket ``b``'s deferred reduction with its spec's compressed axis compressed."""
    spec, out = plan.buckets[b].spec, []
    steps = plan.program(b, *DEFERRED)
    for step in steps:  # the spec's checks make the compressed axis the only deferred one
        if step.axis != spec.compressed_axis or step.op not in ("all_reduce", "reduce_scatter"):
            out.append(step)
            continue
        out += compressed.program(
            spec.outer_compress,
            step.axis,
            plan.mesh,
            op=step.reduce,
            scatter=step.op == "reduce_scatter",
            length=plan.placed[b]["gradient"].length,
            residual_in=lambda _: None if residual is None else residual.get(b),
            residual_out=lambda _, r: None if residual is None else residual.put(b, r),
        )
    return out


def _renumbered(fn: Any, chosen: list[int]) -> Any:
    """``fn(bucket, *rest)`` called with the scheduler's position ``k`` for ``chosen[k]``."""
    return lambda k, *rest: fn(chosen[k], *rest)


def release(plan: Plan, pending: list[Any]) -> None:
    """Release bucket results that will never be read (``Mesh.abandon`` each): a collective
    issued ahead and not used, say."""
    for x in pending:
        plan.mesh.abandon(x)


def wait(plan: Plan, pending: list[Any]) -> list[torch.Tensor]:
    """Wait for ``pending`` bucket results: the buckets' buffers, each the call's own."""
    return [_owned(plan.mesh.wait(x)) for x in pending]


def finish(
    plan: Plan, pending: list[Any], role: str, *, dtype: torch.dtype | None = None
) -> tuple[list[torch.Tensor], list]:
    """Wait for ``pending`` bucket results and unpack them at ``role``: (leaves in tree
    order, the bucket buffers they were unpacked from). ``dtype``: the buffers' dtype, if
    they were packed in another than the plan's."""
    bufs = wait(plan, pending)
    return plan.unpack(bufs, role, dtype), bufs


def _borrowed(x: torch.Tensor) -> bool:
    """Whether ``x`` is a view of part of a larger buffer (a borrowed reduce-scatter result,
    see ``Mesh.reduce_scatter``): keeping it would keep the whole buffer alive."""
    base = x._base
    return base is not None and x.numel() < base.numel()


def _owned(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a copy of it if it is borrowed."""
    return x.clone() if _borrowed(x) else x


def _add(buf: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """``buf + acc``: in place when ``buf`` is a dense buffer of the call's own, into a new
    tensor when it is borrowed (which spares a copy of it). A bucket buffer at this point is
    always one the call made, never a caller's tensor."""
    if buf.is_contiguous() and not _borrowed(buf):
        return buf.add_(acc)
    return torch.add(buf, acc)


# -- tree level -------------------------------------------------------------------------------


def reduce(
    grads: Any,
    spec: Any,
    *,
    last: Any,
    acc: Any,
    at: str = "input",
    check_finite: bool = False,
    name: str = "grads",
    call: str = "reduce_grads",
    mode: str,
    units: bool = False,
    residual: Any = None,
    wait: bool = True,
    tagged: bool = True,
) -> Any:
    """One microbatch: reduce ``grads`` (at role ``at``), add ``acc``, finish on ``last``.
    ``mode``: the validation mode, read by the public call (``validate.current_mode()``), or
    handed to a backward by its forward (psum, pmean). ``units``: see ``Agreement.check``.
    On the last microbatch of a spec with ``outer_compress``: ``(result, new residual)``,
    ``residual`` the previous one (see :func:`~functional_hsdp.reduce_grads`).
    ``wait=False`` (``last=True``, no ``acc``, no compression): the call agrees as any
    (settled before its first collective: ranks that differ would issue mismatched
    collectives, which gloo aborts on and NCCL hangs on), issues the collectives and returns
    a :class:`ReduceInFlight` without waiting for them; its ``result()`` waits. ``tagged=False``:
    the result's leaves carry no placement (the caller gives them its own meaning)."""
    _check_wait(wait, call, plain=last is True and acc is None and residual is None)
    leaves, treedef, paths = flatten(grads, name)
    refuse_vmap(leaves, call)
    with agreement_in_mode(spec, call, mode) as agreed:  # a local error: all raise
        refuse_tracked(leaves, paths, call)
        check_bool("last", last, " (True on the final microbatch)")
        check_bool("check_finite", check_finite)
        if at not in AT:
            raise ValueError(f"{call}: at must be 'input' or 'gradient'; got {at!r}")
        if not leaves:
            return _no_leaves(spec, treedef, acc=acc, name=name, wait=wait)
        plan = _input_plan(grads, leaves, treedef, paths=paths, spec=spec, at=at, name=name)
        compressing, store = _residual_in(plan, residual, treedef, last=last, name=name)
        legs: list = [("input", "gradient")] if at == "input" else []
        if acc is not None:  # checked before any collective
            acc_bufs = _acc_buffers(plan, acc, treedef, name=name)
            legs.append(lambda b, buf: _add(buf, acc_bufs[b]))
        if last:
            legs.append(("gradient", "optimizer"))
        source, nonfinite = _source(plan, leaves, at, check_finite=check_finite)
        options = (f"check_finite={check_finite}", f"at={at}")
        check = dict(last=last, options=options, nonfinite=nonfinite, defer=True, units=units)
        agreed.check(plan, paths, **check)
    pending = start(plan, source, legs, gate=agreed.settle, residual=store)
    flight = ReduceInFlight(plan, pending, treedef, last=last, tagged=tagged)
    if not wait:
        return flight
    result = flight.result()
    return _residual_out(plan, result, store=store, treedef=treedef) if compressing else result


def agree(
    tree: Any, spec: Any, *, name: str, call: str, mode: str, options: tuple[str, ...] = ()
) -> None:
    """The agreement of a last reduction of ``tree`` by ``spec``, settled, with no collective
    of its own: for a caller that moves the tree by collectives of its own (DiLoCo's
    compressed sync). Ranks that would reduce different trees (structure, paths, shapes,
    dtypes, or ``options``) all raise a ``ValueError`` naming the leaf before any of those
    collectives is issued (mismatched ones abort gloo and hang NCCL). ``mode``: as in
    :func:`reduce`; under ``validation("off")`` nothing is exchanged."""
    leaves, treedef, paths = flatten(tree, name)
    with agreement_in_mode(spec, call, mode) as agreed:  # a local error: all raise
        refuse_tracked(leaves, paths, call)
        if not leaves or mode == "off":  # nothing to agree on, or nothing exchanged
            return
        plan = _input_plan(tree, leaves, treedef, paths=paths, spec=spec, at="input", name=name)
        agreed.check(plan, paths, last=True, options=options)


def _check_wait(wait: bool, call: str, *, plain: bool) -> None:
    if not wait and not plain:
        raise TypeError(f"{call}: wait=False: a last reduction only, without acc or residual")


def _no_leaves(spec: Any, treedef: Any, *, acc: Any, name: str, wait: bool) -> Any:
    """A reduction of a tree without leaves: checked, and returned empty (in an
    :class:`ReduceInFlight` already done, for ``wait=False``)."""
    resolve_specs(spec, treedef, name)
    if acc is not None and optree.tree_structure(acc) != treedef:
        raise structure_error(treedef, acc, "acc", what=name)
    empty = optree.tree_unflatten(treedef, [])
    return empty if wait else ReduceInFlight.of(empty)


class ReduceInFlight(InFlight[Any]):
    """A reduction issued and not yet waited for (what :func:`reduce` with ``wait=False``
    returns): its agreement settled, its collectives in flight (on a SimMesh, done).
    :meth:`~functional_hsdp.runtime.flight.InFlight.result` waits for them and unpacks, once (see
    :class:`~functional_hsdp.runtime.flight.InFlight`: an error is kept, an interrupt lets it wait
    again). ``last``: the leaves are final, at the optimizer placement (else accumulating, at
    the gradient placement); ``tagged=False``: the leaves carry no placement.

    Its owner keeps it where the result will be needed (DiLoCo's state holds the syncs in
    flight); dropping it unwaited leaks nothing (a functional collective's result is
    released by its finalizer, a c10d one by its backend when it completes)."""

    __slots__ = ("plan", "_pending", "_treedef", "_last", "_tagged")

    def __init__(
        self,
        plan: Plan | None,
        pending: list | None,
        treedef: Any,
        *,
        last: bool,
        tagged: bool,
        waited: bool = False,
        result: Any = None,
    ):
        super().__init__(waited=waited, result=result)
        self.plan, self._pending, self._treedef, self._last = plan, pending, treedef, last
        self._tagged = tagged

    @classmethod
    def of(cls, tree: Any) -> ReduceInFlight:
        """One already done, whose result is ``tree`` (a reduction of a tree without
        leaves)."""
        treedef = optree.tree_structure(tree)
        return cls(None, None, treedef, last=True, tagged=False, waited=True, result=tree)

    def _wait(self) -> Any:
        """The reduced tree (its leaves tagged with their placement unless ``tagged=False``)."""
        role = "optimizer" if self._last else "gradient"
        out, bufs = finish(self.plan, self._pending, role)
        self._pending = None
        if self._tagged:
            kind, kept = ("final", None) if self._last else ("accumulating", bufs)
            tag(out, self.plan, role, kind=kind, bufs=kept)
        return optree.tree_unflatten(self._treedef, out)

    def _release(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            release(self.plan, pending)

    def __repr__(self) -> str:
        n = len(self.plan.buckets) if self.plan is not None else 0
        how = "waited" if self.done else "in flight"
        return f"ReduceInFlight({n} bucket{'s' if n != 1 else ''}, {how})"


def _residual_out(plan: Plan, result: Any, *, store: Residual | None, treedef: Any) -> tuple:
    """A compressed last microbatch's ``(result, new residual tree or None)``."""
    if store is None:  # no error feedback: nothing to keep
        return result, None
    leaves = plan.unpack(store.bufs, "gradient", torch.float32)
    return result, optree.tree_unflatten(treedef, leaves)


def _residual_in(
    plan: Plan, residual: Any, treedef: Any, *, last: Any, name: str
) -> tuple[bool, Residual | None]:
    """(whether the call compresses a reduction: the last microbatch of a spec with
    ``outer_compress``; the residual's buffers per bucket, fp32 at the gradient placement,
    zeros for None, or None where no bucket feeds its error back). Checked before any
    collective."""
    if not (last is True and any(s.outer_compress is not None for s in plan.specs)):
        if residual is not None:
            raise ValueError(
                "reduce_grads: residual= is the error feedback of a compressed outer reduction: "
                "pass it with last=True and a spec with outer_compress (fh.hsdp(..., "
                "outer_compress=fh.compress(...)))"
            )
        return False, None
    if not any(s.outer_compress.error_feedback for s in plan.specs if s.outer_compress):
        return True, None
    batch = plan.mesh.batch_shape
    if residual is None:
        zeros = [
            torch.zeros((*batch, p["gradient"].length), device=bucket.device)
            for bucket, p in zip(plan.buckets, plan.placed)
        ]
        return True, Residual(zeros)
    leaves, res_def, paths = flatten(residual, "residual")
    if res_def != treedef:
        raise structure_error(treedef, residual, "residual", what=name)
    check_tensors(leaves, paths, plan.mesh, floating=True, batched=True)
    for leaf, path, want in zip(leaves, paths, plan.local_shapes["gradient"]):
        if tuple(leaf.shape) != want:
            raise ValueError(
                f"{path}: expected the residual's local shape {want} at the gradient "
                f"placement (as reduce_grads returned it); got {tuple(leaf.shape)}"
            )
    n = len(plan.buckets)
    return True, Residual([plan.pack(b, leaves, "gradient", dtype=torch.float32) for b in range(n)])


def _source(plan: Plan, leaves: list, role: str, *, check_finite: bool) -> tuple[Any, Any]:
    """(bucket index -> packed buffer, per-rank first non-finite leaf or None). Buckets are
    packed one by one just before their first collective, unless every one is needed first
    to look for NaN/Inf."""
    if not check_finite:
        return functools.partial(plan.pack, leaves=leaves, role=role), None
    packed = [plan.pack(b, leaves, role) for b in range(len(plan.buckets))]
    nonfinite = nonfinite_index(leaves, len(plan.mesh.batch_shape), packed)
    return packed.__getitem__, nonfinite


def _input_plan(grads, leaves, treedef, *, paths, spec, at: str, name: str) -> Plan:
    if at == "gradient":  # local shards at the gradient placement (layer-wise backward)
        return find_plan_at(
            leaves, treedef, paths, spec=spec, role="gradient", kinds=("accumulating",), name=name
        )
    if torch.compiler.is_compiling():
        return traced_grads_plan(grads, leaves, spec, name=name)
    return grads_plan(leaves, treedef, paths, spec=spec, name=name)


def _acc_buffers(plan: Plan, acc: Any, treedef: Any, *, name: str) -> list[torch.Tensor]:
    """``acc``'s bucket buffers at the gradient role: read from the previous result's own
    buffers when ``acc`` is exactly that result, untouched; else checked and packed."""
    acc_leaves, acc_def, acc_paths = flatten(acc, "acc")
    if acc_def != treedef:
        raise structure_error(treedef, acc, "acc", what=name)
    state = result_state(acc_leaves)
    if not (
        state is not None
        and state.plan is plan
        and state.role == "gradient"
        and state.kind == "accumulating"
        and untouched(state, acc_leaves)
    ):
        state = None  # not the previous call's result as it was returned: check it all
        check_tensors(acc_leaves, acc_paths, plan.mesh, floating=True, batched=True)
        check_local(
            acc_leaves,
            acc_paths,
            plan,
            role="gradient",
            kinds=("accumulating",),
            what="a running accumulation",
        )
    known = state.bufs if state is not None and state.bufs else (None,) * len(plan.buckets)
    out = []
    for b, ref in enumerate(known):
        buf = ref() if ref is not None else None
        out.append(buf if buf is not None else plan.pack(b, acc_leaves, "gradient"))
    return out


@torch.compiler.disable  # under torch.compile: run eagerly, a clean graph break
def shard(tree: Any, spec: Any, *, to: str, stacked: bool | None) -> Any:
    """Full values -> local shards at role ``to`` (local slices, no communication)."""
    if to not in ("optimizer", "parameter"):
        raise ValueError(f"shard: to must be 'optimizer' or 'parameter'; got {to!r}")
    leaves, treedef, paths = flatten(tree, "tree")
    refuse_vmap(leaves, "shard")
    specs, units = resolve_specs(spec, treedef, "tree")
    if not leaves:
        return optree.tree_unflatten(treedef, [])
    mesh = specs[0].mesh
    batch, nb = mesh.batch_shape, len(mesh.batch_shape)
    if stacked is None:
        stacked = all(_replicated(x, batch) for x in leaves)
    check_tensors(leaves, paths, mesh, floating=False, batched=stacked)
    if not stacked:
        leaves = [x.expand(*batch, *x.shape) for x in leaves]
    shapes = (x.shape[nb:] for x in leaves)
    plan = plan_for(leaves, treedef, paths, specs=specs, units=units, shapes=shapes)
    if not isinstance(spec, Spec):
        remember_units(tree, spec, plan)
    source = functools.partial(plan.pack, leaves=leaves, role="full")
    out, _ = finish(plan, start(plan, source, [("full", to)]), to)
    tag(out, plan, to, kind="weights")
    return optree.tree_unflatten(treedef, out)


def plan_specs(spec: Any) -> list[Spec]:
    """The Specs of a spec prefix tree, in unit order."""
    return optree.tree_leaves(spec, is_leaf=lambda x: isinstance(x, Spec))


def remember_units(tree: Any, spec: Any, plan: Plan) -> None:
    """Record each unit's own layout, so that a unit's local shards are recognized alone
    (by :func:`~functional_hsdp.gathered`) as well as within the whole tree."""
    spec_def = optree.tree_structure(spec, is_leaf=lambda x: isinstance(x, Spec))
    first = 0
    for unit_spec, subtree in zip(plan_specs(spec), spec_def.flatten_up_to(tree)):
        sub_def = optree.tree_structure(subtree)
        n = sub_def.num_leaves
        shapes = plan.shapes[first : first + n]
        remember_layout(sub_def, (unit_spec,) * n, (0,) * n, shapes=shapes)
        first += n


def _replicated(x: torch.Tensor, batch: tuple[int, ...]) -> bool:
    """Whether ``x`` reads as a stacked replicated value: mesh dims in front, equal slices."""
    if not batch:  # a real rank holds only its own value
        return True
    if not isinstance(x, torch.Tensor) or x.layout != torch.strided or x.is_meta:
        return False  # check_tensors refuses it with a clear error
    if tuple(x.shape[: len(batch)]) != batch:
        return False
    flat = x.reshape(-1, *x.shape[len(batch) :])
    return bool((flat == flat[:1]).all()) if flat.numel() else True


@torch.compiler.disable  # under torch.compile: run eagerly, a clean graph break
def move(
    tree: Any,
    spec: Any,
    to: str,
    *,
    source: str | None,
    like: Any,
    name: str,
    call: str,
    dtype: torch.dtype | None = None,
) -> Any:
    """Local shards (at ``source``, or found) -> role ``to`` (all-gathers); ``call`` names the
    public function in the cross-rank check; ``dtype``: cast to it before the all-gathers."""
    if source not in (None, "optimizer", "parameter"):
        raise ValueError(f"source must be 'optimizer' or 'parameter'; got {source!r}")
    leaves, treedef, paths = flatten(tree, name)
    refuse_vmap(leaves, call)
    if not leaves:
        resolve_specs(spec, treedef, name)
        return optree.tree_unflatten(treedef, [])
    roles = (source,) if source else ("optimizer", "parameter")
    with agreement(spec, call) as agreed:
        refuse_tracked(leaves, paths, call)
        kinds = ("final", "weights")
        plan, role = find_plan(
            leaves, treedef, paths, spec=spec, like=like, roles=roles, kinds=kinds, name=name
        )
        agreed.check(plan, paths, options=(f"from {role}", f"dtype={dtype}"), defer=True)
    pack = functools.partial(plan.pack, leaves=leaves, role=role, dtype=dtype)
    pending = start(plan, pack, [(role, to)], gate=agreed.settle)
    out, _ = finish(plan, pending, to, dtype=dtype)
    if to != "full":
        tag(out, plan, to, kind="weights")
    return optree.tree_unflatten(treedef, out)

"""Reliability: the per-call cross-rank agreement, non-finite checks, clear collective errors.

In data-parallel training the worst failures are silent wrong gradients and hangs, where one
rank issues a collective that the others do not. This module turns both into clear errors.

=====================================  ===================================================
failure                                what happens
=====================================  ===================================================
ranks make different calls, or pass    every call's agreement compares the ranks' rows
different trees, shapes, dtypes,       before any gradient collective; every rank raises
specs, ``last`` or options             the same ``ValueError``, naming the first differing
                                       field or leaf path and the ranks
a rank's own checks fail (a wrong      it raises its error, and the others raise one that
``acc``, a meta leaf, a bad flag)      names it, in the same agreement: nobody waits
ranks run their gathered units in      the step's running fingerprint of unit calls and
another order, or with other options   ``begin_microbatch`` declarations (:class:`UnitLog`)
or dtypes, or declare another last     rides in the summary of ``begin_microbatch(last=
microbatch                             True)``, ``MainGrad.finish`` and the last
                                       ``reduce_grads(at="gradient")``: every rank raises,
                                       naming the first call that differs and how;
                                       ``validation("strict")`` agrees before each unit
                                       collective and declaration (no mismatched one)
NaN/Inf in gradients                   ``check_finite=True``: every rank raises a
                                       ``ValueError`` naming the first such leaf and ranks
a peer dies, hangs or issues another   the collective fails or times out and raises
collective                             :class:`CollectiveError` naming it and its mesh axis
=====================================  ===================================================

The protocol, on every call
---------------------------
Every call that communicates (``reduce_grads``, ``gather``, ``sync_params``, the per-axis
collectives, ``MainGrad.accumulate`` / ``finish``, the checkpoint functions) describes
itself: a header (operation, ``last``, options, mesh, data-parallel axes, tree structure) and
one line per leaf (path, shape, dtype, device type, spec, bucket slot), hashed into a row of
int64 ``[error flag, first non-finite leaf, call digest, whole digest, leaf count, one digest
per header field]``. Digests are 62-bit blake2b hashes, stable across processes (Python's
``hash`` is salted per process); a plan's fingerprint is computed once and cached, so a
call's row costs a list copy.

1. The row is summarized over **every** axis of the mesh (not only the spec's data-parallel
   axes: ranks naming different axes would otherwise wait in different groups) by **one**
   elementwise maximum of ``[row, -row]`` (``Diagnostics.start_max``), which gives every
   rank each field's maximum and minimum over all ranks. It is host data, reduced over a CPU
   (gloo) group, so the agreement never touches device memory and never makes the host wait
   for the device. On a ``DistMesh`` it is recursive doubling in point-to-point messages:
   log2(ranks) rounds (two more where the count is not a power of two), each one 24-integer
   row each way, so a rank's messages and wait grow with log2 of the mesh's size (the
   all-gather of every rank's row that it replaces moved a row per rank in as many ring
   steps as ranks; bench B10, "Scaling with the number of ranks"). It is *issued* (its first
   round) when the call's local checks have passed and *waited* (the later rounds, which
   need the first one's result) just before the call's first gradient collective
   (``Agreement.settle``, called by the scheduler), so packing the first bucket overlaps
   the first round. A call that issues no collective (``ddp`` before the last microbatch)
   settles before it returns, and before it changes any persistent state (``MainGrad``'s
   buffers).
2. Every rank decides alike from the summary. No error row, no non-finite leaf, and every
   field the same on every rank (maximum = minimum): the call passes. That is a healthy
   run's only communication for the agreement. Otherwise, and only then, every rank's row is
   exchanged (one all-gather over the whole mesh, ``Diagnostics.exchange``) and every rank
   decides from the same table, exactly as :func:`agree` does: the call digest must agree
   over the whole mesh, the whole digest within each data-parallel group (so data-parallel
   groups that hold different trees pass, after the exchange). On a mismatch more
   exchanges follow, all ranks alike: the first differing header field, or the first leaf
   whose per-leaf digests differ (padded to the longest tree), and its text, from which every
   rank builds the same message and raises it.
3. A rank whose local checks raise (``ValueError``/``TypeError``/``NotImplementedError``)
   before its row is issued sends an error row instead, in the same summary (its error flag
   sends every rank to the exchange); the others raise the failing rank's error type and
   text, naming it.

**Replicas.** A call on a :func:`~functional_hsdp.replicas` spec (every Spec of it with
replica axes) agrees within its replica only: the summary and every exchange above span the
mesh's other axes (:class:`Within`, ``Diagnostics.within``), and no message of the
agreement crosses a replica axis. Replicas train apart between syncs (DiLoCo): one replica's
calls never wait for another's, which may be slower or at another step. A call that crosses
the replica axis (DiLoCo's sync, a collective over it) agrees over the whole mesh as before.

Neither the summary nor the exchange is a gradient collective: :func:`comm_log` does not
record them, and they are plain ``torch.distributed`` point-to-point messages and all-gathers
(not functional collectives), so profiles of the gradient communication stay exact. On a
one-rank mesh nothing is exchanged (unless ``check_finite=True``).

``check_finite=True`` is the one exception to "never touches device data": the non-finite
scan reads every bucket (a host-device synchronization), and its result rides in the row.

Limits
------
* ``validation("off")`` exchanges nothing (the checks above are off), except for a call with
  ``check_finite=True``, whose row still carries its non-finite flags; every rank must use
  the same mode, or the ranks that exchange wait (bounded by the mesh's timeout). A call
  reads the mode when it starts, in the caller's context; the backward of ``psum`` and
  ``pmean`` (a call too) uses the mode their forward read, since autograd may run a backward
  on another thread (its device threads on CUDA), which does not see the caller's context.
* Under ``torch.compile`` nothing is exchanged (a ``reduce_grads(check_finite=True)`` there
  runs eagerly, at a graph break, agreement included).
* A failure after the agreement (out of memory while packing, a peer dying mid-collective)
  raises :class:`CollectiveError` on the survivors within the timeout, not at once.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import optree
import torch

from ..base.cache import Bounded, register
from ..base.errors import CollectiveError, UnitsDiffer

__all__ = [
    "CollectiveError",
    "Fingerprint",
    "Agreement",
    "UnitLog",
    "agree",
    "agreement",
    "agreement_in_mode",
    "current_mode",
    "fingerprint",
    "nonfinite_index",
    "unit_log",
    "validation",
]


# -- mode -----------------------------------------------------------------------------------

_MODES = ("on", "off", "first", "always", "strict")
_MODE: contextvars.ContextVar[str] = contextvars.ContextVar("fh_validation", default="on")


@contextlib.contextmanager
def validation(mode: str) -> Iterator[None]:
    """Turn the cross-rank agreement on or off inside the ``with`` block.

    Args:
        mode: ``"on"`` (the default: every call takes part in one small summary over the
            mesh before any gradient collective), or ``"off"`` (nothing is exchanged, unless
            ``check_finite=True``). ``"first"`` and ``"always"``, the names of earlier
            versions, mean ``"on"``. ``"strict"``: ``"on"``, and the ranks also agree
            before every collective of a :func:`~functional_hsdp.gathered` unit (its
            all-gathers and its reduce-scatter), so that a unit skipped or called otherwise
            on one rank is a ``ValueError`` on every rank instead of a mismatched collective
            (one more small summary per unit collective). Every rank must use the same mode:
            a rank with validation off while the others exchange makes them wait (bounded by
            the mesh's timeout).

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp": 2})
        >>> with fh.validation("off"):
        ...     out = fh.reduce_grads({"w": torch.ones(2, 3)}, fh.ddp(mesh), last=True)
        >>> out["w"][0]
        tensor([1., 1., 1.])
    """
    if mode not in _MODES:
        raise ValueError(f"validation: mode must be one of {_MODES}; got {mode!r}")
    token = _MODE.set(mode)
    try:
        yield
    finally:
        _MODE.reset(token)


def current_mode() -> str:
    """The mode :func:`validation` set in this context (``"on"`` by default), for a call to
    pass to :func:`agreement_in_mode`. A function whose backward makes a call reads it in its
    forward and hands it to the backward: autograd may run a backward on another thread,
    which does not see this context (see the module docstring, "Limits"). While
    ``torch.compile`` traces, ``"on"`` (nothing is exchanged there, and dynamo cannot read a
    ContextVar)."""
    if torch.compiler.is_compiling():
        return "on"
    return _MODE.get()


# -- fingerprints ---------------------------------------------------------------------------

_MASK = (1 << 62) - 1
_ABSENT = -1  # the per-leaf digest of a leaf a rank does not have (digests are >= 0)
HEADER = ("call", "last", "options", "mesh", "dp axes", "tree")
CALL_FIELDS = 5  # the header fields every rank of the mesh must agree on (all but "tree")
LEAF_FIELDS = ("path", "shape", "dtype", "device", "spec", "bucket slot")


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & _MASK


@dataclass(frozen=True)
class Fingerprint:
    """What one rank is about to do: header texts, per-leaf texts and their digests."""

    header: tuple[str, ...]  # one text per HEADER field
    leaves: tuple[tuple[str, ...], ...]  # one tuple of LEAF_FIELDS texts per leaf
    whole: int

    def row(self) -> list[int]:
        """Its part of the per-call row: the digests of the call (every header field but
        the tree), of the whole, the leaf count and each header field (hashed once)."""
        row = self.__dict__.get("_row")
        if row is None:
            call = _digest("\x1e".join(self.header[:CALL_FIELDS]))
            row = [call, self.whole, len(self.leaves), *map(_digest, self.header)]
            object.__setattr__(self, "_row", row)
        return row

    def leaf_digests(self, n: int) -> list[int]:
        """Per-leaf digests of what the user passed (path, shape, dtype, device, spec), then
        of the bucket slots, each padded to ``n`` leaves: a leaf whose own description
        differs is reported before one whose slot differs only because of an earlier leaf."""
        pad = [_ABSENT] * (n - len(self.leaves))
        own = [_digest("\x1f".join(leaf[:-1])) for leaf in self.leaves]
        return own + pad + [_digest(leaf[-1]) for leaf in self.leaves] + pad


def _spec_text(spec: Any) -> str:
    return (
        f"{spec!r} dp_axes={spec.dp_axes} reduce_op={spec.reduce_op} "
        f"bucket_cap_mb={spec.bucket_cap_mb}"
    )


def fingerprint(
    plan: Any, op: str, paths: Sequence[str], *, last: Any = None, options: tuple[str, ...] = ()
) -> Fingerprint:
    """Describe a call of ``op`` with ``plan`` (full per-rank shapes, not local pieces)."""
    mesh = plan.mesh
    slot_text = {}
    for b, bucket in enumerate(plan.buckets):
        for s in bucket.slots:
            slot_text[s.index] = f"bucket {b} [{s.offset}:{s.offset + s.numel}] of {bucket.padded}"
    specs = {spec: _spec_text(spec) for spec in set(plan.specs)}
    leaves = tuple(
        (
            path,
            str(tuple(shape)),
            str(dtype),
            device.type,
            specs[spec],
            slot_text.get(i, "none (zero-size)"),
        )
        for i, (path, shape, dtype, device, spec) in enumerate(
            zip(paths, plan.shapes, plan.dtypes, plan.devices, plan.specs)
        )
    )
    header = (
        op,
        f"last={last!r}",
        ", ".join(options) or "none",
        " x ".join(f"{a}={n}" for a, n in zip(mesh.axis_names, mesh.sizes)),
        ", ".join(_dp_axes(plan)),
        str(plan.treedef),
    )
    whole = _digest("\x1e".join(header) + "\x1d" + "\x1e".join("\x1f".join(x) for x in leaves))
    return Fingerprint(header, leaves, whole)


def nonfinite_index(
    leaves: Sequence[torch.Tensor],
    batch_ndim: int,
    packed: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Per rank, the index of the first leaf holding NaN or Inf, else -1 (batch shape).

    ``packed``: the leaves' bucket buffers, if at hand: all finite (the usual case) is then
    one check per bucket; leaves are scanned one by one only to find a bad one.
    """
    if packed is not None:
        flags = [torch.isfinite(b).all(-1) for b in packed]
        if not flags or bool(torch.stack(flags).all()):
            return torch.full(packed[0].shape[:-1] if packed else (), -1, dtype=torch.int64)
    flags = [torch.isfinite(x.detach()).reshape(*x.shape[:batch_ndim], -1).all(-1) for x in leaves]
    bad = ~torch.stack(flags).cpu()  # (n_leaves, *batch)
    return torch.where(bad.any(0), bad.to(torch.int8).argmax(0), -1).to(torch.int64)


# -- the agreement ----------------------------------------------------------------------------

# plan -> {(op, last, options): its Fingerprint}; weak: evicted plans take their entries.
_DONE: weakref.WeakKeyDictionary = register(weakref.WeakKeyDictionary())
_LOCAL_ERRORS = (ValueError, TypeError, NotImplementedError)
# the row every rank contributes on every call
_ERROR, _NONFINITE, _CALL, _WHOLE, _COUNT, _HEADER0 = range(6)
# after the header digests: the digest of the unit calls checked by this call (UnitLog), or 0
_UNITS = _HEADER0 + len(HEADER)
_WIDTH = _UNITS + 1


def _dp_axes(plan: Any) -> tuple[str, ...]:
    return plan.dp_axes


def _specs(spec: Any) -> list:
    """The Specs of a Spec or spec tree (none if ``spec`` is neither)."""
    from ..spec.specs import Spec

    if isinstance(spec, Spec):
        return [spec]
    try:
        leaves = optree.tree_leaves(spec, is_leaf=lambda x: isinstance(x, Spec))
    except Exception:  # not even a pytree: the caller's own check names the problem
        return []
    return [x for x in leaves if isinstance(x, Spec)]


class Within(NamedTuple):
    """A mesh as one call's agreement sees it: the axes it spans (every axis of the mesh but
    the replica axes of a :func:`~functional_hsdp.replicas` spec), their sizes, the mesh's
    batch shape and the exchanges over those axes (``Diagnostics.within``)."""

    base: Any
    axis_names: tuple[str, ...]
    sizes: tuple[int, ...]
    batch_shape: tuple[int, ...]
    diagnostics: Any


def within(spec: Any) -> Any:
    """The mesh an agreement on ``spec`` spans (None if it names none): ``spec`` itself if
    it is a mesh; the mesh of its Specs; or, where every Spec of ``spec`` has replica axes,
    a :class:`Within` of the mesh's other axes. Replicas train apart between syncs (they may
    even be at different steps), so their calls agree within a replica, and no message of
    it crosses a replica axis."""
    if hasattr(spec, "diagnostics"):
        return spec
    specs = _specs(spec)
    if not specs:
        return None
    mesh = specs[0].mesh
    apart = set.intersection(*(set(x.replica_axes) for x in specs))
    if not apart:
        return mesh
    axes = tuple(a for a in mesh.axis_names if a not in apart)
    sizes = tuple(mesh.size(a) for a in axes)
    return Within(
        base=mesh,
        axis_names=axes,
        sizes=sizes,
        batch_shape=tuple(mesh.batch_shape),
        diagnostics=mesh.diagnostics.within(axes),
    )


class Agreement:
    """One call's cross-rank agreement (see the module docstring): every rank takes part in
    one small summary per call, before any gradient collective, and all raise together.

    ``mode``: the validation mode for this call (see :func:`validation`), read by the caller
    (:func:`current_mode`): nothing here reads the context, which may not be the caller's
    (a backward on autograd's device thread)."""

    def __init__(self, mesh: Any, call: str, mode: str):
        self.mesh, self.call, self.done = mesh, call, False
        self.off = mode == "off"
        self._pending: tuple | None = None

    def check(
        self,
        plan: Any,
        paths: Sequence[str],
        *,
        last: Any = None,
        options: tuple[str, ...] = (),
        nonfinite: torch.Tensor | None = None,
        defer: bool = False,
        units: bool = False,
    ) -> None:
        """Agree on this call (``plan``: what it will do); raise on any difference.

        ``defer=True`` only issues the summary: the caller must call :meth:`settle` before
        its first collective and before it returns (the scheduler does, given this record
        as its ``gate``). ``units=True``: also agree on the gathered-unit calls this rank
        made on the mesh since the last such check (:class:`UnitLog`, taken and reset now),
        so that units run in another order, skipped or with other options on one rank are
        an error on every rank before the gradient is used."""
        self.done = True
        if torch.compiler.is_compiling():  # nothing is exchanged while tracing
            return
        log = unit_log(self.mesh).take() if units else None
        if self.off and nonfinite is None:
            return
        if all(n == 1 for n in self.mesh.sizes) and nonfinite is None:
            return  # one rank: nobody to disagree with
        key = (self.call, last, options)
        done = _DONE.setdefault(plan, {})
        fp = done.get(key)
        if fp is None:
            fp = done[key] = fingerprint(plan, self.call, paths, last=last, options=options)
        local = _local_row(fp, self.mesh, nonfinite)
        if log is not None:
            local[..., _UNITS] = log.digest
        waiter = _start_summary(self.mesh, local)
        self._pending = (waiter, _dp_axes(plan), fp, paths, local, log)
        if not defer:
            self.settle()

    def settle(self) -> None:
        """Wait for this call's summary (if one is in flight) and decide: returns if every
        rank agrees, else raises on every rank alike. Idempotent."""
        if self._pending is None:
            return
        waiter, dp, fp, paths, local, log = self._pending
        self._pending = None
        if not _healthy(waiter()):  # only now every rank's row, and the exact decision
            _exact(self.mesh, dp, fp, paths=paths, local=local, log=log)

    def fail(self, exc: BaseException) -> None:
        """This rank's local checks raised ``exc``: tell the others (who raise too)."""
        self.done = True
        row = torch.full((_WIDTH,), -1, dtype=torch.int64)
        row[_ERROR] = 1
        local = row.expand(*self.mesh.batch_shape, row.numel()).clone()
        try:
            # the others are in this call's summary, which the error flag sends to the exchange
            _start_summary(self.mesh, local)()
            tables = _gather(self.mesh, self.mesh.axis_names, local)
            _peer_errors(self.mesh, tables, exc)
        finally:  # every rank raises (this one its own error): the step stops here
            _stopped(self.mesh)


def agreement(spec: Any, call: str) -> contextlib.AbstractContextManager[Agreement]:
    """Run a call's local checks inside; ``agreement.check(plan, ...)`` before communicating.

    A ``ValueError``/``TypeError``/``NotImplementedError`` raised inside before ``check`` is
    reported to the other ranks in the same one summary, so that every rank raises (each
    with its own error, or naming the rank that failed) instead of waiting for the others.
    The validation mode is the caller's context's: for a call made in it.
    """
    return agreement_in_mode(spec, call, current_mode())


@contextlib.contextmanager
def agreement_in_mode(spec: Any, call: str, mode: str) -> Iterator[Agreement]:
    """:func:`agreement` in the validation mode ``mode`` (the caller's :func:`current_mode`,
    read where the call was made: a call that may run in a backward is handed it)."""
    mesh = within(spec)  # the mesh, or the part of it a replicas spec agrees over
    agreed = Agreement(mesh, call, mode)
    try:
        yield agreed
    except _LOCAL_ERRORS as exc:
        if mesh is None or agreed.done or agreed.off or torch.compiler.is_compiling():
            raise
        agreed.fail(exc)
        raise


def agree_on_unit_collective(
    spec: Any,
    plan: Any,
    *,
    what: str,
    paths: list[str],
    options: tuple,
    unit: str,
    op: str,
    local: Callable[[], None] | None = None,
) -> None:
    """``validation("strict")``: every rank agrees on a layer-wise unit's collective ``op``
    before it is issued (a first-order unit's or one on the composable path; or, from
    ``MainGrad.begin_microbatch``, the declaration that decides when the deferred reductions
    are issued), so that ranks that differ raise :class:`~functional_hsdp.base.errors.UnitsDiffer`
    on every rank, naming ``unit``, instead of meeting another rank's collective (a crash or
    a hang). ``local``: this rank's own checks, run first inside the agreement (their error
    is this rank's, and the others are told). The rows are the library's own plain tensors,
    whatever transform or backward is running."""
    with torch._C._DisableFuncTorch(), torch.no_grad():
        with agreement_in_mode(spec, what, "strict") as agreed:
            if local is not None:
                local()
            try:
                agreed.check(plan, paths, options=options)
            except ValueError as exc:
                raise UnitsDiffer(
                    f"{unit}, before its {op} (validation('strict')): the ranks differ: {exc}",
                    op.replace("-", "_"),
                    tuple(plan.mesh.axis_names),
                ) from None


def agree(
    mesh: Any,
    dp: tuple[str, ...],
    fp: Fingerprint,
    paths: Sequence[str],
    nonfinite: torch.Tensor | None = None,
) -> None:
    """The exact decision for one call, from every rank's row (what a call's agreement falls
    back to when the summary shows a difference): exchange ``fp``'s row over every axis of
    ``mesh``; raise on any difference (the call's header across all ranks, the layout within
    each group over ``dp``), or a non-finite leaf."""
    _exact(mesh, dp, fp, paths=paths, local=_local_row(fp, mesh, nonfinite))


def _local_row(fp: Fingerprint, mesh: Any, nonfinite: torch.Tensor | None) -> torch.Tensor:
    """This rank's row (per simulated rank on a SimMesh: ``(*batch, L)``)."""
    row = torch.tensor([0, -1, *fp.row(), 0], dtype=torch.int64)
    local = row.expand(*mesh.batch_shape, row.numel()).clone()
    if nonfinite is not None:
        local[..., _NONFINITE] = nonfinite
    return local


def _start_summary(mesh: Any, local: torch.Tensor) -> Any:
    """Issue the maximum over every rank of ``[row, -row]``: each field's maximum and
    (negated) minimum."""
    return mesh.diagnostics.start_max(torch.cat([local, -local], -1))


def _healthy(summary: torch.Tensor) -> bool:
    """Whether the summary shows nothing to decide: no error row, no non-finite leaf, and
    every field alike on every rank. Stricter than :func:`_decide` (which asks the whole
    digest to agree only within each data-parallel group), which decides the rest."""
    width = summary.shape[-1] // 2
    high, low = summary[..., :width], -summary[..., width:]
    return not bool(
        (high[..., _ERROR] > 0).any()
        or (high[..., _NONFINITE] >= 0).any()
        or (high[..., _CALL:] != low[..., _CALL:]).any()
    )


def _exact(
    mesh: Any, dp: tuple[str, ...], fp: Fingerprint, *, paths, local: torch.Tensor, log=None
) -> None:
    """Every rank's row, and the exact decision from them. What it raises, every rank raises
    here alike: the step stops, so :func:`_stopped` forgets its unit calls on every rank."""
    try:
        tables = _gather(mesh, mesh.axis_names, local)
        _decide(mesh, dp, fp, paths=paths, local=local, tables=tables, log=log)
    except BaseException:
        _stopped(mesh)
        raise


def _stopped(mesh: Any) -> None:
    """An agreement raised on every rank (the ranks differ, or one failed its own checks):
    the unit calls recorded since the last check belong to a step that stopped there, and
    may differ across ranks (a strict agreement stops a unit another rank skipped). Forget
    them on every rank, so that the next step's check compares that step's calls only."""
    unit_log(mesh).take()


def _decide(
    mesh: Any,
    dp: tuple[str, ...],
    fp: Fingerprint,
    *,
    paths,
    local: torch.Tensor,
    tables,
    log=None,
) -> None:
    """Every decision made from the exchanged ``tables`` (B, G, L: G = every rank of the
    mesh), alike on all ranks. ``log``: this rank's unit calls, if the call checks them."""
    everyone = mesh.axis_names
    if bool((tables[..., _ERROR] > 0).any()):
        _peer_errors(mesh, tables, None)
    names = mesh.diagnostics.members(everyone)
    for k, field in enumerate(HEADER[:CALL_FIELDS]):  # what every rank must agree on
        column = tables[..., _HEADER0 + k]
        if bool((column != column[:, :1]).any()):
            texts = _gather_text(mesh, everyone, fp.header[k])
            raise ValueError(f"{field} differs across ranks: {_groups(texts, names)}{_TAIL}")
    units = tables[..., _UNITS]
    if bool((units != units[:, :1]).any()):  # every rank must have run the same units
        raise ValueError(_units_message(mesh, fp.header[0], log or UnitLog()))
    if not _agree_within(mesh, dp, tables[..., _WHOLE]):  # the layout, per data-parallel group
        # the longest tree of any rank: every exchange spans the whole mesh, so its rows
        # must be equally long on every rank, not only within a group
        n = int(tables[..., _COUNT].max())
        members = mesh.diagnostics.members(dp)
        raise ValueError(_explain(mesh, dp, fp, n=n, names=members))
    bad = tables[..., _NONFINITE]
    if bool((bad >= 0).any()):
        i = int(bad[bad >= 0].min())
        ranks = _unique(
            n for t, b in enumerate(bad.tolist()) for n, x in zip(names[t], b) if x == i
        )
        raise ValueError(
            f"{paths[i]}: holds NaN or Inf on {_ranks(ranks)} (check_finite=True); no "
            "collective was issued"
        )


# -- the gathered units' running fingerprint -------------------------------------------------

_UNIT_LIMIT = 1 << 16  # unit calls whose digests a log keeps for the message (beyond: the digest)
_PRIME = 1_000_003
_UNIT_DIGESTS = Bounded(4096)  # (unit, options) -> (digest of the unit, of both)
_LOGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # mesh -> its UnitLog


class UnitLog:
    """The :func:`~functional_hsdp.gathered` unit calls one rank made on a mesh since the last
    call that checked them (``Agreement.check(units=True)``): a running, order-sensitive
    digest of every call's unit and options, and each call's digests for the message. A
    ``MainGrad.begin_microbatch`` declaration is recorded among them (its option: ``last``),
    since it decides when the units' deferred reductions are issued.

    An explicit record per mesh (not per thread or context), written by a unit call in the
    caller's thread and read by the checking call: a backward never reads it."""

    def __init__(self) -> None:
        self.digest, self.count = 0, 0
        self.entries: list[tuple[int, int]] = []  # per call: (unit digest, unit+options digest)
        self.texts: dict[int, str] = {}  # unit+options digest -> "unit | options"

    def record(self, unit: str, options: str) -> None:
        """One more unit call: ``unit`` names it, ``options`` what its collectives depend on."""
        key = (unit, options)
        digests = _UNIT_DIGESTS.get(key)
        if digests is None:
            digests = _UNIT_DIGESTS[key] = (_digest(unit), _digest(f"{unit} | {options}"))
        self.digest = (self.digest * _PRIME + digests[1]) & _MASK  # the order counts
        self.count += 1
        if len(self.entries) < _UNIT_LIMIT:
            self.entries.append(digests)
            self.texts.setdefault(digests[1], f"{unit} | {options}")

    def take(self) -> UnitLog:
        """What was recorded, handed to a check; this log starts again empty."""
        taken = UnitLog()
        taken.digest, taken.count, taken.entries, taken.texts = (
            self.digest,
            self.count,
            self.entries,
            self.texts,
        )
        self.digest, self.count, self.entries, self.texts = 0, 0, [], {}
        return taken


def unit_log(mesh: Any) -> UnitLog:
    """The :class:`UnitLog` of ``mesh`` (made on first use; it goes with the mesh; a
    :class:`Within`'s is its mesh's)."""
    if isinstance(mesh, Within):
        mesh = mesh.base
    log = _LOGS.get(mesh)
    if log is None:
        log = _LOGS[mesh] = UnitLog()
    return log


def _units_message(mesh: Any, where: str, log: UnitLog) -> str:
    """The ranks' unit calls differ: the first call where they do, and how (more exchanges,
    all ranks alike)."""
    everyone = mesh.axis_names
    names = mesh.diagnostics.members(everyone)[0]
    mine = torch.tensor([log.count, len(log.entries)])
    counts = _gather(mesh, everyone, mine.expand(*mesh.batch_shape, 2))[0]
    n = max(int(counts[:, 1].max()), 1)
    flat = [x for entry in log.entries for x in entry] + [_ABSENT] * (2 * (n - len(log.entries)))
    digests = torch.tensor(flat, dtype=torch.int64).expand(*mesh.batch_shape, 2 * n)
    lists = _gather(mesh, everyone, digests)[0].view(-1, n, 2)  # (G, n, [unit, unit+options])
    differs = (lists != lists[:1]).any(-1).any(0)
    i = int(differs.to(torch.int8).argmax()) if bool(differs.any()) else n
    text = log.texts[log.entries[i][1]] if i < len(log.entries) else ""
    texts = _gather_text(mesh, everyone, text)[0]
    made = counts[:, 0].tolist()
    values = [t or f"no call #{i} (it made {c})" for t, c in zip(texts, made)]
    how = _how(lists, made, i, texts=texts)
    return (
        f"{where}: the ranks ran their gathered units differently ({how}): first at call #{i} "
        f"since the last check: {_groups([values], [names])}. Every rank must call the same "
        "units, in the same order, with the same options (recompute, reshard_after_forward, "
        "mp_policy), and declare the same last microbatch (begin_microbatch); their "
        "gradients would be wrong. Run under "
        "fh.validation('strict') to stop at the unit's first collective instead"
    )


def _how(lists: torch.Tensor, made: list[int], i: int, *, texts: list[str]) -> str:
    """How the ranks' unit calls differ at call ``i``: ``order``, ``skipped``, ``another
    unit``, ``dtype (...)`` or ``options (...)``."""
    if i >= lists.shape[1]:
        return f"beyond the first {lists.shape[1]} calls kept"
    units = lists[:, i, 0]
    other = bool((units != units[0]).any())
    if bool((units == _ABSENT).any()) or (other and len(set(made)) > 1):
        return "skipped"
    if other:
        kept = [sorted(row[:, 0].tolist()) for row in lists]
        return "order" if all(k == kept[0] for k in kept) else "another unit"
    fields = [dict(f.split("=", 1) for f in t.split(" | ", 1)[1].split("; ")) for t in texts]
    keys = [k for k in fields[0] if any(f.get(k) != fields[0][k] for f in fields)]
    kind = "dtype" if keys and all(k.endswith("dtype") for k in keys) else "options"
    return f"{kind}: {', '.join(keys)}"


def _agree_within(mesh: Any, dp: tuple[str, ...], column: torch.Tensor) -> bool:
    """Whether ``column`` (B, G over every rank, row-major) agrees within each group of ranks
    that differ only in their ``dp`` coordinates."""
    sizes, dims = mesh.sizes, [mesh.axis_names.index(a) for a in dp]
    other = [d for d in range(len(sizes)) if d not in dims]
    grid = column.reshape(column.shape[0], *sizes)
    grid = grid.permute(0, *[1 + d for d in other], *[1 + d for d in dims])
    flat = grid.reshape(
        column.shape[0], -1, max(1, int(torch.tensor([sizes[d] for d in dims]).prod()))
    )
    return bool((flat == flat[..., :1]).all())


def _peer_errors(mesh: Any, tables: torch.Tensor, mine: BaseException | None) -> None:
    """Some rank's local checks failed: raise (every rank). A failing rank's own error is
    re-raised by its caller; the others raise the first failing rank's error type and text."""
    everyone = mesh.axis_names
    text = f"{type(mine).__name__}\x1f{mine}" if mine is not None else ""
    texts = _gather_text(mesh, everyone, text)
    if mine is not None:
        return  # agreement() re-raises it
    names = mesh.diagnostics.members(everyone)
    failed = [(n, t) for table, ns in zip(texts, names) for n, t in zip(ns, table) if t]
    kind, message = failed[0][1].split("\x1f", 1)
    ranks = _unique(n for n, _ in failed)
    cls = {"TypeError": TypeError, "NotImplementedError": NotImplementedError}.get(kind, ValueError)
    raise cls(
        f"{message} [raised on {_ranks(ranks)}; this rank's own input passed its checks, and it "
        "raises too instead of waiting in a collective]"
    )


_TAIL = (
    " (cross-rank check before the first collective of this call; every rank must make "
    "the same library calls with the same trees, shapes, dtypes, specs and last)"
)


def _gather(mesh: Any, axes: tuple[str, ...], local: torch.Tensor) -> torch.Tensor:
    return _table(mesh, mesh.diagnostics.exchange(local, axes))


def _table(mesh: Any, out: torch.Tensor) -> torch.Tensor:
    """An exchange's result as (B, G, L): one table per simulated rank (B = 1 on a DistMesh)."""
    return out.reshape(-1, *out.shape[-2:])


def _explain(mesh, axes, fp: Fingerprint, *, n: int, names) -> str:
    """The error message for differing fingerprints (more exchanges, all ranks alike):
    ``n``, the most leaves any rank of the mesh has."""
    tail = _TAIL
    # the first leaf whose digests differ, over the longest tree of any rank
    mine = torch.tensor(fp.leaf_digests(n), dtype=torch.int64)
    digests = _gather(mesh, axes, mine.expand(*mesh.batch_shape, 2 * n))
    differs = (digests != digests[:, :1]).any(1).any(0)
    if bool(differs.any()):
        i = int(differs.to(torch.int8).argmax()) % n
        leaf = fp.leaves[i] if i < len(fp.leaves) else None
        texts = _gather_text(mesh, axes, "\x1f".join(leaf) if leaf else "")
        return _leaf_message(i, texts, names) + tail
    texts = _gather_text(mesh, axes, fp.header[-1])
    return f"the tree structure differs across ranks: {_groups(texts, names)}{tail}"


def _leaf_message(i: int, texts: list[list[str]], names) -> str:
    rows = [[t.split("\x1f") if t else None for t in table] for table in texts]
    present = [leaf for table in rows for leaf in table if leaf is not None]
    first = present[0]
    fields = [
        f
        for f in range(len(LEAF_FIELDS))
        if any(leaf is None or leaf[f] != first[f] for table in rows for leaf in table)
    ]
    f = fields[0] if fields else 0
    if f == 0:  # the paths differ: the tree structures do
        values = [
            [leaf[0] if leaf else f"no leaf {i} (a shorter tree)" for leaf in table]
            for table in rows
        ]
        return (
            f"{first[0]}: the tree structure differs across ranks at leaf {i}: "
            f"{_groups(values, names)}"
        )
    values = [[leaf[f] for leaf in table] for table in rows]
    return f"{first[0]}: {LEAF_FIELDS[f]} {_groups(values, names)}"


def _gather_text(mesh, axes, text: str) -> list[list[str]]:
    """Every group member's ``text`` (one list per local table). The rows are as long as
    the longest text of the whole mesh, which every exchange spans (a group's longest would
    differ between groups, and gloo aborts on rows of other lengths)."""
    data = list(text.encode())
    every = tuple(mesh.axis_names)
    lengths = _gather(mesh, every, torch.tensor([len(data)]).expand(*mesh.batch_shape, 1))
    width = max(int(lengths.max()), 1)
    padded = torch.tensor(data + [0] * (width - len(data)), dtype=torch.int64)
    rows = _gather(mesh, axes, padded.expand(*mesh.batch_shape, width))
    return [[bytes(r.tolist()).rstrip(b"\0").decode() for r in table] for table in rows]


def _unique(items) -> list:
    return list(dict.fromkeys(items))


def _ranks(names: list[str]) -> str:
    return f"rank {names[0]}" if len(names) == 1 else f"ranks [{', '.join(names)}]"


def _groups(values: list[list[str]], names) -> str:
    """``A on ranks [0, 1, 3] but B on rank 2``: the values and the ranks holding each."""
    holders: dict[str, list[str]] = {}
    for table_values, table_names in zip(values, names):
        for value, name in zip(table_values, table_names):
            if name not in holders.setdefault(value, []):
                holders[value].append(name)
    parts = [f"{value} on {_ranks(ranks)}" for value, ranks in holders.items()]
    return parts[0] + " but " + ", ".join(parts[1:]) if len(parts) > 1 else parts[0]

"""One call's cross-rank agreement: every rank takes part in one small summary per call,
before any gradient collective, and all raise together.

Invariant: every rank decides alike, from the same summary or the same exchanged tables, so
either every rank passes or every rank raises (its own error, or one naming the rank that
failed); no rank is left waiting in a collective the others do not issue. The protocol, step
by step: :class:`Agreement`. Whether a call agrees is the policy's
(:mod:`~functional_hsdp.runtime.validate`); what it compares, its fingerprint's
(:mod:`~functional_hsdp.runtime.fingerprints`); the part of the mesh it spans,
:mod:`~functional_hsdp.runtime.span`'s. What users are promised: ``docs/guides/reliability.md``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..base.cache import register
from ..base.errors import UnitsDiffer
from . import messages, validate
from .fingerprints import CALL_FIELDS, HEADER, Fingerprint, fingerprint
from .span import within
from .unit_calls import UnitLog, unit_log

__all__ = [
    "Agreement",
    "agree",
    "agree_on_unit_collective",
    "agreement",
    "agreement_in_mode",
]

# plan -> {(op, last, options): its Fingerprint}; weak: evicted plans take their entries.
_DONE: weakref.WeakKeyDictionary = register(weakref.WeakKeyDictionary())
_LOCAL_ERRORS = (ValueError, TypeError, NotImplementedError)
# the row every rank contributes on every call
_ERROR, _NONFINITE, _CALL, _WHOLE, _COUNT, _HEADER0 = range(6)
# after the header digests: the digest of the unit calls checked by this call (UnitLog), or 0
_UNITS = _HEADER0 + len(HEADER)
_WIDTH = _UNITS + 1


class Agreement:
    """One call's cross-rank agreement: every rank takes part in one small summary per call,
    before any gradient collective, and all raise together.

    ``mode``: the validation mode for this call (see
    :func:`~functional_hsdp.runtime.validate.validation`), read by the caller
    (:func:`~functional_hsdp.runtime.validate.current_mode`): nothing here reads the context,
    which may not be the caller's (a backward on autograd's device thread).

    What a call says of itself: every call that communicates (``reduce_grads``, ``gather``,
    ``sync_params``, the per-axis collectives, ``MainGrad.accumulate`` / ``finish``, the
    checkpoint functions) describes itself: a header (operation, ``last``, options, mesh,
    data-parallel axes, tree structure) and one line per leaf (path, shape, dtype, device
    type, spec, bucket slot), hashed into a row of int64 ``[error flag, first non-finite
    leaf, call digest, whole digest, leaf count, one digest per header field, the digest of
    the unit calls it checks (or 0)]``. Digests are 62-bit blake2b hashes, stable across
    processes (Python's ``hash`` is salted per process); a plan's fingerprint is computed
    once and cached, so a call's row costs a list copy.

    The protocol, on every call:

    1. **The summary** (:meth:`check`; how it travels: :func:`_start_summary`). The row is
       summarized over **every** axis of the mesh (not only the spec's data-parallel axes:
       ranks naming different axes would otherwise wait in different groups) by **one**
       elementwise maximum of ``[row, -row]``, which gives every rank each field's maximum
       and minimum over all ranks. It is *issued* (its first round) when the call's local
       checks have passed and *waited* (the later rounds, which need the first one's
       result) just before the call's first gradient collective (:meth:`settle`, called by
       the scheduler), so packing the first bucket overlaps the first round. A call that
       issues no collective (``ddp`` before the last microbatch) settles before it returns,
       and before it changes any persistent state (``MainGrad``'s buffers).
    2. **The decision**, alike on every rank: from the summary when it shows nothing to
       decide (:func:`_healthy`), else from every rank's row (:func:`_exact`).
    3. **A rank whose local checks raise** sends an error row instead (:meth:`fail`).

    **Replicas.** A call on a :func:`~functional_hsdp.replicas` spec (every Spec of it with
    replica axes) agrees within its replica only: the summary and every exchange span the
    mesh's other axes (:mod:`~functional_hsdp.runtime.span`). A call that crosses the
    replica axis (DiLoCo's sync, a collective over it) agrees over the whole mesh.

    Neither the summary nor the exchange is a gradient collective:
    :func:`~functional_hsdp.comm_log` does not record them, and they are plain
    ``torch.distributed`` point-to-point messages and all-gathers (not functional
    collectives), so profiles of the gradient communication stay exact. On a one-rank mesh
    nothing is exchanged (unless ``check_finite=True``). ``check_finite=True`` is the one
    exception to "never touches device data": the non-finite scan reads every bucket (a
    host-device synchronization), and its result rides in the row.
    """

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
        made on the mesh since the last such check
        (:class:`~functional_hsdp.runtime.unit_calls.UnitLog`, taken and reset now), so that
        units run in another order, skipped or with other options on one rank are an error
        on every rank before the gradient is used."""
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
        self._pending = (waiter, plan.dp_axes, fp, paths, local, log)
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
        """This rank's local checks raised ``exc``: tell the others (who raise too).

        A rank whose local checks raise (``ValueError``/``TypeError``/``NotImplementedError``)
        before its row is issued sends an error row instead, in the same summary (its error
        flag sends every rank to the exchange); the others raise the failing rank's error
        type and text, naming it."""
        self.done = True
        row = torch.full((_WIDTH,), -1, dtype=torch.int64)
        row[_ERROR] = 1
        local = row.expand(*self.mesh.batch_shape, row.numel()).clone()
        try:
            # the others are in this call's summary, which the error flag sends to the exchange
            _start_summary(self.mesh, local)()
            tables = messages.gather(self.mesh, self.mesh.axis_names, local)
            messages.peer_errors(self.mesh, tables, exc)
        finally:  # every rank raises (this one its own error): the step stops here
            _stopped(self.mesh)


def agreement(spec: Any, call: str) -> contextlib.AbstractContextManager[Agreement]:
    """Run a call's local checks inside; ``agreement.check(plan, ...)`` before communicating.

    A ``ValueError``/``TypeError``/``NotImplementedError`` raised inside before ``check`` is
    reported to the other ranks in the same one summary, so that every rank raises (each
    with its own error, or naming the rank that failed) instead of waiting for the others.
    The validation mode is the caller's context's: for a call made in it.
    """
    return agreement_in_mode(spec, call, validate.current_mode())


@contextlib.contextmanager
def agreement_in_mode(spec: Any, call: str, mode: str) -> Iterator[Agreement]:
    """:func:`agreement` in the validation mode ``mode`` (the caller's
    :func:`~functional_hsdp.runtime.validate.current_mode`, read where the call was made: a
    call that may run in a backward is handed it)."""
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
    (negated) minimum (``Diagnostics.start_max``).

    It is host data, reduced over a CPU (gloo) group, so the agreement never touches device
    memory and never makes the host wait for the device. On a ``DistMesh`` it is recursive
    doubling in point-to-point messages: log2(ranks) rounds (two more where the count is not
    a power of two), each one 24-integer row each way, so a rank's messages and wait grow
    with log2 of the mesh's size (the all-gather of every rank's row that it replaces moved a
    row per rank in as many ring steps as ranks; bench B10, "Scaling with the number of
    ranks")."""
    return mesh.diagnostics.start_max(torch.cat([local, -local], -1))


def _healthy(summary: torch.Tensor) -> bool:
    """Whether the summary shows nothing to decide: no error row, no non-finite leaf, and
    every field alike on every rank (maximum = minimum): the call passes, and that is a
    healthy run's only communication for the agreement. Stricter than :func:`_decide` (which
    asks the whole digest to agree only within each data-parallel group), which decides the
    rest."""
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
    here alike: the step stops, so :func:`_stopped` forgets its unit calls on every rank.

    Only when the summary shows a difference, an error or a non-finite leaf: every rank's row
    is exchanged (one all-gather over the whole mesh, ``Diagnostics.exchange``) and every
    rank decides from the same table, exactly as :func:`agree` does: the call digest must
    agree over the whole mesh, the whole digest within each data-parallel group (so
    data-parallel groups that hold different trees pass, after the exchange). On a mismatch
    more exchanges follow, all ranks alike: the first differing header field, or the first
    leaf whose per-leaf digests differ (padded to the longest tree), and its text, from which
    every rank builds the same message and raises it (:mod:`~functional_hsdp.runtime.messages`)."""
    dp = tuple(a for a in dp if a in mesh.axis_names)  # a replicas mesh spans its group only
    try:
        tables = messages.gather(mesh, mesh.axis_names, local)
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
        messages.peer_errors(mesh, tables, None)
    names = mesh.diagnostics.members(everyone)
    for k, field in enumerate(HEADER[:CALL_FIELDS]):  # what every rank must agree on
        column = tables[..., _HEADER0 + k]
        if bool((column != column[:, :1]).any()):
            raise ValueError(messages.field_message(mesh, field, fp.header[k], names=names))
    units = tables[..., _UNITS]
    if bool((units != units[:, :1]).any()):  # every rank must have run the same units
        raise ValueError(messages.units_message(mesh, fp.header[0], log or UnitLog()))
    if not _agree_within(mesh, dp, tables[..., _WHOLE]):  # the layout, per data-parallel group
        # the longest tree of any rank: every exchange spans the whole mesh, so its rows
        # must be equally long on every rank, not only within a group
        n = int(tables[..., _COUNT].max())
        members = mesh.diagnostics.members(dp)
        raise ValueError(messages.explain(mesh, dp, fp, n=n, names=members))
    bad = tables[..., _NONFINITE]
    if bool((bad >= 0).any()):
        raise ValueError(messages.nonfinite_message(paths, bad, names=names))


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

"""The validation policy: which calls the cross-rank agreement checks (:func:`validation`).

In data-parallel training the worst failures are silent wrong gradients and hangs, where one
rank issues a collective that the others do not; the agreement turns both into clear errors.
This room holds the mode only. Invariant: a call reads the mode once, when it starts, in
the caller's context (:func:`current_mode`), and every rank must use the same mode. What
each failure becomes, and the limits: :func:`validation`; the agreement itself:
:mod:`~functional_hsdp.runtime.agreement`; the whole story: ``docs/guides/reliability.md``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

__all__ = ["current_mode", "validation"]


_MODES = ("on", "off", "first", "always", "strict")
_MODE: contextvars.ContextVar[str] = contextvars.ContextVar("fh_validation", default="on")


@contextlib.contextmanager
def validation(mode: str) -> Iterator[None]:
    """Turn the cross-rank agreement on or off inside the ``with`` block.

    What the agreement turns each failure into:

    * **Ranks make different calls**, or pass different trees, shapes, dtypes, specs,
      ``last`` or options: every call's agreement compares the ranks' rows before any
      gradient collective; every rank raises the same ``ValueError``, naming the first
      differing field or leaf path and the ranks.
    * **A rank's own checks fail** (a wrong ``acc``, a meta leaf, a bad flag): it raises its
      error, and the others raise one that names it, in the same agreement: nobody waits.
    * **Ranks run their gathered units** in another order, or with other options or dtypes,
      or declare another last microbatch: the step's running fingerprint of unit calls and
      ``begin_microbatch`` declarations (``UnitLog``) rides in the summary of
      ``begin_microbatch(last=True)``, ``MainGrad.finish`` and the last
      ``reduce_grads(at="gradient")``: every rank raises, naming the first call that differs
      and how; ``validation("strict")`` agrees before each unit collective and declaration
      (no mismatched one).
    * **NaN/Inf in gradients**: with ``check_finite=True`` every rank raises a ``ValueError``
      naming the first such leaf and ranks.
    * **A peer dies, hangs or issues another collective**: the collective fails or times out
      and raises ``CollectiveError`` naming it and its mesh axis.

    Limits:

    * ``validation("off")`` exchanges nothing (the checks above are off), except for a call
      with ``check_finite=True``, whose row still carries its non-finite flags. A call reads
      the mode when it starts, in the caller's context; the backward of ``psum`` and
      ``pmean`` (a call too) uses the mode their forward read, since autograd may run a
      backward on another thread (its device threads on CUDA), which does not see the
      caller's context.
    * Under ``torch.compile`` nothing is exchanged (a ``reduce_grads(check_finite=True)``
      there runs eagerly, at a graph break, agreement included).
    * A failure after the agreement (out of memory while packing, a peer dying
      mid-collective) raises ``CollectiveError`` on the survivors within the timeout, not at
      once.

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
    pass to :func:`~functional_hsdp.runtime.agreement.agreement_in_mode`. A function whose
    backward makes a call reads it in its forward and hands it to the backward: autograd may
    run a backward on another thread, which does not see this context (see
    :func:`validation`, "Limits"). While ``torch.compile`` traces, ``"on"`` (nothing is exchanged
    there, and dynamo cannot read a ContextVar)."""
    if torch.compiler.is_compiling():
        return "on"
    return _MODE.get()

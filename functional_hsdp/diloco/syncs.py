"""A fragment's sync in flight: what DiLoCo holds between a sync's issue and its landing.

Invariant: a :class:`SyncInFlight` is waited for once (the update where it lands, or a
checkpoint, whichever comes first; both get the same tensors); dropped unwaited, it lets go
of its reduction and leaks nothing; pickled or deep-copied, it is waited for first and its
result travels, never its collectives.
"""

from __future__ import annotations

import torch

from ..runtime.flight import InFlight

__all__ = ["SyncInFlight"]


class SyncInFlight(InFlight[list]):
    """One fragment's delayed sync in flight (an entry of ``DiLoCoState.flight``): its
    all-reduces issued (:func:`~functional_hsdp.sync.collectives.start_pmean`), or compressed,
    its all-to-alls (:func:`~functional_hsdp.runtime.compressed.start_packed`: the rest run when it
    is waited for). Its ``result()`` (:class:`~functional_hsdp.runtime.flight.InFlight`'s, once) is
    the fragment's averaged pseudo-gradient, one tensor per leaf of ``leaves``: the update
    where it lands, or a checkpoint, whichever comes first, waits; both get the same tensors.

    Attributes:
        fragment: the fragment's index.
        leaves: the fragment's leaves (indices in the params' tree order).
    """

    __slots__ = ("fragment", "leaves", "_keys", "_reduction", "_residual", "_total", "empty")

    def __init__(
        self,
        fragment: int,
        leaves: tuple[int, ...],
        *,
        keys: tuple,
        reduction: InFlight | None,
        waited: bool = False,
        result: list | None = None,
        residual: list | None = None,
        total: InFlight | None = None,
        empty: bool = False,
    ):
        super().__init__(waited=waited, result=result)
        self.fragment, self.leaves, self._keys, self._reduction = fragment, leaves, keys, reduction
        self._residual, self._total, self.empty = residual, total, empty

    def _wait(self) -> list[torch.Tensor]:
        got = self._reduction.result()
        if isinstance(got, dict):  # start_pmean's tree, by key
            out = [got[k] for k in self._keys]
        else:
            out, self._residual = got  # the compressed route's pieces and their new residual
        if self._total is not None:  # weighted: mean(w * delta) / mean(w)
            w = self._total.result()["weight"]
            if not bool((w > 0).all()):
                self.empty = True  # no weight anywhere: nothing to merge
                return out
            out = [
                x / w.reshape(*w.shape[:-1], *([1] * (x.dim() - w.dim() + 1))).to(x.dtype)
                for x in out
            ]
        return out

    def _release(self) -> None:
        if self._reduction is not None:
            self._reduction.abandon()
        if self._total is not None:
            self._total.abandon()

    def residual(self) -> list[torch.Tensor] | None:
        """A compressed sync with error feedback: the fragment's new residual (fp32, one
        tensor per leaf of ``leaves``), waited for; else None."""
        self.result()
        return self._residual

    def __reduce__(self) -> tuple:
        """Pickled (``torch.save``, ``copy.deepcopy``) waited for: its result travels, its
        collectives do not (a copy lands alike)."""
        out = [x.clone() for x in self.result()]
        new = self.residual()
        new = None if new is None else [x.clone() for x in new]
        return (_waited_sync, (self.fragment, self.leaves, self._keys, out, new, self.empty))

    def __repr__(self) -> str:
        how = "waited" if self.done else "in flight"
        return f"SyncInFlight(fragment={self.fragment}, {len(self.leaves)} leaves, {how})"


def _waited_sync(
    fragment: int,
    leaves: tuple,
    keys: tuple,
    out: list,
    residual: list | None = None,
    empty: bool = False,
) -> SyncInFlight:
    """A :class:`SyncInFlight` whose result, ``out`` (and ``residual``), is already there
    (unpickled)."""
    done = dict(waited=True, result=out, residual=residual, empty=empty)
    return SyncInFlight(fragment, leaves, keys=keys, reduction=None, **done)

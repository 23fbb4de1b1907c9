"""In flight: work issued and not yet waited for, the one abstraction under everything that flies.

Every reduction the library lets fly past the call that issued it is an :class:`InFlight`:
``engine.reduce(wait=False)``'s, a compressed reduction's first leg, a DiLoCo sync, a
MainGrad's deferred reduction, a gathered unit's all-gather issued ahead and its gradient's
reduce-scatter. A subclass says how to wait (``_wait``) and what to let go of (``_release``);
:meth:`InFlight.result` is written once, here.

Invariant: :meth:`~InFlight.result` waits at most once and keeps what it got, the value or the
error (an interrupt keeps nothing: see there); :meth:`~InFlight.abandon` lets go of what is
still in flight when the result will never be read.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

__all__ = ["InFlight"]

T = TypeVar("T")


class InFlight(Generic[T]):
    """Work issued and not yet waited for; :meth:`result` waits for it, once.

    A subclass implements ``_wait()`` (wait and return the value; it may raise) and, if it
    holds anything in flight, ``_release()`` (let go of it: what is still in flight is
    abandoned, never waited). ``waited=True`` makes one already waited for, whose result is
    ``result`` (nothing to wait for: a tree without leaves, a result unpickled).

    Not an :class:`InFlight`: a mesh's :class:`~functional_hsdp.mesh.Flight`, the backend's
    handle of one collective, which the mesh that issued it waits (``Mesh.wait``) and which
    keeps no result or error of its own; the :class:`InFlight` holding it does.
    """

    __slots__ = ("_value", "_error", "_waited")

    def __init__(self, *, waited: bool = False, result: Any = None) -> None:
        self._value: Any = result
        self._error: Exception | None = None
        self._waited = waited

    @property
    def done(self) -> bool:
        """Whether :meth:`result` will not wait again: its value or its error is kept."""
        return self._waited or self._error is not None

    def result(self) -> T:
        """The value, waited for on the first call and kept. An error (an ``Exception``) is
        kept too: what was still in flight is let go, and every later call raises it again
        (from here, not growing its first traceback). An interrupt (a ``BaseException`` that
        is not an ``Exception``, say ``KeyboardInterrupt``) keeps nothing: the next call
        waits again."""
        if self._error is not None:
            raise self._error.with_traceback(None)
        if not self._waited:
            try:
                value = self._wait()
            except Exception as exc:
                self._fail(exc)
                raise
            self._value, self._waited = value, True
        return self._value

    def abandon(self) -> None:
        """Let go of what is still in flight: its result will never be read (a later
        :meth:`result` raises a ``RuntimeError`` saying so). Nothing once done."""
        if not self.done:
            self._fail(RuntimeError(f"{self!r}: abandoned, its result was let go unread"))

    def _fail(self, exc: Exception) -> None:
        """Keep ``exc`` for every later :meth:`result`, and let go of what is still in flight
        (an error leaks no buffers)."""
        self._error = exc
        self._release()

    def _wait(self) -> T:
        raise NotImplementedError(f"{type(self).__name__} must say how to wait (_wait)")

    def _release(self) -> None:
        """Let go of what is still in flight (nothing, unless a subclass holds some)."""

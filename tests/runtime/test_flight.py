"""functional_hsdp.runtime.flight.InFlight, the one result() under everything that flies: it
waits once and keeps the value or the error (letting go of what is in flight), an interrupt keeps
nothing, abandon() lets go; and every in-flight type of the package is one."""

from __future__ import annotations

import pytest

from functional_hsdp.diloco import SyncInFlight
from functional_hsdp.runtime import compressed, engine
from functional_hsdp.runtime.flight import InFlight
from functional_hsdp.sync import deferred
from functional_hsdp.units.transfers import AllGather, ReduceScatter


class _Script(InFlight[str]):
    """Waits by running the next of ``outcomes`` (a value, or an exception to raise)."""

    def __init__(self, *outcomes):
        super().__init__()
        self.outcomes, self.waits, self.released = list(outcomes), 0, 0

    def _wait(self):
        self.waits += 1
        got = self.outcomes.pop(0)
        if isinstance(got, BaseException):
            raise got
        return got

    def _release(self):
        self.released += 1


def test_result_waits_once_and_keeps_the_value():
    flight = _Script("a", "b")
    assert not flight.done
    assert flight.result() == "a" and flight.result() == "a"
    assert flight.done and flight.waits == 1 and flight.released == 0


def test_an_error_is_kept_and_what_is_in_flight_let_go():
    flight = _Script(ValueError("the collective failed"), "never")
    for _ in range(2):
        with pytest.raises(ValueError, match="the collective failed"):
            flight.result()
    assert flight.done and flight.waits == 1 and flight.released == 1


def test_an_interrupt_keeps_nothing_and_the_next_call_waits_again():
    flight = _Script(KeyboardInterrupt(), "a")
    with pytest.raises(KeyboardInterrupt):
        flight.result()
    assert not flight.done and flight.released == 0
    assert flight.result() == "a" and flight.waits == 2


def test_abandon_lets_go_once_and_a_later_result_says_so():
    flight = _Script("a")
    flight.abandon()
    flight.abandon()
    assert flight.released == 1 and flight.waits == 0
    with pytest.raises(RuntimeError, match="abandoned"):
        flight.result()
    done = _Script("a")
    done.result()
    done.abandon()  # nothing once done
    assert done.result() == "a" and done.released == 0


def test_one_already_waited_has_its_result():
    flight = engine.ReduceInFlight.of({"a": 1})
    assert flight.done and flight.result() == {"a": 1}


def test_every_in_flight_type_is_an_in_flight():
    kinds = [
        engine.ReduceInFlight,
        compressed.CompressedInFlight,
        SyncInFlight,
        deferred.DeferredReduction,
        AllGather,
        ReduceScatter,
    ]
    assert all(issubclass(k, InFlight) for k in kinds)
    assert all("result" not in vars(k) for k in kinds)  # one result(): the base's

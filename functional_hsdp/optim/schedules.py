"""Learning-rate schedules: optax's ``*_schedule`` functions, same arguments, same values.

A schedule is a function ``step -> value`` of the step count, counted from 0 as optax counts
it: the first update uses ``schedule(0)``. Every ``lr`` of the library's optimizers
(:func:`~functional_hsdp.sgd`, :func:`~functional_hsdp.adamw`, :func:`~functional_hsdp.muon`,
:func:`~functional_hsdp.scale_by_learning_rate`) takes a number or a schedule; the step count
lives in the optimizer state (a host int), so a checkpointed state resumes the schedule where
it stopped. The values are host floats computed from host ints (no tensor, no device
synchronization); each function below gives its formula.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Schedule", "constant", "cosine_decay", "join", "linear", "warmup_cosine_decay"]

#: A function of the step count (an int, from 0) returning a number.
Schedule = Callable[[int], float]


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite number; got {type(value).__name__} {value!r}")
    return value


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int; got {type(value).__name__} {value!r}")
    return int(value)


def constant(value: float) -> Schedule:
    """A constant schedule (optax's ``constant_schedule``).

    Args:
        value: the value at every step.

    Returns:
        A function ``step -> value``.

    Example:
        >>> import functional_hsdp as fh
        >>> fh.schedules.constant(0.1)(0), fh.schedules.constant(0.1)(1000)
        (0.1, 0.1)
    """
    _number("constant: value", value)
    return lambda step: value


def linear(
    init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0
) -> Schedule:
    """A linear ramp from ``init_value`` to ``end_value`` (optax's ``linear_schedule``).

    At step ``t``: ``init_value`` while ``t < transition_begin``; then
    ``init_value + (end_value - init_value) * (t - transition_begin) / transition_steps``;
    ``end_value`` from ``transition_begin + transition_steps`` on. As optax's,
    ``transition_steps <= 0`` holds ``init_value`` throughout, and a negative
    ``transition_begin`` counts as 0.

    Args:
        init_value: the value before and at the start of the ramp.
        end_value: the value at its end and after.
        transition_steps: the length of the ramp, in steps.
        transition_begin: the step it starts at.

    Returns:
        A function ``step -> value``.

    Example:
        >>> import functional_hsdp as fh
        >>> warmup = fh.schedules.linear(0.0, 1.0, transition_steps=4)
        >>> [warmup(t) for t in range(6)]
        [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    """
    _number("linear: init_value", init_value)
    _number("linear: end_value", end_value)
    steps = _int("linear: transition_steps", transition_steps)
    begin = max(0, _int("linear: transition_begin", transition_begin))
    if steps <= 0:
        return lambda step: init_value

    def schedule(step: int) -> float:
        done = min(max(step - begin, 0), steps)
        return (init_value - end_value) * (1 - done / steps) + end_value

    return schedule


def cosine_decay(
    init_value: float, decay_steps: int, alpha: float = 0.0, exponent: float = 1.0
) -> Schedule:
    """Cosine decay from ``init_value`` to ``alpha * init_value`` (optax's
    ``cosine_decay_schedule``).

    At step ``t``, with ``c = (1 + cos(pi * min(t, decay_steps) / decay_steps)) / 2``:
    ``init_value * ((1 - alpha) * c**exponent + alpha)``.

    Args:
        init_value: the value at step 0.
        decay_steps: the steps the decay lasts (> 0); after it the value stays
            ``alpha * init_value``.
        alpha: the smallest multiplier of ``init_value``.
        exponent: the power of the cosine factor.

    Returns:
        A function ``step -> value``.

    References:
        Loshchilov & Hutter, *SGDR: Stochastic Gradient Descent with Warm Restarts*, ICLR 2017.

    Example:
        >>> import functional_hsdp as fh
        >>> decay = fh.schedules.cosine_decay(1.0, decay_steps=4)
        >>> [round(decay(t), 4) for t in range(6)]
        [1.0, 0.8536, 0.5, 0.1464, 0.0, 0.0]
    """
    _number("cosine_decay: init_value", init_value)
    _number("cosine_decay: alpha", alpha)
    _number("cosine_decay: exponent", exponent)
    steps = _int("cosine_decay: decay_steps", decay_steps)
    if steps <= 0:
        raise ValueError(f"cosine_decay: decay_steps must be > 0; got {decay_steps!r}")

    def schedule(step: int) -> float:
        cosine = 0.5 * (1 + math.cos(math.pi * min(step, steps) / steps))
        return init_value * ((1 - alpha) * cosine**exponent + alpha)

    return schedule


def warmup_cosine_decay(
    init_value: float,
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    end_value: float = 0.0,
    exponent: float = 1.0,
) -> Schedule:
    """Linear warmup, then cosine decay (optax's ``warmup_cosine_decay_schedule``).

    :func:`linear` from ``init_value`` to ``peak_value`` over ``warmup_steps``, then
    :func:`cosine_decay` of ``peak_value`` over ``decay_steps - warmup_steps`` steps with
    ``alpha = end_value / peak_value`` (0 when ``peak_value`` is 0), joined at
    ``warmup_steps``.

    Args:
        init_value: the value at step 0.
        peak_value: the value at the end of the warmup.
        warmup_steps: the length of the warmup.
        decay_steps: the length of the whole schedule, warmup included.
        end_value: the value at ``decay_steps`` and after.
        exponent: the power of the cosine factor.

    Returns:
        A function ``step -> value``.

    Example:
        >>> import functional_hsdp as fh
        >>> lr = fh.schedules.warmup_cosine_decay(0.0, 1.0, warmup_steps=2, decay_steps=6)
        >>> [round(lr(t), 4) for t in range(8)]
        [0.0, 0.5, 1.0, 0.8536, 0.5, 0.1464, 0.0, 0.0]
    """
    _number("warmup_cosine_decay: peak_value", peak_value)
    _number("warmup_cosine_decay: end_value", end_value)
    warmup = _int("warmup_cosine_decay: warmup_steps", warmup_steps)
    total = _int("warmup_cosine_decay: decay_steps", decay_steps)
    if total <= warmup:
        raise ValueError(
            f"warmup_cosine_decay: decay_steps ({decay_steps!r}) is the whole schedule, warmup "
            f"included, so it must be > warmup_steps ({warmup_steps!r})"
        )
    alpha = 0.0 if peak_value == 0 else end_value / peak_value
    return join(
        [
            linear(init_value, peak_value, transition_steps=warmup),
            cosine_decay(peak_value, total - warmup, alpha=alpha, exponent=exponent),
        ],
        [warmup],
    )


def join(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Schedules one after another (optax's ``join_schedules``).

    Before ``boundaries[0]`` the value is ``schedules[0](step)``; from ``boundaries[i - 1]``
    (until the next boundary) it is ``schedules[i](step - boundaries[i - 1])``: each schedule
    counts its steps from its own start.

    Args:
        schedules: ``n`` schedules.
        boundaries: ``n - 1`` increasing steps.

    Returns:
        A function ``step -> value``.

    Example:
        >>> import functional_hsdp as fh
        >>> s = fh.schedules.join([fh.schedules.constant(1.0),
        ...                        fh.schedules.linear(0.5, 0.0, transition_steps=2)], [3])
        >>> [s(t) for t in range(6)]
        [1.0, 1.0, 1.0, 0.5, 0.25, 0.0]
    """
    schedules, boundaries = list(schedules), [_int("join: boundaries", b) for b in boundaries]
    if len(schedules) != len(boundaries) + 1:
        raise ValueError(
            f"join: expected one boundary fewer than schedules; got {len(schedules)} schedules "
            f"and {len(boundaries)} boundaries"
        )
    for i, s in enumerate(schedules):
        if not callable(s):
            raise TypeError(f"join: schedules[{i}] must be callable; got {type(s).__name__}")
    if any(a > b for a, b in zip(boundaries, boundaries[1:])):
        raise ValueError(f"join: boundaries must increase; got {boundaries}")

    def schedule(step: int) -> float:
        start, current = 0, schedules[0]
        for boundary, s in zip(boundaries, schedules[1:]):
            if step >= boundary:
                start, current = boundary, s
        return current(step - start)

    return schedule


# -- for the optimizers --------------------------------------------------------------------


def check_lr(lr: Any, name: str = "lr") -> None:
    """ValueError unless ``lr`` is a number >= 0 or a callable (a schedule)."""
    if callable(lr):
        return
    if (
        isinstance(lr, bool)
        or not isinstance(lr, numbers.Real)
        or not (lr >= 0 and math.isfinite(lr))
    ):
        raise ValueError(f"{name} must be a number >= 0 or a schedule (step -> number); got {lr!r}")


def value_at(lr: Any, step: int, name: str = "lr") -> float:
    """``lr`` at ``step``: the number itself, or the schedule's value, checked to be a finite
    number >= 0 (an error naming ``name`` and the step otherwise)."""
    if not callable(lr):
        return lr
    value = lr(step)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name}: the schedule returned {type(value).__name__} {value!r} at step {step}; "
            "expected a number (a Python float: for a tensor t, return float(t))"
        )
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(
            f"{name}: the schedule returned {value!r} at step {step}; expected a finite number >= 0"
        )
    return value

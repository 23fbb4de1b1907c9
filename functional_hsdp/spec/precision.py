"""Mixed precision: torch's own ``MixedPrecisionPolicy`` (FSDP2's), read once into dtypes.

:class:`Precision` is what a policy (or None) means for a unit: the dtype its all-gather and
compute run in, the dtype its gradient is reduced in, the dtype of its outputs, and whether its
inputs are cast (the table of fields: :class:`Precision`). The master weights (the shards) keep
their own dtype; an optimizer updates them in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Precision", "check_mp_policy"]


@dataclass(frozen=True)
class Precision:
    """The dtypes a ``MixedPrecisionPolicy`` (or None) means for a unit.

    ==========================  ======================================================
    policy field                what the library does with it
    ==========================  ======================================================
    ``param_dtype``             the shards are cast to it before the all-gather: the
                                wire and the unit's compute are in it (None: the
                                shards' dtype)
    ``reduce_dtype``            the gradient's reduce-scatter (and what lands in a
                                ``MainGrad``, or what ``grad`` returns) runs in it
                                (None: ``param_dtype``, as FSDP2)
    ``output_dtype``            floating outputs of a unit are cast to it
    ``cast_forward_inputs``     floating arguments of a unit are cast to
                                ``param_dtype``
    ==========================  ======================================================
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_inputs: bool = False

    @classmethod
    def of(cls, mp_policy: Any) -> Precision:
        if mp_policy is None:
            return cls()
        param = mp_policy.param_dtype
        return cls(
            param_dtype=param,
            reduce_dtype=mp_policy.reduce_dtype or param,
            output_dtype=mp_policy.output_dtype,
            cast_inputs=param is not None and mp_policy.cast_forward_inputs,
        )


def check_mp_policy(mp_policy: Any, name: str) -> None:
    """TypeError naming ``name`` unless ``mp_policy`` is None or a ``MixedPrecisionPolicy``
    whose dtypes are floating."""
    if mp_policy is None:
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(
            f"{name}: mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy or None; "
            f"got {type(mp_policy).__name__}"
        )
    for field_name in ("param_dtype", "reduce_dtype", "output_dtype"):
        d = getattr(mp_policy, field_name)
        if d is not None and not (isinstance(d, torch.dtype) and d.is_floating_point):
            raise TypeError(
                f"{name}: mp_policy.{field_name} must be a floating torch.dtype or None; got {d!r}"
            )

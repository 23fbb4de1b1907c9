"""What differs between the torch releases the library supports (2.11 through 2.15).

Every name whose spelling or presence depends on the torch release goes through this module,
so the rest of the library is written once against the newest spelling. Each entry says which
releases differ and how; the table of them all is in the guide
(``docs/guides/torch_releases.md``, "What differs between releases"). The CI's second lane
(``.ci/torch-lane``) runs the library on the oldest and the newest release of the range.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

__all__ = [
    "TORCH_RANGE",
    "TRACES_LIBRARY",
    "c10d_all_gather_single",
    "funcol_all_gather_single",
    "funcol_reduce_scatter_single",
    "placement_class",
    "torch_release",
    "traced_or_eager",
]

#: The releases the library is tested on: (oldest, newest), as ``major.minor``.
TORCH_RANGE = ((2, 11), (2, 15))


def torch_release() -> tuple[int, int]:
    """The running torch's ``(major, minor)`` (``2.13.0+cpu`` -> ``(2, 13)``)."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


#: Whether dynamo traces the library's reductions: from 2.13. Dynamo in 2.11 refuses a ``Spec``
#: (a frozen dataclass) as an ``assume_constant_result`` argument, guards on ``Flat`` with
#: "Unexpected type" (:func:`placement_class`) and fails to compare optree tree structures:
#: there the reductions run eagerly at a graph break (:func:`traced_or_eager`), with the same
#: results, and ``fullgraph=True`` is refused.
TRACES_LIBRARY = torch_release() >= (2, 13)


def traced_or_eager(fn: Any) -> Any:
    """``fn`` itself where dynamo traces it; else ``fn`` run eagerly at a graph break
    (``torch.compiler.disable``) inside a compiled function."""
    return fn if TRACES_LIBRARY else torch.compiler.disable(fn)


def placement_class(cls: type) -> type:
    """A ``Placement`` subclass of the library's, made one dynamo can guard on: before 2.13
    dynamo guards a placement by equality only for torch's own (``Shard``, ``Replicate``,
    ``Partial``) or for a class registered as a pytree constant (the library's have
    ``__eq__`` and ``__hash__``), and fails on any other ("Unexpected type"). ``Placement``
    itself is a C++ (pybind11) class in 2.11, whose ``__init__`` a subclass must call
    (``Flat`` calls it on every release); a Python class from 2.13."""
    if not TRACES_LIBRARY:
        import torch.utils._pytree as pytree

        pytree.register_constant(cls)
    return cls


def _first(module: Any, *names: str) -> Any:
    """The first of ``names`` that ``module`` has (the newest spelling is listed first)."""
    for name in names:
        fn = getattr(module, name, None)
        if fn is not None:
            return fn
    raise ImportError(
        f"torch {torch.__version__} has none of {module.__name__}.{{{', '.join(names)}}}; "
        f"functional_hsdp supports torch {'.'.join(map(str, TORCH_RANGE[0]))} to "
        f"{'.'.join(map(str, TORCH_RANGE[1]))}"
    )


#: ``(tensor, gather_dim, group) -> tensor``: the functional all-gather of one tensor
#: (``funcol.all_gather_single`` from 2.13; ``funcol.all_gather_tensor`` before, deprecated
#: from 2.13: it warns there).
funcol_all_gather_single = _first(funcol, "all_gather_single", "all_gather_tensor")

#: ``(tensor, reduce_op, scatter_dim, group) -> tensor``: the functional reduce-scatter
#: (``funcol.reduce_scatter_single`` from 2.13; ``funcol.reduce_scatter_tensor`` before).
funcol_reduce_scatter_single = _first(funcol, "reduce_scatter_single", "reduce_scatter_tensor")

#: ``(output, input, group=, async_op=)``: the c10d all-gather into one tensor
#: (``dist.all_gather_single`` from 2.13; ``dist.all_gather_into_tensor`` before, deprecated
#: from 2.13).
c10d_all_gather_single = _first(dist, "all_gather_single", "all_gather_into_tensor")

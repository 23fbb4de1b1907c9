"""How a MainGrad is saved and loaded mesh-independently: the bodies of its checkpoint protocol.

``MainGrad.__fh_state_dict__``, ``__fh_empty_state_dict__`` and ``__fh_load_state_dict__`` (the
protocol of :mod:`functional_hsdp.io.checkpoint`) are thin delegates to :func:`checkpoint_state`,
:func:`empty_checkpoint_state` and :func:`load_checkpoint`, which use only the MainGrad's public
surface. Invariant: a checkpoint holds final (or zeroed) gradients in the per-leaf form, never a
mid-accumulation partial sum; the error-feedback residual is per rank and loads on the same
mesh and spec only. State: none (the per-rank copy, ``local_state_dict``, is MainGrad's own).
"""

from __future__ import annotations

from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor, Shard

from ..base.tree import paths_of
from ..io.checkpoint import (
    ROLE,
    dtensor_mesh,
    forms,
    from_checkpoint,
    leaf_keys,
    loaded_chunks,
    placeholders,
    to_checkpoint,
)
from ..plan.recipe import Plan
from ..runtime.agreement import agreement
from ..spec.specs import resolve_specs

__all__ = ["checkpoint_state", "empty_checkpoint_state", "load_checkpoint"]


def _check_spec(mg: Any, spec: Any) -> None:
    """``spec``, if given, is the one ``mg`` was made with."""
    if spec is None:
        return
    specs, _ = resolve_specs(spec, mg.plan.treedef, "MainGrad's like tree")
    if specs != mg.plan.specs:
        raise ValueError(
            "spec: is not the spec this MainGrad was made with; pass that spec, or none"
        )


def checkpoint_state(mg: Any, spec: Any) -> dict[str, Any]:
    """MainGrad ``mg`` in a mesh-independent checkpoint (``fh.state_dict(mg)``): ``{"state":
    "final" | "empty", "grads": {key: DTensor}}`` (and ``"residual"``, per rank, with error
    feedback). Mid-accumulation it is refused, on every rank."""
    with agreement(mg.plan.specs, "state_dict") as agreed:
        _check_spec(mg, spec)
        dtensor_mesh(mg.mesh)
        grads = mg.grads
        if grads is not None and mg.state != "final":
            raise ValueError(_MID_ACCUMULATION.format(axes=_deferred_axes(mg.plan)))
        paths = paths_of(mg.plan.treedef, "grads")
        agreed.check(mg.plan, paths, options=(f"MainGrad {mg.state}",))
    residual = _residual_state(mg, mg.local_state_dict()["residuals"])
    if grads is None:  # zeroed: nothing to gather
        holders = placeholders(mg.plan)
        return {"state": "empty", "grads": {k: _zero(v) for k, v in holders.items()}, **residual}
    leaves = optree.tree_leaves(grads)
    keys = leaf_keys(mg.plan.treedef, paths)
    grads = dict(zip(keys, to_checkpoint(mg.plan, leaves)))
    return {"state": "final", "grads": grads, **residual}


def empty_checkpoint_state(mg: Any, spec: Any) -> dict[str, Any]:
    """Placeholders for ``dcp.load`` (``fh.empty_state_dict(mg)``): a final state."""
    _check_spec(mg, spec)
    residual = _residual_state(mg, mg.local_state_dict()["residuals"])
    return {"state": "final", "grads": placeholders(mg.plan), **residual}


def _residual_state(mg: Any, residuals: list | None) -> dict[str, Any]:
    """``{"residual": {bucket: DTensor}}`` for a MainGrad that feeds back a compressed
    reduction's error (else ``{}``): each rank's residual of a bucket as its block of one
    DTensor ``(*mesh shape, L)`` sharded over every mesh dim. It is per-rank state (each
    replica's own rounding loss, at the gradient placement), so it loads on the same mesh
    and layout only."""
    if residuals is None:
        return {}
    dm = dtensor_mesh(mg.mesh)
    place, ones = [Shard(d) for d in range(dm.ndim)], (1,) * dm.ndim
    return {
        "residual": {
            str(b): DTensor.from_local(r.reshape(*ones, -1), dm, place, run_check=False)
            for b, r in enumerate(residuals)
        }
    }


def _load_residual(state: dict, mg: Any, *, name: str) -> None:
    """Restore what :func:`_residual_state` saved into ``mg`` (nothing to do without one)."""
    mine = mg.local_state_dict()
    if mine["residuals"] is None:
        return
    saved = state.get("residual")
    if not isinstance(saved, dict) or len(saved) != len(mine["residuals"]):
        raise ValueError(
            f"{name}['residual']: this MainGrad feeds back a compressed reduction's error; the "
            "state has no residual of each of its buckets (saved by fh.state_dict of a "
            "MainGrad with the same spec, on the same mesh)"
        )
    local = [saved[str(b)].to_local().reshape(-1) for b in range(len(saved))]
    mg.load_local_state_dict({**mine, "residuals": local})


_MID_ACCUMULATION = (
    "MainGrad is mid-accumulation: its buffers are at the gradient placement (Partial over "
    "{axes}: each replica holds its own partial sum), which no mesh-independent checkpoint "
    "can hold. Save after the step's last microbatch (accumulate(..., last=True) or "
    "mg.finish()) or after mg.zero_grad(); to resume mid-accumulation on this same mesh, "
    "save mg.local_state_dict() per rank (torch.save; bit-exact) and restore it with "
    "mg.load_local_state_dict()"
)


def _deferred_axes(plan: Plan) -> tuple[str, ...]:
    axes = {a for spec in plan.specs for a in spec.deferred_axes}
    return tuple(a for a in plan.mesh.axis_names if a in axes) or "no axis"


def _zero(x: DTensor) -> DTensor:
    x.to_local().zero_()
    return x


def load_checkpoint(state: dict, spec: Any, mg: Any, *, name: str) -> Any:
    """Load what :func:`checkpoint_state` saved into MainGrad ``mg``, on any mesh: its final
    gradients (or zeroed), and return ``mg``. ``name``: the state's name in errors."""
    saved = state.get("state")
    if saved not in ("final", "empty"):
        raise ValueError(
            f"{name}['state']: expected 'final' or 'empty' (a MainGrad saved by "
            f"fh.state_dict); got {saved!r}"
        )
    if saved == "empty":
        _check_spec(mg, spec)
        mg.zero_grad(set_to_none=True)
        _load_residual(state, mg, name=name)
        return mg
    plan = mg.plan
    with agreement(mg.plan.specs, "load_state_dict") as agreed:
        _check_spec(mg, spec)
        shapes = forms(plan)
        local = loaded_chunks(state.get("grads", {}), plan, shapes, name=f"{name}['grads']")
        agreed.check(plan, paths_of(plan.treedef, "grads"), options=("MainGrad",))
    pieces = from_checkpoint(plan, local, shapes)
    # packed in place, but for a bucket whose memory was given back (persistent=False, zeroed):
    # that one into a buffer of its own, which load_local_state_dict copies after taking back
    # the memory
    buffers = [
        torch.zeros_like(buf) if buf.untyped_storage().nbytes() == 0 else buf for buf in mg.buffers
    ]
    for b, buf in enumerate(buffers):
        packed = plan.pack(b, pieces, ROLE)
        buf[..., : packed.shape[-1]].copy_(packed)
    n = len(plan.buckets)
    mg.load_local_state_dict(
        {
            "layout": mg.buffer_signature(),  # the key saved states have
            "state": "final",
            "fresh": [False] * n,
            "empty": False,
            "buffers": buffers,
            "residuals": mg.local_state_dict()["residuals"],
        }
    )
    _load_residual(state, mg, name=name)
    return mg

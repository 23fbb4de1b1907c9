"""functional_hsdp: data-parallel gradient synchronization as pure functions over pytrees.

HSDP with deferred DP-outer reduction (Megatron-LM PR 5743) for ``torch.func`` training loops:
``reduce_grads(grads, spec, last=...)`` reduce-scatters over the inner axis every microbatch and
reduces the outer axis only on the last one.

This module is the public surface, ``fh.X``: every name is re-exported from a layer package
(the layers, bottom up: :mod:`functional_hsdp.layers`).
"""

import sys as _sys

from .base.cache import clear_caches
from .base.errors import CollectiveError
from .base.trace import CommLog, Event, comm_log
from .base.tree import MaskedNode, masked_node
from .diloco.outer import DiLoCo, diloco
from .diloco.schedule import balanced_fragments, sync_steps
from .diloco.state import DiLoCoState
from .io.checkpoint import empty_state_dict, load_state_dict, state_dict
from .mesh import DistMesh, Mesh, SimMesh, fault_tolerant, per_rank, simulated_quorum
from .optim import schedules
from .optim.adam import ScaleByAdamState, adamw, scale_by_adam
from .optim.clipping import clip_by_global_norm, clip_global_norm, global_norm
from .optim.combine import ChainState, PartitionState, chain, partition
from .optim.matrix import per_matrix
from .optim.muon import MuonState, muon, newton_schulz
from .optim.noise import AddGaussianNoiseState, add_gaussian_noise, gaussian_noise
from .optim.scaling import (
    ScaleByLearningRateState,
    add_decayed_weights,
    scale,
    scale_by_learning_rate,
)
from .optim.sgd import SGDState, sgd
from .optim.transformation import EmptyState, GradientTransformation, apply_updates
from .plan.owner import owned
from .runtime.compressed import compressed_all_reduce
from .runtime.validate import validation
from .spec.placement import Flat, Owner, Partial, Placement, Replicate, Shard
from .spec.quantize import Compress, compress
from .spec.specs import Spec, ddp, fsdp, hfsdp, hsdp, replicas
from .sync.autodiff import per_example_grad_norms
from .sync.collectives import all_gather, pmean, psum, psum_scatter
from .sync.dtensor import to_dtensor
from .sync.first_order import grad, grad_and_value
from .sync.ghost import ghost_clipped_grad, ghost_grad_norms
from .sync.maingrad import MainGrad, microbatches
from .sync.reduce import gather, reduce_grads, shard, sync_params
from .units import Gathered, gathered, sequence
from .units.module import functional_call, shard_module

__all__ = [
    "AddGaussianNoiseState",
    "ChainState",
    "CollectiveError",
    "CommLog",
    "Compress",
    "DistMesh",
    "EmptyState",
    "Event",
    "DiLoCo",
    "DiLoCoState",
    "Flat",
    "Gathered",
    "GradientTransformation",
    "MainGrad",
    "MaskedNode",
    "Mesh",
    "MuonState",
    "Owner",
    "Partial",
    "PartitionState",
    "Placement",
    "Replicate",
    "SGDState",
    "ScaleByAdamState",
    "ScaleByLearningRateState",
    "Shard",
    "SimMesh",
    "Spec",
    "adamw",
    "add_decayed_weights",
    "add_gaussian_noise",
    "all_gather",
    "apply_updates",
    "chain",
    "clear_caches",
    "clip_by_global_norm",
    "clip_global_norm",
    "comm_log",
    "compress",
    "compressed_all_reduce",
    "ddp",
    "balanced_fragments",
    "diloco",
    "empty_state_dict",
    "fault_tolerant",
    "fsdp",
    "functional_call",
    "gather",
    "gaussian_noise",
    "gathered",
    "ghost_clipped_grad",
    "ghost_grad_norms",
    "global_norm",
    "grad",
    "grad_and_value",
    "hfsdp",
    "hsdp",
    "load_state_dict",
    "masked_node",
    "microbatches",
    "muon",
    "newton_schulz",
    "owned",
    "partition",
    "per_example_grad_norms",
    "per_matrix",
    "per_rank",
    "pmean",
    "psum",
    "psum_scatter",
    "reduce_grads",
    "replicas",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "schedules",
    "sequence",
    "sgd",
    "shard",
    "shard_module",
    "simulated_quorum",
    "state_dict",
    "sync_params",
    "sync_steps",
    "to_dtensor",
    "validation",
]

__version__ = "0.1.0"

# Old spellings, kept working: each warns, naming its new name (DESIGN.md, "Names").
_DEPRECATED = {
    "AdamWState": ("ScaleByAdamState", ScaleByAdamState),
    "Masked": ("MaskedNode", MaskedNode),
    "masked": ("masked_node", masked_node),
}


# ``fh.schedules`` is a public submodule: ``import functional_hsdp.schedules`` and ``from
# functional_hsdp.schedules import ...`` keep working where it lives now, in the optim layer
_sys.modules[f"{__name__}.schedules"] = schedules


def __getattr__(name: str):
    if name in _DEPRECATED:
        import warnings

        new, value = _DEPRECATED[name]
        warnings.warn(
            f"fh.{name} is deprecated: use fh.{new} (the same object)",
            DeprecationWarning,
            stacklevel=2,
        )
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

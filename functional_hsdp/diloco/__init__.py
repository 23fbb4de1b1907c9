"""The diloco layer: DiLoCo and Streaming DiLoCo, the outer loop over a replica axis.

Its rooms, bottom up: ``schedule`` (which leaves form each fragment, after which steps each
syncs: :func:`~functional_hsdp.sync_steps`, :func:`~functional_hsdp.balanced_fragments`),
``syncs`` (a fragment's sync in flight, :class:`SyncInFlight`), ``state``
(:class:`~functional_hsdp.DiLoCoState`, its checks and checkpoint views), ``cut`` (per params
tree: each leaf's fragment, the plan, the packings) and ``outer`` (:func:`~functional_hsdp.diloco`:
the outer step, issuing and landing the syncs).
"""

from .outer import DiLoCo, diloco
from .schedule import balanced_fragments, sync_steps
from .state import DiLoCoState, pending_tree, residual_tree
from .syncs import SyncInFlight

__all__ = [
    "DiLoCo",
    "DiLoCoState",
    "SyncInFlight",
    "balanced_fragments",
    "diloco",
    "pending_tree",
    "residual_tree",
    "sync_steps",
]

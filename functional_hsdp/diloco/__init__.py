"""The diloco layer: DiLoCo and Streaming DiLoCo, the outer loop over a replica axis.

``outer``: :func:`~functional_hsdp.diloco` and its state, the fragment schedule, the syncs in
flight and the outer step.
"""

from .outer import SyncInFlight, pending_tree, residual_tree

__all__ = ["SyncInFlight", "pending_tree", "residual_tree"]

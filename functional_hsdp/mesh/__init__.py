"""Meshes: the protocol library code is written against, and its two implementations.

- :class:`SimMesh` (``sim.py``) simulates every rank in one process; :func:`per_rank` runs
  a per-rank function on its values (``vmap`` over the mesh dims; ``fn`` itself on a
  DistMesh).
- :class:`DistMesh` (``dist.py``) wraps a real ``torch.distributed`` ``DeviceMesh``.
- ``replicas.py``: a fault-tolerant replica axis: :func:`fault_tolerant` (torchft) and the
  mesh over it, and :func:`simulated_quorum` for a SimMesh.
- ``protocol.py``: :class:`Mesh` (thirteen members), its :class:`Geometry` and
  :class:`Diagnostics` companions, and :class:`Flight`, a collective in flight.
"""

from .dist import DistMesh
from .protocol import Diagnostics, Flight, Geometry, Mesh
from .replicas import FaultTolerant, SimQuorum, fault_tolerant, simulated_quorum
from .sim import SimMesh, per_rank

__all__ = [
    "Diagnostics",
    "DistMesh",
    "FaultTolerant",
    "Flight",
    "Geometry",
    "Mesh",
    "SimMesh",
    "SimQuorum",
    "fault_tolerant",
    "per_rank",
    "simulated_quorum",
]

"""Meshes: the protocol library code is written against, and its two implementations.

- :class:`SimMesh` (``sim.py``) simulates every rank in one process; :func:`per_rank` runs
  a per-rank function on its values (``vmap`` over the mesh dims; ``fn`` itself on a
  DistMesh).
- :class:`DistMesh` (``dist.py``) wraps a real ``torch.distributed`` ``DeviceMesh``.
- ``protocol.py``: :class:`Mesh` (thirteen members), its :class:`Geometry` and
  :class:`Diagnostics` companions, and :class:`Flight`, a collective in flight.
"""

from .dist import DistMesh
from .protocol import Diagnostics, Flight, Geometry, Mesh
from .sim import SimMesh, per_rank

__all__ = ["Diagnostics", "DistMesh", "Flight", "Geometry", "Mesh", "SimMesh", "per_rank"]

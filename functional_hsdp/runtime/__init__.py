"""The runtime layer: a plan's programs run on a mesh.

``scheduler`` (the one bucket scheduler), ``engine`` (pack, run, wait, unpack; reductions in
flight), ``compressed`` (the compressed reduction's moves); the per-call cross-rank agreement:
``validate`` (the mode, ``validation()``), ``agreement`` (one call's agreement),
``fingerprints`` (what a call says of itself), ``span`` (the mesh it agrees over),
``unit_calls`` (the gathered units' record) and ``messages`` (the texts all ranks raise).
"""

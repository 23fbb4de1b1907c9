"""The runtime layer: a plan's programs run on a mesh.

``scheduler`` (the one bucket scheduler), ``engine`` (pack, run, wait, unpack; reductions in
flight), ``compressed`` (the compressed reduction's moves) and ``validate`` (the per-call
cross-rank agreement).
"""

"""The base layer: what every other layer uses and that uses none of them.

``tree`` (flattening with paths, errors naming the pytree path), ``tags`` (a result's state),
``errors``, ``cache`` (every cache bounded and registered), ``trace`` (``comm_log``) and
``torch_releases`` (what differs between the supported torch releases, in one place).
"""

"""Benchmarks of the units layer: layer-wise units (``layerwise``, ``deferred``), existing
modules (``module``, ``unit_checks``) and DP-SGD through them (``dpsgd``)."""

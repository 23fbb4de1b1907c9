"""The spec layer: where values rest, and how they travel.

``placement`` (the placements and the collective behind each transition), ``specs`` (``Spec``,
its presets, spec prefix trees, the replica axis), ``quantize`` (the compression policy and
its codec) and ``precision`` (FSDP2's ``MixedPrecisionPolicy`` read into dtypes).
"""

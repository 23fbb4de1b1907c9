"""Benchmarks of the plan layer: bytes on the wire per preset (``wire``) and what aligned leaf
offsets cost in padding (``alignment``)."""

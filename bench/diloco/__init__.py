"""Benchmarks of the diloco layer: DiLoCo and Streaming DiLoCo against HSDP (``diloco``) and a
delayed sync's overlap (``diloco_overlap``)."""

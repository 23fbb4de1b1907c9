"""Benchmarks of the runtime layer: host overhead (``overhead``, ``host``), asynchronous buckets
(``overlap``), the cross-rank agreement (``agreement``) and compressed outer reductions
(``compress``)."""

"""The tools layer: the demo and ``testing/``, above the library, which never imports it.

The demo is ``python -m functional_hsdp demo``; ``testing/`` is what the tests and benchmarks
run on.
"""

"""The tools layer: the demo (``python -m functional_hsdp demo``) and ``testing/``, what the
tests and benchmarks run on. The library never imports it.
"""

"""Benchmarks of the mesh layer: gloo's reduce-scatter implementations (``rsimpl``), and
two scripts that are not registered benchmarks: the cost of starting gloo ranks (``startup``)
and the gloo all-gather reproduction (``gloo_allgather``)."""

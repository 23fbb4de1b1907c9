"""The sync layer: the public reductions over a whole tree.

``reduce`` (``reduce_grads``, ``shard``, ``gather``), ``collectives`` (``psum``, ``pmean``,
``psum_scatter``, ``all_gather``), ``maingrad`` (persistent gradient buffers and the deferred
outer reduction), ``autodiff`` (the collectives as differentiable moves), ``first_order``
(``grad``), ``dtensor`` (``to_dtensor``).
"""

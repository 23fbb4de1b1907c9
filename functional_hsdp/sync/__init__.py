"""The sync layer: the public reductions over a whole tree.

``reduce`` (``reduce_grads``, ``shard``, ``gather``), ``collectives`` (``psum``, ``pmean``,
``psum_scatter``, ``all_gather``), ``maingrad`` (persistent gradient buffers) and its rooms
``deferred`` (the deferred outer reduction), ``unit_sink`` (what gathered units may do to a
MainGrad), ``maingrad_state`` (how a MainGrad is saved and loaded), ``autodiff`` (the
collectives as differentiable moves), ``ghost`` (per-example gradient norms from activations and
output gradients), ``first_order`` (``grad``), ``dtensor`` (``to_dtensor``).
"""

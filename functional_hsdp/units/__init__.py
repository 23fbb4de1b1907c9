"""Layer-wise HSDP: units all-gathered inside the loss, gradients reduce-scattered in backward.

``gathered(fn, spec)(unit_shards, *args) == fn(gather(unit_shards, spec), *args)``,
differentiable under ``torch.func`` and plain autograd: the gradient with respect to
``unit_shards`` is the unit's gradient *at the gradient placement* (JAX's rule: the transpose
of an all-gather is a reduce-scatter). FSDP2's memory, in a ``torch.func`` loop.

Rooms: ``block`` (the call, and which path it takes: ``functions``, first order, or
``composable``: ``vmap``, forward mode, a second derivative), ``call`` (the call record's
phases), ``transfers`` (its collectives in flight), ``storage`` (the gathered weights between
forward and backward), ``replay`` (RNG and autocast for a recompute), ``chain`` (what one
forward pass's calls share), ``registry`` (the only per-thread state), ``checks`` (the unit's
plan, place and description) and ``module`` (``shard_module``, ``functional_call``).
"""

from .block import Gathered, gathered, sequence

__all__ = ["Gathered", "gathered", "sequence"]

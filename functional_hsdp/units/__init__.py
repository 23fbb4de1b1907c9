"""Layer-wise HSDP: a unit's weights all-gathered inside the loss, its gradient reduce-scattered
during backward (FSDP2's memory, in a ``torch.func`` loop).

``gathered(fn, spec)(unit_shards, *args) == fn(gather(unit_shards, spec), *args)``, and it is
differentiable under ``torch.func.grad``/``vjp``/``grad_and_value`` and plain autograd: the
gradient with respect to ``unit_shards`` is the unit's gradient *at the gradient placement*
(reduce-scattered over the non-deferred axes; the deferred axes stay Partial). JAX's rule is
the picture: the transpose of an all-gather is a reduce-scatter.

A unit's forward all-gathers it, runs ``fn`` and keeps (or, released, gathers again in
backward) what backward needs; backward issues the reduce-scatter of the weight gradient
asynchronously, and a wait node applied just before the unit, the one consumer of that
pending gradient, waits for it and hands it on (or adds it into a ``MainGrad``). Under
``vmap``, forward mode or a second derivative a unit takes the composable path instead.

The rooms, one concern each:

- ``block.py``: :func:`gathered`, :class:`Gathered`, :func:`sequence`: the call, and which
  path it takes.
- ``call.py``: the call record and its phases (an explicit state machine).
- ``functions.py``: the first-order path, the ``_Unit`` and ``_Wait`` autograd Functions.
- ``composable.py``: the composable path (differentiable moves of
  :mod:`functional_hsdp.sync.autodiff`).
- ``collectives.py``: the unit's all-gather and reduce-scatter, each in flight a typed record.
- ``storage.py``: the gathered weights' storage between forward and backward (release,
  refill, hold).
- ``replay.py``: the RNG and autocast state a recomputed unit runs in.
- ``chain.py``: what the calls of one forward pass share until its backward ends.
- ``registry.py``: what a thread's forward passes keep between unit calls (the package's
  only per-thread state; backward never reads it).
- ``checks.py``: the unit's plan, its place and description, the ``MainGrad`` buckets it adds
  into.
"""

from .block import Gathered, gathered, sequence

__all__ = ["Gathered", "gathered", "sequence"]

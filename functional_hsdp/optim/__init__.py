"""The optim layer: optax's building blocks on sharded trees, in rooms by concern as optax's.

``transformation`` (``GradientTransformation``, ``EmptyState``, ``apply_updates``),
``combine`` (``chain``, ``partition``), ``clipping`` (``global_norm``, ``clip_by_global_norm``,
``clip_global_norm``: the one room that communicates), ``scaling`` (``scale``,
``scale_by_learning_rate``, ``add_decayed_weights``), ``adam`` (``scale_by_adam``, ``adamw``),
``sgd``, ``schedules`` (optax's learning-rate schedules), ``noise`` (``add_gaussian_noise``:
DP-SGD's noise, each rank drawing its own shard's), ``matrix`` (``per_matrix``: whole
leaves at their owners) and ``muon`` (``newton_schulz``, ``muon``). Users reach them as ``fh.X``.

Invariant: everything works on local shards at a spec's optimizer placement, and everything but
the norm is elementwise, so ``torch.optim`` can update the shards too (see
:func:`~functional_hsdp.adamw`'s example); only the norm needs the library
(``torch.nn.utils.clip_grad_norm_`` on shards would see one rank's part).
"""

"""The optim layer: optax's building blocks on sharded trees, in rooms by concern as optax's.

``transformation`` (``GradientTransformation``, ``EmptyState``, ``apply_updates``),
``combine`` (``chain``, ``partition``), ``clipping`` (``global_norm``, ``clip_by_global_norm``,
``clip_global_norm``: the one room that communicates), ``scaling`` (``scale``,
``scale_by_learning_rate``, ``add_decayed_weights``), ``adam`` (``scale_by_adam``, ``adamw``),
``sgd``, ``schedules`` (optax's learning-rate schedules), ``matrix`` (``per_matrix``: whole
leaves at their owners) and ``muon`` (``newton_schulz``, ``muon``). Users reach them as ``fh.X``.

Everything works on local shards at a spec's optimizer placement, and everything but the norm
is elementwise, so ``torch.optim`` can update the shards too; only the norm needs the library
(``torch.nn.utils.clip_grad_norm_`` on shards would see one rank's part):

Example:
    >>> import optree, torch, functional_hsdp as fh
    >>> mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    >>> spec = fh.hfsdp(mesh, "dp_outer", "dp_inner")
    >>> params = fh.shard({"w": torch.linspace(-1, 1, 6), "b": torch.ones(3)}, spec)
    >>> g = {"w": torch.randn(2, 2, 6), "b": torch.randn(2, 2, 3)}     # 4 ranks' gradients
    >>> grads, norm = fh.clip_by_global_norm(fh.reduce_grads(g, spec, last=True), spec, 0.5)
    >>> opt = fh.adamw(lr=0.1)
    >>> updates, state = opt.update(grads, opt.init(params), params)
    >>> new = fh.apply_updates(params, updates)
    >>> local = [p.clone().requires_grad_() for p in optree.tree_leaves(params)]
    >>> torch_opt = torch.optim.AdamW(local, lr=0.1)                  # the same, by torch.optim
    >>> for p, g in zip(local, optree.tree_leaves(grads)):
    ...     p.grad = g
    >>> torch_opt.step()
    >>> all(torch.allclose(p, q) for p, q in zip(local, optree.tree_leaves(new)))
    True
"""

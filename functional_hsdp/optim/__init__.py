"""The optim layer: optax's building blocks, placement-aware where a global quantity is needed.

``transforms`` (``GradientTransformation``, the combinators, ``sgd``, ``adamw``, global
norms), ``schedules`` (optax's learning-rate schedules) and ``matrix`` (``per_matrix``,
Newton-Schulz, Muon, ``partition``).
"""

"""Every torch.func transform through layer-wise units: the problems and their dense
references, shared by the SimMesh tests (tests/units/test_transforms.py) and the gloo tests
(tests/units/test_transforms_gloo.py).

The model: ``LAYERS`` gathered units ``h = tanh(h @ w + b)``, each a unit of the spec tree;
the loss of a rank is ``sum(h ** 2)`` of its own data. In the library's convention a rank's
loss stands for the mean over the data-parallel ranks, so every reference is that of the
mean over ranks: ``F(w) = mean_r L(w, x_r)`` (per-sample: per sample, the mean over ranks).
Gradients come back at the gradient placement and are finished (deferred axes reduced,
gathered) before they are compared.
"""

from __future__ import annotations

import optree
import torch
from torch.func import grad, jvp, vjp, vmap

import functional_hsdp as fh

D, T, LAYERS, LR = 4, 3, 2, 0.3


def full_weights(seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [
        {"w": torch.randn(D, D, generator=gen) / 2, "b": torch.randn(D, generator=gen) / 2}
        for _ in range(LAYERS)
    ]


def layer(p: dict, h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h @ p["w"] + p["b"])


def dense_loss(weights: list[dict], x: torch.Tensor) -> torch.Tensor:
    h = x
    for p in weights:
        h = layer(p, h)
    return h.square().sum()


class Problem:
    """The units on ``spec``'s mesh: shards at the parameter placement, a loss of them."""

    def __init__(self, spec: fh.Spec, seed: int = 0):
        self.spec, self.mesh = spec, spec.mesh
        self.tree_spec = [spec] * LAYERS
        self.full = full_weights(seed)
        self.params = fh.sync_params(fh.shard(self.full, self.tree_spec), self.tree_spec)
        self.block = fh.gathered(fh.per_rank(layer, self.mesh), spec)

    def out(self, params: list, x: torch.Tensor) -> torch.Tensor:
        return fh.sequence(self.block, params, x)

    def loss(self, params: list, x: torch.Tensor) -> torch.Tensor:
        return self.out(params, x).square().sum()

    def consistent(self, seed: int) -> list:
        """A random tree at the parameter placement, the same on replicas (a tangent)."""
        gen = torch.Generator().manual_seed(seed)
        rand = [
            optree.tree_map(lambda t: torch.randn(t.shape, generator=gen), u) for u in self.full
        ]
        return fh.sync_params(fh.shard(rand, self.tree_spec), self.tree_spec), rand

    def finish(self, g: list) -> list:
        """A gradient-placement tree -> the full mean gradient (deferred axes reduced)."""
        final = fh.reduce_grads(g, self.tree_spec, last=True, at="gradient")
        return fh.gather(final, self.tree_spec)

    def finish_differentiably(self, g: list) -> list:
        """The deferred axes of a gradient-placement tree reduced inside a transform (pmean)."""
        for axis in self.spec.deferred_axes:
            g = fh.pmean(g, axis, self.mesh)
        return g

    # -- the transforms ----------------------------------------------------------------------

    def per_sample(self, xs: torch.Tensor, chunk_size: int | None = None) -> list:
        return vmap(grad(self.loss), in_dims=(None, 0), chunk_size=chunk_size)(self.params, xs)

    def jvp(self, x: torch.Tensor, tangent: list) -> tuple:
        return jvp(lambda s: self.out(s, x), (self.params,), (tangent,))

    def hvp_reverse_reverse(self, x: torch.Tensor, v: list) -> list:
        _, pullback = vjp(grad(lambda s: self.loss(s, x)), self.params)
        return pullback(v)[0]

    def hvp_forward_reverse(self, x: torch.Tensor, v: list) -> list:
        return jvp(grad(lambda s: self.loss(s, x)), (self.params,), (v,))[1]

    def maml(self, x_in: torch.Tensor, x_out: torch.Tensor) -> list:
        def outer(s):
            g = self.finish_differentiably(grad(lambda s: self.loss(s, x_in))(s))
            adapted = optree.tree_map(lambda p, d: p - LR * d, s, g)
            return self.loss(adapted, x_out)

        return grad(outer)(self.params)


# -- dense references (every rank's data in one process) -------------------------------------


def ranks(x: torch.Tensor, batch: tuple[int, ...]) -> torch.Tensor:
    """``x`` with the mesh dims flattened into one rank dim."""
    return x.reshape(-1, *x.shape[len(batch) :])


def mean_grad(weights, xs: torch.Tensor):
    """The gradient of the mean over ranks (xs: one row per rank)."""
    return grad(lambda w: torch.stack([dense_loss(w, x) for x in xs]).mean())(weights)


def dense_per_sample(weights, xs: torch.Tensor) -> list:
    """Per sample (xs: (B, ranks, ...)), the gradient of the mean over ranks."""
    return [mean_grad(weights, x) for x in xs]


def dense_hvp(weights, xs: torch.Tensor, v) -> list:
    return jvp(lambda w: mean_grad(w, xs), (weights,), (v,))[1]


def dense_maml(weights, x_in: torch.Tensor, x_out: torch.Tensor) -> list:
    def outer(w):
        g = mean_grad(w, x_in)
        adapted = optree.tree_map(lambda p, d: p - LR * d, w, g)
        return torch.stack([dense_loss(adapted, x) for x in x_out]).mean()

    return grad(outer)(weights)


def dense_jvp(weights, x: torch.Tensor, tangent) -> torch.Tensor:
    """One rank's output tangent."""
    return jvp(lambda w: _out(w, x), (weights,), (tangent,))[1]


def _out(weights, x):
    h = x
    for p in weights:
        h = layer(p, h)
    return h


def rel(got, want) -> float:
    """The largest relative error over the leaves (max |got - want| / max |want|)."""
    return max(
        ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()
        for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want), strict=True)
    )

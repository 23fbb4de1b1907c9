# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 05 · DP-SGD in the layer-wise loop
#
# DP-SGD clips **each example's** gradient to norm `C`, sums them, adds Gaussian noise of
# scale `σ·C`, and divides by the global batch. With FSDP-style sharding a rank never holds a
# whole per-example gradient for long: each unit's gradient is reduce-scattered in backward,
# and that reduce-scatter **mixes ranks' examples**. So the clipping has to be decided before
# it. The two passes (Opacus's ghost clipping, here through the library):
#
# 1. `fh.per_example_grad_norms(loss_fn, shards, examples)`: under `vmap(grad(...))`, each
#    unit's backward takes the squared norm of every example's full gradient *before* the
#    reduce-scatter, and reduce-scatters nothing;
# 2. an ordinary first-order `grad` of `Σ_b min(1, C/‖g_b‖) · loss_b` on the batch — the
#    layer-wise path, at FSDP memory — gives the mean over ranks of the clipped sums.
#
# It is checked against the whole-tree loop (DDP memory: full per-example gradients, clipped,
# then `reduce_grads`) and a dense single-process DP-SGD on every rank's examples.

# %%
import matplotlib.pyplot as plt
import optree
import torch
from torch.func import grad, vmap

import functional_hsdp as fh

torch.manual_seed(0)
mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
RANKS, D, L, B = 4, 8, 3, 6  # ranks, width, units, examples per rank
C, SIGMA, LR, STEPS = 0.5, 0.8, 0.2, 6


def layer(p, h):
    return torch.tanh(h @ p["w"] + p["b"])


def dense_out(weights, x):
    for p in weights:
        x = layer(p, x)
    return x


def example_loss(weights, x, y):  # one example, dense
    return (dense_out(weights, x) - y).square().sum()


full0 = [{"w": torch.randn(D, D) / D**0.5, "b": torch.zeros(D)} for _ in range(L)]
teacher = torch.randn(D, D) / D**0.5
gen = torch.Generator().manual_seed(1)
data = []  # per step: x, y of shape (RANKS, B, D), rank-major over the 2x2 mesh
for _ in range(STEPS):
    x = torch.randn(RANKS, B, D, generator=gen)
    data.append((x, torch.tanh(x @ teacher)))
noise = [  # the noise of each step: drawn once, the same for every method
    [optree.tree_map(lambda t: torch.randn(t.shape, generator=gen), u) for u in full0]
    for _ in range(STEPS)
]

# %% [markdown]
# ## Dense DP-SGD (one process, every rank's examples)


# %%
def dense_step(weights, x, y, z):
    total = optree.tree_map(torch.zeros_like, weights)
    for xr, yr in zip(x, y):
        for xb, yb in zip(xr, yr):
            g = grad(example_loss)(weights, xb, yb)
            norm = torch.cat([t.flatten() for t in optree.tree_leaves(g)]).norm()
            c = min(1.0, C / norm.item())
            total = optree.tree_map(lambda a, t, c=c: a + t * c, total, g)
    n = RANKS * B
    return optree.tree_map(lambda w, g, e: w - LR * (g + SIGMA * C * e) / n, weights, total, z)


dense = full0
for (x, y), z in zip(data, noise):
    dense = dense_step(dense, x, y, z)

# %% [markdown]
# ## The layer-wise loop: two passes, FSDP memory in the second

# %%
tree_spec = [spec] * L
params = fh.shard(full0, tree_spec)
block = fh.gathered(fh.per_rank(layer, mesh), spec)


def per_rank(t):  # (RANKS, ...) -> (2, 2, ...): rank r's rows at its mesh coordinate
    return t.reshape(2, 2, *t.shape[1:])


def per_example_losses(s, x, y):  # x: (2, 2, batch, D) -> (2, 2, batch)
    return (fh.sequence(block, s, x) - y).square().sum(-1)


def one_example(s, xy):  # one example on each rank: x, y of (2, 2, D)
    x, y = xy
    return per_example_losses(s, x[..., None, :], y[..., None, :]).sum()


losses_lw = []
for (x, y), z in zip(data, noise):
    x, y = per_rank(x), per_rank(y)  # (2, 2, B, D)
    examples = (x.movedim(2, 0), y.movedim(2, 0))  # (B, 2, 2, D): the examples along dim 0
    norms = fh.per_example_grad_norms(one_example, params, examples)  # (B, 2, 2)
    scale = (C / norms).clamp(max=1.0).movedim(0, -1)  # (2, 2, B)
    g = grad(lambda s, x=x, y=y, scale=scale: (per_example_losses(s, x, y) * scale).sum())(params)
    final = fh.reduce_grads(g, tree_spec, last=True, at="gradient")  # mean over ranks
    noise_shards = fh.shard(z, tree_spec)  # the same noise, this rank's shard of it
    params = optree.tree_map(
        lambda w, g, e: w - LR * (RANKS * g + SIGMA * C * e) / (RANKS * B),
        params,
        final,
        noise_shards,
    )
    losses_lw.append(per_example_losses(params, x, y).mean().item())


def error(got, want):  # the largest relative error, rank (0, 0)'s copy against dense
    return max(
        ((a[0, 0] - b).abs().max() / b.abs().max()).item()
        for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want))
    )


lw = fh.gather(params, tree_spec)
print("layer-wise vs dense:", error(lw, dense))
assert error(lw, dense) < 1e-5

# %% [markdown]
# `RANKS * g`: the library's gradient is the *mean* over ranks (its convention), DP-SGD wants
# the sum of every clipped example's gradient over the global batch of `RANKS * B`.
#
# ## The whole-tree loop (DDP memory)

# %%
whole = fh.shard(full0, tree_spec)
for (x, y), z in zip(data, noise):
    x, y = per_rank(x), per_rank(y)
    weights = fh.gather(whole, tree_spec)  # every unit's full weights, on every rank

    def clipped_sum(w, xr, yr):  # one rank: its examples' clipped per-example gradients
        g = vmap(grad(example_loss), in_dims=(None, 0, 0))(w, xr, yr)
        norms = torch.cat([t.flatten(1) for t in optree.tree_leaves(g)], 1).norm(dim=1)
        scale = (C / norms).clamp(max=1.0)
        return optree.tree_map(lambda t: (t * scale.view(-1, *[1] * (t.dim() - 1))).sum(0), g)

    per_rank_sums = fh.per_rank(clipped_sum, mesh)(weights, x, y)
    final = fh.reduce_grads(per_rank_sums, tree_spec, last=True)
    noise_shards = fh.shard(z, tree_spec)
    whole = optree.tree_map(
        lambda w, g, e: w - LR * (RANKS * g + SIGMA * C * e) / (RANKS * B),
        whole,
        final,
        noise_shards,
    )

wt = fh.gather(whole, tree_spec)
print("whole-tree vs dense:", error(wt, dense))
assert error(wt, dense) < 1e-5

# %% [markdown]
# All three agree to float32 rounding. What differs is memory: the whole-tree loop holds every
# unit's full weights and every example's full gradient at once; the layer-wise second pass
# holds one unit's gathered weights at a time and reduce-scatters each unit's gradient in
# backward. The first pass (norms) runs on the composable path: each unit's gathered weights
# stay until its backward, and one unit's per-example gradients exist at a time (`chunk_size`
# examples of them).

# %%
plt.plot(losses_lw, marker="o")
plt.xlabel("step")
plt.ylabel("mean loss after the step (rank-mean)")
plt.title("DP-SGD, layer-wise")
plt.show()

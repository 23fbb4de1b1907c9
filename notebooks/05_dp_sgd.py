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
# it, in two passes (Opacus's ghost clipping, here through the library):
#
# 1. each example's gradient norm, one of two ways:
#    - `fh.ghost_grad_norms(losses_fn, shards, *batch)`: one first-order backward in which
#      each layer that uses a unit's weights adds its per-example squared norms from its
#      input activations and output gradient (a linear layer's per-example gradient is an
#      outer product: `‖g_b aᵀ_b‖² = ‖g_b‖²‖a_b‖²`); no per-example gradient is formed;
#    - `fh.per_example_grad_norms(loss_fn, shards, examples)`: under `vmap(grad(...))`, each
#      unit's backward takes the squared norm of every example's full gradient *before* the
#      reduce-scatter (any layer, at the cost of one unit's per-example gradients at a time);
# 2. an ordinary first-order `grad` of `Σ_b min(1, C/‖g_b‖) · loss_b` on the batch — the
#    layer-wise path, at FSDP memory — gives the mean over ranks of the clipped sums;
# 3. the noise, once per step on the reduced gradient at the optimizer placement:
#    `fh.add_gaussian_noise(spec, stddev, seed=...)`, each rank drawing only its own shard's
#    piece of one dense noise tree per (seed, step).
#
# It is checked against the whole-tree loop (DDP memory: full per-example gradients, clipped,
# then `reduce_grads`) and a dense single-process DP-SGD on every rank's examples.

# %%
import time

import matplotlib.pyplot as plt
import optree
import torch
from torch.func import grad, vmap

import functional_hsdp as fh

torch.manual_seed(0)
mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
RANKS, D, L, B = 4, 8, 3, 6  # ranks, width, units, examples per rank
C, SIGMA, LR, STEPS, SEED = 0.5, 0.8, 0.2, 6, 1234
STD = SIGMA * C / (RANKS * B)  # the noise on the mean over the global batch


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

# %% [markdown]
# ## Dense DP-SGD (one process, every rank's examples)
#
# Its noise is the dense noise tree itself: `fh.gaussian_noise` on a mesh of one rank, which
# holds every element. The sharded runs below draw only their shards' pieces of it.

# %%
one_rank = [fh.ddp(fh.SimMesh({"dp": 1}))] * L


def dense_noise(step):
    zeros = [optree.tree_map(lambda t: torch.zeros(1, *t.shape), u) for u in full0]
    z = fh.gaussian_noise(zeros, one_rank, seed=SEED, step=step)
    return optree.tree_map(lambda t: t[0], z)


def dense_step(weights, x, y, z):
    total = optree.tree_map(torch.zeros_like, weights)
    for xr, yr in zip(x, y):
        for xb, yb in zip(xr, yr):
            g = grad(example_loss)(weights, xb, yb)
            norm = torch.cat([t.flatten() for t in optree.tree_leaves(g)]).norm()
            c = min(1.0, C / norm.item())
            total = optree.tree_map(lambda a, t, c=c: a + t * c, total, g)
    n = RANKS * B
    return optree.tree_map(lambda w, g, e: w - LR * (g / n + STD * e), weights, total, z)


dense = full0
for step, (x, y) in enumerate(data):
    dense = dense_step(dense, x, y, dense_noise(step))

# %% [markdown]
# ## The layer-wise loop: ghost norms, then the clipped step at FSDP memory

# %%
tree_spec = [spec] * L
params = fh.shard(full0, tree_spec)
block = fh.gathered(fh.per_rank(layer, mesh), spec)
opt = fh.chain(fh.add_gaussian_noise(tree_spec, STD, seed=SEED), fh.sgd(LR))
state = opt.init(params)


def per_rank(t):  # (RANKS, ...) -> (2, 2, ...): rank r's rows at its mesh coordinate
    return t.reshape(2, 2, *t.shape[1:])


def per_example_losses(s, x, y):  # x: (2, 2, batch, D) -> (2, 2, batch)
    return (fh.sequence(block, s, x) - y).square().sum(-1)


def one_example(s, xy):  # one example on each rank: x, y of (2, 2, D)
    x, y = xy
    return per_example_losses(s, x[..., None, :], y[..., None, :]).sum()


losses_lw = []
for x, y in data:
    x, y = per_rank(x), per_rank(y)  # (2, 2, B, D)
    norms = fh.ghost_grad_norms(per_example_losses, params, x, y)  # (2, 2, B)
    examples = (x.movedim(2, 0), y.movedim(2, 0))  # (B, 2, 2, D): the examples along dim 0
    by_vmap = fh.per_example_grad_norms(one_example, params, examples).movedim(0, -1)
    torch.testing.assert_close(norms, by_vmap, rtol=1e-5, atol=0)
    scale = (C / norms).clamp(max=1.0)  # (2, 2, B)
    g = grad(lambda s, x=x, y=y, scale=scale: (per_example_losses(s, x, y) * scale).sum())(params)
    final = fh.reduce_grads(g, tree_spec, last=True, at="gradient")  # mean over ranks
    mean = optree.tree_map(lambda t: t / B, final)  # the mean over the global batch
    updates, state = opt.update(mean, state, params)
    params = fh.apply_updates(params, updates)
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
# **Book-keeping** (Bu et al. 2023) gets the same clipped gradient from *one* forward and one
# backward: `fh.ghost_clipped_grad` takes the norms as above, keeps what each layer's formula
# needs (its input activations and output gradient), and forms each unit's clip-weighted
# gradient from them once the norms are known, reduce-scattered as the unit's backward would.
# It saves the second pass's time and holds every layer's activations and output gradients
# until the backward ends (B14 measures both).

# %%
x, y = per_rank(data[-1][0]), per_rank(data[-1][1])
norms = fh.ghost_grad_norms(per_example_losses, params, x, y)
scale = (C / (norms + 1e-6)).clamp(max=1.0)  # the clip factor ghost_clipped_grad uses
two_pass = grad(lambda s: (per_example_losses(s, x, y) * scale).sum())(params)
one_pass, _ = fh.ghost_clipped_grad(per_example_losses, params, x, y, max_norm=C)
for a, b in zip(optree.tree_leaves(one_pass), optree.tree_leaves(two_pass)):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
print("book-keeping = the two passes' clipped gradient")

# %% [markdown]
# `final / B`: the library's gradient is the *mean* over ranks (its convention) of each rank's
# sum of clipped gradients, so dividing by the examples per rank gives the mean over the
# global batch of `RANKS * B`, which the noise of `σ·C / (RANKS·B)` is added to. Every rank
# along `dp_outer` holds the same shard, draws the same noise and stays equal; the ranks along
# `dp_inner` draw different pieces of the same dense noise.
#
# ## The whole-tree loop (DDP memory)

# %%
whole = fh.shard(full0, tree_spec)
state = opt.init(whole)
for x, y in data:
    x, y = per_rank(x), per_rank(y)
    weights = fh.gather(whole, tree_spec)  # every unit's full weights, on every rank

    def clipped_sum(w, xr, yr):  # one rank: its examples' clipped per-example gradients
        g = vmap(grad(example_loss), in_dims=(None, 0, 0))(w, xr, yr)
        norms = torch.cat([t.flatten(1) for t in optree.tree_leaves(g)], 1).norm(dim=1)
        scale = (C / norms).clamp(max=1.0)
        return optree.tree_map(lambda t: (t * scale.view(-1, *[1] * (t.dim() - 1))).sum(0), g)

    per_rank_sums = fh.per_rank(clipped_sum, mesh)(weights, x, y)
    final = fh.reduce_grads(per_rank_sums, tree_spec, last=True)
    updates, state = opt.update(optree.tree_map(lambda t: t / B, final), state, whole)
    whole = fh.apply_updates(whole, updates)

wt = fh.gather(whole, tree_spec)
print("whole-tree vs dense:", error(wt, dense))
assert error(wt, dense) < 1e-5

# %% [markdown]
# All three agree to float32 rounding. What differs is memory: the whole-tree loop holds every
# unit's full weights and every example's full gradient at once; the layer-wise second pass
# holds one unit's gathered weights at a time and reduce-scatters each unit's gradient in
# backward.
#
# ## Ghost norms beside vmap norms: time and memory
#
# The first pass on a wider model: 4 units of `Linear(256, 256) + tanh`, 64 examples per rank
# (every rank's in this one process, on the SimMesh). The vmap pass forms one unit's
# per-example gradients at a time (64 examples x 256 x 256 per rank); the ghost pass forms
# none. Memory: the largest total of live tensor bytes during the pass, from torch's
# profiler (`profile_memory`), above what was live before it.


# %%
def peak_tensor_bytes(fn):
    """The most tensor bytes live at once while ``fn()`` runs, above those live before."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation:
            sizes.append((node.start_time_ns, node.extra_fields.alloc_size))
    live = peak = 0
    for _, size in sorted(sizes):
        live += size
        peak = max(peak, live)
    return peak


W, UNITS, BIG_B = 256, 4, 64
wide = fh.shard([{"w": torch.randn(W, W) / W**0.5, "b": torch.zeros(W)}] * UNITS, [spec] * UNITS)
xw = torch.randn(2, 2, BIG_B, W)
yw = torch.randn(2, 2, BIG_B, W)
passes = {
    "ghost": lambda: fh.ghost_grad_norms(per_example_losses, wide, xw, yw),
    "vmap": lambda: fh.per_example_grad_norms(
        one_example, wide, (xw.movedim(2, 0), yw.movedim(2, 0))
    ).movedim(0, -1),
}
torch.testing.assert_close(passes["ghost"](), passes["vmap"](), rtol=1e-5, atol=0)
figures = {}
for name, run in passes.items():
    run()  # warm
    t0 = time.perf_counter()
    for _ in range(3):
        run()
    seconds = (time.perf_counter() - t0) / 3
    figures[name] = (seconds, peak_tensor_bytes(run) / 2**20)
for name, (seconds, mib) in figures.items():
    print(f"{name:5s}: {seconds * 1e3:7.1f} ms per pass, peak {mib:7.1f} MiB of tensors")
print(f"ghost / vmap: time {figures['ghost'][0] / figures['vmap'][0]:.2f}x, "
      f"memory {figures['ghost'][1] / figures['vmap'][1]:.2f}x")  # fmt: skip

# %% [markdown]
# Both passes hold each unit's gathered weights until its backward (the composable path);
# the vmap pass adds one unit's per-example gradients (`BIG_B` full weight gradients per
# rank), the ghost pass only each layer's input activations and output gradient. B14
# (`python -m bench dpsgd`) measures both on 4 gloo ranks beside Opacus's ghost clipping on
# FSDP2, on this MLP's kind and on a Hugging Face Llama.

# %%
plt.plot(losses_lw, marker="o")
plt.xlabel("step")
plt.ylabel("mean loss after the step (rank-mean)")
plt.title("DP-SGD, layer-wise")
plt.show()

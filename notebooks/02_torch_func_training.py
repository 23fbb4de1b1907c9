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
# # 02 · Training with `torch.func` and HSDP
#
# A small MLP trained the `torch.func` way — `functional_call` + `grad`, parameters as a plain
# dict — with gradients synchronised by `fh.reduce_grads` and a hand-written optimizer. It all
# runs in this process on a 2×2 `SimMesh`, and the loss curve is checked against a dense,
# single-process `nn.Module` + autograd + `torch.optim` run on the same global batch: the
# curves overlap.
#
# The step, for M microbatches:
#
# 1. `full = fh.gather(params, spec)` — all-gather the local shards into full weights;
# 2. for each microbatch, per-rank gradients `g = grad(loss)(full, x, y)` (Partial on every
#    axis: each rank saw different data), then
#    `acc = fh.reduce_grads(g, spec, last=(m == M - 1), acc=acc)`;
# 3. `params, state = optimizer(params, acc, state)` — `acc` now holds this rank's shard of the
#    averaged gradient, laid out exactly like `params`, so any elementwise optimizer written
#    with `optree.tree_map` works on local shards.
#
# Accumulation in `reduce_grads` is a **sum**, so the loss is scaled by 1/M. With equal-size
# slices per rank, the average over ranks of the sum over microbatches of
# grad(mean loss / M) is exactly the gradient of the mean loss over the whole global batch.

# %%
import einops
import matplotlib.pyplot as plt
import optree
import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

import functional_hsdp as fh

torch.manual_seed(0)
OUTER, INNER = 2, 2  # mesh: dp_outer × dp_inner
M, B = 3, 8  # microbatches per step, samples per rank per microbatch
STEPS, LR, MOMENTUM = 25, 0.1, 0.9
FEATURES, HIDDEN, OUTPUTS = 8, 32, 2

mesh = fh.SimMesh({"dp_outer": OUTER, "dp_inner": INNER})
spec = fh.hsdp(mesh, outer="dp_outer", inner="dp_inner")
print(spec)

# %% [markdown]
# ## Model, data and the per-rank loss
#
# The module only describes the computation; `functional_call` supplies the weights, so the
# module itself can live on the `meta` device. Data is synthetic regression, shaped
# `(step, dp_outer, dp_inner, microbatch, sample, feature)`: rank `(o, i)` trains on
# `x[step, o, i, m]`, and the dense reference trains on all of `x[step]` at once.

# %%
model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUTPUTS))
init = {k: v.detach().clone() for k, v in model.named_parameters()}
model = model.to("meta")  # holds no data: functional_call supplies the parameters

gen = torch.Generator().manual_seed(1)
teacher = torch.randn(FEATURES, OUTPUTS, generator=gen) / FEATURES**0.5
x = torch.randn(STEPS, OUTER, INNER, M, B, FEATURES, generator=gen)
y = torch.sin(x @ teacher) + 0.05 * torch.randn(STEPS, OUTER, INNER, M, B, OUTPUTS, generator=gen)


def loss_fn(params, xb, yb):
    # scaled by 1/M: reduce_grads sums microbatches
    return nn.functional.mse_loss(functional_call(model, params, (xb,)), yb) / M


print({k: tuple(v.shape) for k, v in init.items()})

# %% [markdown]
# ## Per-rank gradients with `vmap` over the mesh dims
#
# On a `SimMesh` every distributed value carries the mesh shape in front, including the full
# weights that `fh.gather` returns (rank `(o, i)`'s copy is `full[k][o, i]`). So the per-rank
# gradient is `grad` mapped over those dims: one `vmap` per mesh axis. (On a `DistMesh`,
# `mesh.batch_shape == ()` and the same loop adds no `vmap` at all.)
#
# An equivalent spelling folds the ranks into one dim with einops, maps once and unfolds.

# %%
per_rank = grad_and_value(loss_fn)
for _ in mesh.batch_shape:  # SimMesh: (2, 2) -> two vmaps; DistMesh: () -> none
    per_rank = vmap(per_rank)


def per_rank_einops(params, xb, yb):
    fold = lambda t: einops.rearrange(t, "o i ... -> (o i) ...")  # noqa: E731
    unfold = lambda t: einops.rearrange(t, "(o i) ... -> o i ...", o=OUTER)  # noqa: E731
    g, v = vmap(grad_and_value(loss_fn))(*optree.tree_map(fold, (params, xb, yb)))
    return optree.tree_map(unfold, (g, v))


full = fh.gather(fh.shard(init, spec), spec)
g, value = per_rank(full, x[0, :, :, 0], y[0, :, :, 0])
g2, value2 = per_rank_einops(full, x[0, :, :, 0], y[0, :, :, 0])
optree.tree_map(torch.testing.assert_close, (g, value), (g2, value2))

# each rank's gradient is the plain autograd gradient of its own loss
o, i = 1, 0
ref = {k: v.clone().requires_grad_() for k, v in init.items()}
loss_fn(ref, x[0, o, i, 0], y[0, o, i, 0]).backward()
for k in init:
    torch.testing.assert_close(g[k][o, i], ref[k].grad)
print({k: tuple(v.shape) for k, v in g.items()}, "<- (dp_outer, dp_inner, *param shape)")

# %% [markdown]
# ## A custom optimizer on local shards
#
# SGD with heavy-ball momentum, as a pure function: new tree in, new tree out. It never asks
# how the tree is laid out, because `params`, the gradient and the momentum buffer are all
# local shards at the optimizer placement, leaf for leaf. (The same formula as
# `torch.optim.SGD(momentum=...)`, so the dense reference can use that.)


# %%
def sgd_momentum(params, grads, velocity, *, lr=LR, momentum=MOMENTUM):
    velocity = optree.tree_map(lambda v, g: momentum * v + g, velocity, grads)
    params = optree.tree_map(lambda p, v: p - lr * v, params, velocity)
    return params, velocity


# %% [markdown]
# ## The training loop
#
# Written once against the public API. We run it for HSDP and, unchanged, for the other
# presets; `fh.comm_log()` confirms that HSDP's outer all-reduce happens once per step.


# %%
def train(spec):
    params = fh.shard(init, spec)  # local shards at the optimizer placement
    velocity = optree.tree_map(torch.zeros_like, params)
    losses, logs = [], []
    for step in range(STEPS):
        with fh.comm_log() as log:
            full = fh.gather(params, spec)  # all-gather for the forward
            acc, rank_loss = None, torch.zeros(mesh.batch_shape)
            for m in range(M):
                g, value = per_rank(full, x[step, :, :, m], y[step, :, :, m])
                acc = fh.reduce_grads(g, spec, last=(m == M - 1), acc=acc)
                rank_loss += value.detach()
            params, velocity = sgd_momentum(params, acc, velocity)
        losses.append(rank_loss.mean().item())  # mean over equal-size rank slices
        logs.append(log)
    return params, losses, logs


params, losses, logs = train(spec)
for log in logs:  # every step: M inner reduce-scatters, ONE outer all-reduce, one all-gather
    assert log.count("reduce_scatter", "dp_inner") == M
    assert log.count("all_reduce", "dp_outer") == 1
    assert log.count("all_gather", "dp_inner") == 1
    assert log.count() == M + 2
print("one HSDP step:", logs[0].summary())
print(f"loss: {losses[0]:.4f} -> {losses[-1]:.4f}")

# %% [markdown]
# ## The dense reference
#
# A plain module with real weights, autograd on the whole global batch of the step
# (OUTER·INNER·M·B samples) and `torch.optim.SGD` with the same momentum.

# %%
dense = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUTPUTS))
dense.load_state_dict(init)
opt = torch.optim.SGD(dense.parameters(), lr=LR, momentum=MOMENTUM)
dense_losses = []
for step in range(STEPS):
    opt.zero_grad()
    loss = nn.functional.mse_loss(
        dense(x[step].reshape(-1, FEATURES)), y[step].reshape(-1, OUTPUTS)
    )
    loss.backward()
    opt.step()
    dense_losses.append(loss.item())

torch.testing.assert_close(torch.tensor(losses), torch.tensor(dense_losses), rtol=1e-5, atol=1e-6)
final = fh.gather(params, spec)  # full weights, the same on every rank
for k, v in dense.named_parameters():
    torch.testing.assert_close(final[k], v.detach().expand_as(final[k]), rtol=1e-5, atol=1e-6)
print(
    "HSDP matches the dense run; max |loss difference| =",
    max(abs(a - b) for a, b in zip(losses, dense_losses)),
)

# %% [markdown]
# ## The same loop with other specs
#
# Nothing in `train` depends on the preset: DDP, FSDP and HFSDP (whose optimizer shards over
# `dp_outer` too) give the same curve.

# %%
curves = {"HSDP": losses}
for name, s in {
    "DDP": fh.ddp(mesh),
    "FSDP": fh.fsdp(mesh),
    "HFSDP": fh.hfsdp(mesh, "dp_outer", "dp_inner"),
}.items():
    _, curves[name], _ = train(s)
    torch.testing.assert_close(
        torch.tensor(curves[name]), torch.tensor(dense_losses), rtol=1e-5, atol=1e-6
    )
print({name: f"{c[-1]:.6f}" for name, c in curves.items()}, "dense", f"{dense_losses[-1]:.6f}")

# %%
fig, (ax, ax_err) = plt.subplots(1, 2, figsize=(11, 3.5))
ax.plot(dense_losses, color="0.6", lw=6, alpha=0.6, label="dense (one process, torch.optim)")
for (name, c), style in zip(curves.items(), ["-", "--", ":", "-."]):
    ax.plot(c, style, lw=1.5, label=f"{name} on 2×2 SimMesh")
ax.set_xlabel("step")
ax.set_ylabel("mean loss over the global batch")
ax.set_yscale("log")
ax.legend(fontsize=8)
ax.set_title("loss curves overlap")
for name, c in curves.items():
    diff = [(k, abs(a - b)) for k, (a, b) in enumerate(zip(c, dense_losses)) if a != b]
    ax_err.plot(*zip(*diff), ".", label=name) if diff else None
ax_err.set_yscale("log")
ax_err.set_ylim(1e-10, 1e-5)
ax_err.set_xlabel("step")
ax_err.set_title("|loss − dense loss| where nonzero (fp32 rounding)")
ax_err.legend(loc="upper right")
fig.tight_layout()
plt.show()

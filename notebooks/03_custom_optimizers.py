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
# # 03 · Optimizers on sharded gradients
#
# After `reduce_grads(..., last=True)` every rank holds *its shard* of the averaged gradient,
# at the spec's **optimizer placement**, laid out leaf for leaf like the sharded parameters
# from `fh.shard`. This notebook plugs optimizers into that:
#
# 1. **global-norm clipping**, the one optimizer ingredient that is *not* elementwise, so it
#    needs communication — and the two easy ways to get it wrong;
# 2. an **optax-style** optimizer (`fh.adamw`: a pair of pure functions `init`, `update`);
# 3. **`torch.optim`** stepping the local shards directly;
# 4. what happens when a gradient that is still **Partial** (an accumulation that was never
#    finished with `last=True`) reaches the optimizer;
# 5. optax's **combinators**: `fh.adamw` as the chain of its parts, and a transformation of
#    your own chained with the library's and a learning-rate **schedule**.
#
# Every result is checked against a dense single-process run (`torch.optim.AdamW` and
# `torch.nn.utils.clip_grad_norm_` on the full model).

# %%
from typing import Any, NamedTuple

import matplotlib.pyplot as plt
import optree
import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

import functional_hsdp as fh

torch.manual_seed(0)
OUTER, INNER, M, B = 2, 2, 2, 8
STEPS, LR, MAX_NORM = 15, 0.02, 0.3
FEATURES, HIDDEN, OUTPUTS = 8, 32, 2

mesh = fh.SimMesh({"dp_outer": OUTER, "dp_inner": INNER})
hsdp = fh.hsdp(mesh, "dp_outer", "dp_inner")
hfsdp = fh.hfsdp(mesh, "dp_outer", "dp_inner")

model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUTPUTS))
init = {k: v.detach().clone() for k, v in model.named_parameters()}
model = model.to("meta")  # functional_call supplies the weights

gen = torch.Generator().manual_seed(1)
teacher = torch.randn(FEATURES, OUTPUTS, generator=gen) / FEATURES**0.5
x = torch.randn(STEPS, OUTER, INNER, M, B, FEATURES, generator=gen)
y = torch.sin(x @ teacher) + 0.05 * torch.randn(STEPS, OUTER, INNER, M, B, OUTPUTS, generator=gen)


def loss_fn(params, xb, yb):
    return nn.functional.mse_loss(functional_call(model, params, (xb,)), yb) / M


per_rank = vmap(vmap(grad_and_value(loss_fn)))  # one vmap per mesh axis


def sharded_grads(params, spec, step, *, finish=True):
    """One step's gradients, reduced: local shards at the optimizer placement."""
    full = fh.gather(params, spec)
    acc, loss = None, torch.zeros(mesh.batch_shape)
    for m in range(M):
        g, value = per_rank(full, x[step, :, :, m], y[step, :, :, m])
        last = finish and m == M - 1
        acc = fh.reduce_grads(g, spec, last=last, acc=acc)
        loss += value
    return acc, loss.mean().item()


def dense_loss(params, step):
    out = functional_call(model, params, (x[step].reshape(-1, FEATURES),))
    return nn.functional.mse_loss(out, y[step].reshape(-1, OUTPUTS))


def dense_grads(params, step):
    p = {k: v.clone().requires_grad_() for k, v in params.items()}
    loss = dense_loss(p, step)
    return dict(zip(p, torch.autograd.grad(loss, list(p.values())))), loss.item()


def rank0(full):
    """Rank (0, 0)'s copy of a gathered tree (every rank holds the same one)."""
    return optree.tree_map(lambda t: t[0, 0], full)


# %% [markdown]
# ## 1 · The global norm of a sharded tree
#
# Clipping by global norm needs `‖g‖ = sqrt(Σ g²)` over the *whole* gradient, but each rank
# holds only a piece. Under HSDP the optimizer placement is `[Replicate, Flat]`:
#
# * along `dp_inner` (**Flat**) the ranks hold *different* pieces: their sums of squares must
#   be added (a `psum` over `dp_inner`);
# * along `dp_outer` (**Replicate**) the ranks hold *copies*: adding them would count every
#   element twice.
#
# So: sum the squares of the local shards, then `psum` over exactly the axes where the
# optimizer placement is Flat. Below, written out with `fh.psum`, next to `fh.global_norm`
# and the two mistakes.

# %%
acc, _ = sharded_grads(fh.shard(init, hsdp), hsdp, step=0)
g_dense, _ = dense_grads(init, step=0)
optree.tree_map(  # the sharded result is the dense gradient, split up
    lambda a, b: torch.testing.assert_close(a, b.expand_as(a), rtol=1e-5, atol=1e-6),
    fh.gather(acc, hsdp),
    g_dense,
)


def local_sum_of_squares(tree):
    # on a SimMesh the ragged pieces are zero-filled: the fill adds nothing
    return sum(t.reshape(*mesh.batch_shape, -1).square().sum(-1) for t in optree.tree_leaves(tree))


def my_global_norm(tree, spec):
    sq = local_sum_of_squares(tree)
    for axis, placement in zip(mesh.axis_names, spec.optimizer):
        if isinstance(placement, fh.Flat):  # sharded along this axis: add the pieces
            sq = fh.psum(sq, axis, mesh)
    return sq.sqrt()  # one value per rank, all equal


dense_norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in g_dense.values()]))
norms = {
    "local shard only": local_sum_of_squares(acc).sqrt(),
    "psum over every axis": fh.psum(
        fh.psum(local_sum_of_squares(acc), "dp_inner", mesh), "dp_outer", mesh
    ).sqrt(),
    "psum over Flat axes": my_global_norm(acc, hsdp),
    "fh.global_norm": fh.global_norm(acc, hsdp),
}
for name, n in norms.items():
    print(f"{name:22s} rank values {[round(v, 4) for v in n.flatten().tolist()]}")
print(f"{'dense':22s} {dense_norm.item():.4f}")

torch.testing.assert_close(norms["psum over Flat axes"], dense_norm.expand(2, 2))
torch.testing.assert_close(norms["fh.global_norm"], dense_norm.expand(2, 2))
torch.testing.assert_close(norms["psum over every axis"], (2**0.5 * dense_norm).expand(2, 2))
assert (norms["local shard only"] < dense_norm).all()

# %% [markdown]
# Under HFSDP the optimizer placement is `[Flat, Flat]`, so the same rule sums over both axes.
# Either way it is one small all-reduce per sharded axis, however many leaves the tree has.

# %%
acc_f, _ = sharded_grads(fh.shard(init, hfsdp), hfsdp, step=0)
with fh.comm_log() as log:
    n_hfsdp = fh.global_norm(acc_f, hfsdp)
torch.testing.assert_close(n_hfsdp, dense_norm.expand(2, 2))
torch.testing.assert_close(my_global_norm(acc_f, hfsdp), dense_norm.expand(2, 2))
print("HFSDP global_norm collectives:", [(e.op, e.axis, e.numel) for e in log.events])
assert log.count() == 2  # one tiny all-reduce per sharded axis, not per leaf

fig, ax = plt.subplots(figsize=(7, 2.6))
labels = list(norms)
ax.barh(labels, [n[0, 0].item() for n in norms.values()], color=["0.6", "0.6", "C0", "C0"])
ax.axvline(dense_norm.item(), color="C3", ls="--", label="dense ‖g‖")
ax.invert_yaxis()
ax.set_xlabel("global gradient norm, as computed on rank (0, 0)")
ax.legend(loc="lower right")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 2 · An optax-style optimizer: `fh.adamw` with clipping
#
# `fh.adamw(lr=...)` returns a `GradientTransformation(init, update)`, pure functions in
# optax's style with `torch.optim.AdamW`'s math. The state (`count`, `mu`, `nu`) is a tree of
# local shards like the params, so its memory is sharded exactly as the optimizer placement
# says. Clipping comes first, with `fh.clip_by_global_norm` (the norm as above, the factor
# `min(1, max_norm / (norm + 1e-6))` as `torch.nn.utils.clip_grad_norm_`).


# %%
def train_optax(spec):
    opt = fh.adamw(lr=LR)
    params = fh.shard(init, spec)
    state = opt.init(params)
    losses, gnorms = [], []
    for step in range(STEPS):
        grads, loss = sharded_grads(params, spec, step)
        grads, norm = fh.clip_by_global_norm(grads, spec, MAX_NORM)
        updates, state = opt.update(grads, state, params)
        params = fh.apply_updates(params, updates)
        losses.append(loss)
        gnorms.append(norm[0, 0].item())
    return params, losses, gnorms


def train_dense():
    weights = {k: v.clone().requires_grad_() for k, v in init.items()}
    opt = torch.optim.AdamW(weights.values(), lr=LR)
    losses, gnorms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        loss = dense_loss(weights, step)
        loss.backward()
        gnorms.append(nn.utils.clip_grad_norm_(weights.values(), MAX_NORM).item())
        opt.step()
        losses.append(loss.item())
    return {k: v.detach() for k, v in weights.items()}, losses, gnorms


dense_params, dense_losses, dense_norms = train_dense()
results = {"HSDP": train_optax(hsdp), "HFSDP": train_optax(hfsdp)}
for name, (params, losses, gnorms) in results.items():
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(dense_losses), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(gnorms), torch.tensor(dense_norms), rtol=1e-5, atol=0)
    optree.tree_map(
        lambda a, b: torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6),
        rank0(fh.gather(params, spec=hsdp if name == "HSDP" else hfsdp)),
        dense_params,
    )
assert sum(n > MAX_NORM for n in dense_norms) >= 3, "clipping should be active on some steps"
print("fh.adamw + fh.clip_by_global_norm match torch.optim.AdamW + clip_grad_norm_")

# %%
fig, (ax, ax_n) = plt.subplots(1, 2, figsize=(11, 3.2))
ax.plot(dense_losses, color="0.6", lw=6, alpha=0.6, label="dense torch.optim.AdamW")
ax_n.plot(dense_norms, color="0.6", lw=6, alpha=0.6, label="dense clip_grad_norm_")
for (name, (_, losses, gnorms)), style in zip(results.items(), ["-", "--"]):
    ax.plot(losses, style, label=f"{name}: fh.adamw")
    ax_n.plot(gnorms, style, label=f"{name}: fh.clip_by_global_norm")
ax_n.axhline(MAX_NORM, color="C3", ls=":", label="max_norm")
ax.set(xlabel="step", ylabel="loss", title="loss")
ax_n.set(xlabel="step", ylabel="‖g‖ before clipping", title="global gradient norm")
ax.legend(fontsize=8)
ax_n.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 3 · `torch.optim` on local shards
#
# Local shards are plain tensors, so `torch.optim` can step them. Wrap each shard as a leaf
# that requires grad, give it the reduced gradient as `.grad`, and call `step()`. On a
# `SimMesh` a leaf's local shards for all ranks are one stacked tensor; that is fine for
# elementwise optimizers such as AdamW (the zero fill of ragged pieces stays zero: its gradient
# is zero). On a `DistMesh` the same code steps this rank's 1-D pieces.
#
# Two things still need the library: the **gradient** (from `reduce_grads`) and the **norm**.
# `torch.nn.utils.clip_grad_norm_` on the shards would measure the wrong tree (one rank's
# pieces on a real mesh; every rank's, replicas included, on a SimMesh), so clip with
# `fh.clip_by_global_norm` before setting `.grad`.

# %%
spec = hsdp
shards = fh.shard(init, spec)
leaves, treedef = optree.tree_flatten(shards)
weights = [t.clone().requires_grad_() for t in leaves]  # leaf tensors: local shards
opt = torch.optim.AdamW(weights, lr=LR)
for step in range(STEPS):
    params = optree.tree_unflatten(treedef, [w.detach() for w in weights])
    grads, _ = sharded_grads(params, spec, step)
    grads, _ = fh.clip_by_global_norm(grads, spec, MAX_NORM)
    for w, g in zip(weights, optree.tree_leaves(grads)):
        w.grad = g
    opt.step()

final = fh.gather(optree.tree_unflatten(treedef, [w.detach() for w in weights]), spec)
optree.tree_map(
    lambda a, b: torch.testing.assert_close(a, b.expand_as(a), rtol=1e-5, atol=1e-6),
    final,
    dense_params,
)
print("torch.optim.AdamW on local shards == dense torch.optim.AdamW on full weights")

# %% [markdown]
# ## 4 · When a Partial tree reaches the optimizer
#
# Forget `last=True` on the final microbatch and the accumulation is still at the *gradient*
# placement `[P(avg), F]`: each `dp_outer` group holds only its own summand. Under HSDP that
# tree has **exactly the same local shapes** as the parameters at `[R, F]`, so shape checks
# cannot catch it. The library tags its results, and every library function refuses one:

# %%
params = fh.shard(init, hsdp)
partial, _ = sharded_grads(params, hsdp, step=0, finish=False)  # never called with last=True
assert all(
    a.shape == b.shape for a, b in zip(optree.tree_leaves(partial), optree.tree_leaves(params))
), "same local shapes as the params"

opt = fh.adamw(lr=LR)
attempts = {
    "fh.gather": lambda: fh.gather(partial, hsdp),
    "fh.global_norm": lambda: fh.global_norm(partial, hsdp),
    "fh.clip_by_global_norm": lambda: fh.clip_by_global_norm(partial, hsdp, MAX_NORM),
    "fh.adamw().update": lambda: opt.update(partial, opt.init(params), params),
}
for name, attempt in attempts.items():
    try:
        attempt()
    except ValueError as e:
        print(f"{name} refuses it:\n    ValueError: {e}\n")
    else:
        raise AssertionError(f"{name} accepted a Partial tree")

# %% [markdown]
# The tag lives on the very tensors `reduce_grads` returned. A *new* tensor computed from them
# (`g * 0.5`, `g.float()`) carries no tag, and then nothing can tell it from a finished
# gradient by its shapes. The only visible symptom: its "global norm" differs between the
# `dp_outer` replicas, which hold different summands.

# %%
untagged = optree.tree_map(lambda t: t * 1.0, partial)
suspicious = fh.global_norm(untagged, hsdp)
print("global_norm of an untagged Partial tree, per rank:", suspicious.flatten().tolist())
assert not torch.allclose(suspicious[0], suspicious[1])

# %% [markdown]
# Code outside the library cannot know. A hand-written `tree_map` update (or `torch.optim`
# with `.grad` set to those shards) runs without complaint, and the `dp_outer` replicas,
# which must hold identical weights, silently drift apart:

# %%
drifted = optree.tree_map(lambda p, g: p - LR * g, params, partial)
w = next(iter(drifted.values()))
gap = (w[0] - w[1]).abs().max().item()
print(f"max |replica (0, i) − replica (1, i)| after one naive step: {gap:.2e}")
assert gap > 1e-4, "the replicas should have diverged"

# The fix is the flag: finish the accumulation, and the same update keeps replicas identical.
grads, _ = sharded_grads(params, hsdp, step=0)
fixed = optree.tree_map(lambda p, g: p - LR * g, params, grads)
w = next(iter(fixed.values()))
assert torch.equal(w[0], w[1])

# %% [markdown]
# ## 5 · Your own transformation, chained with the library's and a schedule
#
# `fh.adamw` is itself a chain of optax's building blocks, and it equals that chain bit for bit:
# `fh.scale_by_adam` (the bias-corrected moment ratio), `fh.add_decayed_weights` (decoupled
# weight decay) and `fh.scale_by_learning_rate` (times `-lr`).

# %%
params = fh.shard(init, hfsdp)
grads, _ = sharded_grads(params, hfsdp, step=0)
whole = fh.adamw(lr=LR, weight_decay=0.01)
parts = fh.chain(fh.scale_by_adam(), fh.add_decayed_weights(0.01), fh.scale_by_learning_rate(LR))
u_whole, _ = whole.update(grads, whole.init(params), params)
u_parts, chain_state = parts.update(grads, parts.init(params), params)
assert all(torch.equal(u_whole[k], u_parts[k]) for k in u_whole)  # bit for bit
print([type(s).__name__ for s in chain_state.inner])

# %% [markdown]
# A transformation of your own is the same kind of object: a pair of pure functions
# `init(params) -> state` and `update(updates, state, params) -> (updates, state)` on **local
# shards**, with its state a `NamedTuple` (a pytree, saved field by field by `fh.state_dict`).
# Elementwise arithmetic needs no communication, so it works at any placement. Here: heavy-ball
# momentum, `trace = beta * trace + g`.
#
# It goes in a chain between the library's pieces: the global-norm clip first (the one step
# that communicates, `fh.clip_global_norm`), then the momentum, decoupled weight decay, and a
# learning rate that follows a **schedule** (`fh.schedules`: optax's, a function of the step
# count kept in the state, so a checkpoint resumes it). The dense reference is
# `torch.optim.SGD(momentum=beta)` with `torch.optim.lr_scheduler.LambdaLR` (the same schedule)
# and `clip_grad_norm_`, the weight decay applied as AdamW decouples it.


# %%
class MomentumState(NamedTuple):
    count: int
    trace: Any  # a tree like the params: local shards


def scale_by_momentum(beta: float) -> fh.GradientTransformation:
    def init(params):
        return MomentumState(0, optree.tree_map(torch.zeros_like, params))

    def update(updates, state, params=None):
        trace = optree.tree_map(lambda t, g: beta * t + g, state.trace, updates)
        return trace, MomentumState(state.count + 1, trace)

    return fh.GradientTransformation(init, update)


BETA, WD = 0.9, 0.01
schedule = fh.schedules.warmup_cosine_decay(
    init_value=0.0, peak_value=0.05, warmup_steps=3, decay_steps=STEPS, end_value=0.005
)


def train_chain(spec):
    opt = fh.chain(
        fh.clip_global_norm(spec, MAX_NORM),
        scale_by_momentum(BETA),
        fh.add_decayed_weights(WD, mask=lambda path, leaf: path[0].endswith("weight")),
        fh.scale_by_learning_rate(schedule),
    )
    params = fh.shard(init, spec)
    state = opt.init(params)
    losses = []
    for step in range(STEPS):
        grads, loss = sharded_grads(params, spec, step)
        updates, state = opt.update(grads, state, params)
        params = fh.apply_updates(params, updates)
        losses.append(loss)
    return params, losses, state


def train_dense_sgd():
    weights = {k: v.clone().requires_grad_() for k, v in init.items()}
    opt = torch.optim.SGD(weights.values(), lr=1.0, momentum=BETA)
    lr_schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: schedule(step))
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = dense_loss(weights, step)
        loss.backward()
        nn.utils.clip_grad_norm_(weights.values(), MAX_NORM)
        with torch.no_grad():  # decoupled decay, weights only: p -= lr * wd * p
            for k, w in weights.items():
                if k.endswith("weight"):
                    w.mul_(1 - lr_schedule.get_last_lr()[0] * WD)
        opt.step()
        lr_schedule.step()
        losses.append(loss.item())
    return {k: v.detach() for k, v in weights.items()}, losses


sgd_params, sgd_losses = train_dense_sgd()
for spec in (hsdp, hfsdp):
    params, losses, state = train_chain(spec)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(sgd_losses), rtol=1e-5, atol=0)
    optree.tree_map(
        lambda a, b: torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6),
        rank0(fh.gather(params, spec)),
        sgd_params,
    )
print("own momentum in a chain == torch.optim.SGD(momentum) + LambdaLR + clip_grad_norm_")
print("chain state:", [type(s).__name__ for s in state.inner], "counts", state.inner[1].count,
      state.inner[3].count)  # fmt: skip

# %%
fig, (ax_lr, ax) = plt.subplots(1, 2, figsize=(11, 3.2))
ax_lr.plot([schedule(t) for t in range(STEPS)], "o-", ms=3)
ax_lr.set(xlabel="step (the state's count)", ylabel="lr", title="fh.schedules.warmup_cosine_decay")
ax.plot(sgd_losses, color="0.6", lw=6, alpha=0.6, label="dense SGD(momentum) + LambdaLR")
ax.plot(losses, "--", label="HFSDP: chain(clip, own momentum, decay, lr schedule)")
ax.set(xlabel="step", ylabel="loss", title="loss")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %% [markdown]
# **Summary.** Elementwise optimizers — optax-style pure functions or `torch.optim` — run
# unchanged on the local shards that `reduce_grads(..., last=True)` returns. Anything that
# reduces over the whole tree (here the global norm) must add over the **Flat** axes only,
# which `fh.global_norm` / `fh.clip_by_global_norm` do. And a result of `last=False` is not a
# gradient yet: the library refuses it, but your own code cannot tell.

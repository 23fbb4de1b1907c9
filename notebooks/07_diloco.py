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
# # 07 · DiLoCo: replicas that train apart and meet every H steps
#
# HSDP all-reduces over the outer axis once per step. **DiLoCo** lets the replicas along
# that axis train apart (`fh.replicas(spec, "dp_outer")`: nothing reduces over it) and meet
# every `H` steps, where an outer optimizer (Nesterov SGD) steps on the pseudo-gradient
# `anchor - mean(params)`. **Streaming DiLoCo** syncs one fragment at a time. On a 2×2
# `SimMesh` (2 replicas × 2 inner ranks) this notebook shows
#
# 1. the loss against `H` on a small regression problem whose replicas see different data;
# 2. the outer bytes per step, from `comm_log`;
# 3. the fragment schedule (`fh.sync_steps`).

# %%
import matplotlib.pyplot as plt
import torch

import functional_hsdp as fh

mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
STEPS, LR = 60, 0.05
gen = torch.Generator().manual_seed(0)
W_TRUE = torch.randn(16, 4, generator=gen)
X = torch.randn(STEPS, 2, 2, 32, 16, generator=gen)  # per step, per rank
NOISE = 0.5 * torch.randn(2, 1, 16, 4, generator=gen)  # each replica its own bias
Y = X @ (W_TRUE + NOISE[None])
X_EVAL = torch.randn(256, 16, generator=gen)
Y_EVAL = X_EVAL @ W_TRUE
full = {"w1": torch.randn(16, 32, generator=gen) / 4, "w2": torch.randn(32, 4, generator=gen) / 6}


def loss(p, x, y):
    return torch.nn.functional.mse_loss(torch.tanh(x @ p["w1"]) @ p["w2"], y)


grad = fh.per_rank(torch.func.grad(loss), mesh)


def train(every=None, fragments=1, delay=0):
    dl = None
    if every:
        outer = fh.sgd(0.7, momentum=0.9, nesterov=True)
        dl = fh.diloco(
            spec, axis="dp_outer", every=every, outer=outer, fragments=fragments, delay=delay
        )
    inner = dl.inner if dl else spec
    params = fh.shard(full, inner)
    state = dl.init(params) if dl else None
    opt = fh.sgd(LR, momentum=0.9)
    opt_state = opt.init(params)
    losses, outer_bytes = [], []
    for t in range(STEPS):
        with fh.comm_log() as log:
            g = grad(fh.gather(params, inner), X[t], Y[t])
            updates, opt_state = opt.update(fh.reduce_grads(g, inner, last=True), opt_state, params)
            params = fh.apply_updates(params, updates)
            if dl:
                params, state = dl.update(params, state)
        outer_bytes.append(sum(e.numel * 4 for e in log.events if e.axis == "dp_outer"))
        w = fh.gather(params, inner)  # replica o's weights at [o, 0]
        losses.append(
            sum(loss({k: v[o, 0] for k, v in w.items()}, X_EVAL, Y_EVAL).item() for o in range(2))
            / 2
        )
    return losses, outer_bytes


runs = {"HSDP": train()}
for H in (5, 20):
    runs[f"DiLoCo H={H}"] = train(every=H)
runs["Streaming H=20 F=2 tau=1"] = train(every=20, fragments=2, delay=1)

# %% [markdown]
# ## Loss against H, and the bytes each step sends over the outer axis
#
# The replicas fit their own targets between syncs and meet at the anchor; the larger `H`,
# the fewer outer bytes. HSDP all-reduces its gradient shard every step. (With H=1 the
# papers' outer Nesterov momentum stacks on the inner momentum every step and diverges on
# this problem: DiLoCo's outer optimizer is tuned for large H.)

# %%
fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.5))
for name, (losses, nbytes) in runs.items():
    a.plot(losses, label=name)
    b.plot(nbytes, label=name)
a.set(xlabel="step", ylabel="eval loss (mean of replicas)", yscale="log")
b.set(xlabel="step", ylabel="dp_outer bytes (this rank)")
a.legend()
plt.show()
for name, (losses, nbytes) in runs.items():
    print(f"{name:26s} final loss {losses[-1]:.4f}  outer bytes/step {sum(nbytes) / STEPS:7.1f}")

# %%
# one sync every H steps, nothing in between; a sync sends each rank's pieces of the model
# (each leaf 16-aligned in the pseudo-gradient's bucket: a little more than HSDP's chunk)
for H in (5, 20):
    sent = [x for x in runs[f"DiLoCo H={H}"][1] if x]
    assert len(sent) == STEPS // H and len(set(sent)) == 1
    assert sent[0] < 1.5 * runs["HSDP"][1][0]

# %% [markdown]
# ## The fragment schedule
#
# Fragment p of F syncs after step t when t >= s_p and (t - s_p) % H == 0, with
# s_p = floor((p + 1) H / F): the fragments take turns, so the largest transfer in one step is
# about 1/F of a whole-model sync.

# %%
H, F = 8, 4
schedule = fh.sync_steps(every=H, fragments=F, steps=24)
grid = torch.zeros(F, len(schedule))
for t, due in enumerate(schedule):
    for p in due:
        grid[p, t] = 1
plt.figure(figsize=(9, 1.8))
plt.imshow(grid, aspect="auto", cmap="Greys", extent=(0.5, len(schedule) + 0.5, F - 0.5, -0.5))
plt.xlabel("inner step t")
plt.ylabel("fragment")
plt.title(f"syncs, H={H}, F={F}")
plt.show()
print(schedule)

# %% [markdown]
# ## A sync in flight
#
# With `delay=tau` a fragment's all-reduce is issued after its step and merged `tau` steps
# later: the `update` that issues it returns at once and the state holds it
# (`state.flight`, one `SyncInFlight` per fragment in flight; on a `DistMesh` its
# collectives run while the next inner steps compute), and the `update` where it lands waits
# for it. A checkpoint taken meanwhile waits for it and saves it averaged in
# `state.pending`.

# %%
dl = fh.diloco(spec, axis="dp_outer", every=H, outer=fh.sgd(0.7, momentum=0.9, nesterov=True),
               fragments=F, delay=2)  # fmt: skip
params = fh.shard({f"w{p}": torch.zeros(8, 4) for p in range(F)}, dl.inner)
state, in_flight = dl.init(params), []
for t in range(1, 25):
    params = {k: v - 0.01 * t for k, v in params.items()}
    params, state = dl.update(params, state)
    in_flight.append([s.fragment for s in state.flight if s is not None])
print(in_flight[:10])
# issued after step t (the schedule above), in flight until t + 2, merged there
assert all(p in in_flight[t + d] for t, due in enumerate(schedule) for p in due for d in (0, 1)
           if t + d < len(in_flight))  # fmt: skip

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
# # 04 · Layer-wise: memory per rank through one step
#
# The whole-tree loop (`gather` everything, `grad`, `reduce_grads`) holds the full weights and a
# full gradient tree at once: DDP's memory. The layer-wise loop gathers one unit at a time
# inside the loss with `fh.gathered`, and reduce-scatters each unit's gradient during backward:
# FSDP2's memory. This notebook plots the bytes each rank's tensors occupy through one training
# step, for
#
# - **whole-tree**: the quickstart loop;
# - **layer-wise, pure**: `fh.gathered` units, `reduce_grads(..., at="gradient")` returning
#   new trees;
# - **layer-wise, MainGrad**: `fh.gathered(..., into=mg)`, each unit's gradient added into
#   persistent sharded buffers during backward, in-place SGD;
# - the same with `reshard_after_forward=False` (the gathered weights kept from forward to
#   backward: faster, more memory).
#
# Everything runs in this process on a 2×2 `SimMesh`, so the measure is the tensor allocator's
# own: `torch.profiler` records every allocation and free (`profile_memory=True`), and the live
# bytes over time, divided by the 4 simulated ranks, is one rank's tensor memory. (On real ranks
# `bench/` measures the process's peak RSS against FSDP2's.)

# %%
import matplotlib.pyplot as plt
import optree
import torch
from torch.profiler import ProfilerActivity, profile

import functional_hsdp as fh

torch.manual_seed(0)
OUTER, INNER = 2, 2
RANKS = OUTER * INNER
WIDTH, LAYERS, BATCH, M, LR = 384, 8, 16, 2, 0.05

mesh = fh.SimMesh({"dp_outer": OUTER, "dp_inner": INNER})
spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
tree_spec = [spec] * LAYERS  # each layer is a unit


def init():
    gen = torch.Generator().manual_seed(0)
    return [
        {"w": torch.randn(WIDTH, WIDTH, generator=gen) / WIDTH**0.5, "b": torch.zeros(WIDTH)}
        for _ in range(LAYERS)
    ]


def layer(p, x):  # one rank's layer, on its full weights
    return torch.tanh(x @ p["w"] + p["b"])


gen = torch.Generator().manual_seed(1)
batches = [torch.randn(OUTER, INNER, BATCH, WIDTH, generator=gen) for _ in range(M)]
weights_mib = sum(t.numel() * 4 for t in optree.tree_leaves(init())) / 2**20
print(f"{LAYERS} layers of {WIDTH}x{WIDTH}: {weights_mib:.2f} MiB of fp32 weights per replica")

# %% [markdown]
# The four loops. Each returns the step's per-rank losses so that we can check they agree.

# %%
per_rank_layer = fh.per_rank(layer, mesh)


def whole_tree(params):
    full = fh.gather(params, tree_spec)

    def loss(full, x):
        for p in full:
            x = per_rank_layer(p, x)
        return x.square().mean(-1).sum() / M

    acc, total = None, 0.0
    for m, x in enumerate(batches):
        g, value = torch.func.grad_and_value(loss)(full, x)
        acc = fh.reduce_grads(g, tree_spec, last=(m == M - 1), acc=acc)
        total += value.item()
    return optree.tree_map(lambda p, g: p - LR * g, params, acc), total


def layerwise_pure(params):
    block = fh.gathered(per_rank_layer, spec)

    def loss(shards, x):
        return fh.sequence(block, shards, x).square().mean(-1).sum() / M

    acc, total = None, 0.0
    for m, x in enumerate(batches):
        g, value = torch.func.grad_and_value(loss)(params, x)
        acc = fh.reduce_grads(g, tree_spec, last=(m == M - 1), acc=acc, at="gradient")
        total += value.item()
    return optree.tree_map(lambda p, g: p - LR * g, params, acc), total


def layerwise_maingrad(reshard):
    def step(params, mg):
        block = fh.gathered(per_rank_layer, spec, into=mg, reshard_after_forward=reshard)

        def loss(shards, x):
            return fh.sequence(block, shards, x).square().mean(-1).sum() / M

        total = 0.0
        for x in batches:
            total += torch.func.grad_and_value(loss)(params, x)[1].item()
        mg.finish()
        for p, g in zip(optree.tree_leaves(params), optree.tree_leaves(mg.grads)):
            p.sub_(LR * g)  # in place, as torch.optim does
        mg.zero_grad()
        return params, total

    return step


# %% [markdown]
# One step of each under the profiler. The persistent state (the shards, and the MainGrad's
# buffers) is allocated before the profiled step, so the curves show what the *step* adds; a
# warm-up step first fills the plan caches.


# %%
def timeline(fn):
    """(seconds, per-rank MiB above the step's start) from the profiler's memory events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    t0, live, xs, ys = events[0][0], 0, [], []
    for t, nbytes in events:
        live += nbytes
        xs.append((t - t0) / 1e9)
        ys.append(live / RANKS / 2**20)
    return xs, ys, out


def measure(name, make_step, with_maingrad=False):
    params = fh.shard(init(), tree_spec)
    mg = fh.MainGrad(tree_spec, like=init()) if with_maingrad else None
    args = (mg,) if with_maingrad else ()
    params, _ = make_step(params, *args)  # warm-up step
    xs, ys, (params, total) = timeline(lambda: make_step(params, *args))
    return {"name": name, "t": xs, "mib": ys, "peak": max(ys), "loss": total}


runs = [
    measure("whole-tree", whole_tree),
    measure("layer-wise, pure", layerwise_pure),
    measure("layer-wise, MainGrad", layerwise_maingrad(True), with_maingrad=True),
    measure("layer-wise, MainGrad, no reshard", layerwise_maingrad(False), with_maingrad=True),
]
for r in runs:
    print(f"{r['name']:<34} peak {r['peak']:6.2f} MiB per rank above the step's start")

# %%
fig, ax = plt.subplots(figsize=(9, 4.5))
for r in runs:
    ax.plot(r["t"], r["mib"], label=f"{r['name']} (peak {r['peak']:.1f} MiB)")
ax.axhline(weights_mib, color="grey", linestyle=":", label="one full replica of the weights")
ax.set_xlabel("time in the step (s)")
ax.set_ylabel("tensor memory per rank above the step's start (MiB)")
ax.set_title(f"One step, 2x2 mesh, hsdp, {LAYERS} units, M={M}")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# What the curves show:
#
# - the **whole-tree** step first gathers every layer (one full replica), then each `grad`
#   builds a full gradient tree on top of it: its peak is a few replicas of the weights;
# - **layer-wise** steps rise and fall one unit at a time: a unit's full weights live only while
#   it computes (forward) or is recomputed (backward), and its full gradient only until its
#   reduce-scatter; the pure form also holds the running accumulation and the new tree of
#   sharded gradients; with `into=mg` those live in the persistent buffers allocated before the
#   step, so the step itself adds only about one unit's worth;
# - **no reshard** keeps every gathered unit from forward to backward: its peak grows with the
#   number of units.
#
# The four loops train the same model: the losses agree, and the orders of magnitude hold.

# %%
losses = [r["loss"] for r in runs]
assert max(losses) - min(losses) < 1e-5 * max(abs(x) for x in losses), losses
peak = {r["name"]: r["peak"] for r in runs}
assert peak["layer-wise, MainGrad"] < peak["layer-wise, pure"] < peak["whole-tree"], peak
assert peak["layer-wise, MainGrad"] < peak["layer-wise, MainGrad, no reshard"], peak
print("losses agree:", [f"{x:.6f}" for x in losses])

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
# # 01 · Placements: what every rank holds, microbatch by microbatch
#
# This notebook follows one gradient tree through `fh.reduce_grads` on a 2×2 mesh
# `(dp_outer, dp_inner)` and looks at what each of the four ranks holds after every microbatch.
# Everything runs in this process on a `SimMesh`: a distributed value is a tensor whose leading
# dims are the mesh shape, so rank `(o, i)` holds `x[o, i]`. A `DistMesh` issues exactly the same
# collectives on real ranks.
#
# **Placements**, one per mesh axis, say how the ranks along that axis share a value:
#
# | placement | along that axis |
# |---|---|
# | `Replicate()` — **R** | every rank holds the same, complete value |
# | `Partial("avg")` — **P** | every rank holds a summand; the value is their average |
# | `Flat()` — **F** | leaves flattened into one bucket; each rank holds one equal-size chunk |
#
# (A Flat bucket is padded with zeros between leaves, so that each leaf starts 16-byte aligned,
# and at its tail; never inside a leaf.)
#
# A `Spec` gives three placements per axis: where **parameters** rest between steps, where
# **gradients** rest between microbatches, and where the **optimizer** works (final gradients,
# main weights, optimizer state). HSDP with deferred outer reduction (Megatron-LM PR 5743) is:
#
# | role | dp_outer | dp_inner |
# |---|---|---|
# | parameter | R | F |
# | gradient | **P(avg)** | F |
# | optimizer | R | F |
#
# Raw gradients from a backward pass are Partial on *every* axis (each rank saw different data).
# The axes whose gradient placement is still Partial are the **deferred axes**: `reduce_grads`
# reduce-scatters over `dp_inner` on every microbatch and adds to the running sum, but only
# reduces `dp_outer` when `last=True`.

# %%
import matplotlib.pyplot as plt
import numpy as np
import optree
import torch

import functional_hsdp as fh

torch.manual_seed(0)
mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
spec = fh.hsdp(mesh, outer="dp_outer", inner="dp_inner")
RANKS = [(o, i) for o in range(2) for i in range(2)]
M = 3  # microbatches per step
print(spec)
print("deferred axes:", spec.deferred_axes)

# %% [markdown]
# ## A gradient tree and its element ids
#
# A small tree of 21 numbers. Leaves are packed into one bucket in tree order (optree sorts
# dict keys), each at a multiple of 16 elements (`embed` at 0-11, `head.b` at 16-18, `head.w`
# at 32-37: zeros between them), 38 slots in all, so both `dp_inner` ranks get a chunk of 19:
# rank 0's holds `embed`, 4 zeros and `head.b`; rank 1's 13 zeros and `head.w`.
#
# To see *which* elements a rank holds, we push a tree of element ids (1, 2, …, 21, the same on
# every rank) through the very same calls: averaging identical values leaves them unchanged, so
# the result is the library's own layout, and the zero fill marks padding.

# %%
shapes = {"embed": (4, 3), "head": {"w": (3, 2), "b": (3,)}}
template = optree.tree_map(torch.zeros, shapes, is_leaf=lambda s: isinstance(s, tuple))
leaf_paths, leaf_templates, _ = optree.tree_flatten_with_path(template)
names = [".".join(map(str, p)) for p in leaf_paths]
sizes = [t.numel() for t in leaf_templates]
N = sum(sizes)
print("leaves in bucket order:", list(zip(names, sizes)), "total", N)


def stacked(tree):
    """The same full value on every rank: the mesh shape in front."""
    return optree.tree_map(lambda t: t.expand(*mesh.batch_shape, *t.shape).clone(), tree)


def element_ids(template):
    """The tree's elements numbered 1, 2, ... in bucket (tree) order, as float64."""
    leaves, treedef = optree.tree_flatten(template)
    numbers = torch.arange(1, sum(t.numel() for t in leaves) + 1, dtype=torch.float64)
    pieces = numbers.split([t.numel() for t in leaves])
    return optree.tree_unflatten(treedef, [c.reshape(t.shape) for c, t in zip(pieces, leaves)])


def owners(spec, template=template):
    """Element ids per rank at the input, gradient and optimizer placements."""
    ids = stacked(element_ids(template))
    return {
        "input": ids,
        "gradient": fh.reduce_grads(ids, spec, last=False),
        "optimizer": fh.reduce_grads(ids, spec, last=True),
    }


def per_rank_flat(tree):
    return torch.cat([x.reshape(*mesh.batch_shape, -1) for x in optree.tree_leaves(tree)], -1)


def global_view(local, owner):
    """Each rank's local values placed at their element positions; NaN where it holds nothing."""
    vals, where = per_rank_flat(local).double(), per_rank_flat(owner).long()
    out = torch.full((*mesh.batch_shape, N + 1), float("nan"), dtype=torch.float64)
    out.scatter_(-1, where, vals)  # id 0 is the zero fill: it lands in column 0, dropped
    return out[..., 1:]


hsdp_owner = owners(spec)
view = global_view(hsdp_owner["gradient"], hsdp_owner["gradient"])
for o, i in RANKS:
    held = view[o, i][~view[o, i].isnan()].long().tolist()
    print(f"rank ({o}, {i}) holds elements {held[0]}..{held[-1]} ({len(held)} of {N})")

# %% [markdown]
# ## Reading a placement off the data
#
# Given every rank's view, the placement along one axis can be *observed*: if the ranks along
# the axis hold different elements it is **F**; if they hold the same elements and the same
# values, **R**; the same elements with different values (summands), **P**. We use this to
# check, not assume, what the library does.


# %%
def observed(view):
    """One of 'P', 'F', 'R' per mesh axis, read from a (*mesh, N) global view."""
    out = []
    for d in range(mesh.ndim):
        v = view.movedim(d, 0)
        held = ~v.isnan()
        if not all(torch.equal(held[k], held[0]) for k in range(len(v))):
            assert (held.sum(0) <= 1).all(), "Flat chunks along an axis must be disjoint"
            out.append("F")
        elif all(torch.allclose(v[k], v[0], equal_nan=True) for k in range(len(v))):
            out.append("R")
        else:
            out.append("P")
    return out


def short(placements):
    return [str(p)[0] for p in placements]


# %% [markdown]
# ## Three microbatches through `reduce_grads`
#
# Each rank's microbatch gradient is random here (a real loop gets it from `torch.func.grad`,
# see notebook 02). After every call we check the result against a dense torch reference:
#
# * before the last microbatch, rank `(o, i)` holds chunk `i` of the **dp_inner average of
#   dp_outer-group `o`'s running sum**: Partial over `dp_outer`, Flat over `dp_inner`;
# * after the last, every rank holds chunk `i` of the **global average of the sum over
#   microbatches**: Replicate over `dp_outer`, Flat over `dp_inner`.

# %%
micro = [
    optree.tree_map(lambda t: torch.randn(*mesh.batch_shape, *t.shape), template) for _ in range(M)
]
views, stages, acc = [], [], None
running = torch.zeros(*mesh.batch_shape, N, dtype=torch.float64)

views.append(global_view(micro[0], hsdp_owner["input"]))
stages.append("raw grads\n(microbatch 1)")

with fh.comm_log() as log:
    for m, g in enumerate(micro):
        last = m == M - 1
        acc = fh.reduce_grads(g, spec, last=last, acc=acc)
        view = global_view(acc, hsdp_owner["optimizer" if last else "gradient"])
        running += per_rank_flat(g).double()
        if not last:
            # dense reference: dp_inner average of each dp_outer group's running sum
            dense = running.mean(dim=1, keepdim=True).expand_as(running)
            placement = spec.gradient
        else:
            dense = running.mean(dim=(0, 1), keepdim=True).expand_as(running)
            placement = spec.optimizer
        held = ~view.isnan()
        torch.testing.assert_close(view[held], dense[held])
        assert held.sum(dim=1).eq(1).all(), "dp_inner ranks must tile every element once"
        assert observed(view) == short(placement), (observed(view), placement)
        views.append(view)
        stages.append(f"after microbatch {m + 1}" + (" (last)" if last else ""))
        print(f"microbatch {m + 1}: observed {observed(view)}, spec {short(placement)}")

# The final result is what a dense, single-process run would compute, on every rank:
full = fh.gather(acc, spec)
for k, leaf in enumerate(optree.tree_leaves(full)):
    dense_leaf = sum(optree.tree_leaves(g)[k] for g in micro).mean(dim=(0, 1))
    torch.testing.assert_close(leaf, dense_leaf.expand_as(leaf))
print(log.summary())

# %% [markdown]
# ### The picture: what each rank holds
#
# One row per rank, one column per element of the bucket (grey: the rank holds nothing
# there; solid lines: leaf boundaries; dashed: the boundary between the two `dp_inner`
# chunks). Raw gradients are full and differ everywhere. After microbatches 1 and 2 each rank
# holds only its `dp_inner` chunk, and ranks `(0, i)` and `(1, i)` hold different summands:
# the `dp_outer` reduction is deferred. After the last microbatch, `(0, i)` and `(1, i)` agree.

# %%
bounds = np.cumsum(sizes)[:-1] + 0.5 - 1
split = int((~views[1][0, 0].isnan()).sum())  # the elements dp_inner rank 0's chunk holds
cmap = plt.get_cmap("coolwarm").copy()
cmap.set_bad("0.85")
fig, axes = plt.subplots(len(views), 1, figsize=(9, 1.6 * len(views)), sharex=True)
lim = max(float(v[~v.isnan()].abs().max()) for v in views)
for ax, v, title in zip(axes, views, stages):
    ax.imshow(v.reshape(len(RANKS), N).numpy(), cmap=cmap, vmin=-lim, vmax=lim, aspect="auto")
    ax.set_yticks(range(len(RANKS)), [f"rank {r}" for r in RANKS], fontsize=8)
    for b in bounds:
        ax.axvline(b, color="k", lw=0.8)
    ax.axvline(split - 0.5, color="k", lw=1.5, ls="--")  # between the dp_inner chunks
    ax.set_title(f"{title.replace(chr(10), ' ')}:  observed {observed(v)}", fontsize=9, loc="left")
centers = np.cumsum(sizes) - np.array(sizes) / 2 - 0.5
axes[-1].set_xticks(centers, names)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Placement per axis over the microbatches: HSDP, DDP, FSDP, HFSDP
#
# The same experiment for four presets, reading each stage's placement off the data. DDP
# (`fh.ddp(mesh)`, both axes) defers *everything* to the last microbatch; FSDP reduce-scatters
# over both axes on every microbatch; HSDP keeps `dp_outer` Partial until the last one; HFSDP is
# HSDP whose last microbatch reduce-scatters over `dp_outer` too (optimizer `[F, F]`).

# %%
presets = {
    "DDP": fh.ddp(mesh),
    "FSDP": fh.fsdp(mesh),
    "HSDP": fh.hsdp(mesh, "dp_outer", "dp_inner"),
    "HFSDP": fh.hfsdp(mesh, "dp_outer", "dp_inner"),
}
timeline = {}
for name, s in presets.items():
    own, acc = owners(s), None
    row = [observed(global_view(micro[0], own["input"]))]
    for m, g in enumerate(micro):
        last = m == M - 1
        acc = fh.reduce_grads(g, s, last=last, acc=acc)
        row.append(observed(global_view(acc, own["optimizer" if last else "gradient"])))
        assert row[-1] == short(s.optimizer if last else s.gradient), (name, m, row[-1])
    timeline[name] = row
    print(f"{name:6s}", " → ".join("[" + ", ".join(r) + "]" for r in row))

colors = {"P": "#f4a261", "F": "#2a9d8f", "R": "#8ab17d"}
labels = {"P": "P(avg)", "F": "Flat", "R": "Replicate"}
fig, axes = plt.subplots(1, len(timeline), figsize=(13, 2.4), sharey=True)
for ax, (name, row) in zip(axes, timeline.items()):
    for x, placements in enumerate(row):
        for y, p in enumerate(placements):
            ax.add_patch(plt.Rectangle((x, y), 0.95, 0.9, color=colors[p]))
            ax.text(x + 0.47, y + 0.45, labels[p], ha="center", va="center", fontsize=8)
    ax.set_xlim(0, len(row))
    ax.set_ylim(mesh.ndim, 0)
    ax.set_xticks(np.arange(len(row)) + 0.47, ["raw"] + [f"mb {m + 1}" for m in range(M)])
    ax.set_yticks(np.arange(mesh.ndim) + 0.45, mesh.axis_names)
    ax.set_title(name)
    ax.tick_params(length=0)
    ax.set_frame_on(False)
fig.suptitle(f"gradient placement per axis after each microbatch (M = {M}, mb {M} is last)")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Bytes per axis per microbatch
#
# `fh.comm_log()` records every collective: op, axis, dtype and the number of elements of one
# rank's input. We log each microbatch of a step separately, for a tree of about 33 thousand
# fp32 numbers (`n` elements, 4n bytes per rank), M = 4.
#
# * **DDP** sends nothing until the last microbatch, then all-reduces the full gradient over
#   both axes — but every rank keeps a full-size accumulator.
# * **FSDP** reduce-scatters over `dp_inner` (n elements) and then `dp_outer` (n/2) on *every*
#   microbatch.
# * **HSDP** reduce-scatters over `dp_inner` every microbatch, and all-reduces over `dp_outer`
#   once, on the last microbatch, on the 1/2 shard: (M − 1) fewer outer collectives than FSDP.
#
# Why is one outer reduction enough? The average over `dp_outer` is linear, so the average of
# the sum over microbatches equals the sum of the averages: deferring it changes no numbers,
# only how often the slow (typically inter-node) axis is used.

# %%
M4 = 4
big_shapes = {"w1": (256, 64), "b1": (256,), "w2": (64, 256), "b2": (64,)}
big_template = optree.tree_map(torch.zeros, big_shapes, is_leaf=lambda s: isinstance(s, tuple))
n = sum(t.numel() for t in optree.tree_leaves(big_template))
big_micro = [
    optree.tree_map(lambda t: torch.randn(*mesh.batch_shape, *t.shape), big_template)
    for _ in range(M4)
]
traffic = {}  # name -> {axis: [bytes per microbatch]}
acc_numel = {}
for name in ("DDP", "FSDP", "HSDP"):
    s, acc, per_mb = presets[name], None, {a: [] for a in mesh.axis_names}
    for m, g in enumerate(big_micro):
        with fh.comm_log() as log:
            acc = fh.reduce_grads(g, s, last=(m == M4 - 1), acc=acc)
        for a in mesh.axis_names:
            per_mb[a].append(log.nbytes(axis=a))
        if m == 0:  # elements rank (0, 0) really holds (SimMesh zero-fills ragged pieces)
            held = per_rank_flat(owners(s, big_template)["gradient"])[0, 0]
            acc_numel[name] = int(held.count_nonzero())
    traffic[name] = per_mb

B = 4 * n  # fp32 bytes of one full gradient
none, last_only = [0] * (M4 - 1), lambda b: [0] * (M4 - 1) + [b]
assert traffic["DDP"] == {"dp_outer": last_only(B), "dp_inner": last_only(B)}
assert traffic["FSDP"] == {"dp_outer": [B // 2] * M4, "dp_inner": [B] * M4}
assert traffic["HSDP"] == {"dp_outer": last_only(B // 2), "dp_inner": [B] * M4}
print(f"n = {n} elements, {B} bytes per full gradient")
for name, per_mb in traffic.items():
    print(
        f"{name:5s} per-rank bytes per microbatch {per_mb};"
        f" accumulator per rank: {acc_numel[name]} elements"
    )

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 3.2), sharey=True)
width = 0.27
for ax, a in zip(axes, ("dp_outer", "dp_inner")):
    for k, (name, per_mb) in enumerate(traffic.items()):
        x = np.arange(1, M4 + 1) + (k - 1) * width
        ax.bar(x, np.array(per_mb[a]) / 1024, width, label=name)
    ax.set_title(f"{a}: bytes sent per rank (input to the collective)")
    ax.set_xticks(
        range(1, M4 + 1), [f"mb {m}" + (" (last)" if m == M4 else "") for m in range(1, M4 + 1)]
    )
    ax.set_ylabel("KiB")
axes[0].legend()
fig.tight_layout()
plt.show()

totals = {name: {a: sum(v) for a, v in per_mb.items()} for name, per_mb in traffic.items()}
print("bytes per step per rank:", totals)
assert totals["HSDP"]["dp_outer"] * M4 == totals["FSDP"]["dp_outer"]

# %% [markdown]
# **Summary.** On a `(dp_outer, dp_inner)` mesh, HSDP's gradients rest at `[P(avg), F]` between
# microbatches: every microbatch costs one reduce-scatter over the fast inner axis, and the
# outer axis sees one all-reduce per *step*, on a 1/n_inner shard. Notebook 02 trains a model
# with this; notebook 03 plugs optimizers into the sharded result.

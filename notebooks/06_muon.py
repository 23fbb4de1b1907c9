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
# # 06 · Muon on sharded gradients
#
# AdamW is elementwise, so it runs on whatever piece of a gradient a rank holds. **Muon**
# (`torch.optim.Muon`) is not: it orthogonalizes each weight *matrix*'s momentum with a
# Newton-Schulz iteration, which needs the whole matrix, and a Flat shard splits matrices
# across ranks. This notebook trains a small transformer in a `torch.func` loop on a 2×2
# `SimMesh` with
#
# 1. the usual recipe, `fh.partition`: **Muon** (`fh.muon`) for the blocks' matrices,
#    **AdamW** (`fh.adamw`) for the embedding (tied to the head) and the norms, against AdamW
#    everywhere: loss curves, and a check against `torch.optim.Muon` + `torch.optim.AdamW` on
#    the dense mean gradient;
# 2. the **owner placement** (`fh.owned(spec)`): each matrix whole on one rank of the mesh,
#    who owns which matrix, and how many elements each rank orthogonalizes;
# 3. the **collectives per axis** of one step: AdamW on HSDP, Muon on HSDP (`fh.per_matrix`
#    moves each matrix to its owner by all-to-alls and back), Muon on `fh.owned(hsdp)` (the
#    cheap route: a reduce-scatter over `dp_outer` where HSDP all-reduces, an all-gather of
#    the new weights, nothing in the optimizer) and Muon on `fh.owned(hsdp, "dp_outer")`
#    (HSDP's own layout, uneven all-to-alls of the data over `dp_outer`: no padding).

# %%
import matplotlib.pyplot as plt
import optree
import torch
import torch.nn.functional as F
from torch.func import grad_and_value

import functional_hsdp as fh

OUTER, INNER, M, B = 2, 2, 2, 2  # mesh, microbatches, sequences per microbatch per rank
V, D, T, LAYERS = 32, 32, 8, 2  # vocab, width, sequence length, blocks
STEPS, MUON_LR, ADAMW_LR = 12, 0.02, 3e-3

mesh = fh.SimMesh({"dp_outer": OUTER, "dp_inner": INNER})
hsdp = fh.hsdp(mesh, "dp_outer", "dp_inner")
owned = fh.owned(hsdp)  # the optimizer placement: Owner on both axes
print(owned)


def init(seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = lambda *s, scale=1.0: torch.randn(*s, generator=gen) * scale / s[0] ** 0.5  # noqa: E731
    block = lambda: {  # noqa: E731
        "ln": torch.ones(D),
        "qkv": w(D, 3 * D),
        "o": w(D, D),
        "up": w(D, 4 * D),
        "down": w(4 * D, D),
    }
    return {"tok": w(V, D, scale=D**0.5) * 0.5, "blocks": [block() for _ in range(LAYERS)]}


def forward(p, ids):
    h = p["tok"][ids]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for b in p["blocks"]:
        x = F.layer_norm(h, (D,), b["ln"])
        q, k, v = (x @ b["qkv"]).split(D, dim=-1)
        att = torch.softmax((q @ k.mT / D**0.5).masked_fill(~causal, float("-inf")), -1)
        h = h + att @ v @ b["o"]
        h = h + torch.relu(F.layer_norm(h, (D,), b["ln"]) @ b["up"]) @ b["down"]
    return h @ p["tok"].T  # the head is the embedding


def loss_fn(p, ids):
    return F.cross_entropy(forward(p, ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()) / M


# A task to learn: sequences that count up modulo V from a random start, with a random stride
gen = torch.Generator().manual_seed(1)
start = torch.randint(V, (STEPS, OUTER, INNER, M, B, 1), generator=gen)
stride = torch.randint(1, 4, (STEPS, OUTER, INNER, M, B, 1), generator=gen)
data = (start + stride * torch.arange(T + 1)) % V

per_rank = fh.per_rank(grad_and_value(loss_fn), mesh)  # vmap over the mesh dims


def label(path, leaf=None):
    """The usual recipe: Muon for the blocks' matrices, AdamW for the rest."""
    return "muon" if path[-1] in ("qkv", "o", "up", "down") else "adamw"


def muon_recipe(spec):
    return fh.partition({"muon": fh.muon(spec, lr=MUON_LR), "adamw": fh.adamw(ADAMW_LR)}, label)


def train(spec, opt, steps=STEPS):
    """The whole-tree torch.func loop; returns the losses and the last step's comm_log."""
    params = fh.shard(init(), spec)  # main weights at the optimizer placement
    state, losses = opt.init(params), []
    for step in range(steps):
        with fh.comm_log() as log:
            full = fh.gather(fh.sync_params(params, spec), spec)  # weights for the forward
            acc, loss = None, 0.0
            for m in range(M):
                g, value = per_rank(full, data[step, :, :, m])
                acc = fh.reduce_grads(g, spec, last=m == M - 1, acc=acc)
                loss += value.mean().item()
            updates, state = opt.update(acc, state, params)
            params = fh.apply_updates(params, updates)
        losses.append(loss)
    return losses, log, params


# %% [markdown]
# ## 1 · Muon against AdamW, and against torch.optim
#
# The same data, the same initial weights. `fh.muon` is `torch.optim.Muon`'s math (Nesterov
# momentum 0.95, 5 quintic Newton-Schulz steps in bf16, lr scaled by `sqrt(max(1, rows /
# cols))`, decoupled weight decay 0.1); first checked on the dense mean gradient against
# torch's own optimizers, given the mean over ranks of the same per-rank gradients (in
# float64, then float32, as a dense run would hold them): one step agrees to fp32 roundoff.
# (Over more steps of training the weights' last bits differ, since the update is rounded in
# another order than torch's in-place `mul_` and `add_`; they change the next gradients' last
# bits, and the bf16 iteration can round an input to the next bf16 value. The tests,
# `tests/optim/test_matrix.py`, check several steps on fixed gradients, in bf16 and in fp32.)

# %%
def dense_run(steps):
    """torch.optim.Muon (blocks' matrices) + torch.optim.AdamW (the rest) on the mean over
    ranks of the sum over microbatches."""
    leaves, treedef = optree.tree_flatten(init())
    dense = [x.clone().requires_grad_() for x in leaves]
    labels = [label(p) for p in treedef.paths()]
    opts = [
        torch.optim.Muon([p for p, k in zip(dense, labels) if k == "muon"], lr=MUON_LR),
        torch.optim.AdamW([p for p, k in zip(dense, labels) if k == "adamw"], lr=ADAMW_LR),
    ]
    for step in range(steps):
        on_every_rank = [x.detach().expand(OUTER, INNER, *x.shape) for x in dense]
        full = optree.tree_unflatten(treedef, on_every_rank)
        grads = [per_rank(full, data[step, :, :, m])[0] for m in range(M)]
        for p, *g in zip(dense, *map(optree.tree_leaves, grads)):
            p.grad = sum(x.double() for x in g).mean((0, 1)).float()
        for o in opts:
            o.step()
    return optree.tree_unflatten(treedef, [x.detach() for x in dense])


CHECK = 1
for spec in (hsdp, owned):
    _, _, params = train(spec, muon_recipe(spec), steps=CHECK)
    got, ref = fh.gather(params, spec), dense_run(CHECK)
    diff = optree.tree_map(lambda a, b: (a - b).abs().max().item(), got, ref)
    err = max(optree.tree_leaves(diff))
    print(f"{spec.optimizer}: max |fh - torch.optim| after {CHECK} step = {err:.1e}")
    assert err < 1e-5

# %%
runs = {
    "AdamW (hsdp)": train(hsdp, fh.adamw(ADAMW_LR)),
    "Muon + AdamW (owned(hsdp))": train(owned, muon_recipe(owned)),
}
for name, (losses, _, _) in runs.items():
    plt.plot(losses, label=name)
plt.xlabel("step")
plt.ylabel("loss (mean over ranks)")
plt.legend()
plt.title("Muon vs AdamW, a 2-block transformer on a 2x2 SimMesh")
plt.show()
print("last losses:", {k: round(v[0][-1], 3) for k, v in runs.items()})
assert runs["Muon + AdamW (owned(hsdp))"][0][-1] < runs["AdamW (hsdp)"][0][-1]

# %% [markdown]
# ## 2 · Who owns which matrix
#
# Under `fh.owned(spec)` a leaf's local value at the optimizer placement is the whole leaf on
# its owner and empty on every other rank (on a `SimMesh`, whose values carry every rank, the
# others' rows are zero fill). Leaves are assigned per bucket, largest first to the least
# loaded rank, so every rank orthogonalizes about a quarter of the elements; `fh.per_matrix`
# calls its function once per leaf over the whole mesh.

# %%
params = fh.shard(init(), owned)
paths = ["".join(f"[{k!r}]" for k in p) for p in optree.tree_paths(params)]
loads = torch.zeros(OUTER, INNER, dtype=torch.long)
print(f"{'leaf':28} {'shape':>10}   owner (dp_outer, dp_inner)")
for path, leaf, full in zip(paths, optree.tree_leaves(params), optree.tree_leaves(init())):
    held = leaf.reshape(OUTER, INNER, -1).abs().sum(-1) > 0  # the one rank holding it
    (o, i), = held.nonzero().tolist()
    if full.dim() == 2:
        loads[o, i] += full.numel()
    print(f"{path:28} {str(tuple(full.shape)):>10}   ({o}, {i})")
print("matrix elements per rank:\n", loads)

calls = []
matrices = {"blocks": [{k: b[k] for k in ("qkv", "o", "up", "down")} for b in init()["blocks"]]}
fh.per_matrix(lambda x: calls.append(tuple(x.shape)) or x, fh.shard(matrices, owned), owned)
print("fn calls (a stack of the leaves of one shape each):", calls)
assert sum(c[0] for c in calls) == 4 * LAYERS  # each matrix exactly once

# %% [markdown]
# ## 3 · Collectives per axis, one step
#
# Per step (2 microbatches): AdamW on HSDP reduce-scatters over `dp_inner` per microbatch and
# all-reduces the inner chunk over `dp_outer` once. Muon on HSDP adds, per bucket, an
# all-to-all over `dp_inner` to the owners and one back, and an all-gather over `dp_outer`
# (the replicas get the owners' results). Muon on `fh.owned(hsdp)` reduce-scatters over
# `dp_outer` instead of all-reducing (each owner gets its matrices' final gradient), its
# optimizer communicates nothing, and `sync_params` all-gathers the new weights over
# `dp_outer`: a reduce-scatter and an all-gather carry an all-reduce's bytes, plus each
# bucket's padding to its heaviest owner. Muon on `fh.owned(hsdp, "dp_outer")` keeps HSDP's
# layout: over `dp_outer` a reduce-scatter-v (an all-to-all of the inner chunk's data, each
# piece to its matrix's owner) and an all-gather-v (an all-to-all of the owners' pieces),
# nothing padded; `fh.per_matrix` adds an all-to-all pair over `dp_inner` for the pieces of
# matrices that straddle two inner chunks (each matrix's owner holds most of it). For an
# all-to-all, a rank sends what it sends to the others (`Event.sent`, per rank); "sent" is
# the bytes of the rank that sends the most.
# Its training matches the others' (the first cell of section 1 checks hsdp and owned against
# torch; `tests/optim/test_matrix.py` checks all three).

# %%
def ring(op, n):
    """Bytes a rank sends per input byte (ring algorithms over n ranks)."""
    return {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n,
            "all_to_all": (n - 1) / n, "all_gather": n - 1}[op]


runs["Muon + AdamW (hsdp)"] = train(hsdp, muon_recipe(hsdp), steps=1)  # one step, its log
outer_owned = fh.owned(hsdp, "dp_outer")  # optimizer placement [Owner, Flat]
runs["Muon + AdamW (outer owned)"] = train(outer_owned, muon_recipe(outer_owned), steps=1)
print(f"{'run':28} {'axis':9} {'collectives (count x input elements)':48} sent (bytes, most)")
sent = {}
for name, (_, log, _) in runs.items():
    for axis in mesh.axis_names:
        events = [e for e in log.events if e.axis == axis]
        kinds = {}
        for e in events:
            kinds.setdefault(e.op, []).append(e.numel)
        text = ", ".join(f"{op} {len(n)} x {n[0]}" for op, n in kinds.items())
        per_rank = torch.zeros(OUTER * INNER)  # bytes each rank sends
        for e in events:
            if e.sent is not None:  # an all-to-all: what each rank sends to the others
                per_rank += torch.tensor(e.sent) * e.dtype.itemsize
            else:
                per_rank += e.nbytes * ring(e.op, mesh.size(axis))
        sent[name, axis] = per_rank.max().item()  # the rank that sends the most
        print(f"{name:28} {axis:9} {text:48} {sent[name, axis]:,.0f}")
# the forward's all-gather over dp_inner (gather) is every run's; over dp_outer, the cheap
# route sends what AdamW-HSDP sends, up to the owners' padding of each bucket
print("dp_outer, owned / adamw:", sent["Muon + AdamW (owned(hsdp))", "dp_outer"]
      / sent["AdamW (hsdp)", "dp_outer"])
print("dp_outer, outer owned / adamw:", sent["Muon + AdamW (outer owned)", "dp_outer"]
      / sent["AdamW (hsdp)", "dp_outer"])
assert sent["Muon + AdamW (outer owned)", "dp_outer"] <= sent["AdamW (hsdp)", "dp_outer"]

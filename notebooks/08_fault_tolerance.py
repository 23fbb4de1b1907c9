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
# # 08 · Fault tolerance: replica groups that fail and come back
#
# On a fault-tolerant replica axis a dead group stops no one: each step (each DiLoCo sync)
# starts with a **quorum** of the groups alive, a mean over the axis is over that quorum's
# participants, a step that fails anywhere commits nowhere, and a group that missed a commit
# is **healed** from a peer at its next quorum. On a real run torchft forms the quorums
# (`fh.fault_tolerant(manager, axis=...)`, see the fault-tolerance guide); here
# `fh.simulated_quorum` plays them from a schedule, on a `SimMesh` of 4 replica groups × 2
# inner ranks, in one process. This notebook
#
# 1. draws failure schedules of increasing failure rate and pictures the quorums;
# 2. trains a small regression problem with per-step HSDP and with DiLoCo under them, and
#    checks every run against a naive dense reference;
# 3. plots the final loss against the failure rate, and the participants per step.

# %%
from functools import partial

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.colors import ListedColormap

import functional_hsdp as fh

R, N = 4, 2  # replica groups x inner ranks per group
STEPS, H, LR, RESTART = 60, 5, 0.05, 5  # a dead group is back RESTART steps after it died
BATCH = 32  # examples per rank and step
gen = torch.Generator().manual_seed(0)
W_TRUE = torch.randn(16, 4, generator=gen)
X = torch.randn(STEPS, R, N, BATCH, 16, generator=gen)  # per step, per rank: its own samples
Y = X @ W_TRUE + 0.5 * torch.randn(STEPS, R, N, BATCH, 4, generator=gen)
X_EVAL = torch.randn(256, 16, generator=gen)
Y_EVAL = X_EVAL @ W_TRUE
FULL = {"w1": torch.randn(16, 32, generator=gen) / 4, "w2": torch.randn(32, 4, generator=gen) / 6}


def loss(p, x, y):
    return torch.nn.functional.mse_loss(torch.tanh(x @ p["w1"]) @ p["w2"], y)


# the references' gradients: dense torch, a batch of ranks at once
per_example = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))
per_group = torch.func.vmap(per_example)  # each group's params on its own ranks


def eval_loss(p):
    return loss(p, X_EVAL, Y_EVAL).item()


# %% [markdown]
# ## Failure schedules
#
# Per inner step, each group alive dies with probability `rate`, at a uniform point of the
# step, and is back `RESTART` steps later (a restart loop), joining at the next quorum. A
# quorum takes the groups alive when it starts; a group that dies **after** that, in the same
# step, fails it: its collective fails, and the step commits nowhere. HSDP starts its quorum
# at the start of every step, so every death fails a step. DiLoCo starts one after the inner
# step of a sync step (here: half-way through that step, the other half is the sync): a
# group that died before it is absent (its local progress since the last sync is lost), and
# only a death during the sync fails it. At least one group survives every step.


# %%
def schedule(rate, seed):
    """alive[t]: the groups alive at the start of step t; dies[t]: {group: the point of step
    t (in [0, 1)) where it dies}."""
    rng = np.random.default_rng(seed)
    back = np.zeros(R, dtype=int)  # the step where each group is back
    alive, dies = [], []
    for t in range(STEPS):
        now = tuple(int(r) for r in np.flatnonzero(back <= t))
        gone = {r: float(rng.random()) for r in now if rng.random() < rate}
        if len(gone) == len(now):
            gone.pop(now[0])  # someone survives the step
        for r in gone:
            back[r] = t + 1 + RESTART
        alive.append(now)
        dies.append(gone)
    return alive, dies


def quorums(alive, dies, at, start):
    """The simulated quorum's schedule for quorums at the steps ``at``, each starting at the
    point ``start`` of its step: who takes part, and which quorums fail (a participant dies
    after the quorum started)."""
    members = [tuple(r for r in alive[t] if dies[t].get(r, 1.0) >= start) for t in at]
    fail = [k for k, t in enumerate(at) if any(r in dies[t] for r in members[k])]
    return members, fail


RATES = (0.0, 0.02, 0.05, 0.1)
SEEDS = (0, 1)
HSDP_AT = list(range(STEPS))  # a quorum per step
DILOCO_AT = [t for t in range(STEPS) if (t + 1) % H == 0]  # after steps H, 2H, ...: the syncs


def picture(sim):
    """Per group and quorum: 0 absent, 1 took part (committed), 2 healed there, 3 took part
    in a quorum that failed."""
    grid = np.zeros((R, len(sim.log)))
    for rec in sim.log:
        for r in rec.alive:
            grid[r, rec.index] = 3 if not rec.committed else 2 if r in rec.healed else 1
    return grid


# %% [markdown]
# ## Per-step HSDP on the fault-tolerant axis
#
# The loop of a real run, on the simulated quorum: every tree the loop keeps goes through
# `sim.quorum(...)` (a group behind, or back after an absence, gets a peer's copy in its
# slots), the gradient's mean over `"replica"` is over the quorum's participants, and the
# optimizer steps only where `sim.commit()` says so. The reference recomputes it in dense
# torch: per step, the mean of the participants' gradients, a step that failed dropped.


# %%
def hsdp(rate, seed):
    alive, fails = quorums(*schedule(rate, seed), HSDP_AT, start=0.0)
    sim = fh.simulated_quorum(axis="replica", alive=alive, fail=fails)
    mesh = fh.SimMesh({"replica": R, "dp": N}, replicas=sim)
    spec = fh.hsdp(mesh, "replica", "dp")
    grad = fh.per_rank(torch.func.grad(loss), mesh)
    opt = fh.sgd(LR, momentum=0.5)
    params = fh.shard(FULL, spec)
    opt_state = opt.init(params)
    pos = 0  # the data position: only a committed step moves it on
    for _ in HSDP_AT:
        # every tree the loop keeps (a real group behind takes its peer's pos too; on the
        # simulated axis ints are shared and stay as they are)
        params, opt_state, pos = sim.quorum((params, opt_state, pos))
        g = grad(fh.gather(params, spec), X[pos], Y[pos])
        g = fh.reduce_grads(g, spec, last=True)  # mean over dp, then over the participants
        if sim.commit():
            updates, opt_state = opt.update(g, opt_state, params)
            params = fh.apply_updates(params, updates)
            pos += 1
    w = fh.gather(params, spec)
    return {k: v[sim.alive[0], 0] for k, v in w.items()}, sim


def hsdp_reference(sim):
    """Dense torch: the mean over the quorum's participants of their ranks' gradients; a
    step that did not commit changes nothing."""
    p = {k: v.clone() for k, v in FULL.items()}
    buf = {k: torch.zeros_like(v) for k, v in p.items()}
    pos = 0
    for rec in sim.log:
        rs = list(rec.alive)  # the participants' ranks' gradients, averaged
        g = per_example(p, X[pos, rs].flatten(0, 1), Y[pos, rs].flatten(0, 1))
        if rec.committed:
            for k in p:
                buf[k] = 0.5 * buf[k] + g[k].mean(0)
                p[k] = p[k] - LR * buf[k]
            pos += 1
    return p


# %% [markdown]
# ## DiLoCo on the fault-tolerant axis
#
# Steps without a sync talk to no one. When `dl.sync_due(state)` says the next update
# syncs, the loop starts a quorum with every tree it keeps, and `dl.update` commits the sync
# itself: a failed sync keeps the anchor, the outer state and the params (the next sync
# carries the progress). A group healed at a sync has no progress of its own: it sends a
# zero pseudo-gradient. With `weight=None` the mean still counts it among the participants
# (torchft's DiLoCo does the same); with `weight=` (here the tokens each group read since the
# last sync, Decoupled DiLoCo) the merge is `sum(w * delta) / sum(w)`, and a healed group's
# weight is 0: it is left out exactly. Here every group reads as much per step, so the
# tokens are one number; a real group passes its own count.
#
# The outer optimizer is Nesterov SGD at 0.7 with momentum 0.5: the papers' 0.9 is tuned for
# far more syncs than this run's 12, and overshoots here. (On a real axis a restarted group
# also calls `ft.quorum` once before its first step, to wait for the next sync; a simulated
# replica's slot is carried along while it is absent and needs no such call.)


# %%
def diloco(rate, seed, weighted):
    alive, fails = quorums(*schedule(rate, seed), DILOCO_AT, start=0.5)
    sim = fh.simulated_quorum(axis="replica", alive=alive, fail=fails)
    mesh = fh.SimMesh({"replica": R, "dp": N}, replicas=sim)
    outer = fh.sgd(0.7, momentum=0.5, nesterov=True)
    dl = fh.diloco(fh.hsdp(mesh, "replica", "dp"), axis="replica", every=H, outer=outer)
    grad = fh.per_rank(torch.func.grad(loss), mesh)
    opt = fh.sgd(LR, momentum=0.5)
    params = fh.shard(FULL, dl.inner)
    opt_state, state = opt.init(params), dl.init(params)
    tokens = float(H * N * BATCH)  # what each group read since its last sync
    for t in range(STEPS):
        g = grad(fh.gather(params, dl.inner), X[t], Y[t])
        g = fh.reduce_grads(g, dl.inner, last=True)  # over dp only: per group
        updates, opt_state = opt.update(g, opt_state, params)
        params = fh.apply_updates(params, updates)
        if dl.sync_due(state):
            params, opt_state, state = sim.quorum((params, opt_state, state))
        params, state = dl.update(params, state, weight=tokens if weighted else None)
    anchor = fh.gather(state.anchor, dl.inner)
    return {k: v[sim.alive[0], 0] for k, v in anchor.items()}, sim


def diloco_reference(sim, weighted):
    """Dense torch, per group: inner SGD with momentum on its own data; at a quorum, the
    groups behind take a peer's params and momentum, the pseudo-gradients of the
    participants are averaged (a healed group's is 0, or left out with weights), and a
    committed sync steps the anchor with Nesterov SGD and resets the groups to it."""
    p = {k: v.expand(R, *v.shape).clone() for k, v in FULL.items()}  # [group, ...]
    buf = {k: torch.zeros_like(v) for k, v in p.items()}
    anchor = {k: v.clone() for k, v in FULL.items()}
    mom = {k: torch.zeros_like(v) for k, v in FULL.items()}
    steps = [0] * R  # commits each group took part in
    quorum = iter(sim.log)
    before = tuple(range(R))  # who took part in the last quorum
    for t in range(STEPS):
        g = per_group(p, X[t], Y[t])  # [group, rank, ...]
        for k in FULL:
            buf[k] = 0.5 * buf[k] + g[k].mean(1)
            p[k] = p[k] - LR * buf[k]
        if t not in DILOCO_AT:
            continue
        rec = next(quorum)
        for r in set(rec.alive) - set(before):  # back after an absence: a restarted process
            steps[r] = -1
        before = rec.alive
        top = max(steps[r] for r in rec.alive)
        if top < 0:  # every participant restarted: they start afresh together
            top = 0
            for r in rec.alive:
                steps[r] = 0
        src = next(r for r in rec.alive if steps[r] == top)
        healed = [r for r in rec.alive if steps[r] < top]
        for r in healed:
            for k in FULL:
                p[k][r], buf[k][r] = p[k][src], buf[k][src]
            steps[r] = top
        assert tuple(healed) == rec.healed
        w = torch.zeros(R)
        w[[r for r in rec.alive if r not in healed]] = 1.0
        total = w.sum() if weighted else len(rec.alive)
        if not rec.committed:
            continue
        for k in FULL:
            delta = torch.einsum("r,r...->...", w, anchor[k] - p[k]) / total
            mom[k] = 0.5 * mom[k] + delta
            anchor[k] = anchor[k] - 0.7 * (delta + 0.5 * mom[k])
            p[k] = anchor[k].expand_as(p[k]).clone()  # every slot, a dead one too
        for r in rec.alive:
            steps[r] += 1
    return anchor


# %% [markdown]
# ## The runs, each checked against its reference

# %%
METHODS = {
    "HSDP": (hsdp, hsdp_reference),
    "DiLoCo": (partial(diloco, weighted=False), partial(diloco_reference, weighted=False)),
    "DiLoCo, weight=tokens": (
        partial(diloco, weighted=True),
        partial(diloco_reference, weighted=True),
    ),
}
runs = {name: {} for name in METHODS}
for rate in RATES:
    for seed in SEEDS:
        for name, (run, ref) in METHODS.items():
            got, sim = run(rate, seed)
            want = ref(sim)
            for k in want:
                torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5)
            runs[name][rate, seed] = (eval_loss(got), sim)
print("every run equals its dense reference")

# %% [markdown]
# Without failures nothing heals and every quorum commits; the tokens of each group are then
# equal, and the weighted merge is the plain mean:

# %%
for name in METHODS:
    for seed in SEEDS:
        log = runs[name][0.0, seed][1].log
        assert all(r.committed and not r.healed and r.participants == R for r in log)
plain, weighted = runs["DiLoCo"][0.0, 0][0], runs["DiLoCo, weight=tokens"][0.0, 0][0]
assert abs(plain - weighted) < 1e-6, (plain, weighted)

# %% [markdown]
# ## Quorum by quorum
#
# One schedule drawn at failure rate 0.05, as each loop's quorums saw it (`sim.log`, one
# `QuorumRecord` per quorum): which groups took part, which were healed there (they had
# missed a commit), and the quorums that failed (a participant died during the step or the
# sync: no one committed). A group back after missing a commit heals at its first quorum.

# %%
SHOW = 0.05
cmap = ListedColormap(["#eeeeee", "#4c9a2a", "#3b6fb6", "#d1495b"])
fig, axes = plt.subplots(2, 1, figsize=(11, 4.4))
for ax, name in zip(axes, ("HSDP", "DiLoCo")):
    sim = runs[name][SHOW, 0][1]
    ax.imshow(picture(sim), cmap=cmap, vmin=0, vmax=3, aspect="auto", interpolation="nearest",
              extent=(-0.5, len(sim.log) - 0.5, R - 0.5, -0.5))  # fmt: skip
    every = "a quorum per step" if name == "HSDP" else f"a quorum per sync (H={H})"
    ax.set(ylabel="group", yticks=range(R), title=f"{name}: {every}")
axes[1].set_xlabel("quorum")
handles = [plt.Rectangle((0, 0), 1, 1, color=cmap(k)) for k in range(4)]
fig.legend(handles, ["absent", "took part", "healed there", "took part, quorum failed"],
           loc="lower center", ncol=4)  # fmt: skip
fig.tight_layout(rect=(0, 0.08, 1, 1))
plt.show()

# %% [markdown]
# ## Final loss against the failure rate, and the participants per step
#
# HSDP spends a step on every failure during a step (it commits nowhere, and the same batch
# is tried again), and an absent group thins the mean. DiLoCo's quorums are `H` steps apart:
# a death between two syncs costs the dead group's local progress, not the others', a failed
# sync keeps everyone's progress for the next one, and only a death during a sync fails it.
# With `weight=None` a healed group is counted in the mean with a zero pseudo-gradient (the
# merged step shrinks by the healed share); with `weight=tokens` it is left out.

# %%
fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.5))
for name, res in runs.items():
    final = np.array([[res[rate, s][0] for s in SEEDS] for rate in RATES])
    a.plot(RATES, final.mean(1), "o-", label=name)
    a.fill_between(RATES, final.min(1), final.max(1), alpha=0.15)
a.set(xlabel="failure rate (per group and step)", ylabel="final eval loss",
      title=f"mean (and range) of {len(SEEDS)} schedules")  # fmt: skip
a.legend()
for name, at in (("HSDP", HSDP_AT), ("DiLoCo", DILOCO_AT)):
    sim = runs[name][SHOW, 0][1]
    steps = [at[r.index] + 1 for r in sim.log]
    line = b.step(steps, [r.participants for r in sim.log], where="post", label=name)[0]
    failed = [at[r.index] + 1 for r in sim.log if not r.committed]
    b.plot(failed, [0.3] * len(failed), "x", color=line.get_color())
b.set(xlabel="inner step", ylabel="groups in the quorum", ylim=(0, R + 0.5),
      title=f"rate {SHOW}: participants (x: not committed)")  # fmt: skip
b.legend()
plt.show()
print("final eval loss, mean over schedules; rates", RATES)
for name, res in runs.items():
    row = "  ".join(f"{np.mean([res[rate, s][0] for s in SEEDS]):.4f}" for rate in RATES)
    print(f"{name:22s} {row}")

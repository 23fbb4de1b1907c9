"""Layer-wise training problems shared by the SimMesh and gloo tests: a small transformer
(token embedding tied to the output head, attention + MLP blocks: not a Sequential) trained
with ``fh.gathered`` units, and the dense single-process run it must match.

Every rank r (row-major over the mesh) gets its own microbatches; the dense reference is SGD on
the mean over ranks of the sum over microbatches of the per-rank gradients of ``loss / M``.
"""

from __future__ import annotations

import optree
import torch
import torch.nn.functional as F
from torch.func import grad

import functional_hsdp as fh

V, D, H, T, B = 13, 8, 2, 5, 3  # vocab, width, heads, sequence, batch per rank
LR = 0.5


def init(layers: int = 2, dtype=torch.float32, seed: int = 0) -> dict:
    """Full weights: ``{"embed": {...}, "blocks": [{...}] * layers}`` (embed = tied head)."""
    gen = torch.Generator().manual_seed(seed)

    def w(*shape, scale=0.3):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    block = lambda: {  # noqa: E731
        "ln": {"g": (1 + w(D, scale=0.1)), "b": w(D, scale=0.1)},
        "qkv": w(D, 3 * D),
        "o": w(D, D),
        "mlp": {"up": w(D, 2 * D), "down": w(2 * D, D)},
    }
    return {"embed": {"tok": w(V, D, scale=1.0)}, "blocks": [block() for _ in range(layers)]}


def embed(p: dict, ids: torch.Tensor) -> torch.Tensor:
    return p["tok"][ids]


def head(p: dict, h: torch.Tensor) -> torch.Tensor:
    return h @ p["tok"].T


def block(p: dict, h: torch.Tensor) -> torch.Tensor:
    x = F.layer_norm(h, (D,), p["ln"]["g"], p["ln"]["b"])
    q, k, v = (x @ p["qkv"]).split(D, dim=-1)
    heads = lambda t: t.unflatten(-1, (H, D // H)).transpose(-3, -2)  # noqa: E731
    scores = heads(q) @ heads(k).transpose(-1, -2) / (D // H) ** 0.5
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    att = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ heads(v)
    h = h + att.transpose(-3, -2).flatten(-2) @ p["o"]
    return h + torch.tanh(x @ p["mlp"]["up"]) @ p["mlp"]["down"]


def ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())


def dense_loss(p: dict, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    h = embed(p["embed"], ids)
    for b in p["blocks"]:
        h = block(b, h)
    return ce(head(p["embed"], h), targets)


def batches(rank: int, microbatches: int, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + 7)
    return [
        (torch.randint(V, (B, T), generator=gen), torch.randint(V, (B, T), generator=gen))
        for _ in range(microbatches)
    ]


def mesh_batches(mesh, microbatches: int, step: int) -> list:
    """This process's microbatches: every rank's, stacked (SimMesh), or its own (DistMesh)."""
    if not mesh.batch_shape:
        import torch.distributed as dist

        return batches(dist.get_rank(), microbatches, step)
    n = 1
    for s in mesh.batch_shape:
        n *= s
    per_rank = [batches(r, microbatches, step) for r in range(n)]
    return [
        tuple(
            torch.stack([per_rank[r][m][j] for r in range(n)]).unflatten(0, mesh.batch_shape)
            for j in range(2)
        )
        for m in range(microbatches)
    ]


def dense_train(steps: int, microbatches: int, ranks: int, layers: int = 2) -> dict:
    """Single-process SGD on the mean over ranks of the sum over microbatches."""
    params = init(layers)
    for step in range(steps):
        total = None
        for r in range(ranks):
            for ids, targets in batches(r, microbatches, step):
                g = grad(dense_loss)(params, ids, targets)
                g = optree.tree_map(lambda t: t / microbatches, g)
                total = g if total is None else optree.tree_map(torch.add, total, g)
        params = optree.tree_map(lambda p, g: p - LR * g / ranks, params, total)
    return params


def train(
    spec: fh.Spec,
    steps: int,
    microbatches: int,
    mode: str = "pure",
    *,
    layers: int = 2,
    reshard_after_forward: bool = True,
    set_to_none: bool = True,
    prefetch: bool = True,
    recompute: bool = False,
    mp_policy=None,
    persistent: bool = True,
) -> tuple[dict, list]:
    """Train layer-wise; returns (full params gathered at the end, comm_log events).

    ``mode``: ``"pure"`` (``reduce_grads(..., at="gradient")`` returning new trees),
    ``"maingrad"`` (``MainGrad.accumulate(..., at="gradient")``), ``"sink"``
    (``gathered(..., into=mg)``, in-place updates; ``finish()`` issues the deferred
    reductions) or ``"deferred"`` (as ``"sink"``, the microbatches declared to the MainGrad:
    the last backward issues each unit's deferred reduction)."""
    deferred = mode == "deferred"
    mode = "sink" if deferred else mode
    mesh = spec.mesh
    tree_spec = {"embed": spec, "blocks": [spec] * layers}
    full = init(layers)
    main = fh.shard(full, tree_spec)  # optimizer placement
    mg = fh.MainGrad(tree_spec, like=full, persistent=persistent) if mode != "pure" else None
    into = mg if mode == "sink" else None
    kw = {
        "reshard_after_forward": reshard_after_forward,
        "into": into,
        "recompute": recompute,
        "mp_policy": mp_policy,
    }
    emb = fh.gathered(fh.per_rank(embed, mesh), spec, **kw)
    out = fh.gathered(fh.per_rank(head, mesh), spec, **kw)
    blk = fh.gathered(fh.per_rank(block, mesh), spec, **kw)
    per_rank_ce = fh.per_rank(ce, mesh)
    scale = 1 / microbatches if mode == "sink" else 1.0

    def loss_fn(shards, ids, targets):
        h = emb(shards["embed"], ids)
        if prefetch:
            h = fh.sequence(blk, shards["blocks"], h)
        else:
            for b in shards["blocks"]:
                h = blk(b, h)
        return per_rank_ce(out(shards["embed"], h), targets).sum() * scale

    with fh.comm_log() as log:
        for step in range(steps):
            shards = fh.sync_params(main, tree_spec)  # parameter placement (hfsdp: gathered)
            if mode == "sink" and spec.optimizer == spec.parameter:
                shards = main  # updated in place below: the shards fh.shard made
            acc = None
            declared = mg if deferred else None
            for (ids, targets), last in fh.microbatches(
                mesh_batches(mesh, microbatches, step), into=declared
            ):
                g = grad(loss_fn)(shards, ids, targets)
                if mode == "pure":
                    g = optree.tree_map(lambda t: t / microbatches, g)
                    acc = fh.reduce_grads(g, tree_spec, last=last, acc=acc, at="gradient")
                elif mode == "maingrad":
                    g = optree.tree_map(lambda t: t / microbatches, g)
                    mg.accumulate(g, last=last, at="gradient")
            if mode == "sink":
                mg.finish()
            grads = acc if mode == "pure" else mg.grads
            if mode == "sink" and shards is main:
                for p, g in zip(optree.tree_leaves(main), optree.tree_leaves(grads)):
                    p.sub_(LR * g)
            else:
                main = optree.tree_map(lambda p, g: p - LR * g, main, grads)
            if mg is not None:
                mg.zero_grad(set_to_none=set_to_none)
    return fh.gather(main, tree_spec), log.events


def max_rel_error(got: dict, ref: dict, batch: tuple[int, ...] = ()) -> float:
    """max |got - ref| / max |ref| over leaves (every rank's copy on a SimMesh)."""
    worst = 0.0
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(ref)):
        a = a.double().reshape(-1, *b.shape) if batch else a.double()[None]
        worst = max(worst, ((a - b.double()).abs().max() / b.double().abs().max()).item())
    return worst

"""Ghost norms through ``fh.functional_call`` on an ``fh.shard_module``d model, on 4 gloo ranks
(2x2 mesh): a model mixing formulas and the fallback (an embedding and a layer norm in the
root, linear and conv units, a linear head), a Hugging Face ``LlamaForCausalLM`` (untied and
tied: the tied weight is used twice), and DP-SGD's step (ghost norms, then the clip-weighted
first-order pass into a ``MainGrad``; or book-keeping's one pass, ``fh.ghost_clipped_grad``)
against the dense reference: clip each example of the global batch, then the mean (no
noise).
"""

from __future__ import annotations

import optree
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from reference import dist_preset

import functional_hsdp as fh
from functional_hsdp.mesh.launch import DEFAULT_PRELOAD
from functional_hsdp.sync import ghost
from functional_hsdp.tools.testing import GlooPool

B, T, D, V, CLIP, LR = 3, 5, 8, 11, 1.0, 0.5


@pytest.fixture(scope="module")
def pool():
    with GlooPool(4, preload=(*DEFAULT_PRELOAD, "pytest", "transformers")) as p:
        yield p


class Net(torch.nn.Module):
    """The root: an embedding, a layer norm and a head; the units: Linear + Tanh + a Conv1d
    over the positions (no formula: the per-example fallback)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(V, D, padding_idx=0)
        self.norm = torch.nn.LayerNorm(D)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Tanh(), torch.nn.Conv1d(T, T, 1))
            for _ in range(2)
        )
        self.head = torch.nn.Linear(D, 2)

    def forward(self, ids):
        h = self.norm(self.embed(ids))
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _ids(rank: int, step: int = 0) -> torch.Tensor:
    ids = torch.randint(V, (B, T), generator=torch.Generator().manual_seed(100 * step + rank))
    ids[0, 1] = ids[0, 3]  # a token twice in an example
    return ids


def _net_losses(out: torch.Tensor) -> torch.Tensor:
    return out.square().flatten(1).sum(-1)


def _dense_norms(model: torch.nn.Module, one, *data) -> torch.Tensor:
    """Every example's gradient norm from dense per-example gradients (vmap(grad))."""
    full = {k: v.detach() for k, v in model.named_parameters()}
    per = torch.func.vmap(torch.func.grad(one), in_dims=(None, *([0] * len(data))))(full, *data)
    return sum(g.flatten(1).double().square().sum(1) for g in per.values()).sqrt()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs() / want.double().abs()).max().item()


def _bookkeeping_vs_second_pass(losses, shards, tree_spec, *batch) -> float:
    """The largest relative difference between ``fh.ghost_clipped_grad``'s gradient and the
    second pass's (the clip-weighted losses' first-order gradient, reduced)."""
    norms = fh.ghost_grad_norms(losses, shards, *batch)
    clip = norms.median().item()
    grads, _ = fh.ghost_clipped_grad(losses, shards, *batch, max_norm=clip)
    grads = fh.reduce_grads(grads, tree_spec, last=True, at="gradient")
    scale = (clip / (norms + 1e-6)).clamp(max=1.0)
    g = torch.func.grad(lambda s: (losses(s, *batch) * scale).sum())(shards)
    want = fh.gather(fh.reduce_grads(g, tree_spec, last=True, at="gradient"), tree_spec)
    got = fh.gather(grads, tree_spec)  # the full gradients (a rank's shard may be empty)
    return max(_rel_tensor(a, b) for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want)))


def _mixed_task(strategy: str) -> dict:
    torch.manual_seed(0)
    model, dense = Net(), Net()
    dense.load_state_dict(model.state_dict())
    shards, tree_spec = fh.shard_module(model, dist_preset(strategy), units=list(model.blocks))
    ids = _ids(dist.get_rank())

    def losses(s, ids):
        return _net_losses(fh.functional_call(model, s, (ids,)))

    def one(s, i):  # one example, for the vmap path
        return _net_losses(fh.functional_call(model, s, (i[None],))).sum()

    with fh.comm_log() as log:
        norms, done = ghost.run_pass(losses, shards, args=(ids,), kwargs={}, sequence="auto")
    dense_one = lambda p, i: _net_losses(torch.func.functional_call(dense, p, (i[None],))).sum()  # noqa: E731
    want = _dense_norms(dense, dense_one, ids)
    return {
        "dense": _rel(norms, want),
        "vmap": _rel(norms, fh.per_example_grad_norms(one, shards, ids)),
        "bookkeeping": _bookkeeping_vs_second_pass(losses, shards, tree_spec, ids),
        "routes": {k: sorted(v) for k, v in done.routes.items()},
        "reduced": [e.op for e in log.events if e.op in ("reduce_scatter", "all_reduce")],
    }


@pytest.mark.parametrize("strategy", ["fsdp", "hsdp"])
def test_functional_call_mixing_formulas_and_the_fallback(pool, strategy):
    for r in pool.run(_mixed_task, strategy):
        assert r["dense"] <= 1e-5 and r["vmap"] <= 1e-5
        assert r["bookkeeping"] <= 1e-5
        assert r["reduced"] == []
        routes = r["routes"]
        assert routes["shards['']['embed.weight']"] == ["embedding"]
        assert routes["shards['']['norm.weight']"] == ["layer_norm:weight"]
        assert routes["shards['']['head.weight']"] == ["linear:materialize"]
        assert routes["shards['blocks.0']['0.weight']"] == ["linear:materialize"]
        assert routes["shards['blocks.1']['2.weight']"] == ["fallback"]


# -- a Hugging Face Llama ------------------------------------------------------------------------


def _lm_losses(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each sequence's mean next-token cross-entropy."""
    nll = F.cross_entropy(logits[:, :-1].mT.float(), ids[:, 1:], reduction="none")
    return nll.mean(-1)


def _llama_task(tied: bool) -> dict:
    import hf_problem

    model, dense = hf_problem.model(tied), hf_problem.model(tied)
    shards, tree_spec = fh.shard_module(model, dist_preset("hsdp"), units=list(model.model.layers))
    gen = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(hf_problem.V, (B, hf_problem.SEQ), generator=gen)

    def losses(s, ids):
        return _lm_losses(fh.functional_call(model, s, (ids,)).logits, ids)

    norms, done = ghost.run_pass(losses, shards, args=(ids,), kwargs={}, sequence="auto")

    def one(p, i):
        return _lm_losses(torch.func.functional_call(dense, p, (i[None],)).logits, i[None]).sum()

    return {
        "rel": _rel(norms, _dense_norms(dense, one, ids)),
        "routes": set().union(*done.routes.values()),
        "bookkeeping": _bookkeeping_vs_second_pass(losses, shards, tree_spec, ids),
    }


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_hugging_face_llama(pool, tied):
    pytest.importorskip("transformers")
    for r in pool.run(_llama_task, tied):
        assert r["rel"] <= 1e-5 and r["bookkeeping"] <= 1e-5
        assert "fallback" not in r["routes"]  # every Llama layer has its formula
        assert {"embedding", "mul"} <= r["routes"] or tied
        assert ("summed" in r["routes"]) == tied  # the tied weight: embedding and head


# -- DP-SGD's step against the dense reference ---------------------------------------------------


def _mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        *(torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Tanh()) for _ in range(3))
    )


def _xy(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7 + rank)
    return torch.randn(B, D, generator=gen), torch.randn(B, D, generator=gen)


def _per_example(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).square().mean(-1)


def _dpsgd_task(method: str) -> dict:
    model = _mlp()
    shards, tree_spec = fh.shard_module(model, dist_preset("hsdp"), units=list(model))
    mg = fh.MainGrad(tree_spec, like=shards)
    x, y = _xy(dist.get_rank())
    if method == "bookkeeping":  # one pass: the clipped gradient, reduced (the mean over ranks)
        losses = lambda s, x, y: _per_example(fh.functional_call(model, s, x), y)  # noqa: E731
        grads, _ = fh.ghost_clipped_grad(losses, shards, x, y, max_norm=CLIP)
        grads = fh.reduce_grads(grads, tree_spec, last=True, at="gradient")
        with torch.no_grad():  # clipped sum / B: the mean over the global batch
            torch._foreach_add_(
                optree.tree_leaves(shards), optree.tree_leaves(grads), alpha=-LR / B
            )
        full = fh.gather(shards, tree_spec)
        return {f"{k}.{n}": t for k, unit in full.items() for n, t in unit.items()}
    if method == "ghost":
        losses = lambda s, x, y: _per_example(fh.functional_call(model, s, x), y)  # noqa: E731
        norms = fh.ghost_grad_norms(losses, shards, x, y)
    else:
        one = lambda s, xy: _per_example(
            fh.functional_call(model, s, xy[0][None]), xy[1][None]
        ).sum()  # noqa: E731
        norms = fh.per_example_grad_norms(one, shards, (x, y))
    scale = (CLIP / (norms + 1e-6)).clamp(max=1.0)
    mg.begin_microbatch(last=True)
    torch.func.grad(
        lambda s: (_per_example(fh.functional_call(model, s, x, into=mg), y) * scale).mean()
    )(shards)
    mg.finish()
    with torch.no_grad():
        leaves = optree.tree_leaves(shards)
        torch._foreach_add_(leaves, optree.tree_leaves(mg.grads), alpha=-LR)
    full = fh.gather(shards, tree_spec)
    return {f"{k}.{n}": t for k, unit in full.items() for n, t in unit.items()}


def _dense_dpsgd() -> dict:
    """Every rank's examples: each example's gradient clipped, the mean, one SGD step."""
    model = _mlp()
    full = {k: v.detach() for k, v in model.named_parameters()}
    x, y = (torch.cat(t) for t in zip(*(_xy(r) for r in range(4))))
    one = lambda p, xb, yb: _per_example(
        torch.func.functional_call(model, p, (xb[None],)), yb[None]
    ).sum()  # noqa: E731
    g = torch.func.vmap(torch.func.grad(one), in_dims=(None, 0, 0))(full, x, y)
    norms = sum(t.flatten(1).square().sum(1) for t in g.values()).sqrt()
    scale = (CLIP / (norms + 1e-6)).clamp(max=1.0)
    return {
        k: full[k] - LR * (t * scale.view(-1, *[1] * (t.dim() - 1))).mean(0) for k, t in g.items()
    }


def test_dp_sgd_step_equals_the_dense_reference_and_the_vmap_path(pool):
    ghost_runs, vmap_runs = pool.run(_dpsgd_task, "ghost"), pool.run(_dpsgd_task, "vmap")
    bookkeeping_runs = pool.run(_dpsgd_task, "bookkeeping")
    want = _dense_dpsgd()
    for got, with_vmap, one_pass in zip(ghost_runs, vmap_runs, bookkeeping_runs):
        for k, w in want.items():
            assert _rel_tensor(got[k], w) <= 1e-5
            assert _rel_tensor(got[k], with_vmap[k]) <= 1e-6
            assert _rel_tensor(one_pass[k], w) <= 1e-5


def _rel_tensor(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()

"""Matrix optimizers on 4 real gloo processes (2x2 mesh), one pool for the module.

fh.partition(fh.muon, fh.adamw) on hsdp, hfsdp, owned(hsdp), owned(hsdp, "dp_outer") and
owned(hsdp, "dp_inner"), with 1
and 3 microbatches (and
on an HSDP-style Shard(1) spec tree with 3),
gives torch.optim.Muon + torch.optim.AdamW's parameters on the dense mean gradient; per_matrix
runs fn once per matrix over all the ranks, with one collective per bucket per axis; the
partition state checkpoints through DCP and resumes on another mesh shape.
"""

from __future__ import annotations

import optree
import pytest
import torch
import torch.distributed.checkpoint as dcp
from reference import (
    AXES,
    MUON_SHAPES,
    NCCL_STYLE,
    accumulate,
    carried_as,
    dense_reduce,
    dist_mesh,
    fh_muon_adamw,
    max_error,
    preset,
    random_tree,
    this_rank,
    torch_muon_adamw,
    torch_muon_in,
)
from test_matrix import _llama_layer

import functional_hsdp as fh
from functional_hsdp.mesh.launch import device_mesh

MUON_KW, ADAMW_KW, STEPS = {"lr": 0.02}, {"lr": 1e-3, "weight_decay": 0.01}, 3
STRATEGIES = ("hsdp", "hfsdp", "owned", "owned_outer")
# owned_inner: owners within each outer replica (optimizer [Replicate, Owner])
CASES = [(s, m) for s in (*STRATEGIES, "owned_inner") for m in (1, 3)] + [("shard1", 3)]
NS = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _spec(strategy: str, mesh) -> fh.Spec | dict:
    if strategy == "shard1":  # HSDP-style Shard(1) for the matrices, Shard(0) for 1-D leaves
        R, P = fh.Replicate(), fh.Partial("avg")
        dims = {k: 1 if len(s) > 1 else 0 for k, s in MUON_SHAPES.items()}
        return {
            k: fh.Spec(mesh, [R, fh.Shard(d)], [P, fh.Shard(d)], [R, fh.Shard(d)])
            for k, d in dims.items()
        }
    if strategy == "owned":
        return fh.owned(preset("hsdp", mesh))
    if strategy == "owned_outer":
        return fh.owned(preset("hsdp", mesh), "dp_outer")
    if strategy == "owned_inner":
        return fh.owned(preset("hsdp", mesh), "dp_inner")
    return preset(strategy, mesh)


def _grads(step: int, microbatches: int) -> list:
    """Every rank's microbatch gradients of a step (the mesh dims in front), scaled by 1/M."""
    micro = [
        random_tree((2, 2), seed=100 * step + m, shapes=MUON_SHAPES) for m in range(microbatches)
    ]
    return [optree.tree_map(lambda g: g / microbatches, g) for g in micro]


def _train_fh(strategy: str, microbatches: int, ns: str):
    spec = _spec(strategy, dist_mesh())
    params = fh.shard(random_tree((), seed=20, shapes=MUON_SHAPES), spec)
    opt = fh_muon_adamw(spec, dict(MUON_KW, ns_dtype=NS[ns]), ADAMW_KW)
    state = opt.init(params)
    for step in range(STEPS):
        acc = accumulate([this_rank(g) for g in _grads(step, microbatches)], spec)
        updates, state = opt.update(acc, state, params)
        params = fh.apply_updates(params, updates)
    return fh.gather(params, spec)


def _every_case():
    return {(s, m, ns): _train_fh(s, m, ns) for s, m in CASES for ns in NS}


def _torch(microbatches: int, ns: str):
    dense, step = torch_muon_adamw(random_tree((), seed=20, shapes=MUON_SHAPES), MUON_KW, ADAMW_KW)
    for t in range(STEPS):
        mean = dense_reduce(_grads(t, microbatches), 2)
        for k, p in dense.items():
            p.grad = mean[k].float()
        with torch_muon_in(NS[ns]):
            step()
    return {k: p.detach().double() for k, p in dense.items()}


def test_muon_and_adamw_on_4_ranks_equal_torch_on_the_dense_mean_gradient(pool):
    results = pool.run(_every_case)
    refs = {(m, ns): _torch(m, ns) for m in (1, 3) for ns in NS}
    for case, got in results[0].items():
        ref = refs[case[1:]]
        assert max_error({k: v[None] for k, v in got.items()}, ref) < 5e-6, case
        for other in results[1:]:  # every rank gathers the same parameters
            assert all(torch.equal(got[k], other[case][k]) for k in got)


# -- fn runs once per matrix over the whole mesh ------------------------------------------------

MATRICES = {f"w{k}": (8 + k, 12) for k in range(9)}  # 9 matrices of 9 shapes, on 4 ranks


def _count(strategy: str, carriage=None):
    if carriage is not None:  # the collectives NCCL takes (functional), carried by gloo
        with carried_as(carriage):
            return _count(strategy)
    spec = _spec(strategy, dist_mesh())
    params = fh.shard(random_tree((), seed=1, shapes=MATRICES), spec)
    seen = []

    def fn(x):
        seen.extend(tuple(m.shape) for m in x)
        return 2 * x

    with fh.comm_log() as log:
        out = fh.per_matrix(fn, params, spec)
    doubled = fh.gather(out, spec)
    full = fh.gather(params, spec)
    exact = all(torch.equal(doubled[k], 2 * full[k]) for k in full)
    held = torch._C._distributed_c10d._get_work_registry_size()  # functional, unwaited
    return seen, exact and held == 0, [(e.op, e.axis, e.impl) for e in log.events]


@pytest.mark.parametrize("carriage", ["c10d", "functional"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fn_runs_once_per_matrix_across_the_ranks(pool, strategy, carriage):
    results = pool.run(_count, strategy, NCCL_STYLE if carriage == "functional" else None)
    seen = sorted(s for r in results for s in r[0])
    assert seen == sorted(MATRICES.values())  # each matrix once, on one of the 4 ranks
    assert all(r[1] for r in results)
    events = {tuple(e[:2] for e in r[2]) for r in results}
    assert len(events) == 1  # every rank issued the same collectives
    impl = {e[2] for r in results for e in r[2] if e[0] == "all_to_all"}
    assert impl <= {"native" if carriage == "functional" else "c10d all_to_all_single"}
    expected = {
        "hsdp": [("all_to_all", "dp_inner")] * 2 + [("all_gather", "dp_outer")],
        "hfsdp": [("all_to_all", "dp_inner"), ("all_to_all", "dp_outer")] * 2,
        "owned": [],  # the matrices are at their owners already
        "owned_outer": [("all_to_all", "dp_inner")] * 2,  # the outer owners keep the results
    }[strategy]
    assert sorted(events.pop()) == sorted(expected)  # one bucket: one per axis and way


# -- Shard(d) specs: each rank's torch.chunk to the owners and back ------------------------------

# on 4 ranks: uneven chunks along both dims, empty ones ((9, 12) along 0, (8, 3) along 1)
SHARD_MATRICES = {f"w{k}": (8 + k, 3 + 2 * k) for k in range(5)}


def _shard_count(shape: tuple[int, int], dim: int):
    """per_matrix of a whole-matrix fn on a Shard(dim) spec over dp_inner (dp_outer Replicate)."""
    R, P, S = fh.Replicate(), fh.Partial("avg"), fh.Shard(dim)
    spec = fh.Spec(fh.DistMesh(device_mesh(shape, AXES)), [R, S], [P, S], [R, S])
    full = random_tree((), seed=1, shapes=SHARD_MATRICES)
    seen = []

    def fn(x):
        seen.extend(tuple(m.shape) for m in x)
        return x @ x.mT @ x

    with fh.comm_log() as log:
        out = fh.per_matrix(fn, fh.shard(full, spec), spec)
    got = fh.gather(out, spec)
    error = max((got[k] - full[k] @ full[k].mT @ full[k]).abs().max().item() for k in full)
    return seen, error, [(e.op, e.axis) for e in log.events]


@pytest.mark.parametrize("shape, dim", [((1, 4), 0), ((1, 4), 1), ((2, 2), 1)], ids=str)
def test_per_matrix_on_a_shard_spec_runs_fn_once_per_whole_matrix(pool, shape, dim):
    results = pool.run(_shard_count, shape, dim)
    seen = sorted(s for r in results for s in r[0])
    assert seen == sorted(SHARD_MATRICES.values())  # each matrix once, on one of the 4 ranks
    assert all(r[1] < 1e-4 for r in results)
    events = {tuple(r[2]) for r in results}
    assert len(events) == 1  # every rank issued the same collectives
    expected = [("all_to_all", "dp_inner")] * 2 + [("all_gather", "dp_outer")] * (shape[0] > 1)
    assert sorted(events.pop()) == sorted(expected)  # one bucket: one per axis and way


# -- checkpoints: the partition state (Muon's momentum, AdamW's moments) through DCP -----------


def _resume(path: str, strategy: str):
    """Train 2 steps on a 2x2 owned(hsdp) (or owned over dp_outer), save, go on 2 steps; load
    on 2x2 and 1x4 and go on the same 2 steps: the same parameters (bit for bit on 2x2)."""
    out = {}
    spec = _spec(strategy, dist_mesh())
    full0 = random_tree((), seed=20, shapes=MUON_SHAPES)
    params = fh.shard(full0, spec)
    opt = fh_muon_adamw(spec, MUON_KW, ADAMW_KW)
    state = opt.init(params)

    def train(params, state, spec, first):
        opt = fh_muon_adamw(spec, MUON_KW, ADAMW_KW)
        for t in range(first, first + 2):
            acc = accumulate([this_rank(g) for g in _grads(t, 2)], spec)
            updates, state = opt.update(acc, state, params)
            params = fh.apply_updates(params, updates)
        return params, state

    params, state = train(params, state, spec, 0)
    dcp.save(
        {"params": fh.state_dict(params, spec), "optim": fh.state_dict(state, spec)},
        checkpoint_id=path,
    )
    ref = fh.gather(train(params, state, spec, 2)[0], spec)
    like = optree.tree_map(lambda x: torch.empty_like(x, device="meta"), full0)
    for shape in ((2, 2), (1, 4)):
        spec2 = _spec(strategy, fh.DistMesh(device_mesh(shape, AXES)))
        opt2 = fh_muon_adamw(spec2, MUON_KW, ADAMW_KW)
        target = {
            "params": fh.empty_state_dict(like, spec2),
            "optim": fh.empty_state_dict(opt2.init(like), spec2),
        }
        dcp.load(target, checkpoint_id=path)
        p2 = fh.load_state_dict(target["params"], spec2, like)
        s2 = fh.load_state_dict(target["optim"], spec2, opt2.init(like))
        assert s2.inner["muon"].count == 2 and isinstance(s2.inner["muon"], fh.MuonState)
        out[shape] = fh.gather(train(p2, s2, spec2, 2)[0], spec2)
    return ref, out, sorted(fh.state_dict(state, spec)["muon"]["momentum"])


@pytest.mark.parametrize("strategy", ["owned", "owned_outer"])
def test_partition_state_checkpoints_and_resumes_on_another_mesh(pool, tmp_path, strategy):
    for ref, out, saved in pool.run(_resume, str(tmp_path), strategy):
        assert saved == ["w1", "w2", "w3"]  # Muon's momentum: its own leaves only
        for k in ref:
            assert torch.equal(out[(2, 2)][k], ref[k]), k
            torch.testing.assert_close(out[(1, 4)][k], ref[k], rtol=1e-5, atol=1e-5, msg=k)


# -- an existing nn.Module: shard_module + functional_call into a MainGrad ------------------------


def _net():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(16, 1))


def _net_batches(step: int, rank: int) -> list:
    gen = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(2, 5, 6, generator=gen)
    return [(xm, torch.sin(xm.sum(-1, keepdim=True))) for xm in x]


def _module_task(strategy: str):
    """The module's own forward through fh.functional_call, gradients into a MainGrad, Muon
    on the Linear weights (but the last, a row) and AdamW on the rest; main weights at the
    optimizer placement, the forward's shards from sync_params."""
    import torch.distributed as dist

    net = _net()
    spec = _spec(strategy, dist_mesh())
    main, tree_spec = fh.shard_module(net, spec, units=[net[0], net[2]])
    mg = fh.MainGrad(tree_spec, like=main)
    labels = lambda path, leaf: "muon" if path[-1] == "weight" and path[0] else "adamw"  # noqa: E731
    opt = fh.partition(
        {"muon": fh.muon(tree_spec, **MUON_KW), "adamw": fh.adamw(**ADAMW_KW)}, labels
    )
    state = opt.init(main)
    loss = lambda s, x, y: (
        torch.nn.functional.mse_loss(  # noqa: E731
            fh.functional_call(net, s, (x,), into=mg), y
        )
        / 2
    )
    for step in range(2):
        shards = fh.sync_params(main, tree_spec)
        for (x, y), _ in fh.microbatches(_net_batches(step, dist.get_rank()), into=mg):
            torch.func.grad(loss)(shards, x, y)
        mg.finish()
        updates, state = opt.update(mg.grads, state, main)
        main = fh.apply_updates(main, updates)
        mg.zero_grad()
    full = fh.gather(main, tree_spec)
    return {f"{unit}.{k}" if unit else k: v for unit, ps in full.items() for k, v in ps.items()}


def _module_dense() -> dict:
    net = _net()
    named = dict(net.named_parameters())
    hidden = [p for k, p in named.items() if k in ("0.weight", "2.weight")]
    rest = [p for k, p in named.items() if k not in ("0.weight", "2.weight")]
    muon, adamw = torch.optim.Muon(hidden, **MUON_KW), torch.optim.AdamW(rest, **ADAMW_KW)
    for step in range(2):
        for r in range(4):
            for x, y in _net_batches(step, r):
                (torch.nn.functional.mse_loss(net(x), y) / 2 / 4).backward()
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
    return {k: p.detach() for k, p in named.items()}


@pytest.mark.parametrize("strategy", ["hsdp", "owned", "owned_outer"])
def test_muon_through_shard_module_and_functional_call_equals_torch(pool, strategy):
    ref = _module_dense()
    for got in pool.run(_module_task, strategy):
        assert sorted(got) == sorted(ref)
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=0, atol=5e-6, msg=k)


# -- owned over dp_outer: each rank sends over dp_outer exactly what AdamW-HSDP's sends ---------


def _llama_units(d: int = 32, layers: int = 4) -> dict:
    """One unit per Llama decoder layer (transformers' shapes: hidden d, MLP 4 d, half as
    many key-value heads): 15 d^2 of matrices that no owner layout of 4 ranks balances."""
    return {f"layer{u}": _llama_layer(d) for u in range(layers)}


def _outer_sent(strategy: str, equal: bool = False):
    """This rank's dp_outer bytes over one step (3 microbatches, the optimizer, the weights
    back to the parameter placement): AdamW on hsdp, or Muon + AdamW on owned over dp_outer.
    Ring all-reduce: 2 (n - 1) / n of its input; all-to-all: what it sends to the others."""
    shapes = _llama_units()
    if equal:  # every rank keeps as much: the mesh's own reduce-scatter and all-gather
        shapes = {u: {f"w{k}": (32, 32) for k in range(8)} for u in shapes}
    spec = _spec(strategy, dist_mesh())
    tree_spec = {u: spec for u in shapes}
    params = fh.shard(random_tree((), seed=3, shapes=shapes), tree_spec)
    if strategy == "hsdp":
        opt = fh.adamw(lr=1e-3)
    else:
        labels = lambda path, leaf: "adamw" if "norm" in path[-1] else "muon"  # noqa: E731
        opt = fh.partition({"muon": fh.muon(tree_spec), "adamw": fh.adamw(lr=1e-3)}, labels)
    state = opt.init(params)
    micro = [this_rank(random_tree((2, 2), seed=m, shapes=shapes)) for m in range(3)]
    with fh.comm_log() as log:
        grads = accumulate(micro, tree_spec)
        updates, state = opt.update(grads, state, params)
        new = fh.sync_params(fh.apply_updates(params, updates), tree_spec)
    sent = 0
    for e in log.events:
        if e.axis != "dp_outer":
            continue
        if e.sent is not None:  # an all-to-all: what this rank sends to the others
            sent += e.sent[0] * e.dtype.itemsize
        else:  # 2 ranks: all-reduce 2 (n - 1) / n of its input, reduce-scatter (n - 1) / n,
            ring = {"all_reduce": 1, "reduce_scatter": 0.5, "all_gather": 1}[e.op]  # all-gather
            sent += e.numel * ring * e.dtype.itemsize  # n - 1 times
    return sent, fh.gather(new, tree_spec)


@pytest.mark.parametrize("equal", [False, True], ids=["llama", "equal"])
def test_owned_outer_sends_adamw_hsdps_outer_bytes_on_every_rank(pool, equal):
    """Units of one Llama layer each (owner-major owned(hsdp) pads them 16/15): with Owner on
    dp_outer only, every rank sends over dp_outer exactly what it sends with AdamW on HSDP
    (uneven all-to-alls); so with units of equal matrices (the mesh's own collectives)."""
    hsdp = pool.run(_outer_sent, "hsdp", equal)
    outer = pool.run(_outer_sent, "owned_outer", equal)
    assert all(h[0] > 0 for h in hsdp)
    assert [o[0] for o in outer] == [h[0] for h in hsdp]


def _untagged_role():
    """Owner on dp_outer, one matrix: ranks (0, i) keep their whole chunk, so a copy of
    sync_params' result (no tag) looks like the optimizer placement there and like the
    parameter placement on ranks (1, i)."""
    spec = _spec("owned_outer", dist_mesh())
    full = random_tree((), seed=4, shapes={"w": (8, 8)})
    weights = fh.sync_params(fh.shard(full, spec), spec)
    copy = {k: v.clone() for k, v in weights.items()}
    try:
        fh.gather(copy, spec)
        error = ""
    except ValueError as e:
        error = str(e)
    got = fh.gather(copy, spec, source="parameter")
    # apply_updates' result keeps the weights' tag: read at their placement on every rank
    stepped = fh.apply_updates(weights, {k: torch.ones_like(v) for k, v in weights.items()})
    tagged = fh.gather(stepped, spec)
    return error, torch.equal(got["w"], full["w"]), torch.equal(tagged["w"], full["w"] + 1)


def test_an_untagged_tree_read_otherwise_by_some_ranks_raises_on_every_rank(pool):
    for error, exact, tagged in pool.run(_untagged_role):
        assert "from optimizer" in error and "from parameter" in error, error
        assert exact  # source= names the placement
        assert tagged  # no source= needed for apply_updates' result

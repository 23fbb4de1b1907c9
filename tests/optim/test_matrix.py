"""The owner placement and per_matrix on SimMesh: every preset and its owned() form, against
fn applied to each dense leaf; fn runs once per leaf; collectives per bucket, not per leaf."""

from __future__ import annotations

import math
import re

import optree
import pytest
import torch
from reference import (
    AXES,
    MUON_SHAPES,
    STRATEGIES,
    accumulate,
    dense_reduce,
    fh_muon_adamw,
    hidden,
    max_error,
    preset,
    random_tree,
    torch_muon_adamw,
    torch_muon_in,
)

import functional_hsdp as fh
from functional_hsdp.plan.owner import balance, owner_of_slot

MESHES = [(2, 2), (1, 4), (2, 3)]
# matrices of several shapes: some span several Flat chunks, three share a shape, one is a
# 3-D stack, "big" outweighs the others together on some meshes
MATRICES = {
    "a": (7, 3),
    "z": (13, 11),
    "l": [(4, 6), (4, 6), (4, 6)],
    "e": (2, 3, 5),
    "big": (40, 9),
}


def _mesh(shape) -> fh.SimMesh:
    return fh.SimMesh(dict(zip(AXES, shape)))


def _full(seed=0, shapes=MATRICES):
    return random_tree((), seed=seed, shapes=shapes)


def _fn(x):
    """Needs the whole matrix: a product and its norm."""
    return x @ x.mT @ x / (1 + x.norm(dim=(-2, -1), keepdim=True))


class Counting:
    """fn, counting the matrices it is given and recording each call's shape."""

    def __init__(self, fn=_fn):
        self.fn, self.matrices, self.calls = fn, 0, []

    def __call__(self, x):
        self.matrices += x.shape[0]
        self.calls.append(tuple(x.shape))
        return self.fn(x)


def _replicas(spec) -> int:
    """How many times an owned spec runs fn on a leaf: once per coordinate of its Replicate
    optimizer axes (Owner on the others); 1 for every other spec."""
    if not spec.owner_axes:
        return 1
    names = spec.mesh.axis_names
    return math.prod(
        spec.mesh.size(a) for a in spec.dp_axes if spec.optimizer[names.index(a)] == fh.Replicate()
    )


def _specs(strategy, shape):
    """The preset, its owned form, and (hsdp, hfsdp) Owner on dp_outer only."""
    spec = preset(strategy, _mesh(shape))
    outer = [fh.owned(spec, "dp_outer")] if strategy in ("hsdp", "hfsdp") else []
    inner = [fh.owned(spec, "dp_inner")] if strategy in ("hsdp", "ddp") else []
    outer += [fh.owned(spec, "dp_outer")] if strategy == "ddp" else []
    return [spec, fh.owned(spec), *outer, *inner]


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_per_matrix_equals_fn_of_each_dense_leaf_once(strategy, shape):
    full = _full()
    for spec in _specs(strategy, shape):
        fn = Counting()
        out = fh.per_matrix(fn, fh.shard(full, spec), spec)
        ref = optree.tree_map(_fn, full)
        assert max_error(fh.gather(out, spec), ref) < 1e-5
        # once per leaf on the whole mesh; an owned spec's Replicate axes each compute their own
        assert fn.matrices == len(optree.tree_leaves(full)) * _replicas(spec)
        # the three (4, 6) leaves share one call where they share a bucket (here: always)
        assert (3 * _replicas(spec), 4, 6) in fn.calls


def test_the_old_masked_spellings_warn_and_are_masked_node():
    """``fh.Masked`` / ``fh.masked`` (optax reads ``masked`` as a combinator) are the
    deprecated names of ``fh.MaskedNode`` / ``fh.masked_node``: the same objects."""
    with pytest.warns(DeprecationWarning, match=r"fh\.masked is deprecated: use fh\.masked_node"):
        make = fh.masked
    with pytest.warns(DeprecationWarning, match=r"fh\.Masked is deprecated: use fh\.MaskedNode"):
        from functional_hsdp import Masked
    assert make is fh.masked_node and Masked is fh.MaskedNode
    leaf = make(torch.ones(2, 3))
    assert isinstance(leaf, Masked) and type(leaf) is type(fh.masked_node(torch.ones(2, 3)))
    assert repr(leaf) == "MaskedNode(shape=(2, 3), dtype=torch.float32)"
    assert not {"Masked", "masked"} & set(fh.__all__)
    with pytest.raises(AttributeError, match="has no attribute 'mask'"):
        fh.mask  # noqa: B018


def test_per_matrix_on_a_final_reduce_grads_result_and_masked_leaves():
    shape = (2, 2)
    spec = preset("hsdp", _mesh(shape))
    micro = [random_tree(shape, seed=m, shapes=MATRICES) for m in range(3)]
    final = accumulate(micro, spec)
    dense = dense_reduce(micro, len(shape))
    tree = dict(final, a=fh.masked_node(final["a"]))
    fn = Counting()
    out = fh.per_matrix(fn, tree, spec)
    assert isinstance(out["a"], fh.MaskedNode)
    assert fn.matrices == len(optree.tree_leaves(dense)) - 1
    out["a"] = final["a"]  # (unchanged by per_matrix: only to gather the rest)
    got = fh.gather(out, spec)
    ref = optree.tree_map(lambda x: _fn(x.float()), dense)
    assert (
        max_error(
            {k: v for k, v in got.items() if k != "a"}, {k: v for k, v in ref.items() if k != "a"}
        )
        < 1e-4
    )


@pytest.mark.parametrize("strategy", ["hsdp", "owned", "owned_outer"])
def test_collectives_per_bucket_not_per_leaf(strategy):
    spec = fh.hsdp(_mesh((2, 2)), *AXES, bucket_cap_mb=2000 * 4 / 2**20)  # ~2000 elements
    spec = {"hsdp": spec, "owned": fh.owned(spec), "owned_outer": fh.owned(spec, "dp_outer")}[
        strategy
    ]
    owned = strategy == "owned"
    for n in (8, 32):
        full = {f"w{k}": torch.randn(10, 12) for k in range(n)}
        params = fh.shard(full, spec)
        with fh.comm_log() as log:
            fh.per_matrix(Counting(), params, spec)
        buckets = math.ceil(n * 120 / (2000 * (4 if owned else 1)))
        if owned:
            assert log.events == []  # the leaves are at their owners already
        elif strategy == "hsdp":  # one all-to-all there and one back per bucket, one
            assert log.count("all_to_all", "dp_inner") == 2 * buckets  # all-gather over outer
            assert log.count("all_gather", "dp_outer") == buckets
            assert log.count() == 3 * buckets
        else:  # owned_outer: a pair per bucket where a leaf straddles two inner chunks (each
            # leaf's owner holds most of it); the results stay with the outer owners
            pairs = log.count("all_to_all", "dp_inner")
            assert pairs % 2 == 0 and pairs <= 2 * buckets
            assert log.count() == pairs


def test_owned_outer_per_matrix_moves_only_the_pieces_of_straddling_leaves():
    """Owner on dp_outer only: each leaf's owner is the inner rank whose chunk holds most of
    it. Four equal matrices in two inner chunks: no collective at all. A Llama layer: one
    all-to-all pair over dp_inner, carrying only the gate matrix's piece in the other chunk."""
    mesh = _mesh((2, 2))
    spec = fh.owned(fh.hsdp(mesh, *AXES), "dp_outer")
    for shapes, moved in (
        ({f"w{k}": (16, 16) for k in range(4)}, 0),
        ({k: v for k, v in _llama_layer(32).items() if len(v) == 2}, None),
    ):
        full = _full(shapes=shapes)
        fn = Counting()
        with fh.comm_log() as log:
            out = fh.per_matrix(fn, fh.shard(full, spec), spec)
        assert fn.matrices == len(full)  # each matrix once
        assert max_error(fh.gather(out, spec), optree.tree_map(_fn, full)) < 1e-4
        sent = [sum(e.sent) for e in log.events]
        if moved == 0:
            assert log.events == []
        else:  # a pair of all-to-alls over dp_inner, carrying less than a matrix each way
            assert [(e.op, e.axis) for e in log.events] == [("all_to_all", "dp_inner")] * 2
            assert 0 < sent[0] == sent[1] < 2 * 4 * 32 * 32  # the two outer replicas' pieces


def test_a_leaf_of_fewer_than_two_dims_is_refused_with_its_path():
    spec = fh.hsdp(_mesh((2, 2)), *AXES)
    params = fh.shard({"w": torch.ones(3, 3), "norm": {"bias": torch.ones(3)}}, spec)
    with pytest.raises(ValueError, match=re.escape("tree['norm']['bias']: per_matrix needs")):
        fh.per_matrix(_fn, params, spec)


def test_fn_must_return_the_shape_it_was_given():
    spec = fh.ddp(_mesh((2, 2)))
    params = fh.shard({"w": torch.ones(3, 4)}, spec)
    with pytest.raises(ValueError, match=re.escape("tree['w']: per_matrix's fn must return")):
        fh.per_matrix(lambda x: x.mT, params, spec)


def test_on_a_non_data_parallel_axis_each_coordinate_runs_its_own():
    mesh = fh.SimMesh({"tp": 2, "dp": 2})
    for spec in (fh.fsdp(mesh, "dp"), fh.owned(fh.fsdp(mesh, "dp"))):
        full = {"w": torch.randn(2, 1, 5, 4).expand(2, 2, 5, 4).contiguous()}  # per tp rank
        fn = Counting()
        out = fh.gather(fh.per_matrix(fn, fh.shard(full, spec, stacked=True), spec), spec)
        assert fn.matrices == 2  # one per tp coordinate
        torch.testing.assert_close(out["w"], _fn(full["w"]))


# -- Shard(d) specs: each rank's chunks to the owners and back ------------------------------------

R, P = fh.Replicate(), fh.Partial("avg")
# on 3, 4 or 6 ranks: uneven chunks along dim 0 and 1, empty ones ((1, 6) along 0 on any of
# them, (7, 3) along 1 on 4), a 3-D stack
SHARD_MATRICES = {**MATRICES, "row": (1, 6), "thin": (6, 2)}
# (mesh sizes, where the Shard(d) is): "inner" HSDP-style (dp_outer Replicate), "outer" the
# other way round, "zero2" a Replicate parameter and gradient, "dp" a 1-D mesh
SHARD_CASES = [
    ({"dp": 4}, "dp"),
    ({"dp": 3}, "dp"),
    ({"dp_outer": 2, "dp_inner": 2}, "inner"),
    ({"dp_outer": 2, "dp_inner": 3}, "inner"),
    ({"dp_outer": 2, "dp_inner": 3}, "outer"),
    ({"dp_outer": 3, "dp_inner": 2}, "zero2"),
]


def _shard_spec(mesh, dim, where, **kw):
    S = fh.Shard(dim)
    placements = {
        "dp": ([S], [S], [S]),
        "inner": ([R, S], [P, S], [R, S]),
        "outer": ([S, R], [S, P], [S, R]),
        "zero2": ([R, R], [P, P], [R, S]),
    }[where]
    return fh.Spec(mesh, *placements, **kw)


def _first_exchange_elements(spec, full) -> int:
    """Elements the first all-to-all of the route to the owners moves, over the whole mesh."""
    from functional_hsdp.plan.lookup import plan_for
    from functional_hsdp.plan.owner import Exchange, route

    leaves, treedef = optree.tree_flatten(full)
    paths = tuple(f"t{p}" for p in treedef.paths())
    n = len(leaves)
    plan = plan_for(
        leaves, treedef, paths, specs=(spec,) * n, units=(0,) * n, shapes=[x.shape for x in leaves]
    )
    (r,) = route(plan, (True,) * n)
    return int(next(x for x in r.there if isinstance(x, Exchange)).counts.sum())


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("sizes, where", SHARD_CASES, ids=lambda x: str(x))
def test_per_matrix_on_shard_specs_equals_fn_of_each_dense_leaf_once(sizes, where, dim):
    mesh = fh.SimMesh(sizes)
    spec = _shard_spec(mesh, dim, where)
    full = _full(shapes=SHARD_MATRICES)
    fn = Counting()
    with fh.comm_log() as log:
        out = fh.per_matrix(fn, fh.shard(full, spec), spec)
    ref = optree.tree_map(_fn, full)
    assert max_error(fh.gather(out, spec), ref) < 1e-5
    # the local shards of fn(whole leaf): torch.chunk's, zero-filled past an uneven chunk
    assert max_error(out, fh.shard(ref, spec)) < 1e-5
    assert fn.matrices == len(optree.tree_leaves(full))  # once per leaf, whole mesh
    assert (3, 4, 6) in fn.calls  # the three (4, 6) leaves share one call
    shard_axis, replicated = spec.shard[0], [a for a in mesh.axis_names if a != spec.shard[0]]
    assert log.count("all_to_all", shard_axis) == 2  # one bucket: there and back
    assert all(log.count("all_gather", a) == 1 for a in replicated)
    assert log.count() == 2 + len(replicated)
    # each element travels once: no chunk padding, nothing twice from the replicas
    assert _first_exchange_elements(spec, full) == sum(x.numel() for x in optree.tree_leaves(full))


def test_per_matrix_on_shard_specs_collectives_per_bucket_not_per_leaf():
    spec = _shard_spec(_mesh((2, 2)), 1, "inner", bucket_cap_mb=2000 * 4 / 2**20)
    for n in (8, 32):
        full = {f"w{k}": torch.randn(10, 13) for k in range(n)}
        with fh.comm_log() as log:
            out = fh.per_matrix(Counting(), fh.shard(full, spec), spec)
        buckets = math.ceil(n * 130 / 2000)
        assert log.count("all_to_all", "dp_inner") == 2 * buckets
        assert log.count("all_gather", "dp_outer") == log.count() // 3 == buckets
        assert max_error(fh.gather(out, spec), optree.tree_map(_fn, full)) < 1e-5


def test_per_matrix_on_a_tree_of_flat_owner_and_shard_specs():
    mesh = _mesh((2, 3))
    tree_spec = {
        "flat": fh.hsdp(mesh, *AXES),
        "owned": fh.owned(fh.hsdp(mesh, *AXES)),
        "rows": _shard_spec(mesh, 0, "inner"),
        "cols": _shard_spec(mesh, 1, "outer"),
    }
    full = {k: _full(seed=s) for s, k in enumerate(tree_spec)}
    fn = Counting()
    out = fh.per_matrix(fn, fh.shard(full, tree_spec), tree_spec)
    assert max_error(fh.gather(out, tree_spec), optree.tree_map(_fn, full)) < 1e-5
    assert fn.matrices == len(optree.tree_leaves(full))


def test_per_matrix_on_a_shard_spec_with_a_non_data_parallel_axis():
    mesh = fh.SimMesh({"tp": 2, "dp": 3})
    S = fh.Shard(1)
    spec = fh.Spec(mesh, [R, S], [R, S], [R, S], dp_axes="dp")
    full = {"w": torch.randn(2, 1, 5, 7).expand(2, 3, 5, 7).contiguous()}  # per tp rank
    fn = Counting()
    out = fh.gather(fh.per_matrix(fn, fh.shard(full, spec, stacked=True), spec), spec)
    assert fn.matrices == 2  # one per tp coordinate
    torch.testing.assert_close(out["w"], _fn(full["w"]))


# -- the owner layout ---------------------------------------------------------------------------


def test_balance_gives_largest_first_to_the_least_loaded():
    assert balance([4, 1, 3, 2], 2) == [0, 0, 1, 1]
    sizes = [9, 7, 6, 5, 5, 4, 3, 2, 2, 1]
    owner = balance(sizes, 3)
    loads = [sum(s for s, k in zip(sizes, owner) if k == r) for r in range(3)]
    assert max(loads) - min(loads) <= max(sizes)


def _largest_first(sizes, n):
    """The heaviest load of largest-first assignment alone (each item to the least loaded)."""
    loads = [0] * n
    for s in sorted(sizes, reverse=True):
        loads[loads.index(min(loads))] += s
    return max(loads)


def _heaviest(sizes, owner, n):
    return max(sum(s for s, k in zip(sizes, owner) if k == r) for r in range(n))


def test_balance_evens_what_largest_first_leaves_uneven():
    sizes = [3, 3, 2, 2, 2]  # largest first: 3 + 2 + 2 against 3 + 2
    assert _largest_first(sizes, 2) == 7
    assert _heaviest(sizes, balance(sizes, 2), 2) == 6  # 3 + 3 against 2 + 2 + 2
    gen = torch.Generator().manual_seed(0)
    better = 0
    for _ in range(300):
        n = int(torch.randint(2, 5, (), generator=gen))
        sizes = torch.randint(1, 30, (int(torch.randint(1, 12, (), generator=gen)),), generator=gen)
        sizes = sizes.tolist()
        owner = balance(sizes, n)
        loads = [sum(s for s, k in zip(sizes, owner) if k == r) for r in range(n)]
        assert max(loads) <= _largest_first(sizes, n)
        assert max(loads) - min(loads) <= max(sizes)
        assert max(loads) >= max(max(sizes), -(-sum(sizes) // n))
        better += max(loads) < _largest_first(sizes, n)
    assert better > 0


def _llama_layer(d: int, heads: int = 8) -> dict:
    """A Llama decoder layer's weight shapes (transformers' LlamaDecoderLayer): hidden d,
    intermediate 4 d, half as many key-value heads as query heads."""
    kv = d // 2
    return {
        "self_attn.q_proj.weight": (d, d),
        "self_attn.k_proj.weight": (kv, d),
        "self_attn.v_proj.weight": (kv, d),
        "self_attn.o_proj.weight": (d, d),
        "mlp.gate_proj.weight": (4 * d, d),
        "mlp.up_proj.weight": (4 * d, d),
        "mlp.down_proj.weight": (d, 4 * d),
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
    }


def _least_heaviest(widths: list[int], n: int) -> int:
    """A bound no assignment of ``widths`` (largest first) to n owners beats: the largest
    item; two of the n + 1 largest on one owner; the total over n, rounded up to a load
    (a multiple of the items' greatest common divisor)."""
    step = math.gcd(*widths)
    bound = max(widths[0], -(-sum(widths) // (n * step)) * step)
    return max(bound, widths[n - 1] + widths[n]) if len(widths) > n else bound


def _unit_bucket(shapes: dict, spec):
    from functional_hsdp.plan.buckets import build_buckets
    from functional_hsdp.plan.owner import owner_bucket

    n = len(shapes)
    (bucket,), _ = build_buckets(
        tuple(shapes),
        shapes=tuple(shapes.values()),
        dtypes=(torch.float32,) * n,
        devices=(torch.device("cpu"),) * n,
        specs=(spec,) * n,
        units=(0,) * n,
        owner_major=owner_bucket,
    )
    return bucket


@pytest.mark.parametrize("shape", [(2, 2), (1, 4), (2, 3), (1, 2)])
@pytest.mark.parametrize("layers", [1, 4])
def test_owner_layout_of_llama_units_is_as_short_as_any_assignment(shape, layers):
    """A bucket is n times its heaviest owner's leaves, which no assignment makes lighter
    than :func:`_least_heaviest`: the owner layout of Llama decoder layers reaches that
    bound. One layer on 4 owners pads to 4 MLP matrices (its MLP is three of them, the rest
    less than a fourth); four layers balance exactly."""
    from functional_hsdp.plan.buckets import ALIGN

    spec = fh.owned(fh.hsdp(_mesh(shape), *AXES))
    n = math.prod(shape)
    unit = {f"{k}.{p}": s for k in range(layers) for p, s in _llama_layer(64).items()}
    bucket = _unit_bucket(unit, spec)
    widths = sorted((-(-math.prod(s) // ALIGN) * ALIGN for s in unit.values()), reverse=True)
    assert bucket.padded == n * _least_heaviest(widths, n)
    assert bucket.numel == sum(widths)  # every leaf of an aligned size: no gap between leaves
    if layers == 4 and n == 4:
        assert bucket.padded == bucket.numel


def test_owner_layout_pads_less_than_largest_first_alone():
    """Leaves that largest-first alone splits 7 : 5 (in units of 16 x 16) are evened to 6 : 6."""
    spec = fh.owned(fh.fsdp(fh.SimMesh({"dp": 2}), "dp"))
    sizes = [3, 3, 2, 2, 2]
    bucket = _unit_bucket({f"w{k}": (16 * s, 16) for k, s in enumerate(sizes)}, spec)
    assert bucket.padded == bucket.numel == 2 * 16 * 16 * sum(sizes) // 2
    assert bucket.padded < 2 * 16 * 16 * _largest_first(sizes, 2)


@pytest.mark.parametrize("layers", [1, 4])
def test_owned_hsdp_outer_bytes_are_hsdps_times_the_owner_padding(layers):
    """Outer (dp_outer) bytes a rank sends, ring algorithms: HSDP's all-reduce of the inner
    chunk against owned(hsdp)'s reduce-scatter of it and all-gather of the owner's part, for
    units of Llama decoder layers. One layer a unit: the owners' padding (4 MLP matrices for
    the layer's data); four: equal."""
    mesh = _mesh((2, 2))
    units = {
        f"u{u}": {
            f"{k}.{p}": s for k in range(layers) for p, s in _llama_layer(32, heads=4).items()
        }
        for u in range(4 // layers)
    }
    wire = {}
    for name, spec in (("hsdp", fh.hsdp(mesh, *AXES)), ("owned", fh.owned(fh.hsdp(mesh, *AXES)))):
        tree_spec = {u: spec for u in units}
        params = fh.shard(_full(shapes=units), tree_spec)
        with fh.comm_log() as log:
            accumulate([random_tree((2, 2), shapes=units, seed=1)], tree_spec)
            fh.sync_params(params, tree_spec)
        factor = {"all_reduce": 1, "reduce_scatter": 0.5, "all_gather": 1}  # 2 ranks
        wire[name] = sum(e.nbytes * factor[e.op] for e in log.events if e.axis == "dp_outer")
    unit = units["u0"]
    numel = sum(math.prod(s) for s in unit.values())
    padded = 4 * max(numel // 4, max(math.prod(s) for s in unit.values()))
    assert wire["owned"] * numel == wire["hsdp"] * padded
    assert (wire["owned"] == wire["hsdp"]) == (layers == 4)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_owned_spec_holds_each_leaf_whole_on_one_rank(strategy):
    shape = (2, 3)
    spec = fh.owned(preset(strategy, _mesh(shape)))
    full = _full()
    params = fh.shard(full, spec)
    for leaf, ref in zip(optree.tree_leaves(params), optree.tree_leaves(full)):
        rows = leaf.reshape(-1, leaf.shape[-1])
        holders = [r for r in range(rows.shape[0]) if rows[r].abs().sum() > 0]
        assert len(holders) == 1  # whole on one rank (zero fill on the others)
        torch.testing.assert_close(rows[holders[0], : ref.numel()], ref.reshape(-1))


def test_owner_buckets_are_balanced_and_start_at_their_chunks():
    mesh = _mesh((2, 2))
    spec = fh.owned(fh.hsdp(mesh, *AXES))
    from functional_hsdp.plan.lookup import plan_for

    full = {f"w{k}": torch.zeros(8 * (k + 1), 16) for k in range(6)}
    leaves, treedef = optree.tree_flatten(full)
    paths = tuple(f"t{p}" for p in treedef.paths())
    plan = plan_for(
        leaves, treedef, paths, specs=(spec,) * 6, units=(0,) * 6, shapes=[x.shape for x in leaves]
    )
    (bucket,) = plan.buckets
    chunk = bucket.padded // 4
    loads = [0] * 4
    for s in bucket.slots:
        owner = owner_of_slot(bucket, s)
        k = owner["dp_inner"] * 2 + owner["dp_outer"]  # split order (dp_inner, dp_outer)
        assert k * chunk <= s.offset and s.offset + s.numel <= (k + 1) * chunk
        loads[k] += s.numel
    assert bucket.slots[0].offset == 0
    assert max(loads) <= sum(loads) / 4 + max(s.numel for s in bucket.slots)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_owned_specs_reduce_grads_equal_the_dense_mean(strategy):
    shape = (2, 2)
    spec = fh.owned(preset(strategy, _mesh(shape)))
    micro = [random_tree(shape, seed=m, shapes=MATRICES) for m in range(3)]
    final = accumulate(micro, spec)
    assert max_error(fh.gather(final, spec), dense_reduce(micro, 2)) < 1e-5
    params = fh.sync_params(fh.shard(_full(), spec), spec)
    assert max_error(fh.gather(params, spec), _full()) == 0


def test_owned_hsdp_reduce_scatters_over_outer_where_hsdp_all_reduces():
    """The cheap route: the last microbatch's outer collective is a reduce-scatter of the
    inner chunk (HSDP: an all-reduce of it), sync_params an all-gather: an all-reduce's
    wire bytes. Here the 8 leaves of one size split evenly: no padding."""
    shape = (2, 2)
    mesh = _mesh(shape)
    shapes = {f"w{k}": (16, 16) for k in range(8)}
    logs = {}
    for name, spec in (("hsdp", fh.hsdp(mesh, *AXES)), ("owned", fh.owned(fh.hsdp(mesh, *AXES)))):
        micro = [random_tree(shape, seed=m, shapes=shapes) for m in range(3)]
        params = fh.shard(_full(shapes=shapes), spec)
        with fh.comm_log() as log:
            final = accumulate(micro, spec)
            new = fh.sync_params(optree.tree_map(lambda p, g: p - g, params, final), spec)
        logs[name] = log
        assert (
            max_error(
                fh.gather(new, spec),
                optree.tree_map(lambda p, g: p - g, _full(shapes=shapes), dense_reduce(micro, 2)),
            )
            < 1e-5
        )
    hsdp, owned = logs["hsdp"], logs["owned"]
    assert hsdp.count("reduce_scatter", "dp_inner") == owned.count("reduce_scatter", "dp_inner")
    assert hsdp.nbytes("reduce_scatter", "dp_inner") == owned.nbytes("reduce_scatter", "dp_inner")
    assert [e.op for e in hsdp.events if e.axis == "dp_outer"] == ["all_reduce"]
    assert [e.op for e in owned.events if e.axis == "dp_outer"] == ["reduce_scatter", "all_gather"]
    chunk = hsdp.nbytes("all_reduce", "dp_outer")
    assert owned.nbytes("reduce_scatter", "dp_outer") == chunk  # the inner chunk
    assert owned.nbytes("all_gather", "dp_outer") == chunk // 2  # the owner's half of it


@pytest.mark.parametrize("strategy", ["hsdp", "hfsdp"])
def test_owned_outer_keeps_each_value_on_its_outer_owner_and_zeros_elsewhere(strategy):
    """Owner on dp_outer only: the spec's own chunks over dp_inner; along dp_outer one
    coordinate holds each leaf's piece, the other zeros. reduce_grads, shard, gather,
    sync_params and global_norm agree with the preset."""
    shape = (2, 2)
    base = preset(strategy, _mesh(shape))
    spec = fh.owned(base, "dp_outer")
    assert spec.optimizer == (fh.Owner(), fh.Flat()) and spec.keep_axes == ("dp_outer",)
    micro = [random_tree(shape, seed=m, shapes=MATRICES) for m in range(3)]
    ref, got = accumulate(micro, fh.hsdp(_mesh(shape), *AXES)), accumulate(micro, spec)
    for k, (x, r) in enumerate(zip(optree.tree_leaves(got), optree.tree_leaves(ref))):
        held = [o for o in range(2) if x[o].abs().sum() > 0]
        assert len(held) == 1, k  # one outer coordinate keeps it, the other holds nothing
        torch.testing.assert_close(x[held[0]], r[0], rtol=0, atol=0)
        assert torch.count_nonzero(x[1 - held[0]]) == 0
    assert max_error(fh.gather(got, spec), dense_reduce(micro, 2)) < 1e-5
    norm = fh.global_norm(ref, preset("hsdp", _mesh(shape)))
    torch.testing.assert_close(fh.global_norm(got, spec), norm)
    params = fh.shard(_full(), spec)
    assert max_error(fh.gather(params, spec), _full()) == 0
    weights = fh.sync_params(params, spec)
    assert max_error(fh.gather(weights, spec), _full()) == 0


def test_owned_outer_sends_the_data_only_over_outer():
    """The last microbatch's outer all-reduce becomes one all-to-all (reduce-scatter-v),
    sync_params one all-to-all (all-gather-v); what they send together is at most the
    all-reduce's ring bytes (2-wide outer: each piece of the chunk crosses once each way)."""
    mesh = _mesh((2, 2))
    units = {f"u{u}": _llama_layer(32, heads=4) for u in range(4)}
    logs = {}
    hsdp = fh.hsdp(mesh, *AXES)
    for name, spec in (("hsdp", hsdp), ("outer", fh.owned(hsdp, "dp_outer"))):
        tree_spec = {u: spec for u in units}
        params = fh.shard(_full(shapes=units), tree_spec)
        with fh.comm_log() as log:
            accumulate([random_tree((2, 2), shapes=units, seed=1)], tree_spec)
            fh.sync_params(params, tree_spec)
        logs[name] = [e for e in log.events if e.axis == "dp_outer"]
    assert [e.op for e in logs["hsdp"]] == ["all_reduce"] * 4
    assert [e.op for e in logs["outer"]] == ["all_to_all"] * 8
    # per unit and rank: the rank's chunk is HSDP's all-reduce input (a ring on 2 ranks
    # sends it whole); the reduce-scatter-v sends the pieces the other outer coordinate
    # owns, the all-gather-v the rank's own: together the chunk (here no alignment zeros)
    for e in logs["hsdp"]:
        assert e.numel == sum(math.prod(s) for s in units["u0"].values()) // 2
    for rs, ag, ar in zip(logs["outer"][:4], logs["outer"][4:], logs["hsdp"]):
        assert len(rs.sent) == len(ag.sent) == 4  # every rank's, on a SimMesh
        assert all(0 < x < ar.numel for x in (*rs.sent, *ag.sent))
        assert [a + b for a, b in zip(rs.sent, ag.sent)] == [ar.numel] * 4


@pytest.mark.parametrize("layers", [1, 4])
def test_owned_outer_evens_what_each_rank_keeps_and_orthogonalizes(layers):
    """A Llama decoder layer's unit under owned(hsdp, "dp_outer") on 2x2: each rank keeps
    about half its inner chunk (the outer coordinates split every chunk evenly, not just the
    whole), and the owners' matrices are as even as whole matrices allow."""
    from functional_hsdp.plan.lookup import plan_for
    from functional_hsdp.plan.owner import keep_owners

    d, mesh = 64, _mesh((2, 2))
    spec = fh.owned(fh.hsdp(mesh, *AXES), "dp_outer")
    unit = {f"{k}.{p}": s for k in range(layers) for p, s in _llama_layer(d).items()}
    leaves, treedef = optree.tree_flatten({k: torch.zeros(s) for k, s in unit.items()})
    n = len(leaves)
    plan = plan_for(
        leaves,
        treedef,
        tuple(map(str, treedef.paths())),
        specs=(spec,) * n,
        units=(0,) * n,
        shapes=[x.shape for x in leaves],
    )
    (bucket,) = plan.buckets
    chunk = plan.placed[0]["gradient"].length
    kept = plan.placed[0]["optimizer"].geometry
    held = [sum(hi - lo for _, lo, hi, _ in at) for at in kept.at.values()]
    assert sum(held) == sum(s.numel for s in bucket.slots)  # each piece on one rank
    assert max(held) <= 0.54 * chunk
    loads = {}
    for s, o in zip(bucket.slots, keep_owners(bucket, mesh)):
        if len(s.shape) == 2:
            loads[o] = loads.get(o, 0) + s.numel
    # the bound no assignment beats: the largest matrix, or a quarter of them all
    assert max(loads.values()) == max(4 * d * d, sum(loads.values()) // 4)


@pytest.mark.parametrize("shapes", ["equal", "llama"])
def test_owned_outer_takes_the_mesh_collectives_when_every_rank_keeps_as_much(shapes):
    """Owner on dp_outer: where every rank keeps as much (8 equal matrices), the outer moves
    are the mesh's own reduce-scatter and all-gather of the kept pieces, HSDP's all-reduce
    bytes; otherwise (a Llama layer) the uneven all-to-alls. Both equal the dense mean."""
    mesh = _mesh((2, 2))
    tree = (
        {f"w{k}": (16, 16) for k in range(8)}
        if shapes == "equal"
        else {k: v for k, v in _llama_layer(32).items() if len(v) == 2}
    )
    spec = fh.owned(fh.hsdp(mesh, *AXES), "dp_outer")
    micro = [random_tree((2, 2), seed=m, shapes=tree) for m in range(3)]
    params = fh.shard(_full(shapes=tree), spec)
    with fh.comm_log() as log:
        final = accumulate(micro, spec)
        new = fh.sync_params(optree.tree_map(lambda p, g: p - g, params, final), spec)
    ref = optree.tree_map(lambda p, g: p - g, _full(shapes=tree), dense_reduce(micro, 2))
    assert max_error(fh.gather(new, spec), ref) < 1e-5
    outer = [(e.op, e.numel) for e in log.events if e.axis == "dp_outer"]
    chunk = sum(math.prod(s) for s in tree.values()) // 2
    if shapes == "equal":
        assert outer == [("reduce_scatter", chunk), ("all_gather", chunk // 2)]
    else:
        assert [op for op, _ in outer] == ["all_to_all"] * 2


def test_owned_outer_averages_float16_without_overflow():
    """float16 gradients near its largest value: the reduce-scatter-v sums in float32 and
    rounds once, as HSDP's fp16 all-reduce (pre- and post-divided) does not overflow."""
    mesh = _mesh((2, 2))
    hsdp = fh.hsdp(mesh, *AXES)
    g = {"w": torch.full((2, 2, 8, 4), 60000.0, dtype=torch.float16)}
    g["w"][1] = 50000.0
    ref = fh.gather(fh.reduce_grads(g, hsdp, last=True), hsdp)
    spec = fh.owned(hsdp, "dp_outer")
    got = fh.gather(fh.reduce_grads(g, spec, last=True), spec)
    assert torch.isfinite(got["w"]).all() and torch.equal(got["w"], ref["w"])
    assert ((got["w"].float() - 54992).abs() <= 16).all()  # (60000 + 49984) / 2, rounded


def test_owned_on_some_axes_needs_a_replicate_parameter_there():
    mesh = _mesh((2, 2))
    F, Own = fh.Flat(), fh.Owner()
    with pytest.raises(ValueError, match="needs parameter Replicate"):
        fh.Spec(mesh, [F, F], [F, F], [Own, F])
    # the kept pieces are of the gradient's Flat chunks: the same Flat axes in the gradient
    # and the optimizer, at least one (a ZeRO-1 style spec)
    R, P = fh.Replicate(), fh.Partial("avg")
    with pytest.raises(ValueError, match="same Flat axes"):
        fh.Spec(mesh, [R, R], [P, P], [Own, F])
    # Owner on some axes and Replicate on the others is owner-major within each replica
    for spec in (fh.owned(fh.hsdp(mesh, *AXES), "dp_inner"), fh.owned(fh.ddp(mesh), "dp_outer")):
        assert spec.keep_axes == () and len(spec.owner_axes) == 1
    with pytest.raises(ValueError, match="data-parallel axes"):
        fh.owned(fh.hsdp(mesh, *AXES), "tp")
    with pytest.raises(ValueError, match="data-parallel axes"):
        fh.owned(fh.hsdp(mesh, *AXES), ())
    assert fh.owned(fh.hsdp(mesh, *AXES), AXES) == fh.owned(fh.hsdp(mesh, *AXES))


def test_owner_only_in_the_optimizer_and_on_every_data_parallel_axis():
    mesh = _mesh((2, 2))
    R, F, P, Own = fh.Replicate(), fh.Flat(), fh.Partial("avg"), fh.Owner()
    with pytest.raises(ValueError, match="optimizer placement only"):
        fh.Spec(mesh, [R, Own], [P, F], [Own, Own])
    with pytest.raises(NotImplementedError, match="Shard"):
        fh.owned(fh.Spec(mesh, [R, fh.Shard(0)], [P, fh.Shard(0)], [R, fh.Shard(0)]))
    assert fh.owned(fh.ddp(mesh)) == fh.owned(fh.ddp(mesh))


# -- muon and partition against torch.optim.Muon + torch.optim.AdamW -------------------------------

MUON_KW, ADAMW_KW = {"lr": 0.02}, {"lr": 1e-3, "weight_decay": 0.01}
NS = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _muon_run(spec, microbatches, muon_kw, steps=3, shapes=MUON_SHAPES):
    """fh.partition(muon, adamw) on ``spec`` and torch's Muon + AdamW on the dense mean
    gradient, ``steps`` steps of ``microbatches``; returns both final parameter trees."""
    shape = optree.tree_leaves(spec)[0].mesh.batch_shape  # spec: a Spec or a spec tree
    full = random_tree((), seed=20, shapes=shapes)
    params = fh.shard(full, spec)
    opt = fh_muon_adamw(spec, muon_kw, ADAMW_KW)
    state = opt.init(params)
    torch_kw = {k: v for k, v in muon_kw.items() if k != "ns_dtype"}
    dense, torch_step = torch_muon_adamw(full, torch_kw, ADAMW_KW)
    for step in range(steps):
        micro = [
            random_tree(shape, seed=100 * step + m, shapes=shapes) for m in range(microbatches)
        ]
        micro = [optree.tree_map(lambda g: g / microbatches, g) for g in micro]
        mean = dense_reduce(micro, len(shape))
        for k, p in dense.items():
            p.grad = mean[k].float()
        updates, state = opt.update(accumulate(micro, spec), state, params)
        params = fh.apply_updates(params, updates)
        with torch_muon_in(muon_kw.get("ns_dtype", torch.bfloat16)):
            torch_step()
    assert state.inner["muon"].count == steps
    return fh.gather(params, spec), {k: p.detach().double() for k, p in dense.items()}


@pytest.mark.parametrize("ns", NS)
@pytest.mark.parametrize("microbatches", [1, 3])
@pytest.mark.parametrize("strategy", ["hsdp", "hfsdp", "owned", "owned_outer", "owned_inner"])
def test_muon_and_adamw_equal_torch_on_the_dense_mean_gradient(strategy, microbatches, ns):
    mesh = _mesh((2, 2))
    spec = _strategy(strategy, mesh)
    got, ref = _muon_run(spec, microbatches, dict(MUON_KW, ns_dtype=NS[ns]))
    # bf16 Newton-Schulz sees the same bf16 inputs as torch's: both agree to fp32 roundoff
    assert max_error(got, ref) < 5e-6


# uneven along both dims on 3 and 4 ranks, an empty chunk along dim 1 on 4 ((5, 3))
UNEVEN_MUON_SHAPES = {
    "w1": (10, 7),
    "w2": (7, 13),
    "w3": (5, 3),
    "embed": (9, 4),
    "b1": (7,),
    "norm": (5,),
}


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize(
    "sizes, where", [({"dp": 4}, "dp"), ({"dp_outer": 2, "dp_inner": 3}, "inner")], ids=str
)
@pytest.mark.parametrize("shapes", ["even", "uneven"])
def test_muon_on_shard_specs_equals_torch_on_the_dense_mean_gradient(shapes, sizes, where, dim):
    """Shard(dim) for the matrices (Shard(0) for the 1-D leaves: a spec tree)."""
    mesh = fh.SimMesh(sizes)
    shapes = MUON_SHAPES if shapes == "even" else UNEVEN_MUON_SHAPES
    spec = {k: _shard_spec(mesh, dim if len(s) > 1 else 0, where) for k, s in shapes.items()}
    got, ref = _muon_run(spec, 2, MUON_KW, shapes=shapes)
    assert max_error(got, ref) < 5e-6


def test_muon_options_equal_torch():
    spec = preset("hfsdp", _mesh((2, 3)))
    kw = dict(
        lr=0.05,
        weight_decay=0.2,
        momentum=0.9,
        nesterov=False,
        ns_steps=4,
        adjust_lr_fn="match_rms_adamw",
        ns_coefficients=(3.0, -4.0, 2.0),
        eps=1e-6,
    )
    got, ref = _muon_run(spec, 2, kw)
    assert max_error(got, ref) < 5e-6


def test_muon_orthogonalizes_a_stack_of_matrices_each_on_its_own():
    """A 3-D leaf [E, M, N] is E matrices: as torch's Muon on each expert's matrix."""
    spec = fh.owned(preset("hsdp", _mesh((2, 2))))
    full = {"experts": torch.randn(3, 8, 12, generator=torch.Generator().manual_seed(1))}
    params = fh.shard(full, spec)
    opt = fh.muon(spec, lr=0.1, ns_dtype=torch.float32)
    g = random_tree((2, 2), seed=5, shapes={"experts": (3, 8, 12)})
    updates, _ = opt.update(fh.reduce_grads(g, spec, last=True), opt.init(params), params)
    got = fh.gather(fh.apply_updates(params, updates), spec)["experts"][0, 0]
    mean = dense_reduce([g], 2)["experts"].float()
    experts = [e.clone().requires_grad_() for e in full["experts"]]
    with torch_muon_in(torch.float32):
        torch_opt = torch.optim.Muon(experts, lr=0.1)
        for e, ge in zip(experts, mean):
            e.grad = ge
        torch_opt.step()
    torch.testing.assert_close(got, torch.stack(experts).detach(), rtol=0, atol=5e-6)


def test_muon_update_is_pure_and_refuses_a_bias():
    spec = preset("hsdp", _mesh((2, 2)))
    params = fh.shard({"w": torch.randn(6, 4)}, spec)
    g = fh.reduce_grads({"w": torch.randn(2, 2, 6, 4)}, spec, last=True)
    opt = fh.muon(spec)
    state = opt.init(params)
    inputs = optree.tree_leaves((g, state.momentum, params))
    before = [x.clone() for x in inputs]
    opt.update(g, state, params)
    assert all(torch.equal(a, b) for a, b in zip(before, inputs))
    bias = fh.shard({"b": torch.ones(6)}, spec)
    gb = fh.reduce_grads({"b": torch.ones(2, 2, 6)}, spec, last=True)
    with pytest.raises(ValueError, match=re.escape("tree['b']: per_matrix needs matrices")):
        opt.update(gb, opt.init(bias), bias)
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        fh.muon(spec, adjust_lr_fn="other")


def test_partition_labels_as_a_tree_equal_labels_as_a_callable():
    spec = preset("hsdp", _mesh((2, 2)))
    full = random_tree((), seed=3, shapes=MUON_SHAPES)
    params = fh.shard(full, spec)
    g = fh.reduce_grads(random_tree((2, 2), seed=4, shapes=MUON_SHAPES), spec, last=True)
    by_tree = {k: hidden((k,)) for k in full}
    results = []
    for labels in (hidden, by_tree):
        opt = fh.partition(
            {"muon": fh.muon(spec, **MUON_KW), "adamw": fh.adamw(**ADAMW_KW)}, labels
        )
        results.append(opt.update(g, opt.init(params), params)[0])
    assert all(torch.equal(a, b) for a, b in zip(*map(optree.tree_leaves, results)))
    opt = fh.partition({"muon": fh.muon(spec)}, hidden)
    with pytest.raises(ValueError, match=re.escape("params['b1']: label 'adamw' has no")):
        opt.init(params)


# -- every loop: MainGrad, the layer-wise loop with into=MainGrad --------------------------------


def _strategy(name: str, mesh) -> fh.Spec:
    """A preset; ``owned``: owned(hsdp); ``owned_outer``: owned(hsdp, "dp_outer")."""
    if name == "owned":
        return fh.owned(preset("hsdp", mesh))
    if name == "owned_outer":
        return fh.owned(preset("hsdp", mesh), "dp_outer")
    if name == "owned_inner":
        return fh.owned(preset("hsdp", mesh), "dp_inner")
    return preset(name, mesh)


@pytest.mark.parametrize("strategy", ["owned", "owned_outer", "owned_inner"])
def test_muon_on_a_maingrad_equals_torch(strategy):
    """The whole-tree loop with persistent main grads: MainGrad.accumulate, then the
    optimizer on mg.grads, on the cheap routes."""
    shape = (2, 2)
    spec = _strategy(strategy, _mesh(shape))
    full = random_tree((), seed=20, shapes=MUON_SHAPES)
    params = fh.shard(full, spec)
    mg = fh.MainGrad(spec, like=full)
    opt = fh_muon_adamw(spec, MUON_KW, ADAMW_KW)
    state = opt.init(params)
    dense, torch_step = torch_muon_adamw(full, MUON_KW, ADAMW_KW)
    for step in range(2):
        micro = [random_tree(shape, seed=100 * step + m, shapes=MUON_SHAPES) for m in range(3)]
        micro = [optree.tree_map(lambda g: g / 3, g) for g in micro]
        for g, last in fh.microbatches(micro):
            mg.accumulate(g, last=last)
        updates, state = opt.update(mg.grads, state, params)
        params = fh.apply_updates(params, updates)
        mg.zero_grad()
        mean = dense_reduce(micro, 2)
        for k, p in dense.items():
            p.grad = mean[k].float()
        torch_step()
    ref = {k: p.detach().double() for k, p in dense.items()}
    assert max_error(fh.gather(params, spec), ref) < 5e-6


def _lw_label(path, leaf=None) -> str:
    return "muon" if path[-1] in ("qkv", "o", "up", "down") else "adamw"


def _lw_dense(steps: int, microbatches: int, ranks: int) -> dict:
    """torch.optim.Muon (block matrices) + AdamW (tied embedding, norms) on the dense mean
    gradient of lw_problem's transformer."""
    import lw_problem as lw

    params = lw.init()
    leaves, treedef = optree.tree_flatten(params)
    dense = [x.clone().requires_grad_() for x in leaves]
    labels = [_lw_label(p) for p in treedef.paths()]
    muon = torch.optim.Muon([p for p, k in zip(dense, labels) if k == "muon"], **MUON_KW)
    adamw = torch.optim.AdamW([p for p, k in zip(dense, labels) if k == "adamw"], **ADAMW_KW)
    for step in range(steps):
        tree = optree.tree_unflatten(treedef, dense)
        loss = sum(
            lw.dense_loss(tree, ids, targets) / microbatches / ranks
            for r in range(ranks)
            for ids, targets in lw.batches(r, microbatches, step)
        )
        loss.backward()
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
    return optree.tree_unflatten(treedef, [p.detach().double() for p in dense])


@pytest.mark.parametrize("strategy", ["hsdp", "owned", "owned_outer"])
def test_muon_in_the_layerwise_loop_into_a_maingrad_equals_torch(strategy):
    """Units gathered inside the loss, gradients reduced into a MainGrad in backward, the
    optimizer on mg.grads; main weights at the optimizer placement, the forward's shards
    from sync_params (owned: an all-gather over the outer axis, as hfsdp)."""
    import lw_problem as lw

    shape, steps, microbatches = (2, 2), 2, 2
    mesh = _mesh(shape)
    spec = _strategy(strategy, mesh)
    tree_spec = {"embed": spec, "blocks": [spec] * 2}
    full = lw.init()
    main = fh.shard(full, tree_spec)
    mg = fh.MainGrad(tree_spec, like=full)
    emb, out, blk = (
        fh.gathered(fh.per_rank(f, mesh), spec, into=mg) for f in (lw.embed, lw.head, lw.block)
    )
    ce = fh.per_rank(lw.ce, mesh)

    def loss_fn(shards, ids, targets):
        h = fh.sequence(blk, shards["blocks"], emb(shards["embed"], ids))
        return ce(out(shards["embed"], h), targets).sum() / microbatches

    opt = fh.partition(
        {"muon": fh.muon(tree_spec, **MUON_KW), "adamw": fh.adamw(**ADAMW_KW)}, _lw_label
    )
    state = opt.init(main)
    for step in range(steps):
        shards = fh.sync_params(main, tree_spec)
        batches = lw.mesh_batches(mesh, microbatches, step)
        for (ids, targets), _ in fh.microbatches(batches, into=mg):
            torch.func.grad(loss_fn)(shards, ids, targets)
        mg.finish()
        updates, state = opt.update(mg.grads, state, main)
        main = fh.apply_updates(main, updates)
        mg.zero_grad()
    ref = _lw_dense(steps, microbatches, math.prod(shape))
    assert lw.max_rel_error(fh.gather(main, tree_spec), ref, shape) < 2e-5


def _wire(event: fh.Event, n: int) -> float:
    """Bytes a rank sends for one collective over n ranks (ring algorithms): an all-reduce
    2 (n - 1) / n of its input, a reduce-scatter (n - 1) / n, an all-gather (n - 1) times."""
    factor = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": n - 1}
    return event.nbytes * factor[event.op]


def test_a_muon_step_on_owned_hsdp_moves_adamw_hsdps_bytes_over_outer():
    """The whole step (3 microbatches, the optimizer, the weights back to the parameter
    placement): Muon on owned(hsdp) sends over dp_outer what AdamW on hsdp sends (a
    reduce-scatter and an all-gather where HSDP all-reduces), and over dp_inner the same
    reduce-scatters; its optimizer itself communicates nothing."""
    shape = (2, 2)
    mesh = _mesh(shape)
    shapes = {f"w{k}": (32, 16) for k in range(8)}  # 8 equal matrices: no owner padding
    micro = [random_tree(shape, seed=m, shapes=shapes) for m in range(3)]
    logs = {}
    for name in ("adamw", "muon"):
        spec = fh.hsdp(mesh, *AXES)
        spec, opt = (
            (fh.owned(spec), fh.muon(fh.owned(spec)))
            if name == "muon"
            else (spec, fh.adamw(lr=1e-3))
        )
        params = fh.shard(_full(shapes=shapes), spec)
        state = opt.init(params)
        with fh.comm_log() as log:
            grads = accumulate(micro, spec)
            with fh.comm_log() as in_update:
                updates, state = opt.update(grads, state, params)
            fh.sync_params(fh.apply_updates(params, updates), spec)
        assert in_update.events == []
        logs[name] = log
    outer = {
        k: sum(_wire(e, 2) for e in log.events if e.axis == "dp_outer") for k, log in logs.items()
    }
    assert outer["muon"] == outer["adamw"] > 0
    inner = {
        k: [(e.op, e.numel) for e in log.events if e.axis == "dp_inner"] for k, log in logs.items()
    }
    assert inner["muon"] == inner["adamw"] == [("reduce_scatter", 8 * 512)] * 3


def test_partition_takes_gradients_of_another_dtype_than_the_params():
    """bf16 gradients for fp32 params (cast by each optimizer): every label's trees share
    the params' MaskedNode leaves."""
    spec = preset("hsdp", _mesh((2, 2)))
    params = fh.shard(random_tree((), seed=3, shapes=MUON_SHAPES), spec)
    g = fh.reduce_grads(random_tree((2, 2), seed=4, shapes=MUON_SHAPES), spec, last=True)
    opt = fh_muon_adamw(spec, MUON_KW, ADAMW_KW)
    state = opt.init(params)
    want, _ = opt.update(g, state, params)
    got, _ = opt.update(optree.tree_map(lambda x: x.to(torch.bfloat16), g), state, params)
    assert max_error(got, optree.tree_map(lambda x: x.double(), want)) < 1e-3

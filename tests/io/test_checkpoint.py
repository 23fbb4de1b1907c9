"""Checkpoints through torch.distributed.checkpoint, on 4 gloo ranks: save on a 2x2 mesh, load on
2x2 (bit-exact), 1x4 and 4x1 (resharded), and training goes on as if never interrupted; and
across world sizes, 4 ranks to 2 and 2 to 4 (a second, 2-rank pool)."""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import optree
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from reference import AXES, STRATEGIES, mlp_loss, mlp_problem, preset, scale_by_ema
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Shard
from torch.func import grad

import functional_hsdp as fh
from functional_hsdp.io.checkpoint import even_chunks
from functional_hsdp.mesh.launch import DEFAULT_PRELOAD, device_mesh
from functional_hsdp.tools.testing import GlooPool

MESHES = ((2, 2), (1, 4), (4, 1))
CAP = 40 * 4 / 2**20  # 40-element buckets: leaves straddle buckets and ranks' chunks
M, BEFORE, AFTER = 2, 2, 3  # microbatches; steps before and after the checkpoint


def _mesh(shape) -> fh.DistMesh:
    return fh.DistMesh(device_mesh(shape, AXES))


def _meta(tree):
    return optree.tree_map(lambda x: torch.empty_like(x, device="meta"), tree)


def _equal(a, b) -> bool:
    """Same structure, and every leaf the same: tensors bit for bit (and dtype), others =="""
    la, lb = optree.tree_leaves(a), optree.tree_leaves(b)
    same = lambda x, y: (  # noqa: E731
        x.dtype == y.dtype and torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
    )
    return len(la) == len(lb) and all(map(same, la, lb))


def test_even_chunks_are_dtensor_shards():
    for n, sizes in itertools.product([0, 1, 3, 7, 13], [(4,), (2, 2), (1, 4), (4, 1), (3, 2)]):
        chunks = even_chunks(n, sizes)
        for k, coord in enumerate(itertools.product(*map(range, sizes))):
            shape, offset = _compute_local_shape_and_global_offset(
                (n, 2), sizes, list(coord), [Shard(0)] * len(sizes)
            )
            lo, hi = chunks[k]
            assert shape[0] == hi - lo and (hi == lo or offset[0] == lo), (n, sizes, coord)


# -- every preset: resume AdamW training on the same and on reshaped meshes ---------------------


def _train(params, state, spec, opt, steps: int):
    model, _, x, y = mlp_problem(4, M)
    loss, rank = mlp_loss(model), dist.get_rank()
    for _ in range(steps):
        full, acc = fh.gather(params, spec), None
        for m, last in fh.microbatches(M):
            g = optree.tree_map(lambda t: t / M, grad(loss)(full, x[rank, m], y[rank, m]))
            acc = fh.reduce_grads(g, spec, last=last, acc=acc)
        updates, state = opt.update(acc, state, params)
        params = fh.apply_updates(params, updates)
    return params, state


class MomentumState(NamedTuple):
    """A user's own optimizer state, as in notebooks/03_custom_optimizers.py: no method, no
    registration; fh.state_dict saves it field by field."""

    count: int
    trace: Any  # a tree like the params: local shards


def momentum_sgd(lr: float, beta: float = 0.9) -> fh.GradientTransformation:
    """A user's optimizer whose state is a :class:`MomentumState` (heavy-ball momentum)."""

    def init(params):
        return MomentumState(0, optree.tree_map(torch.zeros_like, params))

    def update(grads, state, params=None):
        trace = optree.tree_map(lambda t, g: beta * t + g, state.trace, grads)
        return optree.tree_map(lambda t: -lr * t, trace), MomentumState(state.count + 1, trace)

    return fh.GradientTransformation(init, update)


OPTIMIZERS = {"adamw": lambda: fh.adamw(lr=0.05), "own": lambda: momentum_sgd(lr=0.05)}


def _resume(strategy: str, path: str, optimizer: str = "adamw"):
    spec, opt = preset(strategy, _mesh((2, 2)), bucket_cap_mb=CAP), OPTIMIZERS[optimizer]()
    _, full0, _, _ = mlp_problem(4, M)
    params = fh.shard(full0, spec)
    params, state = _train(params, opt.init(params), spec, opt, BEFORE)
    saved = {"params": fh.state_dict(params, spec), "optim": fh.state_dict(state, spec)}
    as_full = {k: v.full_tensor() for k, v in saved["params"].items()}
    dcp.save(saved, checkpoint_id=path)
    ref = fh.gather(_train(params, state, spec, opt, AFTER)[0], spec)
    like, out = _meta(full0), {}
    for shape in MESHES:
        spec2 = preset(strategy, _mesh(shape), bucket_cap_mb=CAP)
        target = {
            "params": fh.empty_state_dict(like, spec2),
            "optim": fh.empty_state_dict(opt.init(like), spec2),
        }
        dcp.load(target, checkpoint_id=path)
        p2 = fh.load_state_dict(target["params"], spec2, like)
        s2 = fh.load_state_dict(target["optim"], spec2, opt.init(like))
        exact = s2.count == state.count and (shape != (2, 2) or _equal((p2, s2), (params, state)))
        out[shape] = (exact, fh.gather(_train(p2, s2, spec2, opt, AFTER)[0], spec2))
    return as_full, fh.gather(params, spec), ref, out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resume_on_same_and_reshaped_meshes_matches_uninterrupted_run(pool, strategy, tmp_path):
    for as_full, full, ref, out in pool.run(_resume, strategy, str(tmp_path)):
        assert _equal(as_full, full)  # the per-leaf DTensors are the full leaves
        for shape, (exact, trained) in out.items():
            assert exact, shape
            for k in ref:
                if shape == (2, 2):
                    assert torch.equal(trained[k], ref[k]), k
                torch.testing.assert_close(trained[k], ref[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("strategy", ["hsdp", "hfsdp"])
def test_a_users_own_namedtuple_state_resumes_on_reshaped_meshes(pool, strategy, tmp_path):
    """A state the library does not know (notebook 03's kind: a count and a tree) checkpoints
    as the library's do, at the top level (in a chain: the test of a chain below)."""
    for as_full, full, ref, out in pool.run(_resume, strategy, str(tmp_path), "own"):
        assert _equal(as_full, full)
        for shape, (exact, trained) in out.items():
            assert exact, shape
            for k in ref:
                if shape == (2, 2):
                    assert torch.equal(trained[k], ref[k]), k
                torch.testing.assert_close(trained[k], ref[k], rtol=1e-5, atol=1e-6, msg=k)


class Params(NamedTuple):
    """Params as a NamedTuple of tensors: a tree, not a state (it holds no host value)."""

    w: torch.Tensor
    b: torch.Tensor


class TraceState(NamedTuple):
    """A transformation's state of trees only (optax's ``TraceState``): in a chain, a state."""

    trace: Any


def _namedtuples(path: str):
    """Params as a NamedTuple save as a tree (keyed by position, as any tree of tensors); a
    chain's count-less NamedTuple state field by field; both load on 1x4."""
    spec = preset("hfsdp", _mesh((2, 2)), bucket_cap_mb=CAP)
    full = Params(torch.arange(35.0).reshape(7, 5), torch.arange(3.0))
    params = optree.tree_map(lambda x: 2 * x, fh.shard(full, spec))  # untagged shards
    state = fh.ChainState((TraceState(params),))
    saved = {"params": fh.state_dict(params, spec), "optim": fh.state_dict(state, spec)}
    keys = (sorted(saved["params"]), sorted(saved["optim"]["0"]))
    dcp.save(saved, checkpoint_id=path)
    spec2, like = preset("hfsdp", _mesh((1, 4)), bucket_cap_mb=CAP), _meta(full)
    likes = {"params": like, "optim": fh.ChainState((TraceState(like),))}
    target = {k: fh.empty_state_dict(v, spec2) for k, v in likes.items()}
    dcp.load(target, checkpoint_id=path)
    p2 = fh.load_state_dict(target["params"], spec2, like)
    s2 = fh.load_state_dict(target["optim"], spec2, likes["optim"])
    want = fh.gather(params, spec)
    same = _equal(fh.gather(p2, spec2), want) and _equal(fh.gather(s2.inner[0].trace, spec2), want)
    return keys, same, type(p2).__name__, type(s2.inner[0]).__name__


def test_namedtuple_params_are_a_tree_and_a_chains_namedtuple_a_state(pool, tmp_path):
    for keys, same, params, state in pool.run(_namedtuples, str(tmp_path)):
        assert keys == (["0", "1"], ["trace"]) and same
        assert (params, state) == ("Params", "TraceState")


class _Steps:
    """A stateful object of a user's own (not a NamedTuple) with the checkpoint protocol."""

    def __init__(self, n: int):
        self.n = n

    def __fh_state_dict__(self, spec, *, like=None):
        return {"n": self.n}

    def __fh_empty_state_dict__(self, spec):
        return {"n": 0}

    def __fh_load_state_dict__(self, state, spec, *, name):
        if "n" not in state:
            raise ValueError(f"{name}: has no entry 'n'")
        return _Steps(state["n"])


class _Held(NamedTuple):
    count: int
    steps: Any
    unused: Any = None


def test_the_protocol_and_namedtuples_dispatch_without_a_list_of_types():
    """Any NamedTuple is saved field by field (host values as they are, None left out) and a
    type with the protocol saves itself, at any depth (no tensors here: no mesh needed)."""
    held = _Held(3, fh.ChainState((fh.EmptyState(), _Steps(7))))
    saved = fh.state_dict(held)
    assert saved == {"count": 3, "steps": {"0": {}, "1": {"n": 7}}}
    like = _Held(0, fh.ChainState((fh.EmptyState(), _Steps(0))))
    assert fh.empty_state_dict(like) == {"count": 0, "steps": {"0": {}, "1": {"n": 0}}}
    loaded = fh.load_state_dict(saved, None, like)
    assert loaded.count == 3 and loaded.unused is None and loaded.steps.inner[1].n == 7
    assert isinstance(loaded.steps, fh.ChainState) and loaded.steps.inner[0] == fh.EmptyState()
    with pytest.raises(ValueError, match=r"state\['steps'\]\['1'\]: has no entry 'n'"):
        fh.load_state_dict({"count": 3, "steps": {"0": {}, "1": {}}}, None, like)
    with pytest.raises(ValueError, match=r"state\['steps'\]: has no entry '1' \(for the Chain"):
        fh.load_state_dict({"count": 3, "steps": {"0": {}}}, None, like)


# -- another world size: 4 ranks -> 2, and 2 -> 4 ------------------------------------------------


@pytest.fixture(scope="module")
def pool2():
    """2 gloo ranks, beside conftest.py's 4: a checkpoint saved by one world loads on the other."""
    with GlooPool(2, preload=(*DEFAULT_PRELOAD, "pytest")) as p:
        yield p


WORLD_STRATEGIES = ("hsdp", "hfsdp")


def _full(params, state, spec) -> dict:
    """What a checkpoint must reproduce, as full tensors: weights, AdamW moments, count."""
    moments = {k: fh.gather(getattr(state, k), spec) for k in ("mu", "nu")}
    return {"params": fh.gather(params, spec), **moments, "count": state.count}


def _save_on(shape, path: str) -> dict:
    out, opt = {}, fh.adamw(lr=0.05)
    for strategy in WORLD_STRATEGIES:
        spec = preset(strategy, _mesh(shape), bucket_cap_mb=CAP)
        _, full0, _, _ = mlp_problem(4, M)
        params = fh.shard(full0, spec)
        params, state = _train(params, opt.init(params), spec, opt, 1)  # moments, count 1
        saved = {"params": fh.state_dict(params, spec), "optim": fh.state_dict(state, spec)}
        dcp.save(saved, checkpoint_id=f"{path}/{strategy}")
        out[strategy] = _full(params, state, spec)
    return out


def _load_on(shapes, path: str) -> dict:
    out, opt = {}, fh.adamw(lr=0.05)
    like = _meta(mlp_problem(4, M)[1])
    for shape, strategy in itertools.product(shapes, WORLD_STRATEGIES):
        spec = preset(strategy, _mesh(shape), bucket_cap_mb=CAP)
        state = {
            "params": fh.empty_state_dict(like, spec),
            "optim": fh.empty_state_dict(opt.init(like), spec),
        }
        dcp.load(state, checkpoint_id=f"{path}/{strategy}")
        params = fh.load_state_dict(state["params"], spec, like)
        moments = fh.load_state_dict(state["optim"], spec, opt.init(like))
        out[(shape, strategy)] = _full(params, moments, spec)
    return out


@pytest.mark.parametrize("direction", ["4-to-2", "2-to-4"])
def test_a_checkpoint_loads_on_another_world_size(pool, pool2, direction, tmp_path):
    """Saved by 4 ranks (2x2) and loaded by 2 (1x2, 2x1), and the other way (1x2 -> 2x2, 4x1):
    the weights, AdamW moments and count, bit for bit (loading only moves data)."""
    if direction == "4-to-2":
        saver, saved_on, loader, shapes = pool, (2, 2), pool2, [(1, 2), (2, 1)]
    else:
        saver, saved_on, loader, shapes = pool2, (1, 2), pool, [(2, 2), (4, 1)]
    saved = saver.run(_save_on, saved_on, str(tmp_path))
    for rank_saved in saved[1:]:  # every rank holds the same full values
        assert all(_equal(rank_saved[k], saved[0][k]) for k in WORLD_STRATEGIES)
    for loaded in loader.run(_load_on, shapes, str(tmp_path)):
        for (shape, strategy), full in loaded.items():
            assert _equal(full, saved[0][strategy]), (shape, strategy)


# -- a chain with a schedule and a transformation of one's own ----------------------------------


def _chain(spec):
    lr = fh.schedules.warmup_cosine_decay(0.0, 0.05, warmup_steps=2, decay_steps=5)
    return fh.chain(
        fh.clip_global_norm(spec, 1.0),
        scale_by_ema(0.5),
        fh.scale_by_adam(),
        fh.add_decayed_weights(0.01, mask=lambda path, leaf: path[0].endswith("weight")),
        fh.scale_by_learning_rate(lr),
    )


def _resume_chain(path: str):
    """A chain's state (the schedule's step included) saved on 2x2 and loaded on 2x2 and 1x4:
    training resumes mid-schedule as if never interrupted."""
    spec = preset("hfsdp", _mesh((2, 2)), bucket_cap_mb=CAP)
    opt = _chain(spec)
    _, full0, _, _ = mlp_problem(4, M)
    params = fh.shard(full0, spec)
    params, state = _train(params, opt.init(params), spec, opt, BEFORE)
    dcp.save({"params": fh.state_dict(params, spec), "optim": fh.state_dict(state, spec)},
             checkpoint_id=path)  # fmt: skip
    ref = fh.gather(_train(params, state, spec, opt, AFTER)[0], spec)
    like, out = _meta(full0), {}
    for shape in ((2, 2), (1, 4)):
        spec2 = preset("hfsdp", _mesh(shape), bucket_cap_mb=CAP)
        opt2 = _chain(spec2)
        target = {
            "params": fh.empty_state_dict(like, spec2),
            "optim": fh.empty_state_dict(opt2.init(like), spec2),
        }
        dcp.load(target, checkpoint_id=path)
        p2 = fh.load_state_dict(target["params"], spec2, like)
        s2 = fh.load_state_dict(target["optim"], spec2, opt2.init(like))
        counts = (s2.inner[1].count, s2.inner[2].count, s2.inner[4].count)
        exact = shape != (2, 2) or _equal((p2, s2), (params, state))
        kinds = [type(x).__name__ for x in s2.inner]
        out[shape] = (counts, exact, kinds, fh.gather(_train(p2, s2, spec2, opt2, AFTER)[0], spec2))
    return ref, out


def test_a_chain_state_with_a_schedule_and_a_users_transform_resumes(pool, tmp_path):
    for ref, out in pool.run(_resume_chain, str(tmp_path)):
        for shape, (counts, exact, kinds, trained) in out.items():
            assert counts == (BEFORE,) * 3 and exact, shape
            assert kinds == [
                "EmptyState",
                "EmaState",
                "ScaleByAdamState",
                "EmptyState",
                "ScaleByLearningRateState",
            ]
            for k in ref:
                if shape == (2, 2):
                    assert torch.equal(trained[k], ref[k]), k
                torch.testing.assert_close(trained[k], ref[k], rtol=1e-5, atol=1e-6, msg=k)


# -- Shard(0) and Flat units, bf16, zero-size and 0-d leaves -------------------------------------


def _units(mesh: fh.Mesh):
    R, P, S = fh.Replicate(), fh.Partial("avg"), fh.Shard(0)
    cap = 30 * 4 / 2**20
    return {
        "s": fh.Spec(mesh, [R, S], [P, S], [R, S], bucket_cap_mb=cap),
        "f": fh.hfsdp(mesh, "dp_outer", "dp_inner", bucket_cap_mb=cap),
    }


def _units_tree():
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(s, generator=gen)  # noqa: E731
    return {
        "s": {"a": r(7, 3), "b": r(1, 6), "h": r(5, 2).bfloat16()},
        "f": {"w": r(13, 11), "h": r(9).bfloat16(), "z": r(0, 4), "c": r(), "v": r(3)},
    }


def _round_trip_units(path: str):
    full = _units_tree()
    spec = _units(_mesh((2, 2)))
    local = fh.shard(full, spec)
    dcp.save({"params": fh.state_dict(local, spec)}, checkpoint_id=path)
    out = {}
    for shape in MESHES:
        spec2 = _units(_mesh(shape))
        state = {"params": fh.empty_state_dict(_meta(full), spec2)}
        dcp.load(state, checkpoint_id=path)
        loaded = fh.load_state_dict(state["params"], spec2, _meta(full))
        same = shape != (2, 2) or _equal(loaded, local)
        out[shape] = (same, fh.gather(loaded, spec2), _equal(loaded, fh.shard(full, spec2)))
    return out


def test_units_shard_dim_bf16_zero_size_and_scalar_leaves(pool, tmp_path):
    full = _units_tree()
    for out in pool.run(_round_trip_units, str(tmp_path)):
        for shape, (same, gathered, as_sharded) in out.items():
            assert same and as_sharded, shape  # bit-exact on every mesh: data only moves
            assert _equal(gathered, full), shape


# -- MainGrad: final state reshards; mid-accumulation is refused ---------------------------------


def _maingrad(path: str):
    model, full0, x, y = mlp_problem(4, M)
    loss, rank = mlp_loss(model), dist.get_rank()
    spec = preset("hsdp", _mesh((2, 2)), bucket_cap_mb=CAP)
    mg = fh.MainGrad(spec, like=full0)
    for m, last in fh.microbatches(M):
        mg.accumulate(grad(loss)(full0, x[rank, m], y[rank, m]), last=last)
    dcp.save({"mg": fh.state_dict(mg)}, checkpoint_id=path)
    spec2 = preset("hfsdp", _mesh((4, 1)), bucket_cap_mb=CAP)
    mg2 = fh.MainGrad(spec2, like=full0)
    state = {"mg": fh.empty_state_dict(mg2, spec2)}
    dcp.load(state, checkpoint_id=path)
    fh.load_state_dict(state["mg"], spec2, mg2)
    moved = mg2.state == "final" and _equal(fh.gather(mg2.grads, spec2), fh.gather(mg.grads, spec))
    # into a MainGrad whose buckets' memory is given back (persistent=False, zeroed): it loaded
    # into the released storage before taking it back (a segfault)
    mg3 = fh.MainGrad(spec2, like=full0, persistent=False)
    mg3.zero_grad()
    state = {"mg": fh.empty_state_dict(mg3, spec2)}
    dcp.load(state, checkpoint_id=path)
    fh.load_state_dict(state["mg"], spec2, mg3)
    moved = moved and _equal(fh.gather(mg3.grads, spec2), fh.gather(mg.grads, spec))
    mg.zero_grad()
    empty = fh.state_dict(mg)["state"] == "empty"
    mg.accumulate(grad(loss)(full0, x[rank, 0], y[rank, 0]), last=False)
    try:
        fh.state_dict(mg)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return moved, empty, refused


def test_maingrad_final_state_reshards_and_mid_accumulation_is_refused(pool, tmp_path):
    for moved, empty, refused in pool.run(_maingrad, str(tmp_path)):
        assert moved and empty
        assert "mid-accumulation" in refused and "('dp_outer',)" in refused
        assert "mg.finish()" in refused and "mg.local_state_dict()" in refused


def _maingrad_kept(path: str):
    """A MainGrad under Owner on dp_outer only (each rank keeps its owned pieces of its
    chunk) saves its final gradients, which load into another one (2x2) and into hfsdp on
    4x1."""
    model, full0, x, y = mlp_problem(4, M)
    loss, rank = mlp_loss(model), dist.get_rank()
    spec = fh.owned(preset("hsdp", _mesh((2, 2)), bucket_cap_mb=CAP), "dp_outer")
    mg = fh.MainGrad(spec, like=full0)
    for m, last in fh.microbatches(M):
        mg.accumulate(grad(loss)(full0, x[rank, m], y[rank, m]), last=last)
    dcp.save({"mg": fh.state_dict(mg)}, checkpoint_id=path)
    out = []
    for spec2 in (spec, preset("hfsdp", _mesh((4, 1)), bucket_cap_mb=CAP)):
        mg2 = fh.MainGrad(spec2, like=full0)
        state = {"mg": fh.empty_state_dict(mg2, spec2)}
        dcp.load(state, checkpoint_id=path)
        fh.load_state_dict(state["mg"], spec2, mg2)
        same = _equal(fh.gather(mg2.grads, spec2), fh.gather(mg.grads, spec))
        local = spec2 is spec and _equal(mg2.grads, mg.grads)  # each rank's kept pieces
        out.append(mg2.state == "final" and same and (local or spec2 is not spec))
    return out


def test_maingrad_under_owner_on_dp_outer_only_reshards(pool, tmp_path):
    for loaded in pool.run(_maingrad_kept, str(tmp_path)):
        assert loaded == [True, True]


# -- errors name the path ----------------------------------------------------------------------


def _error(fn, *args, **kw) -> str:
    try:
        fn(*args, **kw)
    except (TypeError, ValueError, CheckpointException) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _errors(path: str):
    spec = preset("hsdp", _mesh((2, 2)))
    full = {"a": torch.randn(7, 3), "b": torch.randn(5)}
    dcp.save({"p": fh.state_dict(fh.shard(full, spec), spec)}, checkpoint_id=path)
    state = fh.empty_state_dict(_meta(full), spec)
    wrong = dict(full, b=torch.randn(6))
    missing = {"a": full["a"], "c": full["b"]}
    on_disk = {"p": fh.empty_state_dict(_meta(wrong), spec)}
    return {
        "structure": _error(fh.load_state_dict, state, spec, missing),
        "shape": _error(fh.load_state_dict, state, spec, wrong),
        "leaf": _error(fh.empty_state_dict, {"a": 3}, spec),
        "spec": _error(fh.load_state_dict, state, preset("fsdp", _mesh((2, 2))), full),
        "disk": _error(dcp.load, on_disk, checkpoint_id=path),
    }


def test_errors_name_the_path(pool, tmp_path):
    for errors in pool.run(_errors, str(tmp_path)):
        assert "state: has no entry 'c' for like['c']" in errors["structure"]
        assert "like['b']" in errors["shape"] and "(5,)" in errors["shape"]
        assert "like['a']: expected a tensor" in errors["leaf"]
        assert "empty_state_dict(like, spec)" in errors["spec"]
        assert "Size mismatch" in errors["disk"] and "p.b" in errors["disk"]


def test_a_simmesh_is_refused():
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
    with pytest.raises(TypeError, match="need a DistMesh"):
        fh.state_dict(fh.shard({"w": torch.ones(4)}, spec), spec)

"""Property tests (hypothesis) on SimMesh: random meshes, specs, trees, dtypes and M.

* ``gather(reduce_grads over M microbatches)`` equals the dense reference: per rank, the sum
  over microbatches reduced (avg or sum, per axis) over the spec's data-parallel axes only;
* inputs (gradients and ``acc``) are never mutated, and repeated calls are bit-identical;
* ``shard`` then ``gather`` is the identity, bit for bit; ``MainGrad`` equals the pure path.

Meshes have 1 to 3 axes of sizes 1 to 4 (at most 16 ranks); specs are presets (ddp, fsdp,
hsdp, hfsdp) or random per-axis placements (Replicate, Partial, Flat, Shard(d) on one axis)
over a random set of data-parallel axes; specs the library refuses (ValueError,
NotImplementedError) are rejected as examples. Leaves have 0 to 3 dims of sizes 0 to 5
(scalars, empty and size-1 dims included), in float32, float64 or bfloat16.

Profiles: ``FH_HYPOTHESIS_PROFILE=ci`` (default: 200 examples for the main property) or
``thorough`` (2000).
"""

from __future__ import annotations

import math
import os

import optree
import pytest
import torch
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

import functional_hsdp as fh

for name, examples in (("ci", 200), ("thorough", 2000)):
    settings.register_profile(
        name,
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
PROFILE = settings.get_profile(os.environ.get("FH_HYPOTHESIS_PROFILE", "ci"))
SMALLER = settings(PROFILE, max_examples=max(1, PROFILE.max_examples // 2))

R, F = fh.Replicate(), fh.Flat()
DTYPES = [torch.float32, torch.float64, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 4e-2}
NAMES = ("a", "b", "c")


@st.composite
def meshes(draw) -> fh.SimMesh:
    n = draw(st.integers(1, 3))
    sizes = draw(
        st.lists(st.integers(1, 4), min_size=n, max_size=n).filter(lambda s: math.prod(s) <= 16)
    )
    return fh.SimMesh(dict(zip(NAMES, sizes)))


def _triples(shard: fh.Placement, flat: bool = True) -> list:
    """(parameter, gradient, optimizer) makers for one DP axis, given the Partial's op."""
    P = fh.Partial
    out = [
        lambda op: (R, P(op), R),  # ddp: deferred
        lambda op: (R, R, R),  # all-reduce every microbatch
    ]
    if flat:
        out += [
            lambda op: (R, P(op), F),  # optimizer sharded (zero-1/2 style), deferred
            lambda op: (F, P(op), F),
            lambda op: (R, F, F),  # reduce-scatter every microbatch
            lambda op: (F, F, F),  # fsdp
            lambda op: (R, R, F),
        ]
    if shard is not None:
        out += [
            lambda op: (shard, P(op), shard),
            lambda op: (R, shard, shard),
            lambda op: (shard, shard, shard),
        ]
    return out


@st.composite
def specs(draw, mesh: fh.SimMesh) -> fh.Spec:
    names = mesh.axis_names
    cap = draw(st.sampled_from([25.0, 24 * 4 / 2**20, 7 * 4 / 2**20]))  # 1, or many buckets
    op = draw(st.sampled_from(["avg", "sum"]))
    kinds = ["random", "ddp", "fsdp", "hsdp", "hfsdp", "random", "shard", "random", "shard"]
    kind = draw(st.sampled_from(kinds))
    event(f"spec: {kind}")
    kw = {"reduce_op": op, "bucket_cap_mb": cap}
    if kind in ("ddp", "fsdp"):
        axes = draw(st.lists(st.sampled_from(names), min_size=1, max_size=len(names), unique=True))
        return (fh.ddp if kind == "ddp" else fh.fsdp)(mesh, tuple(axes), **kw)
    if kind in ("hsdp", "hfsdp"):
        assume(len(names) >= 2)
        outer, inner = draw(st.permutations(names))[:2]
        return (fh.hsdp if kind == "hsdp" else fh.hfsdp)(mesh, outer, inner, **kw)
    dp = draw(st.lists(st.sampled_from(names), min_size=1, max_size=len(names), unique=True))
    # "shard": Shard(d) on one DP axis (FSDP2 style allows only one), no Flat anywhere
    sharded = draw(st.sampled_from(dp)) if kind == "shard" else None
    shard = fh.Shard(draw(st.sampled_from([0, -1])))
    rows = {"parameter": [], "gradient": [], "optimizer": []}
    for axis in names:
        if axis not in dp:
            p = g = o = R
        else:
            if kind == "random":
                choices = _triples(fh.Shard(0))
            elif axis == sharded:
                choices = _triples(shard, flat=False)[2:]
            else:
                choices = _triples(None, flat=False)
            p, g, o = draw(st.sampled_from(choices))(draw(st.sampled_from(["avg", "sum"])))
        rows["parameter"].append(p)
        rows["gradient"].append(g)
        rows["optimizer"].append(o)
    try:
        spec = fh.Spec(mesh, **rows, dp_axes=tuple(a for a in names if a in dp), **kw)
    except (ValueError, NotImplementedError):
        assume(False)
    event(f"valid {kind} spec" + (" with Shard(d)" if spec.shard else ""))
    return spec


@st.composite
def cases(draw):
    mesh = draw(meshes())
    spec = draw(specs(mesh))
    min_dims = 1 if spec.shard else 0  # Shard(0) needs a dim 0
    shape = st.lists(st.integers(0, 5), min_size=min_dims, max_size=3).map(tuple)
    names = draw(st.lists(st.sampled_from("uvwxyz"), min_size=1, max_size=4, unique=True))
    leaves = {k: (draw(shape), draw(st.sampled_from(DTYPES))) for k in names}
    microbatches = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**16))
    return mesh, spec, leaves, microbatches, seed


def _random(leaves: dict, batch: tuple[int, ...], gen: torch.Generator) -> dict:
    return {k: torch.randn((*batch, *s), generator=gen).to(d) for k, (s, d) in leaves.items()}


def _reference(micro: list, spec: fh.Spec) -> dict:
    """Per rank: the sum over microbatches, reduced over the DP axes only, in float64."""
    names, nb = spec.mesh.axis_names, len(spec.mesh.axis_names)
    ops = {a: spec.input[names.index(a)].reduce_op for a in spec.dp_axes}

    def one(*xs):
        total = sum(x.double() for x in xs)
        for d, a in enumerate(names):
            if a in ops:
                total = (total.mean if ops[a] == "avg" else total.sum)(d, keepdim=True)
        return total.expand(*spec.mesh.sizes, *xs[0].shape[nb:])

    return optree.tree_map(one, *micro)


def _bits(tree) -> list[torch.Tensor]:
    return [x.detach().clone() for x in optree.tree_leaves(tree)]


def _same_bits(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b)
    )


def _accumulate(micro: list, spec: fh.Spec):
    acc, accs = None, []
    for m, g in enumerate(micro):
        if acc is not None:
            accs.append((acc, _bits(acc)))
        acc = fh.reduce_grads(g, spec, last=m == len(micro) - 1, acc=acc)
    for old, bits in accs:  # every acc passed in is untouched
        assert _same_bits(_bits(old), bits)
    return acc


@PROFILE
@given(cases())
def test_reduce_grads_equals_the_dense_reference_and_never_mutates(case):
    mesh, spec, leaves, microbatches, seed = case
    gen = torch.Generator().manual_seed(seed)
    micro = [_random(leaves, mesh.sizes, gen) for _ in range(microbatches)]
    before = [_bits(g) for g in micro]
    out = _accumulate(micro, spec)
    assert all(_same_bits(_bits(g), b) for g, b in zip(micro, before))  # inputs untouched
    full = fh.gather(out, spec)
    ref = _reference(micro, spec)
    for k, (shape, dtype) in leaves.items():
        assert full[k].dtype == dtype and full[k].shape == (*mesh.sizes, *shape)
        if full[k].numel():
            scale = max(1.0, ref[k].abs().max().item())
            err = (full[k].double() - ref[k]).abs().max().item()
            assert err <= TOL[dtype] * scale * microbatches, (k, err)
    assert _same_bits(_bits(_accumulate(micro, spec)), _bits(out))  # bit-identical again


@SMALLER
@given(cases(), st.sampled_from(["optimizer", "parameter"]), st.booleans())
def test_shard_then_gather_is_the_identity(case, to, stacked):
    mesh, spec, leaves, _, seed = case
    gen = torch.Generator().manual_seed(seed)
    full = _random(leaves, (), gen)
    tree = optree.tree_map(lambda x: x.expand(*mesh.sizes, *x.shape), full) if stacked else full
    before = _bits(tree)
    local = fh.shard(tree, spec, to=to, stacked=stacked)
    back = fh.gather(local, spec)
    assert _same_bits(_bits(tree), before)
    for k, x in full.items():
        assert torch.equal(back[k], x.expand(*mesh.sizes, *x.shape)), k


@SMALLER
@given(cases())
def test_maingrad_equals_the_pure_path(case):
    mesh, spec, leaves, microbatches, seed = case
    gen = torch.Generator().manual_seed(seed)
    like = {k: torch.zeros(s, dtype=d) for k, (s, d) in leaves.items()}
    micro = [_random(leaves, mesh.sizes, gen) for _ in range(microbatches)]
    mg = fh.MainGrad(spec, like=like, dtype=torch.float64)
    for g, last in fh.microbatches(micro):
        mg.accumulate(g, last=last)
    ref = _reference(micro, spec)
    full = fh.gather(mg.grads, spec)
    for k, (_, dtype) in leaves.items():
        if full[k].numel():
            scale = max(1.0, ref[k].abs().max().item())
            tol = TOL[dtype] * scale * microbatches
            # inputs round to their own dtype; the buffers accumulate in float64
            assert (full[k] - ref[k]).abs().max().item() <= tol, k


@pytest.mark.parametrize("name", ["ci", "thorough"])
def test_profiles_are_registered(name):
    assert settings.get_profile(name).deadline is None
    assert settings.get_profile("ci").max_examples >= 200

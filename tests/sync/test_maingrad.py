"""MainGrad on SimMesh: same results as the pure path, persistent buffers, modes, precision."""

from __future__ import annotations

import re

import optree
import pytest
import torch
from reference import (
    AXES,
    SHAPES,
    STRATEGIES,
    accumulate,
    dense_reduce,
    max_error,
    preset,
    random_tree,
)

import functional_hsdp as fh


def like(shapes=SHAPES, dtype=torch.float32):
    return random_tree((), dtype, shapes=shapes)


def run_steps(mg, steps, set_to_none):
    """Train-loop shaped use of MainGrad; returns the final grads of every step."""
    out = []
    for micro in steps:
        for g, last in fh.microbatches(micro):
            mg.accumulate(g, last=last)
        out.append(optree.tree_map(torch.clone, mg.grads))
        mg.zero_grad(set_to_none=set_to_none)
    return out


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("microbatches", [1, 3])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_maingrad_equals_pure_reduce_grads(strategy, microbatches, set_to_none):
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 3})
    spec = preset(strategy, mesh, bucket_cap_mb=60 * 4 / 2**20)
    steps = [[random_tree((2, 3), seed=10 * s + m) for m in range(microbatches)] for s in range(2)]
    mg = fh.MainGrad(spec, like=like())
    got = run_steps(mg, steps, set_to_none)
    for micro, final in zip(steps, got):
        pure = accumulate(micro, spec)
        for a, b in zip(optree.tree_leaves(final), optree.tree_leaves(pure)):
            assert torch.equal(a, b)
        assert max_error(fh.gather(final, spec), dense_reduce(micro, 2)) < 1e-5


def test_buffers_and_views_stay_put_across_steps():
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    spec = fh.ddp(mesh)  # full-shape leaves: views of the buffers on SimMesh too
    mg = fh.MainGrad(spec, like=like())
    ptrs = [b.data_ptr() for b in mg.buffers]
    seen = []
    for s in range(3):
        for g, last in fh.microbatches([random_tree((2, 2), seed=s)] * 2):
            mg.accumulate(g, last=last)
        seen.append([x.data_ptr() for x in optree.tree_leaves(mg.grads)])
        mg.zero_grad(set_to_none=s % 2 == 0)
    assert [b.data_ptr() for b in mg.buffers] == ptrs
    assert seen[0] == seen[1] == seen[2]
    buf = mg.buffers[0]
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()
    assert all(lo <= p < hi for p in seen[0])


def test_zero_grad_modes():
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
    mg = fh.MainGrad(spec, like=like())
    assert mg.grads is None and mg.state == "accumulating"
    mg.accumulate(random_tree((2, 2)), last=True)
    assert mg.state == "final"
    mg.zero_grad(set_to_none=True)
    assert mg.grads is None and mg.state == "accumulating"
    mg.accumulate(random_tree((2, 2)), last=True)
    mg.zero_grad(set_to_none=False)
    assert all(not x.any() for x in optree.tree_leaves(mg.grads))
    assert mg.state == "accumulating"


def test_accumulating_on_a_final_buffer_asks_for_zero_grad():
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    mg = fh.MainGrad(fh.hsdp(mesh, "dp_outer", "dp_inner"), like=like())
    g = random_tree((2, 2))
    mg.accumulate(g, last=True)
    with pytest.raises(ValueError, match="zero_grad"):
        mg.accumulate(g, last=True)
    with pytest.raises(ValueError, match="zero_grad"):
        mg.accumulate(g, last=False)


def test_accumulating_grads_are_refused_by_gather_and_final_ones_gathered():
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
    mg = fh.MainGrad(spec, like=like())
    micro = [random_tree((2, 2), seed=m) for m in range(2)]
    mg.accumulate(micro[0], last=False)
    with pytest.raises(ValueError, match="still Partial"):
        fh.gather(mg.grads, spec)
    mg.accumulate(micro[1], last=True)
    assert max_error(fh.gather(mg.grads, spec), dense_reduce(micro, 2)) < 1e-5


def test_bf16_grads_accumulate_in_fp32_buffers():
    """Closer to the fp32 reference than bf16 accumulation, and within bf16 tolerance."""
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
    micro32 = [random_tree((2, 2), seed=m) for m in range(16)]
    micro16 = [optree.tree_map(lambda x: x.bfloat16(), g) for g in micro32]
    ref = dense_reduce(micro16, 2)  # exact sum of the bf16 inputs
    mg = fh.MainGrad(spec, like=like(dtype=torch.bfloat16), dtype=torch.float32)
    for g, last in fh.microbatches(micro16):
        mg.accumulate(g, last=last)
    main = fh.gather(mg.grads, spec)
    assert optree.tree_all(optree.tree_map(lambda x: x.dtype == torch.float32, main))
    low = fh.gather(accumulate(micro16, spec), spec)
    err_main, err_low = max_error(main, ref), max_error(low, ref)
    assert err_main < 1e-5 < err_low
    assert max_error(low, ref) < 0.1  # bf16 tolerance
    # the layout is the parameters': fp32 buffers line up with bf16 params' shards
    params = fh.shard(like(dtype=torch.bfloat16), spec)
    for p, g in zip(optree.tree_leaves(params), optree.tree_leaves(mg.grads)):
        assert p.shape == g.shape


def test_fp16_on_the_wire_pre_and_post_divides_so_large_worlds_do_not_overflow():
    mesh = fh.SimMesh({"dp": 8})
    spec = fh.ddp(mesh)
    g = {"w": torch.full((8, 4), 20000.0, dtype=torch.float16)}  # naive fp16 sum: 160000 = inf
    assert torch.isinf(g["w"].sum(0)).all()
    mg = fh.MainGrad(spec, like={"w": torch.zeros(4)}, reduce_dtype=torch.float16)
    with fh.comm_log() as log:
        mg.accumulate(g, last=True)
    assert torch.equal(mg.grads["w"], torch.full((8, 4), 20000.0))
    (event,) = log.events
    assert (event.dtype, event.reduce) == (torch.float16, "sum")


def test_local_state_dict_resumes_mid_accumulation_bit_identically():
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    spec = fh.hfsdp(mesh, "dp_outer", "dp_inner")
    micro = [random_tree((2, 2), seed=m) for m in range(4)]
    straight = fh.MainGrad(spec, like=like())
    for g, last in fh.microbatches(micro):
        straight.accumulate(g, last=last)

    first = fh.MainGrad(spec, like=like())
    first.accumulate(micro[0], last=False)
    first.accumulate(micro[1], last=False)
    saved = first.local_state_dict()
    resumed = fh.MainGrad(spec, like=like())
    resumed.load_local_state_dict(saved)
    assert resumed.state == "accumulating"
    resumed.accumulate(micro[2], last=False)
    resumed.accumulate(micro[3], last=True)
    for a, b in zip(optree.tree_leaves(resumed.grads), optree.tree_leaves(straight.grads)):
        assert torch.equal(a, b)


def test_load_local_state_dict_from_another_spec_or_shape_is_refused():
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    mg = fh.MainGrad(fh.hsdp(mesh, "dp_outer", "dp_inner"), like=like())
    other = fh.MainGrad(fh.fsdp(mesh), like=like())
    with pytest.raises(ValueError, match=re.escape("state_dict['layout']['specs']: saved with")):
        mg.load_local_state_dict(other.local_state_dict())
    smaller = fh.MainGrad(fh.hsdp(mesh, "dp_outer", "dp_inner"), like={"a": torch.zeros(3)})
    with pytest.raises(ValueError, match=re.escape("state_dict['layout']['tree']: saved with")):
        mg.load_local_state_dict(smaller.local_state_dict())
    elsewhere = fh.MainGrad(
        fh.hsdp(fh.SimMesh({"dp_outer": 1, "dp_inner": 4}), "dp_outer", "dp_inner"), like=like()
    )
    with pytest.raises(ValueError, match=re.escape("state_dict['layout']['mesh']: saved with")):
        mg.load_local_state_dict(elsewhere.local_state_dict())
    with pytest.raises(ValueError, match="not a MainGrad local_state_dict"):
        mg.load_local_state_dict({"buffers": []})


def test_the_old_state_dict_spellings_warn_and_are_the_local_ones():
    """``mg.state_dict()`` / ``mg.load_state_dict()`` (per rank) are the deprecated names of
    ``mg.local_state_dict()`` / ``mg.load_local_state_dict()``: ``fh.state_dict(mg)`` is the
    mesh-independent checkpoint."""
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
    mg = fh.MainGrad(spec, like=like())
    mg.accumulate(random_tree((2, 2), seed=0), last=False)
    with pytest.warns(DeprecationWarning, match=r"MainGrad\.state_dict is deprecated: use mg\."):
        old = mg.state_dict()
    new = mg.local_state_dict()
    assert old.keys() == new.keys() and old["state"] == new["state"] == "accumulating"
    assert all(torch.equal(a, b) for a, b in zip(old["buffers"], new["buffers"]))
    resumed = fh.MainGrad(spec, like=like())
    with pytest.warns(DeprecationWarning, match=r"use mg\.load_local_state_dict\(\)"):
        resumed.load_state_dict(old)
    assert resumed.state == "accumulating"
    assert all(torch.equal(a, b) for a, b in zip(resumed.buffers, mg.buffers))


def test_the_old_layout_spelling_warns_and_the_saved_key_is_kept():
    """``mg.layout()`` is the deprecated name of ``mg.buffer_signature()``; a per-rank copy
    keeps it under the key ``"layout"``, so copies saved before the rename still load."""
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
    mg = fh.MainGrad(spec, like=like())
    with pytest.warns(DeprecationWarning, match=r"MainGrad\.layout is deprecated: use mg\.buf"):
        old = mg.layout()
    assert old == mg.buffer_signature() == mg.local_state_dict()["layout"]
    keys = ["mesh", "tree", "shapes", "kinds", "specs", "dtype", "reduce_dtype", "buffers"]
    assert list(old) == keys


def test_accumulate_bad_input_names_the_path():
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    mg = fh.MainGrad(fh.hsdp(mesh, "dp_outer", "dp_inner"), like=like())
    g = random_tree((2, 2))
    with pytest.raises(ValueError, match=r"grads\['n'\]"):
        mg.accumulate({**g, "n": [g["n"][0]]}, last=True)
    bad = random_tree((2, 2))
    bad["a"] = torch.zeros(2, 2, 3, 7)
    with pytest.raises(ValueError, match=r"grads\['a'\]: expected per-rank shape \(7, 3\)"):
        mg.accumulate(bad, last=True)
    bad["a"] = torch.zeros(2, 2, 7, 3, dtype=torch.int32)
    with pytest.raises(TypeError, match=r"grads\['a'\]: gradients must have a floating dtype"):
        mg.accumulate(bad, last=True)
    with pytest.raises(TypeError, match="last must be a bool"):
        mg.accumulate(g, last=None)
    with pytest.raises(TypeError, match="floating"):
        fh.MainGrad(fh.ddp(mesh), like=like(), dtype=torch.int64)


def test_microbatches_helper():
    assert list(fh.microbatches(1)) == [(0, True)]
    assert [last for _, last in fh.microbatches(iter(range(4)))] == [False, False, False, True]
    with pytest.raises(ValueError):
        list(fh.microbatches(0))
    with pytest.raises(ValueError):
        list(fh.microbatches([]))


@pytest.mark.parametrize("shape", [(2, 2), (1, 4), (4, 1)])
def test_hfsdp_final_grads_match_dense_reference(shape):
    mesh = fh.SimMesh(dict(zip(AXES, shape)))
    spec = fh.hfsdp(mesh, "dp_outer", "dp_inner")
    micro = [random_tree(shape, seed=m) for m in range(3)]
    mg = fh.MainGrad(spec, like=like())
    for g, last in fh.microbatches(micro):
        mg.accumulate(g, last=last)
    assert max_error(fh.gather(mg.grads, spec), dense_reduce(micro, 2)) < 1e-5


@pytest.mark.parametrize("reduce_dtype", [torch.bfloat16, torch.float16])
def test_last_with_nothing_deferred_keeps_the_fp32_sum(reduce_dtype):
    # fsdp defers no axis: the last microbatch sends nothing more, so the fp32 sum must not
    # pass through the wire dtype
    spec = fh.fsdp(fh.SimMesh({"dp": 2}))
    mg = fh.MainGrad(spec, like={"w": torch.zeros(4)}, reduce_dtype=reduce_dtype)
    for value, last in ((1.0, False), (2.0**-12, False), (0.0, True)):
        mg.accumulate({"w": torch.full((2, 4), value)}, last=last)
    assert fh.gather(mg.grads, spec)["w"][0].tolist() == [1 + 2**-12] * 4

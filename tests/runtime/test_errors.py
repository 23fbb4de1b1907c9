"""Bad input gets a clear ValueError/TypeError naming the pytree path, never silent corruption."""

from __future__ import annotations

import re

import pytest
import torch

import functional_hsdp as fh

# ``mesh`` (a 2x2 SimMesh) and ``spec`` (hsdp on it) are conftest.py's fixtures. The refusal of
# sparse and meta leaves, and of an acc of the wrong dtype, is in tests/runtime/test_reliability.py.


def grads(**extra):
    g = {"layers": [{"w": torch.randn(2, 2, 4, 3)}, {"w": torch.randn(2, 2, 5)}]}
    g.update(extra)
    return g


def test_spec_prefix_that_does_not_match_the_tree(mesh, spec):
    with pytest.raises(ValueError, match=re.escape("spec['layers']")):
        fh.reduce_grads(grads(), {"layers": {"w": spec}}, last=True)
    with pytest.raises(ValueError, match="missing key"):
        fh.reduce_grads(grads(), {"other": spec}, last=True)


def test_spec_tree_with_a_non_spec_leaf(spec):
    with pytest.raises(TypeError, match=re.escape("spec['layers'][1]")):
        fh.reduce_grads(grads(), {"layers": [spec, "hsdp"]}, last=True)


def test_axis_name_not_in_the_mesh(mesh):
    with pytest.raises(ValueError, match="'dp_middle' is not in the mesh"):
        fh.hsdp(mesh, "dp_middle", "dp_inner")
    with pytest.raises(ValueError, match="'nope' is not in the mesh"):
        fh.ddp(mesh, "nope")
    with pytest.raises(ValueError, match="'nope' is not in the mesh"):
        fh.psum(torch.ones(2, 2, 3), "nope", mesh)


def test_placements_of_the_wrong_length(mesh):
    R, F, P = fh.Replicate(), fh.Flat(), fh.Partial("avg")
    with pytest.raises(ValueError, match=r"Spec.gradient: expected 2 placements .* got 3"):
        fh.Spec(mesh, parameter=[R, F], gradient=[P, F, F], optimizer=[R, F])
    with pytest.raises(TypeError, match="Spec.parameter: expected a sequence"):
        fh.Spec(mesh, parameter=F, gradient=[P, F], optimizer=[R, F])


def test_unsupported_and_impossible_placements(mesh):
    R, F, P = fh.Replicate(), fh.Flat(), fh.Partial("avg")
    with pytest.raises(NotImplementedError, match="Shard"):
        fh.Spec(mesh, parameter=[R, fh.Shard(0)], gradient=[P, F], optimizer=[R, F])
    with pytest.raises(ValueError, match="Spec.optimizer on axis 'dp_outer'"):
        fh.Spec(mesh, parameter=[R, F], gradient=[P, F], optimizer=[P, F])
    with pytest.raises(ValueError, match="Partial\\('max'\\)"):
        fh.Spec(mesh, parameter=[R, F], gradient=[fh.Partial("max"), F], optimizer=[R, F])
    with pytest.raises(ValueError, match="cannot be honoured"):
        fh.Spec(mesh, parameter=[F, R], gradient=[P, F], optimizer=[F, F])
    with pytest.raises(ValueError, match="not a data-parallel axis"):
        fh.Spec(mesh, parameter=[R, F], gradient=[P, F], optimizer=[R, F], dp_axes=("dp_inner",))


def test_non_floating_grads(spec):
    with pytest.raises(
        TypeError, match=re.escape("grads['step']: gradients must have a floating dtype")
    ):
        fh.reduce_grads(grads(step=torch.ones(2, 2, 3, dtype=torch.int64)), spec, last=True)


def test_non_tensor_leaf(spec):
    with pytest.raises(TypeError, match=re.escape("grads['lr']: expected a torch.Tensor")):
        fh.reduce_grads(grads(lr=0.1), spec, last=True)


def test_sim_value_without_the_mesh_shape_in_front(spec):
    bad = grads()
    bad["layers"][1]["w"] = torch.randn(5)
    with pytest.raises(ValueError, match=re.escape("grads['layers'][1]['w']: on SimMesh")):
        fh.reduce_grads(bad, spec, last=True)


def test_last_missing_or_not_a_bool(spec):
    with pytest.raises(TypeError, match="last"):
        fh.reduce_grads(grads(), spec)
    with pytest.raises(TypeError, match="last must be a bool"):
        fh.reduce_grads(grads(), spec, last=1)
    with pytest.raises(TypeError, match="last must be a bool"):
        fh.reduce_grads(grads(), spec, last=torch.tensor(True))
    with pytest.raises(TypeError):
        fh.reduce_grads(grads(), spec, True)  # last is keyword-only


def test_finalized_result_refused_as_acc(spec):
    g = grads()
    final = fh.reduce_grads(g, spec, last=True)
    with pytest.raises(ValueError, match=re.escape("acc['layers'][0]['w']: is a finalized result")):
        fh.reduce_grads(g, spec, last=True, acc=final)


def test_weights_refused_as_acc(mesh, spec):
    g = grads()
    params = fh.shard({"layers": [{"w": torch.randn(4, 3)}, {"w": torch.randn(5)}]}, spec)
    with pytest.raises(ValueError, match="holds weights"):
        fh.reduce_grads(g, spec, last=True, acc=params)


def test_acc_from_another_spec_refused(mesh, spec):
    g = grads()
    other = fh.fsdp(mesh)
    acc = fh.reduce_grads(g, other, last=False)
    with pytest.raises(ValueError, match="another tree or spec"):
        fh.reduce_grads(g, spec, last=True, acc=acc)


def test_acc_with_another_structure(spec):
    acc = fh.reduce_grads(grads(), spec, last=False)
    with pytest.raises(ValueError, match=re.escape("acc['layers']")):
        fh.reduce_grads(grads(), spec, last=True, acc={"layers": acc["layers"][:1]})


def test_acc_with_wrong_shapes(spec):
    g = grads()
    acc = fh.reduce_grads(g, spec, last=False)
    acc = {"layers": [{"w": torch.zeros(2, 2, 3)}, acc["layers"][1]]}
    with pytest.raises(ValueError, match=re.escape("acc['layers'][0]['w']: expected local shape")):
        fh.reduce_grads(g, spec, last=True, acc=acc)


def test_gather_of_a_partial_accumulation_is_refused(spec):
    acc = fh.reduce_grads(grads(), spec, last=False)
    with pytest.raises(ValueError, match="still Partial"):
        fh.gather(acc, spec)


def test_gather_of_an_unknown_layout_asks_for_like(mesh):
    spec = fh.fsdp(mesh, bucket_cap_mb=1.0)
    pieces = {"never_seen": torch.zeros(2, 2, 3)}
    with pytest.raises(ValueError, match="like="):
        fh.gather(pieces, spec)
    full = fh.gather(pieces, spec, like={"never_seen": torch.empty(12)})
    assert full["never_seen"].shape == (2, 2, 12)


def test_spec_trees_must_share_one_mesh(mesh):
    other = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
    spec = {"a": fh.ddp(mesh), "b": fh.ddp(other)}
    with pytest.raises(ValueError, match="same mesh"):
        fh.reduce_grads({"a": torch.ones(2, 2, 1), "b": torch.ones(2, 2, 1)}, spec, last=True)


def test_sim_mesh_bad_shape():
    with pytest.raises(ValueError, match="positive int"):
        fh.SimMesh({"dp": 0})
    with pytest.raises(TypeError):
        fh.SimMesh([("dp", 2)])

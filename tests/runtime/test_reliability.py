"""Reliability in one process: the bad-input matrix, check_finite, the fingerprint protocol.

The bad-input matrix, and where each case is tested (E: tests/runtime/test_errors.py, R: here,
G: tests/runtime/test_reliability_gloo.py on 4 gloo ranks, D: tests/mesh/test_dist_gloo.py):

====================================================  =========================  ==========
case                                                  outcome                    tests
====================================================  =========================  ==========
spec prefix that does not match the tree              ValueError, spec path      E
spec tree with a non-Spec leaf                        TypeError, spec path       E
spec trees over two meshes                            ValueError                 E
axis not in the mesh; placements of wrong length      ValueError / TypeError     E
unsupported or impossible placements                  NotImplementedError / VE   E
non-floating gradients                                TypeError, path            E, G
non-tensor leaf                                       TypeError, path            E, G
SimMesh value without the mesh shape in front         ValueError, path           E
``last`` missing or not a bool                        TypeError                  E, G
finalized result / weights / other spec as ``acc``    ValueError, path           E, G
``acc`` of another structure, shape or dtype          ValueError/TypeError, path E, R, G
gather of a Partial accumulation / unknown layout     ValueError                 E
sparse leaves (reduce_grads, shard, gather, MainGrad) TypeError, path            R, G
meta-device leaves (every entry point)                ValueError, path           R, G
trees that differ across ranks (keys, list/tuple)     ValueError on every rank   G, R
shapes that differ across ranks                       ValueError on every rank   G, R
dtypes that differ across ranks                       ValueError on every rank   G, R
``last`` that differs across ranks (also ddp)         ValueError on every rank   G, R
specs or bucket caps that differ across ranks         ValueError on every rank   G
ranks in different calls (reduce_grads vs gather)     ValueError on every rank   G
MainGrad ``like`` or ``last`` differing across ranks  ValueError on every rank   G
NaN/Inf with ``check_finite=True``                    ValueError, path + ranks   R, G
empty tree                                            empty tree, no collective  R, G
zero-size leaves                                      work (empty results)       R, G
non-contiguous leaves                                 work                       R, G
requires_grad leaves                                  work, results detached     R, G
a rank that dies mid-accumulation / raises alone      CollectiveError in time    G
====================================================  =========================  ==========
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import threading

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
    packs,
    preset,
    random_tree,
)

import functional_hsdp as fh
from functional_hsdp.base.errors import CollectiveError, collective_error
from functional_hsdp.plan.recipe import TreeMeta, get_plan
from functional_hsdp.runtime.agreement import agree
from functional_hsdp.runtime.fingerprints import fingerprint
from functional_hsdp.runtime.validate import validation

# ``mesh`` (a 2x2 SimMesh) and ``spec`` (hsdp on it) are conftest.py's fixtures.

# -- documented behaviours -----------------------------------------------------------------


@pytest.mark.parametrize("empty", [{}, [], {"a": []}, (None, {})], ids=repr)
def test_empty_tree_gives_an_empty_tree_and_no_collective(spec, empty):
    ddp_1d = fh.ddp(fh.SimMesh({"dp": 2}))
    with fh.comm_log() as log:
        for s in (spec, ddp_1d):
            assert fh.reduce_grads(empty, s, last=True) == empty
            assert fh.gather(empty, s) == empty
            assert fh.shard(empty, s) == empty
    assert log.events == []
    with pytest.raises(ValueError, match="acc does not have the structure"):
        fh.reduce_grads({}, spec, last=True, acc={"x": torch.ones(1)})


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_zero_size_and_scalar_leaves_work(mesh, strategy):
    spec = preset(strategy, mesh)
    micro = [
        {
            "z": torch.ones(2, 2, 0, 3),
            "w": torch.randn(2, 2, 5),
            "e": torch.ones(2, 2, 4, 0),
            "s": torch.randn(2, 2),  # a scalar per rank
        }
        for _ in range(2)
    ]
    full = fh.gather(accumulate(micro, spec), spec)
    assert full["z"].shape == (2, 2, 0, 3) and full["e"].shape == (2, 2, 4, 0)
    assert full["s"].shape == (2, 2)
    assert max_error(full, dense_reduce(micro, 2)) < 1e-6
    params = {"z": torch.ones(0, 3), "w": torch.ones(5), "e": torch.ones(4, 0), "s": torch.ones(())}
    assert fh.gather(fh.shard(params, spec), spec)["z"].shape == (2, 2, 0, 3)


def test_only_zero_size_leaves_issue_no_collective(spec):
    with fh.comm_log() as log:
        out = fh.reduce_grads({"z": torch.ones(2, 2, 0)}, spec, last=True)
    assert log.events == [] and out["z"].numel() == 0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_non_contiguous_leaves_work_everywhere(mesh, strategy):
    spec = preset(strategy, mesh)
    base = torch.randn(2, 2, 6, 4)
    g = {"t": base.transpose(-1, -2), "s": base[..., ::2, 1]}
    assert not g["t"].is_contiguous() and not g["s"].is_contiguous()
    full = fh.gather(fh.reduce_grads(g, spec, last=True), spec)
    assert max_error(full, dense_reduce([g], 2)) < 1e-6
    mg = fh.MainGrad(spec, like={"t": torch.zeros(4, 6), "s": torch.zeros(3)})
    mg.accumulate(g, last=True)
    assert max_error(fh.gather(mg.grads, spec), dense_reduce([g], 2)) < 1e-6
    w = torch.randn(6, 4).t()
    torch.testing.assert_close(fh.gather(fh.shard({"w": w}, spec), spec)["w"][1, 0], w)


def test_requires_grad_leaves_give_detached_results(spec):
    w = torch.randn(2, 2, 4, 3, requires_grad=True)
    g = {"w": w * 2}
    outs = [
        fh.reduce_grads(g, spec, last=False),
        fh.reduce_grads(g, spec, last=True),
        fh.shard({"w": torch.ones(4, 3, requires_grad=True)}, spec),
        fh.gather(fh.reduce_grads(g, spec, last=True), spec),
    ]
    mg = fh.MainGrad(spec, like={"w": torch.zeros(4, 3, requires_grad=True)})
    mg.accumulate(g, last=True)
    outs.append(mg.grads)
    for out in outs:
        assert not out["w"].requires_grad and out["w"].grad_fn is None
    assert w.grad is None


# -- local bad input at every entry point --------------------------------------------------


def test_sparse_and_meta_leaves_are_refused_by_every_entry_point(spec):
    sparse, meta = torch.ones(2, 2, 4).to_sparse(), torch.empty(2, 2, 4, device="meta")
    like = {"w": torch.zeros(4)}
    calls = {
        "reduce_grads": lambda x: fh.reduce_grads(
            {"a": torch.ones(2, 2, 3), "w": x}, spec, last=True
        ),
        "shard": lambda x: fh.shard({"w": x}, spec),
        "gather": lambda x: fh.gather({"w": x}, spec),
        "MainGrad": lambda x: fh.MainGrad(spec, like=like).accumulate({"w": x}, last=True),
        "MainGrad like": lambda x: fh.MainGrad(spec, like={"w": x[0, 0]}),
        "psum": lambda x: fh.psum({"w": x}, "dp_inner", spec.mesh),
    }
    for name, call in calls.items():
        where = re.escape("grads['w']") if name == "reduce_grads" else r"\['w'\]"
        with pytest.raises(TypeError, match=where + ": expected a dense"):
            call(sparse)
        with pytest.raises(ValueError, match=where + ": is on the meta device"):
            call(meta)
    with pytest.raises(TypeError, match=re.escape("tree['lr']: expected a torch.Tensor")):
        fh.shard({"w": torch.ones(3), "lr": 0.1}, spec)


def test_an_acc_of_the_wrong_dtype_is_refused_naming_its_path_before_any_collective(spec):
    g = {"layers": [{"w": torch.randn(2, 2, 4, 3)}, {"w": torch.randn(2, 2, 6)}]}
    acc = fh.reduce_grads(g, spec, last=False)
    edited = fh.reduce_grads(g, spec, last=False)  # the result itself, one leaf replaced
    edited["layers"][1]["w"] = edited["layers"][1]["w"].double()
    rebuilt = {"layers": [acc["layers"][0], {"w": acc["layers"][1]["w"].double()}]}
    for bad in (edited, rebuilt):
        message = re.escape("acc['layers'][1]['w']: expected dtype")
        with fh.comm_log() as log, pytest.raises(TypeError, match=message):
            fh.reduce_grads(g, spec, last=True, acc=bad)
        assert log.events == []  # on a DistMesh no peer is left waiting in a collective


# -- check_finite --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=str)
def test_check_finite_names_the_first_bad_leaf_and_its_ranks(spec, bad):
    g = {"a": torch.ones(2, 2, 3), "b": torch.ones(2, 2, 4), "c": torch.ones(2, 2, 2)}
    g["b"][1, 0, 2] = bad
    g["c"][0, 0, 0] = bad
    before = optree.tree_map(torch.clone, g)
    with fh.comm_log() as log, pytest.raises(ValueError) as info:
        fh.reduce_grads(g, spec, last=True, check_finite=True)
    assert str(info.value).startswith("grads['b']: holds NaN or Inf on rank (1, 0)")
    assert log.events == []
    torch.testing.assert_close(g, before, rtol=0, atol=0, equal_nan=True)  # not mutated


def test_check_finite_lists_every_rank_with_the_bad_leaf():
    mesh = fh.SimMesh({"dp": 4})
    g = {"w": torch.ones(4, 3)}
    g["w"][1, 0] = g["w"][3, 2] = float("nan")
    with pytest.raises(ValueError, match=re.escape("grads['w']: holds NaN or Inf on ranks [1, 3]")):
        fh.reduce_grads(g, fh.fsdp(mesh), last=False, check_finite=True)


def test_check_finite_on_maingrad_leaves_the_buffers_alone(spec):
    mg = fh.MainGrad(spec, like={"w": torch.zeros(6)})
    mg.accumulate({"w": torch.ones(2, 2, 6)}, last=False)
    saved = [b.clone() for b in mg.buffers]
    bad = torch.ones(2, 2, 6, dtype=torch.bfloat16)
    bad[0, 1, 5] = float("inf")
    with pytest.raises(ValueError, match=re.escape("grads['w']: holds NaN or Inf on rank (0, 1)")):
        mg.accumulate({"w": bad}, last=True, check_finite=True)
    assert all(torch.equal(a, b) for a, b in zip(mg.buffers, saved)) and mg.state == "accumulating"


def test_without_check_finite_nan_propagates_and_check_finite_must_be_a_bool(spec):
    g = {"w": torch.ones(2, 2, 4)}
    g["w"][0, 0, 0] = float("nan")
    out = fh.gather(fh.reduce_grads(g, spec, last=True), spec)
    assert out["w"][:, :, 0].isnan().all() and not out["w"][:, :, 1:].isnan().any()
    with pytest.raises(TypeError, match="check_finite must be a bool"):
        fh.reduce_grads(g, spec, last=True, check_finite=1)


# -- the fingerprint protocol, with threads as ranks ---------------------------------------


class ThreadMesh:
    """The mesh's diagnostics (the validation exchange) for ranks that are threads (a test
    double)."""

    def __init__(self, n: int):
        self.n, self.batch_shape = n, ()
        self.axis_names, self.sizes = ("dp",), (n,)
        self.diagnostics = self
        self._barrier = threading.Barrier(n, timeout=30)
        self._rows: list = [None] * n
        self._local = threading.local()

    def bind(self, rank: int) -> ThreadMesh:
        self._local.rank = rank
        return self

    def exchange(self, t: torch.Tensor, axes) -> torch.Tensor:
        self._rows[self._local.rank] = t.clone()
        self._barrier.wait()
        out = torch.stack(self._rows)
        self._barrier.wait()  # nobody overwrites a row before everyone has read it
        return out

    def members(self, axes):
        return [tuple(str(r) for r in range(self.n))]


def _fingerprint(grads: dict, spec: fh.Spec, last: bool, name: str = "grads"):
    nb = len(spec.mesh.batch_shape)
    paths, leaves, treedef = optree.tree_flatten_with_path(grads)
    paths = tuple(name + "".join(f"[{k!r}]" for k in p) for p in paths)
    plan = get_plan(
        TreeMeta(
            treedef,
            tuple(tuple(x.shape[nb:]) for x in leaves),
            tuple(x.dtype for x in leaves),
            tuple(x.device for x in leaves),
            (spec,) * len(leaves),
            (0,) * len(leaves),
        ),
        paths,
    )
    return fingerprint(plan, "reduce_grads", paths, last=last, options=()), paths


def _agree_on_threads(per_rank: list, nonfinite: list | None = None) -> list:
    """Run the protocol with rank r's (grads, spec, last); each rank's error or None."""
    mesh, out = ThreadMesh(len(per_rank)), [None] * len(per_rank)

    def rank(r: int) -> None:
        fp, paths = _fingerprint(*per_rank[r])
        bad = torch.tensor(nonfinite[r]) if nonfinite else None
        try:
            agree(mesh.bind(r), ("dp",), fp, paths, bad)
        except ValueError as e:
            out[r] = str(e)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(len(per_rank))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


@pytest.fixture
def dp2():
    return fh.ddp(fh.SimMesh({"dp": 2}))


def _g(**shapes):
    return {k: torch.zeros(2, *s) for k, s in shapes.items()}


def test_protocol_agrees_when_every_rank_matches(dp2):
    assert _agree_on_threads([(_g(a=(3,), b=(4, 2)), dp2, True)] * 3) == [None] * 3


@pytest.mark.parametrize(
    ("ranks", "message"),
    [
        (
            [_g(a=(3,), b=(4, 2)), _g(a=(3,), b=(5, 2)), _g(a=(3,), b=(4, 2))],
            "grads['b']: shape (4, 2) on ranks [0, 2] but (5, 2) on rank 1",
        ),
        (
            [_g(a=(3,)), _g(a=(3,), b=(1,)), _g(a=(3,), b=(1,))],
            "grads['b']: the tree structure differs across ranks at leaf 1: no leaf 1 (a shorter "
            "tree) on rank 0 but grads['b'] on ranks [1, 2]",
        ),
        (
            [_g(a=(3,), b=(2,)), _g(a=(3,), c=(2,)), _g(a=(3,), d=(2,))],
            "grads['b']: the tree structure differs across ranks at leaf 1: grads['b'] on rank 0 "
            "but grads['c'] on rank 1, grads['d'] on rank 2",
        ),
    ],
    ids=["shape", "missing_leaf", "three_ways"],
)
def test_protocol_names_the_first_differing_leaf_and_the_ranks(dp2, ranks, message):
    errors = _agree_on_threads([(g, dp2, True) for g in ranks])
    assert len(set(errors)) == 1 and errors[0].startswith(message), errors[0]


def test_protocol_reports_dtype_before_the_bucket_slots_it_moves(dp2):
    a = _g(a=(3,), b=(4,))
    b = {"a": a["a"], "b": a["b"].double()}  # b's dtype changes a's bucket too
    errors = _agree_on_threads([(a, dp2, True), (b, dp2, True)])
    assert errors[0] == errors[1]
    assert errors[0].startswith("grads['b']: dtype torch.float32 on rank 0 but torch.float64")


def test_protocol_reports_last_and_non_finite_leaves(dp2):
    g = _g(a=(3,), b=(2,))
    errors = _agree_on_threads([(g, dp2, False), (g, dp2, True)])
    assert errors[0] == errors[1]
    assert errors[0].startswith("last differs across ranks: last=False on rank 0 but last=True")
    errors = _agree_on_threads([(g, dp2, True)] * 3, nonfinite=[-1, 1, 0])
    assert (
        errors
        == ["grads['a']: holds NaN or Inf on rank 2 (check_finite=True); no collective was issued"]
        * 3
    )


# -- validation modes and caching ----------------------------------------------------------


def _count_exchanges(monkeypatch, mesh) -> list:
    calls = []
    original = mesh.diagnostics.exchange

    def spy(t, axes):
        calls.append(axes)
        return original(t, axes)

    monkeypatch.setattr(mesh.diagnostics, "exchange", spy)
    return calls


def test_every_call_exchanges_one_row_over_the_whole_mesh(monkeypatch, mesh, spec):
    """The agreement cannot be skipped by one rank alone: every call takes part in exactly one
    small exchange (a healthy run never makes a second), check_finite included."""
    calls = _count_exchanges(monkeypatch, mesh)
    g = {"w": torch.ones(2, 2, 6)}
    for _ in range(3):
        accumulate([g, g, g], spec)  # 3 calls per step
    assert len(calls) == 9 and set(calls) == {("dp_outer", "dp_inner")}
    fh.gather(fh.reduce_grads(g, spec, last=True), spec)
    assert len(calls) == 11
    fh.reduce_grads(g, spec, last=True, check_finite=True)
    assert len(calls) == 12
    with validation("always"):  # a former name of the default, kept
        fh.reduce_grads(g, spec, last=True)
    with validation("off"):
        fh.reduce_grads({"new": torch.ones(2, 2, 1)}, spec, last=True)
    assert len(calls) == 13


def test_the_exchange_spans_every_axis_so_ranks_naming_other_axes_cannot_deadlock(monkeypatch):
    """A spec over "dp" alone still exchanges over ("tp", "dp"): ranks whose specs name
    different data-parallel axes would otherwise wait in different groups."""
    mesh = fh.SimMesh({"tp": 2, "dp": 2})
    calls = _count_exchanges(monkeypatch, mesh)
    fh.reduce_grads({"w": torch.ones(2, 2, 3)}, fh.fsdp(mesh, "dp"), last=True)
    assert calls == [("tp", "dp")]
    with pytest.raises(ValueError, match="mode must be one of"):
        with validation("sometimes"):
            pass


def test_validation_is_not_a_logged_collective(mesh, spec):
    with fh.comm_log() as log:
        fh.reduce_grads({"w": torch.ones(2, 2, 6)}, spec, last=True)  # first call: validated
    assert [(e.op, e.axis) for e in log.events] == [
        ("reduce_scatter", "dp_inner"),
        ("all_reduce", "dp_outer"),
    ]


def test_collective_error_names_the_collective_and_chains_the_cause(mesh):
    cause = RuntimeError("Connection closed by peer")
    err = collective_error("all_reduce", "dp_outer", mesh, exc=cause, rank=3, timeout=5)
    assert issubclass(CollectiveError, RuntimeError)
    assert isinstance(err, RuntimeError) and isinstance(err, CollectiveError)
    assert (err.op, err.axis) == ("all_reduce", "dp_outer")
    text = str(err)
    assert text.startswith("all_reduce over mesh axis 'dp_outer' failed on rank 3")
    assert "a peer rank may have died" in text and "Connection closed by peer" in text


# -- determinism ---------------------------------------------------------------------------


def _digests() -> tuple[str, int]:
    """A digest of many results' bytes, and a fingerprint digest (run here and in a child)."""
    mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 3})
    h = hashlib.sha256()
    for strategy in STRATEGIES:
        spec = preset(strategy, mesh, bucket_cap_mb=40 * 4 / 2**20)
        for dtype in (torch.float32, torch.bfloat16):
            micro = [random_tree((2, 3), dtype, seed=m) for m in range(3)]
            for t in optree.tree_leaves(fh.gather(accumulate(micro, spec), spec)):
                h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    fp, _ = _fingerprint(
        {"w": torch.zeros(2, 3), "b": torch.zeros(2)}, fh.ddp(fh.SimMesh({"dp": 2})), True
    )
    return h.hexdigest(), fp.whole


def test_results_are_bit_identical_across_calls():
    for strategy in STRATEGIES:
        mesh = fh.SimMesh(dict(zip(AXES, (2, 3))))
        spec = preset(strategy, mesh, bucket_cap_mb=40 * 4 / 2**20)
        micro = [random_tree((2, 3), torch.bfloat16, shapes=SHAPES, seed=m) for m in range(3)]
        a, b = accumulate(micro, spec), accumulate(micro, spec)
        assert all(torch.equal(x, y) for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b)))


def test_results_and_fingerprints_are_identical_across_processes():
    here = os.path.dirname(os.path.abspath(__file__))
    child = subprocess.run(
        [sys.executable, "-c", "import test_reliability as t; print(*t._digests())"],
        cwd=here,
        env={**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": os.pathsep.join(sys.path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr
    digest, whole = child.stdout.split()
    assert (digest, int(whole)) == _digests()


def test_simmesh_results_never_alias_across_ranks(mesh):
    """ddp's final result on a SimMesh: each rank's value is its own memory, as on real ranks."""
    out = fh.reduce_grads({"w": torch.randn(2, 2, 3)}, fh.ddp(mesh), last=True)
    before = out["w"][1, 0].clone()
    out["w"][0, 0].mul_(10)
    assert torch.equal(out["w"][1, 0], before)
    # writable as a whole, too: no element is another's memory (an expanded result would
    # refuse the in-place write), so each rank's value is halved once
    whole = out["w"].clone()
    out["w"].mul_(0.5)
    assert torch.equal(out["w"], whole * 0.5)


def test_complex_leaves_are_refused_with_their_path(mesh, spec):
    with pytest.raises(TypeError, match=re.escape("grads['c']: complex gradients")):
        fh.reduce_grads({"c": torch.ones(2, 2, 3, dtype=torch.complex64)}, spec, last=True)


class _SumFirstMesh(fh.SimMesh):
    """A SimMesh whose AVG sums in the buffer's dtype and divides after, as gloo's AVG does
    (the SimMesh's own mean accumulates fp16 in fp32, so it never overflows)."""

    def all_reduce(self, buf, axis, op):
        if op != "avg":
            return super().all_reduce(buf, axis, op)
        return super().all_reduce(buf, axis, "sum") / self.size(axis)

    def reduce_scatter(self, buf, axis, op):
        if op != "avg":
            return super().reduce_scatter(buf, axis, op)
        return super().reduce_scatter(buf, axis, "sum") / self.size(axis)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fp16_average_does_not_overflow_on_a_simmesh(strategy):
    """On a mesh whose fp16 AVG overflows (2 x 40000 > 65504), the pre- and post-divided sum
    does not: each rank's 40000 averages to 40000, in reduce_grads and in fp16 MainGrads."""
    mesh = _SumFirstMesh({"dp_outer": 2, "dp_inner": 2})
    g = {"w": torch.full((2, 2, 4), 40000.0, dtype=torch.float16)}
    assert torch.isinf(mesh.all_reduce(g["w"], "dp_inner", "avg")).all()  # the naive AVG
    spec = preset(strategy, mesh)
    with fh.comm_log() as log:
        out = fh.gather(fh.reduce_grads(g, spec, last=True), spec)["w"]
        mg = fh.MainGrad(spec, like={"w": torch.zeros(4)}, dtype=torch.float16)
        mg.accumulate(g, last=True)
    assert torch.equal(out, g["w"]), out
    assert torch.equal(fh.gather(mg.grads, spec)["w"], g["w"])
    assert {e.reduce for e in log.events if e.op != "all_gather"} == {"sum"}  # on the wire


def test_acc_leaves_swapped_between_positions_are_checked_by_value(mesh, spec):
    """A result's own leaves given back at other positions: not trusted as that result (its
    buffers are not read); checked by value, so a shape that no longer fits is refused."""
    g = {"a": torch.ones(2, 2, 7, 3), "c": torch.ones(2, 2, 5)}
    acc = fh.reduce_grads(g, spec, last=False)
    with pytest.raises(ValueError, match=re.escape("acc['a']: holds this tree's leaf acc['c']")):
        fh.reduce_grads(g, spec, last=True, acc={"a": acc["c"], "c": acc["a"]})


@pytest.mark.parametrize("replace", ["set_", "data"])
def test_acc_leaf_whose_storage_was_replaced_is_read_by_value(mesh, spec, replace):
    g = {"a": torch.ones(2, 2, 7, 3), "c": torch.ones(2, 2, 5)}
    acc = fh.reduce_grads(g, spec, last=False)
    fresh = acc["a"].clone().fill_(5.0)
    if replace == "set_":
        acc["a"].set_(fresh)
    else:
        acc["a"].data = fresh
    out = fh.reduce_grads(g, spec, last=False, acc=acc)
    ref = fh.reduce_grads(g, spec, last=False, acc=optree.tree_map(torch.clone, acc))
    assert all(map(torch.equal, optree.tree_leaves(out), optree.tree_leaves(ref)))


def test_vmap_over_the_library_is_refused_up_front(mesh, spec):
    g = torch.randn(7, 2, 2, 5, 3)
    for fn in (
        lambda x: fh.reduce_grads({"w": x}, spec, last=True)["w"],
        lambda x: fh.shard({"w": x[0, 0]}, spec)["w"],
    ):
        with pytest.raises(NotImplementedError, match="under torch.func.vmap is not supported"):
            torch.func.vmap(fn)(g)


def test_a_per_example_gradient_tree_is_refused_naming_the_leaf(mesh, spec):
    params = fh.shard({"b": torch.zeros(3), "w": torch.zeros(5, 3)}, spec)
    assert params["w"].shape[:2] == (2, 2)
    per_example = {"b": torch.ones(2, 2, 8, 3), "w": torch.ones(2, 2, 8, 5, 3)}
    with pytest.raises(ValueError, match=re.escape("grads['b']: has shape (8, 3)")):
        fh.reduce_grads(per_example, spec, last=True)


def test_an_acc_is_read_from_its_buffers_whatever_id_a_dead_result_had(mesh, spec):
    """A result given back as acc is read from its bucket buffers even when its first leaf
    has the id of a leaf of a result that died (tags are swept lazily): with that dead
    entry consulted first, 12 in 100 such accs were packed again."""
    ddp = fh.ddp(fh.SimMesh({"dp": 4}))
    packed = []
    for i in range(60):
        fh.reduce_grads(random_tree((2, 2), seed=i), spec, last=False)  # pieces: tagged by id
        g = random_tree((4,), seed=i)
        acc = fh.reduce_grads(g, ddp, last=False)
        with packs("gradient") as again:
            fh.reduce_grads(g, ddp, last=True, acc=acc)
        packed += again
    assert packed == []


@pytest.mark.parametrize("replace", ["set_", "data"])
@pytest.mark.parametrize(
    "shape", [{"dp": 2}, {"dp_outer": 2, "dp_inner": 1}], ids=["ddp", "hsdp-inner-1"]
)
def test_a_replaced_storage_is_not_read_from_the_old_bucket_buffer(shape, replace):
    """Where result leaves view their bucket buffer (ddp's gradient placement; a Flat axis of
    size 1), an acc given back as returned is read from that buffer: in-place edits are seen,
    and a leaf whose storage was replaced is read by value, not from the old buffer."""
    mesh = fh.SimMesh(shape)
    spec = fh.ddp(mesh) if len(shape) == 1 else fh.hsdp(mesh, "dp_outer", "dp_inner")
    batch = tuple(shape.values())
    g = {"a": torch.randn(*batch, 7, 3), "c": torch.randn(*batch, 5)}
    for last in (False, True):
        acc = fh.reduce_grads(g, spec, last=False)
        assert all(x._base is not None for x in optree.tree_leaves(acc))  # bucket views
        acc["c"].mul_(3)  # seen through the buffer
        fresh = acc["a"].clone().fill_(5.0)
        if replace == "set_":
            acc["a"].set_(fresh)
        else:
            acc["a"].data = fresh
        out = fh.reduce_grads(g, spec, last=last, acc=acc)
        ref = fh.reduce_grads(g, spec, last=last, acc=optree.tree_map(torch.clone, acc))
        assert all(map(torch.equal, optree.tree_leaves(out), optree.tree_leaves(ref)))

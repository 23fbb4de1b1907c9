"""Every tensor the library makes takes its device from its inputs, and a healthy call reads no
device data on the host: the hot paths run on tensors of a device that is not the CPU.

How, on a CPU-only machine: ``torch._subclasses.FakeTensorMode`` makes tensors that carry a
device and a shape but no data. Inside it every op checks devices exactly as on real
hardware (a CPU tensor mixed with a device tensor raises), and any read of data on the host
(``.item()``, ``bool(t)``, ``.tolist()``: what a host-device synchronization is made of)
raises ``DataDependentOutputException``. So a call that passes here makes every tensor on its
inputs' device and never waits for the device's data.

The device is ``"lazy"``, not ``"cuda"``: on torch's CPU wheel, fake ``"cuda"`` tensors fail
inside torch's own Python bindings of ``copy_``, indexing and ``.to(device)`` (they enter a
CUDA device guard, which the CPU build lacks), whatever the library does; ``"lazy"`` has a
guard and is otherwise an ordinary non-CPU device here. Where CUDA is present, the same tests
also run on real ``"cuda"`` tensors (values included).

What this cannot cover: the cross-rank agreement on a SimMesh (its rows are compared in
process, so it runs with ``validation("off")`` here; on a DistMesh its rows are CPU data by
construction, tested in ``tests/runtime/test_field_gloo.py``), collectives on a real device (a
one-rank DistMesh issues none), streams, and the speed of anything (``python -m bench gpu``).
"""

from __future__ import annotations

import warnings

import optree
import pytest
import torch
from reference import STRATEGIES, preset
from torch._subclasses.fake_tensor import FakeTensorMode

import functional_hsdp as fh
from functional_hsdp.mesh import launch

SHAPES = {"w": (8, 5), "b": (7,), "n": {"v": (3, 2)}}


def _cases():
    yield pytest.param("fake", id="fake-lazy")
    if torch.cuda.is_available():
        yield pytest.param("cuda", id="cuda")


@pytest.fixture(params=list(_cases()))
def on_device(request):
    """``(device, context)``: tensors made inside ``context`` on ``device`` are what the
    library gets; ``context`` is a FakeTensorMode (no data) or nothing (real CUDA)."""
    fh.clear_caches()  # no plan built under fake tensors outlives the test
    with warnings.catch_warnings():
        # the library's checks that a buffer is untouched read data_ptr: fake tensors warn
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        if request.param == "fake":
            with FakeTensorMode(), fh.validation("off"):
                yield torch.device("lazy")
        else:
            yield torch.device("cuda")
    fh.clear_caches()


def _tree(batch, device, dtype=torch.float32):
    return optree.tree_map(
        lambda s: torch.randn(*batch, *s, device=device, dtype=dtype),
        SHAPES,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def _on(tree, device) -> bool:
    return all(x.device.type == device.type for x in optree.tree_leaves(tree))


def _sim():
    return fh.SimMesh({"dp_outer": 2, "dp_inner": 2})


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_whole_tree_loop_stays_on_the_device(on_device, strategy):
    device, spec = on_device, preset(strategy, _sim())
    batch = spec.mesh.batch_shape
    params = fh.shard(_tree((), device), spec)
    full = fh.gather(fh.sync_params(params, spec), spec)
    acc = None
    for m in range(3):
        acc = fh.reduce_grads(_tree(batch, device), spec, last=m == 2, acc=acc)
    grads, _ = fh.clip_by_global_norm(acc, spec, max_norm=1.0)
    opt = fh.adamw(lr=1e-3)
    updates, _ = opt.update(grads, opt.init(params), params)
    params = fh.apply_updates(params, updates)
    assert _on(params, device) and _on(full, device) and _on(grads, device)
    assert [x.shape for x in optree.tree_leaves(full)] == [
        (*batch, *x.shape) for x in optree.tree_leaves(_tree((), device))
    ]


@pytest.mark.parametrize("strategy", ["hsdp", "hfsdp"])
@pytest.mark.parametrize("at", ["input", "gradient"])
def test_maingrad_stays_on_the_device(on_device, strategy, at):
    device, spec = on_device, preset(strategy, _sim())
    batch = spec.mesh.batch_shape
    like = _tree((), device)
    mg = fh.MainGrad(spec, like=like, reduce_dtype=torch.bfloat16)
    for step in range(2):
        for _, last in fh.microbatches(2):
            g = _tree(batch, device, torch.bfloat16)
            if at == "gradient":
                g = fh.reduce_grads(g, spec, last=False)  # local shards at the gradient role
            mg.accumulate(g, last=last, at=at)
        assert _on(mg.grads, device) and all(b.device.type == device.type for b in mg.buffers)
        mg.zero_grad(set_to_none=step == 0)  # both of torch.optim's modes


def test_per_axis_collectives_and_shard_dim_specs_stay_on_the_device(on_device):
    device, mesh = on_device, _sim()
    g = _tree(mesh.batch_shape, device)
    pieces = fh.psum_scatter(g, "dp_inner", mesh)
    out = [fh.psum(g, "dp_outer", mesh), fh.pmean(g, "dp_inner", mesh), pieces]
    out.append(fh.all_gather(pieces, "dp_inner", mesh))
    spec = fh.Spec(mesh, [fh.Replicate(), fh.Shard(0)], [fh.Partial(), fh.Shard(0)],
                   [fh.Replicate(), fh.Shard(0)])  # fmt: skip
    out.append(fh.gather(fh.reduce_grads(g, spec, last=True), spec))
    assert all(_on(t, device) for t in out)


def _layerwise_step(mesh, spec, device, into, deferred: bool):
    """Two steps of a two-block model with gathered units (pure, or into a MainGrad)."""
    tree_spec = [spec, spec]
    full = [{"w": torch.randn(4, 4, device=device)} for _ in range(2)]
    shards = fh.shard(full, tree_spec)
    mg = fh.MainGrad(tree_spec, like=full) if into else None
    blk = fh.gathered(fh.per_rank(lambda p, x: torch.tanh(x @ p["w"]), mesh), spec, into=mg)
    x = torch.randn(*mesh.batch_shape, 3, 4, device=device)
    loss = lambda s: fh.sequence(blk, s, x).square().sum()  # noqa: E731
    for _ in range(2):
        acc = None
        for _m, last in fh.microbatches(2, into=mg if deferred else None):
            g = torch.func.grad(loss)(shards)
            if mg is None:
                acc = fh.reduce_grads(g, tree_spec, last=last, acc=acc, at="gradient")
        if mg is not None:
            mg.finish()
            acc = mg.grads
        assert _on(acc, device)
        for p, d in zip(optree.tree_leaves(shards), optree.tree_leaves(acc)):
            p.sub_(0.1 * d)
        if mg is not None:
            mg.zero_grad()
    return shards


@pytest.mark.parametrize(
    "into, deferred",
    [(False, False), (True, False), (True, True)],
    ids=["pure", "into", "deferred"],
)
def test_gathered_units_stay_on_the_device(on_device, into, deferred):
    """Layer-wise units under torch.func.grad: forward all-gathers, backward reduce-scatters
    and (into=) the MainGrad's adds and zero gradients, all on the inputs' device."""
    mesh = _sim()
    shards = _layerwise_step(mesh, preset("hsdp", mesh), on_device, into, deferred)
    assert _on(shards, on_device)


def test_device_tensors_mixed_with_cpu_ones_are_caught_here():
    """The check is real: a CPU tensor meeting a device one raises, and so does reading
    device data on the host."""
    with FakeTensorMode():
        x = torch.ones(2, 3, device="lazy")
        with pytest.raises(RuntimeError):
            x + torch.ones(2, 3)
        with pytest.raises(Exception, match="aten._local_scalar_dense"):
            bool(x.sum() > 0)


def _one_rank(task, *args):
    return launch.run(task, *args, world_size=1, timeout=60.0)


def _one_rank_device_task():
    """On a one-rank DistMesh (no collective, no exchange: what ``bench gpu`` runs on NCCL):
    every library path on device tensors."""
    from torch.distributed.device_mesh import init_device_mesh

    dm = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_outer", "dp_inner"))
    mesh = fh.DistMesh(dm)
    device = torch.device("lazy")
    out = []
    with FakeTensorMode(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        for strategy in STRATEGIES:
            spec = preset(strategy, mesh)
            params = fh.shard(_tree((), device), spec)
            acc = None
            for m in range(2):
                acc = fh.reduce_grads(_tree((), device), spec, last=m == 1, acc=acc)
            out.append(_on(fh.gather(params, spec), device) and _on(acc, device))
        for into, deferred in [(False, False), (True, False), (True, True)]:
            shards = _layerwise_step(mesh, preset("hsdp", mesh), device, into, deferred)
            out.append(_on(shards, device))
    return out


def test_one_rank_distmesh_paths_stay_on_the_device():
    (results,) = _one_rank(_one_rank_device_task)
    assert results == [True] * 7


MATRIX_SHAPES = {"w": (8, 6), "v": (6, 6), "e": (3, 4, 6), "b": (6,)}


def _matrix_spec(kind: str, mesh):
    if kind == "owned":
        return fh.owned(preset("hsdp", mesh))
    if kind == "owned_outer":
        return fh.owned(preset("hsdp", mesh), "dp_outer")
    if kind == "shard1":  # Shard(1) for the matrices, Shard(0) for the 1-D leaf
        R, P = fh.Replicate(), fh.Partial()
        return {
            k: fh.Spec(mesh, [R, fh.Shard(d)], [P, fh.Shard(d)], [R, fh.Shard(d)])
            for k, d in {"w": 1, "v": 1, "e": 2, "b": 0}.items()
        }
    return preset(kind, mesh)


@pytest.mark.parametrize("kind", ["hsdp", "owned", "owned_outer", "shard1"])
def test_matrix_optimizers_stay_on_the_device(on_device, kind):
    """fh.muon + fh.adamw (fh.partition) and fh.per_matrix: the owner routes (all-to-alls,
    the local selection, Shard(d) chunks joined at the owner), Newton-Schulz and the updates,
    all on the inputs' device, with no host read of device data."""
    device, mesh = on_device, _sim()
    spec = _matrix_spec(kind, mesh)
    full = optree.tree_map(
        lambda s: torch.randn(*s, device=device),
        MATRIX_SHAPES,
        is_leaf=lambda x: isinstance(x, tuple),
    )
    params = fh.shard(full, spec)
    labels = {k: "muon" if len(s) > 1 else "adamw" for k, s in MATRIX_SHAPES.items()}
    opt = fh.partition({"muon": fh.muon(spec, lr=0.02), "adamw": fh.adamw(lr=1e-3)}, labels)
    state = opt.init(params)
    for _ in range(2):
        g = optree.tree_map(lambda x: torch.randn(*mesh.batch_shape, *x.shape, device=device), full)
        grads = fh.reduce_grads(g, spec, last=True)
        updates, state = opt.update(grads, state, params)
        params = fh.apply_updates(params, updates)
    matrices = {k: v for k, v in full.items() if v.dim() > 1}
    mspec = {k: spec[k] for k in matrices} if isinstance(spec, dict) else spec
    doubled = fh.per_matrix(lambda x: 2 * x, fh.shard(matrices, mspec), mspec)
    moments = [x for x in optree.tree_leaves(state) if isinstance(x, torch.Tensor)]  # and counts
    assert moments and _on(moments, device)
    assert _on(params, device) and _on(doubled, device)


@pytest.mark.parametrize(
    "options",
    [
        dict(fragments=2, delay=0),
        dict(fragments=2, delay=1, mix=0.5),
        dict(fragments=1, delay=1, compress="int8"),
    ],  # fmt: skip
    ids=["streaming", "delayed", "compressed"],
)
def test_diloco_stays_on_the_device(on_device, options):
    """fh.diloco: the pseudo-gradient, its sync (in flight with a delay; compressed), the
    outer step, the merge and the whole state on the inputs' device, no host read of device
    data, and a checkpoint's trees of a sync in flight (pending_tree, residual_tree) too."""
    from functional_hsdp.diloco import pending_tree, residual_tree

    device, mesh = on_device, _sim()
    options = dict(options)
    if options.pop("compress", None):
        options["compress"] = fh.compress(torch.int8, block=8)
    outer = fh.sgd(0.7, momentum=0.9, nesterov=True)
    dl = fh.diloco(fh.hsdp(mesh, "dp_outer", "dp_inner"), axis="dp_outer", every=2,
                   outer=outer, **options)  # fmt: skip
    params = fh.shard(_tree((), device), dl.inner)
    state, opt = dl.init(params), fh.sgd(0.1)
    opt_state, saved = opt.init(params), None
    for _ in range(4):
        grads = fh.reduce_grads(_tree(mesh.batch_shape, device), dl.inner, last=True)
        updates, opt_state = opt.update(grads, opt_state, params)
        params, state = dl.update(fh.apply_updates(params, updates), state)
        if any(state.flight):  # what a checkpoint saves of a sync in flight
            saved = [pending_tree(state), residual_tree(state)]
    tensors = [x for x in optree.tree_leaves(state) if isinstance(x, torch.Tensor)]
    assert tensors and _on(tensors, device) and _on(params, device)
    assert (saved is not None) == (options["delay"] > 0)
    assert saved is None or _on(optree.tree_leaves(saved), device)
    assert saved is None or (saved[1] is not None) == ("compress" in options)

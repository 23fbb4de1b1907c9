"""Plain dense-torch references that the tests check every mesh and spec against, and the
helpers that gloo worker processes import with the test modules' task functions (workers
import modules by name; ``conftest.py`` holds the fixtures, and is not imported).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import optree
import torch
from torch.func import functional_call

import functional_hsdp as fh
from functional_hsdp.mesh import dist as dist_module
from functional_hsdp.plan import recipe as plan_module
from functional_hsdp.tools.testing import torch_muon_in  # noqa: F401 - torch's Muon, fp32 Newton-Schulz


class Tap(torch.autograd.Function):
    """``x`` (a copy); its backward first calls ``on_backward()``: a probe for when a gradient
    passes that point (and whether it is computed at all), under any torch.func transform."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, on_backward):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.on_backward = inputs[1]

    @staticmethod
    def backward(ctx, g):
        ctx.on_backward()
        return g, None


AXES = ("dp_outer", "dp_inner")
SHAPES = {"a": (7, 3), "n": [(5,), {"s": (1,)}], "z": (13, 11)}
STRATEGIES = ("ddp", "fsdp", "hsdp", "hfsdp")
GLOO_SHAPE = (2, 2)  # the 4 ranks of conftest.py's ``pool`` as a (dp_outer, dp_inner) mesh


def preset(name: str, mesh: fh.Mesh, **kw) -> fh.Spec:
    """A preset over the whole (dp_outer, dp_inner) mesh."""
    if name == "ddp":
        return fh.ddp(mesh, **kw)
    if name == "fsdp":
        return fh.fsdp(mesh, **kw)
    if name == "hsdp":
        return fh.hsdp(mesh, "dp_outer", "dp_inner", **kw)
    if name == "hfsdp":
        return fh.hfsdp(mesh, "dp_outer", "dp_inner", **kw)
    raise ValueError(name)


def random_tree(batch: tuple[int, ...], dtype=torch.float32, shapes=SHAPES, seed=None):
    """A tree of random per-rank values with the mesh shape ``batch`` in front."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return optree.tree_map(
        lambda s: torch.randn(*batch, *s, generator=gen).to(dtype),
        shapes,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def dense_reduce(micro: list, batch_ndim: int, op: str = "avg"):
    """The mean (or sum) over ranks of the sum over microbatches, in float64."""

    def one(*xs):
        total = sum(x.double() for x in xs)
        dims = tuple(range(batch_ndim))
        return total.mean(dims) if op == "avg" else total.sum(dims)

    return optree.tree_map(one, *micro)


def accumulate(micro: list, spec, **kw):
    """reduce_grads over the microbatches, as a training loop would."""
    acc = None
    for m, g in enumerate(micro):
        acc = fh.reduce_grads(g, spec, last=(m == len(micro) - 1), acc=acc, **kw)
    return acc


def max_error(tree, ref) -> float:
    """Max |tree - ref|; ``tree`` has the mesh shape in front of ``ref``'s shape."""
    errs = optree.tree_map(
        lambda x, r: (x.double() - r).abs().max().item() if x.numel() else 0.0, tree, ref
    )
    return max(optree.tree_leaves(errs), default=0.0)


MLP_IN, MLP_HIDDEN, MLP_BATCH = 6, 16, 4


def dense_norm(tree) -> float:
    """The global 2-norm of a dense tree, summed in fp64."""
    return math.sqrt(sum(float(x.double().square().sum()) for x in optree.tree_leaves(tree)))


def torch_clip(dense, max_norm: float):
    """``torch.nn.utils.clip_grad_norm_`` on a dense gradient tree: the clipped tree (fp32)
    and the norm torch measured."""
    leaves, treedef = optree.tree_flatten(dense)
    params = [torch.zeros_like(x, dtype=torch.float32, requires_grad=True) for x in leaves]
    for p, g in zip(params, leaves):
        p.grad = g.float().clone()
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return optree.tree_unflatten(treedef, [p.grad for p in params]), norm


class EmaState(NamedTuple):
    """A user's transformation's state: a count and a tree like the params."""

    count: int
    ema: Any


def scale_by_ema(decay: float) -> fh.GradientTransformation:
    """A user's transformation: an exponential moving average of the updates (local shards,
    elementwise, no communication), chained with the library's in the tests."""

    def init(params):
        return EmaState(0, optree.tree_map(torch.zeros_like, params))

    def update(updates, state, params=None):
        ema = optree.tree_map(lambda e, u: decay * e + (1 - decay) * u, state.ema, updates)
        return ema, EmaState(state.count + 1, ema)

    return fh.GradientTransformation(init, update)


def mlp_problem(world: int, microbatches: int):
    """A small MLP, its parameters as a dict, and one fixed learnable global batch.

    ``x[rank, m]`` and ``y[rank, m]`` are rank ``rank``'s microbatch ``m``.
    """
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(MLP_IN, MLP_HIDDEN), torch.nn.Tanh(), torch.nn.Linear(MLP_HIDDEN, 1)
    )
    x = torch.randn(world, microbatches, MLP_BATCH, MLP_IN)
    y = torch.sin(x.sum(-1, keepdim=True))  # a smooth target, revisited every step
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return model, params, x, y


def mlp_loss(model):
    """The MSE loss of ``model`` as a function of a parameter dict, for torch.func."""

    def loss(params, x, y):
        return torch.nn.functional.mse_loss(functional_call(model, params, (x,)), y)

    return loss


def mlp_step(step_grad, full, x, y, spec, each=None):
    """One training step's M microbatches ``x[m]``, ``y[m]`` on this rank: ``reduce_grads``
    of ``grad(loss) / M`` (each scaled gradient is also given to ``each(g, last)``, if given).
    Returns the reduced gradients and the mean microbatch loss."""
    M = len(x)
    acc, loss_sum = None, 0.0
    for m, last in fh.microbatches(M):
        g, loss = step_grad(full, x[m], y[m])
        g = optree.tree_map(lambda t: t / M, g)
        if each is not None:
            each(g, last)
        acc = fh.reduce_grads(g, spec, last=last, acc=acc)
        loss_sum += loss.item() / M
    return acc, loss_sum


def every_call(spec: fh.Spec, seed: int = 0) -> None:
    """Every public function that communicates, once, on ``spec``'s mesh (a SimMesh, or this
    rank's DistMesh): shard, sync_params, gather, reduce_grads over microbatches, MainGrad,
    the per-axis collectives on every axis, and a gathered unit through forward and backward
    (its gradient finished by ``reduce_grads(at="gradient")``)."""
    mesh = spec.mesh
    batch = mesh.batch_shape
    micro = [random_tree(batch, seed=seed + m) for m in range(2)]
    params = fh.shard(random_tree((), seed=seed), spec)
    fh.gather(fh.sync_params(params, spec), spec)
    grads = accumulate(micro, spec)
    fh.gather(optree.tree_map(lambda p, g: p - 0.1 * g, params, grads), spec)
    mg = fh.MainGrad(spec, like=random_tree((), seed=seed))
    for g, last in fh.microbatches(micro):
        mg.accumulate(g, last=last)
    for axis in mesh.axis_names:
        fh.pmean(fh.psum(micro[0], axis, mesh), axis, mesh)
        fh.all_gather(fh.psum_scatter(micro[0], axis, mesh), axis, mesh)
    unit = fh.sync_params(fh.shard({"w": torch.linspace(-1, 1, 12).reshape(4, 3)}, spec), spec)
    block = fh.gathered(fh.per_rank(lambda p, x: torch.tanh(x @ p["w"]), mesh), spec)
    x = torch.randn(*batch, 2, 4, generator=torch.Generator().manual_seed(seed))
    g = torch.func.grad(lambda s: block(s, x).square().sum())(unit)
    fh.gather(fh.reduce_grads(g, spec, last=True, at="gradient"), spec)


# -- in a gloo worker: helpers for the tasks that tests run on conftest.py's ``pool`` ---------


def dist_mesh(**kw) -> fh.DistMesh:
    """A DistMesh over the worker's cached 2x2 (dp_outer, dp_inner) DeviceMesh."""
    from functional_hsdp.mesh.launch import device_mesh

    return fh.DistMesh(device_mesh(GLOO_SHAPE, AXES), **kw)


def dist_preset(strategy: str, **kw) -> fh.Spec:
    """``preset(strategy)`` on :func:`dist_mesh`."""
    return preset(strategy, dist_mesh(), **kw)


@contextlib.contextmanager
def carried_as(carriage: dist_module.Carriage):
    """In a worker: gloo groups carried as another backend would be (a test seam on the
    library's own table, not a mock of torch.distributed)."""
    saved = dict(dist_module.BACKENDS)
    dist_module.BACKENDS["gloo"] = carriage
    try:
        yield
    finally:
        dist_module.BACKENDS.clear()
        dist_module.BACKENDS.update(saved)


NCCL_STYLE = dist_module.BACKENDS["nccl"]  # functional collectives, native AVG


def coords() -> tuple[int, int]:
    """This rank's (dp_outer, dp_inner) coordinates."""
    import torch.distributed as dist

    return divmod(dist.get_rank(), GLOO_SHAPE[1])


def this_rank(tree):
    """This rank's values ``x[o, i]`` of a tree with the mesh shape in front."""
    o, i = coords()
    return optree.tree_map(lambda x: x[o, i], tree)


def check_acc_reuse(
    strategy: str, spec, batch: tuple[int, ...], rank: int = 0
) -> tuple[list[int], list[int]]:
    """``reduce_grads`` given back its own previous result reads the result's buffers rather
    than packing the leaves again; check that this agrees bit for bit with the same values
    passed as fresh tensors, sees in-place edits of the acc leaves, never mutates its
    inputs, and notices leaves put back in other positions (ddp: same local shapes).

    Returns the buckets packed at the gradient role (the acc packed from its leaves) in the
    calls given the acc as returned, and in the calls given fresh copies of it."""
    shapes = {"a": (7, 3), "b": (7, 3), "c": (5,)}
    g1 = random_tree(batch, shapes=shapes, seed=1 + 10 * rank)  # ranks hold different values
    g2 = random_tree(batch, shapes=shapes, seed=2 + 10 * rank)

    def clone(tree):
        return optree.tree_map(torch.clone, tree)

    def same(x, y):
        return all(map(torch.equal, optree.tree_leaves(x), optree.tree_leaves(y)))

    as_returned: list[int] = []
    fresh: list[int] = []
    for last in (False, True):
        acc = fh.reduce_grads(g1, spec, last=False)
        before = clone((g1, g2, acc))
        with packs("gradient") as packed:
            fast = fh.reduce_grads(g2, spec, last=last, acc=acc)
        as_returned += packed
        with packs("gradient") as packed:
            assert same(fast, fh.reduce_grads(g2, spec, last=last, acc=clone(acc)))
        fresh += packed
        assert same((g1, g2, acc), before), "an input was mutated"
        acc["a"].mul_(3)  # the caller edits the running sum in place
        with packs("gradient") as packed:
            fast = fh.reduce_grads(g2, spec, last=last, acc=acc)
        as_returned += packed
        assert same(fast, fh.reduce_grads(g2, spec, last=last, acc=clone(acc)))
        if strategy == "ddp":
            swapped = {"a": acc["b"], "b": acc["a"], "c": acc["c"]}
            fast = fh.reduce_grads(g2, spec, last=last, acc=swapped)
            assert same(fast, fh.reduce_grads(g2, spec, last=last, acc=clone(swapped)))
    return as_returned, fresh


# -- spies on public seams: the mesh's collectives and waits, plan building, packing ----------


@contextlib.contextmanager
def issue_and_wait_order(mesh: fh.Mesh) -> Iterator[list[str]]:
    """Record, in order, every collective issued on ``mesh`` and the first wait for each.

    The mesh's collectives and ``wait`` (its protocol, :class:`functional_hsdp.Mesh`) are
    wrapped on the instance. Collectives are numbered in issue order; the list yielded is
    filled on exit with ``"issue <op> <axis> #k"`` and ``"wait #k"`` entries. A wait made
    inside the collective's own issue (``DistMesh(overlap=False)``) is recorded right after
    its issue; a later wait for the same result (a finished tensor passes through ``wait``)
    is not recorded again.
    """
    events: list[tuple] = []
    results: list = []
    issuing: list[int] = []
    waited: set[int] = set()

    def collective(op: str):
        original = getattr(mesh, op)

        def issue(buf, axis, *rest):
            k = len(results)
            results.append(None)
            events.append(("issue", op, axis, k))
            issuing.append(k)
            try:
                out = original(buf, axis, *rest)
            finally:
                issuing.pop()
            results[k] = out
            return out

        return issue

    original_wait = mesh.wait

    def wait(x):
        if issuing:  # waited by the collective itself: nothing stays in flight
            k = issuing[-1]
        else:
            k = next((k for k, r in enumerate(results) if r is x), None)
        if k is not None and k not in waited:
            waited.add(k)
            events.append(("wait", k))
        return original_wait(x)

    names = ("all_reduce", "reduce_scatter", "all_gather", "wait")
    for op in names[:3]:
        setattr(mesh, op, collective(op))
    mesh.wait = wait
    out: list[str] = []
    try:
        yield out
    finally:
        for name in names:
            delattr(mesh, name)  # the class's own methods again
        out.extend(
            f"issue {e[1]} {e[2]} #{e[3]}" if e[0] == "issue" else f"wait #{e[1]}" for e in events
        )


@contextlib.contextmanager
def plans_built() -> Iterator[list]:
    """Count the plans built inside the block (``Plan`` constructed: the plan cache missed).
    Yields a list that gets each new plan."""
    built: list = []
    original = plan_module.Plan.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        built.append(self)

    plan_module.Plan.__init__ = init
    try:
        yield built
    finally:
        plan_module.Plan.__init__ = original


@contextlib.contextmanager
def packs(at: str) -> Iterator[list[int]]:
    """The buckets packed at role ``at`` inside the block (``Plan.pack`` calls, in order): an
    acc re-packed from its leaves shows as packs at the ``"gradient"`` role."""
    packed: list[int] = []
    original = plan_module.Plan.pack

    def pack(self, b, leaves, role, *args, **kwargs):
        if role == at:
            packed.append(b)
        return original(self, b, leaves, role, *args, **kwargs)

    plan_module.Plan.pack = pack
    try:
        yield packed
    finally:
        plan_module.Plan.pack = original


def _library_functions() -> list[type]:
    """Every ``torch.autograd.Function`` the library defines."""
    import functional_hsdp.units  # noqa: F401 - defines its Functions on import

    found, todo = [], list(torch.autograd.Function.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__module__.startswith("functional_hsdp."):
            found.append(cls)
    return found


@contextlib.contextmanager
def on_device_threads() -> Iterator[list[str]]:
    """Every library ``autograd.Function``'s backward runs as on autograd's CUDA device
    thread: in a fresh ``contextvars.Context()`` (none of the caller's ContextVars) and with
    a fresh thread-local state of the units (``units.registry._FORWARD``), and so do the vmap
    and jvp rules that backward reaches. Yields the names of the backwards run so, for the caller to
    check that some ran."""
    import contextvars

    from functional_hsdp.units import registry

    ran: list[str] = []

    def fresh(cls: type, backward):
        def run(ctx, *grads):
            ran.append(cls.__name__)
            saved, registry._FORWARD = registry._FORWARD, registry._Forward()
            try:
                return contextvars.Context().run(backward, ctx, *grads)
            finally:
                registry._FORWARD = saved

        return staticmethod(run)

    originals = {cls: cls.__dict__["backward"] for cls in _library_functions()}
    try:
        for cls, backward in originals.items():
            cls.backward = fresh(cls, backward.__func__)
        yield ran
    finally:
        for cls, backward in originals.items():
            cls.backward = backward


# -- Muon: torch.optim.Muon on the hidden matrices, torch.optim.AdamW on the rest ---------------

MUON_SHAPES = {
    "w1": (16, 24),
    "w2": (24, 24),
    "w3": (40, 24),
    "embed": (32, 16),
    "b1": (24,),
    "norm": (24,),
}


def hidden(path, leaf=None) -> str:
    """The usual recipe's label: Muon for the hidden matrices (``w*``), AdamW for the rest."""
    return "muon" if str(path[0]).startswith("w") else "adamw"


def torch_muon_adamw(full: dict, muon_kw: dict, adamw_kw: dict):
    """(dense params requiring grad, step()): torch.optim.Muon on the hidden matrices and
    torch.optim.AdamW on the rest (``hidden``'s labels)."""
    dense = {k: v.detach().clone().requires_grad_() for k, v in full.items()}
    muon = torch.optim.Muon([p for k, p in dense.items() if hidden((k,)) == "muon"], **muon_kw)
    adamw = torch.optim.AdamW([p for k, p in dense.items() if hidden((k,)) == "adamw"], **adamw_kw)

    def step():
        muon.step()
        adamw.step()

    return dense, step


def fh_muon_adamw(spec, muon_kw: dict, adamw_kw: dict):
    """fh.partition of fh.muon (hidden matrices) and fh.adamw (the rest)."""
    return fh.partition({"muon": fh.muon(spec, **muon_kw), "adamw": fh.adamw(**adamw_kw)}, hidden)

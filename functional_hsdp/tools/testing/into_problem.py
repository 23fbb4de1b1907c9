"""Calls alternating ``into=`` / ``recompute=`` / ``reshard_after_forward=`` on one model.

Shared by the SimMesh tests (tests/units/test_into.py), the gloo tests
(tests/units/test_into_gloo.py) and ``tests/units/hostile.py``. One small language model (an
embedding, ``L`` tanh layers, a head tied to the embedding or not), run two ways: as ``fh.gathered``
blocks (:func:`blocks_model`) or as an ``nn.Module`` through ``fh.shard_module``
(:func:`module_model`). A :func:`step` goes into a ``MainGrad``, a :func:`probe` is one gradient
without ``into=``; :func:`run` compares every sequence (``SEQUENCES``) with the same step, or the
same probe, made clean: on fresh shards of the same weights, a fresh ``MainGrad``, nothing run
before.
"""

from __future__ import annotations

from collections.abc import Callable

import optree
import torch
import torch.nn.functional as F

import functional_hsdp as fh

V, D, L, M, B, T = 11, 8, 3, 2, 3, 5  # vocab, width, layers, microbatches, batch, sequence
SEED = 0


def init(tied: bool) -> dict:
    """Full weights: ``{"embed": {"w"}, "layers": [{"w", "b"}] * L, "head": {"w"}}`` (no head
    when tied: the embedding is the head)."""
    gen = torch.Generator().manual_seed(SEED)
    w = lambda *s: torch.randn(*s, generator=gen) * 0.5  # noqa: E731
    full = {"embed": {"w": w(V, D)}, "layers": [{"w": w(D, D), "b": w(D)} for _ in range(L)]}
    if not tied:
        full["head"] = {"w": w(V, D)}
    return full


def _embed(p: dict, ids: torch.Tensor) -> torch.Tensor:
    return p["w"][ids]


#: how many times a layer's forward ran (recompute=True runs it again in backward)
LAYER_RUNS = [0]


def _layer(p: dict, h: torch.Tensor) -> torch.Tensor:
    LAYER_RUNS[0] += 1
    return torch.tanh(h @ p["w"].T + p["b"])


def _head(p: dict, h: torch.Tensor) -> torch.Tensor:
    return h @ p["w"].T


def _ce(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2), ids.roll(1, -1).flatten()) / M


def _dense(p: dict, ids: torch.Tensor) -> torch.Tensor:
    h = _embed(p["embed"], ids)
    for layer in p["layers"]:
        h = _layer(layer, h)
    return _ce(_head(p.get("head", p["embed"]), h), ids)


def batches(rank: int, step: int = 0) -> list[torch.Tensor]:
    """Rank ``rank``'s ``M`` microbatches of token ids."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    return [torch.randint(V, (B, T), generator=gen) for _ in range(M)]


def mesh_batches(mesh, step: int = 0) -> list[torch.Tensor]:
    """This process's microbatches: every rank's, stacked (SimMesh), or its own (DistMesh)."""
    if not mesh.batch_shape:
        import torch.distributed as dist

        return batches(dist.get_rank(), step)
    n = 1
    for s in mesh.batch_shape:
        n *= s
    per_rank = [batches(r, step) for r in range(n)]
    return [
        torch.stack([per_rank[r][m] for r in range(n)]).unflatten(0, mesh.batch_shape)
        for m in range(M)
    ]


def tree_spec(spec: fh.Spec, tied: bool, whole: bool = False):
    if whole:
        return spec
    out = {"embed": spec, "layers": [spec] * L}
    if not tied:
        out["head"] = spec
    return out


def block_loss(
    spec: fh.Spec,
    tied: bool,
    *,
    into: fh.MainGrad | None = None,
    recompute: bool = False,
    reshard: bool = True,
    whole: bool = False,
) -> Callable:
    """``loss(shards, ids)`` through ``fh.gathered`` blocks made for these options (as a user
    makes one set of blocks per target): the mean over microbatches is the sum of ``loss``."""
    mesh = spec.mesh
    kw = {"into": into, "recompute": recompute}
    ce = fh.per_rank(_ce, mesh)
    if whole:
        model = fh.gathered(fh.per_rank(_dense, mesh), spec, reshard_after_forward=reshard, **kw)
        return lambda shards, ids: model(shards, ids).sum()
    emb = fh.gathered(fh.per_rank(_embed, mesh), spec, reshard_after_forward=False, **kw)
    layer = fh.gathered(fh.per_rank(_layer, mesh), spec, reshard_after_forward=reshard, **kw)
    head = fh.gathered(fh.per_rank(_head, mesh), spec, reshard_after_forward=reshard, **kw)

    def loss(shards: dict, ids: torch.Tensor) -> torch.Tensor:
        h = emb(shards["embed"], ids)
        h = fh.sequence(layer, shards["layers"], h)
        return ce(head(shards.get("head", shards["embed"]), h), ids).sum()

    return loss


GRADS = {"fh.grad": fh.grad, "torch.func.grad": torch.func.grad}


def step(loss: Callable, shards, mg: fh.MainGrad, *, mesh, grad: str = "fh.grad") -> list:
    """One step into ``mg`` (``loss`` adds into it), finished: its gradients, copied.

    That is ``for ids, last in fh.microbatches(batches, into=mg): grad(loss)(shards, ids)``
    then ``mg.finish()``."""
    for ids, _ in fh.microbatches(mesh_batches(mesh), into=mg):
        GRADS[grad](loss)(shards, ids)
    mg.finish()
    return [g.clone() for g in optree.tree_leaves(mg.grads)]


def probe(loss: Callable, shards, *, mesh, grad: str = "fh.grad") -> list:
    """One gradient without ``into=`` (the first microbatch; a gradient norm, a validation
    gradient): returned at the gradient placement."""
    g = GRADS[grad](loss)(shards, mesh_batches(mesh)[0])
    return [x.clone() for x in optree.tree_leaves(g)]


def error(got: list, want: list) -> float:
    """max |got - want| / max |want| over leaves (a leaf of this rank's may be empty: a Flat
    shard; it must be empty in both)."""
    assert len(got) == len(want)
    worst = 0.0
    for a, b in zip(got, want):
        if a.shape != b.shape:
            return float("inf")
        if b.numel():
            worst = max(worst, ((a - b).abs().max() / b.abs().max()).item())
    return worst


# -- the model as an nn.Module (DistMesh only: fh.shard_module) --------------------------------


class _Layer(torch.nn.Module):
    def __init__(self, p: dict):
        super().__init__()
        self.w = torch.nn.Parameter(p["w"].clone())
        self.b = torch.nn.Parameter(p["b"].clone())

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return _layer({"w": self.w, "b": self.b}, h)


class Net(torch.nn.Module):
    """:func:`init`'s weights as a module: an ``nn.Embedding``, ``L`` layers, an
    ``nn.Linear`` head (its weight the embedding's when ``tied``)."""

    def __init__(self, tied: bool):
        super().__init__()
        full = init(tied)
        self.embed = torch.nn.Embedding(V, D)
        self.embed.weight = torch.nn.Parameter(full["embed"]["w"].clone())
        self.layers = torch.nn.ModuleList([_Layer(p) for p in full["layers"]])
        self.head = torch.nn.Linear(D, V, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        else:
            self.head.weight = torch.nn.Parameter(full["head"]["w"].clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


# -- one model, called with these options or others --------------------------------------------


class Model:
    """Fresh shards of :func:`init`'s weights, and ``loss(into, recompute, reshard)``: the
    loss of a call with those options."""

    def __init__(self, shards, tree_spec, loss: Callable):
        self.shards, self.tree_spec, self.loss = shards, tree_spec, loss

    def maingrad(self) -> fh.MainGrad:
        return fh.MainGrad(self.tree_spec, like=self.shards)


def blocks_model(spec: fh.Spec, tied: bool, whole: bool = False) -> Model:
    """``fh.gathered`` blocks, one set per target and options (as a user makes them).

    The units inside the loss (:func:`block_loss`), the layers run by ``fh.sequence`` (each
    next unit prefetched), the embedding a unit kept from forward to backward (a root, as
    FSDP2 keeps its own), on a SimMesh or a DistMesh; or the whole model one unit
    (``whole=True``)."""
    ts = tree_spec(spec, tied, whole)
    shards = fh.shard(init(tied), ts)
    made: dict = {}

    def loss(into=None, recompute=False, reshard=True):
        key = (id(into), recompute, reshard)
        if key not in made:  # the MainGrad rides along: its id stays its own
            fn = block_loss(
                spec, tied, into=into, recompute=recompute, reshard=reshard, whole=whole
            )
            made[key] = (into, fn)
        return made[key][1]

    return Model(shards, ts, loss)


def module_model(spec: fh.Spec, tied: bool, root: bool = True) -> Model:
    """:class:`Net` through ``fh.shard_module`` / ``fh.functional_call``: the layers are the
    units, the embedding and the head the root (``root=False``, untied: each its own unit).
    DistMesh only."""
    net = Net(tied)
    units = list(net.layers) if root else [net.embed, *net.layers, net.head]
    shards, ts = fh.shard_module(net, spec, units=units)

    def loss(into=None, recompute=False, reshard=True):
        def f(s: dict, ids: torch.Tensor) -> torch.Tensor:
            logits = fh.functional_call(
                net, s, (ids,), into=into, recompute=recompute, reshard_after_forward=reshard
            )
            return _ce(logits, ids)

        return f

    return Model(shards, ts, loss)


def traced_step(model: Model, mg: fh.MainGrad, *, mesh, grad: str, **opts) -> tuple[list, tuple]:
    """:func:`step` with these options, and what it did: its collectives (op, axis, numel)
    and how many times a layer's forward ran."""
    LAYER_RUNS[0] = 0
    with fh.comm_log() as log:
        g = step(model.loss(mg, **opts), model.shards, mg, mesh=mesh, grad=grad)
    return g, ([(e.op, e.axis, e.numel) for e in log.events], LAYER_RUNS[0])


# -- the sequences -----------------------------------------------------------------------------

SEQUENCES = (
    "probe_before_first_step",
    "probe_between_steps",
    "new_maingrad",
    "two_maingrads_interleaved",
    "eval_between_steps",
    "options_alternate",
)


class _Checks:
    """One sequence's run: clean references made on fresh models, and the checks so far
    (``{check: relative error}``)."""

    def __init__(self, make: Callable[[], Model], mesh, *, grad: str, recompute: bool):
        # nothing runs here (a constructor that trains would be reachable, for the static
        # checks of tests/units/test_device_threads.py, from every super().__init__)
        self.make, self.mesh, self.grad = make, mesh, grad
        self.opts = {"recompute": recompute, "reshard": True}
        self.out: dict[str, float] = {}
        self.ref: tuple[list, tuple] | None = None

    def begin(self) -> _Checks:
        """Make the clean reference of the run's options, first: nothing run before it."""
        self.ref = self.clean(**self.opts)
        return self

    def traced(self, model: Model, mg: fh.MainGrad, **opts) -> tuple[list, tuple]:
        return traced_step(model, mg, mesh=self.mesh, grad=self.grad, **opts)

    def probe(self, model: Model, **opts) -> list:
        return probe(model.loss(None, **opts), model.shards, mesh=self.mesh, grad=self.grad)

    def clean(self, **opts) -> tuple[list, tuple]:
        model = self.make()
        return self.traced(model, model.maingrad(), **opts)

    def step(self, name: str, model: Model, mg: fh.MainGrad, **opts) -> None:
        """A step into ``mg`` against the same step made clean (:attr:`ref` for the run's
        options, else made after it): its gradients, and its collectives and layer runs."""
        got = self.traced(model, mg, **opts)
        want = self.ref if opts == self.opts else self.clean(**opts)
        self.out[name] = error(got[0], want[0])
        self.out[name + ": collectives and layer runs"] = float(got[1] != want[1])

    def probe_alone(self, name: str, model: Model, mg: fh.MainGrad, **opts) -> None:
        """A probe against the same probe made clean; it leaves ``mg`` empty."""
        self.out[name] = error(self.probe(model, **opts), self.probe(self.make(), **opts))
        self.out[name + " left the MainGrad empty"] = float(mg.grads is not None)


def _probe_before_first_step(c: _Checks, m: Model, mg: fh.MainGrad) -> None:
    c.probe_alone("probe", m, mg, **c.opts)
    c.step("step", m, mg, **c.opts)


def _probe_between_steps(c: _Checks, m: Model, mg: fh.MainGrad) -> None:
    c.traced(m, mg, **c.opts)
    mg.zero_grad()
    c.probe_alone("probe", m, mg, **c.opts)
    c.step("second step", m, mg, **c.opts)


def _new_maingrad(c: _Checks, m: Model, mg: fh.MainGrad) -> None:
    c.traced(m, mg, **c.opts)
    c.step("step into the new MainGrad", m, m.maingrad(), **c.opts)
    c.out["the first MainGrad kept its step"] = error(optree.tree_leaves(mg.grads), c.ref[0])


def _two_maingrads_interleaved(c: _Checks, m: Model, mg: fh.MainGrad) -> None:
    """Two losses, two MainGrads, one step."""
    mg1 = m.maingrad()
    for ids, last in fh.microbatches(mesh_batches(c.mesh)):
        for target in (mg, mg1):
            target.begin_microbatch(last=last)
            GRADS[c.grad](m.loss(target, **c.opts))(m.shards, ids)
    for target in (mg, mg1):
        target.finish()
    c.out["first MainGrad"] = error(optree.tree_leaves(mg.grads), c.ref[0])
    c.out["second MainGrad"] = error(optree.tree_leaves(mg1.grads), c.ref[0])


def _eval_between_steps(c: _Checks, m: Model, mg: fh.MainGrad) -> None:
    c.traced(m, mg, **c.opts)
    mg.zero_grad()
    with torch.no_grad():
        m.loss(None, **c.opts)(m.shards, mesh_batches(c.mesh)[0])
    c.step("second step", m, mg, **c.opts)


def _options_alternate(c: _Checks, m: Model, mg: fh.MainGrad) -> None:
    """Steps whose options change every call, each followed by a probe with the others."""
    recompute = c.opts["recompute"]
    for k, o in enumerate(
        [
            {"recompute": not recompute, "reshard": True},
            {"recompute": recompute, "reshard": False},
            {"recompute": not recompute, "reshard": False},
            c.opts,
        ]
    ):
        c.step(f"step {k} {o}", m, mg, **o)
        mg.zero_grad()
        p = {"recompute": not o["recompute"], "reshard": not o["reshard"]}
        c.out[f"probe {k} {p}"] = error(c.probe(m, **p), c.probe(c.make(), **p))


_RUN = {
    "probe_before_first_step": _probe_before_first_step,
    "probe_between_steps": _probe_between_steps,
    "new_maingrad": _new_maingrad,
    "two_maingrads_interleaved": _two_maingrads_interleaved,
    "eval_between_steps": _eval_between_steps,
    "options_alternate": _options_alternate,
}


def run(sequence: str, make: Callable[[], Model], mesh, *, grad: str, recompute: bool) -> dict:
    """Run ``sequence`` on a model ``make()`` makes; ``{check: relative error}`` against the
    clean step or probe (0.0 is exact; a check that is a yes/no is 0.0 or 1.0)."""
    if sequence not in _RUN:
        raise ValueError(f"unknown sequence {sequence!r}")
    checks = _Checks(make, mesh, grad=grad, recompute=recompute).begin()
    model = make()
    _RUN[sequence](checks, model, model.maingrad())
    return checks.out

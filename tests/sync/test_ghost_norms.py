"""Ghost norms (``fh.ghost_grad_norms``): each example's gradient norm from one first-order
backward, without per-example gradients, through gathered units on a SimMesh.

Every formula is checked against the per-example gradients ``torch.func.vmap(grad(...))``
makes of the same dense function on every rank's examples, and the route each parameter's
norms took is checked too (so a formula that silently fell back, or a fallback that silently
took a formula, fails). Through ``fh.functional_call`` on gloo ranks:
``tests/sync/test_ghost_norms_gloo.py``.
"""

from __future__ import annotations

import optree
import pytest
import torch
import torch.nn.functional as F
from reference import STRATEGIES, on_device_threads, preset
from transform_problem import Problem, dense_loss

import functional_hsdp as fh
from functional_hsdp.sync import ghost

MESH = {"dp_outer": 2, "dp_inner": 2}
B, T, D, V = 4, 5, 6, 9


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _units(kinds: list[str], seed: int = 0) -> tuple[list[dict], list]:
    """The full weights and per-rank functions of one unit per kind."""
    gen = _gen(seed)
    rand = lambda *s: torch.randn(*s, generator=gen) / 2  # noqa: E731
    made = {
        "linear": ({"w": rand(D, D), "b": rand(D)}, lambda p, h: F.linear(h, p["w"], p["b"])),
        "tanh_linear": ({"w": rand(D, D)}, lambda p, h: torch.tanh(F.linear(h, p["w"]))),
        "keywords": (  # F.linear's tensors by keyword (flattened in another order), non-square
            {"w": rand(D, 2 * D), "b": rand(D)},
            lambda p, h: F.linear(torch.cat([h, h.sin()], -1), weight=p["w"], bias=p["b"]),
        ),
        "type_as": (  # an op that returns its input as it is (the dtypes already match)
            {"w": rand(D, D)},
            lambda p, h: torch.tanh(F.linear(h.type_as(p["w"]), p["w"])),
        ),
        "matmul": ({"w": rand(D, D), "b": rand(D)}, lambda p, h: torch.tanh(h @ p["w"] + p["b"])),
        "embedding": ({"e": rand(V, D)}, lambda p, ids: F.embedding(ids, p["e"], padding_idx=0)),
        "layer_norm": (
            {"w": 1 + rand(D), "b": rand(D)},
            lambda p, h: F.layer_norm(h, (D,), p["w"], p["b"]),
        ),
        "rms_norm": ({"w": 1 + rand(D)}, lambda p, h: F.rms_norm(h, (D,), p["w"], 1e-6)),
        "llama_rms_norm": ({"w": 1 + rand(D)}, _llama_rms_norm),
        "scale_shift": ({"s": rand(D), "c": rand(D)}, lambda p, h: p["s"] * h + p["c"]),
        "conv": (  # F.conv1d: no formula, the per-example fallback (channels: the last dim)
            {"w": rand(D, D, 3), "b": rand(D)},
            lambda p, h: F.conv1d(h.mT, p["w"], p["b"], padding=1).mT,
        ),
        "atan2": ({"c": rand(D)}, lambda p, h: torch.atan2(h, p["c"])),  # fallback, elementwise
        "function": ({"c": rand(D)}, lambda p, h: _Softplus.apply(h, p["c"])),  # a user's
    }
    return [made[k][0] for k in kinds], [made[k][1] for k in kinds]


class _Softplus(torch.autograd.Function):
    """A user's ``autograd.Function`` of an activation and a parameter: the fallback."""

    generate_vmap_rule = True

    @staticmethod
    def forward(h, c):
        return F.softplus(h * c)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        h, c = ctx.saved_tensors
        s = torch.sigmoid(h * c) * g
        return s * c, (s * h).sum_to_size(c.shape)


def _llama_rms_norm(p: dict, h: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``LlamaRMSNorm`` on the unit's weight: ``self.weight * hidden.to(dtype)``."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(D, eps=1e-6).to("meta")
    return torch.func.functional_call(norm, {"weight": p["w"]}, (h,))


class Stack:
    """Units of the given kinds, one after the other, on a 2x2 SimMesh: each rank's
    per-example loss is the sum of squares of its output."""

    def __init__(self, kinds: list[str], strategy: str = "hsdp", seed: int = 0):
        self.mesh = fh.SimMesh(MESH)
        self.spec = preset(strategy, self.mesh)
        self.full, self.fns = _units(kinds, seed)
        self.tree_spec = [self.spec] * len(kinds)
        self.params = fh.sync_params(fh.shard(self.full, self.tree_spec), self.tree_spec)
        self.blocks = [fh.gathered(fh.per_rank(fn, self.mesh), self.spec) for fn in self.fns]

    def losses(self, shards: list, x: torch.Tensor) -> torch.Tensor:
        """(*mesh, B): each rank's examples' losses."""
        h = x
        for block, unit in zip(self.blocks, shards):
            h = block(unit, h)
        return h.square().flatten(3).sum(-1)

    def dense(self, full: list, x: torch.Tensor) -> torch.Tensor:
        h = x
        for fn, unit in zip(self.fns, full):
            h = fn(unit, h)
        return h.square().sum()

    def want(self, x: torch.Tensor) -> torch.Tensor:
        """(*mesh, B): every example's gradient norm, from dense per-example gradients."""
        one = lambda full, xb: self.dense(full, xb[None])  # noqa: E731
        per = torch.func.vmap(torch.func.grad(one), in_dims=(None, 0))
        rows = x.reshape(-1, *x.shape[2:])
        norms = [_norm_of(per(self.full, r)) for r in rows]
        return torch.stack(norms).reshape(x.shape[:3])


def _norm_of(g) -> torch.Tensor:
    """Per-example norms of a tree of per-example gradients (B, ...)."""
    return sum(t.flatten(1).double().square().sum(1) for t in optree.tree_leaves(g)).sqrt()


def _data(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*MESH.values(), *shape, generator=_gen(seed))


def _ids(seed: int = 2) -> torch.Tensor:
    ids = torch.randint(1, V, (*MESH.values(), B, T), generator=_gen(seed))
    ids[..., 0, 1] = ids[..., 0, 3]  # a token twice in an example
    ids[..., 1, 2] = 0  # the padding row: no gradient
    return ids


def _run(stack: Stack, x: torch.Tensor, sequence: str = "auto"):
    norms, done = ghost.run_pass(
        stack.losses, stack.params, args=(x,), kwargs={}, sequence=sequence
    )
    return norms, {k: v for k, v in done.routes.items()}


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5) -> bool:
    return torch.allclose(got.double(), want.double(), rtol=rtol, atol=0)


# -- the formulas, one kind of layer at a time ---------------------------------------------------

CASES = {
    # kinds, data, the routes of the first unit's parameters
    "linear on [B, d]": (
        ["linear", "tanh_linear"],
        (B, D),
        {"w": "linear:outer", "b": "linear:bias"},
    ),
    "x @ W + b": (["tanh_linear", "matmul"], (B, D), None),
    "F.linear by keyword": (["tanh_linear", "keywords"], (B, T, D), None),
    "an input returned as it is": (["tanh_linear", "type_as"], (B, T, D), None),
    "embedding, repeated ids and padding": (
        ["embedding", "tanh_linear"],
        "ids",
        {"e": "embedding"},
    ),
    "layer norm": (["tanh_linear", "layer_norm"], (B, T, D), None),
    "rms norm": (["tanh_linear", "rms_norm"], (B, T, D), None),
    "LlamaRMSNorm": (["tanh_linear", "llama_rms_norm"], (B, T, D), None),
    "scale and shift": (["tanh_linear", "scale_shift"], (B, T, D), None),
    "conv1d: fallback": (["tanh_linear", "conv"], (B, T, D), None),
    "atan2: fallback": (["tanh_linear", "atan2"], (B, T, D), None),
    "a user's autograd.Function: fallback": (["tanh_linear", "function"], (B, T, D), None),
}
SECOND = {  # the routes of the second unit's parameters
    "x @ W + b": {"w": "matmul:outer", "b": "add"},
    "F.linear by keyword": {"w": "linear:materialize", "b": "linear:bias"},
    "an input returned as it is": {"w": "summed"},
    "layer norm": {"w": "layer_norm:weight", "b": "layer_norm:bias"},
    "rms norm": {"w": "rms_norm:weight"},
    "LlamaRMSNorm": {"w": "mul"},
    "scale and shift": {"s": "mul", "c": "add"},
    "conv1d: fallback": {"w": "fallback", "b": "fallback"},
    "atan2: fallback": {"c": "fallback"},
    "a user's autograd.Function: fallback": {"c": "fallback"},
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_formula_equals_the_norm_of_vmap_grad(case):
    kinds, shape, first = CASES[case]
    if "LlamaRMSNorm" in case:
        pytest.importorskip("transformers")
    stack = Stack(kinds)
    x = _ids() if shape == "ids" else _data(*shape)
    got, routes = _run(stack, x)
    assert got.shape == (*MESH.values(), B)
    assert _close(got, stack.want(x))
    unit = 0 if first is not None else 1
    expect = first if first is not None else SECOND[case]
    for name, route in expect.items():
        assert routes[f"tree[{unit}][{name!r}]"] == {route}, routes
    # the other unit: a linear one on a sequence or not
    other = routes[f"tree[{1 - unit}]['w']"]
    assert len(other) == 1 and next(iter(other)).split(":")[0] in ("linear", "matmul")


@pytest.mark.parametrize("sequence", ["gram", "materialize"])
def test_both_sequence_forms_equal_vmap_grad(sequence):
    stack = Stack(["linear", "tanh_linear"])
    x = _data(B, T, D)
    got, routes = _run(stack, x, sequence=sequence)
    assert routes["tree[0]['w']"] == {f"linear:{sequence}"}
    assert routes["tree[1]['w']"] == {f"linear:{sequence}"}
    assert _close(got, stack.want(x))


def test_auto_picks_the_sequence_form_by_the_count():
    """Gram when T (d_in + d_out) <= d_in d_out: T = 5 with d = 6 is Gram (60 <= 36 is not:
    materialized); T = 2 is Gram (24 <= 36)."""
    stack = Stack(["linear", "tanh_linear"])
    _, long = _run(stack, _data(B, 5, D))
    _, short = _run(stack, _data(B, 2, D))
    assert long["tree[0]['w']"] == {"linear:materialize"}
    assert short["tree[0]['w']"] == {"linear:gram"}


def test_a_model_mixing_supported_and_unsupported_layers_equals_the_vmap_path():
    """Formulas and the fallback in one model; the norms equal ``fh.per_example_grad_norms``'
    (the vmap path) and the dense per-example gradients'."""
    stack = Stack(["linear", "layer_norm", "conv", "matmul", "atan2", "rms_norm"])
    x = _data(B, T, D)
    got, routes = _run(stack, x)
    assert routes["tree[2]['w']"] == {"fallback"} and routes["tree[0]['w']"] != {"fallback"}

    def one(s, example):  # one example on each rank: (*mesh, 1, T, D)
        return stack.losses(s, example[:, :, None]).sum()

    vmap_norms = fh.per_example_grad_norms(one, stack.params, x.movedim(2, 0))
    assert _close(got, vmap_norms.movedim(0, -1))
    assert _close(got, stack.want(x))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_reduces_nothing_and_gathers_each_unit(strategy):
    stack = Stack(["linear", "tanh_linear"], strategy=strategy)
    x = _data(B, D)
    with fh.comm_log() as log:
        got, _ = _run(stack, x)
    ops = {e.op for e in log.events}
    assert "reduce_scatter" not in ops and "all_reduce" not in ops
    assert _close(got, stack.want(x))


def test_a_unit_called_twice_and_a_parameter_used_twice_sum_their_gradients():
    """Each use's per-example gradient is materialized and summed before the norm (the
    cross terms): a block called twice on the same shards, a weight used in two ops."""
    gen = _gen(4)
    full = [{"w": torch.randn(D, D, generator=gen) / 2, "s": torch.randn(D, generator=gen)}]
    mesh = fh.SimMesh(MESH)
    spec = preset("hsdp", mesh)
    params = fh.sync_params(fh.shard(full, [spec]), [spec])

    def layer(p, h):
        return torch.tanh(F.linear(h, p["w"]) * p["s"]) + F.linear(h, p["w"])

    block = fh.gathered(fh.per_rank(layer, mesh), spec)
    losses = lambda s, x: block(s[0], block(s[0], x)).square().sum(-1)  # noqa: E731
    x = _data(B, D)
    norms, done = ghost.run_pass(losses, params, args=(x,), kwargs={}, sequence="auto")
    assert done.routes["tree[0]['w']"] == {"summed"}

    def dense(w, xb):
        return layer(w[0], layer(w[0], xb[None])).square().sum()

    per = torch.func.vmap(torch.func.grad(dense), in_dims=(None, 0))
    want = torch.stack([_norm_of(per(full, r)) for r in x.reshape(-1, B, D)]).reshape(2, 2, B)
    assert _close(norms, want)


def test_a_parameter_through_views_is_followed():
    """``h @ w.T``, ``F.linear(h, w.t().contiguous().t())``: views of the parameter, with its
    norm; used twice (as ``w`` and ``w.T``), each use's gradient is taken back to ``w``'s
    shape before the sum (else the transposed one would be added as it is)."""
    mesh = fh.SimMesh(MESH)
    spec = preset("hsdp", mesh)
    full = [{"w": torch.randn(D, D, generator=_gen(6)) / 2}]
    params = fh.sync_params(fh.shard(full, [spec]), [spec])
    layers = {
        "T": lambda p, h: torch.tanh(h @ p["w"].T),
        "chain": lambda p, h: torch.tanh(F.linear(h, p["w"].t().contiguous().t())),
        "twice": lambda p, h: torch.tanh(h @ p["w"].T) + torch.sin(h @ p["w"]),
    }
    x = _data(B, T, D)
    for name, layer in layers.items():
        block = fh.gathered(fh.per_rank(layer, mesh), spec)
        losses = lambda s, x, block=block: block(s[0], x).square().flatten(3).sum(-1)  # noqa: E731
        norms, done = ghost.run_pass(losses, params, args=(x,), kwargs={}, sequence="auto")
        dense = lambda w, xb, layer=layer: layer(w[0], xb[None]).square().sum()  # noqa: E731
        per = torch.func.vmap(torch.func.grad(dense), in_dims=(None, 0))
        want = torch.stack([_norm_of(per(full, r)) for r in x.reshape(-1, B, T, D)])
        assert _close(norms, want.reshape(2, 2, B)), name
        assert ("summed" in done.routes["tree[0]['w']"]) == (name == "twice")


def test_weights_a_unit_returns_are_counted_where_the_caller_uses_them():
    """An identity unit (``fh.functional_call``'s root is one): its weights are used outside
    it, by the caller, and inside another unit as an argument (a tied weight)."""
    mesh = fh.SimMesh(MESH)
    spec = preset("hsdp", mesh)
    gen = _gen(8)
    full = [
        {"w": torch.randn(D, D, generator=gen) / 2},
        {"v": torch.randn(D, D, generator=gen) / 2},
    ]
    params = fh.sync_params(fh.shard(full, [spec] * 2), [spec] * 2)
    root = fh.gathered(lambda p: p, spec, reshard_after_forward=False, recompute=True)
    inner = fh.per_rank(lambda p, w, h: torch.tanh(h @ p["v"]) @ w, mesh)
    block = fh.gathered(inner, spec)
    outer = fh.per_rank(lambda w, h: torch.tanh(F.linear(h, w)), mesh)

    def losses(s, x):
        w = root(s[0])["w"]
        return block(s[1], w, outer(w, x)).square().sum(-1)

    x = _data(B, D)
    norms, done = ghost.run_pass(losses, params, args=(x,), kwargs={}, sequence="auto")
    assert done.routes["tree[0]['w']"] == {"summed"}  # outside and inside the other unit

    def dense(f, xb):
        h = torch.tanh(F.linear(xb[None], f[0]["w"]))
        return (torch.tanh(h @ f[1]["v"]) @ f[0]["w"]).square().sum()

    per = torch.func.vmap(torch.func.grad(dense), in_dims=(None, 0))
    want = torch.stack([_norm_of(per(full, r)) for r in x.reshape(-1, B, D)]).reshape(2, 2, B)
    assert _close(norms, want)


def test_bf16_weights_and_activations():
    """FSDP2's mixed precision (bf16 gathers and compute): the norms are taken in float32 of
    the bf16 activations and output gradients, close to the fp32 ones as bf16 allows, and to
    the vmap path's under the same policy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    stack = Stack(["linear", "layer_norm", "matmul"])
    mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    stack.blocks = [
        fh.gathered(fh.per_rank(fn, stack.mesh), stack.spec, mp_policy=mp) for fn in stack.fns
    ]
    x = _data(B, T, D)
    got, _ = _run(stack, x)
    assert got.dtype == torch.float32
    assert _close(got, stack.want(x), rtol=2e-2)

    def one(s, example):
        return stack.losses(s, example[:, :, None]).float().sum()

    vmap_norms = fh.per_example_grad_norms(one, stack.params, x.movedim(2, 0)).movedim(0, -1)
    assert _close(got, vmap_norms, rtol=2e-2)


@pytest.mark.parametrize("kinds", [["linear", "matmul"], ["tanh_linear", "scale_shift"]])
def test_autocast_entered_inside_the_losses(kinds):
    """An autocast region inside ``losses_fn`` (the backward outside it): the backward
    recomputes the inputs' gradients in the forward's autocast state, and the norms are the
    float32 pass's to bfloat16's precision."""
    stack = Stack(kinds)
    x = _data(B, T, D)

    def losses(shards, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return stack.losses(shards, x).float()

    got = fh.ghost_grad_norms(losses, stack.params, x)
    want = fh.ghost_grad_norms(stack.losses, stack.params, x)
    assert _close(got, want, rtol=5e-2) and not torch.equal(got, want)


def test_recompute_counts_each_use_once():
    stack = Stack(["linear", "tanh_linear"])
    stack.blocks = [
        fh.gathered(fh.per_rank(fn, stack.mesh), stack.spec, recompute=True) for fn in stack.fns
    ]
    x = _data(B, T, D)
    got, routes = _run(stack, x)
    assert "summed" not in set().union(*routes.values())
    assert _close(got, stack.want(x))


def test_backward_on_a_device_thread():
    """The backward adds into the pass its forward took (no ContextVar read there)."""
    stack = Stack(["embedding", "tanh_linear", "layer_norm"])
    x = _ids()
    want, _ = _run(stack, x)
    with on_device_threads() as ran:
        got, _ = _run(stack, x)
    assert {"_GhostOp", "_Unit"} <= set(ran)
    assert torch.equal(got, want)


# -- DP-SGD: the clipped step ---------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_clipped_step_equals_the_vmap_paths_and_the_dense_one(strategy):
    """Ghost norms, then the first-order gradient of the clip-weighted losses (the existing
    second pass): the step equals the one made with the vmap path's norms (1e-6) and the
    mean over ranks of each rank's sum of clipped dense per-example gradients."""
    pb = Problem(preset(strategy, fh.SimMesh(MESH)))
    x = _data(B, pb.full[0]["w"].shape[0], seed=9)  # (*mesh, B, D)

    def losses(s, x):
        return pb.out(s, x).square().sum(-1)

    norms = fh.ghost_grad_norms(losses, pb.params, x)
    vmap_norms = fh.per_example_grad_norms(pb.loss, pb.params, x.movedim(2, 0)[..., None, :])
    assert _close(norms, vmap_norms.movedim(0, -1))
    clip = 0.5 * norms.median()

    def step(n):
        scale = (clip / n).clamp(max=1.0)
        g = torch.func.grad(lambda s: (losses(s, x) * scale).sum())(pb.params)
        return pb.finish(g)

    got, with_vmap = step(norms), step(vmap_norms.movedim(0, -1))
    assert _max_rel(got, with_vmap) <= 1e-6
    per = torch.func.vmap(torch.func.grad(dense_loss), in_dims=(None, 0))
    rows = x.reshape(-1, B, x.shape[-1])
    clipped = []
    for r in rows:
        g = per(pb.full, r[:, None])
        c = (clip / _norm_of(g).float()).clamp(max=1.0)
        clipped.append(
            optree.tree_map(lambda t, c=c: (t * c.view(-1, 1, *[1] * (t.dim() - 2))).sum(0), g)
        )
    want = optree.tree_map(lambda *t: sum(t) / len(rows), *clipped)
    assert _max_rel(optree.tree_map(lambda t: t[0, 0], got), want) <= 1e-5


def _max_rel(a, b) -> float:
    return max(
        ((x - y).abs().max() / y.abs().max()).item()
        for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b))
    )


def test_blocks_into_a_maingrad_add_nothing_in_the_pass():
    """A norms pass through blocks made with ``into=mg`` adds nothing and leaves no gradient
    due: the step after it equals the step without it."""

    def run(norms_first: bool):
        pb = Problem(preset("hsdp", fh.SimMesh(MESH)))
        mg = fh.MainGrad(pb.tree_spec, like=pb.full)
        block = fh.gathered(
            fh.per_rank(lambda p, h: torch.tanh(h @ p["w"] + p["b"]), pb.mesh), pb.spec, into=mg
        )
        losses = lambda s, x: fh.sequence(block, s, x).square().sum(-1)  # noqa: E731
        x = _data(B, pb.full[0]["w"].shape[0], seed=3)
        if norms_first:
            fh.ghost_grad_norms(losses, pb.params, x)
        mg.begin_microbatch(last=True)
        torch.func.grad(lambda s: losses(s, x).sum())(pb.params)
        mg.finish()
        return optree.tree_map(torch.clone, mg.grads)

    assert all(
        torch.equal(a, b)
        for a, b in zip(optree.tree_leaves(run(True)), optree.tree_leaves(run(False)))
    )


# -- bad input -------------------------------------------------------------------------------------


def test_a_batch_dim_that_differs_between_units_is_an_error():
    stack = Stack(["linear", "tanh_linear"])

    def losses(s, x):
        h = stack.blocks[0](s[0], x)
        return stack.blocks[1](s[1], h[..., :-1, :]).square().sum(-1)  # one example dropped

    with pytest.raises(
        ValueError, match=r"tree\[1\]\['w'\].*\(2, 2, 3\).*tree\[0\]\['w'\].*\(2, 2, 4\)"
    ):
        fh.ghost_grad_norms(losses, stack.params, _data(B, D))


def test_losses_of_the_wrong_shape_or_type_are_errors():
    stack = Stack(["linear", "tanh_linear"])
    x = _data(B, D)
    with pytest.raises(ValueError, match=r"losses have shape \(2, 2\).*\(2, 2, 4\)"):
        fh.ghost_grad_norms(lambda s, x: stack.losses(s, x).sum(-1), stack.params, x)
    with pytest.raises(ValueError, match="per-example losses, a floating tensor"):
        fh.ghost_grad_norms(lambda s, x: stack.losses(s, x).sum(), stack.params, x)
    with pytest.raises(ValueError, match="per-example losses"):
        fh.ghost_grad_norms(lambda s, x: (stack.losses(s, x),), stack.params, x)


def test_bad_arguments_are_errors():
    stack = Stack(["linear"])
    with pytest.raises(TypeError, match="losses_fn must be callable"):
        fh.ghost_grad_norms("loss", stack.params, _data(B, D))
    with pytest.raises(ValueError, match="sequence must be one of"):
        fh.ghost_grad_norms(stack.losses, stack.params, _data(B, D), sequence="fast")
    with pytest.raises(ValueError, match="reached no parameter"):
        fh.ghost_grad_norms(lambda s, x: x.square().sum(-1), stack.params, _data(B, D))


def test_a_parameter_transformed_before_the_batch_and_a_unit_under_vmap_are_refused():
    mesh = fh.SimMesh(MESH)
    spec = preset("hsdp", mesh)
    params = fh.sync_params(fh.shard([{"w": torch.randn(D, D)}], [spec]), [spec])

    def layer(p, h):  # what carries no gradient passes: zeros_like, detach
        return torch.zeros_like(p["w"]).sum() + p["w"].detach().sum() + h @ p["w"].exp()

    block = fh.gathered(fh.per_rank(layer, mesh), spec)
    with pytest.raises(NotImplementedError, match=r"tree\[0\]\['w'\] goes through exp"):
        fh.ghost_grad_norms(lambda s, x: block(s[0], x).sum(-1), params, _data(B, D))
    plain = fh.gathered(fh.per_rank(lambda p, h: h @ p["w"], mesh), spec)

    def under_vmap(s, x):
        return torch.func.vmap(lambda xb: plain(s[0], xb).sum(-1), in_dims=2, out_dims=2)(x)

    with pytest.raises(ValueError, match="runs under vmap"):
        fh.ghost_grad_norms(under_vmap, params, _data(B, D))


# -- book-keeping: the clipped gradient from the same backward ------------------------------------


def _two_pass(stack: Stack, x: torch.Tensor, norms: torch.Tensor, max_norm: float):
    """The clip-weighted losses' first-order gradient, reduced: DP-SGD's second pass."""
    scale = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    g = torch.func.grad(lambda s: (stack.losses(s, x) * scale).sum())(stack.params)
    return fh.reduce_grads(g, stack.tree_spec, last=True, at="gradient")


def _finish(stack: Stack, grads):
    return fh.reduce_grads(grads, stack.tree_spec, last=True, at="gradient")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bookkeeping_equals_the_second_pass(strategy):
    stack = Stack(
        ["linear", "layer_norm", "conv", "matmul", "atan2", "rms_norm", "scale_shift"],
        strategy=strategy,
    )
    x = _data(B, T, D)
    norms = fh.ghost_grad_norms(stack.losses, stack.params, x)
    clip = norms.median().item()  # about half the examples clipped
    grads, got_norms = fh.ghost_clipped_grad(stack.losses, stack.params, x, max_norm=clip)
    assert torch.equal(got_norms, norms)
    assert _max_rel(_finish(stack, grads), _two_pass(stack, x, norms, clip)) <= 1e-6


def test_bookkeeping_through_views_tied_uses_and_a_unit_called_twice():
    mesh = fh.SimMesh(MESH)
    spec = preset("hsdp", mesh)
    full = [{"w": torch.randn(D, D, generator=_gen(6)) / 2, "s": torch.randn(D, generator=_gen(7))}]
    stack = Stack(["linear"])
    stack.full, stack.tree_spec = full, [spec]
    stack.params = fh.sync_params(fh.shard(full, [spec]), [spec])

    def layer(p, h):
        return torch.tanh(h @ p["w"].T * p["s"]) + torch.sin(F.linear(h, p["w"]))

    block = fh.gathered(fh.per_rank(layer, mesh), spec)
    stack.losses = lambda s, x: block(s[0], block(s[0], x)).square().flatten(3).sum(-1)
    x = _data(B, T, D)
    grads, norms = fh.ghost_clipped_grad(stack.losses, stack.params, x, max_norm=1.0)
    assert _max_rel(_finish(stack, grads), _two_pass(stack, x, norms, 1.0)) <= 1e-6


def test_bookkeeping_embedding_and_a_users_function_against_dense():
    """Against dense per-rank gradients (the second pass through ``per_rank``'s vmap is no
    reference here: torch's gradient of ``vmap(F.embedding(..., padding_idx=0))`` over
    batched weights is wrong at the padding row on torch 2.13)."""
    stack = Stack(["embedding", "tanh_linear", "function"])
    x = _ids()
    clip = 0.5 * stack.want(x).median().item()
    grads, norms = fh.ghost_clipped_grad(stack.losses, stack.params, x, max_norm=clip)
    assert _close(norms, stack.want(x))
    scale = (clip / (norms + 1e-6)).clamp(max=1.0)
    ranks = x.reshape(-1, *x.shape[2:])
    per_rank = [
        torch.func.grad(
            lambda f, xr=xr, c=c: sum(c[b] * stack.dense(f, xr[b : b + 1]) for b in range(B))
        )(stack.full)
        for xr, c in zip(ranks, scale.reshape(-1, B))
    ]
    want = optree.tree_map(lambda *t: sum(t) / len(t), *per_rank)
    got = optree.tree_map(lambda t: t[0, 0], fh.gather(_finish(stack, grads), stack.tree_spec))
    assert _max_rel(got, want) <= 1e-5


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_bookkeeping_needs_a_positive_max_norm(bad):
    stack = Stack(["linear"])
    with pytest.raises(ValueError, match="max_norm must be positive"):
        fh.ghost_clipped_grad(stack.losses, stack.params, _data(B, D), max_norm=bad)
    with pytest.raises(TypeError, match="max_norm must be a number"):
        fh.ghost_clipped_grad(stack.losses, stack.params, _data(B, D), max_norm=True)


def test_bookkeeping_refuses_a_shard_no_unit_was_called_with():
    stack = Stack(["linear", "tanh_linear"])

    def first_only(s, x):
        return stack.blocks[0](s[0], x).square().sum(-1)

    with pytest.raises(ValueError, match=r"shards\[1\]\['w'\] is no shard a unit the losses"):
        fh.ghost_clipped_grad(first_only, stack.params, _data(B, D), max_norm=1.0)

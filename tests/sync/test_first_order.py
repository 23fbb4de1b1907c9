"""fh.grad / fh.grad_and_value: torch.func's signature and results, autograd's memory (each
backward node's saved tensors freed once it has run), torch.func's own under transforms."""

import weakref

import pytest
import torch
from reference import Tap

import functional_hsdp as fh


def _tree():
    gen = torch.Generator().manual_seed(0)
    return {"a": torch.randn(3, 4, generator=gen), "b": [torch.randn(4, generator=gen)]}


def _loss(p, x, scale=1.0):
    h = torch.tanh(x @ p["a"]) * p["b"][0]
    return (h**2).sum() * scale


@pytest.mark.parametrize("has_aux", [False, True])
@pytest.mark.parametrize("argnums", [0, (0, 1), 1, (-1,)])
def test_equals_torch_func(argnums, has_aux):
    p, x = _tree(), torch.randn(2, 3)

    def f(p, x, scale=1.0):
        loss = _loss(p, x, scale)
        return (loss, {"h": loss * 2}) if has_aux else loss

    ours = fh.grad_and_value(f, argnums, has_aux=has_aux)(p, x, scale=0.5)
    theirs = torch.func.grad_and_value(f, argnums, has_aux)(p, x, scale=0.5)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    g_ours = fh.grad(f, argnums, has_aux=has_aux)(p, x, scale=0.5)
    g_theirs = torch.func.grad(f, argnums, has_aux)(p, x, scale=0.5)
    torch.testing.assert_close(g_ours, g_theirs, rtol=0, atol=0)
    value = ours[1][0] if has_aux else ours[1]
    assert not value.requires_grad
    if has_aux:
        assert not ours[1][1]["h"].requires_grad


def test_leaves_are_left_as_they_were():
    p, x = _tree(), torch.randn(2, 3)
    q = torch.nn.Parameter(torch.randn(3, 4))  # already requires a gradient: left so
    fh.grad(lambda p, q: _loss(p, x) + (q**2).sum(), (0, 1))(p, q)
    assert not any(t.requires_grad for t in [p["a"], *p["b"]])
    assert q.requires_grad and q.grad is None  # returned, never accumulated
    assert p["a"].grad is None

    def raises(p):
        _loss(p, x)
        raise KeyError("inside")

    with pytest.raises(KeyError, match="inside"):
        fh.grad(raises)(p)
    assert not any(t.requires_grad for t in [p["a"], *p["b"]])


def test_unused_leaves_get_zeros_and_a_constant_gives_zeros():
    p = _tree()
    g = fh.grad(lambda p: (p["a"] ** 2).sum())(p)
    assert torch.equal(g["b"][0], torch.zeros(4))
    g = fh.grad(lambda p: torch.tensor(1.0))(p)
    assert all(torch.equal(t, torch.zeros_like(t)) for t in [g["a"], *g["b"]])


def test_bad_input_names_the_path():
    p = _tree()
    with pytest.raises(TypeError, match=r"args\[0\]\['c'\].*floating.*torch.int64"):
        fh.grad(lambda p: p["a"].sum())({**p, "c": torch.ones(2, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"args\[0\]\['y'\]: the same tensor as args\[0\]\['x'\]"):
        fh.grad(lambda p: p["x"].sum())({"x": p["a"], "y": p["a"]})
    with pytest.raises(TypeError, match="scalar tensor.*shape \\(3, 4\\)"):
        fh.grad(lambda p: p["a"] * 2)(p)
    with pytest.raises(TypeError, match=r"has_aux=True.*tuple \(output, aux\)"):
        fh.grad(lambda p: p["a"].sum(), has_aux=True)(p)
    with pytest.raises(TypeError, match=r"args\[1\]\['n'\]: only floating"):
        fh.grad(lambda p, q: p["a"].sum(), argnums=(0, 1))(p, {"n": 3})
    with pytest.raises(ValueError, match="out of range"):
        fh.grad(lambda p: p["a"].sum(), argnums=2)(p)


class _Saves(torch.autograd.Function):
    """``x * 2``; saves a new tensor of its own for backward, a weak reference to it in
    ``refs``."""

    @staticmethod
    def forward(ctx, x, refs):
        own = x.detach().clone()
        refs.append(weakref.ref(own))
        ctx.save_for_backward(own)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (own,) = ctx.saved_tensors
        return g * 2 + 0 * own, None


def test_a_nodes_saved_tensors_are_freed_once_it_has_run():
    """What loss.backward() does and torch.func.grad does not (it keeps the backward's graph
    for higher derivatives): by the time the first op's backward runs, the saved tensors of
    the ops after it are gone. Fails with retain_graph or create_graph."""
    refs, alive = [], []

    def f(w):
        # the first op: its backward runs last
        h = Tap.apply(w, lambda: alive.append([r() is not None for r in refs]))
        for _ in range(3):
            h = torch.tanh(_Saves.apply(h, refs))
        return h.sum()

    w = torch.randn(5)
    g = fh.grad(f)(w)
    assert len(refs) == 3 and alive == [[False, False, False]]
    w.requires_grad_(True)
    f(w).backward()  # what loss.backward() gives
    torch.testing.assert_close(g, w.grad)


def test_under_transforms_it_is_torch_funcs():
    """vmap of it (per-sample gradients), grad of it (second order), jvp of it: what
    torch.func gives, exactly."""
    p, xs = _tree(), torch.randn(5, 2, 3)
    per_sample = torch.vmap(fh.grad(_loss), in_dims=(None, 0))(p, xs)
    torch.testing.assert_close(
        per_sample, torch.vmap(torch.func.grad(_loss), in_dims=(None, 0))(p, xs), rtol=0, atol=0
    )

    def g_norm(f):
        return lambda p: sum((t**2).sum() for t in [f(_loss)(p, xs[0])["a"]])

    torch.testing.assert_close(
        torch.func.grad(g_norm(fh.grad))(p), torch.func.grad(g_norm(torch.func.grad))(p)
    )
    tangent = {"a": torch.ones(3, 4), "b": [torch.ones(4)]}
    ours = torch.func.jvp(lambda p: fh.grad(_loss)(p, xs[0]), (p,), (tangent,))
    theirs = torch.func.jvp(lambda p: torch.func.grad(_loss)(p, xs[0]), (p,), (tangent,))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_under_torch_compile_it_is_torch_funcs():
    """Traced by torch.compile, fh.grad_and_value is torch.func's (which dynamo traces): the
    same results, and no leaf is left requiring a gradient."""
    p, x = _tree(), torch.randn(2, 3)
    torch._dynamo.reset()
    step = torch.compile(lambda p, x: fh.grad_and_value(_loss)(p, x), backend="aot_eager")
    torch.testing.assert_close(step(p, x), torch.func.grad_and_value(_loss)(p, x))
    assert not any(t.requires_grad for t in [p["a"], *p["b"]])

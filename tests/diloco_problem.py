"""DiLoCo's test problem and its naive reference: every replica a plain dense model (its
inner ranks' gradients averaged by hand), the replicas' deltas averaged by hand, and
``torch.optim.SGD(nesterov=True)`` as the outer optimizer. With ``compress=``, each rank's
part of the deltas goes through the policy's codec round trip and is averaged by hand, with
error feedback (:func:`compressed_mean`). Shared by tests/diloco/test_diloco.py (SimMesh) and
tests/diloco/test_diloco_gloo.py (4 gloo ranks), whose workers import it by name."""

from __future__ import annotations

import torch
from torch.func import functional_call

import functional_hsdp as fh

D_IN, D_HID, D_OUT, BATCH = 8, 16, 4, 6
INNER_LR, OUTER = 0.1, dict(lr=0.7, momentum=0.9, nesterov=True)


def model() -> torch.nn.Module:
    """The model, with the same initial weights every time (the global RNG is left alone)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(D_IN, D_HID), torch.nn.Tanh(), torch.nn.Linear(D_HID, D_OUT)
        )


def full_params() -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model().named_parameters()}


def loss(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(functional_call(_MODEL, p, (x,)), y)


_MODEL = model()  # the forward of loss(); its own weights are never used


def data(steps: int, outer: int, inner: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Per step and rank ``(o, i)`` a batch: x ``(steps, outer, inner, BATCH, D_IN)``; the
    replicas see different targets, so that they diverge."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, outer, inner, BATCH, D_IN, generator=gen)
    w = torch.randn(outer, 1, D_IN, D_OUT, generator=gen) / 2
    return x, torch.tanh(x @ w[None])


def starts(every: int, n: int) -> list[int]:
    return [(p + 1) * every // n for p in range(n)]


def reference(
    full: dict,
    x,
    y,
    *,
    every: int,
    labels: list[int],
    delay: int,
    mix: float,
    compress=None,
    units=None,
    updates=None,
) -> list[dict]:
    """Each replica's params after ``len(x)`` steps, by hand (``compress``: a policy the
    deltas travel in, each inner rank's part of a fragment on its own, as under fh.hsdp,
    ``units`` as in :func:`chunks`; ``updates``: per step and replica a dict subtracted from
    its params, in place of the inner SGD step on ``x``, ``y``)."""
    steps, n_outer, n_inner = x.shape[:3]
    keys = list(full)  # a dict of str keys flattens in sorted order
    keys.sort()
    reps = [{k: full[k].clone() for k in keys} for _ in range(n_outer)]
    anchor = {k: full[k].clone().requires_grad_() for k in keys}
    opt = torch.optim.SGD(list(anchor.values()), **OUTER)
    n = len(set(labels))
    frag = {k: labels[j] for j, k in enumerate(keys)}
    pending: dict[int, tuple[int, dict]] = {}
    held = chunks(full, n_inner, units=units)
    residuals: dict = {}  # (fragment, inner rank) -> per replica, its residual

    def merge(p: int, delta: dict) -> None:
        for k in keys:
            anchor[k].grad = delta[k].clone() if frag[k] == p else None
        opt.step()
        for k in keys:
            if frag[k] == p:
                for r in reps:
                    r[k] = mix * anchor[k].detach() + (1 - mix) * r[k]

    for t in range(1, steps + 1):
        for o, r in enumerate(reps):
            if updates is not None:
                for k in keys:
                    r[k] = r[k] - updates[t - 1][o][k]
                continue
            gs = [torch.func.grad(loss)(r, x[t - 1, o, i], y[t - 1, o, i]) for i in range(n_inner)]
            for k in keys:
                r[k] = r[k] - INNER_LR * sum(g[k] for g in gs) / n_inner
        for p in range(n):
            if p in pending and pending[p][0] == t:
                merge(p, pending.pop(p)[1])
        for p, s in enumerate(starts(every, n)):
            if t >= s and (t - s) % every == 0:
                if compress is None:
                    delta = {
                        k: anchor[k].detach() - sum(r[k] for r in reps) / n_outer
                        for k in keys
                        if frag[k] == p
                    }
                else:
                    own = [{k: anchor[k].detach() - r[k] for k in keys} for r in reps]
                    delta = _compressed_delta(own, held, frag, p, compress, residuals)
                if delay:
                    pending[p] = (t + delay, delta)
                else:
                    merge(p, delta)
    return reps


def chunks(full: dict, n_inner: int, units=None) -> list[list[tuple[str, int]]]:
    """Per inner rank, the elements ``(key, flat index)`` it holds under ``fh.hsdp``, in tree
    order: each unit's leaves (``units``: lists of keys, default one of all) in one bucket of
    its own, each leaf at an offset that is a multiple of 16, the bucket cut into
    ``n_inner`` equal chunks."""
    held: list[list] = [[] for _ in range(n_inner)]
    for keys in units or [sorted(full)]:
        slots, end = [], 0
        for k in keys:
            start = -(-end // 16) * 16
            slots += [None] * (start - end) + [(k, j) for j in range(full[k].numel())]
            end = start + full[k].numel()
        slots += [None] * (-end % n_inner)
        size = len(slots) // n_inner
        for i in range(n_inner):
            held[i] += [s for s in slots[i * size : (i + 1) * size] if s]
    return held


def compressed_mean(xs: list[torch.Tensor], policy) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The mean of the replicas' rows ``xs`` (residual already added) as the compressed
    all-reduce makes it, by hand: each row cut into one piece per replica, each piece
    through the codec (``decode(encode(.))``), piece q of every row summed in fp32 in order
    and divided on replica q, the mean through the codec again. Returns it and each
    replica's loss: its own rounding, plus, on replica q, n times the mean's of piece q."""
    n, length = len(xs), xs[0].numel()
    piece = -(-length // n)

    def round_trip(v):
        return policy.decode(policy.encode(v), v.shape[-1])

    rows = [torch.nn.functional.pad(v, (0, n * piece - length)).view(n, piece) for v in xs]
    sent = [round_trip(v) for v in rows]
    total = sent[0]
    for s in sent[1:]:
        total = total + s
    total = total / n
    back = round_trip(total)
    lost = [v - s for v, s in zip(rows, sent)]
    for q in range(n):
        lost[q][q] = lost[q][q] + (total[q] - back[q]) * n
    return back.flatten()[:length], [v.flatten()[:length] for v in lost]


def _compressed_delta(own: list[dict], held, frag: dict, p: int, policy, residuals: dict) -> dict:
    """Fragment ``p``'s averaged delta: per inner rank, its elements of the fragment (every
    replica's, in tree order, padded to the longest rank's) through :func:`compressed_mean`,
    each replica's residual added first and kept after (error feedback)."""
    delta = {k: torch.zeros_like(v) for k, v in own[0].items() if frag[k] == p}
    mine = [[(k, j) for k, j in ids if frag[k] == p] for ids in held]
    length = max(len(ids) for ids in mine)
    for i, ids in enumerate(mine):
        rows = [torch.zeros(length) for _ in own]
        for row, d in zip(rows, own):
            row[: len(ids)] = torch.stack([d[k].flatten()[j] for k, j in ids]) if ids else 0
        kept = residuals.get((p, i))
        if policy.error_feedback and kept is not None:
            rows = [row + r for row, r in zip(rows, kept)]
        mean, lost = compressed_mean(rows, policy)
        if policy.error_feedback:
            residuals[(p, i)] = lost
        for m, (k, j) in zip(mean, ids):
            delta[k].view(-1)[j] = m
    return delta


def train(mesh, full, x, y, *, spec=None, steps: int, inner=None, **options) -> tuple:
    """The whole-tree loop through fh (any mesh): x, y this process's ranks' batches per step
    (on a SimMesh with the mesh dims in front). Returns the gathered params (per rank), per
    step the comm_log events of ``dl.update``, and the DiLoCo state. ``options``: diloco's;
    without them, plain HSDP with the same inner optimizer (``inner``, default SGD)."""
    spec = spec or fh.hsdp(mesh, "dp_outer", "dp_inner")
    dl = make(spec, **options) if options else None
    inner_spec = dl.inner if dl else spec
    params = fh.shard(full, inner_spec)
    opt = inner or fh.sgd(INNER_LR)
    loop = Loop(
        mesh, inner_spec, dl, opt, params, opt.init(params), dl.init(params) if dl else None
    )
    events = [loop.step(x[t], y[t]) for t in range(steps)]
    return fh.gather(loop.params, inner_spec), events, loop.state


def make(spec, **options):
    return fh.diloco(spec, axis="dp_outer", outer=fh.sgd(**OUTER), **options)


class Loop:
    """One replica group's whole-tree training loop (gather, grad, reduce_grads, inner
    optimizer, ``dl.update``), its trees held between steps (for checkpoints)."""

    def __init__(self, mesh, spec, dl, opt, params, opt_state, state):
        self.spec, self.dl, self.opt = spec, dl, opt
        self.params, self.opt_state, self.state = params, opt_state, state
        self.grad = fh.per_rank(torch.func.grad(loss), mesh)

    def step(self, x, y) -> list:
        g = self.grad(fh.gather(self.params, self.spec), x, y)
        acc = fh.reduce_grads(g, self.spec, last=True)
        updates, self.opt_state = self.opt.update(acc, self.opt_state, self.params)
        self.params = fh.apply_updates(self.params, updates)
        if self.dl is None:
            return []
        with fh.comm_log() as log:
            self.params, self.state = self.dl.update(self.params, self.state)
        return [(e.op, e.axis, e.numel) for e in log.events]


def max_error(got: dict, want: dict) -> float:
    return max((got[k] - want[k]).abs().max().item() for k in want)


#: the leaf labels fragments=F gives this problem's 4 leaves (sorted keys 0.bias, 0.weight,
#: 2.bias, 2.weight: 16, 128, 4, 64 floats): contiguous groups, about equal bytes
LABELS = {1: [0, 0, 0, 0], 2: [0, 0, 1, 1]}

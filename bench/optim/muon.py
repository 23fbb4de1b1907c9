"""(B16) Matrix optimizers: ``fh.muon`` on the owner placement versus ``fh.adamw`` and the naive
route, on an MLP and a Hugging Face Llama through ``fh.shard_module`` + ``fh.functional_call``.

4 gloo processes, 2x2 mesh (dp_outer, dp_inner); B13's models, loop and data
(``bench/units/module.py``), the MLP's blocks grouped into units of 4 (an owner layout puts whole
matrices in a unit's buckets: a unit of one matrix would pad its bucket to 4 chunks, one of them
used): gradients land in a ``MainGrad`` (``into=mg``, microbatches declared) under
``fh.grad_and_value``, M microbatches, the loss scaled by 1/M; then the optimizer, applied in
place to the main weights (``torch._foreach_add_``). Variants:

- ``adamw``: HSDP (``fh.hsdp``) for every unit and the root, ``fh.adamw`` on every leaf.
- ``muon``: the cheap route: the units (MLP blocks, Llama decoder layers) under
  ``fh.owned(hsdp)`` (each matrix's final gradient, main weight and momentum whole on one of
  the 4 ranks), the root (Llama's embedding, head and final norm) under HSDP;
  ``fh.partition`` of ``fh.muon`` (the units' 2-D weights) and ``fh.adamw`` (the rest). The
  forward's shards are ``fh.sync_params(main)`` (an all-gather over dp_outer of the owners'
  new weights).
- ``muon_outer``: the same with the units under ``fh.owned(hsdp, "dp_outer")``: HSDP's own
  layout; the last microbatch's outer all-reduce is a reduce-scatter-v (each piece of the
  inner chunk to its leaf owner's outer coordinate, data only; the mesh's reduce-scatter
  where every rank keeps as much), ``fh.per_matrix`` moves over ``dp_inner`` only the
  pieces of matrices that straddle two inner chunks (an all-to-all pair, or nothing),
  ``fh.sync_params`` is an all-gather-v over dp_outer.
- ``naive``: HSDP as ``adamw``; Muon's math on every rank: the units' momentum directions
  all-gathered whole on every rank (``fh.gather``), Newton-Schulz of every matrix on every
  rank, each rank keeping its own slice (``fh.shard``); ``fh.adamw`` on the rest.

Newton-Schulz runs in bf16 (torch's ``Muon``); its time is measured around every call of
``fh.newton_schulz`` on each rank (``muon``: its owned matrices; ``naive``: every matrix, the
dense time). Bytes per axis: one untimed step per variant under ``fh.comm_log``; *wire* bytes
a rank sends with ring algorithms (all-reduce 2(n-1)/n of its input, reduce-scatter (n-1)/n,
all-gather n-1 times; an all-to-all what it sends to the others), the most of any rank.
Memory as B13: each variant in a fresh group, glibc mmapping >= 64 KiB, ``VmHWM`` of one step
above the idle RSS, max over ranks.
"""

from __future__ import annotations

import contextlib
import gc
import time

import optree
import torch

from .. import common as C
from ..units import module as B13
from ..units.module import _data, _loss, _warm_modules

# B13's sizes; the MLP tiny with 8 blocks (two units of 4), full with batch 256 (tokens per
# step for Newton-Schulz to be amortized over, as in training); 5 timed repetitions
SIZES = {
    "tiny": {
        **B13.SIZES["tiny"],
        "mlp": {"D": 64, "L": 8, "B": 4},
        "mlp_b1024": {"D": 64, "L": 8, "B": 16},
    },
    "full": {
        **B13.SIZES["full"],
        "mlp": {"D": 1024, "L": 8, "B": 256},
        # the same MLP at 4x the tokens per step: Newton-Schulz's work per step is the same
        "mlp_b1024": {"D": 1024, "L": 8, "B": 1024},
        "reps": 5,
    },
}
MODELS = ("llama", "mlp", "mlp_b1024")
VARIANTS = ("adamw", "muon", "muon_outer", "naive")
MUONS = ("muon", "muon_outer")  # fh.muon on the two cheap routes
LR, MUON_LR = 1e-3, 0.02

_LABEL = {
    "adamw": "HSDP, fh.adamw on every leaf",
    "muon": "units under fh.owned(hsdp), fh.muon (2-D weights) + fh.adamw",
    "muon_outer": "units under fh.owned(hsdp, 'dp_outer'), fh.muon (2-D weights) + fh.adamw",
    "naive": "HSDP, every matrix gathered and orthogonalized on every rank + fh.adamw",
}


# -- the models: B13's; the MLP's blocks in units of 4 ---------------------------------------------

GROUP = 4  # blocks per MLP unit: an owner layout wants at least about a matrix per rank


def _model(kind: str, cfg: dict) -> torch.nn.Module:
    """B13's model; the MLP's L blocks (the same weights, seeded alike) grouped by GROUP."""
    model = B13._model(kind, cfg)
    if kind == "llama":
        return model
    blocks = list(model)
    return torch.nn.Sequential(
        *(torch.nn.Sequential(*blocks[i : i + GROUP]) for i in range(0, len(blocks), GROUP))
    )


def _units(kind: str, model: torch.nn.Module) -> list:
    return list(model.model.layers) if kind == "llama" else list(model)


# -- Newton-Schulz time ----------------------------------------------------------------------

_NS = {"seconds": 0.0}


@contextlib.contextmanager
def _ns_timed():
    """Every fh.newton_schulz call inside adds its time to ``_NS`` (a seam on the library's
    module attribute, which fh.muon's per-matrix function calls)."""
    from functional_hsdp.optim import muon as muon_room

    own = muon_room.newton_schulz

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = own(*args, **kwargs)
        _NS["seconds"] += time.perf_counter() - t0
        return out

    muon_room.newton_schulz = timed
    try:
        yield
    finally:
        muon_room.newton_schulz = own


def _orthogonalized(x: torch.Tensor) -> torch.Tensor:
    """fh.muon's direction of one whole matrix (torch.optim.Muon's defaults)."""
    from functional_hsdp.optim import muon as muon_room

    ratio = max(1, x.shape[-2] / x.shape[-1]) ** 0.5
    return muon_room.newton_schulz(x).to(x.dtype) * ratio


def _naive_muon(tree_spec: dict, units: list[str]):
    """Muon's math with every matrix all-gathered and orthogonalized on every rank."""
    import functional_hsdp as fh
    from functional_hsdp.base.tree import unmask

    def init(params):
        return fh.MuonState(0, optree.tree_map(torch.zeros_like, params))

    def update(grads, state, params):
        buf = optree.tree_map(lambda b, g: b.lerp(g, 0.05), state.momentum, grads)
        direction = optree.tree_map(lambda g, b: g.lerp(b, 0.95), grads, buf)
        leaves, present, treedef, _ = unmask(direction, "d")
        full = optree.tree_unflatten(treedef, leaves)
        mine, local = optree.tree_unflatten(treedef, present), dict(full)
        for k in units:  # unit by unit (each unit's layout is known alone)
            gathered = fh.gather(full[k], tree_spec[k])  # every full matrix on every rank
            ortho = {n: _orthogonalized(x) if mine[k][n] else x for n, x in gathered.items()}
            local[k] = fh.shard(ortho, tree_spec[k])  # this rank's slices: no communication
        o = optree.tree_unflatten(treedef, optree.tree_leaves(local))
        updates = optree.tree_map(  # fh.muon's chain: -lr * (u + weight_decay * p)
            lambda p, u: -MUON_LR * torch.add(u, p, alpha=0.1), params, _masked_as(o, direction)
        )
        return updates, fh.MuonState(state.count + 1, buf)

    return fh.GradientTransformation(init, update)


def _masked_as(tree, like):
    """``tree``'s leaves where ``like`` has leaves, ``like``'s MaskedNode elsewhere."""
    from functional_hsdp.base.tree import MaskedNode

    is_masked = lambda x: isinstance(x, MaskedNode)  # noqa: E731
    values, treedef = optree.tree_flatten(tree)
    marks = optree.tree_leaves(like, is_leaf=is_masked)
    return optree.tree_unflatten(treedef, [m if is_masked(m) else v for v, m in zip(values, marks)])


# -- the runners -------------------------------------------------------------------------------


class _Runner:
    """One model and variant: step(batches) -> this rank's summed microbatch loss / M."""

    def __init__(self, kind: str, variant: str, cfg: dict, dm):
        import functional_hsdp as fh

        self.fh, self.M, self.variant = fh, cfg["M"], variant
        model = _model(kind, cfg)
        model.train()
        hsdp = fh.hsdp(fh.DistMesh(dm), *C.AXES)
        owned = {"muon": fh.owned(hsdp), "muon_outer": fh.owned(hsdp, "dp_outer")}.get(variant)
        spec = (lambda m: hsdp if m is model else owned) if owned is not None else hsdp
        self.main, self.tree_spec = fh.shard_module(model, spec, units=_units(kind, model))
        self.leaves = optree.tree_leaves(self.main)
        self.units = [k for k in self.main if k]  # every unit but the root
        self.mg = mg = fh.MainGrad(self.tree_spec, like=self.main, persistent=False)
        self.opt = self._optimizer(model)
        self.state = self.opt.init(self.main)

        def loss_fn(s, batch):
            forward = lambda a, k: fh.functional_call(model, s, a, k, into=mg)  # noqa: E731
            return _loss(kind, forward, batch) / self.M

        self.grad = fh.grad_and_value(loss_fn)

    def _optimizer(self, model):
        fh = self.fh
        if self.variant == "adamw":
            return fh.adamw(lr=LR)
        full = dict(model.named_parameters())  # the module's meta stand-ins: full shapes
        labels = {
            unit: {n: "muon" if unit and full[f"{unit}.{n}"].dim() == 2 else "adamw" for n in ps}
            for unit, ps in self.main.items()
        }
        muon = (
            fh.muon(self.tree_spec, lr=MUON_LR)
            if self.variant in MUONS
            else _naive_muon(self.tree_spec, self.units)
        )
        return fh.partition({"muon": muon, "adamw": fh.adamw(lr=LR)}, labels)

    def _shards(self):
        if self.variant not in MUONS:
            return self.main  # HSDP: the optimizer's placement is the parameters'
        # the owners' new weights, all-gathered over outer (muon_outer: an all-gather-v; the
        # HSDP root: a local copy)
        return self.fh.sync_params(self.main, self.tree_spec)

    def step(self, batches) -> float:
        fh, mg, total = self.fh, self.mg, 0.0
        shards = self._shards()
        for batch, _ in fh.microbatches(batches, into=mg):
            _, loss = self.grad(shards, batch)
            total += float(loss)
        mg.finish()
        updates, self.state = self.opt.update(mg.grads, self.state, self.main)
        with torch.no_grad():
            torch._foreach_add_(self.leaves, optree.tree_leaves(updates))
        mg.zero_grad()
        return total


# -- tasks (on every rank) ------------------------------------------------------------------------


def _wire(events, sizes: dict) -> dict:
    """Per axis: comm_log input bytes per op, and the ring wire bytes a rank sends (an
    all-to-all: the bytes it sends to the others, ``Event.sent``)."""
    factor = {
        "all_reduce": lambda n: 2 * (n - 1) / n,
        "reduce_scatter": lambda n: (n - 1) / n,
        "all_to_all": lambda n: (n - 1) / n,
        "all_gather": lambda n: n - 1,
    }
    out: dict = {}
    for e in events:
        axis = out.setdefault(e.axis, {"input": {}, "wire": 0.0})
        axis["input"][e.op] = axis["input"].get(e.op, 0) + e.nbytes
        if e.sent is not None:  # this rank's (a DistMesh: one)
            axis["wire"] += sum(e.sent) * e.dtype.itemsize
        else:
            axis["wire"] += e.nbytes * factor[e.op](sizes[e.axis])
    return out


def time_task(cfg: dict) -> dict:
    """Every variant of both models in this group, steps interleaved (their Newton-Schulz
    time per step recorded); then one more step each under comm_log."""
    import functional_hsdp as fh

    dm = C.device_mesh((2, 2))
    runners = {(k, v): _Runner(k, v, cfg, dm) for k in MODELS for v in VARIANTS}
    gc.collect()
    losses = {key: [] for key in runners}
    ns = {key: [] for key in runners}
    step = [0]
    data = {k: _data(k, cfg, 0) for k in MODELS}

    def op(key):
        def run():
            _NS["seconds"] = 0.0
            with _ns_timed():
                losses[key].append(runners[key].step(data[key[0]]))
            ns[key].append(_NS["seconds"])

        return run

    def advance():
        step[0] += 1
        for k in MODELS:
            data[k] = _data(k, cfg, step[0])

    keys = list(runners)
    times = C.interleaved(
        {key: op(key) for key in keys}, cfg["warmup"], cfg["reps"], after={keys[-1]: advance}
    )
    advance()
    wire = {}
    for key in keys:
        with fh.comm_log() as log:
            runners[key].step(data[key[0]])
        wire[key] = _wire(log.events, dict(zip(C.AXES, (2, 2))))
    skip = cfg["warmup"]
    padding = {}
    for k in MODELS:  # the owned units' buckets: padded length over data (the outer RS input)
        buckets = runners[(k, "muon")].mg.plan.buckets
        owned = [b for b in buckets if any(isinstance(p, fh.Owner) for p in b.spec.optimizer)]
        padding[k] = sum(b.padded for b in owned) / sum(b.numel for b in owned)
    return {
        "padding": padding,
        "times": {f"{k}/{v}": t for (k, v), t in times.items()},
        "losses": {f"{k}/{v}": x for (k, v), x in losses.items()},
        "ns": {f"{k}/{v}": C.median(x[skip:]) for (k, v), x in ns.items()},
        "wire": {f"{k}/{v}": w for (k, v), w in wire.items()},
    }


def mem_task(cfg: dict, kind: str, variant: str) -> dict:
    """One variant's step memory (as B13's)."""
    _warm_modules(kind)
    return C.step_memory(
        lambda dm: _Runner(kind, variant, cfg, dm), lambda k: (_data(kind, cfg, k),)
    )


# -- driver ---------------------------------------------------------------------------------------


def run(size: str = "full", pool=None) -> dict:
    cfg = SIZES[size]

    def memory(pool, per_rank):
        return {f"{k}/{v}": C.on_ranks(pool, mem_task, cfg, k, v) for k in MODELS for v in VARIANTS}

    per_rank, res, mem = C.time_then_memory(time_task, SIZES, size, pool, memory)
    res["times"], res["median"] = C.slowest_rank_medians([r["times"] for r in per_rank])
    res["losses"] = C.mean_losses(per_rank)
    res["ns"] = {key: [r["ns"][key] for r in per_rank] for key in per_rank[0]["ns"]}
    res["wire"], res["padding"] = _most(r["wire"] for r in per_rank), per_rank[0]["padding"]
    res["mem"] = {key: max(r["peak"] for r in rs) for key, rs in mem.items()}
    res["numel"] = {k: sum(p.numel() for p in _model(k, cfg).parameters()) for k in MODELS}
    res["goals"] = _goals(res)
    return res


def _most(per_rank) -> dict:
    """Per variant and axis: the rank that sends the most (its input bytes per op with it)."""
    out: dict = {}
    for wire in per_rank:
        for key, axes in wire.items():
            for axis, v in axes.items():
                known = out.setdefault(key, {}).get(axis)
                if known is None or v["wire"] > known["wire"]:
                    out[key][axis] = v
    return out


def _goals(res: dict) -> dict:
    med, ns, wire, mem = res["median"], res["ns"], res["wire"], res["mem"]
    n = C.WORLD
    goals = {}
    for k in MODELS:
        outer = lambda v, k=k: wire[f"{k}/{v}"].get("dp_outer", {}).get("wire", 0.0)  # noqa: E731
        dense = C.median(ns[f"{k}/naive"])
        for v in MUONS:
            goals[f"{k}, {v}: step <= 1.15x adamw's"] = (med[f"{k}/{v}"] / med[f"{k}/adamw"], 1.15)
            goals[f"{k}, {v}: Newton-Schulz per rank (slowest) <= 1.3/{n} of dense"] = (
                max(ns[f"{k}/{v}"]) / dense if dense else float("nan"),
                1.3 / n,
            )
            goals[f"{k}, {v}: dp_outer wire bytes (the most of any rank) <= adamw's"] = (
                outer(v) / outer("adamw"),
                1.0,
            )
            goals[f"{k}, {v}: peak memory <= 1.1x adamw's"] = (
                mem[f"{k}/{v}"] / mem[f"{k}/adamw"],
                1.1,
            )
            muon, naive = res["losses"][f"{k}/{v}"], res["losses"][f"{k}/naive"]
            res.setdefault("agree", {})[f"{k}, {v}"] = max(
                abs(a - b) / abs(b) for a, b in zip(muon, naive)
            )
    return goals


def _intro(res: dict) -> str:
    cfg = res["cfg"]
    ll, mlp = cfg["llama"], cfg["mlp"]
    return (
        f"Models (B13's): `llama` = `LlamaForCausalLM` (vocab {ll['V']}, hidden {ll['D']}, "
        f"{ll['L']} layers, {res['numel']['llama']:,} parameters), batch {ll['B']} x {ll['T']} "
        f"tokens per microbatch, units = the decoder layers; `mlp` = {mlp['L']} x "
        f"(Linear({mlp['D']}, {mlp['D']}) + Tanh) ({res['numel']['mlp']:,} parameters), batch "
        f"{mlp['B']}, units = {GROUP} blocks each; `mlp_b1024` = the same MLP at batch "
        f"{cfg['mlp_b1024']['B']} (the same Newton-Schulz work per step, 4x the tokens). "
        f"M = {cfg['M']}; AdamW lr "
        f"{LR}, Muon lr {MUON_LR} (torch's other defaults, Newton-Schulz in bf16). Variants as "
        "in `bench/optim/muon.py`'s docstring. "
        + C.timing_note(cfg, f"all {len(MODELS) * len(VARIANTS)} variants")
        + " Newton-Schulz: seconds per step in `fh.newton_schulz` on each rank (median over "
        "the timed steps); *dense* is the naive route's (every rank orthogonalizes every "
        "matrix). Bytes: one untimed step under `fh.comm_log`, per axis: each op's input "
        "bytes per rank, and the bytes a rank sends with ring algorithms. Memory: as B13."
        f"\n\n1-minute load average (4 busy ranks make about 4): time "
        f"{res['load']['time'][0]:.2f} / {res['load']['time'][1]:.2f}, memory "
        f"{res['load']['memory'][0]:.2f} / {res['load']['memory'][1]:.2f}.\n"
    )


def _bytes(axes: dict, axis: str) -> str:
    """An axis's input MiB per op, and what a rank sends."""
    per_op = axes.get(axis, {}).get("input", {})
    text = ", ".join(f"{op} {C.mib(b)}" for op, b in sorted(per_op.items()))
    return f"{text} (sends {C.mib(axes.get(axis, {}).get('wire', 0.0))})"


def _table(res: dict, k: str) -> str:
    rows = []
    for v in VARIANTS:
        key, ns = f"{k}/{v}", res["ns"][f"{k}/{v}"]
        rows.append(
            [
                f"`{v}`",
                _LABEL[v],
                res["median"][key],
                f"{res['median'][key] / res['median'][f'{k}/adamw']:.2f}",
                f"{max(ns):.3f} / {min(ns):.3f}" if v != "adamw" else "-",
                *(_bytes(res["wire"][key], a) for a in C.AXES),
                C.mib(res["mem"][key]),
            ]
        )
    header = [
        "variant",
        "what",
        "median step (s)",
        "vs adamw",
        "Newton-Schulz s/step, slowest / fastest rank",
        "dp_outer MiB per rank (sent)",
        "dp_inner MiB per rank (sent)",
        "peak above idle (MiB)",
    ]
    return f"\n**{k}**\n\n" + C.table(header, rows)


def report(res: dict, command: str, when: str) -> str:
    title = (
        "(B16) Matrix optimizers: fh.muon on the owner placement versus fh.adamw and the "
        "naive route (4 gloo processes, 2x2 mesh)"
    )
    lines = [C.section_header(title, command, when), _intro(res)]
    lines += [_table(res, k) for k in MODELS]
    lines.append("")
    for name, (value, goal) in res["goals"].items():
        met = value <= goal
        lines.append(f"- {name}: {value:.3f} — **{'met' if met else 'not met'}**.")
    for k, x in res["padding"].items():
        lines.append(
            f"- {k}, muon: the owner layout pads the owned units' buckets to {x:.3f}x their "
            "data (what the outer reduce-scatter and all-gather carry beyond HSDP's "
            "all-reduce); muon_outer keeps HSDP's layout and sends the data only."
        )
    for k, x in res["agree"].items():
        lines.append(f"- {k}: muon and naive losses agree to {x:.1e} (relative): the same math.")
    return "\n".join(lines) + "\n"

"""(B14) DP-SGD in the layer-wise loop versus the whole-tree vmap loop, beside FSDP2's plain
step: step time and peak step memory per rank.

4 gloo processes, 2x2 mesh, an MLP of ``L`` blocks ``Linear(D, D) + Tanh`` (units: the blocks),
``B`` examples per rank, MSE loss, SGD. DP-SGD here is per-example clipping to norm ``C`` and
the sum over the global batch (the noise, a Gaussian of the shards' shapes, costs the same in
every variant and is left out, so that the two DP-SGD variants' losses can be compared).
Variants:

- ``fsdp2``: FSDP2 ``fully_shard`` per block + root, a plain step on the batch (the memory
  reference: DP-SGD at FSDP memory means this).
- ``fh``: the same plain step through ``fh.shard_module`` + ``fh.functional_call(into=mg)``.
- ``fh_dpsgd``: DP-SGD in two passes: ``fh.per_example_grad_norms`` (each rank's examples'
  gradient norms, ``chunk_size`` examples at a time), then a first-order step on the
  clip-weighted loss into the ``MainGrad``.
- ``whole_dpsgd``: the whole-tree loop: ``fh.gather`` of every weight, per-example gradients by
  ``vmap(grad)``, clipped and averaged on each rank, ``fh.reduce_grads``.
- ``opacus_fsdp2`` (where Opacus is installed; it is not a dependency): Opacus's ghost
  clipping on FSDP2 (``make_private(..., grad_sample_mode="ghost_fsdp")``), ``fully_shard``
  per Linear + root on the same mesh.

Every DP-SGD variant steps on the mean over the global batch of the clipped per-example
gradients (clip factor ``min(1, C / (norm + 1e-6))``, Opacus's), so their losses agree.

Phases as (B13): time (all variants in one group, interleaved), then memory (each variant in a
fresh group, glibc mmapping allocations >= 64 KiB; ``VmHWM`` of one step above the idle RSS).
"""

from __future__ import annotations

import gc

import optree
import torch

from .. import common as C

SIZES = {
    "tiny": {"D": 64, "L": 3, "B": 4, "chunk": 2, "warmup": 1, "reps": 1, "fresh": False},
    "full": {"D": 1024, "L": 8, "B": 8, "chunk": 2, "warmup": 1, "reps": 5, "fresh": True},
}
VARIANTS = ("fsdp2", "fh", "fh_dpsgd", "whole_dpsgd")
CLIP, LR = 1.0, 0.05

_LABEL = {
    "fsdp2": "FSDP2 fully_shard per block + root, plain step",
    "fh": "fh.functional_call(into=MainGrad), plain step",
    "fh_dpsgd": "fh DP-SGD: per_example_grad_norms, then the clip-weighted step",
    "whole_dpsgd": "fh whole tree: gather, vmap(grad) per example, clip, reduce_grads",
    "opacus_fsdp2": "Opacus ghost clipping on FSDP2 (grad_sample_mode='ghost_fsdp')",
}


def _model(cfg: dict) -> torch.nn.Sequential:
    torch.manual_seed(0)
    D = cfg["D"]
    return torch.nn.Sequential(
        *(torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Tanh()) for _ in range(cfg["L"]))
    )


def _data(cfg: dict, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 * step + C.rank())
    shape = (cfg["B"], cfg["D"])
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def _per_example(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).square().mean(-1)


class _FSDP2:
    def __init__(self, cfg, dm):
        from torch.distributed.fsdp import fully_shard

        model = _model(cfg)
        for block in model:
            fully_shard(block, mesh=dm)
        fully_shard(model, mesh=dm)
        self.model, self.opt = model, torch.optim.SGD(model.parameters(), lr=LR)

    def step(self, x, y) -> float:
        loss = _per_example(self.model(x), y).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())


class _Fh:
    def __init__(self, cfg, dm, dpsgd: bool):
        import functional_hsdp as fh

        self.fh, self.dpsgd, self.chunk = fh, dpsgd, cfg["chunk"]
        model = _model(cfg)
        spec = fh.hsdp(fh.DistMesh(dm), *C.AXES)
        self.shards, tree_spec = fh.shard_module(model, spec, units=list(model))
        self.leaves = optree.tree_leaves(self.shards)
        self.mg = mg = fh.MainGrad(tree_spec, like=self.shards, persistent=False)

        def losses(s, x, y):
            return _per_example(fh.functional_call(model, s, x, into=mg), y)

        def one(s, xy):  # one example's loss, for the norms (no MainGrad there)
            x, y = xy
            return _per_example(fh.functional_call(model, s, x[None]), y[None]).sum()

        self.losses, self.one = losses, one

    def step(self, x, y) -> float:
        fh, mg = self.fh, self.mg
        scale = torch.ones(x.shape[0])
        if self.dpsgd:
            norms = fh.per_example_grad_norms(self.one, self.shards, (x, y), chunk_size=self.chunk)
            scale = (CLIP / (norms + 1e-6)).clamp(max=1.0)  # Opacus's clip factor

        def weighted(s):  # the mean over examples of the clip-weighted losses
            per = self.losses(s, x, y)
            return (per * scale).mean(), per.detach().mean()

        mg.begin_microbatch(last=True)
        _, loss = torch.func.grad(weighted, has_aux=True)(self.shards)
        mg.finish()
        with torch.no_grad():
            torch._foreach_add_(self.leaves, optree.tree_leaves(mg.grads), alpha=-LR)
        mg.zero_grad()
        return float(loss)


class _WholeTree:
    def __init__(self, cfg, dm):
        import functional_hsdp as fh

        self.fh = fh
        model = _model(cfg)
        self.spec = fh.hsdp(fh.DistMesh(dm), *C.AXES)
        self.params = fh.shard({k: v.detach() for k, v in model.named_parameters()}, self.spec)
        shell = _model(cfg).to("meta")

        def one(p, x, y):
            return _per_example(torch.func.functional_call(shell, p, (x[None],)), y[None]).sum()

        self.per_example = torch.func.vmap(torch.func.grad_and_value(one), in_dims=(None, 0, 0))

    def step(self, x, y) -> float:
        fh = self.fh
        full = fh.gather(self.params, self.spec)
        g, losses = self.per_example(full, x, y)  # every example's full gradient, at once
        norms = torch.cat([t.flatten(1) for t in optree.tree_leaves(g)], 1).norm(dim=1)
        scale = (CLIP / (norms + 1e-6)).clamp(max=1.0)
        total = optree.tree_map(lambda t: (t * scale.view(-1, *[1] * (t.dim() - 1))).mean(0), g)
        loss = float(losses.mean())
        del g, full
        final = fh.reduce_grads(total, self.spec, last=True)
        self.params = optree.tree_map(lambda p, g: p - LR * g, self.params, final)
        return loss


class _PerExampleMSE(torch.nn.Module):
    """The loss as Opacus wants a criterion: per-example values under ``reduction="none"``."""

    def __init__(self):
        super().__init__()
        self.reduction = "mean"

    def forward(self, out, y):
        per = _per_example(out, y)
        return {"none": per, "sum": per.sum(), "mean": per.mean()}[self.reduction]


class _Opacus:
    """Opacus's ghost clipping on FSDP2 (``grad_sample_mode="ghost_fsdp"``): ``fully_shard``
    per Linear + root on the 2x2 mesh (what its ``FSDP2Wrapper`` does on the default mesh),
    ``make_private`` with no noise."""

    def __init__(self, cfg, dm):
        from opacus import PrivacyEngine
        from torch.distributed.fsdp import fully_shard

        model = _model(cfg)
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=dm)
        fully_shard(model, mesh=dm)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        x, y = _data(cfg, 0)
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x, y), batch_size=cfg["B"]
        )
        self.model, self.opt, self.criterion, _ = PrivacyEngine().make_private(
            module=model,
            optimizer=opt,
            criterion=_PerExampleMSE(),
            data_loader=loader,
            noise_multiplier=0.0,
            max_grad_norm=CLIP,
            grad_sample_mode="ghost_fsdp",
            poisson_sampling=False,
        )

    def step(self, x, y) -> float:
        self.opt.zero_grad()
        loss = self.criterion(self.model(x), y)
        loss.backward()
        self.opt.step()
        return loss.item()


def _opacus() -> bool:
    try:
        import opacus  # noqa: F401
    except ImportError:
        return False
    return True


def _variants() -> tuple[str, ...]:
    """The variants, Opacus's where it is installed (it is not a dependency)."""
    return (*VARIANTS, "opacus_fsdp2") if _opacus() else VARIANTS


def _build(variant: str, cfg: dict, dm):
    if variant == "opacus_fsdp2":
        return _Opacus(cfg, dm)
    if variant == "fsdp2":
        return _FSDP2(cfg, dm)
    if variant == "whole_dpsgd":
        return _WholeTree(cfg, dm)
    return _Fh(cfg, dm, dpsgd=variant == "fh_dpsgd")


def time_task(cfg: dict) -> dict:
    dm = C.device_mesh((2, 2))
    variants = _variants()
    runners = {v: _build(v, cfg, dm) for v in variants}
    gc.collect()
    losses = {v: [] for v in variants}
    step, data = [0], [_data(cfg, 0)]

    def op(v):
        return lambda: losses[v].append(runners[v].step(*data[0]))

    def advance():
        step[0] += 1
        data[0] = _data(cfg, step[0])

    times = C.interleaved(
        {v: op(v) for v in variants}, cfg["warmup"], cfg["reps"], after={variants[-1]: advance}
    )
    return {"times": times, "losses": losses}


def mem_task(cfg: dict, variant: str) -> dict:
    """One variant: its modules imported (Opacus: about 65 MiB of RSS, which is not its step's
    memory), idle RSS, build, one warm-up step, one measured step (its VmHWM)."""
    if variant == "opacus_fsdp2":
        from opacus import PrivacyEngine  # noqa: F401
    return C.step_memory(lambda dm: _build(variant, cfg, dm), lambda k: _data(cfg, k))


def run(size: str = "full", pool=None) -> dict:
    cfg = SIZES[size]

    def memory(pool, per_rank):
        return {v: C.on_ranks(pool, mem_task, cfg, v) for v in per_rank[0]["losses"]}

    per_rank, res, mem = C.time_then_memory(time_task, SIZES, size, pool, memory)
    res["times"], res["median"] = C.slowest_rank_medians([r["times"] for r in per_rank])
    res["losses"] = C.mean_losses(per_rank)
    res["variants"] = variants = list(res["losses"])
    res["mem"] = {
        v: {"peak": max(r["peak"] for r in rs), "before": max(r["before"] for r in rs)}
        for v, rs in mem.items()
    }
    a, b = res["losses"]["fh_dpsgd"], res["losses"]["whole_dpsgd"]
    res["dpsgd_loss_maxrel"] = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    a, b = res["losses"]["fh"], res["losses"]["fsdp2"]
    res["plain_loss_maxrel"] = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    if "opacus_fsdp2" in res["losses"]:  # the same clipped mean gradient: the same training
        a, b = res["losses"]["fh_dpsgd"], res["losses"]["opacus_fsdp2"]
        res["opacus_loss_maxrel"] = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    peak, med = {v: m["peak"] for v, m in res["mem"].items()}, res["median"]
    res["goals"] = {
        "fh_dpsgd peak memory <= 1.2x fsdp2's plain step": (peak["fh_dpsgd"] / peak["fsdp2"], 1.2),
    }
    res["ratios"] = {
        v: {"time_fsdp2": med[v] / med["fsdp2"], "mem_fsdp2": peak[v] / peak["fsdp2"]}
        for v in variants
    }
    return res


def report(res: dict, command: str, when: str) -> str:
    cfg = res["cfg"]
    lines = [
        C.section_header(
            "(B14) DP-SGD in the layer-wise loop versus the whole-tree loop (4 gloo processes, "
            "2x2 mesh)",
            command,
            when,
        ),
        f"Model: {cfg['L']} x (Linear({cfg['D']}, {cfg['D']}) + Tanh), units = the blocks; "
        f"{cfg['B']} examples per rank, MSE (the mean over examples, as Opacus), SGD lr {LR}; "
        f"clip norm {CLIP}, no noise (the "
        f"same cost in every variant); `per_example_grad_norms` with chunk_size "
        f"{cfg['chunk']}. Variants as in `bench/units/dpsgd.py`'s docstring. "
        + C.timing_note(cfg, "the 4 variants")
        + " Memory: each variant in a fresh group of 4 ranks, glibc told to mmap allocations "
        ">= 64 KiB; *peak* = `VmHWM` of one step minus the idle RSS (read after the variant's "
        "modules are imported: Opacus's are about 65 MiB), max over ranks.",
        f"\n1-minute load average: time {res['load']['time'][0]:.2f} / "
        f"{res['load']['time'][1]:.2f}, memory {res['load']['memory'][0]:.2f} / "
        f"{res['load']['memory'][1]:.2f}.\n",
    ]
    rows = [
        [
            f"`{v}`",
            _LABEL[v],
            res["median"][v],
            f"{res['ratios'][v]['time_fsdp2']:.2f}",
            C.mib(res["mem"][v]["peak"]),
            C.mib(res["mem"][v]["before"]),
            f"{res['ratios'][v]['mem_fsdp2']:.2f}",
        ]
        for v in res["variants"]
    ]
    lines.append(
        C.table(
            [
                "variant",
                "what",
                "median step (s)",
                "time / fsdp2",
                "peak above idle (MiB)",
                "held (MiB)",
                "memory / fsdp2",
            ],
            rows,
        )
    )
    lines.append("")
    for name, (value, goal) in res["goals"].items():
        lines.append(f"- {name}: {value:.2f} — **{'met' if value <= goal else 'not met'}**.")
    lines.append(
        f"- Losses: `fh_dpsgd` vs `whole_dpsgd` max rel. diff {res['dpsgd_loss_maxrel']:.1e}; "
        f"`fh` vs `fsdp2` {res['plain_loss_maxrel']:.1e}"
        + (
            f"; `fh_dpsgd` vs `opacus_fsdp2` {res['opacus_loss_maxrel']:.1e}."
            if "opacus_loss_maxrel" in res
            else "; Opacus is not installed here: no `opacus_fsdp2` row."
        )
    )
    return "\n".join(lines) + "\n"

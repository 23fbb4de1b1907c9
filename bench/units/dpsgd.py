"""(B14) DP-SGD in the layer-wise loop: ghost norms and vmap norms, beside the whole-tree vmap
loop, Opacus's ghost clipping on FSDP2 and FSDP2's plain step: step time and peak step memory
per rank, on two cases.

4 gloo processes, 2x2 mesh, SGD. Cases:

- ``mlp``: ``L`` blocks ``Linear(D, D) + Tanh`` (units: the blocks), ``B`` examples per rank,
  MSE loss;
- ``llama``: a random-init Hugging Face ``LlamaForCausalLM`` (units: the decoder layers),
  ``B`` sequences of ``T`` tokens per rank, each example's loss its mean next-token
  cross-entropy.

DP-SGD here is per-example clipping to norm ``C`` and the mean over the global batch (the
noise, ``fh.add_gaussian_noise``, costs the same in every variant and is left out, so that the
DP-SGD variants' losses can be compared). Variants:

- ``fsdp2``: FSDP2 ``fully_shard`` per unit + root, a plain step on the batch (the memory
  reference: DP-SGD at FSDP memory means this).
- ``fh``: the same plain step through ``fh.shard_module`` + ``fh.functional_call(into=mg)``.
- ``fh_ghost``: DP-SGD in two passes: ``fh.ghost_grad_norms`` (each rank's examples'
  gradient norms from each layer's activations and output gradients, one first-order
  backward, no per-example gradient), then a first-order step on the clip-weighted loss into
  the ``MainGrad``.
- ``fh_bk``: DP-SGD from one forward and one backward (book-keeping):
  ``fh.ghost_clipped_grad`` takes the norms as ``fh_ghost`` does and forms the clip-weighted
  gradient from what that backward kept, each unit's reduce-scattered, then
  ``mg.accumulate(..., at="gradient")``.
- ``fh_dpsgd``: the ``fh_ghost`` step with ``fh.per_example_grad_norms`` (``vmap(grad)``:
  every example's gradient of one unit at a time, ``chunk_size`` examples at a time).
- ``whole_dpsgd`` (``mlp`` only): the whole-tree loop: ``fh.gather`` of every weight,
  per-example gradients by ``vmap(grad)``, clipped and averaged on each rank,
  ``fh.reduce_grads``.
- ``opacus_fsdp2`` (where Opacus is installed; it is not a dependency): Opacus's ghost
  clipping on FSDP2 (``make_private(..., grad_sample_mode="ghost_fsdp")``), ``fully_shard``
  per Linear (and Embedding) + root on the same mesh.

Every DP-SGD variant steps on the mean over the global batch of the clipped per-example
gradients (clip factor ``min(1, C / (norm + 1e-6))``, Opacus's), so their losses agree. Before
the timed steps each rank compares its examples' norms three ways on the same weights and
batch (ghost, vmap, and Opacus's per-sample norms where installed), and after them the
weights of ``fh_ghost`` and ``fh_dpsgd`` (the same steps on the same data).

Phases as (B13): time (all variants in one group, interleaved), then memory (each variant in a
fresh group, glibc mmapping allocations >= 64 KiB; ``VmHWM`` of one step above the idle RSS).
"""

from __future__ import annotations

import gc

import optree
import torch
import torch.nn.functional as F

from .. import common as C

SIZES = {
    "tiny": {"D": 64, "L": 3, "B": 4, "chunk": 2, "warmup": 1, "reps": 1, "fresh": False,
             "llama": {"V": 64, "D": 32, "L": 1, "heads": 2, "T": 16, "B": 2}},
    "full": {"D": 1024, "L": 8, "B": 8, "chunk": 2, "warmup": 1, "reps": 5, "fresh": True,
             "llama": {"V": 1024, "D": 256, "L": 2, "heads": 4, "T": 128, "B": 8}},
}  # fmt: skip
CASES = ("mlp", "llama")
VARIANTS = {
    "mlp": ("fsdp2", "fh", "fh_ghost", "fh_bk", "fh_dpsgd", "whole_dpsgd"),
    "llama": ("fsdp2", "fh", "fh_ghost", "fh_bk", "fh_dpsgd"),
}
CLIP, LR = 1.0, 0.05
GHOST = ("fh_ghost", "fh_bk")  # the ghost-norm variants: the goals are theirs

_LABEL = {
    "fsdp2": "FSDP2 fully_shard per unit + root, plain step",
    "fh": "fh.functional_call(into=MainGrad), plain step",
    "fh_ghost": "fh DP-SGD: ghost_grad_norms, then the clip-weighted step",
    "fh_bk": "fh DP-SGD: ghost_clipped_grad (book-keeping: one forward, one backward)",
    "fh_dpsgd": "fh DP-SGD: per_example_grad_norms (vmap), then the clip-weighted step",
    "whole_dpsgd": "fh whole tree: gather, vmap(grad) per example, clip, reduce_grads",
    "opacus_fsdp2": "Opacus ghost clipping on FSDP2 (grad_sample_mode='ghost_fsdp')",
}


def case_cfg(cfg: dict, case: str) -> dict:
    """``cfg`` (a size of :data:`SIZES`) for ``case``: the Llama's own entries over it."""
    return {**cfg, **cfg["llama"], "case": "llama"} if case == "llama" else {**cfg, "case": "mlp"}


def _case(cfg: dict) -> str:
    return cfg.get("case", "mlp")


def _model(cfg: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    D = cfg["D"]
    if _case(cfg) == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=cfg["V"], hidden_size=D, intermediate_size=2 * D,
            num_hidden_layers=cfg["L"], num_attention_heads=cfg["heads"],
            num_key_value_heads=cfg["heads"], max_position_embeddings=cfg["T"], use_cache=False,
        )  # fmt: skip
        config._attn_implementation = "eager"
        return LlamaForCausalLM(config)
    return torch.nn.Sequential(
        *(torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Tanh()) for _ in range(cfg["L"]))
    )


def _units(cfg: dict, model: torch.nn.Module) -> list:
    return list(model.model.layers) if _case(cfg) == "llama" else list(model)


def _data(cfg: dict, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of step ``step``: ``(x, y)``; the Llama's ``(ids, ids)``."""
    gen = torch.Generator().manual_seed(10_000 * step + C.rank())
    if _case(cfg) == "llama":
        ids = torch.randint(cfg["V"], (cfg["B"], cfg["T"]), generator=gen)
        return ids, ids
    shape = (cfg["B"], cfg["D"])
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def _forward(cfg: dict, model, x: torch.Tensor) -> torch.Tensor:
    """The model's output: the MLP's, the Llama's logits."""
    return model(x).logits if _case(cfg) == "llama" else model(x)


def _per_example(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each example's loss: MSE (the MLP), or the mean next-token cross-entropy (logits
    ``(B, T, V)`` against the ids)."""
    if out.dim() == 3:
        logits, ids = out[:, :-1].float(), y[:, 1:]
        ce = F.cross_entropy(logits.flatten(0, 1), ids.flatten(), reduction="none")
        return ce.view(ids.shape).mean(-1)
    return (out - y).square().mean(-1)


class _FSDP2:
    def __init__(self, cfg, dm):
        from torch.distributed.fsdp import fully_shard

        self.cfg = cfg
        model = _model(cfg)
        for unit in _units(cfg, model):
            fully_shard(unit, mesh=dm)
        fully_shard(model, mesh=dm)
        self.model, self.opt = model, torch.optim.SGD(model.parameters(), lr=LR)

    def step(self, x, y) -> float:
        loss = _per_example(_forward(self.cfg, self.model, x), y).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())


class _Fh:
    """fh's step through ``shard_module`` + ``functional_call(into=mg)``; ``norms``: None (a
    plain step), ``"ghost"`` or ``"vmap"`` (DP-SGD, the norms' pass before the step)."""

    def __init__(self, cfg, dm, norms: str | None = None):
        import functional_hsdp as fh

        self.fh, self.norms, self.chunk = fh, norms, cfg["chunk"]
        model = _model(cfg)
        spec = fh.hsdp(fh.DistMesh(dm), *C.AXES)
        self.shards, tree_spec = fh.shard_module(model, spec, units=_units(cfg, model))
        self.leaves = optree.tree_leaves(self.shards)
        self.mg = mg = fh.MainGrad(tree_spec, like=self.shards, persistent=False)

        def call(s, x, **kw):  # the model's output through the shards
            return _forward(cfg, lambda x: fh.functional_call(model, s, x, **kw), x)

        def losses(s, x, y):  # the per-example losses, into the MainGrad
            return _per_example(call(s, x, into=mg), y)

        def plain(s, x, y):  # the per-example losses, for the ghost pass (no MainGrad there)
            return _per_example(call(s, x), y)

        def one(s, xy):  # one example's loss, for the vmap norms (no MainGrad there)
            x, y = xy
            return _per_example(call(s, x[None]), y[None]).sum()

        self.losses, self.plain, self.one = losses, plain, one
        self.first_norms = None

    def per_example_norms(self, x, y) -> torch.Tensor:
        fh = self.fh
        if self.norms == "ghost":
            return fh.ghost_grad_norms(self.plain, self.shards, x, y)
        return fh.per_example_grad_norms(self.one, self.shards, (x, y), chunk_size=self.chunk)

    def step(self, x, y) -> float:
        fh, mg = self.fh, self.mg
        if self.norms == "bookkeeping":
            return self._bookkeeping(x, y)
        scale = torch.ones(x.shape[0])
        if self.norms is not None:
            norms = self.per_example_norms(x, y)
            if self.first_norms is None:  # at the initial weights, for the norms' comparison
                self.first_norms = norms.detach().clone()
            scale = (CLIP / (norms + 1e-6)).clamp(max=1.0)  # Opacus's clip factor

        def weighted(s):  # the mean over examples of the clip-weighted losses
            per = self.losses(s, x, y)
            return (per * scale).mean(), per.detach().mean()

        mg.begin_microbatch(last=True)
        _, loss = fh.grad(weighted, has_aux=True)(self.shards)  # autograd's memory
        mg.finish()
        with torch.no_grad():
            torch._foreach_add_(self.leaves, optree.tree_leaves(mg.grads), alpha=-LR)
        mg.zero_grad()
        return float(loss)

    def _bookkeeping(self, x, y) -> float:
        """One forward and one backward: the clipped sum at the gradient placement, its mean
        over the examples into the MainGrad."""
        fh, mg = self.fh, self.mg
        seen = []

        def losses(s, x, y):  # the pass's per-example losses, kept for the step's loss
            per = self.plain(s, x, y)
            seen.append(per.detach())
            return per

        grads, norms = fh.ghost_clipped_grad(losses, self.shards, x, y, max_norm=CLIP)
        if self.first_norms is None:
            self.first_norms = norms.detach().clone()
        mean = optree.tree_map(lambda g: g / x.shape[0], grads)
        mg.accumulate(mean, last=True, at="gradient")
        with torch.no_grad():
            torch._foreach_add_(self.leaves, optree.tree_leaves(mg.grads), alpha=-LR)
        mg.zero_grad()
        return float(seen[0].mean())


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


class _PerExampleLoss(torch.nn.Module):
    """The loss as Opacus wants a criterion: per-example values under ``reduction="none"``."""

    def __init__(self):
        super().__init__()
        self.reduction = "mean"

    def forward(self, out, y):
        per = _per_example(out, y)
        return {"none": per, "sum": per.sum(), "mean": per.mean()}[self.reduction]


class _Opacus:
    """Opacus's ghost clipping on FSDP2 (``grad_sample_mode="ghost_fsdp"``): ``fully_shard``
    per Linear and Embedding + root on the 2x2 mesh (what its ``FSDP2Wrapper`` does on the
    default mesh; the Llama's RMSNorm weights sit in the root's group, and Opacus takes their
    norms by its functorch fallback), ``make_private`` with no noise."""

    def __init__(self, cfg, dm):
        from opacus import PrivacyEngine
        from torch.distributed.fsdp import fully_shard

        self.cfg = cfg
        model = _model(cfg)
        for m in model.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
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
            criterion=_PerExampleLoss(),
            data_loader=loader,
            noise_multiplier=0.0,
            max_grad_norm=CLIP,
            grad_sample_mode="ghost_fsdp",
            poisson_sampling=False,
        )
        self.first_norms = None

    def step(self, x, y) -> float:
        self.opt.zero_grad()
        loss = self.criterion(_forward(self.cfg, self.model, x), y)
        loss.backward()
        self.opt.step()
        if self.first_norms is None:  # this rank's examples' norms at the initial weights
            self.first_norms = self.model.per_sample_gradient_norms.detach().clone()
        return loss.item()


def _opacus_version() -> str | None:
    """Opacus's version where it is installed (``pip install opacus``), else None."""
    try:
        import opacus
    except ImportError:
        return None
    return opacus.__version__


def _opacus() -> bool:
    return _opacus_version() is not None


def _variants(cfg: dict) -> tuple[str, ...]:
    """The case's variants, Opacus's where it is installed (it is not a dependency)."""
    own = VARIANTS[_case(cfg)]
    return (*own, "opacus_fsdp2") if _opacus() else own


def _build(variant: str, cfg: dict, dm):
    if variant == "opacus_fsdp2":
        return _Opacus(cfg, dm)
    if variant == "fsdp2":
        return _FSDP2(cfg, dm)
    if variant == "whole_dpsgd":
        return _WholeTree(cfg, dm)
    norms = {"fh_ghost": "ghost", "fh_bk": "bookkeeping", "fh_dpsgd": "vmap"}.get(variant)
    return _Fh(cfg, dm, norms=norms)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest relative difference of two norm vectors."""
    return float(((a.double() - b.double()).abs() / b.double().abs()).max())


def time_task(cfg: dict) -> dict:
    dm = C.device_mesh((2, 2))
    variants = _variants(cfg)
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
    # the first step's norms (the initial weights, the first batch) and the DP-SGD steps' weights
    ghost = runners["fh_ghost"].first_norms
    norms = {"vmap": _rel(ghost, runners["fh_dpsgd"].first_norms),
             "book-keeping's": _rel(ghost, runners["fh_bk"].first_norms)}  # fmt: skip
    if "opacus_fsdp2" in runners:
        norms["opacus"] = _rel(ghost, runners["opacus_fsdp2"].first_norms)
    weights = {}
    for v in GHOST:
        pairs = zip(runners[v].leaves, runners["fh_dpsgd"].leaves)
        weights[v] = max(float((a - b).abs().max()) for a, b in pairs if a.numel())
    return {"times": times, "losses": losses, "norms": norms, "weights": weights}


def mem_task(cfg: dict, variant: str) -> dict:
    """One variant: every variant's modules imported first, whichever this one is (Opacus's
    about 65 MiB of RSS, transformers' Llama: memory of no step, and shared libraries one
    import would otherwise count and another not), idle RSS, build, one warm-up step, one
    measured step (its VmHWM)."""
    if _opacus():
        from opacus import PrivacyEngine  # noqa: F401
    if _case(cfg) == "llama":
        from transformers import LlamaForCausalLM  # noqa: F401
    return C.step_memory(lambda dm: _build(variant, cfg, dm), lambda k: _data(cfg, k))


def _maxrel(a: list, b: list) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _run_case(cfg: dict, size: str, pool) -> dict:
    def memory(pool, per_rank):
        return {v: C.on_ranks(pool, mem_task, cfg, v) for v in per_rank[0]["losses"]}

    per_rank, res, mem = C.time_then_memory(time_task, {size: cfg}, size, pool, memory)
    res["times"], res["median"] = C.slowest_rank_medians([r["times"] for r in per_rank])
    res["losses"] = C.mean_losses(per_rank)
    res["variants"] = variants = list(res["losses"])
    res["mem"] = {
        v: {"peak": max(r["peak"] for r in rs), "before": max(r["before"] for r in rs)}
        for v, rs in mem.items()
    }
    res["norms_maxrel"] = {k: max(r["norms"][k] for r in per_rank) for k in per_rank[0]["norms"]}
    res["weights_maxabs"] = {v: max(r["weights"][v] for r in per_rank) for v in GHOST}
    L = res["losses"]
    res["loss_maxrel"] = {f"{v} vs fh_dpsgd": _maxrel(L[v], L["fh_dpsgd"]) for v in GHOST}
    res["loss_maxrel"]["fh vs fsdp2"] = _maxrel(L["fh"], L["fsdp2"])
    if "whole_dpsgd" in L:
        res["loss_maxrel"]["fh_dpsgd vs whole_dpsgd"] = _maxrel(L["fh_dpsgd"], L["whole_dpsgd"])
    if "opacus_fsdp2" in L:  # the same clipped mean gradient: the same training
        res["loss_maxrel"]["fh_ghost vs opacus_fsdp2"] = _maxrel(L["fh_ghost"], L["opacus_fsdp2"])
    peak, med = {v: m["peak"] for v, m in res["mem"].items()}, res["median"]
    res["ratios"] = {
        v: {"time_fsdp2": med[v] / med["fsdp2"], "mem_fsdp2": peak[v] / peak["fsdp2"]}
        for v in variants
    }
    return res


def goals(case: str, res: dict) -> dict[str, tuple[float, float]]:
    """Issue 48's goals on a case, for each ghost-norm variant: ``name -> (value, bound)``,
    met when value <= bound."""
    peak, med = {v: m["peak"] for v, m in res["mem"].items()}, res["median"]
    out = {}
    for v in GHOST:
        out[f"{case}: {v} peak memory <= 1.2x fsdp2's plain step"] = (peak[v] / peak["fsdp2"], 1.2)
        out[f"{case}: {v} weights vs fh_dpsgd's after the same steps, max abs <= 1e-6"] = (
            res["weights_maxabs"][v], 1e-6)  # fmt: skip
        if "opacus_fsdp2" in med:
            out[f"{case}: {v} step time <= 0.8x Opacus ghost_fsdp's"] = (
                med[v] / med["opacus_fsdp2"], 0.8)  # fmt: skip
            out[f"{case}: {v} peak memory <= 1.0x Opacus ghost_fsdp's"] = (
                peak[v] / peak["opacus_fsdp2"], 1.0)  # fmt: skip
    if "opacus_fsdp2" in med:
        name = f"{case}: ghost norms vs Opacus's per-sample norms, max relative difference"
        out[name + " <= 1e-5"] = (res["norms_maxrel"]["opacus"], 1e-5)
    return out


def run(size: str = "full", pool=None) -> dict:
    cases = {case: _run_case(case_cfg(SIZES[size], case), size, pool) for case in CASES}
    res = {"size": size, "cfg": SIZES[size], "cases": cases, "opacus": _opacus_version()}
    res["wall_s"] = sum(c["wall_s"] for c in cases.values())
    res["goals"] = {k: v for case, c in cases.items() for k, v in goals(case, c).items()}
    return res


def _case_lines(case: str, c: dict) -> list[str]:
    cfg = c["cfg"]
    if case == "llama":
        what = (f"Hugging Face `LlamaForCausalLM` (random init): hidden {cfg['D']}, {cfg['L']} "
                f"layers, {cfg['heads']} heads, vocabulary {cfg['V']}; {cfg['B']} sequences of "
                f"{cfg['T']} tokens per rank, each example's loss its mean next-token "
                "cross-entropy; units = the decoder layers.")  # fmt: skip
    else:
        what = (
            f"{cfg['L']} x (Linear({cfg['D']}, {cfg['D']}) + Tanh), units = the blocks; "
            f"{cfg['B']} examples per rank, MSE (the mean over examples, as Opacus)."
        )
    lines = [
        f"\n### Case `{case}`\n",
        what + f" 1-minute load average: time {c['load']['time'][0]:.2f} / "
        f"{c['load']['time'][1]:.2f}, memory {c['load']['memory'][0]:.2f} / "
        f"{c['load']['memory'][1]:.2f}.\n",
    ]
    opacus = "opacus_fsdp2" in c["median"]
    rows = [
        [
            f"`{v}`",
            _LABEL[v],
            c["median"][v],
            f"{c['ratios'][v]['time_fsdp2']:.2f}",
            f"{c['median'][v] / c['median']['opacus_fsdp2']:.2f}" if opacus else "-",
            C.mib(c["mem"][v]["peak"]),
            C.mib(c["mem"][v]["before"]),
            f"{c['ratios'][v]['mem_fsdp2']:.2f}",
            f"{c['mem'][v]['peak'] / c['mem']['opacus_fsdp2']['peak']:.2f}" if opacus else "-",
        ]
        for v in c["variants"]
    ]
    lines.append(
        C.table(
            [
                "variant",
                "what",
                "median step (s)",
                "time / fsdp2",
                "time / Opacus",
                "peak above idle (MiB)",
                "held (MiB)",
                "memory / fsdp2",
                "memory / Opacus",
            ],
            rows,
        )  # fmt: skip
    )
    norms = ", ".join(f"{k} {v:.1e}" for k, v in c["norms_maxrel"].items())
    losses = "; ".join(f"{k} {v:.1e}" for k, v in c["loss_maxrel"].items())
    weights = ", ".join(f"`{k}` {v:.1e}" for k, v in c["weights_maxabs"].items())
    lines.append(
        f"\n- First step's per-example norms (initial weights, this rank's examples), ghost "
        f"against: {norms} (max relative difference over the ranks' examples). Weights "
        f"against `fh_dpsgd`'s after the same steps, max abs: {weights}. Losses, max "
        f"relative difference per step: {losses}."
    )
    return lines


def report(res: dict, command: str, when: str) -> str:
    cfg = res["cfg"]
    lines = [
        C.section_header(
            "(B14) DP-SGD: ghost norms, vmap norms, the whole-tree loop and Opacus on FSDP2 "
            "(4 gloo processes, 2x2 mesh)",
            command,
            when,
        ),
        f"SGD lr {LR}; clip norm {CLIP}, no noise (the same cost in every variant); "
        f"`per_example_grad_norms` with chunk_size {cfg['chunk']}; `ghost_grad_norms` with its "
        "default form choice. Variants as in `bench/units/dpsgd.py`'s docstring. "
        + C.timing_note(cfg, "the variants")
        + " Memory: each variant in a fresh group of 4 ranks, glibc told to mmap allocations "
        ">= 64 KiB; *peak* = `VmHWM` of one step minus the idle RSS (read after every variant's "
        "modules are imported, in each: Opacus's, about 65 MiB, and transformers' Llama), "
        "max over ranks."
        + (
            f" Opacus {res['opacus']}."
            if res["opacus"]
            else " Opacus is not installed here (`pip install opacus`): no `opacus_fsdp2` rows."
        ),
    ]
    for case, c in res["cases"].items():
        lines += _case_lines(case, c)
    lines.append("\n### Goals (issue 48)\n")
    for name, (value, bound) in res["goals"].items():
        fmt = f"{value:.2f}" if bound >= 0.1 else f"{value:.1e}"
        lines.append(f"- {name}: {fmt} — **{'met' if value <= bound else 'not met'}**.")
    return "\n".join(lines) + "\n"

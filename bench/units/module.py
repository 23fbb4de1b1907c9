"""(B13) Existing modules: ``fh.shard_module`` + ``fh.functional_call`` versus FSDP2, step time,
peak step memory and bytes on the wire, for a Hugging Face Llama and an MLP.

4 gloo processes, 2x2 mesh (dp_outer, dp_inner). Two models, each an ``nn.Module`` whose own
forward runs: ``llama``, a random-init ``transformers`` ``LlamaForCausalLM`` (next-token loss
through its ``labels``), units = its decoder layers; ``mlp``, ``L`` blocks of
``Linear(D, D) + Tanh`` (MSE loss), units = the blocks. M microbatches per step, the loss
scaled by 1/M, SGD; the same initial weights on every rank and in every variant, the same data
in every variant. Variants (each per model):

- ``fsdp2``: ``fully_shard`` per unit and on the root (HSDP), ``reshard_after_forward=True``,
  ``set_requires_all_reduce(last)``, ``torch.optim.SGD``, ``zero_grad(set_to_none=True)``.
- ``fsdp2_ac``: ``fsdp2`` with activation checkpointing per unit (Hugging Face's own
  ``gradient_checkpointing_enable`` for the Llama, torch's ``checkpoint_wrapper`` per block
  for the MLP).
- ``fsdp2_bf16``: ``fsdp2`` with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``.
- ``fh``: ``fh.shard_module(model, spec, units=...)``,
  ``fh.MainGrad(tree_spec, like=shards, persistent=False)`` (its memory released by
  ``zero_grad`` and taken bucket by bucket as gradients land, as FSDP2's sharded gradients),
  ``fh.functional_call(model, shards, ..., into=mg)`` under ``fh.grad_and_value`` (the
  README's loop: torch.func's signature, differentiated once as ``loss.backward()`` does),
  the microbatches declared (``fh.microbatches(..., into=mg)``), ``mg.finish()``, SGD in
  place on the shards (``torch._foreach_add_``), ``mg.zero_grad()``. ``recompute=False``.
- ``fh_recompute``: ``fh`` with ``recompute=True`` (per-unit activation checkpointing).
- ``fh_bf16``: ``fh`` with the same policy as ``fsdp2_bf16``.
- ``fh_func``: ``fh`` under ``torch.func.grad_and_value`` (which keeps every saved tensor
  and intermediate of the backward outside the units until the backward ends).

Two phases, as (B9): *time*: every variant of both models built in one group of 4 ranks,
steps interleaved, glibc's default malloc; then one more step of each, untimed, with the bytes
each collective carried recorded (``fh.comm_log`` for fh; for FSDP2 a dispatch mode that sees
every c10d collective and its input). *Memory*: each variant in a fresh group of 4 ranks,
glibc told to mmap allocations >= 64 KiB; the model's modules imported (a tiny model run
once), then idle RSS before the variant is built, a warm-up
step, then the high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``) of one
measured step; peak above idle, max over ranks.
"""

from __future__ import annotations

import gc

import optree
import torch
import torch.nn.functional as F

from .. import common as C

SIZES = {
    "tiny": {
        "llama": {"V": 128, "D": 32, "L": 2, "heads": 4, "T": 16, "B": 2},
        "mlp": {"D": 64, "L": 3, "B": 4},
        "M": 2,
        "warmup": 1,
        "reps": 1,
        "fresh": False,
    },
    "full": {
        "llama": {"V": 2048, "D": 256, "L": 4, "heads": 8, "T": 64, "B": 4},
        "mlp": {"D": 1024, "L": 8, "B": 32},
        "M": 2,
        "warmup": 1,
        "reps": 5,
        "fresh": True,
    },
}
MODELS = ("llama", "mlp")
VARIANTS = ("fsdp2", "fsdp2_ac", "fsdp2_bf16", "fh", "fh_recompute", "fh_bf16", "fh_func")
# each fh variant and the FSDP2 variant it is measured against
PAIRS = {"fh": "fsdp2", "fh_recompute": "fsdp2_ac", "fh_bf16": "fsdp2_bf16", "fh_func": "fsdp2"}
LR = 0.05

_LABEL = {
    "fsdp2": "FSDP2 fully_shard HSDP per unit + root",
    "fsdp2_ac": "FSDP2 + activation checkpointing per unit",
    "fsdp2_bf16": "FSDP2, MixedPrecisionPolicy(bf16, fp32)",
    "fh": "fh.functional_call(into=MainGrad) under fh.grad_and_value, recompute=False",
    "fh_recompute": "fh, recompute=True",
    "fh_bf16": "fh, mp_policy=MixedPrecisionPolicy(bf16, fp32)",
    "fh_func": "fh under torch.func.grad_and_value",
}


# -- the models -------------------------------------------------------------------------------


def _model(kind: str, cfg: dict) -> torch.nn.Module:
    """The initial model, the same on every rank (seeded)."""
    torch.manual_seed(0)
    c = cfg[kind]
    if kind.startswith("mlp"):  # bench/optim/muon.py's mlp_b1024 too
        return torch.nn.Sequential(
            *(
                torch.nn.Sequential(torch.nn.Linear(c["D"], c["D"]), torch.nn.Tanh())
                for _ in range(c["L"])
            )
        )
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=c["V"],
        hidden_size=c["D"],
        intermediate_size=4 * c["D"],
        num_hidden_layers=c["L"],
        num_attention_heads=c["heads"],
        num_key_value_heads=c["heads"] // 2,
        max_position_embeddings=c["T"],
        use_cache=False,
    )
    return LlamaForCausalLM(config)


def _units(kind: str, model: torch.nn.Module) -> list:
    return list(model.model.layers) if kind == "llama" else list(model)


def _data(kind: str, cfg: dict, step: int) -> list:
    """This rank's M microbatches of step ``step``: ids (llama) or (x, y) (mlp)."""
    gen = torch.Generator().manual_seed(10_000 * step + C.rank())
    c, M = cfg[kind], cfg["M"]
    if kind == "llama":
        return list(torch.randint(c["V"], (M, c["B"], c["T"]), generator=gen))
    x = torch.randn(M, c["B"], c["D"], generator=gen)
    return list(zip(x, torch.randn(M, c["B"], c["D"], generator=gen)))


def _loss(kind: str, forward, batch) -> torch.Tensor:
    """The microbatch loss; ``forward(args, kwargs)`` runs the model."""
    if kind == "llama":
        return forward((batch,), {"labels": batch}).loss
    x, y = batch
    return F.mse_loss(forward((x,), {}).float(), y)


def _checkpointing(model: torch.nn.Module) -> None:
    """Hugging Face's own activation checkpointing of every decoder layer (its newer name
    where this transformers has it)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    enable = enable or model.gradient_checkpointing_enable
    enable({"use_reentrant": False})


def _policy(bf16: bool):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else None


# -- the variants (each: step(batches) -> this rank's summed microbatch loss / M) --------------


class _FSDP2:
    def __init__(self, kind, cfg, dm, ac=False, bf16=False):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.kind, self.M = kind, cfg["M"]
        model = _model(kind, cfg)
        if ac and kind == "llama":
            _checkpointing(model)
        elif ac:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                checkpoint_wrapper,
            )

            for i in range(len(model)):
                model[i] = checkpoint_wrapper(model[i])
        mp = _policy(bf16) or MixedPrecisionPolicy()
        for unit in _units(kind, model):
            fully_shard(unit, mesh=dm, mp_policy=mp)
        fully_shard(model, mesh=dm, mp_policy=mp)
        model.train()
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step(self, batches) -> float:
        total = 0.0
        forward = lambda a, k: self.model(*a, **k)  # noqa: E731
        for m, batch in enumerate(batches):
            self.model.set_requires_all_reduce(m == self.M - 1)
            loss = _loss(self.kind, forward, batch) / self.M
            loss.backward()
            total += float(loss.detach())
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return total


class _Fh:
    def __init__(self, kind, cfg, dm, recompute=False, bf16=False, func=False):
        import functional_hsdp as fh

        self.fh, self.M = fh, cfg["M"]
        model = _model(kind, cfg)
        model.train()
        spec = fh.hsdp(fh.DistMesh(dm), *C.AXES)
        self.shards, tree_spec = fh.shard_module(
            model, spec, units=_units(kind, model), mp_policy=_policy(bf16)
        )
        self.leaves = optree.tree_leaves(self.shards)
        # its memory given back by zero_grad, as FSDP2's sharded gradients are
        self.mg = mg = fh.MainGrad(tree_spec, like=self.shards, persistent=False)
        M = self.M

        def loss_fn(s, batch):
            def forward(args, kwargs):
                return fh.functional_call(model, s, args, kwargs, into=mg, recompute=recompute)

            return _loss(kind, forward, batch) / M

        self.grad = (torch.func.grad_and_value if func else fh.grad_and_value)(loss_fn)

    def step(self, batches) -> float:
        fh, mg, total = self.fh, self.mg, 0.0
        for batch, _ in fh.microbatches(batches, into=mg):
            _, loss = self.grad(self.shards, batch)
            total += float(loss)
        mg.finish()
        with torch.no_grad():  # in place, one fused op, as torch.optim's foreach SGD
            torch._foreach_add_(self.leaves, optree.tree_leaves(mg.grads), alpha=-LR)
        mg.zero_grad()
        return total


def _build(kind: str, variant: str, cfg: dict, dm):
    if variant.startswith("fsdp2"):
        return _FSDP2(kind, cfg, dm, ac=variant == "fsdp2_ac", bf16=variant == "fsdp2_bf16")
    return _Fh(
        kind,
        cfg,
        dm,
        recompute=variant == "fh_recompute",
        bf16=variant == "fh_bf16",
        func=variant == "fh_func",
    )


# -- bytes on the wire ----------------------------------------------------------------------------


class _Wire(torch.utils._python_dispatch.TorchDispatchMode):
    """Per collective kind: input bytes per rank and dtypes, of every c10d collective run
    inside (FSDP2's; the library's are read from comm_log)."""

    KINDS = {
        "_allgather_base_": "all_gather",
        "allgather_into_tensor_coalesced_": "all_gather",
        "_reduce_scatter_base_": "reduce_scatter",
        "reduce_scatter_tensor_coalesced_": "reduce_scatter",
        "allreduce_": "all_reduce",
    }

    def __init__(self):
        super().__init__()
        self.bytes: dict[str, int] = {}
        self.numel: dict[str, int] = {}
        self.dtypes: dict[str, set] = {}

    def add(self, kind: str, numel: int, dtype: torch.dtype) -> None:
        self.bytes[kind] = self.bytes.get(kind, 0) + numel * dtype.itemsize
        self.numel[kind] = self.numel.get(kind, 0) + numel
        self.dtypes.setdefault(kind, set()).add(str(dtype).removeprefix("torch."))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = self.KINDS.get(func._opname) if func.namespace == "c10d" else None
        if kind is not None:
            # the input: an all-gather's or reduce-scatter's second tensor, an all-reduce's list
            tensors = [t for t in optree.tree_leaves(args) if isinstance(t, torch.Tensor)]
            source = tensors[:1] if kind == "all_reduce" else tensors[1:2]
            for t in source:
                if t.is_floating_point():
                    self.add(kind, t.numel(), t.dtype)
        return func(*args, **kwargs)


def _wire_step(runner, batches) -> dict:
    import functional_hsdp as fh

    wire = _Wire()
    if isinstance(runner, _Fh):
        with fh.comm_log() as log:
            runner.step(batches)
        for e in log.events:
            wire.add(e.op, e.numel, e.dtype)
    else:
        with wire:
            runner.step(batches)
    return {
        "bytes": wire.bytes,
        "gathered": wire.numel.get("all_gather", 0),
        "dtypes": {k: sorted(v) for k, v in wire.dtypes.items()},
    }


# -- tasks (on every rank) ----------------------------------------------------------------------


def time_task(cfg: dict) -> dict:
    """Every variant of both models in this group, steps interleaved; then one more step each
    with its bytes on the wire recorded."""
    dm = C.device_mesh((2, 2))
    runners = {(k, v): _build(k, v, cfg, dm) for k in MODELS for v in VARIANTS}
    gc.collect()
    losses = {key: [] for key in runners}
    step = [0]
    data = {k: _data(k, cfg, 0) for k in MODELS}

    def op(key):
        return lambda: losses[key].append(runners[key].step(data[key[0]]))

    def advance():
        step[0] += 1
        for k in MODELS:
            data[k] = _data(k, cfg, step[0])

    keys = list(runners)
    times = C.interleaved(
        {key: op(key) for key in keys}, cfg["warmup"], cfg["reps"], after={keys[-1]: advance}
    )
    advance()
    wire = {key: _wire_step(runners[key], data[key[0]]) for key in keys}
    return {
        "times": {f"{k}/{v}": t for (k, v), t in times.items()},
        "losses": {f"{k}/{v}": x for (k, v), x in losses.items()},
        "wire": {f"{k}/{v}": w for (k, v), w in wire.items()},
    }


def _warm_modules(kind: str) -> None:
    """Import what building and running ``kind`` imports (for the Llama, transformers and what
    it loads lazily, scipy where installed: tens of MiB) by running a tiny one, so that the
    idle RSS holds it and the step's peak above idle is the step's own."""
    if kind == "llama":
        model = _model(kind, SIZES["tiny"])
        ids = _data(kind, SIZES["tiny"], 0)[0]
        _loss(kind, lambda a, k: model(*a, **k), ids).backward()


def mem_task(cfg: dict, kind: str, variant: str) -> dict:
    """One variant: modules warmed, idle RSS, build, one warm-up step, one measured step (its
    VmHWM)."""
    _warm_modules(kind)
    return C.step_memory(
        lambda dm: _build(kind, variant, cfg, dm), lambda k: (_data(kind, cfg, k),)
    )


# -- driver -----------------------------------------------------------------------------------


def run(size: str = "full", pool=None) -> dict:
    cfg = SIZES[size]

    def memory(pool, per_rank):
        return {f"{k}/{v}": C.on_ranks(pool, mem_task, cfg, k, v) for k in MODELS for v in VARIANTS}

    per_rank, res, mem = C.time_then_memory(time_task, SIZES, size, pool, memory)
    res["times"], res["median"] = C.slowest_rank_medians([r["times"] for r in per_rank])
    res["losses"] = C.mean_losses(per_rank)  # mean over ranks, per step
    res["wire"] = per_rank[0]["wire"]
    res["mem"] = {
        key: {
            "peak": max(r["peak"] for r in rs),
            "before": max(r["before"] for r in rs),
            "reset_ok": all(r["reset_ok"] for r in rs),
        }
        for key, rs in mem.items()
    }
    res["numel"] = {k: sum(p.numel() for p in _model(k, cfg).parameters()) for k in MODELS}
    med, peak = res["median"], {key: m["peak"] for key, m in res["mem"].items()}
    res["ratio"] = {
        f"{k}/{ours}": {
            "time": med[f"{k}/{ours}"] / med[f"{k}/{theirs}"],
            "mem": peak[f"{k}/{ours}"] / peak[f"{k}/{theirs}"],
            "loss": max(
                abs(a - b) / abs(b)
                for a, b in zip(res["losses"][f"{k}/{ours}"], res["losses"][f"{k}/{theirs}"])
            ),
        }
        for k in MODELS
        for ours, theirs in PAIRS.items()
    }
    r, w = res["ratio"], res["wire"]
    # bytes per all-gathered element (the wire dtype's size; fh all-gathers the forward's
    # last unit once less than FSDP2, so totals differ by that unit)
    gather = lambda key: w[key]["bytes"].get("all_gather", 0) / w[key]["gathered"]  # noqa: E731
    reduce_dtypes = {
        d for op in ("reduce_scatter", "all_reduce") for d in w["llama/fh_bf16"]["dtypes"][op]
    }
    res["goals"] = {
        "llama fh (recompute=False) step time <= 0.9x fsdp2": (r["llama/fh"]["time"], 0.9),
        "llama fh (recompute=False) step time <= 1.0x fsdp2": (r["llama/fh"]["time"], 1.0),
        "llama fh (recompute=False) peak memory <= 1.1x fsdp2": (r["llama/fh"]["mem"], 1.1),
        "llama fh_recompute step time <= 0.95x fsdp2_ac": (r["llama/fh_recompute"]["time"], 0.95),
        "llama fh_recompute peak memory <= 1.0x fsdp2_ac": (r["llama/fh_recompute"]["mem"], 1.0),
        "llama fh_bf16 step time <= 0.9x fsdp2_bf16": (r["llama/fh_bf16"]["time"], 0.9),
        "llama fh_bf16 all-gather bytes per element = fsdp2_bf16's": (
            gather("llama/fh_bf16") / gather("llama/fsdp2_bf16"),
            1.0,
        ),
    }
    res["reduce_dtypes_bf16"] = sorted(reduce_dtypes)
    return res


def report(res: dict, command: str, when: str) -> str:
    cfg = res["cfg"]
    lines = [
        C.section_header(
            "(B13) Existing modules: fh.shard_module + fh.functional_call versus FSDP2 "
            "(4 gloo processes, 2x2 mesh)",
            command,
            when,
        )
    ]
    ll, mlp = cfg["llama"], cfg["mlp"]
    lines.append(
        f"Models: `llama` = transformers `LlamaForCausalLM` (vocab {ll['V']}, hidden {ll['D']}, "
        f"{ll['L']} layers, {ll['heads']} heads, {res['numel']['llama']:,} parameters), batch "
        f"{ll['B']} x {ll['T']} tokens per microbatch, units = the decoder layers; `mlp` = "
        f"{mlp['L']} x (Linear({mlp['D']}, {mlp['D']}) + Tanh) ({res['numel']['mlp']:,} "
        f"parameters), batch {mlp['B']}, units = the blocks. M = {cfg['M']} microbatches, SGD "
        f"lr {LR}. Variants as in `bench/units/module.py`'s docstring. "
        + C.timing_note(cfg, f"all {len(MODELS) * len(VARIANTS)} variants")
        + " Memory: each variant in a fresh group of 4 ranks, glibc told to mmap allocations "
        ">= 64 KiB (`MALLOC_MMAP_THRESHOLD_=65536` / `mallopt`); *peak* = `VmHWM` of one step "
        "(after a warm-up step) minus the idle RSS before the variant was built (the "
        "model's modules imported before idle: a tiny model run once), max over "
        "ranks; *held* = RSS above idle just before the step. Wire: one untimed step per "
        "variant, input bytes per rank of each collective kind (fh: `comm_log`; FSDP2: every "
        "c10d collective seen by a dispatch mode)."
    )
    lines.append(
        f"\n1-minute load average (4 busy ranks make about 4): time {res['load']['time'][0]:.2f}"
        f" / {res['load']['time'][1]:.2f}, memory {res['load']['memory'][0]:.2f} / "
        f"{res['load']['memory'][1]:.2f}.\n"
    )
    for k in MODELS:
        rows = []
        for v in VARIANTS:
            key = f"{k}/{v}"
            wire = res["wire"][key]
            theirs = PAIRS.get(v)
            ratio = res["ratio"].get(key, {})
            rows.append(
                [
                    f"`{v}`",
                    _LABEL[v],
                    res["median"][key],
                    f"{ratio['time']:.2f} vs `{theirs}`" if theirs else "-",
                    C.mib(res["mem"][key]["peak"]),
                    C.mib(res["mem"][key]["before"]),
                    f"{ratio['mem']:.2f}" if theirs else "-",
                    ", ".join(
                        f"{op} {C.mib(b)} MiB {'/'.join(wire['dtypes'][op])}"
                        for op, b in sorted(wire["bytes"].items())
                    ),
                    f"{ratio['loss']:.1e}" if theirs else "-",
                ]
            )
        lines.append(f"\n**{k}**\n")
        lines.append(
            C.table(
                [
                    "variant",
                    "what",
                    "median step (s)",
                    "time ratio",
                    "peak above idle (MiB)",
                    "held (MiB)",
                    "memory ratio",
                    "per step on the wire (per rank)",
                    "max rel. loss diff vs its FSDP2",
                ],
                rows,
            )
        )
    lines.append("")
    for name, (value, goal) in res["goals"].items():
        met = value == goal if "bytes" in name else value <= goal
        lines.append(f"- {name}: {value:.2f} — **{'met' if met else 'not met'}**.")
    lines.append(
        f"- llama fh_bf16 reductions in: {', '.join(res['reduce_dtypes_bf16'])} (goal: float32)."
    )
    func = res["ratio"]["llama/fh_func"]
    lines.append(
        f"- The same fh step under torch.func.grad_and_value (`fh_func`): {func['time']:.2f}x "
        f"FSDP2's time, {func['mem']:.2f}x its memory; fh.grad_and_value frees the backward's "
        "saved tensors and intermediates outside the units as it goes, torch.func keeps them "
        "to the end of the backward."
    )
    lines.append(
        "- Glue for the Hugging Face model (the README's 'Your existing model' example): "
        "`shard_module`, `MainGrad`, the loss function and the loop with its optimizer step, "
        "15 lines."
    )
    return "\n".join(lines) + "\n"

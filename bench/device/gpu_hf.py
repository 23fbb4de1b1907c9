"""(B11, existing model) A Hugging Face Llama at world size 1: ``fh.shard_module`` +
``fh.functional_call(..., into=MainGrad)`` against FSDP2, with bf16 mixed precision.

The part of ``python -m bench gpu`` (:mod:`bench.device.gpu`) that runs the path users run on GPUs
with a model they did not write (README, "Your existing model"). A random-init
``transformers`` ``LlamaForCausalLM`` (sdpa attention, ``use_cache=False``, untied head; the
same initial weights in every variant), next-token loss through its own ``labels``, loss / M
per microbatch, SGD (lr ``LR``) on fp32 master weights. Every variant uses FSDP2's
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` or its autocast
equivalent:

- ``hf_plain_bf16``: the model alone under ``torch.autocast(bfloat16)``, ``loss.backward()``,
  ``torch.optim.SGD``: no library, no process group (the floor; autocast rounds other
  tensors than the policy, so its losses are close to, not equal to, the others').
- ``hf_fsdp2_bf16``: ``fully_shard(layer, mesh=dm, mp_policy=mp)`` per decoder layer and on
  the root, ``set_requires_all_reduce(last)``, ``torch.optim.SGD``,
  ``zero_grad(set_to_none=True)``. The reference.
- ``hf_fh_bf16``: ``fh.shard_module(model, spec, units=list(model.model.layers),
  mp_policy=mp)``, ``fh.MainGrad(tree_spec, like=shards)``, ``fh.functional_call(model,
  shards, (ids,), {"labels": ids}, into=mg)`` under ``fh.grad_and_value`` (the README's),
  ``fh.microbatches(ids, into=mg)``, ``mg.finish()``, SGD in place on the shards
  (``torch._foreach_add_``), ``mg.zero_grad()``.
- ``hf_fh_bf16_recompute``: ``hf_fh_bf16`` with ``recompute=True`` (per-unit activation
  checkpointing: one more forward of each decoder layer in backward).

``bench.device.gpu`` runs the phases (correctness here; time, syncs and memory with its own
helpers, as for the MLP). If ``transformers`` cannot be imported the phase is skipped with a
note and the rest of the benchmark runs.
"""

from __future__ import annotations

import copy
import gc

import optree
import torch

from .. import common as C

# CUDA: a TinyLlama-shaped model (hidden 2048, 32 heads, 4 key-value heads, MLP 5632, vocab
# 32000, untied) with 16 layers: 836M parameters (3.1 GiB fp32), M = 2 microbatches of 4 x 2048
# tokens, 82 TFLOP of matrix products per step (see flops() and bench/README.md, "On a GPU").
# CPU: 5M parameters, 25 GFLOP per step, about 0.3 s a step on one thread.
SIZES = {
    "tiny": {
        "cuda": {"V": 256, "D": 64, "I": 128, "L": 2, "heads": 4, "kv": 2, "T": 32, "B": 2,
                 "M": 2, "warmup": 1, "reps": 2},
        "cpu": {"V": 256, "D": 64, "I": 128, "L": 2, "heads": 4, "kv": 2, "T": 32, "B": 2,
                "M": 2, "warmup": 1, "reps": 2},
    },
    "full": {
        "cuda": {"V": 32000, "D": 2048, "I": 5632, "L": 16, "heads": 32, "kv": 4, "T": 2048,
                 "B": 4, "M": 2, "warmup": 3, "reps": 10},
        "cpu": {"V": 4096, "D": 256, "I": 688, "L": 4, "heads": 8, "kv": 4, "T": 128, "B": 4,
                "M": 2, "warmup": 2, "reps": 7},
    },
}  # fmt: skip
VARIANTS = ("hf_plain_bf16", "hf_fsdp2_bf16", "hf_fh_bf16", "hf_fh_bf16_recompute")
REFERENCE = "hf_fsdp2_bf16"
FH = ("hf_fh_bf16", "hf_fh_bf16_recompute")
LR = 0.05
CORRECT_STEPS = 3
DATASETS = 3  # distinct steps' data, cycled (all variants see the same sequence)
# bf16's unit roundoff (2^-8, relative): the library's variants run FSDP2's arithmetic, so
# their losses and weights must agree with FSDP2-bf16's within it (on the CPU they are equal)
TOLERANCE = 2.0**-8
# autocast rounds other tensors than the policy (norms and the residual stream stay fp32)
PLAIN_TOLERANCE = 2e-2

LABEL = {
    "hf_plain_bf16": "the model alone, torch.autocast(bf16), no library",
    "hf_fsdp2_bf16": "FSDP2 fully_shard per decoder layer + root, MixedPrecisionPolicy(bf16, fp32)",
    "hf_fh_bf16": "fh.shard_module + fh.functional_call(into=MainGrad), same policy",
    "hf_fh_bf16_recompute": "the same, recompute=True (per-layer activation checkpointing)",
}


def available() -> str | None:
    """None if ``transformers``' Llama can be imported, else why not."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure skips the phase, with its reason
        return f"{type(e).__name__}: {e}"
    return None


def _policy():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def flops(cfg: dict, recompute: bool = False) -> float:
    """Floating-point operations of one step's matrix products (forward + backward: 6 per
    weight and token; causal attention 6 T D per token and layer), plus the recomputed
    forward of the decoder layers with ``recompute``."""
    D, Dkv, L, T = cfg["D"], cfg["D"] * cfg["kv"] // cfg["heads"], cfg["L"], cfg["T"]
    layer = 2 * D * D + 2 * D * Dkv + 3 * D * cfg["I"]  # q, o; k, v; gate, up, down
    tokens = cfg["B"] * T * cfg["M"]
    per_token = 6 * (L * layer + D * cfg["V"]) + 6 * T * D * L  # + the untied head
    extra = 2 * L * layer + 2 * T * D * L if recompute else 0
    return float(tokens * (per_token + extra))


class Problem:
    """The initial model (seeded, on the device; never trained: each variant trains a copy)
    and the data: DATASETS steps of M microbatches of B x T token ids."""

    def __init__(self, cfg: dict, device: torch.device):
        from transformers import LlamaConfig, LlamaForCausalLM

        self.cfg, self.device, self.M = cfg, device, cfg["M"]
        config = LlamaConfig(
            vocab_size=cfg["V"],
            hidden_size=cfg["D"],
            intermediate_size=cfg["I"],
            num_hidden_layers=cfg["L"],
            num_attention_heads=cfg["heads"],
            num_key_value_heads=cfg["kv"],
            max_position_embeddings=cfg["T"],
            tie_word_embeddings=False,
            use_cache=False,
        )
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        with torch.device(device):
            self.base = LlamaForCausalLM(config)
        self.base.train()
        self.numel = sum(p.numel() for p in self.base.parameters())
        gen = torch.Generator(device=device).manual_seed(1234)
        self.ids = torch.randint(
            cfg["V"], (DATASETS, cfg["M"], cfg["B"], cfg["T"]), generator=gen, device=device
        )

    def model(self) -> torch.nn.Module:
        """A copy of the initial model, this variant's own."""
        return copy.deepcopy(self.base)

    def full(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.base.named_parameters()}

    def data(self, step: int) -> tuple[torch.Tensor]:
        """One step's ``(ids,)``: M x B x T token ids (the labels too)."""
        return (self.ids[step % DATASETS],)


# -- the variants (each: step(ids) -> the step's loss as a device tensor; full()) -------------


class _Plain:
    def __init__(self, pb: Problem, dm):
        self.M, self.device = pb.M, pb.device
        self.model = pb.model()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)

    def step(self, ids):
        total = 0.0
        for m in range(self.M):
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                loss = self.model(ids[m], labels=ids[m]).loss / self.M
            loss.backward()
            total = total + loss.detach()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return total

    def full(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.named_parameters()}


class _FSDP2:
    def __init__(self, pb: Problem, dm):
        from torch.distributed.fsdp import fully_shard

        self.M = pb.M
        model = pb.model()
        mp = _policy()
        for layer in model.model.layers:
            fully_shard(layer, mesh=dm, mp_policy=mp)
        fully_shard(model, mesh=dm, mp_policy=mp)
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step(self, ids):
        total = 0.0
        for m in range(self.M):
            self.model.set_requires_all_reduce(m == self.M - 1)
            loss = self.model(ids[m], labels=ids[m]).loss / self.M
            loss.backward()
            total = total + loss.detach()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return total

    def full(self) -> dict[str, torch.Tensor]:
        return {k: v.full_tensor().detach() for k, v in self.model.named_parameters()}


class _Fh:
    def __init__(self, pb: Problem, dm, recompute: bool):
        import functional_hsdp as fh

        self.fh, self.M = fh, pb.M
        model = pb.model()
        spec = fh.hsdp(fh.DistMesh(dm, issue_size_one=True), *C.AXES)
        self.shards, self.tree_spec = fh.shard_module(
            model, spec, units=list(model.model.layers), mp_policy=_policy()
        )
        self.leaves = optree.tree_leaves(self.shards)
        self.mg = mg = fh.MainGrad(self.tree_spec, like=self.shards)
        M = pb.M

        def loss_fn(shards, ids):
            out = fh.functional_call(
                model, shards, (ids,), {"labels": ids}, into=mg, recompute=recompute
            )
            return out.loss / M

        self.grad = fh.grad_and_value(loss_fn)

    def step(self, ids):
        fh, mg, total = self.fh, self.mg, 0.0
        for batch, _ in fh.microbatches(ids, into=mg):
            _, loss = self.grad(self.shards, batch)
            total = total + loss.detach()
        mg.finish()
        with torch.no_grad():  # in place, one fused op, as torch.optim's foreach SGD
            torch._foreach_add_(self.leaves, optree.tree_leaves(mg.grads), alpha=-LR)
        mg.zero_grad()
        return total

    def full(self) -> dict[str, torch.Tensor]:
        full = self.fh.gather(self.shards, self.tree_spec)
        return {(f"{u}.{n}" if u else n): v for u, sub in full.items() for n, v in sub.items()}


def build(name: str, pb: Problem, dm):
    if name == "hf_plain_bf16":
        return _Plain(pb, dm)
    if name == "hf_fsdp2_bf16":
        return _FSDP2(pb, dm)
    if name in FH:
        return _Fh(pb, dm, recompute=name == "hf_fh_bf16_recompute")
    raise ValueError(name)


# -- correctness ------------------------------------------------------------------------------


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def correctness(pb: Problem, dm) -> dict:
    """Each variant CORRECT_STEPS steps from the same weights on the same data, against
    FSDP2-bf16: per-step losses (max relative difference), the weights after the steps and
    the update they made (``after - before``), worst leaf, relative L2 error."""
    before = {k: v.float() for k, v in pb.full().items()}
    out: dict = {"losses": {}, "vs_reference": {}}
    ref_w = None
    for v in (REFERENCE, *(x for x in VARIANTS if x != REFERENCE)):
        runner = build(v, pb, dm)
        out["losses"][v] = [float(runner.step(*pb.data(s))) for s in range(CORRECT_STEPS)]
        w = {k: t.detach().float().clone() for k, t in runner.full().items()}
        del runner
        gc.collect()
        if v == REFERENCE:
            ref_w = w
            continue
        assert w.keys() == ref_w.keys(), (v, sorted(w.keys() ^ ref_w.keys()))
        want = out["losses"][REFERENCE]
        out["vs_reference"][v] = {
            "loss": max(abs(a - b) / abs(b) for a, b in zip(out["losses"][v], want)),
            "weights": max(_rel(w[k], ref_w[k]) for k in w),
            "update": max(_rel(w[k] - before[k], ref_w[k] - before[k]) for k in w),
        }
        del w
    out["ok"] = all(
        c["loss"] <= TOLERANCE and c["weights"] <= TOLERANCE
        for v, c in out["vs_reference"].items()
        if v in FH
    )
    return out


# -- report -----------------------------------------------------------------------------------


def collectives_text(counts: dict[str, int]) -> str:
    """``12 (RS 4, AR 4, AG 4)``, or ``n/a`` for a variant the library does not run."""
    if not counts:
        return "n/a"
    short = {"reduce_scatter": "RS", "all_reduce": "AR", "all_gather": "AG", "all_to_all": "A2A"}
    parts = ", ".join(f"{short[op]} {n}" for op, n in sorted(counts.items()))
    return f"{sum(counts.values())} ({parts})"


def report_lines(hf: dict, cuda: bool) -> list[str]:
    """The section's part for the Llama (its own tables)."""
    lines = ["\n### A Hugging Face Llama: shard_module + functional_call versus FSDP2, bf16\n"]
    if hf.get("skipped"):
        lines.append(
            f"Skipped: `transformers` could not be imported ({hf['skipped']}); the MLP "
            'figures above ran. Install it (`pip install -e ".[test]"`) for this part.\n'
        )
        return lines
    cfg = hf["cfg"]
    fl, flr = flops(cfg), flops(cfg, recompute=True)
    lines.append(
        f"Model: `LlamaForCausalLM`, random init (seeded), vocab {cfg['V']:,}, hidden "
        f"{cfg['D']}, MLP {cfg['I']}, {cfg['L']} decoder layers, {cfg['heads']} heads "
        f"({cfg['kv']} key-value), untied head, sdpa attention, `use_cache=False`: "
        f"{hf['numel']:,} parameters, fp32 master weights ({C.mib(4 * hf['numel'])} MiB). "
        f"M = {cfg['M']} microbatches of {cfg['B']} x {cfg['T']} tokens (random ids, the "
        f"labels too); loss / M; SGD lr {LR}; `MixedPrecisionPolicy(param_dtype=bfloat16, "
        "reduce_dtype=float32)` (bf16 compute, fp32 gradients). Matrix products per step "
        f"{fl / 1e12:.3g} TFLOP ({flr / 1e12:.3g} with the recomputed forward); *model "
        "TFLOP/s* divides the former by the step time, for every variant. "
        f"{cfg['warmup']} warm-up and {cfg['reps']} timed steps per variant, interleaved, "
        "timed as above; median"
        + (
            "; syncs, *peak above idle* and *held* as above (idle: with the initial model "
            "and the data)"
            if cuda
            else ""
        )
        + ".\n"
    )
    lines.append(
        "\n".join(f"- `{v}`: {LABEL[v]}." for v in VARIANTS)
        + "\n- bench/device/gpu_hf.py has the exact loops.\n"
    )
    med, enq = hf["median"], hf["median_enqueue"]
    mem, syncs = hf.get("memory", {}), hf.get("syncs", {})
    rows = []
    for v in VARIANTS:
        rows.append(
            [
                f"`{v}`",
                f"{1e3 * med[v]:.1f}",
                f"{med[v] / med[REFERENCE]:.2f}",
                f"{med[v] / med['hf_plain_bf16']:.2f}",
                f"{fl / med[v] / 1e12:.3g}",
                f"{1e3 * enq[v]:.1f}" if cuda else "= step",
                f"{enq[v] / med[v]:.2f}" if cuda else "n/a",
                C.mib(mem[v]["peak"]) if v in mem else "n/a",
                C.mib(mem[v]["held"]) if v in mem else "n/a",
                str(syncs[v][0]) if v in syncs else "n/a",
                collectives_text(hf["collectives"][v]),
                f"{hf['loss_maxrel'][v]:.1e}",
            ]
        )
    lines.append(
        C.table(
            [
                "variant",
                "step (ms)",
                "/ fsdp2_bf16",
                "/ plain_bf16",
                "model TFLOP/s",
                "enqueue (ms)",
                "enqueue / step",
                "peak above idle (MiB)",
                "held between steps (MiB)",
                "syncs per step",
                "collectives per step",
                "loss max rel. diff vs fsdp2_bf16",
            ],
            rows,
        )
    )
    c = hf["correct"]
    crow = [
        [
            f"`{v}`",
            ", ".join(f"{x:.6g}" for x in c["losses"][v]),
            f"{r['loss']:.1e}",
            f"{r['weights']:.1e}",
            f"{r['update']:.1e}",
        ]
        for v, r in c["vs_reference"].items()
    ]
    crow.insert(
        0, [f"`{REFERENCE}`", ", ".join(f"{x:.6g}" for x in c["losses"][REFERENCE]), "-", "-", "-"]
    )
    lines.append(
        f"\n**Correctness** against `{REFERENCE}`: {CORRECT_STEPS} steps of each variant from "
        "the same weights on the same data; losses per step, their max relative difference, "
        "and after the steps the weights and the update they made (`after - before`), worst "
        "leaf, relative L2 error:\n"
    )
    lines.append(
        C.table(
            [
                "variant",
                "losses",
                "losses: max rel. diff",
                "weights: rel. error",
                "update: rel. error",
            ],
            crow,
        )
    )
    fh_ok = "yes" if c["ok"] else "no"
    lines.append(
        f"\n- The library's variants (`{'`, `'.join(FH)}`) train as FSDP2-bf16 does, losses and "
        f"weights within bf16's unit roundoff ({TOLERANCE:.1e}, relative): **{fh_ok}**. "
        f"(`hf_plain_bf16` runs autocast, which rounds other tensors: within "
        f"{PLAIN_TOLERANCE:g} is expected of it, not equality.)"
    )
    if cuda:
        lib = {v: syncs[v][0] for v in FH}
        lines.append(
            "- Host-device synchronizations per step of the library's variants (goal 0): "
            + ", ".join(f"`{v}` {n}" for v, n in lib.items())
            + f" — **{'met' if not any(lib.values()) else 'not met'}**; the model alone "
            f"{syncs['hf_plain_bf16'][0]}, FSDP2 {syncs[REFERENCE][0]}."
        )
        for v in VARIANTS:
            if syncs[v][1]:
                lines.append(f"  - `{v}`: from {', '.join(syncs[v][1])}")
    lines.append(
        "- Time per phase (s): "
        + ", ".join(f"{k} {v:.0f}" for k, v in hf["phase_s"].items())
        + " (the model is built and copied inside)."
    )
    return lines

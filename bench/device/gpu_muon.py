"""(B11, matrix optimizers) Muon at world size 1: ``fh.muon`` on the owner placement against
``torch.optim.Muon`` + ``torch.optim.AdamW``, and ``fh.adamw``'s step beside it.

The part of ``python -m bench gpu`` (:mod:`bench.device.gpu`) that runs the matrix-optimizer path
(README, "Matrix optimizers") on the device: B16's loop (``bench/optim/muon.py``) on one rank. An
MLP of L x (Linear(D, D) + Tanh) blocks (each block one unit), MSE loss / M per microbatch; the
Linear weights take Muon (lr ``MUON_LR``, torch's other defaults, Newton-Schulz in bf16 as torch's),
the biases AdamW (lr ``LR``, weight decay ``WEIGHT_DECAY``). The same initial weights and data in
every variant:

- ``muon_torch``: the model alone, ``loss.backward()``, ``torch.optim.Muon`` (weights) +
  ``torch.optim.AdamW`` (biases), ``zero_grad(set_to_none=True)``: no library. The reference.
- ``adamw_torch``: the same with ``torch.optim.AdamW`` on every parameter (``adamw_fh``'s
  reference).
- ``adamw_fh``: ``fh.shard_module(model, hsdp, units=blocks)``, ``fh.MainGrad``,
  ``fh.functional_call(..., into=mg)`` under ``fh.grad_and_value``, ``mg.finish()``,
  ``fh.adamw`` on every leaf, applied in place (``torch._foreach_add_``). B16's ``adamw``.
- ``muon_fh``: the units under ``fh.owned(hsdp)``, ``fh.partition`` of ``fh.muon`` (2-D
  weights) and ``fh.adamw`` (the rest); the forward's shards are ``fh.sync_params(main)``.
  B16's ``muon``.
- ``muon_fh_outer``: the same under ``fh.owned(hsdp, "dp_outer")``. B16's ``muon_outer``.

On one rank every matrix is orthogonalized here, so the step ratio to ``adamw_fh`` is the
n = 1 case of B16's goal (each of n ranks does 1/n of it). The *Newton-Schulz* phase times
every Newton-Schulz call of a step (``fh.newton_schulz``, torch's
``_zeropower_via_newtonschulz``): CUDA events around each call, summed after the step (on the
CPU ``perf_counter``). From those two figures the report gives the arithmetic for n ranks
(each doing 1/n of the Newton-Schulz work, the rest of the step unchanged), labelled as such:
not a measurement of n ranks.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import time

import optree
import torch
import torch.nn.functional as F

from .. import common as C

# The model and data sizes are bench/device/gpu.py's MLP (CUDA: 8 x Linear(4096), fp32, 537 MB of
# weights; Newton-Schulz of its 8 matrices is 5 x 3 bf16 products of 4096^3 each: 16.5 TFLOP
# per step. CPU: 8 x Linear(1024)); this part times fewer steps of it (full size only).
TIMING = {
    "tiny": {"cuda": {}, "cpu": {}},
    "full": {"cuda": {"warmup": 2, "reps": 7}, "cpu": {"warmup": 2, "reps": 5}},
}
VARIANTS = ("muon_torch", "adamw_torch", "adamw_fh", "muon_fh", "muon_fh_outer")
FH = ("adamw_fh", "muon_fh", "muon_fh_outer")
MUONS = ("muon_torch", "muon_fh", "muon_fh_outer")
# each variant's reference in the correctness phase (losses and weights)
REFERENCE = {
    "adamw_fh": "adamw_torch",
    "muon_fh": "muon_torch",
    "muon_fh_outer": "muon_torch",
}
BASELINE = "adamw_fh"  # the step the issue's ratio is taken against
LR, MUON_LR, WEIGHT_DECAY = 1e-3, 0.02, 0.01
CORRECT_STEPS = 3
DATASETS = 3  # distinct steps' data, cycled
# The same math in fp32 (Newton-Schulz in float32 on both sides; bench/device/gpu.py's tolerance):
# other summation orders only
TOLERANCE = 1e-4
RANKS = (4, 8)  # the arithmetic's world sizes

LABEL = {
    "muon_torch": "the model alone, torch.optim.Muon (weights) + AdamW (biases)",
    "adamw_torch": "the model alone, torch.optim.AdamW",
    "adamw_fh": "fh.shard_module(hsdp) + functional_call(into=MainGrad), fh.adamw",
    "muon_fh": "units under fh.owned(hsdp), fh.partition(fh.muon, fh.adamw)",
    "muon_fh_outer": "units under fh.owned(hsdp, 'dp_outer'), the same optimizers",
}


# -- the problem ------------------------------------------------------------------------------


class Problem:
    """The initial model (seeded, on the device; each variant trains a copy) and the data:
    DATASETS steps of M microbatches."""

    def __init__(self, cfg: dict, device: torch.device, M: int | None = None):
        self.cfg, self.device = cfg, device
        self.M = M = cfg["M"] if M is None else M
        D, L, B = cfg["D"], cfg["L"], cfg["B"]
        torch.manual_seed(0)
        with torch.device(device):
            blocks = [torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Tanh()) for _ in range(L)]
        self.base = torch.nn.Sequential(*blocks)
        gen = torch.Generator(device=device).manual_seed(1234)
        w = torch.randn(D, D, generator=gen, device=device) / D**0.5
        self.xs = torch.randn(DATASETS, M, B, D, generator=gen, device=device)
        self.ys = torch.sin(self.xs @ w)
        self.numel = sum(p.numel() for p in self.base.parameters())

    def model(self) -> torch.nn.Module:
        return copy.deepcopy(self.base)

    def full(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.base.named_parameters()}

    def data(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.xs[step % DATASETS], self.ys[step % DATASETS]


def _is_matrix(p: torch.Tensor) -> bool:
    return p.dim() == 2


# -- the variants (each: step(xs, ys) -> the step's loss as a device tensor; full()) ----------


class _Torch:
    def __init__(self, pb: Problem, muon: bool):
        self.M, self.model = pb.M, pb.model()
        params = list(self.model.parameters())
        if muon:
            self.opts = [
                torch.optim.Muon([p for p in params if _is_matrix(p)], lr=MUON_LR),
                torch.optim.AdamW(
                    [p for p in params if not _is_matrix(p)], lr=LR, weight_decay=WEIGHT_DECAY
                ),
            ]
        else:
            self.opts = [
                torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
            ]

    def step(self, xs, ys):
        total = 0.0
        for m in range(self.M):
            loss = F.mse_loss(self.model(xs[m]), ys[m]) / self.M
            loss.backward()
            total = total + loss.detach()
        for opt in self.opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return total

    def full(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.named_parameters()}


class _Fh:
    """B16's runner on one rank: ``owned`` None (adamw_fh), ``"all"`` or ``"dp_outer"``."""

    def __init__(self, pb: Problem, dm, owned: str | None, ns_dtype: torch.dtype):
        import functional_hsdp as fh

        self.fh, self.M, self.owned = fh, pb.M, owned
        model = pb.model()
        hsdp = fh.hsdp(fh.DistMesh(dm, issue_size_one=True), *C.AXES)
        spec = hsdp
        if owned is not None:
            unit = fh.owned(hsdp) if owned == "all" else fh.owned(hsdp, owned)
            spec = lambda m: hsdp if m is model else unit  # noqa: E731
        self.main, self.tree_spec = fh.shard_module(model, spec, units=list(model))
        self.leaves = optree.tree_leaves(self.main)
        self.mg = mg = fh.MainGrad(self.tree_spec, like=self.main)
        if owned is None:
            self.opt = fh.adamw(lr=LR, weight_decay=WEIGHT_DECAY)
        else:
            full = dict(model.named_parameters())  # the module's meta stand-ins: full shapes
            labels = {
                u: {n: "muon" if _is_matrix(full[f"{u}.{n}" if u else n]) else "adamw" for n in ps}
                for u, ps in self.main.items()
            }
            self.opt = fh.partition(
                {
                    "muon": fh.muon(self.tree_spec, lr=MUON_LR, ns_dtype=ns_dtype),
                    "adamw": fh.adamw(lr=LR, weight_decay=WEIGHT_DECAY),
                },
                labels,
            )
        self.state = self.opt.init(self.main)
        M = pb.M

        def loss_fn(shards, x, y):
            return F.mse_loss(fh.functional_call(model, shards, (x,), into=mg), y) / M

        self.grad = fh.grad_and_value(loss_fn)

    def step(self, xs, ys):
        fh, mg, total = self.fh, self.mg, 0.0
        shards = self.main if self.owned is None else fh.sync_params(self.main, self.tree_spec)
        for (x, y), _ in fh.microbatches(zip(xs, ys), into=mg):
            _, loss = self.grad(shards, x, y)
            total = total + loss.detach()
        del shards
        mg.finish()
        updates, self.state = self.opt.update(mg.grads, self.state, self.main)
        with torch.no_grad():
            torch._foreach_add_(self.leaves, optree.tree_leaves(updates))
        mg.zero_grad()
        return total

    def full(self) -> dict[str, torch.Tensor]:
        full = self.fh.gather(self.fh.sync_params(self.main, self.tree_spec), self.tree_spec)
        return {(f"{u}.{n}" if u else n): v for u, sub in full.items() for n, v in sub.items()}


def build(name: str, pb: Problem, dm, ns_dtype: torch.dtype = torch.bfloat16):
    """A variant; ``ns_dtype``: the library's Newton-Schulz dtype (torch's: under
    ``functional_hsdp.tools.testing.torch_muon_in``)."""
    if name in ("muon_torch", "adamw_torch"):
        return _Torch(pb, muon=name == "muon_torch")
    if name in FH:
        owned = {"adamw_fh": None, "muon_fh": "all", "muon_fh_outer": "dp_outer"}[name]
        return _Fh(pb, dm, owned, ns_dtype)
    raise ValueError(name)


# -- correctness ------------------------------------------------------------------------------


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def correctness(cfg: dict, device, dm) -> dict:
    """Per microbatch count (1 and M): every variant CORRECT_STEPS steps from the same weights
    on the same data, Newton-Schulz in float32 (the library's ``ns_dtype``; torch's through
    ``functional_hsdp.tools.testing.torch_muon_in``: in bf16, a gradient's last-bit difference,
    from another summation order, flips a bf16 rounding that the iteration amplifies, so the
    comparison would measure bf16, not the route); each fh variant against its torch
    reference: per-step losses (max relative difference), the weights after the steps and the
    update they made (``after - before``), worst leaf, relative L2 error."""
    from functional_hsdp.tools.testing import torch_muon_in

    out: dict = {}
    for M in sorted({1, cfg["M"]}):
        pb = Problem(cfg, device, M)
        before = {k: v.float().clone() for k, v in pb.full().items()}
        losses, weights = {}, {}
        for v in VARIANTS:
            runner = build(v, pb, dm, ns_dtype=torch.float32)
            with torch_muon_in(torch.float32):
                losses[v] = [float(runner.step(*pb.data(s))) for s in range(CORRECT_STEPS)]
            weights[v] = {k: t.detach().float().clone() for k, t in runner.full().items()}
            del runner
            gc.collect()
        case = {}
        for v, ref in REFERENCE.items():
            w, rw = weights[v], weights[ref]
            assert w.keys() == rw.keys(), (v, sorted(w.keys() ^ rw.keys()))
            case[v] = {
                "loss": max(abs(a - b) / abs(b) for a, b in zip(losses[v], losses[ref])),
                "weights": max(_rel(w[k], rw[k]) for k in w),
                "update": max(_rel(w[k] - before[k], rw[k] - before[k]) for k in w),
            }
        out[M] = case
        del pb, weights
    return out


# -- Newton-Schulz time -----------------------------------------------------------------------


@contextlib.contextmanager
def _ns_timer(device: torch.device, spans: list):
    """Every Newton-Schulz call inside (the library's and torch's Muon's) appends its
    ``(start, end)`` to ``spans``: CUDA events, or ``perf_counter`` seconds on the CPU."""
    import torch.optim._muon as torch_muon

    from functional_hsdp.optim import muon as muon_room

    seams = [(muon_room, "newton_schulz"), (torch_muon, "_zeropower_via_newtonschulz")]
    owns = [getattr(mod, name) for mod, name in seams]

    def timed(own):
        def call(*args, **kwargs):
            if device.type == "cuda":
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                out = own(*args, **kwargs)
                end.record()
                spans.append((start, end))
                return out
            t0 = time.perf_counter()
            out = own(*args, **kwargs)
            spans.append((t0, time.perf_counter()))
            return out

        return call

    for (mod, name), own in zip(seams, owns):
        setattr(mod, name, timed(own))
    try:
        yield
    finally:
        for (mod, name), own in zip(seams, owns):
            setattr(mod, name, own)


def newton_schulz_time(pb: Problem, dm, device, reps: int) -> dict:
    """Per Muon variant: Newton-Schulz seconds per step (median over ``reps`` steps after one
    warm-up step), and its calls per step."""
    out = {}
    for v in MUONS:
        runner = build(v, pb, dm)
        runner.step(*pb.data(0))
        per_step, calls = [], 0
        for rep in range(reps):
            spans: list = []
            with _ns_timer(device, spans):
                runner.step(*pb.data(rep + 1))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                per_step.append(sum(s.elapsed_time(e) for s, e in spans) / 1e3)
            else:
                per_step.append(sum(e - s for s, e in spans))
            calls = len(spans)
        out[v] = {"seconds": C.median(per_step), "calls": calls}
        del runner
        gc.collect()
    return out


# -- report -----------------------------------------------------------------------------------


def summarize(mu: dict) -> None:
    """Medians, losses against the reference and the step arithmetic, into ``mu``."""
    mu["median"] = {v: C.median(t) for v, t in mu["times"].items()}
    mu["median_enqueue"] = {v: C.median(t) for v, t in mu["enqueue"].items()}
    mu["loss_maxrel"] = {
        v: max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(mu["losses"][v], mu["losses"][r]))
        for v, r in REFERENCE.items()
    }
    mu["correct_ok"] = all(
        c["loss"] <= TOLERANCE and c["weights"] <= TOLERANCE
        for case in mu["correct"].values()
        for c in case.values()
    )
    base, ns = mu["median"][BASELINE], mu["ns"]
    mu["ratio"] = {}
    for v in ("muon_fh", "muon_fh_outer"):
        step, t_ns = mu["median"][v], ns[v]["seconds"]
        mu["ratio"][v] = {
            "measured": step / base,
            "ns_share": t_ns / step,
            **{n: (step - t_ns * (1 - 1 / n)) / base for n in RANKS},
        }


def report_lines(mu: dict, cuda: bool) -> list[str]:
    """The section's part for Muon (its own tables)."""
    cfg = mu["cfg"]
    lines = [
        "",
        "### Muon: fh.muon on the owner placement against torch.optim.Muon, and fh.adamw",
        "",
        f"`bench/device/gpu_muon.py`: {cfg['L']} x (Linear({cfg['D']}, {cfg['D']}) + Tanh) blocks "
        f"({mu['numel']:,} parameters, fp32), each block a unit; M = {cfg['M']} microbatches of "
        f"{cfg['B']} x {cfg['D']}, MSE loss / M; Muon (lr {MUON_LR}, torch's other defaults, "
        f"Newton-Schulz in bf16) on the Linear weights, AdamW (lr {LR}, weight decay "
        f"{WEIGHT_DECAY}) on the biases (`adamw_*`: AdamW on every parameter). Same process "
        f"group and (1, 1) mesh as above, `issue_size_one=True`. {cfg['warmup']} warm-up and "
        f"{cfg['reps']} timed steps per variant, interleaved; median. *Newton-Schulz*: the time "
        "of every Newton-Schulz call in a step (CUDA events around each, summed; on the CPU "
        "`perf_counter`), median of the timed steps.",
        "",
    ]
    med, enq = mu["median"], mu["median_enqueue"]
    mem, syncs, ns = mu.get("memory", {}), mu.get("syncs", {}), mu["ns"]
    from .gpu_hf import collectives_text

    rows = []
    for v in VARIANTS:
        rows.append(
            [
                f"`{v}`",
                LABEL[v],
                f"{1e3 * med[v]:.1f}",
                f"{med[v] / med[BASELINE]:.2f}",
                f"{1e3 * ns[v]['seconds']:.1f} ({ns[v]['calls']} calls)" if v in ns else "-",
                f"{1e3 * enq[v]:.1f}" if cuda else "= step",
                C.mib(mem[v]["peak"]) if v in mem else "n/a",
                C.mib(mem[v]["held"]) if v in mem else "n/a",
                str(syncs[v][0]) if v in syncs else "n/a",
                collectives_text(mu["collectives"][v]),
                f"{mu['loss_maxrel'][v]:.1e}" if v in REFERENCE else "-",
            ]
        )
    lines.append(
        C.table(
            [
                "variant",
                "what",
                "step (ms)",
                f"/ {BASELINE}",
                "Newton-Schulz (ms per step)",
                "enqueue (ms)",
                "peak above idle (MiB)",
                "held between steps (MiB)",
                "syncs per step",
                "collectives per step",
                "loss max rel. diff vs its torch reference",
            ],
            rows,
        )
    )
    crow = [
        [str(M), f"`{v}`", f"`{REFERENCE[v]}`", f"{c['weights']:.1e}", f"{c['update']:.1e}",
         f"{c['loss']:.1e}"]
        for M, case in mu["correct"].items()
        for v, c in case.items()
    ]  # fmt: skip
    lines += [
        f"\n**Correctness**: {CORRECT_STEPS} steps from the same weights with 1 and with M "
        "microbatches, Newton-Schulz in float32 on both sides (in bf16 a gradient's last-bit "
        "difference flips a rounding that the iteration amplifies), each library variant "
        "against its torch reference (worst leaf, relative L2 error of the weights and of the "
        "update they made; tolerance "
        f"{TOLERANCE:g} on weights and losses):\n",
        C.table(["M", "variant", "reference", "weights", "update", "losses: max rel. diff"], crow),
        "",
        f"- fh.muon and fh.adamw train as torch's optimizers within {TOLERANCE:g}: "
        f"**{'yes' if mu['correct_ok'] else 'no'}**.",
    ]
    for v, r in mu["ratio"].items():
        arith = ", ".join(f"n = {n}: {r[n]:.2f}x" for n in RANKS)
        lines.append(
            f"- `{v}`: step {r['measured']:.2f}x `{BASELINE}`'s at world size 1, where it "
            f"orthogonalizes every matrix (Newton-Schulz {100 * r['ns_share']:.0f} % of its "
            f"step). Arithmetic, not a measurement: with each of n ranks doing 1/n of the "
            f"Newton-Schulz work and the rest of the step as here, {arith} (B16's goal on 4 "
            "ranks: 1.15x; the dp_outer bytes of the cheap route are AdamW's, the dp_inner "
            "all-to-all pair is not in this arithmetic)."
        )
    if cuda:
        lib = {v: syncs[v][0] for v in FH if v in syncs}
        lines.append(
            "- Host-device synchronizations per step (goal 0): "
            + ", ".join(f"`{v}` {n}" for v, n in lib.items())
            + f" — **{'met' if not any(lib.values()) else 'not met'}**."
        )
        for v in VARIANTS:
            if v in syncs and syncs[v][1]:
                lines.append(f"  - `{v}`: from {', '.join(syncs[v][1])}")
    lines.append(
        "- Time per phase (s): " + ", ".join(f"{k} {v:.0f}" for k, v in mu["phase_s"].items()) + "."
    )
    return lines

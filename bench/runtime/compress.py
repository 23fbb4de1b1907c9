"""(B19) Compressed outer reductions: HSDP with ``outer_compress`` (bf16, fp8 e4m3, int8, int4;
each with and without error feedback) versus the uncompressed fp32 outer all-reduce, on B18's
language model and data (``bench/diloco/diloco.py``: a small transformers ``LlamaForCausalLM``
on the Python stdlib's ``.py`` files as byte tokens, the first 90 % for training, the last 10 % held
out) through ``fh.shard_module`` + ``fh.functional_call(into=MainGrad)``.

4 gloo processes, 2x2 mesh (dp_outer, dp_inner). Units = the decoder layers, M microbatches
declared (``fh.microbatches(..., into=mg)``: each unit's compressed outer reduction issued
from its backward), ``mg.finish()``, ``fh.adamw`` (B18's HSDP optimizer, the same constant
learning rate for every variant) on the shards, ``mg.zero_grad()`` (the residual stays).
Every variant is built in one group from the same weights and trains on the same tokens (each
rank draws its own batches of the training bytes, once per step, fed to every variant), steps
interleaved (one step of each in turn), so step times compare on a noisy machine.

Reported per variant: bytes each rank sends over dp_outer per step (``CommLog.sent_bytes``:
ring all-reduce 2(n-1)/n of its input, all-gather n-1 times, an all-to-all what it sends),
the eval loss on fixed held-out batches (each rank its own, the mean over the ranks) every
``eval_every`` steps and after the last step (the curves plotted into ``bench/compress.png``),
the median step time (the slowest rank), the step's peak RSS above the RSS before it
(``VmHWM``, one step), and the codec's share: the seconds spent in the compressed reduction's
local work (quantize, dequantize and the fp32 sum: ``compressed._Legs``' items, timed by a
seam) over one step, against the same step's outer collectives. A second, isolated measure:
one compressed_all_reduce of a large flat bucket (``isolated_numel``: B13's full Llama's
gradient shard, 2,491,520 elements), its codec time against the whole call and against a
plain fp32 all-reduce of the same bucket (fh.psum).

DiLoCo (``fh.diloco(..., compress=)``: the pseudo-gradient compressed) on B18's language model
and data (``bench/diloco/diloco.py``: a Llama on the stdlib's ``.py`` bytes, inner ``fh.adamw``,
outer ``fh.sgd(0.7, 0.9, nesterov)``, every H = 5 steps) through ``shard_module`` +
``functional_call(into=MainGrad)``, 2x2 gloo: uncompressed against int8, fp8 and int4 with
error feedback, variants interleaved step by step on the same tokens. Reported: bytes each
rank sends over dp_outer per step (``CommLog.sent_bytes``, mean over the steps and ranks),
the eval loss on fixed held-out bytes after the last step (mean of the two replicas; the
training loss per step in the plot's third panel), and the residual each rank keeps.
"""

from __future__ import annotations

import contextlib
import gc
import time

import optree
import torch

from .. import common as C
from ..diloco import diloco as B18

SIZES = {
    "tiny": {
        "hsdp": dict(steps=2, M=2, seq=16, batch=2, hidden=32, layers=1, eval_batches=1,
                     eval_every=1, lr=3e-3, data_mb=0.2),
        "isolated_numel": 4096,
        "diloco": dict(
            steps=4, every=2, seq=32, batch=2, hidden=32, layers=1, eval_batches=2, data_mb=0.2
        ),
    },
    "full": {
        # B18's model and data (its full Llama); 300 steps of the nine variants: about 5 minutes
        "hsdp": dict(steps=300, M=2, seq=64, batch=4, hidden=64, layers=2, eval_batches=8,
                     eval_every=25, lr=3e-3, data_mb=4.0),
        "isolated_numel": 2_491_520,  # B13's full Llama's gradient shard: a large flat bucket
        # B18's model and data; about a minute for the four DiLoCo variants (7 s per 30 steps)
        "diloco": dict(
            steps=250, every=5, seq=64, batch=4, hidden=64, layers=2, eval_batches=8, data_mb=4.0
        ),
    },
}  # fmt: skip
FORMATS = ("bf16", "fp8", "int8", "int4")
VARIANTS = ("none", *(f"{f}{ef}" for f in FORMATS for ef in ("+ef", "-ef")))
PNG = "bench/compress.png"
DILOCO = ("none", "int8+ef", "fp8+ef", "int4+ef")


def _policy(variant: str):
    import functional_hsdp as fh

    if variant == "none":
        return None
    name, ef = variant[:-3], variant.endswith("+ef")
    dtype = {
        "bf16": torch.bfloat16,
        "fp8": torch.float8_e4m3fn,
        "int8": torch.int8,
        "int4": "int4",
    }[name]
    return fh.compress(dtype, error_feedback=ef)


class _Run:
    """One variant: B18's Llama, its shards, MainGrad, AdamW; ``step(batches)`` returns the
    mean training loss of the step's microbatches."""

    def __init__(self, variant: str, cfg: dict, dm):
        import functional_hsdp as fh

        self.cfg = cfg
        self.model = B18._model(cfg)
        spec = fh.hsdp(fh.DistMesh(dm), *C.AXES, outer_compress=_policy(variant))
        units = list(self.model.model.layers)
        self.shards, self.tree_spec = fh.shard_module(self.model, spec, units=units)
        self.mg = fh.MainGrad(self.tree_spec, like=self.shards)
        self.leaves = optree.tree_leaves(self.shards)
        self.opt = fh.adamw(lr=cfg["lr"], weight_decay=0.0)
        self.opt_state = self.opt.init(self.shards)

    def _logits(self, ids, into):
        import functional_hsdp as fh

        return fh.functional_call(self.model, self.shards, (ids,), into=into).logits

    def step(self, batches) -> float:
        import functional_hsdp as fh

        mg, M = self.mg, len(batches)
        total = 0.0
        loss = lambda s, ids: B18._loss(self._logits(ids, mg), ids) / M  # noqa: E731
        for ids, _last in fh.microbatches(batches, into=mg):
            _, value = fh.grad_and_value(loss)(self.shards, ids)
            total += float(value)
        mg.finish()
        updates, self.opt_state = self.opt.update(mg.grads, self.opt_state, self.shards)
        with torch.no_grad():
            torch._foreach_add_(self.leaves, optree.tree_leaves(updates))
        del updates
        mg.zero_grad()
        return total

    @torch.no_grad()
    def eval_loss(self, batches) -> float:
        return sum(float(B18._loss(self._logits(b, None), b)) for b in batches) / len(batches)


# -- the codec's time: a seam on the compressed reduction's local items ------------------------

_CODEC = {"seconds": 0.0}


@contextlib.contextmanager
def _codec_timed():
    """Every local item of a compressed reduction (encode: residual + quantize; reduce:
    dequantize, fp32 sum, quantize; decode: dequantize) adds its time to ``_CODEC``."""
    from functional_hsdp.runtime import compressed

    own = {n: getattr(compressed._Legs, n) for n in ("encode", "reduce", "decode")}

    def timed(fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            _CODEC["seconds"] += time.perf_counter() - t0
            return out

        return wrapper

    for n, fn in own.items():
        setattr(compressed._Legs, n, timed(fn))
    try:
        yield
    finally:
        for n, fn in own.items():
            setattr(compressed._Legs, n, fn)


def _isolated(dm, numel: int, reps: int) -> dict:
    """One bucket of ``numel`` (one rank's gradient shard): compressed_all_reduce per format
    (its codec seconds and whole call) and a plain fp32 psum over dp_outer, medians."""
    import functional_hsdp as fh

    mesh = fh.DistMesh(dm)
    gen = torch.Generator().manual_seed(C.rank())
    x = torch.randn(numel, generator=gen)
    out = {"psum": [], **{f: {"call": [], "codec": []} for f in FORMATS}}
    for _ in range(reps):
        dt, _ = C.timed(lambda: fh.psum(x, "dp_outer", mesh))
        out["psum"].append(dt)
        for f in FORMATS:
            policy = _policy(f + "+ef")
            _CODEC["seconds"] = 0.0
            with _codec_timed():
                dt, _ = C.timed(
                    lambda p=policy: fh.compressed_all_reduce(x, "dp_outer", mesh, compress=p)
                )
            out[f]["call"].append(dt)
            out[f]["codec"].append(_CODEC["seconds"])
    return {
        "psum": C.median(out["psum"]),
        **{f: {k: C.median(v) for k, v in out[f].items()} for f in FORMATS},
    }


class _DiLoCo:
    """One DiLoCo variant on B18's Llama (``compress=`` the policy of ``variant``):
    ``step(ids)`` trains one inner step, then ``dl.update``; returns the loss and the bytes
    sent over dp_outer."""

    def __init__(self, variant: str, cfg: dict, dm):
        import functional_hsdp as fh

        self.model = B18._model(cfg)
        spec = fh.hsdp(fh.DistMesh(dm), *C.AXES)
        self.dl = fh.diloco(spec, axis="dp_outer", every=cfg["every"],
                            outer=fh.sgd(0.7, momentum=0.9, nesterov=True),
                            compress=_policy(variant))  # fmt: skip
        units = list(self.model.model.layers)
        self.shards, tree_spec = fh.shard_module(self.model, self.dl.inner, units=units)
        self.mg = fh.MainGrad(tree_spec, like=self.shards)
        self.opt = fh.adamw(lr=3e-3, weight_decay=0.0)
        self.opt_state, self.state = self.opt.init(self.shards), self.dl.init(self.shards)

    def step(self, ids) -> tuple[float, float]:
        import functional_hsdp as fh

        def loss_fn(s, ids):
            logits = fh.functional_call(self.model, s, (ids,), into=self.mg).logits
            return B18._loss(logits, ids)

        self.mg.begin_microbatch(last=True)
        _, value = fh.grad_and_value(loss_fn)(self.shards, ids)
        self.mg.finish()
        updates, self.opt_state = self.opt.update(self.mg.grads, self.opt_state, self.shards)
        leaves = optree.tree_leaves(self.shards)
        with torch.no_grad():
            torch._foreach_add_(leaves, optree.tree_leaves(updates))
        self.mg.zero_grad()
        with fh.comm_log() as log:
            new, self.state = self.dl.update(self.shards, self.state)
        with torch.no_grad():
            for p, q in zip(leaves, optree.tree_leaves(new)):
                if p is not q:
                    p.copy_(q)  # the units' shards stay the tensors shard_module made
        return float(value), log.sent_bytes("dp_outer", 2)

    @torch.no_grad()
    def eval_loss(self, batches) -> float:
        import functional_hsdp as fh

        losses = [
            B18._loss(fh.functional_call(self.model, self.shards, (b,)).logits, b) for b in batches
        ]
        return float(sum(losses)) / len(losses)

    def residual_bytes(self) -> int:
        leaves = optree.tree_leaves(self.state.residual)
        return sum(x.numel() * x.element_size() for x in leaves)


def _diloco_task(cfg: dict, dm) -> dict:
    """Every DiLoCo variant in one group, stepped in turn on the same batches."""
    text = B18._text(cfg["data_mb"])
    split = int(0.9 * len(text))
    train, held = text[:split], text[split:]
    eval_gen = torch.Generator().manual_seed(7)
    held_out = [B18._batch(held, eval_gen, cfg) for _ in range(cfg["eval_batches"])]
    gen = torch.Generator().manual_seed(1000 + C.rank())
    runs = {v: _DiLoCo(v, cfg, dm) for v in DILOCO}
    losses, sent, times = ({v: [] for v in DILOCO} for _ in range(3))
    for _ in range(cfg["steps"]):
        ids = B18._batch(train, gen, cfg)
        for v, run in runs.items():
            dt, (value, nbytes) = C.timed(lambda run=run, ids=ids: run.step(ids))
            losses[v].append(value)
            sent[v].append(nbytes)
            times[v].append(dt)
    return {
        "losses": losses,
        "sent": sent,
        "times": times,
        "eval": {v: run.eval_loss(held_out) for v, run in runs.items()},
        "residual": {v: run.residual_bytes() for v, run in runs.items()},
        "shard": sum(x.numel() * x.element_size() for x in optree.tree_leaves(runs["none"].shards)),
        "numel": sum(p.numel() for p in runs["none"].model.parameters()),
    }


def task(cfg: dict) -> dict:
    import functional_hsdp as fh

    dm = C.device_mesh((2, 2))
    hc = cfg["hsdp"]
    text = B18._text(hc["data_mb"])
    split = int(0.9 * len(text))
    train, held = text[:split], text[split:]
    eval_gen = torch.Generator().manual_seed(7 + C.rank())
    held_out = [B18._batch(held, eval_gen, hc) for _ in range(hc["eval_batches"])]
    gen = torch.Generator().manual_seed(1000 + C.rank())
    draw = lambda: [B18._batch(train, gen, hc) for _ in range(hc["M"])]  # noqa: E731
    runs = {v: _Run(v, hc, dm) for v in VARIANTS}
    gc.collect()
    losses = {v: [] for v in VARIANTS}
    times = {v: [] for v in VARIANTS}
    curve = {v: [(0, run.eval_loss(held_out))] for v, run in runs.items()}
    for step in range(1, hc["steps"] + 1):
        data = draw()
        for v, run in runs.items():
            dt, value = C.timed(lambda run=run, data=data: run.step(data))
            losses[v].append(value)
            times[v].append(dt)
        if step % hc["eval_every"] == 0 or step == hc["steps"]:
            for v, run in runs.items():
                curve[v].append((step, run.eval_loss(held_out)))
    evals = {v: curve[v][-1][1] for v in VARIANTS}
    # one more step each: bytes over dp_outer, the codec's seconds, the outer collectives'
    data = draw()
    wire, codec, peak = {}, {}, {}
    for v, run in runs.items():
        _CODEC["seconds"] = 0.0
        C.barrier()
        gc.collect()
        C.reset_peak()
        before = C.status("VmRSS")
        with fh.comm_log() as log, _codec_timed():
            run.step(data)
        peak[v] = C.status("VmHWM") - before
        wire[v] = {
            "outer": log.sent_bytes("dp_outer", 2),
            "inner": log.sent_bytes("dp_inner", 2),
            "ops": sorted(
                {
                    (e.op, str(e.dtype).removeprefix("torch."))
                    for e in log.events
                    if e.axis == "dp_outer"
                }
            ),
            "count": log.count(axis="dp_outer"),
        }
        codec[v] = _CODEC["seconds"]
    shard = sum(b.numel() for b in runs["none"].mg.buffers)
    isolated = _isolated(dm, cfg["isolated_numel"], 5 if hc["steps"] > 5 else 1)
    return {
        "losses": losses,
        "times": times,
        "curve": curve,
        "eval": evals,
        "wire": wire,
        "codec": codec,
        "peak": peak,
        "residual_bytes": {v: 0 if r.mg.residual is None else 4 * shard for v, r in runs.items()},
        "isolated": isolated,
        "shard": shard,
        "numel": sum(p.numel() for p in runs["none"].model.parameters()),
        "diloco": _diloco_task(cfg["diloco"], dm),
    }


def run(size: str = "full", pool=None) -> dict:
    per_rank, res = C.run_task(task, SIZES, size, pool)
    n = len(per_rank)
    res["losses"] = {
        v: [sum(x) / n for x in zip(*(r["losses"][v] for r in per_rank))] for v in VARIANTS
    }
    res["eval"] = {v: sum(r["eval"][v] for r in per_rank) / n for v in VARIANTS}
    res["curve"] = {
        v: [
            (pts[0][0], sum(p[1] for p in pts) / n)
            for pts in zip(*(r["curve"][v] for r in per_rank))
        ]
        for v in VARIANTS
    }
    # per step the slowest rank; the median over the steps after the first (a warm-up)
    slowest = {v: [max(x) for x in zip(*(r["times"][v] for r in per_rank))] for v in VARIANTS}
    res["step_s"] = {v: C.median(t[1:] or t) for v, t in slowest.items()}
    res["wire"] = per_rank[0]["wire"]
    res["codec"] = {v: max(r["codec"][v] for r in per_rank) for v in VARIANTS}
    res["peak"] = {v: max(r["peak"][v] for r in per_rank) for v in VARIANTS}
    res["isolated"] = {
        "psum": max(r["isolated"]["psum"] for r in per_rank),
        **{
            f: {k: max(r["isolated"][f][k] for r in per_rank) for k in ("call", "codec")}
            for f in FORMATS
        },
    }
    res["shard"], res["numel"] = per_rank[0]["shard"], per_rank[0]["numel"]
    res["residual_bytes"] = per_rank[0]["residual_bytes"]
    base = res["wire"]["none"]["outer"]
    res["ratio"] = {v: res["wire"][v]["outer"] / base for v in VARIANTS}
    none = res["eval"]["none"]
    res["loss_rel"] = {v: (res["eval"][v] - none) / none for v in VARIANTS}
    res["goals"] = {
        "bf16 outer bytes 0.50x": (res["ratio"]["bf16+ef"], 0.5),
        "fp8 outer bytes <= 0.26x": (res["ratio"]["fp8+ef"], 0.26),
        "int8 outer bytes <= 0.26x": (res["ratio"]["int8+ef"], 0.26),
        "int4 outer bytes <= 0.14x": (res["ratio"]["int4+ef"], 0.14),
        **{
            f"{v} eval loss within 1 % of none": (abs(res["loss_rel"][v]), 0.01)
            for v in ("bf16+ef", "fp8+ef", "int8+ef")
        },
        **{
            f"{f} codec <= 10 % of the compressed reduction (isolated)": (
                res["isolated"][f]["codec"] / res["isolated"][f]["call"],
                0.10,
            )
            for f in FORMATS
        },
    }
    res["diloco"] = _diloco_summary([r["diloco"] for r in per_rank])
    dl = res["diloco"]
    res["goals"].update(
        {
            **{
                f"DiLoCo {f} outer bytes <= 0.26x": (dl["ratio"][f"{f}+ef"], 0.26)
                for f in ("int8", "fp8")
            },
            "DiLoCo int4 outer bytes <= 0.14x": (dl["ratio"]["int4+ef"], 0.14),
            **{
                f"DiLoCo {v} eval loss within 1 % of none": (abs(dl["loss_rel"][v]), 0.01)
                for v in ("int8+ef", "fp8+ef")
            },
        }
    )
    if size == "full":
        _plot(res)
    return res


def _diloco_summary(per_rank: list[dict]) -> dict:
    """DiLoCo's figures over the ranks: bytes sent per step (mean over steps and ranks), eval
    loss (mean of the replicas: ranks 0 and 2), training loss per step (mean over ranks),
    median step time of the slowest rank."""
    n = len(per_rank)
    sent = {v: sum(sum(r["sent"][v]) / len(r["sent"][v]) for r in per_rank) / n for v in DILOCO}
    evals = {v: (per_rank[0]["eval"][v] + per_rank[2]["eval"][v]) / 2 for v in DILOCO}
    slowest = {v: [max(x) for x in zip(*(r["times"][v] for r in per_rank))] for v in DILOCO}
    return {
        "sent": sent,
        "ratio": {v: sent[v] / sent["none"] for v in DILOCO},
        "syncs": sum(1 for x in per_rank[0]["sent"]["none"] if x),
        "eval": evals,
        "loss_rel": {v: (evals[v] - evals["none"]) / evals["none"] for v in DILOCO},
        "losses": {
            v: [sum(x) / n for x in zip(*(r["losses"][v] for r in per_rank))] for v in DILOCO
        },
        "step_s": {v: C.median(t[1:] or t) for v, t in slowest.items()},
        "residual": per_rank[0]["residual"],
        "shard": per_rank[0]["shard"],
        "numel": per_rank[0]["numel"],
    }


def _plot(res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4))
    for v in VARIANTS:
        steps, vals = zip(*res["curve"][v])
        a.plot(steps, vals, label=v, lw=1, ls="-" if v == "none" or v.endswith("+ef") else "--")
    a.set_xlabel("step")
    a.set_ylabel("HSDP eval loss (held-out stdlib bytes)")
    a.legend(fontsize=7, ncol=2)
    rel = [100 * res["loss_rel"][v] for v in VARIANTS]
    b.bar(range(len(VARIANTS)), rel)
    b.axhline(1.0, color="r", lw=0.8, ls=":")
    b.axhline(-1.0, color="r", lw=0.8, ls=":")
    b.set_xticks(range(len(VARIANTS)), VARIANTS, rotation=45, fontsize=7)
    b.set_ylabel("final eval loss vs none, % (goal: within 1 %)")
    dl, k = res["diloco"], 10
    for v in DILOCO:  # a moving mean over k steps: per-step losses of one batch are noisy
        xs = dl["losses"][v]
        c.plot([sum(xs[i : i + k]) / k for i in range(len(xs) - k + 1)], label=v, lw=1)
    c.set_xlabel(f"inner step (mean of {k})")
    c.set_ylabel("DiLoCo H=5 training loss (stdlib bytes)")
    c.legend(fontsize=7)
    fig.suptitle(
        "B19: outer reduction compressed: HSDP, DiLoCo's pseudo-gradient "
        "(B18's Llama on the stdlib's bytes, 2x2 gloo)"
    )
    fig.tight_layout()
    fig.savefig(PNG, dpi=100)
    plt.close(fig)


def report(res: dict, command: str, when: str) -> str:
    hc = res["cfg"]["hsdp"]
    lines = [
        C.section_header(
            "(B19) Compressed outer reductions: HSDP with outer_compress on a Llama "
            "(4 gloo processes, 2x2 mesh)",
            command,
            when,
        ),
        "Model and data: B18's (`bench/diloco/diloco.py`): transformers `LlamaForCausalLM` "
        f"(hidden {hc['hidden']}, {hc['layers']} layers, vocab 256, {res['numel']:,} parameters) "
        f"on the Python stdlib's `.py` files as bytes (first 90 % train, last 10 % held out), "
        f"through `fh.shard_module` + `fh.functional_call(into=MainGrad)`, units = the decoder "
        f"layers, M={hc['M']} microbatches of {hc['batch']} x {hc['seq']} tokens per rank, "
        f"fh.adamw({hc['lr']:g}) (constant, the same for every variant), {hc['steps']} steps, "
        f"every variant the same tokens (steps interleaved); eval: {hc['eval_batches']} "
        f"held-out batches per rank (mean over the 4 ranks) every {hc['eval_every']} steps and "
        f"after the last; error feedback's blocks 256. One rank's gradient shard: "
        f"{res['shard']:,} elements. Plot: `{PNG}` (eval loss curves).\n",
    ]
    rows = []
    for v in VARIANTS:
        w = res["wire"][v]
        rows.append(
            [
                v,
                C.mib(w["outer"]),
                f"{res['ratio'][v]:.3f}",
                ", ".join(f"{op} {dt}" for op, dt in w["ops"]),
                f"{res['curve'][v][0][1]:.3f}",
                f"{res['eval'][v]:.4f}",
                f"{100 * res['loss_rel'][v]:+.2f} %",
                f"{1000 * res['step_s'][v]:.0f}",
                C.mib(res["peak"][v]),
                C.mib(res["residual_bytes"][v]),
                f"{1000 * res['codec'][v]:.1f}",
            ]
        )
    lines.append(
        C.table(
            [
                "variant",
                "dp_outer sent / step",
                "vs none",
                "dp_outer collectives",
                "eval loss at step 0",
                "eval loss after the last step",
                "vs none",
                "step ms (median)",
                "step peak RSS",
                "residual",
                "codec ms / step",
            ],
            rows,
        )
    )
    iso = res["isolated"]
    lines.append(
        f"\nIsolated, one flat bucket of {res['cfg']['isolated_numel']:,} fp32 elements (as "
        f"large as one rank's gradient shard of B13's full Llama) over dp_outer, median of the "
        f"slowest rank: plain fp32 all-reduce (`fh.psum`) "
        f"{1000 * iso['psum']:.2f} ms; compressed_all_reduce:\n"
    )
    lines.append(
        C.table(
            ["format", "call ms", "codec ms", "codec share of the call", "call vs fp32 psum"],
            [
                [
                    f,
                    f"{1000 * iso[f]['call']:.2f}",
                    f"{1000 * iso[f]['codec']:.2f}",
                    f"{100 * iso[f]['codec'] / iso[f]['call']:.0f} %",
                    f"{iso[f]['call'] / iso['psum']:.2f}x",
                ]
                for f in FORMATS
            ],
        )
    )
    lines.append(_diloco_report(res))
    lines.append("\nGoals:\n")
    for name, (got, goal) in res["goals"].items():
        ok = abs(got - goal) < 1e-3 if "0.50x" in name else got <= goal
        lines.append(f"- {name}: {got:.3f} -> {'met' if ok else 'NOT met'}")
    return "\n".join(lines) + "\n"


def _diloco_report(res: dict) -> str:
    dl, cfg = res["diloco"], res["cfg"]["diloco"]
    rows = [
        [
            v,
            f"{dl['sent'][v] / 1e3:.1f} kB",
            f"{dl['ratio'][v]:.3f}",
            f"{dl['eval'][v]:.4f}",
            f"{100 * dl['loss_rel'][v]:+.2f} %",
            f"{1000 * dl['step_s'][v]:.0f}",
            f"{dl['residual'][v] / 1e3:.1f} kB",
        ]
        for v in DILOCO
    ]
    head = (
        f"\nDiLoCo, the pseudo-gradient compressed (`fh.diloco(..., compress=)`), on B18's "
        f"model and data: Llama (hidden {cfg['hidden']}, {cfg['layers']} layers, vocab 256, "
        f"{dl['numel']:,} parameters) on the stdlib's `.py` bytes, {cfg['steps']} steps of "
        f"{cfg['batch']}x{cfg['seq']} tokens per rank (every variant the same tokens, steps "
        f"interleaved), inner fh.adamw(3e-3), outer fh.sgd(0.7, 0.9, nesterov), H = "
        f"{cfg['every']} ({dl['syncs']} syncs), every format with error feedback (block 256). "
        f"Bytes: what each rank sends over dp_outer per step, mean over the steps and ranks; "
        f"eval: {cfg['eval_batches']} held-out batches after the last step, mean of the two "
        f"replicas. One rank's shard: {dl['shard'] / 1e3:.1f} kB.\n"
    )
    return (
        head
        + "\n"
        + C.table(
            [
                f"DiLoCo H={cfg['every']}",
                "dp_outer sent / step",
                "vs none",
                "eval loss",
                "vs none",
                "step ms (median)",
                "residual per rank",
            ],
            rows,
        )
    )

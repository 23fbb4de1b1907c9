"""(B10) The per-call cross-rank agreement: what it costs.

Every library call takes part in one small summary over the whole mesh before its first
gradient collective (README, "Reliability"). 4 gloo processes, 2x2 mesh, ``hsdp``:

- **step**: the HSDP training step of (B1) (``gather``, ``grad``, ``MainGrad.accumulate``
  per microbatch, SGD) with the agreement on (the default) and with ``validation("off")``,
  interleaved; the cost is (on - off) / off. Goal: <= 2 %.
- **10,000 leaves**: ``reduce_grads(g, spec, last=True)`` on a tree of 10,000 small leaves,
  on and off; and the agreement alone (``agreement.agreement`` and its ``check``, with the
  call's cached fingerprint, waited at once).
- **the floor**: 1 + M agreements alone per step (a step makes 1 + M calls): what the
  agreement costs where nothing overlaps it. Beside it, one bare host all-gather of a row as
  long as the agreement's (a few int64, ``dist.all_gather`` on the default gloo group): what
  a protocol that gathers every rank's row pays at least.
- **scaling**: the per-call cost at 4, 8 and 16 gloo ranks (mesh 2 x n/2, ``hsdp``):
  ``reduce_grads(last=True)`` on a small tree, on and off, and the agreement alone
  (:mod:`bench.runtime.agreement_scaling`). Each world size runs in fresh ranks started by a fresh
  Python process whose ``functional_hsdp`` is a checkout's (a link to its package in an
  empty folder, the process's working directory). With ``BENCH_BASELINE=<checkout>`` in the
  environment, the same job measures that checkout's library first (the baseline), then
  this one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from functools import partial

import torch

from .. import common as C
from . import agreement_scaling as S

SIZES = {
    "tiny": {
        **{"D": 32, "L": 4, "B": 4, "M": 2, "leaves": 200, "warmup": 1, "reps": 2},
        **{"worlds": (4,), "scaling_warmup": 1, "scaling_reps": 2},
    },
    "full": {
        **{"D": 1024, "L": 8, "B": 32, "M": 4, "leaves": 10_000, "warmup": 2, "reps": 21},
        **{"worlds": (4, 8, 16), "scaling_warmup": 5, "scaling_reps": 101},
    },
}


def _step(fh, spec, params, mg, grad_fn, xs, ys, M):
    full = fh.gather(params, spec)
    for m, last in fh.microbatches(M):
        mg.accumulate(grad_fn(full, xs[m], ys[m]), last=last)
    mg.zero_grad()


def _bare_exchange(row: torch.Tensor, parts: list[torch.Tensor]) -> None:
    import torch.distributed as dist

    dist.all_gather(parts, row)


def task(cfg: dict) -> dict:
    from torch.func import functional_call, grad

    import functional_hsdp as fh
    from functional_hsdp.base.tree import flatten
    from functional_hsdp.plan.lookup import grads_plan
    from functional_hsdp.runtime import agreement
    from functional_hsdp.runtime.fingerprints import HEADER

    dm = C.device_mesh((2, 2))
    spec = fh.hsdp(fh.DistMesh(dm), *C.AXES)
    D, L, B, M = cfg["D"], cfg["L"], cfg["B"], cfg["M"]
    torch.manual_seed(0)
    layers = []
    for _ in range(L):
        layers += [torch.nn.Linear(D, D), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    full = {k: v.detach().clone() for k, v in model.named_parameters()}
    params, mg = fh.shard(full, spec), fh.MainGrad(spec, like=full)

    def loss(p, x, y):
        return torch.nn.functional.mse_loss(functional_call(model, p, (x,)), y) / M

    gen = torch.Generator().manual_seed(C.rank())
    xs = [torch.randn(B, D, generator=gen) for _ in range(M)]
    ys = [torch.randn(B, D, generator=gen) for _ in range(M)]
    step = partial(_step, fh, spec, params, mg, grad(loss), xs, ys, M)
    tree = {f"p{i:05d}": torch.randn(20) for i in range(cfg["leaves"])}
    call = partial(fh.reduce_grads, tree, spec, last=True)
    leaves, treedef, paths = flatten(tree, "grads")
    plan = grads_plan(leaves, treedef, paths, spec=spec, name="grads")
    row = torch.zeros(len(HEADER) + 5, dtype=torch.int64)  # the agreement's row
    bare = partial(_bare_exchange, row, [torch.empty_like(row) for _ in range(C.WORLD)])
    ops = {
        "step_on": step,
        "step_off": partial(S.validation_off, step),
        "tree_on": call,
        "tree_off": partial(S.validation_off, call),
        "agreement": partial(S.agreement_alone, agreement, spec, plan, paths),
        "bare": bare,
    }
    return C.interleaved(ops, cfg["warmup"], cfg["reps"])


def _scaling_of(checkout: str, size: str) -> dict:
    """The scaling part (``agreement_scaling.main``) in a fresh process whose
    ``functional_hsdp`` is ``checkout``'s: links to it and to ``agreement_scaling.py`` in an
    empty working directory, which Python puts first on ``sys.path`` (see that module)."""
    with tempfile.TemporaryDirectory(prefix="fh_agreement_") as tmp:
        links = {
            "functional_hsdp": os.path.join(os.path.abspath(checkout), "functional_hsdp"),
            "fh_agreement_scaling.py": os.path.abspath(S.__file__),
        }
        for name, target in links.items():
            os.symlink(target, os.path.join(tmp, name))
        out = os.path.join(tmp, "out.json")
        entry = "from fh_agreement_scaling import main; raise SystemExit(main())"
        cfg = json.dumps(SIZES[size])
        subprocess.run(
            [sys.executable, "-c", entry, "--cfg", cfg, "--out", out], cwd=tmp, check=True
        )
        with open(out) as f:
            medians = {int(n): m for n, m in json.load(f).items()}
    return {"checkout": checkout, "library": _commit(checkout), "medians": medians}


def _commit(checkout: str) -> str:
    git = ["git", "-C", checkout, "rev-parse", "--short", "HEAD"]
    try:
        head = subprocess.run(git, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    dirty = ["git", "-C", checkout, "status", "--porcelain", "functional_hsdp"]
    changed = subprocess.run(dirty, capture_output=True, text=True).stdout.strip()
    return head + (" with uncommitted changes" if changed else "")


def _scaling(size: str, pool) -> list[dict]:
    """The scaling part: with a pool (the smoke test), its 4 ranks only; else fresh ranks per
    world size, for ``$BENCH_BASELINE`` (if set) and then this checkout."""
    if pool is not None:
        per_rank = pool.run(S.task, SIZES[size])
        medians = {C.WORLD: C.slowest_rank_medians(per_rank)[1]}
        return [{"checkout": C.REPO_ROOT, "library": "this run's", "medians": medians}]
    baseline = os.environ.get("BENCH_BASELINE")
    runs = [_scaling_of(baseline, size)] if baseline else []
    return [*runs, _scaling_of(C.REPO_ROOT, size)]


def run(size: str = "full", pool=None) -> dict:
    per_rank, res = C.run_task(task, SIZES, size, pool)
    res["times"], res["median"] = C.slowest_rank_medians(per_rank)
    m = res["median"]
    res["step_cost"] = (m["step_on"] - m["step_off"]) / m["step_off"]
    # the spread: each repetition's on / off (the two ran back to back)
    res["step_ratios"] = [a / b for a, b in zip(res["times"]["step_on"], res["times"]["step_off"])]
    res["tree_cost_ms"] = 1e3 * (m["tree_on"] - m["tree_off"])
    # the floor: 1 + M agreements per step, none overlapped
    res["floor"] = (1 + res["cfg"]["M"]) * m["agreement"] / m["step_off"]
    res["scaling"] = _scaling(size, pool)
    return res


def report(res: dict, command: str, when: str) -> str:
    cfg, m = res["cfg"], res["median"]
    head = C.section_header("(B10) The per-call cross-rank agreement", command, when)
    desc = (
        f"hsdp on the 2x2 mesh. Step: (B1)'s HSDP step ({cfg['L']} x Linear({cfg['D']}) + "
        f"tanh, M={cfg['M']} microbatches of {cfg['B']}: `gather`, `grad`, "
        "`MainGrad.accumulate`, SGD; 1 + M library calls, each with its agreement) with the "
        'agreement on (the default) and `validation("off")`. Tree: `reduce_grads(last=True)` '
        f"on {cfg['leaves']} leaves of 20 fp32 elements; the agreement alone: "
        "`agreement.agreement` and its `check`, with the cached fingerprint, waited at once. "
        f"{C.timing_note(cfg, 'every operation')}\n"
    )
    t = C.table(
        ["", "agreement on (ms)", "off (ms)", "cost"],
        [
            [
                "HSDP step",
                _ms(m["step_on"]),
                _ms(m["step_off"]),
                f"{100 * res['step_cost']:+.1f} %",
            ],
            [
                f"reduce_grads, {cfg['leaves']} leaves",
                _ms(m["tree_on"]),
                _ms(m["tree_off"]),
                f"{res['tree_cost_ms']:+.2f} ms",
            ],
            ["the agreement alone", _ms(m["agreement"]), "", ""],
            ["one bare host all-gather of the row", _ms(m["bare"]), "", ""],
        ],
    )
    verdict = "met" if res["step_cost"] <= 0.02 else "not met"
    return (
        f"{head}\n{desc}\n{t}\n\nGoal (the agreement <= 2 % of an HSDP step): **{verdict}** "
        f"({100 * res['step_cost']:+.1f} %; a negative figure is noise: the two are within "
        "the run's spread). The spread: per repetition, step on / off = "
        f"{min(res['step_ratios']):.2f} to {max(res['step_ratios']):.2f} (median "
        f"{C.median(res['step_ratios']):.2f}). The floor where nothing overlaps the agreement: "
        f"1 + M = {1 + cfg['M']} agreements per step, {1 + cfg['M']} x "
        f"{_ms(m['agreement'])} ms = {100 * res['floor']:.1f} % of the step with the agreement "
        f"off.\n\n{_scaling_report(res['scaling'], cfg)}"
    )


def _ms(s: float) -> str:
    return f"{1e3 * s:.2f}"


def _scaling_report(runs: list[dict], cfg: dict) -> str:
    tree = f"{S.TREE['leaves']} leaves of {S.TREE['numel']} fp32 elements"
    names = [f"`{r['checkout']}` ({r['library']})" for r in runs]
    if len(runs) == 2:  # the first came from $BENCH_BASELINE
        names[0] += ", from `BENCH_BASELINE`"
    labels = ["baseline", "this checkout"][-len(runs) :] if len(runs) <= 2 else names
    rows = []
    for n in runs[-1]["medians"]:
        row = [f"{n} (2 x {n // 2})"]
        for key in ("agreement", "cost", "off"):
            for r in runs:
                m = r["medians"][n]
                row.append(_ms(m["on"] - m["off"] if key == "cost" else m[key]))
        rows.append(row)
    head = ["ranks (mesh)"] + [
        f"{what}, {label} (ms)"
        for what in ("agreement alone", "reduce_grads on - off", "reduce_grads off")
        for label in labels
    ]
    libraries = "; ".join(f"{label}: {name}" for label, name in zip(labels, names))
    return (
        "### Scaling with the number of ranks\n\nPer-call cost at each world size, fresh gloo "
        f"ranks on this machine, hsdp on a 2 x n/2 mesh: `reduce_grads(last=True)` on {tree} "
        'with the agreement on and `validation("off")`, and the agreement alone (as above). '
        f"{cfg['scaling_warmup']} warm-up and {cfg['scaling_reps']} timed repetitions, the "
        "three interleaved, each after a barrier; median of the slowest rank's time. "
        f"Libraries: {libraries}.\n\n{C.table(head, rows)}\n"
    )

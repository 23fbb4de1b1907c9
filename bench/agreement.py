"""(B10) The per-call cross-rank agreement: what it costs.

Every library call exchanges one small row over the whole mesh before its first gradient
collective (README, "Reliability"). 4 gloo processes, 2x2 mesh, ``hsdp``:

- **step**: the HSDP training step of (B1) (``gather``, ``grad``, ``MainGrad.accumulate``
  per microbatch, SGD) with the agreement on (the default) and with ``validation("off")``,
  interleaved; the cost is (on - off) / off. Goal: <= 2 %.
- **10,000 leaves**: ``reduce_grads(g, spec, last=True)`` on a tree of 10,000 small leaves,
  on and off; and the exchange alone (``validate.agree`` with the call's cached fingerprint).
- **the floor**: one bare host all-gather of a row as long as the agreement's (a few int64,
  ``dist.all_gather`` on the default gloo group, waited): what one exchange costs at least
  where nothing overlaps it. A step makes 1 + M calls.
"""

from __future__ import annotations

from functools import partial

import torch

from . import common as C

SIZES = {
    "tiny": {"D": 32, "L": 4, "B": 4, "M": 2, "leaves": 200, "warmup": 1, "reps": 2},
    "full": {"D": 1024, "L": 8, "B": 32, "M": 4, "leaves": 10_000, "warmup": 2, "reps": 21},
}


def _step(fh, spec, params, mg, grad_fn, xs, ys, M):
    full = fh.gather(params, spec)
    for m, last in fh.microbatches(M):
        mg.accumulate(grad_fn(full, xs[m], ys[m]), last=last)
    mg.zero_grad()


def _bare_exchange(row: torch.Tensor, parts: list[torch.Tensor]) -> None:
    import torch.distributed as dist

    dist.all_gather(parts, row)


def _off(fn):
    import functional_hsdp as fh

    with fh.validation("off"):
        return fn()


def task(cfg: dict) -> dict:
    from torch.func import functional_call, grad

    import functional_hsdp as fh
    from functional_hsdp import validate
    from functional_hsdp.lookup import grads_plan
    from functional_hsdp.tree import flatten

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
    plan = grads_plan(leaves, treedef, paths, spec, "grads")
    fp = validate.fingerprint(plan, "reduce_grads", paths, True, ("check_finite=False",))
    exchange = partial(validate.agree, spec.mesh, spec.dp_axes, fp, paths)
    row = torch.zeros(len(validate.HEADER) + 5, dtype=torch.int64)  # the agreement's row
    bare = partial(_bare_exchange, row, [torch.empty_like(row) for _ in range(C.WORLD)])
    ops = {
        "step_on": step,
        "step_off": partial(_off, step),
        "tree_on": call,
        "tree_off": partial(_off, call),
        "exchange": exchange,
        "bare": bare,
    }
    return C.interleaved(ops, cfg["warmup"], cfg["reps"])


def run(size: str = "full", pool=None) -> dict:
    per_rank, res = C.run_task(task, SIZES, size, pool)
    res["times"], res["median"] = C.slowest_rank_medians(per_rank)
    m = res["median"]
    res["step_cost"] = (m["step_on"] - m["step_off"]) / m["step_off"]
    # the spread: each repetition's on / off (the two ran back to back)
    res["step_ratios"] = [a / b for a, b in zip(res["times"]["step_on"], res["times"]["step_off"])]
    res["tree_cost_ms"] = 1e3 * (m["tree_on"] - m["tree_off"])
    # the floor: 1 + M exchanges per step, none overlapped
    res["floor"] = (1 + res["cfg"]["M"]) * m["bare"] / m["step_off"]
    return res


def report(res: dict, command: str, when: str) -> str:
    cfg, m = res["cfg"], res["median"]
    head = C.section_header("(B10) The per-call cross-rank agreement", command, when)
    desc = (
        f"hsdp on the 2x2 mesh. Step: (B1)'s HSDP step ({cfg['L']} x Linear({cfg['D']}) + "
        f"tanh, M={cfg['M']} microbatches of {cfg['B']}: `gather`, `grad`, "
        "`MainGrad.accumulate`, SGD; 1 + M library calls, each with its exchange) with the "
        'agreement on (the default) and `validation("off")`. Tree: `reduce_grads(last=True)` '
        f"on {cfg['leaves']} leaves of 20 fp32 elements; exchange alone: `validate.agree` with "
        f"the cached fingerprint. {C.timing_note(cfg, 'every operation')}\n"
    )
    ms = lambda s: f"{1e3 * s:.2f}"  # noqa: E731
    t = C.table(
        ["", "agreement on (ms)", "off (ms)", "cost"],
        [
            ["HSDP step", ms(m["step_on"]), ms(m["step_off"]), f"{100 * res['step_cost']:+.1f} %"],
            [
                f"reduce_grads, {cfg['leaves']} leaves",
                ms(m["tree_on"]),
                ms(m["tree_off"]),
                f"{res['tree_cost_ms']:+.2f} ms",
            ],
            ["the exchange alone", ms(m["exchange"]), "", ""],
            ["one bare host all-gather of the row", ms(m["bare"]), "", ""],
        ],
    )
    verdict = "met" if res["step_cost"] <= 0.02 else "not met"
    return (
        f"{head}\n{desc}\n{t}\n\nGoal (the agreement <= 2 % of an HSDP step): **{verdict}** "
        f"({100 * res['step_cost']:+.1f} %; a negative figure is noise: the two are within "
        "the run's spread). The spread: per repetition, step on / off = "
        f"{min(res['step_ratios']):.2f} to {max(res['step_ratios']):.2f} (median "
        f"{C.median(res['step_ratios']):.2f}). The floor where nothing overlaps the exchange: "
        "1 + M = "
        f"{1 + cfg['M']} bare host all-gathers of the row per step, "
        f"{1 + cfg['M']} x {ms(m['bare'])} ms = {100 * res['floor']:.1f} % of the step with the "
        "agreement off.\n"
    )

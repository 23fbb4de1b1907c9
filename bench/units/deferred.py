"""(B12) The deferred dp_outer all-reduce issued in backward, versus after it.

The layer-wise step of (B9) (4 gloo processes, 2x2 mesh, ``fh.gathered(..., into=mg)`` units
with ``fh.sequence``), timed two ways in the same group, steps interleaved:

- ``lw_sink``: the microbatches declared, ``fh.microbatches(M, into=mg)``: on the last
  microbatch each unit's dp_outer all-reduce is issued from its backward, as soon as the
  unit's gradient is complete, so it overlaps the backward of the units before it;
  ``mg.finish()`` only waits.
- ``lw_sink_undeclared``: ``fh.microbatches(M)``: ``mg.finish()`` issues every dp_outer
  all-reduce after the whole backward.

Also timed: ``mg.finish()`` alone within each step (what is left of the deferred reduction
once the backward is over). Only the time phase of (B9), for these two variants
(``layerwise.time_task``); no memory phase.
"""

from __future__ import annotations

import time

from .. import common as C
from . import layerwise

SIZES = {
    "tiny": {**layerwise.SIZES["tiny"], "reps": 2},
    "full": {**layerwise.SIZES["full"], "warmup": 1, "reps": 16},
}
VARIANTS = ("lw_sink", "lw_sink_undeclared")


def _timing_finish(mg, spent: list[float]) -> None:
    """``mg.finish`` timed: each call's seconds appended to ``spent``."""
    finish = mg.finish

    def timed() -> None:
        t0 = time.perf_counter()
        finish()
        spent.append(time.perf_counter() - t0)

    mg.finish = timed


def task(cfg: dict) -> dict:
    finishes: dict[str, list[float]] = {v: [] for v in VARIANTS}

    def build(name, cfg, base, dm):
        runner = layerwise._build(name, cfg, base, dm)
        _timing_finish(runner.mg, finishes[name])
        return runner

    out = layerwise.time_task(cfg, VARIANTS, build=build)
    out["finish"] = {v: t[cfg["warmup"] :] for v, t in finishes.items()}
    return out


def run(size: str = "full", pool=None) -> dict:
    per_rank, res = C.run_task(task, SIZES, size, pool)
    res["times"], res["median"] = C.slowest_rank_medians([r["times"] for r in per_rank])
    res["finish"], res["median_finish"] = C.slowest_rank_medians([r["finish"] for r in per_rank])
    res["losses"] = C.mean_losses(per_rank, keys=VARIANTS)
    declared, undeclared = res["losses"]["lw_sink"], res["losses"]["lw_sink_undeclared"]
    res["loss_maxrel"] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(declared, undeclared))
    times = res["times"]
    res["ratio"] = res["median"]["lw_sink"] / res["median"]["lw_sink_undeclared"]
    # per repetition (the two ran back to back): declared / undeclared
    res["ratios"] = [a / b for a, b in zip(times["lw_sink"], times["lw_sink_undeclared"])]
    cfg = res["cfg"]
    res["numel"] = cfg["L"] * (cfg["D"] ** 2 + cfg["D"])
    return res


def report(res: dict, command: str, when: str) -> str:
    cfg, med, fin = res["cfg"], res["median"], res["median_finish"]
    head = C.section_header(
        "(B12) The deferred dp_outer all-reduce issued in backward versus after it "
        "(4 gloo processes, 2x2 mesh)",
        command,
        when,
    )
    shard = res["numel"] // 2  # the dp_inner shard the dp_outer all-reduce carries
    desc = (
        f"(B9)'s layer-wise step: {cfg['L']} x (Linear({cfg['D']}, {cfg['D']}) + Tanh), "
        f"{res['numel']:,} parameters, one `fh.gathered(..., into=mg)` unit per Linear with "
        f"`fh.sequence`, M = {cfg['M']} microbatches of {cfg['B']} x {cfg['D']} per rank, "
        "in-place SGD. `lw_sink` declares its microbatches (`fh.microbatches(M, into=mg)`): "
        "the last microbatch's backward issues each unit's dp_outer all-reduce as soon as the "
        "unit's gradient is complete, and `mg.finish()` waits. `lw_sink_undeclared` "
        "(`fh.microbatches(M)`): `mg.finish()` issues them all after the backward. The "
        f"all-reduces carry the dp_inner shard, {shard:,} fp32 elements per rank per step, "
        f"in {cfg['L']} buckets (one per unit). Both built in one group of 4 ranks; "
        + C.timing_note(cfg, "the two variants")
        + " *finish()*: the time of `mg.finish()` within the step (slowest rank).\n"
    )
    rows = [
        [
            f"`{v}`",
            layerwise._LABEL[v],
            f"{med[v]:.3f}",
            " ".join(f"{x:.3f}" for x in res["times"][v]),
            f"{fin[v]:.3f}",
            f"{med[v] / med['lw_sink_undeclared']:.2f}",
        ]
        for v in VARIANTS
    ]
    t = C.table(
        ["variant", "what", "median step (s)", "timed steps (s)", "median finish() (s)",
         "step / undeclared"],
        rows,
    )  # fmt: skip
    ratios = res["ratios"]
    lines = [
        head,
        desc,
        t,
        "",
        f"- Declared / undeclared (ratio of medians): **{res['ratio']:.2f}**; per repetition "
        f"(the two run back to back): {', '.join(f'{r:.2f}' for r in ratios)} (median "
        f"{C.median(ratios):.2f}, min {min(ratios):.2f}, max {max(ratios):.2f}).",
        f"- `mg.finish()`: {fin['lw_sink']:.3f} s declared versus "
        f"{fin['lw_sink_undeclared']:.3f} s undeclared: what of the deferred reduction is "
        "still exposed after the backward.",
        f"- Losses equal (max relative difference {res['loss_maxrel']:.1e}).",
        "",
    ]
    return "\n".join(lines)

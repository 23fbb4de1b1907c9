"""(B13v) The cost of the gathered units' cross-rank checks on B13's step: validation "off",
"on" (the default: a running fingerprint of the step's unit calls, agreed at the last
microbatch's ``begin_microbatch(last=True)`` and at ``MainGrad.finish``) and "strict" (also
one agreement before each unit collective, its all-gathers and its reduce-scatter, and each
``begin_microbatch``).

B13's ``fh`` variant (``bench/units/module.py``: ``fh.functional_call(into=MainGrad)`` under
``fh.grad_and_value``, ``fh.microbatches(..., into=mg)``, ``mg.finish()``, SGD in place) for
both of its models, built once per mode in one group of 4 gloo ranks (2x2 mesh), the steps of
the three modes interleaved. Also timed alone, per step, with less noise: the default mode's
one extra summary (``units_of(mg).agree(...)``, which ``begin_microbatch(last=True)`` runs) and the
recording of the step's unit calls.
"""

from __future__ import annotations

import time

import torch

from .. import common as C
from . import module as B13

SIZES = {
    "tiny": {**B13.SIZES["tiny"], "warmup": 1, "reps": 1, "calls": 5},
    "full": {**B13.SIZES["full"], "warmup": 2, "reps": 15, "calls": 200},
}
MODES = ("off", "on", "strict")


class _Mode:
    """B13's fh step, run under ``fh.validation(mode)``."""

    def __init__(self, kind: str, cfg: dict, dm, mode: str):
        self.runner, self.mode = B13._Fh(kind, cfg, dm), mode

    def step(self, batches) -> float:
        with self.runner.fh.validation(self.mode):
            return self.runner.step(batches)


def _alone(runner, data, calls: int) -> dict:
    """Per step, the default mode's own work, timed alone: the extra summary and the unit
    calls' recording (each call's texts are cached: a list append and a hash update)."""
    from functional_hsdp.runtime.unit_calls import UnitLog
    from functional_hsdp.sync.maingrad import units_of

    mg, fh = runner.mg, runner.fh
    with fh.validation("on"):  # one step to know its unit calls
        for batch, _ in fh.microbatches(data, into=mg):
            runner.grad(runner.shards, batch)
        mg.finish()
    mg.zero_grad()
    C.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        units_of(mg).agree("MainGrad.begin_microbatch")
    summary = (time.perf_counter() - t0) / calls
    log, units = UnitLog(), 2 * len(runner.shards)  # each unit once per microbatch
    t0 = time.perf_counter()
    for _ in range(calls):
        for u in range(units):
            log.record(f"unit {u}", "recompute=False; param_dtype=None; buckets=[1024]")
        log.take()
    return {"summary": summary, "record": (time.perf_counter() - t0) / calls, "units": units}


def time_task(cfg: dict) -> dict:
    dm = C.device_mesh((2, 2))
    runners = {(k, m): _Mode(k, cfg, dm, m) for k in B13.MODELS for m in MODES}
    data = {k: B13._data(k, cfg, 0) for k in B13.MODELS}
    ops = {key: (lambda key=key: runners[key].step(data[key[0]])) for key in runners}
    times = C.interleaved(ops, cfg["warmup"], cfg["reps"])
    alone = {k: _alone(runners[(k, "on")].runner, data[k], cfg["calls"]) for k in B13.MODELS}
    return {"times": {f"{k}/{m}": t for (k, m), t in times.items()}, "alone": alone}


def run(size: str = "full", pool=None) -> dict:
    torch.manual_seed(0)
    per_rank, res = C.run_task(time_task, SIZES, size, pool)
    res["times"], res["median"] = C.slowest_rank_medians([r["times"] for r in per_rank])
    res["alone"] = {
        k: {x: max(r["alone"][k][x] for r in per_rank) for x in ("summary", "record", "units")}
        for k in B13.MODELS
    }
    return res


def report(res: dict, command: str, when: str) -> str:
    cfg, med = res["cfg"], res["median"]
    lines = [
        C.section_header(
            "(B13v) The units' cross-rank checks on B13's step: validation off / on (default) "
            "/ strict (4 gloo processes, 2x2 mesh)",
            command,
            when,
        ),
        "B13's `fh` variant (see B13 for the models and the loop), one runner per mode, "
        + C.timing_note(cfg, "the 3 modes of both models"),
        "",
    ]
    rows = []
    for k in B13.MODELS:
        off, alone = med[f"{k}/off"], res["alone"][k]
        own = alone["summary"] + alone["record"]
        for m in MODES:
            t = med[f"{k}/{m}"]
            rows.append([k, m, f"{t:.4f}", f"{(t / off - 1) * 100:+.1f} %"])
        rows.append(
            [
                k,
                "on: its own work alone",
                f"{own:.5f}",
                f"{own / off * 100:.2f} % (summary {alone['summary'] * 1e3:.2f} ms, "
                f"{alone['units']} unit calls recorded {alone['record'] * 1e6:.0f} us)",
            ]
        )
    lines.append(C.table(["model", "mode", "median step (s)", "vs off"], rows))
    return "\n".join(lines) + "\n"

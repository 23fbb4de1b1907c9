"""(B4) Bytes on the wire per axis versus the theoretical minimum, for each preset.

4 gloo processes, 2x2 mesh; a tree of N fp32 parameters with sizes that do not divide evenly
(padding is exercised). One step = ``gather`` of the parameters for the forward + M
``reduce_grads`` calls. From ``comm_log``, per (axis, collective): the bytes one rank sends
with the bandwidth-optimal algorithm for the logged input (reduce-scatter (n-1)/n·in,
all-reduce 2(n-1)/n·in, all-gather (n-1)·in), against the theoretical minimum of the preset,
computed independently from the unpadded tree size S (per rank):

- ddp: all-reduce inner on S and outer on S, once per step;
- fsdp: per microbatch reduce-scatter inner on S and outer on S/n_i; gather: all-gather outer
  of S/(n_i·n_o), inner of S/n_i;
- hsdp: per microbatch reduce-scatter inner on S; once all-reduce outer on S/n_i; gather:
  all-gather inner of S/n_i;
- hfsdp: per microbatch reduce-scatter inner on S; once reduce-scatter outer on S/n_i;
  gather: all-gather outer of S/(n_i·n_o), inner of S/n_i.

Also measured: bytes through the loopback interface during the step (all 4 processes), against
the theoretical total of all ranks: what gloo actually sends.
"""

from __future__ import annotations

from .. import common as C

SIZES = {
    "tiny": {"n": 60_000, "M": 2, "cap": 0.05},
    "full": {"n": 10_000_000, "M": 4, "cap": 25.0},
}
PRESETS = ("ddp", "fsdp", "hsdp", "hfsdp")
_FACTOR = {
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: n - 1,
}


def theory(preset: str, S: float, M: int, no: int, ni: int) -> dict[tuple[str, str], float]:
    """Minimum bytes one rank sends per step, per (axis, op)."""
    rs, ar = _FACTOR["reduce_scatter"], _FACTOR["all_reduce"]
    out = {}
    if preset == "ddp":
        out[("dp_inner", "all_reduce")] = ar(ni) * S
        out[("dp_outer", "all_reduce")] = ar(no) * S
    elif preset == "fsdp":
        out[("dp_inner", "reduce_scatter")] = M * rs(ni) * S
        out[("dp_outer", "reduce_scatter")] = M * rs(no) * S / ni
        out[("dp_outer", "all_gather")] = (no - 1) * S / (ni * no)
        out[("dp_inner", "all_gather")] = (ni - 1) * S / ni
    elif preset == "hsdp":
        out[("dp_inner", "reduce_scatter")] = M * rs(ni) * S
        out[("dp_outer", "all_reduce")] = ar(no) * S / ni
        out[("dp_inner", "all_gather")] = (ni - 1) * S / ni
    elif preset == "hfsdp":
        out[("dp_inner", "reduce_scatter")] = M * rs(ni) * S
        out[("dp_outer", "reduce_scatter")] = rs(no) * S / ni
        out[("dp_outer", "all_gather")] = (no - 1) * S / (ni * no)
        out[("dp_inner", "all_gather")] = (ni - 1) * S / ni
    return out


def task(cfg: dict) -> dict:
    import functional_hsdp as fh

    dm = C.device_mesh((2, 2))
    mesh = fh.DistMesh(dm)
    shapes = C.param_tree(cfg["n"], odd=True)
    full = C.make(shapes, fill=0.5)
    g = C.make(shapes, fill=1.0)
    out = {}
    for preset in PRESETS:
        make = getattr(fh, preset)
        spec = (
            make(mesh, *C.AXES, bucket_cap_mb=cfg["cap"])
            if preset in ("hsdp", "hfsdp")
            else make(mesh, bucket_cap_mb=cfg["cap"])
        )
        params = fh.shard(full, spec)
        for _ in range(2):  # a warm-up step, then the logged one
            C.barrier()
            lo0 = C.lo_bytes()
            with fh.comm_log() as log:
                f = fh.gather(params, spec)
                acc = None
                for _, last in fh.microbatches(cfg["M"]):
                    acc = fh.reduce_grads(g, spec, last=last, acc=acc)
                del f, acc
            C.barrier()
            lo1 = C.lo_bytes()
        events = [(e.op, e.axis, e.numel, e.dtype.itemsize, mesh.size(e.axis)) for e in log.events]
        out[preset] = {"events": events, "lo": lo1 - lo0}
    return {"presets": out, "numel": C.numel(shapes)}


def run(size: str = "full", pool=None) -> dict:
    per_rank, res = C.run_task(task, SIZES, size, pool)
    cfg, numel = res["cfg"], per_rank[0]["numel"]
    S = numel * 4
    res.update(numel=numel, presets={})
    for preset in PRESETS:
        evs = per_rank[0]["presets"][preset]["events"]
        assert all(r["presets"][preset]["events"] == evs for r in per_rank), "ranks disagree"
        rows = {}
        for op, axis, n_el, item, n in evs:
            key = (axis, op)
            cnt, inb, wire = rows.get(key, (0, 0, 0.0))
            rows[key] = (cnt + 1, inb + n_el * item, wire + _FACTOR[op](n) * n_el * item)
        th = theory(preset, S, cfg["M"], 2, 2)
        keys = sorted(set(rows) | set(th))
        table = []
        for key in keys:
            cnt, inb, wire = rows.get(key, (0, 0, 0.0))
            t = th.get(key, 0.0)
            table.append(
                {
                    "axis": key[0],
                    "op": key[1],
                    "count": cnt,
                    "input": inb,
                    "wire": wire,
                    "theory": t,
                    "ratio": wire / t if t else float("inf" if wire else "nan"),
                }
            )
        total_wire = sum(x["wire"] for x in table)
        total_theory = sum(th.values())
        res["presets"][preset] = {
            "rows": table,
            "wire": total_wire,
            "theory": total_theory,
            "lo": per_rank[0]["presets"][preset]["lo"],  # machine-wide, all 4 processes
        }
    return res


def report(res: dict, command: str, when: str) -> str:
    cfg = res["cfg"]
    head = C.section_header(
        "(B4) Bytes on the wire per axis versus the theoretical minimum", command, when
    )
    desc = (
        f"2x2 mesh; tree of {res['numel']:,} fp32 parameters (S = {C.mib(res['numel'] * 4)} "
        f"MiB per rank; leaf sizes chosen not to divide evenly); one step = `gather` + "
        f"{cfg['M']} x `reduce_grads`. *Wire (comm_log)*: bytes one rank sends for the logged "
        "collectives with the bandwidth-optimal algorithm (reduce-scatter (n-1)/n·in, "
        "all-reduce 2(n-1)/n·in, all-gather (n-1)·in, in = the logged input, padding "
        "included). *Theory*: the preset's minimum from the unpadded S (see `bench/plan/wire.py`). "
        "*Loopback*: bytes that went through `lo` during the step, all 4 processes, versus 4 x "
        "the per-rank theory (gloo's own algorithms; includes TCP/IP headers).\n"
    )
    rows = []
    worst = 0.0
    for preset, p in res["presets"].items():
        for x in p["rows"]:
            worst = max(worst, x["ratio"])
            rows.append(
                [
                    preset,
                    x["axis"],
                    x["op"],
                    x["count"],
                    C.mib(x["input"]),
                    C.mib(x["wire"]),
                    C.mib(x["theory"]),
                    f"{x['ratio']:.4f}",
                ]
            )
    t1 = C.table(
        [
            "preset",
            "axis",
            "collective",
            "count",
            "logged input (MiB)",
            "wire, comm_log (MiB)",
            "theory (MiB)",
            "ratio",
        ],
        rows,
    )
    rows2 = [
        [
            preset,
            C.mib(p["wire"]),
            C.mib(p["theory"]),
            f"{p['wire'] / p['theory']:.4f}",
            C.mib(p["lo"]),
            f"{p['lo'] / (4 * p['theory']):.2f}",
        ]
        for preset, p in res["presets"].items()
    ]
    t2 = C.table(
        [
            "preset",
            "wire per rank, comm_log (MiB)",
            "theory per rank (MiB)",
            "ratio",
            "loopback, all ranks (MiB)",
            "loopback / (4 x theory)",
        ],
        rows2,
    )
    met = worst <= 1.01
    return (
        f"{head}\n{desc}\n{t1}\n\nPer step:\n\n{t2}\n\nGoal (every axis <= 1.01 x theory, from "
        f"comm_log): **{'met' if met else 'not met'}** (worst {worst:.4f}). The loopback column "
        "is what gloo really sends: its reduce-scatter moves about as many bytes as an "
        "all-reduce (see the reduce-scatter section).\n"
    )

"""(B20) What a delayed DiLoCo sync's overlap gains: in flight while the next step computes.

4 gloo processes, 2x2 mesh (2 replicas x 2 inner ranks): ``fh.diloco(fh.hsdp(...),
axis="dp_outer", every=2, outer=fh.sgd(1.0))`` on a tree of N fp32 parameters (each rank holds
its half, the inner shard). A sync is one all-reduce per bucket over ``dp_outer`` of that shard.
The inner step stands for a step whose compute leaves the host free, as a GPU's does: the
host sleeps ``compute`` seconds (``sleep``); or it computes on this host's cores (``cpu``:
matmuls, which the loopback transfer's copies then compete with). ``compute`` is the time of
the sync's blocking all-reduce measured first (the slowest rank's median), so an overlap
could hide all of the transfer. Then each rank's params drop by a constant and
``dl.update`` runs.

Variants, each timed over runs of ``steps`` consecutive steps (``steps / 2`` syncs, every run
starting and ending with nothing in flight), runs of the variants interleaved, each after a
barrier:

- ``delay=0``: the update after every second step issues the sync and waits for it;
- ``delay=1``: it issues the sync and returns; the update after the next step waits for it
  (:class:`~functional_hsdp.diloco.SyncInFlight`) and merges;
- ``int8 delay=0`` and ``int8 delay=1``: the same with ``compress=fh.compress(torch.int8)``
  (a sync is a quantized all-to-all, an fp32 sum and a quantized all-gather per bucket;
  with delay=1 the all-to-all flies and the update where it lands sums and all-gathers);
- ``no sync``: the same steps without ``dl.update`` (the floor: compute alone).

Reported: the median run time per sync period (two steps) on the slowest rank, and the part
of the sync's cost that ``delay=1`` hides: ``(delay0 - delay1) / (delay0 - floor)``.
"""

from __future__ import annotations

import time

import torch

from .. import common as C

SIZES = {
    "tiny": {"n": 40_000, "steps": 4, "reps": 1, "warmup": 1, "probes": 2},
    "full": {"n": 8_000_000, "steps": 20, "reps": 7, "warmup": 1, "probes": 7},
}
KINDS = ("sleep", "cpu")
#: variant -> (delay, compressed); "no sync" steps without dl.update
SYNCS = {
    "delay=0": (0, False),
    "delay=1": (1, False),
    "int8 delay=0": (0, True),
    "int8 delay=1": (1, True),
}
VARIANTS = (*SYNCS, "no sync")
WIRES = {"fp32": "", "int8": "int8 "}  # a sync's wire -> its variants' name prefix


def _agreed_max(x: float) -> float:
    """The largest ``x`` over the ranks (so that every rank computes alike)."""
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _cpu_work(seconds: float):
    """A compute of about ``seconds`` on this host's cores: repeated 256x256 matmuls."""
    a = torch.randn(256, 256)
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.2:
        a @ a
        n += 1
    reps = max(1, round(seconds / ((time.perf_counter() - t0) / n)))
    reps = int(_agreed_max(reps))

    def work() -> None:
        for _ in range(reps):
            a @ a

    return work


def task(cfg: dict) -> dict:
    import functional_hsdp as fh

    mesh = fh.DistMesh(C.device_mesh((2, 2)))
    spec = fh.hsdp(mesh, *C.AXES)
    full = C.make(C.param_tree(cfg["n"], leaf=min(1 << 20, max(64, cfg["n"] // 8))), fill=1.0)
    runs: dict = {}
    for name, (delay, compressed) in SYNCS.items():
        policy = fh.compress(torch.int8) if compressed else None
        dl = fh.diloco(spec, axis="dp_outer", every=2, outer=fh.sgd(1.0), delay=delay,
                       compress=policy)  # fmt: skip
        params = fh.shard(full, dl.inner)
        runs[name] = [dl, params, dl.init(params)]
    shard = runs["delay=0"][1]
    probes = [C.timed(lambda: fh.pmean(shard, "dp_outer", mesh))[0] for _ in range(cfg["probes"])]
    transfer = _agreed_max(C.median(probes))
    works = {"sleep": lambda: time.sleep(transfer), "cpu": _cpu_work(transfer)}

    floor = {k: v.clone() for k, v in shard.items()}

    updates: dict = {}  # (kind, delay, issues a sync) -> dl.update's seconds

    def steps(name, work, kind) -> None:
        entry = runs.get(name)
        for _ in range(cfg["steps"]):
            work()
            params = {k: v.sub_(1e-6) for k, v in (entry[1] if entry else floor).items()}
            if entry is not None:
                issues = entry[2].count % 2 == 1  # after an even step (counted from 1)
                t0 = time.perf_counter()
                entry[1], entry[2] = entry[0].update(params, entry[2])
                key = f"{kind}/{name}/{'issue' if issues else 'land'}"
                updates.setdefault(key, []).append(time.perf_counter() - t0)

    for name in SYNCS:  # one step first: every run then starts after an odd step count,
        dl, params, state = runs[name]  # issues after its odd steps, lands after its even
        runs[name][1:] = dl.update({k: v.sub_(1e-6) for k, v in params.items()}, state)
    out = {"transfer": transfer, "bytes": sum(x.numel() * 4 for x in shard.values()), "times": {}}
    out["updates"] = updates
    for kind in KINDS:
        work = works[kind]
        ops = {name: lambda n=name, w=work, k=kind: steps(n, w, k) for name in VARIANTS}
        times = C.interleaved(ops, cfg["warmup"], cfg["reps"])
        for name in VARIANTS:
            out["times"][f"{kind}/{name}"] = times[name]
        for name in SYNCS:
            assert not any(runs[name][2].flight), "a run ended with a sync in flight"
    return out


def run(size: str = "full", pool=None) -> dict:
    per_rank, res = C.run_task(task, SIZES, size, pool)
    _, median = C.slowest_rank_medians([r["times"] for r in per_rank])
    periods = res["cfg"]["steps"] / 2
    res.update(
        transfer=max(r["transfer"] for r in per_rank),
        shard_bytes=per_rank[0]["bytes"],
        period={k: v / periods for k, v in median.items()},
    )
    res["hidden"], res["saved"] = {}, {}
    for kind in KINDS:
        p = res["period"]
        for wire, prefix in WIRES.items():  # the sync's cost and what delay=1 saves of it
            cost = p[f"{kind}/{prefix}delay=0"] - p[f"{kind}/no sync"]
            saved = p[f"{kind}/{prefix}delay=0"] - p[f"{kind}/{prefix}delay=1"]
            res["saved"][f"{kind}/{wire}"], res["hidden"][f"{kind}/{wire}"] = saved, saved / cost
    # dl.update's own time (warm-up included), the slowest rank's median
    res["updates"] = {
        k: max(C.median(r["updates"][k]) for r in per_rank) for k in per_rank[0]["updates"]
    }
    return res


def report(res: dict, command: str, when: str) -> str:
    cfg = res["cfg"]
    head = C.section_header(
        "(B20) What a delayed DiLoCo sync's overlap gains (2x2 gloo)", command, when
    )
    desc = (
        f"`fh.diloco(fh.hsdp(...), axis='dp_outer', every=2, outer=fh.sgd(1.0))` on "
        f"{cfg['n'] / 1e6:.1f}M fp32 parameters: a sync all-reduces each rank's "
        f"{res['shard_bytes'] / 1e6:.1f} MB shard over dp_outer, {res['transfer'] * 1e3:.1f} ms "
        "blocking (the slowest rank's median). An inner step is a compute of that length: "
        "`sleep` (the host free, as under a GPU's step) or `cpu` (matmuls on this host's 2 "
        "cores, which the 4 processes' loopback copies compete with), then the params drop "
        "by a constant and `dl.update` runs. "
        f"{C.timing_note(cfg, 'runs of ' + str(cfg['steps']) + ' steps of the five variants')} "
        "Shown per sync period (2 steps). The sync's cost, delay=0 - no sync, is its "
        "transfer and its local work (the pseudo-gradient, its packing, the outer step, the "
        "merge: passes over the shard that no overlap hides). Saved: delay=0 - delay=1, also "
        "as a part of that cost and of the blocking all-reduce's time. Last columns: "
        "`dl.update`'s median time (the slowest rank's) where it issues and where it lands "
        "a sync (with delay=0 both in one call). `int8`: the same with "
        "`compress=fh.compress(torch.int8)`: its all-to-all flies, its sum and all-gather "
        "run where it lands.\n"
    )
    rows = []
    for kind in KINDS:
        p, u = res["period"], res["updates"]
        for wire, prefix in WIRES.items():
            key, v = f"{kind}/{wire}", f"{kind}/{prefix}delay="
            rows.append(
                [
                    kind,
                    wire,
                    f"{p[f'{kind}/no sync'] * 1e3:.1f}",
                    f"{p[v + '0'] * 1e3:.1f}",
                    f"{p[v + '1'] * 1e3:.1f}",
                    f"{res['saved'][key] * 1e3:.1f}",
                    f"{res['hidden'][key]:.2f}",
                    f"{res['saved'][key] / res['transfer']:.2f}",
                    f"{u[v + '0/issue'] * 1e3:.1f}",
                    f"{u[v + '1/issue'] * 1e3:.1f}",
                    f"{u[v + '1/land'] * 1e3:.1f}",
                ]
            )
    columns = ["inner compute", "sync", "no sync (ms)", "delay=0 (ms)", "delay=1 (ms)"]
    columns += ["saved (ms)", "of the sync's cost", "of the blocking all-reduce"]
    columns += ["update, delay=0 (ms)", "update issuing, delay=1 (ms)"]
    columns += ["update landing, delay=1 (ms)"]
    t = C.table(columns, rows)
    return f"{head}\n{desc}\n{t}\n"

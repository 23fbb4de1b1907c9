"""B21: the outer axis over a rate-limited link between two sites (issue 46).

Two sites on this machine (``functional_hsdp.tools.testing.sites``: a network namespace per
replica group, joined by a veth pair whose egress ``tbf`` limits to a rate), two gloo ranks in
each: the inner axis (``dp_inner``, ranks {0, 1} and {2, 3}) stays inside a site, over its
loopback; only the outer axis (``dp_outer``, {0, 2} and {1, 3}) crosses the link, as between two
datacenters. B18's data (the stdlib's ``.py`` bytes, byte tokens) and a larger Llama of B18's
shape (hidden 384, 8 layers: 10.8 M parameters, so that HSDP's outer all-reduce of 21 MB per
rank dominates a step at 100 Mbit/s) through ``fh.shard_module`` + ``fh.functional_call(into=
MainGrad)``, inner ``fh.adamw``.

Variants: HSDP; HSDP with ``outer_compress`` bf16/int8/int4 (error feedback); DiLoCo every
H in {20, 50} steps, uncompressed and with ``compress=`` int8/int4 (outer ``fh.sgd(0.7,
momentum=0.9, nesterov=True)``); Streaming DiLoCo (H = 20, F = 4, delay 1 and 2).

Two phases, each one :meth:`Sites.call` (4 fresh ranks) at one link rate:

- **curves** at the rate the goals name (100 Mbit/s): every variant trains ``steps`` steps on
  the same batches; eval loss on fixed held-out bytes every ``eval_every`` steps (of a copy of
  the params taken then and evaluated after the run, so that no sync flies during an untimed
  eval; with DiLoCo the mean of the two replicas' own losses), each step timed (a barrier
  inside the site before it: none crosses the link, so no barrier waits behind a sync's bytes
  queued in the ``tbf``; a site's step is its slower rank's, a step the slower site's, or
  where the sites meet, a sync, the later one's), the bytes each site's interface sent on
  the link over the variant (``/sys/class/net/wan0/statistics``, read between barriers) beside
  ``comm_log``'s outer bytes (:meth:`CommLog.sent_bytes`, the payload a bandwidth-optimal
  algorithm moves), and for the compressed HSDP variants the codec's seconds (B19's seam on the
  compressed reduction's local items). Time-to-loss: the wall-clock (the slower site's summed
  step times) at the first eval whose loss is at most HSDP's final one (HSDP's own too).
  Step-time statistics leave out the first step (its warm-up).
- **step times** at the other rates (unlimited, 1 Gbit/s): each variant of H = 20 over
  ``every + delay + 2`` steps, a sync in them (H = 50's sync step is H = 20's: the same bytes).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, NamedTuple

import optree
import torch

from .. import common as C
from ..runtime import compress as B19
from . import diloco as B18

AXES = C.AXES
PNG = os.path.join(C.BENCH_DIR, "wan.png")
PROCESSES = 4
SIZES = {
    "tiny": dict(hidden=32, layers=1, seq=32, batch=2, data_mb=0.2, inner_lr=3e-3,
                 outer_lr=0.7, outer_momentum=0.9, steps=5, diloco_steps=6, eval_every=3,
                 eval_batches=1,
                 every=4, long_every=6, delays=(1,), fragments=2, curve_rate=100.0,
                 rates=(), timeout=300.0,
                 only=("HSDP", "HSDP int8", "DiLoCo H=4", "Streaming H=4 F=2 delay=1")),
    "full": dict(hidden=384, layers=8, seq=64, batch=4, data_mb=4.0, inner_lr=2e-3,
                 outer_lr=0.7, outer_momentum=0.9, steps=80, diloco_steps=160, eval_every=10,
                 eval_batches=8,
                 every=20, long_every=50, delays=(1, 2), fragments=4, curve_rate=100.0,
                 rates=(None, 1000.0), timeout=5400.0, only=None),
}  # fmt: skip


class Variant(NamedTuple):
    name: str
    every: int  # 0: HSDP (its outer all-reduce every step)
    fragments: int
    delay: int
    compress: str  # B19's variant names: "none", "int8+ef", ...


def variants(cfg: dict, *, curves: bool) -> list[Variant]:
    """Every variant of the curves phase; the step-time phase leaves out H = ``long_every``."""
    out = [Variant("HSDP", 0, 1, 0, "none")]
    out += [Variant(f"HSDP {f}", 0, 1, 0, f"{f}+ef") for f in ("bf16", "int8", "int4")]
    for every in (cfg["every"], cfg["long_every"]) if curves else (cfg["every"],):
        for f in ("none", "int8", "int4"):
            suffix = "" if f == "none" else f" {f}"
            out.append(Variant(f"DiLoCo H={every}{suffix}", every, 1, 0, _ef(f)))
    for d in cfg["delays"]:
        name = f"Streaming H={cfg['every']} F={cfg['fragments']} delay={d}"
        out.append(Variant(name, cfg["every"], cfg["fragments"], d, "none"))
    return [v for v in out if cfg["only"] is None or v.name in cfg["only"]]


def _ef(f: str) -> str:
    return "none" if f == "none" else f"{f}+ef"


class _Run:
    """One variant on this rank: B18's model at ``cfg``'s size, its shards, MainGrad, inner
    AdamW; HSDP's spec compresses the outer axis, DiLoCo's sync compresses its pseudo-gradient."""

    def __init__(self, cfg: dict, v: Variant, dm):
        import functional_hsdp as fh

        policy = B19._policy(v.compress)
        mesh = fh.DistMesh(dm)
        self.model = B18._model(cfg)
        units = list(self.model.model.layers)
        self.dl = None
        if v.every:
            spec = fh.hsdp(mesh, *AXES)
            m = cfg["outer_momentum"]
            outer = fh.sgd(cfg["outer_lr"], momentum=m, nesterov=m > 0)
            self.dl = fh.diloco(spec, axis=AXES[0], every=v.every, outer=outer,
                                fragments=v.fragments, delay=v.delay, compress=policy)  # fmt: skip
            spec = self.dl.inner
        else:
            spec = fh.hsdp(mesh, *AXES, outer_compress=policy)
        self.shards, tree_spec = fh.shard_module(self.model, spec, units=units)
        self.leaves = optree.tree_leaves(self.shards)
        self.mg = fh.MainGrad(tree_spec, like=self.shards)
        self.opt = fh.adamw(lr=cfg["inner_lr"], weight_decay=0.0)
        self.opt_state = self.opt.init(self.shards)
        self.state = self.dl.init(self.shards) if self.dl else None

    def _loss(self, s, ids):
        import functional_hsdp as fh

        return B18._loss(fh.functional_call(self.model, s, (ids,), into=self.mg).logits, ids)

    def step(self, ids: torch.Tensor) -> float:
        """One inner step (HSDP's outer all-reduce in ``mg.finish``), then ``dl.update``;
        returns the bytes this rank sent over dp_outer as ``comm_log`` counts them."""
        import functional_hsdp as fh

        with fh.comm_log() as log:
            self.mg.begin_microbatch(last=True)
            torch.func.grad(self._loss)(self.shards, ids)
            self.mg.finish()
            updates, self.opt_state = self.opt.update(self.mg.grads, self.opt_state, self.shards)
            with torch.no_grad():
                torch._foreach_add_(self.leaves, optree.tree_leaves(updates))
            del updates
            self.mg.zero_grad()
            if self.dl:
                new, self.state = self.dl.update(self.shards, self.state)
                with torch.no_grad():
                    for p, q in zip(self.leaves, optree.tree_leaves(new)):
                        if p is not q:
                            p.copy_(q)
                del new
        return log.sent_bytes(AXES[0], 2)

    def drain(self) -> None:
        """Wait for every sync still in flight (B18's ``drain``)."""
        for sync in self.state.flight if self.state is not None else ():
            if sync is not None:
                sync.result()

    @torch.no_grad()
    def evaluate(self, evals: list, shards: Any = None) -> float:
        """The mean eval loss of this replica's params (``shards``: a copy taken earlier)."""
        import functional_hsdp as fh

        shards = self.shards if shards is None else shards
        logits = (fh.functional_call(self.model, shards, (ids,)).logits for ids in evals)
        return statistics.mean(B18._loss(x, ids).item() for x, ids in zip(logits, evals))


def _link_tx(inner) -> int | None:
    """Bytes this site's end of the link has sent so far, read by the site's first rank between
    two barriers of every rank (so no rank is sending meanwhile); None on the others."""
    import torch.distributed as dist

    from functional_hsdp.tools.testing import sites

    dist.barrier()
    tx = sites.link_counters()["tx_bytes"] if dist.get_rank(inner) == 0 else None
    dist.barrier()
    return tx


def _variant(cfg: dict, v: Variant, steps: int, text: torch.Tensor, evaluate: bool) -> dict:
    import torch.distributed as dist

    dm = C.device_mesh((2, 2), AXES)
    inner = dm.get_group(AXES[1])
    split = int(0.9 * len(text))
    train, held = text[:split], text[split:]
    gen = torch.Generator().manual_seed(1000 + C.rank())
    eval_gen = torch.Generator().manual_seed(7)
    evals = [B18._batch(held, eval_gen, cfg) for _ in range(cfg["eval_batches"])]
    import functional_hsdp as fh

    run = _Run(cfg, v, dm)
    # Params are copied at each eval step and evaluated after the run: an eval between steps
    # would give a delayed sync in flight time on the link that no step pays for.
    copies = [(0, optree.tree_map(torch.clone, run.shards))] if evaluate else []
    times, sent = [], []
    B19._CODEC["seconds"] = 0.0
    start = _link_tx(inner)
    with B19._codec_timed():
        for step in range(1, steps + 1):
            ids = B18._batch(train, gen, cfg)
            dist.barrier(group=inner)  # inside the site: nothing crosses the link
            t0 = time.perf_counter()
            sent.append(run.step(ids))
            times.append(time.perf_counter() - t0)
            if evaluate and (step % cfg["eval_every"] == 0 or step == steps):
                copies.append((step, optree.tree_map(torch.clone, run.shards)))
        with fh.comm_log() as log:  # a delayed compressed sync's last leg runs when collected
            run.drain()
        sent[-1] += log.sent_bytes(AXES[0], 2)
    codec = B19._CODEC["seconds"]
    end = _link_tx(inner)
    link = None if start is None else end - start
    curve = [(step, run.evaluate(evals, shards)) for step, shards in copies]
    return dict(times=times, sent=sent, curve=curve, link=link, codec=codec)


def _task(cfg: dict, curves: bool) -> dict:
    torch.set_num_threads(1)
    text = B18._text(cfg["data_mb"])
    out = {}
    for v in variants(cfg, curves=curves):
        if curves:  # DiLoCo's steps are cheaper: twice HSDP's, so that it may reach its loss
            steps = cfg["diloco_steps"] if v.every else cfg["steps"]
        else:
            steps = v.every + v.delay + 2 if v.every else 6
        out[v.name] = _variant(cfg, v, steps, text, evaluate=curves)
    return out


def _synced(v: Variant, steps: int) -> list[str]:
    """Per step: "sync" (HSDP's all-reduce; a DiLoCo sync issued with no delay, or landing),
    "issue" (a delayed sync issued), "flight" (a delayed sync in flight) or "quiet"."""
    import functional_hsdp as fh

    if not v.every:
        return ["sync"] * steps
    issued = fh.sync_steps(v.every, v.fragments, steps)
    out = ["quiet"] * steps
    for t in range(steps):
        if issued[t]:
            if out[t] != "quiet":
                raise ValueError(f"{v.name}: a sync issued while another lands ({t + 1})")
            out[t] = "sync" if v.delay == 0 else "issue"
            for k in range(t + 1, min(t + v.delay + 1, steps)):
                out[k] = "land" if k == t + v.delay else "flight"
    return out


def _summarize(per_rank: list[dict], vlist: list[Variant], curves: bool) -> dict:
    out = {}
    for v in vlist:
        runs = [r[v.name] for r in per_rank]
        # A site's step: its slower rank's (the two meet at a barrier before each step).
        sites = [[max(a, b) for a, b in zip(runs[i]["times"], runs[i + 1]["times"])]
                 for i in (0, 2)]  # fmt: skip
        kinds = _synced(v, len(sites[0]))
        # A step's time: the slower site's; where the sites meet (a sync, a landing), the
        # site that came last's, since the other one's also holds the wait for it.
        times = [min(a, b) if k in ("sync", "land") else max(a, b)
                 for a, b, k in zip(*sites, kinds)]  # fmt: skip
        # the statistics leave out step 1 (the first step's warm-up)
        by_kind = {k: [t for t, kk in zip(times[1:], kinds[1:]) if kk == k] for k in set(kinds)}
        # the wall-clock after k steps: the slower site's own steps summed (the sites run
        # apart between syncs, so the per-step maxima would overstate it)
        wall = [max(sum(site[:k]) for site in sites) for k in range(len(times) + 1)]
        x = dict(
            every=v.every, fragments=v.fragments, delay=v.delay, compress=v.compress,
            steps=len(times), times=times, kinds=kinds, rank_times=[r["times"] for r in runs],
            median={k: statistics.median(ts) for k, ts in by_kind.items() if ts},
            largest=max(times[1:]), wall=wall[-1],
            comm_bytes=sum(sum(r["sent"]) for r in runs),
            link_bytes=sum(r["link"] for r in runs if r["link"] is not None),
            codec=max(r["codec"] for r in runs),
        )  # fmt: skip
        if curves:
            evals = [[e for _, e in r["curve"]] for r in runs]
            x["curve"] = [(s, statistics.mean(es), wall[s]) for (s, _), *es in
                          zip(runs[0]["curve"], *evals)]  # fmt: skip
        out[v.name] = x
    return out


def _time_to_loss(v: dict, target: float) -> tuple[float | None, float]:
    """The wall-clock at the first eval at or below ``target`` (None: never) and the loss
    reached last."""
    for _, loss, wall in v["curve"]:
        if loss <= target:
            return wall, loss
    return None, v["curve"][-1][1]


def run(size: str = "full", pool: Any = None) -> dict:
    from functional_hsdp.tools.testing import sites

    del pool  # the ranks run in the sites' namespaces, not in a pool
    cfg = SIZES[size]
    reason = sites.probe()
    if reason is not None:
        return {"size": size, "cfg": cfg, "skipped": reason}
    res: dict[str, Any] = {"size": size, "cfg": cfg, "rates": {}, "load": {}}
    t0 = time.perf_counter()
    with sites.Sites(2) as s:
        for rate, curves in [(r, False) for r in cfg["rates"]] + [(cfg["curve_rate"], True)]:
            s.set_rate(rate)
            start = C.loadavg()
            per_rank = s.call(_task, ranks_per_site=2, timeout=cfg["timeout"], cfg=cfg,
                              curves=curves)  # fmt: skip
            key = "unlimited" if rate is None else f"{rate:g}"
            res["rates"][key] = _summarize(per_rank, variants(cfg, curves=curves), curves)
            res["load"][key] = [start, C.loadavg()]
            res.setdefault("drops", {})[key] = [s.drops(i) for i in range(2)]
    res["curve_rate"] = f"{cfg['curve_rate']:g}"
    res["params"] = sum(p.numel() for p in B18._model(cfg).parameters())
    res["wall_s"] = time.perf_counter() - t0
    res["png"] = _plot(res, PNG if size == "full" else None)
    return res


def _plot(res: dict, path: str | None) -> str | None:
    if path is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    v = res["rates"][res["curve_rate"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    tokens = 4 * res["cfg"]["batch"] * res["cfg"]["seq"]
    for name, x in v.items():
        steps, loss, wall = zip(*x["curve"])
        style = "-" if name.startswith("HSDP") else ("--" if "DiLoCo" in name else ":")
        a.plot([s * tokens for s in steps], loss, style, label=name)
        b.plot(wall, loss, style, label=name)
    a.set_xlabel("tokens (all ranks)")
    b.set_xlabel(f"wall-clock s, link {res['curve_rate']} Mbit/s per site's egress")
    for ax in (a, b):
        ax.set_ylabel("eval loss")
        ax.grid(alpha=0.3)
    b.legend(fontsize=7)
    fig.suptitle("B21: two sites, 2 ranks each (python -m bench wan)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(res: dict, command: str, when: str) -> str:
    title = "(B21) Two sites over a rate-limited link: HSDP, compression and DiLoCo"
    head = C.section_header(title, command, when)
    if "skipped" in res:
        return head + f"\nSkipped: {res['skipped']}.\n"
    cfg = res["cfg"]
    head += (
        f"Two network namespaces (one per replica group), 2 gloo ranks in each; dp_inner inside a "
        f"site (loopback), dp_outer across the veth link, each site's egress limited by tbf. "
        f"Llama hidden {cfg['hidden']}, {cfg['layers']} layers ({res['params'] / 1e6:.1f} M "
        f"parameters), {cfg['batch']}x{cfg['seq']} tokens per rank and step, inner "
        f"fh.adamw({cfg['inner_lr']:g}), DiLoCo's outer fh.sgd({cfg['outer_lr']:g}, momentum="
        f"{cfg['outer_momentum']:g}, nesterov=True); a DiLoCo eval loss is the mean of the two "
        f"replicas' own. Run time {res['wall_s']:.0f} s; load "
        f"(1-min average, start/end of each phase): {res['load']}; tbf drops {res['drops']}.\n"
    )
    return head + _steps_table(res) + _curves_table(res) + _estimated_table(res) + _goals(res)


def _medians_at(res: dict, rate: str, name: str) -> dict | None:
    """A variant's median step of each kind at ``rate``; H = ``long_every``'s from H = ``every``'s
    (its sync is the same bytes) where the step-time phase left it out."""
    vs = res["rates"][rate]
    cfg = res["cfg"]
    if name not in vs:
        name = name.replace(f"H={cfg['long_every']}", f"H={cfg['every']}")
    return vs[name]["median"] if name in vs else None


def estimated_time_to_loss(res: dict) -> dict[str, dict[str, float | None]]:
    """``{rate: {variant: seconds to HSDP's final loss}}`` at every rate of the step-time phase:
    the curves' eval loss at each step (the same at any rate: the same batches and arithmetic),
    each step taking that rate's measured median step of its kind (None: never reached)."""
    curves = res["rates"][res["curve_rate"]]
    target = curves["HSDP"]["curve"][-1][1]
    out: dict[str, dict[str, float | None]] = {}
    for rate in res["rates"]:
        if rate == res["curve_rate"]:
            continue
        out[rate] = {}
        for name, x in curves.items():
            med = _medians_at(res, rate, name)
            if med is None:
                continue
            walls = [0.0]
            for kind in x["kinds"]:
                walls.append(walls[-1] + med.get(kind, med.get("quiet", 0.0)))
            hit = next((s for s, loss, _ in x["curve"] if loss <= target), None)
            out[rate][name] = None if hit is None else walls[hit]
    return out


def _estimated_table(res: dict) -> str:
    est = estimated_time_to_loss(res)
    if not est:
        return ""
    rates = list(est)
    rows = []
    for name in res["rates"][res["curve_rate"]]:
        row = [name]
        for rate in rates:
            t, base = est[rate].get(name), est[rate].get("HSDP")
            row.append("never" if t is None else f"{t:.1f} s ({t / base:.2f}x)")
        rows.append(row)
    return (
        "\n### Time-to-loss at the other rates (estimated)\n\nThe curves' loss at each step (the "
        "same at any rate: the same batches and arithmetic), each step taking the rate's measured "
        "median step of its kind (H = 50 at H = 20's: the same sync); seconds to HSDP's final "
        "loss, and against HSDP's at that rate:\n\n"
        + C.table(["variant", *(r if r == "unlimited" else f"{r} Mbit/s" for r in rates)], rows)
        + "\n"
    )


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.0f}"


def _steps_table(res: dict) -> str:
    rows = []
    for rate, vs in res["rates"].items():
        base = vs["HSDP"]["wall"] / vs["HSDP"]["steps"]  # HSDP's mean step
        for name, x in vs.items():
            m = x["median"]
            sync = m.get("sync") or m.get("land")
            rows.append([
                rate, name, _ms(m.get("quiet")), _ms(sync), _ms(m.get("issue")),
                _ms(m.get("flight")), _ms(x["largest"]),
                f"{(x['wall'] / x['steps']) / base:.2f}x",
                f"{x['link_bytes'] / 1e6:.1f}", f"{x['comm_bytes'] / 1e6:.1f}",
                f"{x['link_bytes'] / x['comm_bytes']:.3f}" if x["comm_bytes"] else "-",
            ])  # fmt: skip
    header = ["Mbit/s", "variant", "step ms, no sync", "sync (or landing) step",
              "issuing step", "step with a sync in flight", "largest step",
              "mean step vs HSDP's", "link MB (both sites)", "comm_log outer MB",
              "link / comm_log"]  # fmt: skip
    return (
        "\n### Step times (medians of each kind of step, the first left out)\n\n"
        + C.table(header, rows)
        + "\n"
    )


def _curves_table(res: dict) -> str:
    vs = res["rates"][res["curve_rate"]]
    target = vs["HSDP"]["curve"][-1][1]
    hsdp_wall = _time_to_loss(vs["HSDP"], target)[0]  # its first eval at its final loss
    rows = []
    for name, x in vs.items():
        t, reached = _time_to_loss(x, target)
        ratio = "never" if t is None else f"{t / hsdp_wall:.3f}"
        rows.append([name, f"{x['curve'][-1][1]:.3f}", f"{x['wall']:.1f}",
                     "-" if t is None else f"{t:.1f}", ratio, f"{reached:.3f}",
                     f"{x['link_bytes'] / 1e6:.0f}"])  # fmt: skip
    header = [
        "variant",
        "final eval loss",
        "wall-clock s",
        "s to HSDP's final loss",
        "vs HSDP's wall-clock",
        "loss there (or last)",
        "link MB",
    ]
    png = res["png"]
    return (
        f"\n### Time-to-loss at {res['curve_rate']} Mbit/s ({res['cfg']['steps']} steps of each "
        f"HSDP variant, {res['cfg']['diloco_steps']} of each DiLoCo one; "
        f"HSDP's final eval loss {target:.3f}; evals every {res['cfg']['eval_every']} steps, "
        "not timed)\n\n" + C.table(header, rows)
        + (f"\n\nPlots: `{os.path.relpath(png, C.BENCH_DIR)}`.\n" if png else "\n")
    )  # fmt: skip


def goals(res: dict) -> dict[str, tuple[float, float, bool]]:
    """The issue's goals at the curves' rate: ``{goal: (value, bound, met)}``."""
    vs = res["rates"][res["curve_rate"]]
    out = {}
    hsdp = vs["HSDP"]["median"]["sync"]
    if "HSDP int8" in vs:
        x = vs["HSDP int8"]
        r = x["median"]["sync"] / hsdp
        out["HSDP int8 step <= 0.35x HSDP's"] = (r, 0.35, r <= 0.35)
        call = x["wall"] - x["steps"] * _quiet_compute(vs)
        share = x["codec"] / call if call > 0 else float("nan")
        out["int8 codec <= 10 % of the compressed reduction"] = (share, 0.10, share <= 0.10)
    for name, x in vs.items():
        if name.startswith("Streaming"):
            m = x["median"]
            worst = max(m.get(k, 0.0) for k in ("issue", "flight", "land"))
            r = worst / m.get("quiet", float("nan"))
            out[f"{name}: steps with a sync in flight / without (within 5 %)"] = (r, 1.0, r <= 1.05)
            whole = _whole_sync(vs)
            extra = x["largest"] - m.get("quiet", float("nan"))
            f = x["fragments"]
            out[f"{name}: largest step's extra <= 1/F of a whole sync"] = (
                extra / whole,
                1 / f,
                extra <= whole / f,
            )
    target = vs["HSDP"]["curve"][-1][1]
    hsdp_wall = _time_to_loss(vs["HSDP"], target)[0]
    best = min(((_time_to_loss(x, target)[0] or float("inf")) / hsdp_wall)
               for n, x in vs.items() if x["every"])  # fmt: skip
    out["best DiLoCo time-to-loss <= 1/5 of HSDP's"] = (best, 0.2, best <= 0.2)
    return out


def _plain_diloco(vs: dict) -> dict:
    """The first DiLoCo variant that syncs the whole model, uncompressed, at once (H=every's)."""
    return next(x for x in vs.values() if x["every"] and x["fragments"] == 1
                and x["delay"] == 0 and x["compress"] == "none")  # fmt: skip


def _quiet_compute(vs: dict) -> float:
    """A step's compute alone: the median step of that DiLoCo variant without a sync."""
    return _plain_diloco(vs)["median"]["quiet"]


def _whole_sync(vs: dict) -> float:
    """A whole (F = 1, uncompressed) DiLoCo sync's time: its sync step less a quiet one."""
    m = _plain_diloco(vs)["median"]
    return m["sync"] - m["quiet"]


def _goals(res: dict) -> str:
    rows = [[g, f"{v:.3f}", f"{b:.3f}", "met" if ok else "NOT met"]
            for g, (v, b, ok) in goals(res).items()]  # fmt: skip
    return "\n### Goals (issue 46)\n\n" + C.table(["goal", "measured", "bound", ""], rows) + "\n"

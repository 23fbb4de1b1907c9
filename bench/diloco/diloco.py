"""B18: DiLoCo and Streaming DiLoCo against HSDP on real text, at the same token budget.

Data: the Python standard library's own ``.py`` files (``sysconfig.get_paths()["stdlib"]``,
sorted by path, read as bytes: byte-level tokens, vocabulary 256), the first 90 % of the
bytes for training and the last 10 % for evaluation (fixed). Model: a small transformers
``LlamaForCausalLM`` (random init from a config, the same weights on every rank) through
``fh.shard_module`` (a unit per decoder layer) + ``fh.functional_call(into=MainGrad)`` on 4
gloo ranks, 2x2 (2 replicas x 2 inner), inner optimizer ``fh.adamw`` (HSDP's too; a constant
learning rate, or warmup and cosine decay). Variants: HSDP; the inner loop alone (FSDP within
each replica, never a sync: the step a step without a sync is held to); DiLoCo with H in {5, 20, 50}
(outer ``fh.sgd(lr, momentum, nesterov=momentum > 0)``, the same for every DiLoCo variant;
the full size's: ``fh.sgd(1.0)``, the replicas' mean, see bench/RESULTS.md); Streaming
DiLoCo (H = 20, F = 4, delay 1), its fragments contiguous (``fragments=4``) or balanced
by bytes (``fh.balanced_fragments``). Each rank draws its own batches; every variant sees the
same batches. Reported: eval loss curves (the mean of the two replicas' losses; plot
``bench/diloco.png``), ``dp_outer`` bytes per step from ``comm_log`` (mean and the largest
single step), step time (median; steps without a sync apart), the per-rank bytes DiLoCo
keeps besides HSDP's (anchor + outer momentum, and with a delay the syncs held or in
flight), and the peak step memory per rank (each variant in 4 fresh processes of its own,
every variant over the same first steps: torch's allocation events, and the RSS high-water
mark with glibc mmapping allocations >= 64 KiB; see :func:`_memory`).
"""

from __future__ import annotations

import gc
import os
import statistics
import sysconfig
import time

import optree
import torch
import torch.nn.functional as F

from .. import common as C

AXES = ("dp_outer", "dp_inner")
INNER = -1  # a variant's ``every`` for the inner loop alone: replicas that never meet
PNG = os.path.join(C.BENCH_DIR, "diloco.png")
SIZES = {
    "tiny": dict(steps=6, seq=32, batch=2, hidden=32, layers=1, eval_every=3, eval_batches=2,
                 paired_steps=4,
                 data_mb=0.2, inner_lr=3e-3, warmup=0, outer_lr=0.7, outer_momentum=0.9,
                 variants=(("hsdp", 0, 1, 0), ("inner only", INNER, 1, 0), ("H=2", 2, 1, 0),
                           ("H=2 F=2 balanced", 2, ("balanced", 2), 1))),
    "full": dict(steps=800, seq=64, batch=4, hidden=64, layers=2, eval_every=40, eval_batches=8,
                 paired_steps=120,
                 data_mb=4.0, inner_lr=3e-3, warmup=0, outer_lr=1.0, outer_momentum=0.0,
                 variants=(("hsdp", 0, 1, 0), ("inner only (no sync)", INNER, 1, 0),
                           ("DiLoCo H=5", 5, 1, 0), ("DiLoCo H=20", 20, 1, 0),
                           ("DiLoCo H=50", 50, 1, 0), ("Streaming H=20 F=4 tau=1", 20, 4, 1),
                           ("Streaming H=20 F=4 tau=1 balanced", 20, ("balanced", 4), 1))),
}  # fmt: skip


def _text(mb: float) -> torch.Tensor:
    root = sysconfig.get_paths()["stdlib"]
    out, total = [], 0
    for dirpath, dirnames, files in sorted(os.walk(root)):
        dirnames.sort()
        if "site-packages" in dirpath:
            continue
        for name in sorted(files):
            if name.endswith(".py"):
                with open(os.path.join(dirpath, name), "rb") as f:
                    data = f.read()
                out.append(data)
                total += len(data)
                if total >= mb * 2**20:
                    return torch.frombuffer(bytearray(b"".join(out)), dtype=torch.uint8).long()
    return torch.frombuffer(bytearray(b"".join(out)), dtype=torch.uint8).long()


def _model(cfg: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    h = cfg["hidden"]
    return LlamaForCausalLM(
        LlamaConfig(vocab_size=256, hidden_size=h, intermediate_size=2 * h,
                    num_hidden_layers=cfg["layers"], num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=cfg["seq"], use_cache=False)
    )  # fmt: skip


def _batch(data: torch.Tensor, gen: torch.Generator, cfg: dict) -> torch.Tensor:
    starts = torch.randint(len(data) - cfg["seq"] - 1, (cfg["batch"],), generator=gen)
    return torch.stack([data[s : s + cfg["seq"] + 1] for s in starts.tolist()])


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def _inner_lr(cfg: dict):
    """The inner learning rate: constant, or linear warmup then cosine decay to 10 %."""
    import functional_hsdp as fh

    if not cfg["warmup"]:
        return cfg["inner_lr"]
    lr = cfg["inner_lr"]
    return fh.schedules.warmup_cosine_decay(0.0, lr, cfg["warmup"], cfg["steps"], 0.1 * lr)


class _Run:
    """One variant on this rank: the model's shards, MainGrad, inner AdamW, DiLoCo state."""

    def __init__(self, cfg: dict, every: int, fragments: int, delay: int):
        import functional_hsdp as fh

        mesh = fh.DistMesh(C.device_mesh((2, 2), AXES))
        spec = fh.hsdp(mesh, *AXES)
        self.model = model = _model(cfg)
        inner = fh.replicas(spec, AXES[0]) if every else spec
        self.shards, tree_spec = fh.shard_module(model, inner, units=list(model.model.layers))
        self.dl = None
        if every > 0:
            m = cfg["outer_momentum"]
            outer = fh.sgd(cfg["outer_lr"], momentum=m, nesterov=m > 0)
            if isinstance(fragments, tuple):  # ("balanced", F): labels by bytes
                fragments = fh.balanced_fragments(self.shards, fragments[1])
            self.dl = fh.diloco(spec, axis="dp_outer", every=every, outer=outer,
                                fragments=fragments, delay=delay)  # fmt: skip
        self.mg = fh.MainGrad(tree_spec, like=self.shards)
        self.opt = fh.adamw(lr=_inner_lr(cfg), weight_decay=0.0)
        self.opt_state = self.opt.init(self.shards)
        self.state = self.dl.init(self.shards) if self.dl else None

    def _loss(self, s, ids):
        import functional_hsdp as fh

        return _loss(fh.functional_call(self.model, s, (ids,), into=self.mg).logits, ids)

    def step(self, ids: torch.Tensor) -> int:
        """One inner step and ``dl.update``; returns the bytes this rank sent over dp_outer."""
        import functional_hsdp as fh

        with fh.comm_log() as log:
            self.mg.begin_microbatch(last=True)
            torch.func.grad(self._loss)(self.shards, ids)
            self.mg.finish()
            updates, self.opt_state = self.opt.update(self.mg.grads, self.opt_state, self.shards)
            for p, u in zip(optree.tree_leaves(self.shards), optree.tree_leaves(updates)):
                p.add_(u)
            del updates
            self.mg.zero_grad()
            if self.dl:
                with torch.profiler.record_function(_UPDATE):  # a mark for _memory
                    new, self.state = self.dl.update(self.shards, self.state)
                    for p, q in zip(optree.tree_leaves(self.shards), optree.tree_leaves(new)):
                        if p is not q:
                            p.copy_(q)
                    del new
        return sum(e.numel * e.dtype.itemsize for e in log.events if e.axis == "dp_outer")

    def drain(self) -> None:
        """Waits for every sync still in flight (its all-reduces done, its buffers owned by
        this thread), so that no gloo thread frees a tensor once the caller moves on: one
        doing so while a memory profiler stops crashed the process (a segfault in
        ``profile.__exit__`` on CI)."""
        for sync in self.state.flight if self.state is not None else ():
            if sync is not None:
                sync.result()

    def evaluate(self, evals: list) -> float:
        import functional_hsdp as fh

        with torch.no_grad():
            return statistics.mean(
                _loss(fh.functional_call(self.model, self.shards, (ids,)).logits, ids).item()
                for ids in evals
            )


def _variant(cfg: dict, every: int, fragments: int, delay: int, text: torch.Tensor) -> dict:
    run = _Run(cfg, every, fragments, delay)
    split = int(0.9 * len(text))
    train, held = text[:split], text[split:]
    gen = torch.Generator().manual_seed(1000 + C.rank())
    eval_gen = torch.Generator().manual_seed(7)
    evals = [_batch(held, eval_gen, cfg) for _ in range(cfg["eval_batches"])]
    curve, outer_bytes, times = [], [], []
    for step in range(1, cfg["steps"] + 1):
        ids = _batch(train, gen, cfg)
        C.barrier()
        t0 = time.perf_counter()
        outer_bytes.append(run.step(ids))
        times.append(time.perf_counter() - t0)
        if step % cfg["eval_every"] == 0:
            curve.append((step, run.evaluate(evals)))
    kept = pending = 0
    if run.dl:
        kept = _nbytes(run.state.anchor)
        for s in run.state.outer.inner.values():
            kept += _nbytes(s.momentum)
        if run.state.pending is not None:  # held (MaskedNode leaves have none) and in flight
            pending = _nbytes(run.state.pending)
            pending += sum(_nbytes(s.result()) for s in run.state.flight if s is not None)
    return dict(curve=curve, outer_bytes=outer_bytes, times=times, kept=kept, pending=pending,
                shard_bytes=_nbytes(run.shards))  # fmt: skip


def _nbytes(tree) -> int:
    return sum(x.numel() * x.element_size() for x in optree.tree_leaves(tree))


def _count(fragments) -> int:
    """F of a variant's fragments: an int, or ("balanced", F)."""
    return fragments[1] if isinstance(fragments, tuple) else fragments


def _sync_steps(every: int, fragments, delay: int, steps: int) -> list[bool]:
    """Per step 1..steps: whether a fragment's sync is issued or lands after it."""
    if not every:
        return [True] * steps  # HSDP's outer all-reduce runs every step
    if every == INNER:
        return [False] * steps
    import functional_hsdp as fh

    issued = fh.sync_steps(every, _count(fragments), steps)
    return [bool(issued[t]) or (t >= delay and bool(issued[t - delay])) for t in range(steps)]


_MARK, _UPDATE = "diloco_bench_step_", "diloco_bench_update"


def _peaks(events: list, windows: list) -> tuple[list[int], list[int]]:
    """Live tensor bytes from allocation events ``(ns, +-bytes)`` in order: the largest in each
    window ``(start_ns, end_ns)``, and the bytes live when each window starts."""
    peaks, starts, live, i = [], [], 0, 0
    for start, end in windows:
        while i < len(events) and events[i][0] < start:
            live += events[i][1]
            i += 1
        starts.append(live)
        top = live
        while i < len(events) and events[i][0] <= end:
            live += events[i][1]
            top = max(top, live)
            i += 1
        peaks.append(top)
    return peaks, starts


def _paired(events: list, windows: list) -> tuple[list, int, int, list[bool]]:
    """The profiler's allocation events ``(ns, address, +-bytes)`` (sorted) as ``(ns,
    +-bytes)`` with every allocation's free, for :func:`_peaks`; the bytes and number of
    the frees the profiler missed; and per window (step, in time order) whether it
    allocated a buffer whose free was missed (its peak may then count that buffer for
    longer than it lived).

    The profiler misses some frees: an allocation whose address is allocated again with no
    free reported between. They are buffers of the collectives (the unit gather's and the
    reduce's flat inputs, 65-150 kB here), most likely freed off the main thread (the last
    reference going with gloo's work), where no free is reported. Summing the events as
    they come keeps each such buffer live to the end of the profile: a creep that lands on
    whichever variant it hits, at random (in a probe it put HSDP's own median step peak 7x
    the shard bytes higher; it is what made DiLoCo's 2.8-4.2x over HSDP's in a run of the
    whole bench). Every step waits for its collectives, so such a buffer is taken as freed
    at the end of the step that allocated it (one made outside a step, before the next
    step), or when its address is allocated again if sooner. An allocation made in a step
    and neither freed nor reused by the end of the profile (which deletes the run and
    collects garbage first) is such a buffer too. A free of an allocation made before the
    profile started is dropped (not counted negative)."""

    def freed_by(t0: int, t: int) -> int:  # the end of t0's step, or the next one's start
        k = next(((a, b) for a, b in windows if b >= t0), (t, t))
        return min(k[1] if k[0] <= t0 else k[0], t)

    out, live, lost, n, hit = [], {}, 0, 0, [False] * len(windows)
    for t, ptr, nbytes in events:
        if nbytes > 0:
            if ptr in live:  # freed unseen, before this allocation
                t0, size = live.pop(ptr)
                out.append((freed_by(t0, t), -size))
                lost, n = lost + size, n + 1
                for k, (a, b) in enumerate(windows):
                    hit[k] = hit[k] or a <= t0 <= b
            live[ptr] = (t, nbytes)
            out.append((t, nbytes))
        elif ptr in live:
            out.append((t, -live.pop(ptr)[1]))
    for t0, size in live.values():  # still live after the run was deleted and collected
        k = next((k for k, (a, b) in enumerate(windows) if a <= t0 <= b), None)
        if k is not None:  # made in a step: a free the profiler missed, never reused
            out.append((windows[k][1], -size))
            lost, n, hit[k] = lost + size, n + 1, True
    return sorted(out), lost, n, hit


def _exact(mem: dict, kind: str) -> list[int]:
    """The steps whose ``kind`` peak counts: every step for the RSS; for the tensors, the
    steps that allocated no buffer whose free the profiler missed (every step if all did)."""
    steps = range(len(mem["synced"]))
    if kind != "torch":
        return list(steps)
    return [k for k in steps if not mem["torch_missed"][k]] or list(steps)


def _allocations(prof) -> tuple[list, dict, list]:
    """From a finished profile: CPU allocation events ``(ns, address, +-bytes)`` sorted, the
    step windows by index, and ``dl.update``'s windows."""
    from torch._C._profiler import _EventType

    events, windows, updates = [], {}, []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        n = stack.pop()
        stack.extend(n.children)
        if n.tag == _EventType.Allocation:
            f = n.extra_fields
            if str(f.device).startswith("cpu"):
                events.append((n.start_time_ns, f.ptr, f.alloc_size))
        elif n.name == _UPDATE:
            updates.append((n.start_time_ns, n.end_time_ns))
        elif n.name.startswith(_MARK):
            windows[int(n.name[len(_MARK) :])] = (n.start_time_ns, n.end_time_ns)
    return sorted(events), windows, sorted(updates)


def _memory(
    cfg: dict, every: int, fragments: int, delay: int, text: torch.Tensor, steps: int
) -> dict:
    """One variant's peak step memory on this rank over its first ``steps`` steps (every
    variant the same steps and batches, as many as the longest period takes to sync: its
    every + delay + 1), measured twice, each from before the variant is built:

    - ``torch``: tensor bytes: the profiler's allocation events (``profile_memory``), live
      bytes summed in order (every allocation paired with its free, :func:`_paired`: the
      frees the profiler misses made good); per step the largest sum in it, counted from
      before the build (so it includes the params, the inner and outer optimizer states and
      MainGrad's buffers). ``missed_bytes``/``missed_frees``: the frees made good;
      ``torch_missed``: per step, whether it allocated such a buffer (its peak is then
      left out of the summaries, :func:`_exact`).
    - ``rss``: the process's resident set: per step ``VmHWM`` (reset before the step) minus
      the RSS before the build, glibc mmapping every allocation of 64 KiB or more (so freed
      tensors leave the RSS; smaller ones stay in its heap) and trimming what is freed.
    """
    from torch.profiler import ProfilerActivity, profile

    synced = _sync_steps(every, fragments, delay, steps)
    gen = torch.Generator().manual_seed(1000 + C.rank())
    batches = [_batch(text, gen, cfg) for _ in range(steps)]
    out = {"synced": synced}
    with C.frozen():  # the RSS pass first, then the same steps under the profiler
        C.barrier()
        idle = C.settle()
        run = _Run(cfg, every, fragments, delay)
        rss = []
        for ids in batches:
            C.barrier()
            C.reset_peak()
            run.step(ids)
            rss.append(C.status("VmHWM") - idle)
        out["rss"], out["rss_held"] = rss, C.settle() - idle
        run.drain()
        del run
        C.settle()
        C.barrier()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            run = _Run(cfg, every, fragments, delay)
            for k, ids in enumerate(batches):
                with torch.profiler.record_function(f"{_MARK}{k}"):
                    run.step(ids)
            run.drain()  # nothing in flight while the profiler stops
            del run
            gc.collect()
            C.barrier()
    events, windows, updates = _allocations(prof)
    steps_ns = [windows[k] for k in range(steps)]
    events, out["missed_bytes"], out["missed_frees"], out["torch_missed"] = _paired(
        events, steps_ns
    )
    out["torch"], held = _peaks(events, steps_ns)
    out["torch_held"] = held[0]
    top, start = _peaks(events, updates)
    out["update_extra"] = max((a - b for a, b in zip(top, start)), default=0)
    out["update_peak"] = max(top, default=0)
    return out


def _task(cfg: dict) -> dict:
    text = _text(cfg["data_mb"])
    out = {
        name: _variant(cfg, every, fragments, delay, text)
        for name, every, fragments, delay in cfg["variants"]
    }
    return out


def _paired_task(cfg: dict, every: int, fragments: int, delay: int) -> list[tuple[float, float]]:
    """Step times of the inner loop alone and of a DiLoCo variant, the two stepped in
    alternation (A B B A ...) on the same batches, so that load that drifts during the run
    falls on both alike; the steps where the variant issues or lands a sync are left out."""
    train = _text(cfg["data_mb"])
    train = train[: int(0.9 * len(train))]
    alone, run = _Run(cfg, INNER, 1, 0), _Run(cfg, every, fragments, delay)
    gen = torch.Generator().manual_seed(2000 + C.rank())
    busy = _sync_steps(every, fragments, delay, cfg["paired_steps"])
    out = []
    for t in range(cfg["paired_steps"]):
        ids = _batch(train, gen, cfg)
        took = {}
        for which, r in (("alone", alone), ("run", run))[:: 1 if t % 2 == 0 else -1]:
            C.barrier()
            t0 = time.perf_counter()
            r.step(ids)
            took[which] = time.perf_counter() - t0
        if not busy[t]:
            out.append((took["alone"], took["run"]))
    return out


def _memory_task(cfg: dict, every: int, fragments: int, delay: int) -> dict:
    """One variant's :func:`_memory` on this rank (in processes of its own, unless a pool)."""
    steps = max(every + delay + 1 for _, every, _, delay in cfg["variants"])
    train = _text(cfg["data_mb"])
    train = train[: int(0.9 * len(train))]
    # A warm-up first: the process's one-time costs (gloo's first collectives, the
    # library's and torch's lazy set-ups) are not the variant's step memory.
    warm, gen = _Run(cfg, every, fragments, delay), torch.Generator().manual_seed(0)
    for _ in range(2):
        warm.step(_batch(train, gen, cfg))
    warm.drain()
    del warm
    C.set_malloc()  # mmap allocations >= 64 KiB, trim what is freed
    return _memory(cfg, every, fragments, delay, train, steps)


def run(size: str = "full", pool=None, cfg: dict | None = None) -> dict:
    cfg = cfg or SIZES[size]
    per_rank = C.on_ranks(pool, _task, cfg)
    # Memory: each variant in 4 fresh processes (unless a pool is given), so that none
    # inherits the heap, caches or late frees of the timed runs or of the variants before
    # it (the RSS in one process set depended on the order: HSDP's 8.8 MB measured first,
    # 15.3 MB measured last).
    for name, every, fragments, delay in cfg["variants"] if cfg.get("memory", True) else ():
        for r, m in zip(per_rank, C.on_ranks(pool, _memory_task, cfg, every, fragments, delay)):
            r[name]["memory"] = m
    paired = {  # rank 0's pairs: (inner loop alone, the variant), steps without a sync
        name: C.on_ranks(pool, _paired_task, cfg, every, fragments, delay)[0]
        for name, every, fragments, delay in cfg["variants"]
        if every > 0
    }
    res = {"cfg": {k: v for k, v in cfg.items() if k != "variants"}, "variants": {}}
    tokens = cfg["steps"] * cfg["batch"] * cfg["seq"] * 4
    for name, every, fragments, delay in cfg["variants"]:
        r0, r2 = per_rank[0][name], per_rank[2][name]
        curve = [(s, (a + b) / 2) for (s, a), (_, b) in zip(r0["curve"], r2["curve"])]
        ob = [sum(r[name]["outer_bytes"][t] for r in per_rank[:2]) for t in range(cfg["steps"])]
        synced = [t for t, b in enumerate(ob) if b]
        quiet = [t for t in range(cfg["steps"]) if t not in synced]
        times = r0["times"]
        res["variants"][name] = dict(
            every=every, fragments=_count(fragments), balanced=isinstance(fragments, tuple),
            delay=delay, curve=curve, tokens=tokens,
            bytes_per_step=sum(ob) / len(ob), max_step_bytes=max(ob), quiet_nonzero=sum(
                1 for t in quiet if ob[t]), syncs=len(synced),
            step_quiet=statistics.median(times[t] for t in quiet) if quiet else None,
            step_sync=statistics.median(times[t] for t in synced) if synced else None,
            kept=r0["kept"], pending=r0["pending"], shard_bytes=r0["shard_bytes"],
            memory=_memory_summary([r[name] for r in per_rank]),
            paired=dict(alone=statistics.median(a for a, _ in paired[name]),
                        run=statistics.median(b for _, b in paired[name]),
                        steps=len(paired[name])) if paired.get(name) else None,
        )  # fmt: skip
    base = [r["hsdp"] for r in per_rank]
    measured = res["variants"].items() if cfg.get("memory", True) else ()
    for name, v in measured:  # per rank against HSDP's: the peaks' difference, in shard bytes
        for kind in ("torch", "rss"):
            tops, diffs, lows = [], [], []
            for r, b in zip(per_rank, base):
                m, h, s = r[name]["memory"], b["memory"], r[name]["shard_bytes"]
                mk, hk = _exact(m, kind), _exact(h, kind)
                both = [k for k in mk if k in hk] or mk
                tops.append((max(m[kind][k] for k in mk) - max(h[kind][k] for k in hk)) / s)
                lows.append((min(m[kind][k] for k in mk) - min(h[kind][k] for k in hk)) / s)
                # step by step, the same batches
                diffs.append(statistics.median(m[kind][k] - h[kind][k] for k in both) / s)
            v["memory"][f"{kind}_over_hsdp"] = max(tops)
            v["memory"][f"{kind}_over_hsdp_median"] = max(diffs)
            v["memory"][f"{kind}_over_hsdp_low"] = max(lows)
        v["memory"]["held_over_hsdp"] = max(
            (r[name]["memory"]["torch_held"] - b["memory"]["torch_held"]) / r[name]["shard_bytes"]
            for r, b in zip(per_rank, base)
        )
    res["png"] = _plot(res) if size == "full" else None
    return res


def _memory_summary(ranks: list[dict]) -> dict:
    """The largest over the ranks: peak of any step, of sync steps, of the others; held
    (the tensors' peaks over the steps :func:`_exact` keeps)."""
    if "memory" not in ranks[0]:
        return {}
    out = {"steps": len(ranks[0]["memory"]["synced"])}
    out["missed_steps"] = sum(sum(r["memory"]["torch_missed"]) for r in ranks)
    out["missed_bytes"] = max(r["memory"]["missed_bytes"] for r in ranks)
    synced = ranks[0]["memory"]["synced"]
    for kind in ("torch", "rss"):
        per = [[r["memory"][kind][k] for k in _exact(r["memory"], kind)] for r in ranks]
        flags = [[synced[k] for k in _exact(r["memory"], kind)] for r in ranks]
        out[kind] = max(max(p) for p in per)
        both = [(x, s) for p, f in zip(per, flags) for x, s in zip(p, f)]
        sync = [x for x, s in both if s]
        out[f"{kind}_sync"] = max(sync) if sync else None
        quiet = [x for x, s in both if not s]
        out[f"{kind}_quiet"] = max(quiet) if quiet else None
        out[f"{kind}_held"] = max(r["memory"][f"{kind}_held"] for r in ranks)
        out[f"{kind}_median"] = max(statistics.median(p) for p in per)
        out[f"{kind}_low"] = max(min(p) for p in per)
    for key in ("update_extra", "update_peak"):
        out[key] = max(r["memory"][key] for r in ranks)
    return out


def _plot(res: dict) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, v in res["variants"].items():
        steps, losses = zip(*v["curve"])
        ax.plot(steps, losses, label=name)
    ax.set_xlabel("inner step (same tokens for every variant)")
    ax.set_ylabel("eval loss (stdlib bytes, mean of replicas)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(PNG, dpi=100)
    plt.close(fig)
    return PNG


def report(res: dict, command: str, when: str) -> str:
    v = res["variants"]
    base = v["hsdp"]
    rows = []
    for name, x in v.items():
        final = x["curve"][-1][1]
        rel = (final - base["curve"][-1][1]) / base["curve"][-1][1]
        ratio = x["bytes_per_step"] / base["bytes_per_step"] if base["bytes_per_step"] else 0
        q = "n/a" if x["step_quiet"] is None else f"{1e3 * x['step_quiet']:.0f}"
        s = "n/a" if x["step_sync"] is None else f"{1e3 * x['step_sync']:.0f}"
        rows.append(
            f"| {name} | {final:.3f} ({rel:+.1%}) | {x['bytes_per_step'] / 1e3:.1f} kB "
            f"({ratio:.3f}x) | {x['max_step_bytes'] / 1e3:.1f} kB | {x['quiet_nonzero']} | "
            f"{q} / {s} | {x['kept'] / max(x['shard_bytes'], 1):.2f}x |"
        )
    cfg = res["cfg"]
    title = "(B18) DiLoCo and Streaming DiLoCo against HSDP on the stdlib's .py bytes (2x2 gloo)"
    lr = f"fh.adamw({cfg['inner_lr']:g})"
    if cfg["warmup"]:
        lr = (f"fh.adamw(warmup_cosine_decay(0, {cfg['inner_lr']:g}, warmup {cfg['warmup']}, "
              f"to 10 % at step {cfg['steps']}))")  # fmt: skip
    return (
        C.section_header(title, command, when)
        + f"\nLlama (hidden {cfg['hidden']}, {cfg['layers']} layers, vocab 256), "
        f"{cfg['steps']} steps of {cfg['batch']}x{cfg['seq']} tokens per rank (the same tokens "
        f"for every variant), inner {lr} (HSDP's optimizer too), outer {_outer(cfg)} (every "
        "DiLoCo variant).\n\n"
        "| variant | final eval loss (vs HSDP) | dp_outer bytes/step, 2 inner ranks (vs HSDP) "
        "| largest step | outer collectives on steps without a sync | median step ms "
        "(no sync / sync) | DiLoCo state / shard bytes |\n|---|---|---|---|---|---|---|\n"
        + "\n".join(rows)
        + f"\n\nEval curves: `{os.path.relpath(res['png'], C.BENCH_DIR) if res['png'] else '-'}`."
        + "\n\n"
        + _memory_table(res)
        + _goals(v)
    )


def _outer(cfg: dict) -> str:
    if cfg["outer_momentum"]:
        return f"fh.sgd({cfg['outer_lr']:g}, momentum={cfg['outer_momentum']:g}, nesterov=True)"
    return f"fh.sgd({cfg['outer_lr']:g}) (no momentum: at lr 1, the replicas' mean)"


def _memory_table(res: dict) -> str:
    v = res["variants"]
    if not v["hsdp"]["memory"]:
        return ""
    steps = v["hsdp"]["memory"]["steps"]
    rows = []
    for name, x in v.items():
        m, shard = x["memory"], x["shard_bytes"]
        quiet = "n/a" if m["torch_quiet"] is None else f"{m['torch_quiet'] / 1e3:.0f}"
        sync = "n/a" if m["torch_sync"] is None else f"{m['torch_sync'] / 1e3:.0f}"
        update = (
            f"{m['update_extra'] / 1e3:.0f} / {m['update_peak'] / 1e3:.0f}"
            if x["every"] > 0
            else "-"
        )
        rows.append(
            f"| {name} | {m['torch_held'] / 1e3:.0f} ({m['held_over_hsdp']:+.2f}) | "
            f"{m['torch'] / 1e3:.0f} ({sync} / {quiet}) | "
            f"{m['torch_median'] / 1e3:.0f} | {m['torch_low'] / 1e3:.0f} "
            f"({m['torch_over_hsdp_low']:+.2f}) | {m['torch_over_hsdp']:+.2f} "
            f"({m['torch_over_hsdp_median']:+.2f}) | {update} | "
            f"{m['rss'] / 1e3:.0f} | {m['rss_over_hsdp']:+.2f} | "
            f"{m['missed_steps']} ({m['missed_bytes'] / 1e3:.0f}) |"
        )
    shard = v["hsdp"]["shard_bytes"]
    return (
        f"Peak step memory per rank (the largest over the 4 ranks; every variant measured over "
        f"its first {steps} steps, the same batches, each variant in 4 fresh processes of "
        "its own). Tensors: torch's allocation events (`torch.profiler`, `profile_memory`) "
        "summed in order from before the variant was built, so params, inner AdamW moments, "
        "MainGrad's buffers and the DiLoCo state are in. The profiler misses some frees "
        "(collectives' flat input buffers, 65-150 kB, most likely freed on gloo's thread: "
        "their address is allocated again with no free reported); summed as reported, "
        "each would stay live to the end of the profile and raise every later step's peak, "
        "HSDP's as much as DiLoCo's, at random. Such a buffer is taken as freed at the end "
        "of its step, and the steps that allocated one are left out of the peaks (last "
        "column: how many, over the 4 ranks, and the most bytes of missed frees on a rank). "
        "What is left varies a little with timing (about 0.15 MB between steps of the same "
        "variant, HSDP's too: when a gather's buffer is freed against the peak; it only ever "
        "adds), so the lowest step peak (every step allocates the same tensors here) is the "
        "figure free of timing; the held bytes and `dl.update`'s own peak are stable too. "
        "RSS: `VmHWM` (reset "
        "with `/proc/self/clear_refs` before each step) minus the RSS before the variant was "
        "built, the workers' glibc set (`mallopt`, as `MALLOC_MMAP_THRESHOLD_=65536` would) "
        "to mmap allocations of 64 KiB or more and to trim freed memory; smaller tensors "
        "(most shards of this model) stay in glibc's heap once freed, so the RSS is coarser. "
        "'over HSDP': per rank, minus HSDP's, in shard bytes (one rank's param shard: "
        f"{shard / 1e3:.0f} kB); in brackets the median over the steps of the difference "
        "step by step (the same batch). The goal allows +2.00 (anchor + outer momentum).\n\n"
        "| variant | tensors held before a step, kB (over HSDP, x shard) | peak step, kB (sync "
        "steps / others) | median step peak, kB | lowest step peak, kB (over HSDP, x shard) "
        "| peak over HSDP, x shard (step by step) | "
        "`dl.update`: extra / peak, kB | peak RSS, kB | RSS over HSDP, x shard | steps left "
        f"out of {4 * steps} (missed frees, kB) |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
    )


def _goals(v: dict) -> str:
    """The goals of issue 37, each stated met or not from this run's figures."""
    base, out = v["hsdp"], []
    for name, x in v.items():
        if x["every"] <= 0:
            continue
        ratio = x["bytes_per_step"] / base["bytes_per_step"]
        want = 1 / x["every"]
        out.append(f"{name}: outer bytes/step {ratio:.4f}x HSDP's (1/H = {want:.4f})")
        if x["fragments"] > 1:
            whole = max(y["max_step_bytes"] for y in v.values() if y["fragments"] == 1)
            out.append(
                f"{name}: largest step {x['max_step_bytes'] / whole:.3f} of a whole sync "
                f"(1/F = {1 / x['fragments']:.3f})"
            )
    h20 = next((x for n, x in v.items() if x["every"] == 20 and x["fragments"] == 1), None)
    if h20:
        rel = h20["curve"][-1][1] / base["curve"][-1][1] - 1
        out.append(
            f"eval loss at H=20 {rel:+.1%} of HSDP's at the same tokens: within 5 % "
            + ("met" if abs(rel) <= 0.05 else "NOT met")
        )
    quiet = sum(x["quiet_nonzero"] for x in v.values())
    out.append(f"outer collectives on steps without a sync: {quiet} (goal 0)")
    pairs = {n: x["paired"] for n, x in v.items() if x.get("paired")}
    if pairs:  # against the inner loop alone, stepped in alternation with it (_paired_task)
        slow = [n for n, p in pairs.items() if p["run"] > 1.05 * p["alone"]]
        out.append(
            "median step without a sync vs the inner loop's alone (FSDP within the replica), "
            "the two stepped in alternation on the same batches: "
            + ", ".join(
                f"{n} {1e3 * p['run']:.1f} vs {1e3 * p['alone']:.1f} ms ({p['steps']} steps)"
                for n, p in pairs.items()
            )
            + (": no longer, within 5 %: met" if not slow else f": NOT met for {slow}")
        )
    for n, x in v.items():
        if x["every"] <= 0 or not x["memory"]:
            continue
        m = x["memory"]
        state = (x["kept"] + x["pending"]) / x["shard_bytes"]
        below = m["update_peak"] <= m["torch_median"]
        ok = m["torch_over_hsdp_low"] <= 2
        out.append(
            f"{n}: peak memory <= HSDP's + 2x the shard bytes: {'met' if ok else 'NOT met'} "
            f"on the lowest step peaks (free of timing), {m['torch_over_hsdp_low']:+.2f}x; "
            f"{m['torch_over_hsdp_median']:+.2f}x step by step "
            f"(median; {m['torch_over_hsdp']:+.2f}x the largest, RSS "
            f"{m['rss_over_hsdp']:+.2f}x); of that, tensors held +{m['held_over_hsdp']:.2f}x "
            f"(the DiLoCo state {state:.2f}x{' with the syncs in flight' if x['pending'] else ''}"
            f"), and `dl.update`'s own peak {m['update_peak'] / 1e3:.0f} kB is "
            f"{'below' if below else 'above'} the median step peak "
            f"{m['torch_median'] / 1e3:.0f} kB"
        )
    return "Goals:\n\n" + "\n".join(f"- {line}" for line in out) + "\n"

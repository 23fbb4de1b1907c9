"""B22: the fault-tolerant replica axis under a fixed failure schedule (issue 47).

A torchft lighthouse (``replica_groups.Lighthouse(min_replicas=...)``) and ``groups`` replica
groups of ``ranks`` gloo ranks each, every rank a process of its own with the environment
``torchrun`` gives it plus torchft's (as ``replica_groups.Group`` makes them; here forked from a
:class:`Zygote` that imported torch, transformers and torchft once, so that a restart's process
start is not 2-4 s of imports taken from the survivors' two cores), running
``bench/diloco/faults_worker.py``: B18's Llama on B18's data (the stdlib's ``.py`` bytes)
through ``fh.shard_module`` + ``fh.functional_call(into=MainGrad)``, inner ``fh.adamw``, on
``fh.DistMesh(dm, replicas=fh.fault_tolerant(manager_from_env()))``. Modes: per-step HSDP (a
quorum and a commit per step), DiLoCo every H steps (outer ``fh.sgd(0.7, momentum=0.9,
nesterov=True)``) and Streaming DiLoCo (H, F fragments, delay 1: legal on a fault-tolerant
axis, the delay being below the gap between two syncs, H / F).

Where the machine can make sites (``functional_hsdp.tools.testing.sites.probe()`` is None: root,
``ip``/``tc``, ``tbf``), each replica group runs in a site of its own: group ``g``'s ranks in
the network namespace of site ``g`` (address ``10.213.0.<g+1>`` on its end of the link,
``wan0``), the sites joined by a link whose egress from each site ``tbf`` limits to
``rate_mbit`` (B21's slow rate, 100 Mbit/s), so that a group's inner collectives stay inside
its site and everything between groups (the replica axis's collectives, heals, the lighthouse's
and the managers' traffic) crosses the link, and killing a group is killing every process of
its site. The ranks, forked from the zygote in the machine's namespace, enter their site's
(``sites.enter``) before any socket; each group's store (``MASTER_ADDR``) is its site's address,
``GLOO_SOCKET_IFNAME=wan0``, and its rank 0 advertises its site's address to the lighthouse and
to healing peers (``FH_FT_HOSTNAME``, read by ``replica_groups.manager_from_env``: torchft's
default, the machine's name, would resolve to each namespace's own loopback). The lighthouse
runs in site 0's namespace (group 0 is never killed; a two-site run has no bridge namespace to
put it in), reached by every group at ``10.213.0.1``. The plain world runs across the same
sites (group ``g``'s ranks in site ``g``, its store in site 0). The bytes each run put on the
link are read from the sites' interface counters before and after it. Elsewhere everything
runs over loopback, as it says in its report.

Per mode, two runs of the same steps on the same tokens: **no failure**, and the mode's
**failure schedule**: whole groups killed by pid (SIGKILL) at failure points the worker reaches
(``between`` steps, ``before_quorum``: a DiLoCo sync's step done, its quorum not requested,
``after_quorum``, ``in_collective``: just before the outer collective, and ``in_flight``: a
delayed sync issued, not landed): the dying group writes a marker and stops
there, the harness kills it ``kill_after`` s later and restarts it ``pause`` s after the kill, a
fresh job that heals from live peers at its first quorum. A failure fires at the first such
point at or after its step once the failures before it in the schedule happened and the last
``settle`` quorums had every group and committed (one failure at a time, each after the last
restart is back). Before them one **plain** world (``groups x ranks`` gloo ranks, a
``(groups, ranks)`` device mesh, a plain ``fh.DistMesh``) runs the mode on the same tokens: the
baseline of the step times and of the no-failure run's bits; with ``bracket`` (the full size)
the plain world runs again right after the no-failure run, so that the steady state is
compared with the plain runs on both sides of it, and their own difference is the report's
measure of how much the machine moved meanwhile.

Measured from the workers' logs (wall clock of this one machine, ``time.time()``):

- **goodput**: group 0's (never killed) committed steps per second (DiLoCo: inner steps; their
  progress is kept across a failed sync), from the run's first step to its last, failure run
  against no-failure run (a failure run goes on until the last restart is back);
- **detection**: from a kill to the survivors' next committed step (the later survivor);
- **what a failure costs a survivor**: from its last commit before the kill to its first commit
  after it, less its useful steps in that window at the no-failure run's median step of their
  kind; against the bound: the lighthouse's heartbeat timeout plus one step (DiLoCo: one sync
  period, H quiet steps);
- **heal**: from the restarted group's first quorum request (its process start shown apart) to
  the return of that quorum with the healed trees, the part of it after every group had
  requested that quorum (the rest is waiting for the survivors' next quorum: with DiLoCo their
  next sync; the goal, a heal in under 1 s from the restart's first quorum, is judged on this
  part) and the survivors' own wait in it; heal bytes: the tensors of the trees the group
  received (params, optimizer state, DiLoCo state, data position), over its ranks; for each
  rank, the live groups whose trees at that quorum its healed trees equal bit for bit (torchft
  picks a source per rank: with DiLoCo, whose replicas differ between syncs, a healed group may
  hold a mix of peers); whether its shards equal the others' after its first committed step
  (HSDP) or sync (DiLoCo of one fragment);
- **eval loss** of the copies of the parameters taken at every ``eval_every``-th step (evaluated
  after the run, outside the timed steps; the mean over the groups that hold a copy at that
  step), failure run against no-failure run, at the last step both have;
- **bits**: no failure against the plain DistMesh, every rank's parameter shards after every
  step and the collectives of every step (``fh.comm_log``); with failures, every group's shards
  at every committed HSDP step and after every committed DiLoCo sync (one fragment), all
  equal; HSDP's failure run **replayed from its quorum log in a plain world** (the goal's
  check): ``groups x ranks`` gloo ranks on loopback run each committed torchft step, in
  order, on a plain ``fh.DistMesh`` over that step's participants only (a ``(participants,
  ranks)`` device mesh in the quorum's order; uncommitted steps left out), each participant
  at the data position it used, a group that was not in the step before taking its trees
  from a group that was (``faults_worker``'s ``Worker.replay``): no torchft, no failure, no
  heal; every group's final parameters against the replay's, max abs and bit for bit; and
  the same final parameters against a dense reference replayed in this process (each
  committed step's mean gradient over its participants' batches, ``torch.func.grad`` and
  ``fh.adamw`` on the full parameters), the no-failure run replayed alike as the control of
  that reference's own rounding (it sums in another order than gloo's ring, and Adam
  amplifies the difference over the steps). DiLoCo's replay from the quorum log is the
  tests' (``tests/mesh/test_fault_tolerance.py``), not this benchmark's;
- **steady state**: the median step (the slowest rank's, each rank's first ``skip`` steps left
  out) of the no-failure run against the plain world's (with ``bracket``: the mean of the
  plain runs before and after it, their ratio shown beside): HSDP's steps, DiLoCo's steps
  without a sync; beside it the median CPU time of such a step (``time.process_time()`` of
  the rank's process: every thread, torchft's manager threads included), the work it costs,
  which the other busy processes on the machine move less than the wall time;
- **link bytes** (sites only): per run, what the sites' ends of the link sent (``wan0``'s
  ``tx_bytes`` summed over the sites, Ethernet frames; ``Sites.counters``), and ``tbf``'s drops.

Plot (``bench/faults.png``, full size): per mode, eval loss against wall-clock (both runs, kills
marked) and the participants of each quorum against wall-clock (the failure run, each start of
a group apart). ``FH_B22_KEEP=1`` keeps the workers' logs (their directory is printed).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .. import common as C

PNG = os.path.join(C.BENCH_DIR, "faults.png")
PROCESSES = 6
MODES = ("hsdp", "diloco", "streaming")
NAMES = {"hsdp": "per-step HSDP", "diloco": "DiLoCo", "streaming": "Streaming DiLoCo"}

SIZES = {
    # 2 groups x 1 rank: one kill and one heal per mode, seconds of steps (most of the time is
    # the processes' start: torch, transformers, torchft)
    "tiny": dict(groups=2, ranks=1, min_replicas=1, hidden=32, layers=1, seq=32, batch=2,
                 data_mb=0.2, inner_lr=3e-3, outer_lr=0.7, outer_momentum=0.9, every=4,
                 fragments=2, delay=1, eval_every=4, eval_batches=1, modes=("hsdp", "streaming"),
                 steps={"hsdp": 12, "diloco": 16, "streaming": 16},
                 die={"hsdp": [{"group": 1, "step": 2, "phase": "in_collective"}],
                      "diloco": [{"group": 1, "step": 2, "phase": "in_collective"}],
                      "streaming": [{"group": 1, "step": 2, "phase": "in_flight"}]},
                 timeout=5.0, quorum_timeout=60.0, join_timeout_ms=1000,
                 heartbeat_timeout_ms=2000, kill_after=0.2, pause=2.5, settle=2, skip=2,
                 deadline=240.0, rate_mbit=100.0),
    # 3 groups x 2 ranks, B18's full model (hidden 64, 2 layers, 106,816 parameters); each
    # failure waits for the one before it and for `settle` whole committed quorums after it.
    # rate_mbit: each site's egress on the link where the groups run in sites (B21's slow rate)
    "full": dict(groups=3, ranks=2, min_replicas=2, hidden=64, layers=2, seq=64, batch=4,
                 data_mb=4.0, inner_lr=3e-3, outer_lr=0.7, outer_momentum=0.9, every=20,
                 fragments=4, delay=1, eval_every=20, eval_batches=32, modes=MODES,
                 steps={"hsdp": 500, "diloco": 600, "streaming": 600},
                 die={"hsdp": [{"group": 1, "step": 50, "phase": "in_collective"},
                               {"group": 2, "step": 200, "phase": "after_quorum"},
                               {"group": 1, "step": 350, "phase": "between", "life": 1}],
                      "diloco": [{"group": 1, "step": 50, "phase": "between"},
                                 {"group": 2, "step": 250, "phase": "in_collective"},
                                 {"group": 1, "step": 450, "phase": "before_quorum",
                                  "life": 1}],
                      "streaming": [{"group": 1, "step": 50, "phase": "between"},
                                    {"group": 2, "step": 250, "phase": "in_collective"},
                                    {"group": 1, "step": 450, "phase": "in_flight",
                                     "life": 1}]},
                 timeout=5.0, quorum_timeout=60.0, join_timeout_ms=1000,
                 heartbeat_timeout_ms=2000, kill_after=0.2, pause=3.0, settle=2, skip=5,
                 deadline=1800.0, rate_mbit=100.0, bracket=True),
}  # fmt: skip


def probe() -> str | None:
    """Why this benchmark cannot run here (None: it can)."""
    import importlib.util

    for mod, extra in (("torchft", "pip install -e '.[ft]'"), ("transformers", "B18's model")):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed ({extra})"
    if shutil.which("torchft_lighthouse") is None:
        return "torchft_lighthouse is not on PATH (it ships in the torchft wheel)"
    return None


class Zygote:
    """A process that has imported what a rank needs (torch, transformers' Llama, torchft, the
    library) once and forks each rank from there (``faults_worker.zygote``): a rank's start,
    a restarted group's too, then costs no 2-4 s of imports, which on a 2-core machine would be
    taken from the survivors' steps. Started from the multiprocessing forkserver."""

    def __init__(self) -> None:
        import multiprocessing

        from functional_hsdp.mesh import launch

        from . import faults_worker

        ctx = multiprocessing.get_context("forkserver")
        self.conn, child = ctx.Pipe()
        with launch.starting_workers(C.PRELOAD):
            self.proc = ctx.Process(target=faults_worker.zygote, args=(child,), daemon=True)
            self.proc.start()
        child.close()
        self.pids: list[int] = []

    def spawn(self, cfg_path: Path, env: dict, log: str, netns: str | None = None) -> int:
        """Fork a rank (``faults_worker.forked``), in network namespace ``netns`` (None: this
        one's); returns its pid."""
        self.conn.send(("spawn", str(cfg_path), env, log, netns))
        pid = self.conn.recv()
        self.pids.append(pid)
        return pid

    def poll(self, pid: int) -> int | None:
        self.conn.send(("poll", pid))
        return self.conn.recv()

    def close(self) -> None:
        """End the zygote, and any rank it forked that still runs (SIGKILL)."""
        try:
            for pid in self.pids:
                if self.poll(pid) is None:
                    os.kill(pid, signal.SIGKILL)
            self.conn.send(("close",))
            self.conn.recv()
        except (OSError, EOFError, ProcessLookupError):
            pass
        self.proc.join(10)
        if self.proc.exitcode is None:
            self.proc.kill()


class Network:
    """Where the ranks run: each replica group in a site of its own (``sites``: an open
    ``functional_hsdp.tools.testing.sites.Sites`` of one site per group), or everything on this
    machine's loopback (None)."""

    def __init__(self, sites: Any = None) -> None:
        self.sites = sites
        self._port = 29600  # the sites' stores and lighthouses: a fresh port each (no reuse)

    def describe(self) -> dict:
        if self.sites is None:
            return {"kind": "loopback"}
        return {"kind": "sites", "sites": len(self.sites.sites), "rate_mbit": self.sites.rate_mbit,
                "addrs": [x.addr for x in self.sites.sites]}  # fmt: skip

    def port(self) -> int:
        """A port for a store or a lighthouse: free on loopback; in a site, the next of a range
        below the ephemeral ports that no process of this run has used."""
        from functional_hsdp.tools.testing.replica_groups import free_port

        if self.sites is None:
            return free_port()
        self._port += 1
        return self._port

    def site(self, g: int) -> tuple[str | None, str]:
        """Site ``g``'s namespace and address (loopback: None, 127.0.0.1)."""
        if self.sites is None:
            return None, "127.0.0.1"
        x = self.sites.sites[g]
        return x.netns, x.addr

    def env(self, g: int) -> dict:
        """What a rank in site ``g`` gets beside torchrun's environment: gloo on the site's end
        of the link, and the address its group's rank 0 advertises (``manager_from_env``)."""
        if self.sites is None:
            return {}
        from functional_hsdp.tools.testing.replica_groups import HOSTNAME_ENV
        from functional_hsdp.tools.testing.sites import IFNAME

        return {"GLOO_SOCKET_IFNAME": IFNAME, HOSTNAME_ENV: self.site(g)[1]}

    def lighthouse(self, cfg: dict, log: Path) -> Any:
        """The run's lighthouse: in site 0 (group 0's, never killed), bound on every address of
        it, reached by every group at site 0's address; or on a free port of loopback."""
        from functional_hsdp.tools.testing.replica_groups import Lighthouse

        where = {}
        if self.sites is not None:
            netns, addr = self.site(0)
            where = dict(netns=netns, host=addr, port=self.port())
        return Lighthouse(min_replicas=cfg["min_replicas"], join_timeout_ms=cfg["join_timeout_ms"],
                          heartbeat_timeout_ms=cfg["heartbeat_timeout_ms"], log=log,
                          **where)  # fmt: skip

    def counters(self) -> list[dict] | None:
        """Each site's counters of its end of the link (None: loopback)."""
        if self.sites is None:
            return None
        return [self.sites.counters(i) for i in range(len(self.sites.sites))]

    def measured(self, fn, *args, **kw) -> tuple[Any, dict | None]:
        """``fn(*args, **kw)`` and the bytes the sites sent on the link meanwhile: in all and
        per site (None: loopback)."""
        before = self.counters()
        out = fn(*args, **kw)
        after = self.counters()
        if before is None or after is None:
            return out, None
        sent = [b["tx_bytes"] - a["tx_bytes"] for a, b in zip(before, after)]
        return out, {"bytes": sum(sent), "per_site": sent}


class Ranks:
    """One replica group's ranks (or the plain world's), as
    :class:`~functional_hsdp.tools.testing.replica_groups.Group` makes them (the environment
    ``torchrun`` gives a rank, ``TORCHFT_LIGHTHOUSE``, ``REPLICA_GROUP_ID``; output to
    ``log_dir/g{gid}r{r}.log``; killed by pid), each rank a process forked from ``zygote``,
    running ``bench.diloco.faults_worker.main(cfg_path)``. Rank ``r`` runs in site
    ``sites[r]`` of ``net`` (default: site ``gid`` for all), the store in rank 0's site."""

    def __init__(self, zygote: Zygote, gid: int, n: int, cfg_path: Path, *, lighthouse: str,
                 log_dir: Path, env: dict, net: Network,
                 sites: list[int] | None = None) -> None:  # fmt: skip
        self.zygote, self.gid, self.n = zygote, gid, n
        sites = sites or [gid] * n
        base = {**env, "MASTER_ADDR": net.site(sites[0])[1], "MASTER_PORT": str(net.port()),
                "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n), "TORCHFT_LIGHTHOUSE": lighthouse,
                "REPLICA_GROUP_ID": str(gid), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                "TORCH_CPP_LOG_LEVEL": "ERROR"}  # fmt: skip
        self.pids = [
            zygote.spawn(cfg_path, {**base, **net.env(sites[r]), "RANK": str(r),
                                    "LOCAL_RANK": str(r)},
                         str(Path(log_dir) / f"g{gid}r{r}.log"), net.site(sites[r])[0])
            for r in range(n)
        ]  # fmt: skip
        self.codes: list[int | None] = [None] * n

    def poll(self) -> list[int | None]:
        self.codes = [c if c is not None else self.zygote.poll(p)
                      for p, c in zip(self.pids, self.codes)]  # fmt: skip
        return self.codes

    def running(self) -> bool:
        return any(c is None for c in self.poll())

    def kill(self) -> None:
        """SIGKILL every rank (by pid), and reap them."""
        for pid, code in zip(self.pids, self.poll()):
            if code is None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        while self.running():
            time.sleep(0.005)

    def wait(self, timeout: float) -> list[int | None]:
        deadline = time.monotonic() + timeout
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.codes


# -- the runs ----------------------------------------------------------------------------------


def _env(started: float, life: int = 0) -> dict:
    """A rank's own environment beside torchrun's: its start's number and time."""
    return {"FH_RESTART": str(life), "FH_STARTED": repr(started)}


def _worker_cfg(cfg: dict, out: Path, **kw) -> Path:
    keys = ("groups", "ranks", "hidden", "layers", "seq", "batch", "data_mb", "inner_lr",
            "outer_lr", "outer_momentum", "every", "fragments", "delay", "eval_every",
            "eval_batches", "timeout", "quorum_timeout", "settle")  # fmt: skip
    wcfg = {k: cfg[k] for k in keys} | {"out": str(out)} | kw
    path = out / f"cfg.{kw.get('mode', 'plain')}.json"
    path.write_text(json.dumps(wcfg))
    return path


def _ft_run(zygote: Zygote, net: Network, cfg: dict, mode: str, die: list, out: Path) -> dict:
    """One fault-tolerant run: the lighthouse, the groups, the kills at the failure points and
    the restarts. Returns the harness's own events (kills, restarts, failures not reached)."""
    out.mkdir(parents=True)
    path = _worker_cfg(cfg, out, mode=mode, steps=cfg["steps"][mode], die=die)
    G, n = cfg["groups"], cfg["ranks"]
    pending = sorted(die, key=lambda d: (d.get("life", 0), d["step"]))
    lives, kills, groups = [0] * G, [], []
    start = time.monotonic()
    with net.lighthouse(cfg, out / "lighthouse.log") as lh:
        try:
            t = time.time()
            groups = [Ranks(zygote, g, n, path, lighthouse=lh.addr, log_dir=out, env=_env(t),
                            net=net) for g in range(G)]  # fmt: skip
            while pending:  # whichever failure point is reached first
                markers = {out / f"dying.{mode}.g{d['group']}.{d.get('life', 0)}": d
                           for d in pending}  # fmt: skip
                reached = []
                while not reached:
                    reached = [(m, d) for m, d in markers.items() if m.exists()]
                    if time.monotonic() - start > cfg["deadline"]:
                        raise RuntimeError(f"B22 {mode}: never reached {pending}; see {out}")
                    if not any(g.running() for g in groups):
                        break  # every group ended first: the rest are not reached
                    time.sleep(0.01)
                if not reached:
                    break
                marker, d = reached[0]
                time.sleep(cfg["kill_after"])  # the survivors are in the step now
                g = d["group"]
                t_kill = time.time()
                groups[g].kill()
                time.sleep(cfg["pause"])  # the pause before the restart
                lives[g] += 1
                t_restart = time.time()
                groups[g] = Ranks(zygote, g, n, path, lighthouse=lh.addr, log_dir=out,
                                  env=_env(t_restart, lives[g]), net=net)  # fmt: skip
                kills.append(dict(d, life=lives[g] - 1, t_kill=t_kill, t_restart=t_restart,
                                  **json.loads(marker.read_text())))  # fmt: skip
                pending.remove(d)
            for g in groups:
                codes = g.wait(max(cfg["deadline"] - (time.monotonic() - start), 1.0))
                if codes != [0] * n:
                    raise RuntimeError(f"B22 {mode}: group {g.gid} ended with {codes}; see {out}")
        finally:
            for g in groups:
                g.kill()
    return {"kills": kills, "missed": pending}


def _plain_run(zygote: Zygote, net: Network, cfg: dict, mode: str, out: Path) -> None:
    """The plain world of one mode: a (groups, ranks) DistMesh, group g's ranks in site g."""
    out.mkdir(parents=True)
    path = _worker_cfg(cfg, out, plain=True, modes=[mode], steps_by_mode=cfg["steps"])
    world = cfg["groups"] * cfg["ranks"]
    g = Ranks(zygote, 0, world, path, lighthouse="", log_dir=out, env=_env(time.time()), net=net,
              sites=[r // cfg["ranks"] for r in range(world)])  # fmt: skip
    try:
        codes = g.wait(cfg["deadline"])
        if codes != [0] * world:
            raise RuntimeError(f"B22 plain world ended with {codes}; see {out}")
    finally:
        g.kill()


def _replay_run(zygote: Zygote, cfg: dict, fail: Path, out: Path) -> dict:
    """Per-step HSDP replayed from the failure run's quorum log (``faults_worker``'s
    ``Worker.replay``) in a plain world of ``groups x ranks`` gloo ranks on this machine's
    loopback (what is compared is the bits, not the time)."""
    schedule = _replay_schedule(_read(fail, "hsdp"))
    if "error" in schedule:
        return schedule
    out.mkdir(parents=True)
    path = _worker_cfg(cfg, out, plain=True, modes=["hsdp"], steps_by_mode=cfg["steps"],
                       replay=schedule["steps"])  # fmt: skip
    world = cfg["groups"] * cfg["ranks"]
    t0 = time.perf_counter()
    g = Ranks(zygote, 0, world, path, lighthouse="", log_dir=out, env=_env(time.time()),
              net=Network(None))  # fmt: skip
    try:
        codes = g.wait(cfg["deadline"])
        if codes != [0] * world:
            raise RuntimeError(f"B22 replay ended with {codes}; see {out}")
    finally:
        g.kill()
    return {"steps": len(schedule["steps"]), "sets": schedule["sets"],
            "wall": time.perf_counter() - t0}  # fmt: skip


def _committed_steps(logs: dict) -> dict:
    """From a per-step HSDP run's logs (each group's rank 0's records): ``{torchft step:
    {group: (its quorum's rank, the data position it used)}}`` of the committed steps, in
    order (``{"error": ...}`` where they are not contiguous from 0)."""
    steps: dict[int, dict[int, tuple[int, int]]] = {}
    for (g, r, _), recs in logs.items():
        if r:
            continue
        quorums = {x["q"]: x for x in recs if x["kind"] == "quorum"}
        for x in recs:
            if x["kind"] == "step" and x.get("commit"):
                q = quorums[x["q"]]
                steps.setdefault(q["step"], {})[g] = (q["rank"], x["count"] - 1)
    order = sorted(steps)
    if order != list(range(len(order))):
        return {"error": f"committed steps not contiguous: {order[:10]}"}
    return {s: steps[s] for s in order}


def _replay_schedule(logs: dict) -> dict:
    """From a per-step HSDP run's logs: per committed torchft step, ``[[group, data position],
    ...]`` in the quorum's order along the replica axis (:func:`_committed_steps`);
    uncommitted steps are left out."""
    steps = _committed_steps(logs)
    if "error" in steps:
        return steps
    out = []
    for s in steps:
        by_rank = sorted((rank, g, pos) for g, (rank, pos) in steps[s].items())
        if [rank for rank, _, _ in by_rank] != list(range(len(by_rank))):
            return {"error": f"step {s}: quorum ranks {by_rank}"}
        out.append([[g, pos] for _, g, pos in by_rank])
    sets = sorted({tuple(g for g, _ in s) for s in out})
    return {"steps": out, "sets": [list(x) for x in sets]}


def _final(path: Path) -> dict[str, torch.Tensor]:
    """A saved ``<mode>.g{g}.final.pt``: full parameter name -> tensor."""
    return {f"{u}.{k}" if u else k: v for u, sub in torch.load(path).items()
            for k, v in sub.items()}  # fmt: skip


def _replayed(ft: Path, replay: Path, info: dict) -> dict:
    """Every group's final parameters of the failure run against the replay's (the groups of
    its last step): max abs difference and whether every bit is equal."""
    if "error" in info:
        return info
    want = [_final(p) for p in sorted(replay.glob("hsdp.g*.final.pt"))]
    if not want:
        return {"error": "the replay saved no parameters"}
    per, same = {}, True
    for p in sorted(ft.glob("hsdp.g*.final.pt")):
        got = _final(p)
        per[p.name.split(".")[1]] = max((got[k] - w[k]).abs().max().item() for w in want for k in w)
        same = same and all(torch.equal(got[k], w[k]) for w in want for k in w)
    return {"steps": info["steps"], "sets": info["sets"], "wall": info["wall"],
            "max_abs": max(per.values()) if per else None, "per_group": per,
            "bitwise": same and bool(per)}  # fmt: skip


# -- the logs ----------------------------------------------------------------------------------


def _read(out: Path, mode: str) -> dict:
    """``{(group, rank, life): [records]}`` of one run."""
    logs = {}
    for p in sorted(out.glob(f"{mode}.g*r*.*.jsonl")):
        g, r, life = p.name[len(mode) + 2 :].split(".")[0].split("r") + [p.name.split(".")[-2]]
        logs[(int(g), int(r), int(life))] = [json.loads(x) for x in p.read_text().splitlines()]
    return logs


def _kind(logs: dict, kind: str) -> dict:
    return {k: [x for x in v if x["kind"] == kind] for k, v in logs.items()}


def _slowest_steps(logs: dict, skip: int) -> dict[str, list[float]]:
    """Per kind of step, the step times of the slowest rank (by step count, a rank's first
    ``skip`` steps left out; fault-tolerant runs: the first life only), less the benchmark's
    own work in the step (the digest of a quorum's trees, ``own``)."""
    per: dict[tuple, float] = {}
    for (_, _, life), recs in logs.items():
        if life:
            continue
        steps = [x for x in recs if x["kind"] == "step"]
        for k, x in enumerate(steps):
            if k < skip:
                continue
            key = (x["sync"], k)
            own = x.get("own", (0.0, 0.0))[0]  # the benchmark's digest of a quorum's trees
            per[key] = max(per.get(key, 0.0), x["t1"] - x["t0"] - own)
    out: dict[str, list[float]] = {}
    for (kind, _), t in sorted(per.items(), key=lambda kv: kv[0][1]):
        out.setdefault(kind, []).append(t)
    return out


def _commits(recs: list) -> list[float]:
    """When this rank's quorums committed (the end of the step that decided them)."""
    return [x["t_decided"] for x in recs if x["kind"] == "quorum" and x["commit"]]


def _by_group(logs: dict) -> dict[int, list]:
    """Group -> rank 0's records over its lives, in order."""
    out: dict[int, list] = {}
    for (g, r, _), recs in sorted(logs.items()):
        if r == 0:
            out.setdefault(g, []).extend(recs)
    return out


def _goodput(logs: dict, mode: str, survivor: int) -> dict:
    recs = _by_group(logs)[survivor]
    steps = [x for x in recs if x["kind"] == "step"]
    t0 = min(x["t0"] for k, v in logs.items() for x in v if x["kind"] == "step")
    if mode == "hsdp":
        done = [x for x in steps if x.get("commit")]
    else:
        done = steps
    wall = done[-1]["t1"] - t0
    return {"steps": len(done), "wall": wall, "rate": len(done) / wall}


def _medians(logs: dict, skip: int) -> dict[str, float]:
    return {k: statistics.median(v) for k, v in _slowest_steps(logs, skip).items() if v}


def _cpu_medians(logs: dict, skip: int) -> dict[str, float]:
    """Per kind of step, the median CPU time of a step over every rank's steps (the rank's
    process, every thread of it: torchft's manager threads too; a rank's first ``skip`` steps
    left out; fault-tolerant runs: the first life only): the work a step costs, which the
    other processes on the machine move less than its wall time."""
    per: dict[str, list[float]] = {}
    for (_, _, life), recs in logs.items():
        if life:
            continue
        steps = [x for x in recs if x["kind"] == "step" and "cpu" in x]
        for x in steps[skip:]:
            per.setdefault(x["sync"], []).append(x["cpu"] - x.get("own", (0.0, 0.0))[1])
    return {k: statistics.median(v) for k, v in per.items() if v}


def _failures(logs: dict, kills: list, mode: str, cfg: dict, normal: dict) -> list[dict]:
    """Per kill: detection, each survivor's cost, the heal of the restart."""
    out = []
    quiet = normal.get("quiet", min(normal.values(), default=0.0))  # tiny Streaming: none quiet
    first = min(x["t0"] for v in logs.values() for x in v if x["kind"] == "step")
    for k in kills:
        g, life = k["group"], k["life"]
        detect, costs = [], []
        for (s, r, ll), recs in logs.items():  # each survivor's life that spans the kill
            commits = [x["t_decided"] for x in recs if x["kind"] == "quorum" and x["commit"]]
            after = [t for t in commits if t > k["t_kill"]]
            before = [t for t in commits if t <= k["t_kill"]]
            if s == g or r or not after or not (before or ll == 0):
                continue
            before = before or [first]
            detect.append(after[0] - k["t_kill"])
            window = [x for x in recs if x["kind"] == "step" and before[-1] < x["t1"] <= after[0]]
            useful = [x for x in window if mode != "hsdp" or x.get("commit")]
            expected = sum(normal.get(x["sync"], quiet) for x in useful)
            costs.append(after[0] - before[-1] - expected)
        heal = _heal(logs, g, life + 1, mode)
        period = normal.get("sync", 0.0) if mode == "hsdp" else cfg["every"] * quiet
        bound = cfg["heartbeat_timeout_ms"] / 1e3 + period
        out.append(dict(group=g, life=life, phase=k["phase"], step=k["step"],
                        t_kill=k["t_kill"], t_marker=k["t"],
                        detection=max(detect) if detect else None,
                        cost=max(costs) if costs else None, bound=bound, heal=heal))  # fmt: skip
    return out


def _committed(logs: dict, mode: str) -> dict[tuple, dict]:
    """``{(step count, inner rank): {(group, life): digest}}`` of the shards after every
    committed HSDP step, and after every committed DiLoCo sync of one fragment (a restart's
    join too): where the groups' shards must all be equal."""
    out: dict[tuple, dict] = {}
    for (g, r, life), recs in logs.items():
        commits = {x["q"]: x["commit"] for x in recs if x["kind"] == "quorum"}
        for x in recs:
            if x["kind"] != "step" or x.get("q") is None or not commits.get(x["q"]):
                continue
            if mode == "hsdp" or (mode == "diloco" and x["sync"] in ("sync", "join")):
                out.setdefault((x["count"], r), {})[(g, life)] = x["digest"]
    return out


def _heal(logs: dict, g: int, life: int, mode: str) -> dict | None:
    """The restart's first quorum, over its ranks, against the survivors' at that step: its
    times, the bytes received, the peer groups whose trees each rank's equal (torchft picks a
    source per rank: one group for all, or several), and (HSDP, DiLoCo of one fragment) whether
    its shards equal the others' after its first committed step or sync."""
    mine = {r: v for (gg, r, ll), v in logs.items() if gg == g and ll == life}
    firsts = {}
    for r, recs in mine.items():
        q = [x for x in recs if x["kind"] == "quorum"]
        if q:
            firsts[r] = q[0]
    if not firsts or 0 not in mine:
        return None
    start = [x for x in mine[0] if x["kind"] == "start"]
    step = firsts[0]["step"]
    theirs = {  # the others' records of the same quorum (same torchft step), per rank
        r: [(gg, x) for (gg, rr, ll), v in logs.items() if gg != g and rr == r for x in v
            if x["kind"] == "quorum" and x["step"] == step
            and x["t_request"] < firsts[r]["t_return"] and x["t_return"] > firsts[r]["t_request"]]
        for r in firsts
    }  # fmt: skip
    request = max(x["t_request"] for x in firsts.values())
    ret = max(x["t_return"] for x in firsts.values())
    peers = [x for v in theirs.values() for _, x in v]
    both = max([request, *(x["t_request"] for x in peers)])
    sources = {r: sorted({gg for gg, x in theirs[r] if x["trees"] == firsts[r]["trees"]})
               for r in firsts}  # fmt: skip
    after = None
    if mode in ("hsdp", "diloco"):
        table = _committed(logs, mode)
        checks = []
        for r in mine:
            for key, digests in sorted(table.items()):
                if key[1] == r and (g, life) in digests:
                    others = {d for who, d in digests.items() if who != (g, life)}
                    checks.append(bool(others) and others == {digests[(g, life)]})
                    break
        after = bool(checks) and all(checks)
    return dict(
        healed=all(x["healed"] for x in firsts.values()),
        time=ret - request,
        transfer=ret - both,
        survivors_wait=max((x["t_return"] - x["t_request"] for x in peers), default=None),
        bytes=sum(x["bytes"] for x in firsts.values()),
        sources=sources,
        equal=all(sources.values()),
        one_peer=bool(set.intersection(*(set(v) for v in sources.values()))),
        after=after,
        startup=(request - start[0]["t"]) if start else None,
        step=step,
    )


def _evals(logs: dict) -> dict[int, tuple[float, float]]:
    """Step -> (mean eval loss over the groups holding a copy, the earliest copy's time)."""
    by: dict[int, list] = {}
    for (_, r, _), recs in logs.items():
        if r:
            continue
        for x in recs:
            if x["kind"] == "eval":
                by.setdefault(x["count"], []).append((x["loss"], x["t"]))
    return {
        k: (statistics.mean(a for a, _ in v), min(t for _, t in v)) for k, v in sorted(by.items())
    }


def _consistent(logs: dict, mode: str) -> dict:
    """HSDP: every group's shards equal at every committed step (per inner rank); DiLoCo (one
    fragment): every participant's after every committed sync (a restart's too, after the sync
    it joined). Counts of the steps compared and of those that differ."""
    seen = _committed(logs, mode)
    return {
        "compared": len(seen),
        "differ": sum(1 for v in seen.values() if len(set(v.values())) > 1),
    }


def _same_bits(ft: dict, plain: dict) -> dict:
    """No failure against the plain world: per (group, rank, step) the shards' digest and the
    step's collectives."""

    def table(logs, key):
        return {(g, r, x["count"]): x[key] for (g, r, life), v in logs.items()
                for x in v if x["kind"] == "step"}  # fmt: skip

    out = {}
    for key in ("digest", "comm"):
        a, b = table(ft, key), table(plain, key)
        both = sorted(set(a) & set(b))
        diff = [k for k in both if a[k] != b[k]]
        out[key] = {"compared": len(both), "only_one": len(set(a) ^ set(b)), "differ": len(diff),
                    "first": list(diff[0]) if diff else None}  # fmt: skip
    return out


# -- the HSDP reference ------------------------------------------------------------------------


def _hsdp_reference(cfg: dict, logs: dict, out: Path) -> dict:
    """Per-step HSDP replayed in this process from the logged quorums: each committed torchft
    step's mean gradient over its participants' batches (every inner rank's, at the data
    position it used), ``fh.adamw`` on the dense parameters; against every group's final
    parameters."""
    import optree

    import functional_hsdp as fh

    from . import diloco as B18
    from .faults_worker import batch_of, texts

    steps = _committed_steps(logs)
    if "error" in steps:
        return steps
    model = B18._model(cfg)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = fh.adamw(lr=cfg["inner_lr"], weight_decay=0.0)
    state = opt.init(params)
    train, _ = texts(cfg)

    def loss(p, ids):
        return B18._loss(torch.func.functional_call(model, p, (ids,)).logits, ids)

    grad = torch.func.grad(loss)

    def mean(xs):  # in the order of the reductions: a sum, then the division
        total = xs[0]
        for x in xs[1:]:
            total = total + x
        return total / len(xs)

    for by_group in steps.values():
        # each group's mean over its inner ranks (dp_inner), then the mean over the step's
        # participants (the replica axis)
        inner = []
        for g, (_, pos) in sorted(by_group.items()):
            gs = [grad(params, batch_of(train, cfg, g, i, pos)) for i in range(cfg["ranks"])]
            inner.append(optree.tree_map(lambda *xs: mean(xs), *gs))
        mean_ = optree.tree_map(lambda *xs: mean(xs), *inner)
        updates, state = opt.update(mean_, state, params)
        params = fh.apply_updates(params, updates)
    diffs = {}
    for p in sorted(out.glob("hsdp.g*.final.pt")):
        final = _final(p)
        diffs[p.name.split(".")[1]] = max((final[k] - params[k]).abs().max().item() for k in params)
    return {"steps": len(steps), "max_abs": max(diffs.values()) if diffs else None,
            "per_group": diffs}  # fmt: skip


# -- run ---------------------------------------------------------------------------------------


def run(size: str = "full", pool: Any = None, cfg: dict | None = None) -> dict:
    from functional_hsdp.tools.testing import sites

    del pool  # its own processes: a lighthouse and one job per replica group
    cfg = cfg or SIZES[size]
    reason = probe()
    if reason is not None:
        return {"size": size, "cfg": cfg, "skipped": reason}
    t0 = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="fh-b22-"))
    no_sites = sites.probe()
    res: dict[str, Any] = {"size": size, "cfg": cfg, "modes": {}, "load": {}}
    try:
        with contextlib.ExitStack() as stack:  # the zygote's ranks end, then the sites go
            s = None
            if no_sites is None:
                s = stack.enter_context(sites.Sites(cfg["groups"], rate_mbit=cfg["rate_mbit"]))
            net = Network(s)
            res["network"] = net.describe() | ({"why": no_sites} if no_sites else {})
            zygote = Zygote()
            stack.callback(zygote.close)
            res["load"]["start"] = C.loadavg()
            runs = {}
            for mode in cfg["modes"]:  # the plain world first, then the no-failure run
                _, plain = net.measured(_plain_run, zygote, net, cfg, mode, root / f"plain-{mode}")
                none, link_none = net.measured(_ft_run, zygote, net, cfg, mode, [],
                                               root / f"{mode}-none")  # fmt: skip
                if cfg.get("bracket"):  # the plain world again: the steady state's bracket
                    _plain_run(zygote, net, cfg, mode, root / f"plain-{mode}-after")
                fail, link_fail = net.measured(_ft_run, zygote, net, cfg, mode, cfg["die"][mode],
                                               root / f"{mode}-fail")  # fmt: skip
                link = {"plain": plain, "none": link_none, "fail": link_fail}
                runs[mode] = {"none": none, "fail": fail, "link": link}
                if mode == "hsdp":  # the failure run replayed from its quorum log
                    runs[mode]["replay"] = _replay_run(zygote, cfg, root / "hsdp-fail",
                                                       root / "hsdp-replay")  # fmt: skip
            res["load"]["end"] = C.loadavg()
            if s is not None:
                res["network"]["drops"] = [s.drops(i) for i in range(len(s.sites))]
        for mode in cfg["modes"]:
            res["modes"][mode] = _summarize(cfg, mode, root, runs[mode])
        res["params"] = sum(p.numel() for p in _model_params(cfg))
    except BaseException:
        print(f"B22: the logs are kept in {root}", file=sys.stderr)
        raise
    if os.environ.get("FH_B22_KEEP"):
        print(f"B22: the logs are kept in {root} (FH_B22_KEEP)", file=sys.stderr)
    else:
        shutil.rmtree(root, ignore_errors=True)
    res["wall_s"] = time.perf_counter() - t0
    res["png"] = _plot(res, PNG if size == "full" else None)
    return res


def _model_params(cfg: dict):
    from . import diloco as B18

    return B18._model(cfg).parameters()


def _summarize(cfg: dict, mode: str, root: Path, harness: dict) -> dict:
    plain = _read(root / f"plain-{mode}", mode)
    after = _read(root / f"plain-{mode}-after", mode) if cfg.get("bracket") else None
    none = _read(root / f"{mode}-none", mode)
    fail = _read(root / f"{mode}-fail", mode)
    skip = cfg["skip"]
    normal = _medians(none, skip)
    killed = {k["group"] for k in harness["fail"]["kills"]}
    survivor = min(set(range(cfg["groups"])) - killed, default=0)
    ev_none, ev_fail = _evals(none), _evals(fail)
    last = max(set(ev_none) & set(ev_fail), default=None)
    x = dict(
        steps=cfg["steps"][mode],
        medians={"plain": _medians(plain, skip), "none": normal, "fail": _medians(fail, skip)}
        | ({"plain_after": _medians(after, skip)} if after is not None else {}),
        cpu={"plain": _cpu_medians(plain, skip), "none": _cpu_medians(none, skip)}
        | ({"plain_after": _cpu_medians(after, skip)} if after is not None else {}),
        goodput={"none": _goodput(none, mode, survivor), "fail": _goodput(fail, mode, survivor),
                 "survivor": survivor},
        failures=_failures(fail, harness["fail"]["kills"], mode, cfg, normal),
        missed=harness["fail"]["missed"],
        evals={"none": ev_none, "fail": ev_fail, "plain": _evals(plain)},
        last_eval=last,
        bits=_same_bits(none, plain),
        consistent={"none": _consistent(none, mode), "fail": _consistent(fail, mode)},
        participants=_participants(fail),
        link=harness["link"],
        t0={k: min(x["t0"] for v in logs.values() for x in v if x["kind"] == "step")
            for k, logs in (("none", none), ("fail", fail))},
    )  # fmt: skip
    if mode == "hsdp":
        x["reference"] = {"fail": _hsdp_reference(cfg, fail, root / f"{mode}-fail"),
                          "none": _hsdp_reference(cfg, none, root / f"{mode}-none")}  # fmt: skip
        x["replay"] = _replayed(root / f"{mode}-fail", root / f"{mode}-replay",
                                harness["replay"])  # fmt: skip
    return x


def _participants(logs: dict) -> list:
    """Per group and start (life): ``[group, life, [(time its quorum returned, participants,
    committed), ...]]``, from its rank 0."""
    return [[g, life, [(x["t_return"], x["n"], x["commit"]) for x in recs if x["kind"] == "quorum"]]
            for (g, r, life), recs in sorted(logs.items()) if r == 0]  # fmt: skip


# -- plot and report ---------------------------------------------------------------------------


def _plot(res: dict, path: str | None) -> str | None:
    if path is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(res["modes"])
    fig, axes = plt.subplots(len(modes), 2, figsize=(12, 3.4 * len(modes)), squeeze=False)
    for (a, b), mode in zip(axes, modes):
        x = res["modes"][mode]
        for run, style in (("none", "-"), ("fail", "--")):
            ev = x["evals"][run]
            t0 = x["t0"][run]
            a.plot(
                [t - t0 for _, t in ev.values()],
                [loss for loss, _ in ev.values()],
                style,
                marker=".",
                label="no failure" if run == "none" else "failure schedule",
            )
        t0 = x["t0"]["fail"]
        for f in x["failures"]:
            for ax in (a, b):
                ax.axvline(f["t_kill"] - t0, color="red", alpha=0.4, lw=1)
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for g, life, qs in x["participants"]:
            if qs:
                ts = [t - t0 for t, _, _ in qs]
                ns = [n + 0.04 * g for _, n, _ in qs]
                b.step(ts, ns, where="post", color=colors[g % len(colors)],
                       label=f"group {g}" if not life else None)  # fmt: skip
                bad = [(t, n) for t, n, (_, _, c) in zip(ts, ns, qs) if not c]
                if bad:
                    b.plot(*zip(*bad), "x", color="black")
        a.set_title(f"{NAMES[mode]}: eval loss (kills in red)", fontsize=9)
        b.set_title(
            f"{NAMES[mode]}: participants per quorum, failure run (x: not committed)", fontsize=9
        )
        a.set_ylabel("eval loss")
        b.set_ylabel("participants")
        for ax in (a, b):
            ax.set_xlabel("wall-clock s from the run's first step")
            ax.grid(alpha=0.3)
        a.legend(fontsize=7)
        b.legend(fontsize=7)
    fig.suptitle("B22: fault-tolerant replica axis (python -m bench faults)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.0f}"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _where(res: dict) -> tuple[str, str]:
    """The network the groups ran on: for the title, and the report's sentence on it."""
    net = res.get("network", {"kind": "loopback"})
    if net["kind"] == "sites":
        n, rate = net["sites"], net["rate_mbit"]
        link = "a bridge" if n > 2 else "a veth pair"
        limit = "not limited" if rate is None else f"limited to {rate:g} Mbit/s by tbf"
        return (f"{n} sites over {'an unlimited' if rate is None else f'a {rate:g} Mbit/s'} link", (
            f"in {n} sites, one per group: network namespaces on this machine joined by {link} "
            f"(`functional_hsdp.tools.testing.sites`), each site's egress on the link {limit} "
            f"(tbf drops: {net.get('drops', '-')}); group g's ranks in site "
            "g, their store at its address (10.213.0.<g+1>), `GLOO_SOCKET_IFNAME=wan0`, the "
            "group's manager and checkpoint transport advertised at that address "
            "(`manager_from_env`, `FH_FT_HOSTNAME`). A group's own ranks talk inside their site; "
            "the replica axis, heals and the control traffic cross the link. The lighthouse runs "
            "in site 0 (group 0's, never killed), every group reaching it at 10.213.0.1; killing "
            "any other group kills every process of its site"))  # fmt: skip
    why = f" (no sites: {net['why']})" if net.get("why") else ""
    return "over loopback", f"on this machine over loopback{why}"


def report(res: dict, command: str, when: str) -> str:
    title = "(B22) The fault-tolerant replica axis under failures (torchft, kill -9, heal)"
    if "skipped" in res:
        return C.section_header(title, command, when) + f"\nSkipped: {res['skipped']}.\n"
    where, sentence = _where(res)
    head = C.section_header(f"{title}: {where}", command, when)
    cfg = res["cfg"]
    head += (
        f"\nA torchft lighthouse (`--min_replicas {cfg['min_replicas']} --join_timeout_ms "
        f"{cfg['join_timeout_ms']} --heartbeat_timeout_ms {cfg['heartbeat_timeout_ms']} "
        f"--quorum_tick_ms 100`) and {cfg['groups']} replica groups x {cfg['ranks']} gloo "
        f"rank(s) {sentence}. Each rank is a process of its own with torchrun's environment "
        "(forked from one process that imported torch, transformers and torchft once), "
        "`fh.DistMesh(dm, replicas=fh.fault_tolerant(manager))` (the Manager's timeout "
        f"{cfg['timeout']:g} s). B18's Llama (hidden {cfg['hidden']}, {cfg['layers']} "
        f"layer(s), {res['params']:,} parameters) on the stdlib's `.py` bytes, {cfg['batch']}x"
        f"{cfg['seq']} tokens per rank and step, `fh.shard_module` + "
        f"`fh.functional_call(into=MainGrad)`, inner `fh.adamw({cfg['inner_lr']:g})`; DiLoCo H="
        f"{cfg['every']}, Streaming H={cfg['every']} F={cfg['fragments']} delay {cfg['delay']}, "
        f"outer `fh.sgd({cfg['outer_lr']:g}, momentum={cfg['outer_momentum']:g}, nesterov=True)`."
        " A dying group stops at its failure point and is killed (SIGKILL, by pid) "
        f"{cfg['kill_after']:g} s later, restarted {cfg['pause']:g} s after the kill, healing "
        "from live peers at its first quorum (no checkpoint); a failure fires once the one "
        f"before it happened and {cfg['settle']} whole quorums committed after that. The plain "
        f"baseline: one world of {cfg['groups'] * cfg['ranks']} gloo ranks, a "
        f"({cfg['groups']}, {cfg['ranks']}) device mesh, a plain `fh.DistMesh`, the same tokens, "
        + ("" if where == "over loopback" else "group g's ranks in site g, ")
        + "run just before each mode's fault-tolerant runs"
        + (
            " and again right after its no-failure run (the steady state: the no-failure run "
            "against the mean of the two plain runs; their own ratio shows how far the machine "
            "moved meanwhile)"
            if cfg.get("bracket")
            else ""
        )
        + " (the ratios compare runs one after the other, on a machine whose load is given "
        "below). Eval: copies of the parameters "
        f"taken every {cfg['eval_every']} steps, {cfg['eval_batches']} held-out batch(es), "
        "evaluated after each run (not timed). "
        f"Run time {res['wall_s']:.0f} s; load (1-min average) {res['load']}.\n"
    )
    return (
        head + _runs_table(res) + _failures_table(res) + _bits_table(res) + _goals(res)
        + (f"\nPlot: `{os.path.relpath(res['png'], C.BENCH_DIR)}`.\n" if res["png"] else "")
    )  # fmt: skip


def _mb(link: dict | None) -> str:
    return "-" if not link else f"{link['bytes'] / 1e6:.2f}"


def _runs_table(res: dict) -> str:
    rows = []
    sites = any(v for x in res["modes"].values() for v in x.get("link", {}).values())
    for mode, x in res["modes"].items():
        g = x["goodput"]
        ev = x["evals"]
        last = x["last_eval"]
        lossn = ev["none"][last][0] if last is not None else None
        lossf = ev["fail"][last][0] if last is not None else None
        m = x["medians"]
        quiet = "sync" if mode == "hsdp" else "quiet"
        rows.append([
            NAMES[mode], x["steps"], len(x["failures"]),
            f"{g['none']['rate']:.2f}", f"{g['fail']['rate']:.2f}",
            f"{g['fail']['rate'] / g['none']['rate']:.3f}",
            "-" if last is None else f"{lossn:.4f} / {lossf:.4f} (step {last})",
            "-" if last is None else f"{lossf / lossn - 1:+.2%}",
            f"{_ms(m['plain'].get(quiet))} / {_ms(m['none'].get(quiet))} / "
            f"{_ms(m['fail'].get(quiet))}"
            + (f" (plain after: {_ms(m['plain_after'].get(quiet))})" if "plain_after" in m else ""),
            f"{_ms(x['cpu']['plain'].get(quiet))} / {_ms(x['cpu']['none'].get(quiet))}",
            "-" if mode == "hsdp" else " / ".join(
                f"{k} {_ms(m['none'][k])}" for k in ("sync", "issue", "land") if k in m["none"]),
        ])  # fmt: skip
        if sites:
            rows[-1].append(" / ".join(_mb(x["link"][k]) for k in ("plain", "none", "fail")))
    header = ["mode", "steps", "kills", "goodput, steps/s (no failure)", "goodput (failures)",
              "ratio", "eval loss, no failure / failures", "difference",
              "median step ms, plain / ft / ft with failures (HSDP: every step; DiLoCo: no sync)",
              "median CPU ms of such a step (a rank's threads), plain / ft",
              "ft sync steps ms (no failure)"]  # fmt: skip
    if sites:
        header.append("MB across the link, plain / ft / ft with failures")
    link = (
        " Across the link: what the sites' ends of it sent during the run (each site's `wan0` "
        "tx bytes, Ethernet frames, summed over the sites), the lighthouse's and the managers' "
        "traffic, the heals and the failed runs' restarts included."
    )
    return (
        "\n### The runs\n\nGoodput: the committed steps (DiLoCo: inner steps) per second of group "
        "0, never killed, from the run's first step to its last. Step times: the slowest rank's, "
        "the first steps of each rank left out. CPU time of a step: the rank's process, every "
        "thread of it (torchft's manager threads included), the median over every rank's steps: "
        "the work a step costs, which the other processes on the two cores move less than its "
        "wall time." + (link if sites else "") + "\n\n"
        + C.table(header, rows) + "\n"
    )  # fmt: skip


def _failures_table(res: dict) -> str:
    rows = []
    for mode, x in res["modes"].items():
        for f in x["failures"]:
            h = f["heal"] or {}
            life = f"restart {f['life']}" if f["life"] else "first start"
            rows.append([
                NAMES[mode], f"group {f['group']} ({life})", f"{f['phase']} (step {f['step']})",
                _s(f["detection"]), _s(f["cost"]), _s(f["bound"]), _s(h.get("startup")),
                _s(h.get("time")), _s(h.get("transfer")), _s(h.get("survivors_wait")),
                f"{h['bytes'] / 1e6:.3f}" if h else "-",
                _healed_cell(h),
                "-" if not h or h["after"] is None else ("yes" if h["after"] else "NO"),
            ])  # fmt: skip
        for d in x["missed"]:
            rows.append([NAMES[mode], f"group {d['group']}", f"{d['phase']}: NOT REACHED",
                         *["-"] * 10])  # fmt: skip
    header = ["mode", "killed", "failure point (step)",
              "detection s (kill -> the survivors' next commit, the later survivor)",
              "cost to a survivor s", "bound s (heartbeat timeout + a step / a sync period)",
              "restart: process start -> first quorum request s",
              "heal s (first quorum request -> healed)", "of which after every group requested",
              "survivors' wait in that quorum s", "heal MB (the group's ranks)",
              "healed trees = a live peer's, bit for bit (each rank's: which groups)",
              "= the others' after its first committed step / sync"]  # fmt: skip
    return (
        "\n### Failures and heals\n\nCost to a survivor: from its last commit before the kill "
        "to its first commit after it, less its useful steps in between at the no-failure "
        "run's median step of their kind (the slower survivor). A heal's time includes waiting "
        "for the survivors' next quorum (with DiLoCo, their next sync); the survivors' wait in "
        "that quorum is what the rejoin costs them (the lighthouse's join timeout).\n\n"
        + C.table(header, rows)
        + "\n"
    )


def _healed_cell(h: dict) -> str:
    if not h:
        return "-"
    if not (h["healed"] and h["equal"]):
        return "NO"
    groups = sorted({g for v in h["sources"].values() for g in v})
    if h["one_peer"]:
        return f"yes (= group{'s' if len(groups) > 1 else ''} {', '.join(map(str, groups))})"
    per = ", ".join(
        f"rank {r} = group {'/'.join(map(str, v))}" for r, v in sorted(h["sources"].items())
    )
    return f"yes, a mix of peers: {per}"


def _reference_cell(ref: dict) -> str:
    def one(r: dict) -> str:
        if r.get("max_abs") is None:
            return r.get("error", "-")
        return f"{r['max_abs']:.2e} ({r['steps']} steps)"

    return f"{one(ref['fail'])}; the no-failure run's: {one(ref['none'])}"


def _replay_cell(rep: dict) -> str:
    if rep.get("max_abs") is None:
        return rep.get("error", "-")
    sets = ", ".join("{" + ",".join(map(str, x)) + "}" for x in rep["sets"])
    bits = "every bit equal" if rep["bitwise"] else "bits differ"
    return f"{rep['max_abs']:.2e}, {bits} ({rep['steps']} steps; participants {sets})"


def _bits_table(res: dict) -> str:
    rows = []
    for mode, x in res["modes"].items():
        b = x["bits"]
        c = x["consistent"]
        ref = x.get("reference", {})
        rows.append([
            NAMES[mode],
            f"{b['digest']['compared'] - b['digest']['differ']}/{b['digest']['compared']}",
            f"{b['comm']['compared'] - b['comm']['differ']}/{b['comm']['compared']}",
            "-" if mode == "streaming" else f"{c['fail']['compared'] - c['fail']['differ']}/"
            f"{c['fail']['compared']}",
            "-" if "replay" not in x else _replay_cell(x["replay"]),
            "-" if not ref else _reference_cell(ref),
        ])  # fmt: skip
    header = ["mode", "no failure = plain: shards equal (rank-steps)",
              "collectives equal (rank-steps)",
              "failures: groups equal at each commit (HSDP steps, DiLoCo syncs)",
              "failures: final params vs the quorum log replayed in a plain world, max abs",
              "final params vs the dense reference from the quorum log, max abs"]  # fmt: skip
    return "\n### Nothing silently wrong\n\n" + C.table(header, rows) + "\n"


def goals(res: dict) -> dict[str, tuple[str, str, bool]]:
    """The issue's goals from the measured numbers: ``{goal: (measured, bound, met)}``."""
    out: dict[str, tuple[str, str, bool]] = {}
    for mode, x in res["modes"].items():
        name = NAMES[mode]
        fs = x["failures"]
        costs = [f["cost"] for f in fs]
        ok = (
            bool(fs)
            and not x["missed"]
            and all(c is not None and c <= f["bound"] for c, f in zip(costs, fs))
        )
        worst = max((c for c in costs if c is not None), default=None)
        out[f"{name}: survivors never stop (every failure reached; each costs <= heartbeat + "
            f"{'a step' if mode == 'hsdp' else 'a sync period'})"] = (
            _s(worst), _s(max((f["bound"] for f in fs), default=None)), ok)  # fmt: skip
        b = x["bits"]
        same = all(b[k]["differ"] == 0 and b[k]["compared"] > 0 and b[k]["only_one"] == 0
                   for k in b)  # fmt: skip
        out[f"{name}: no failure = plain DistMesh bit for bit, same collectives"] = (
            f"{b['digest']['differ']} + {b['comm']['differ']} differ",
            "0",
            same,
        )
        if mode == "hsdp":
            rep = x["replay"]
            ref = rep.get("max_abs")
            got = rep.get("error", "-") if ref is None else f"{ref:.2e}"
            if rep.get("bitwise"):
                got += " (every bit)"
            goal = f"{name}: failures: weights = the quorum log replayed in a plain world, max abs"
            out[goal] = (
                got,
                "1e-6",
                ref is not None and ref <= 1e-6,
            )
        heals = [f["heal"] for f in fs]
        if heals:
            # from the restart's first quorum: once every group has requested it (before that
            # the restart waits for the survivors' next quorum: with DiLoCo their next sync,
            # up to a sync period away), to the healed trees; the time from the restart's own
            # request shown beside
            t = max((h["transfer"] for h in heals if h), default=None)
            asked = max((h["time"] for h in heals if h), default=None)
            out[f"{name}: heal < 1 s from the restart's first quorum (every group in it)"] = (
                f"{_s(t)} (from its own request: {_s(asked)})",
                "1.00",
                t is not None and t < 1.0,
            )
            exact = all(h and h["healed"] and h["equal"] for h in heals)
            if mode == "streaming":  # fragments: no step where every shard is synced
                what, ok = "at the heal, rank by rank", exact
            else:
                what = "after its first committed " + ("step" if mode == "hsdp" else "sync")
                ok = exact and all(h["after"] for h in heals)
            out[f"{name}: healed bit-identical to the survivors ({what})"] = (
                "all" if ok else "not all",
                "all",
                ok,
            )
        g = x["goodput"]
        r = g["fail"]["rate"] / g["none"]["rate"]
        out[f"{name}: goodput >= 0.9 of no failure"] = (f"{r:.3f}", "0.90", r >= 0.9)
        last = x["last_eval"]
        if last is not None:
            d = x["evals"]["fail"][last][0] / x["evals"]["none"][last][0] - 1
            out[f"{name}: eval loss within 2 % of no failure"] = (
                f"{d:+.2%}",
                "2 %",
                abs(d) <= 0.02,
            )
        m = x["medians"]
        kind, bound = ("sync", 1.10) if mode == "hsdp" else ("quiet", 1.02)
        if kind in m["plain"] and kind in m["none"]:
            cpu = x.get("cpu", {})
            ratio, spread = _steady(m, kind), None
            work = _steady(cpu, kind) if kind in cpu.get("none", {}) else None
            if kind in m.get("plain_after", {}):
                spread = m["plain_after"][kind] / m["plain"][kind]
            what = "steps" if mode == "hsdp" else "steps without a sync"
            notes = [f"CPU time per step: {work:.3f}"] if work is not None else []
            if spread is not None:
                notes.insert(0, "against the mean of the plain runs before and after it")
                notes.append(f"the plain runs, after / before: {spread:.3f}")
            out[f"{name}: {what} <= {bound:.2f}x the plain DistMesh's"] = (
                f"{ratio:.3f}" + (f" ({'; '.join(notes)})" if notes else ""),
                f"{bound:.2f}",
                ratio <= bound,
            )
    return out


def _steady(m: dict, kind: str) -> float:
    """The no-failure run's median step of ``kind`` against the plain world's: the plain
    run's, or the mean of the plain runs before and after it (``bracket``)."""
    plain = [m[k][kind] for k in ("plain", "plain_after") if kind in m.get(k, {})]
    return m["none"][kind] / (sum(plain) / len(plain))


def _goals(res: dict) -> str:
    rows = [[g, v, b, "met" if ok else "NOT met"] for g, (v, b, ok) in goals(res).items()]
    return "\n### Goals (issue 47)\n\n" + C.table(["goal", "measured", "bound", ""], rows) + "\n"

"""B22's worker: one rank of one replica group (or of the plain baseline's world).

Forked by ``bench/diloco/faults.py``'s ``Ranks`` from its zygote (:func:`zygote`, then
:func:`forked`) with the environment ``torchrun`` gives a rank plus ``TORCHFT_LIGHTHOUSE`` and
``REPLICA_GROUP_ID`` (as ``functional_hsdp.tools.testing.replica_groups.Group`` sets it), and
runs :func:`main` on the run's config. Where the groups run in sites (a network namespace per
group, ``functional_hsdp.tools.testing.sites``), the forked rank enters its group's namespace
before anything else, ``MASTER_ADDR`` is its site's address, ``GLOO_SOCKET_IFNAME`` the site's
end of the link, and ``FH_FT_HOSTNAME`` the site's address, which ``manager_from_env``
advertises for the group's manager and checkpoint transport. The structure is the
fault-tolerance tests' program (``functional_hsdp.tools.testing.ft_train``) with B18's Llama on
B18's data: ``fh.shard_module`` (a unit per decoder layer) + ``fh.functional_call(into=MainGrad)``,
inner ``fh.adamw``.

- **Fault-tolerant** (``CONFIG['mode']``): the group's ranks form a 1-D ``dp_inner`` device
  mesh; the replica axis ``replica`` is ``fh.fault_tolerant(manager_from_env())``. ``hsdp``: a
  quorum and a commit per step (the optimizer steps only on a commit). ``diloco``/``streaming``:
  a quorum only where ``dl.sync_due`` (the sync commits itself), a restarted group's join at the
  survivors' next sync (as the tests' program and the guide do it).
- **Plain** (``CONFIG['plain']``): one world of ``groups x ranks`` gloo ranks with a ``(groups,
  ranks)`` device mesh (``replica``, ``dp_inner``) and a plain ``fh.DistMesh``; every mode of
  ``CONFIG['modes']`` in turn, the same loops without quorums.

A rank's batch at data position ``pos`` is drawn from a generator seeded by (group, inner rank,
pos) (the position is a leaf of the healed trees), so that every run (fault-tolerant or plain,
with failures or not) and the reference replay see the same tokens at the same position.

The log (JSON lines, ``CONFIG['out']/<mode>.g{g}r{r}.{life}.jsonl``): one line per step (wall
times from ``time.time()`` at its start and end, its CPU time, the benchmark's own part of both,
the step count after it, its kind, the quorum started in it, a digest of this rank's parameter
shards after it and of the collectives it issued), one line per quorum once decided (its
record, when it was requested and when it returned, the CPU time it took, a digest of the trees
it returned, the bytes of their tensors), the eval losses of the parameter copies taken at
every ``eval_every``-th step (evaluated after the run, so that no eval runs between timed
steps), and ``done``; rank 0 of each group saves the full parameters at the
end (``<mode>.g{g}.final.pt``). Failure points (``CONFIG['die']``, in the schedule's order; this
group's for its ``FH_RESTART``-th start): the ranks write ``dying.<mode>.g{g}.{life}`` (with the
time) and sleep until the harness kills them: ``between`` (between two steps: after a step,
before the next one; with DiLoCo a step without a sync), ``before_quorum`` (DiLoCo: a sync's
step done, its quorum not requested), ``after_quorum`` (HSDP: after the step's quorum, before
the forward), ``in_collective`` (just before the outer collective: HSDP's backward, whose units
issue the outer all-reduce; a DiLoCo sync's ``dl.update`` right after its quorum: the survivors
are in it when the group dies) and ``in_flight`` (a delayed sync issued, not landed). A failure
fires at the first such point at or after its step once the failures before it in the schedule
happened (their markers exist) and the last ``settle`` quorums had every group and committed.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import optree
import torch
import torch.distributed as dist

AXES = ("replica", "dp_inner")


def batch_of(train: torch.Tensor, cfg: dict, gid: int, rank: int, pos: int) -> torch.Tensor:
    """The batch of inner rank ``rank`` of group ``gid`` at data position ``pos``."""
    from . import diloco as B18

    gen = torch.Generator().manual_seed(1_000_003 * gid + 10_007 * rank + pos)
    return B18._batch(train, gen, cfg)


def texts(cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """B18's bytes: (train, held-out), the fixed 90/10 split."""
    from . import diloco as B18

    text = B18._text(cfg["data_mb"])
    split = int(0.9 * len(text))
    return text[:split], text[split:]


def eval_batches(held: torch.Tensor, cfg: dict) -> list[torch.Tensor]:
    from . import diloco as B18

    gen = torch.Generator().manual_seed(7)
    return [B18._batch(held, gen, cfg) for _ in range(cfg["eval_batches"])]


def diloco_options(cfg: dict, mode: str) -> dict:
    """``fh.diloco``'s options of a mode: DiLoCo every H, Streaming every H in F fragments with
    a delay."""
    if mode == "diloco":
        return dict(every=cfg["every"], fragments=1, delay=0)
    return dict(every=cfg["every"], fragments=cfg["fragments"], delay=cfg["delay"])


def digest(tensors) -> str:
    h = hashlib.sha1()
    for x in tensors:
        if isinstance(x, torch.Tensor):
            h.update(x.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        elif x is None or isinstance(x, (bool, int, float, str)):
            h.update(repr(x).encode())
    return h.hexdigest()[:16]


def tensor_bytes(tree) -> int:
    return sum(
        x.numel() * x.element_size()
        for x in optree.tree_leaves(tree, none_is_leaf=True)
        if isinstance(x, torch.Tensor)
    )


def _marker(d: dict) -> str:
    """A failure's marker file's name (after ``dying.<mode>.``)."""
    return f"g{d['group']}.{d.get('life', 0)}"


class Model:
    """B18's Llama on ``mesh`` for one mode: its shards, MainGrad, inner AdamW, DiLoCo."""

    def __init__(self, cfg: dict, mode: str, mesh):
        import functional_hsdp as fh

        from . import diloco as B18

        self.model = B18._model(cfg)  # seeded: the same initial weights everywhere
        self.full = {k: (v.shape, v.dtype) for k, v in self.model.named_parameters()}
        spec = fh.hsdp(mesh, *AXES)
        self.dl = None
        if mode != "hsdp":
            m = cfg["outer_momentum"]
            outer = fh.sgd(cfg["outer_lr"], momentum=m, nesterov=m > 0)
            self.dl = fh.diloco(spec, axis=AXES[0], outer=outer, **diloco_options(cfg, mode))
            spec = self.dl.inner
        self.shards, self.tree_spec = fh.shard_module(
            self.model, spec, units=list(self.model.model.layers)
        )
        self.leaves = optree.tree_leaves(self.shards)
        self.mg = fh.MainGrad(self.tree_spec, like=self.shards)
        self.hook = None
        self.opt = fh.adamw(lr=cfg["inner_lr"], weight_decay=0.0)
        self.opt_state = self.opt.init(self.shards)
        self.state = self.dl.init(self.shards) if self.dl else None

    def _loss(self, s, ids):
        import functional_hsdp as fh

        from . import diloco as B18

        loss = B18._loss(fh.functional_call(self.model, s, (ids,), into=self.mg).logits, ids)
        if self.hook is not None:  # after the forward, before the backward's reductions
            self.hook()
        return loss

    def grads(self, ids: torch.Tensor, before_reduce=None) -> None:
        """The step's gradient into MainGrad; ``before_reduce()`` runs between the forward and
        the backward, whose units issue their reductions (HSDP: the outer all-reduce too)."""
        self.mg.begin_microbatch(last=True)
        self.hook = before_reduce
        try:
            torch.func.grad(self._loss)(self.shards, ids)
        finally:
            self.hook = None
        self.mg.finish()

    def apply(self) -> None:
        updates, self.opt_state = self.opt.update(self.mg.grads, self.opt_state, self.shards)
        with torch.no_grad():
            torch._foreach_add_(self.leaves, optree.tree_leaves(updates))

    def outer(self, weight=None) -> None:
        """``dl.update``; its new values copied into the shards (the module's tensors)."""
        new, self.state = self.dl.update(self.shards, self.state)
        with torch.no_grad():
            for p, q in zip(self.leaves, optree.tree_leaves(new)):
                if p is not q:
                    p.copy_(q)

    def copy(self):
        return optree.tree_map(torch.clone, self.shards)

    @torch.no_grad()
    def evaluate(self, evals: list, shards) -> float:
        import functional_hsdp as fh

        from . import diloco as B18

        losses = [
            B18._loss(fh.functional_call(self.model, shards, (ids,)).logits, ids).item()
            for ids in evals
        ]
        return sum(losses) / len(losses)


class Worker:
    def __init__(self, cfg: dict):
        from torch.distributed.device_mesh import init_device_mesh

        import functional_hsdp as fh

        torch.set_num_threads(1)
        self.cfg, self.fh = cfg, fh
        self.out = Path(cfg["out"])
        self.plain = bool(cfg.get("plain"))
        self.life = int(os.environ.get("FH_RESTART", "0"))
        self.started = float(os.environ.get("FH_STARTED", "0") or 0)
        dist.init_process_group("gloo")
        self.G, self.I = cfg["groups"], cfg["ranks"]
        self.ft = None
        if self.plain:
            self.gid, self.rank = divmod(dist.get_rank(), self.I)
            if cfg.get("replay") is None:  # a replay makes a mesh per quorum: Worker.replay
                dm = init_device_mesh("cpu", (self.G, self.I), mesh_dim_names=AXES)
                self.mesh = fh.DistMesh(dm)
        else:
            from functional_hsdp.tools.testing.replica_groups import manager_from_env

            dm = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=AXES[1:])
            self.gid, self.rank = int(os.environ["REPLICA_GROUP_ID"]), dist.get_rank()
            self.manager = manager_from_env(
                timeout=cfg["timeout"], quorum_timeout=cfg["quorum_timeout"]
            )
            self.ft = fh.fault_tolerant(self.manager, axis=AXES[0])
            self.mesh = fh.DistMesh(dm, replicas=self.ft)
        self.train, held = texts(cfg)
        self.evals = eval_batches(held, cfg)
        # the schedule in its order: a failure waits for the ones before it (their markers)
        schedule = [(d, _marker(d)) for d in cfg.get("die", [])]
        self.dies = [
            (d, [m for _, m in schedule[:k]])
            for k, (d, _) in enumerate(schedule)
            if d["group"] == self.gid and d.get("life", 0) == self.life
        ]
        self.quorums: dict[int, dict] = {}  # index -> times, digest, bytes (until decided)
        self.written = 0

    # the log -------------------------------------------------------------------------------

    def open(self, mode: str) -> None:
        self.mode = mode
        self.steps = self.cfg["steps_by_mode"][mode] if self.plain else self.cfg["steps"]
        self.log = open(self.out / f"{mode}.g{self.gid}r{self.rank}.{self.life}.jsonl", "a")

    def write(self, **kw) -> None:
        self.log.write(json.dumps(kw) + "\n")
        self.log.flush()

    def decided(self) -> None:
        """Every quorum decided since the last call, once."""
        if self.ft is None:
            return
        for rec in self.ft.log[self.written :]:
            if rec.committed is None:
                break
            extra = self.quorums.pop(rec.index)
            self.write(kind="quorum", q=rec.index, step=rec.step, n=rec.participants,
                       rank=rec.rank, healed=bool(rec.healed), commit=rec.committed,
                       t_decided=time.time(), **extra)  # fmt: skip
            self.written += 1

    def quorum(self, m: Model, trees: tuple, count):
        """``ft.quorum(trees)`` (``trees[0]``: ``m``'s shards), timed and noted;
        ``count(trees)``: the step count it is for."""
        t, c = time.time(), time.process_time()
        trees = self.ft.quorum(trees)
        m.shards, m.leaves = trees[0], optree.tree_leaves(trees[0])
        ret, c1 = time.time(), time.process_time()
        rec = self.ft.log[-1]
        self.quorums[rec.index] = dict(
            t_request=t, t_return=ret, count=count(trees),
            trees=digest(optree.tree_leaves(trees, none_is_leaf=True)),
            bytes=tensor_bytes(trees) if rec.healed else 0, cpu=c1 - c,
        )  # fmt: skip
        # the digest is this benchmark's, not the step's: its time is kept apart (step_record)
        self.own = (self.own[0] + time.time() - ret, self.own[1] + time.process_time() - c1)
        return trees

    # failure points ------------------------------------------------------------------------

    def whole(self) -> bool:
        return bool(self.ft and self.ft.log) and self.ft.log[-1].participants == self.G

    def settled(self) -> bool:
        """Whether the last quorum has every group (committed, or still open) and the
        ``settle`` before it had every group and committed (a failure waits for the last
        restart to be back for a while)."""
        k = self.cfg.get("settle", 2)
        log = self.ft.log if self.ft else []
        last = log[-(k + 1) :]
        return (
            len(last) == k + 1
            and all(q.participants == self.G for q in last)
            and all(q.committed for q in last[:-1])
            and last[-1].committed is not False  # the last one: committed or still open
        )

    def maybe_die(self, step: int, phase: str) -> None:
        if not self.dies or not self.settled() or step >= self.steps:
            return
        due = [
            d
            for d, before in self.dies
            if step >= d["step"] and d["phase"] == phase
            and all((self.out / f"dying.{self.mode}.{m}").exists() for m in before)
        ]  # fmt: skip
        if due:
            marker = self.out / f"dying.{self.mode}.{_marker(due[0])}"
            tmp = marker.with_name(f"{marker.name}.{self.rank}.tmp")  # both ranks write it:
            tmp.write_text(json.dumps({"t": time.time(), "step": step, "phase": phase}))
            os.replace(tmp, marker)  # atomically, so that the harness reads a whole one
            time.sleep(3600)

    def ended(self, count: int, state=None) -> bool:
        if self.ft is None:  # a delayed sync lands before the end, as on the ft axis
            return count >= self.steps and not (state is not None and state.flight)
        last = self.ft.log[-1] if self.ft.log else None
        done = count >= self.steps and self.whole() and bool(last and last.committed)
        return done or count >= 20 * self.steps  # a safety cap: the harness has a deadline

    def barrier(self) -> None:
        """Every group's ranks up before the first quorum (a first start only)."""
        if self.life or self.ft is None:
            return
        (self.out / f"ready.{self.mode}.g{self.gid}r{self.rank}").write_text("")
        while len(list(self.out.glob(f"ready.{self.mode}.g*"))) < self.G * self.I:
            time.sleep(0.01)

    # the loops -----------------------------------------------------------------------------

    def clock(self) -> float:
        """A step's start: its wall time (returned) and this process's CPU time, every thread
        of it (torchft's manager threads included), kept for :meth:`step_record`, which also
        writes the time of the benchmark's own work in the step (``own``: wall, CPU; the digest
        of a quorum's trees), left out of the step times the report compares."""
        self.cpu0 = time.process_time()
        self.own = (0.0, 0.0)  # wall and CPU time of the benchmark's own work in the step
        return time.time()

    def step_record(self, t0: float, count: int, kind: str, m: Model, log, **kw) -> None:
        t1 = time.time()
        cpu = time.process_time() - self.cpu0
        events = [(e.op, e.axis, str(e.dtype), e.numel, e.reduce) for e in log.events]
        self.write(kind="step", t0=t0, t1=t1, cpu=cpu, own=self.own, count=count, sync=kind,
                   digest=digest(m.leaves), comm=digest([repr(events)]), ncomm=len(events),
                   **kw)  # fmt: skip

    def hsdp(self) -> Model:
        fh, ft = self.fh, self.ft
        m = Model(self.cfg, "hsdp", self.mesh)
        pos, copies = 0, []
        if not self.life:
            copies.append((0, time.time(), m.copy()))
        self.barrier()
        while not self.ended(pos):
            self.maybe_die(pos, "between")
            with fh.comm_log() as log:
                t0 = self.clock()
                q = None
                if ft is not None:
                    m.shards, m.opt_state, pos = self.quorum(
                        m, (m.shards, m.opt_state, pos), lambda x: x[2]
                    )
                    q = ft.log[-1].index
                    self.maybe_die(pos, "after_quorum")
                ids = batch_of(self.train, self.cfg, self.gid, self.rank, pos)
                m.grads(ids, functools.partial(self.maybe_die, pos, "in_collective"))
                ok = ft.commit() if ft is not None else True
                if ok:
                    m.apply()
                    pos += 1
                m.mg.zero_grad()
            self.step_record(t0, pos, "sync", m, log, q=q, commit=ok)
            self.decided()
            if ok and pos % self.cfg["eval_every"] == 0:
                copies.append((pos, time.time(), m.copy()))
        self.copies = copies
        return m

    def diloco(self, mode: str) -> Model:
        fh, ft = self.fh, self.ft
        m = Model(self.cfg, mode, self.mesh)
        pos, copies = 0, []
        if not self.life:
            copies.append((0, time.time(), m.copy()))
        self.barrier()
        if self.life:  # join at the survivors' next sync, healed there
            with fh.comm_log() as log:
                t0 = self.clock()
                trees = (m.shards, m.opt_state, m.state, pos)
                m.shards, m.opt_state, m.state, pos = self.quorum(
                    m, trees, lambda x: x[2].count + 1
                )
                q = ft.log[-1].index
                if m.dl.sync_due(m.state):
                    m.outer()
                else:
                    ft.commit()
            self.step_record(t0, m.state.count, "join", m, log, q=q)
            self.decided()
        while not self.ended(m.state.count, m.state):
            t = m.state.count + 1
            q = None
            with fh.comm_log() as log:
                t0 = self.clock()
                ids = batch_of(self.train, self.cfg, self.gid, self.rank, pos)
                m.grads(ids)  # over dp_inner only
                m.apply()
                m.mg.zero_grad()
                pos += 1
                due = m.dl.sync_due(m.state)
                landing = any(d == t for d in m.state.due)
                if due and ft is not None:
                    self.maybe_die(t, "before_quorum")  # the survivors in the sync's quorum
                    trees = (m.shards, m.opt_state, m.state, pos)
                    m.shards, m.opt_state, m.state, pos = self.quorum(
                        m, trees, lambda x: x[2].count + 1
                    )
                    q = ft.log[-1].index
                    self.maybe_die(t, "in_collective")
                m.outer()
                if m.state.flight:
                    self.maybe_die(t, "in_flight")
            kind = (
                ("issue" if m.state.flight else "sync") if due else ("land" if landing else "quiet")
            )
            self.step_record(t0, m.state.count, kind, m, log, q=q)
            self.decided()
            if m.state.count % self.cfg["eval_every"] == 0:
                copies.append((m.state.count, time.time(), m.copy()))
            self.maybe_die(t, "between")
        self.copies = copies
        return m

    def replay(self) -> Model:
        """Per-step HSDP replayed from a fault-tolerant run's quorum log in this plain world
        (``CONFIG['replay']``: per committed torchft step, its participants in their order
        along the replica axis, each with the data position it used; uncommitted steps are not
        in it). Each step runs on a plain ``fh.DistMesh`` over a ``(participants, ranks)``
        device mesh of this world's ranks (one per distinct set of participants, every rank
        making every one, and its host group, upfront; a group's rows in the quorum's order),
        the participants' ranks only, with the same loop as :meth:`hsdp` and no quorum; a
        group that was not in the previous step receives its trees (shards, optimizer state)
        from the same inner rank of the previous step's first participant
        (``dist.send_object_list``: pickled tensors, every bit). The result: what the
        fault-tolerant run must give, computed without torchft, its failures or its heals.
        Returns the model of the last step's participants (None on the other ranks)."""
        from torch.distributed.device_mesh import DeviceMesh

        fh = self.fh
        steps = [[tuple(x) for x in s] for s in self.cfg["replay"]]
        sets = list(dict.fromkeys(tuple(g for g, _ in s) for s in steps))
        meshes = {}
        for P in sets:
            dm = DeviceMesh("cpu", [[g * self.I + i for i in range(self.I)] for g in P],
                            mesh_dim_names=AXES)  # fmt: skip
            # the host group a DistMesh on a mesh short of the world makes (dist.py's
            # _host_group, a collective of the world), made now by every rank under the same
            # name, so that P's ranks alone can make P's DistMesh at P's first step
            dm._flatten("fh_host_" + "_".join(AXES), backend_override="gloo")
            meshes[P] = dm
        models: dict[tuple, Model] = {}
        trees = None  # this rank's (shard leaves, optimizer state), once its group has a model
        prev = tuple(range(self.G))  # every group starts from the same seeded weights
        for step in steps:
            P, pos = tuple(g for g, _ in step), dict(step)
            src = prev[0]
            for g in (g for g in P if g not in prev):  # joining: healed from prev's first
                if self.gid == src:
                    dist.send_object_list([trees], dst=g * self.I + self.rank)
                elif self.gid == g:
                    got = [None]
                    dist.recv_object_list(got, src=src * self.I + self.rank)
                    trees = got[0]
            prev = P
            if self.gid not in P:
                continue
            if P not in models:  # made by P's ranks together, at P's first step
                models[P] = Model(self.cfg, "hsdp", fh.DistMesh(meshes[P]))
            m = models[P]
            if trees is not None:  # this rank's current trees into P's model (its MainGrad
                leaves, m.opt_state = trees  # knows its own shard tensors: copied into them)
                with torch.no_grad():
                    for p, q in zip(m.leaves, leaves):
                        if p is not q:
                            p.copy_(q)
            with fh.comm_log() as log:
                t0 = self.clock()
                m.grads(batch_of(self.train, self.cfg, self.gid, self.rank, pos[self.gid]))
                m.apply()
                m.mg.zero_grad()
            self.step_record(t0, pos[self.gid] + 1, "sync", m, log)
            trees = (m.leaves, m.opt_state)
        self.copies = []
        return models[prev] if self.gid in prev else None

    def evaluate(self, m: Model) -> None:
        """The copies' eval losses (every rank of a group computes the same: the full model,
        gathered over the group's ranks)."""
        for count, t, shards in self.copies:
            self.write(kind="eval", count=count, t=t, loss=m.evaluate(self.evals, shards))

    def final(self, m: Model) -> None:
        """The full parameters at the end (``fh.gather`` over dp_inner, every rank of the group),
        saved by the group's rank 0."""
        full = self.fh.gather(m.shards, m.tree_spec)
        if self.rank == 0:
            torch.save(full, self.out / f"{self.mode}.g{self.gid}.final.pt")
        self.write(kind="done", t=time.time(), digest=digest(m.leaves))


def forked(path: str, env: dict, log: str, netns: str | None = None) -> None:
    """A rank forked from the zygote: into its site's network namespace ``netns`` first (None:
    the machine's, loopback), before it opens any socket (``sites.enter``); then torchrun's
    environment, its output to ``log``, then :func:`main`; the process ends here whatever
    happens."""
    code = 1
    try:
        if netns is not None:
            from functional_hsdp.tools.testing.sites import enter

            enter(netns)
        os.environ.update(env)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
        main(path)
        code = 0
    except BaseException:  # noqa: BLE001 - the traceback goes to the rank's log
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def zygote(conn) -> None:
    """The benchmark's zygote (a process of its own, from the forkserver): imports what a rank
    needs once (torch, transformers' Llama, torchft, the library), then forks a rank on each
    request, ``("spawn", cfg_path, env, log, netns) -> pid`` (:func:`forked`; ``netns``: the
    rank's site, or None), and reaps them,
    ``("poll", pid) -> exit code or None``; ``("close",)`` ends it. A rank is then a process
    of its own, killed by pid, whose start costs no imports."""
    import torchft  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    import functional_hsdp  # noqa: F401
    import functional_hsdp.tools.testing.replica_groups  # noqa: F401
    import functional_hsdp.tools.testing.sites  # noqa: F401

    from . import diloco  # noqa: F401

    codes: dict[int, int] = {}
    while True:
        msg = conn.recv()
        if msg[0] == "spawn":
            pid = os.fork()
            if pid == 0:
                conn.close()
                forked(*msg[1:])
            conn.send(pid)
        elif msg[0] == "poll":
            pid = msg[1]
            if pid not in codes:
                try:
                    done, status = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    done, status = pid, 1 << 8
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
            conn.send(codes.get(pid))
        else:
            conn.send(None)
            return


def main(path: str) -> None:
    cfg = json.loads(Path(path).read_text())
    w = Worker(cfg)
    modes = cfg["modes"] if w.plain else [cfg["mode"]]
    for mode in modes:
        w.open(mode)
        if w.started:
            w.write(kind="start", t=w.started, ready=time.time())
        if cfg.get("replay") is not None:
            m = w.replay()
        else:
            m = w.hsdp() if mode == "hsdp" else w.diloco(mode)
        w.write(kind="end", t=time.time())
        w.evaluate(m)  # a replay keeps no copies
        if m is not None:  # a replay: the last step's participants only
            w.final(m)
        w.log.close()
        if w.plain:
            dist.barrier()
    if w.ft is not None:
        w.manager.shutdown(wait=False)
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])

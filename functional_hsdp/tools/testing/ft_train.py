"""One replica group's rank of a fault-tolerant training run (the tests' program).

Run by :class:`~functional_hsdp.tools.testing.replica_groups.Group` (or ``torchrun``, one job
per replica group, with ``TORCHFT_LIGHTHOUSE`` and ``REPLICA_GROUP_ID`` set) as
``python -m functional_hsdp.tools.testing.ft_train CONFIG.json``. The group's ranks form a
1-D ``dp_inner`` device mesh (``init_device_mesh``); the replica axis ``replica`` is
``fh.fault_tolerant(manager)``. The model is a small tree; each rank's gradient is a fixed
function of (group, rank, data position), so a reference can be recomputed from the quorum
log. Modes: ``hsdp`` (a quorum and a commit per step) and ``diloco`` (a quorum per sync).

The log (JSON lines, ``CONFIG['out']/g{gid}r{rank}.jsonl``): one line per quorum with its
record, the data position used, and the full params after the step; ``{"done": ...}`` at the
end. The run ends after ``CONFIG['steps']``, once every failure of the schedule has happened,
at the first committed quorum of every group (``CONFIG['groups']``), so that a restarted group
is back before the end. Failure points
(``CONFIG['die']``: a list of ``{"group": g, "step": s, "phase": p, "life": k}``, for the
k-th start of that group, from 0, ``FH_RESTART``): at the first point at or after step ``s``
where the quorum has every group, the group's ranks write
``CONFIG['out']/dying.g{g}.{k}`` and sleep (the test kills them by pid), at ``phase`` =
``"before_quorum"`` (between steps), ``"after_quorum"`` (mid-step), ``"before_sync"`` (just
before the outer collective: the survivors are in it when the group dies) or, for DiLoCo,
``"in_flight"`` (a delayed sync issued and not landed). ``{"group": null, "phase":
"sending"}``: the first group that sends its state to a healing peer dies while sending it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def grad_of(gid: int, rank: int, pos: int, *, shapes: dict) -> dict:
    """The gradient a rank computes at data position ``pos``: a fixed function of them."""
    g = torch.Generator().manual_seed(100_003 * gid + 1009 * rank + pos)
    return {k: torch.randn(n, generator=g) for k, n in shapes.items()}


class Run:
    """One rank's run: the group, the mesh, the log and the failure points of ``cfg``."""

    def __init__(self, cfg: dict):
        from torch.distributed.device_mesh import init_device_mesh

        import functional_hsdp as fh

        from .replica_groups import manager_from_env

        self.cfg, self.fh = cfg, fh
        self.gid, self.rank = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["RANK"])
        self.restart = int(os.environ.get("FH_RESTART", "0"))
        dist.init_process_group("gloo")
        dm = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_inner",))
        self.manager = manager_from_env(
            timeout=cfg.get("timeout", 5.0), quorum_timeout=cfg.get("quorum_timeout", 60.0)
        )
        self.ft = fh.fault_tolerant(self.manager, axis="replica")
        self.spec = fh.hsdp(fh.DistMesh(dm, replicas=self.ft), "replica", "dp_inner")
        self.shapes = {"w": 10, "b": 3}
        self.lr, self.steps, self.out = cfg.get("lr", 0.1), cfg["steps"], Path(cfg["out"])
        self.log = open(self.out / f"g{self.gid}r{self.rank}.jsonl", "a")
        self.dies = [
            d
            for d in cfg.get("die", [])
            if d["group"] == self.gid and d.get("life", 0) == self.restart
        ]
        self.everyone = cfg.get("groups", 1)
        if not self.restart and any(d["phase"] == "sending" for d in cfg.get("die", [])):
            self._die_sending()

    def _die_sending(self) -> None:
        """The first group asked for its state by a healing peer dies while sending it (in
        torchft's quorum thread, inside fh's state-dict callback): marker
        ``dying.any.sending`` (holding ``gid life``), then sleep until killed."""
        fns = self.manager._user_state_dicts  # torchft's registered callbacks (failure injection)
        save = fns["functional_hsdp"]

        def dying_save():
            try:
                fd = os.open(self.out / "sending.claimed", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return save()
            os.close(fd)
            tmp = self.out / f"sending.{self.rank}.tmp"  # whole when the harness reads it
            tmp.write_text(f"{self.gid} {self.restart}")
            os.replace(tmp, self.out / "dying.any.sending")
            time.sleep(600)

        fns["functional_hsdp"] = dying_save

    def whole(self) -> bool:
        """Whether the last quorum had every group."""
        return bool(self.ft.log) and self.ft.log[-1].participants == self.everyone

    def ended(self, count: int) -> bool:
        """The job's end: its step budget, every failure of the schedule done, at a committed
        quorum of every group (capped at 20 times the budget)."""
        done = self.whole() and self.ft.log[-1].committed and self.all_died()
        return (count >= self.steps and done) or count >= 20 * self.steps

    def all_died(self) -> bool:
        """Whether every failure of the schedule (any group's) has happened and the group it
        killed is back: a committed step after its restart (its marker ``back.g{g}.{life}``)."""
        for d in self.cfg.get("die", []):
            if d["group"] is None:
                marker = self.out / "dying.any.sending"
                if not marker.exists():
                    return False
                gid, life = map(int, marker.read_text().split())
            else:
                gid, life = d["group"], d.get("life", 0)
            if not (self.out / f"back.g{gid}.{life + 1}").exists():
                return False
        return True

    def maybe_die(self, step: int, phase: str) -> None:
        """At the first such point at or after a failure's step with every group in the
        quorum: the marker, then sleep until killed."""
        if self.whole():
            if any(step >= d["step"] and d["phase"] == phase for d in self.dies):
                (self.out / f"dying.g{self.gid}.{self.restart}").write_text(str(os.getpid()))
                time.sleep(600)

    def write(self, **kw) -> None:
        self.log.write(json.dumps(kw) + "\n")
        self.log.flush()

    def record(self, rec, params, spec, **kw) -> None:
        """One decided quorum in the log; a restarted group that committed a step marks
        itself back (the end of the run waits for it)."""
        if self.restart and rec.committed:  # in step with the others again
            (self.out / f"back.g{self.gid}.{self.restart}").write_text("")
        full = self.fh.gather(params, spec)
        self.write(q=rec.index, step=rec.step, n=rec.participants, rank=rec.rank,
                   healed=rec.healed, commit=rec.committed,
                   params={k: v.tolist() for k, v in full.items()}, **kw)  # fmt: skip

    def barrier(self) -> None:
        """The harness's start barrier: every group up before the first quorum."""
        if self.restart or not self.cfg.get("groups"):
            return
        (self.out / f"ready.g{self.gid}r{self.rank}").write_text("")
        while len(list(self.out.glob("ready.g*"))) < self.everyone * dist.get_world_size():
            time.sleep(0.02)

    def step_grads(self, pos: int, spec) -> dict:
        return self.fh.reduce_grads(
            grad_of(self.gid, self.rank, pos, shapes=self.shapes), spec, last=True
        )

    def hsdp(self) -> tuple:
        fh, ft, spec = self.fh, self.ft, self.spec
        params = fh.shard({k: torch.zeros(n) for k, n in self.shapes.items()}, spec)
        pos = 0
        while not self.ended(pos):
            self.maybe_die(pos, "before_quorum")
            params, pos = ft.quorum((params, pos))
            self.maybe_die(pos, "after_quorum")
            grads = grad_of(self.gid, self.rank, pos, shapes=self.shapes)
            self.maybe_die(pos, "before_sync")  # the survivors are in the outer collective
            g = fh.reduce_grads(grads, spec, last=True)
            used = pos
            if ft.commit():
                params = {k: params[k] - self.lr * g[k] for k in params}
                pos += 1
            self.record(ft.log[-1], params, spec, pos=used)
            time.sleep(self.cfg.get("pace", 0.0))
        return params, spec

    def make_diloco(self):
        fh, cfg = self.fh, self.cfg
        compress = fh.compress(torch.int8) if cfg.get("compress") else None
        return fh.diloco(
            self.spec,
            axis="replica",
            every=cfg["every"],
            delay=cfg.get("delay", 0),
            fragments=cfg.get("fragments", 1),
            outer=fh.sgd(0.7, momentum=0.9, nesterov=True),
            compress=compress,
        )

    def diloco(self) -> tuple:
        fh, ft, cfg, dl = self.fh, self.ft, self.cfg, self.make_diloco()
        params = fh.shard({k: torch.zeros(n) for k, n in self.shapes.items()}, dl.inner)
        state, pos, syncs = dl.init(params), 0, []  # syncs: per quorum, (t, pos)

        def logged(params) -> None:  # every quorum decided so far, once
            for rec in ft.log[len(self._written) :]:
                if rec.committed is None:
                    break
                t, at = syncs[rec.index]
                self.record(rec, params, dl.inner, t=t, pos=at)
                self._written.append(rec.index)

        self._written = []
        if self.restart:  # join at the survivors' next sync, healed there
            params, state, pos = ft.quorum((params, state, pos))
            syncs.append((state.count + 1, pos))
            if dl.sync_due(state):
                params, state = dl.update(params, state)
            else:
                ft.commit()
            logged(params)
        while not self.ended(state.count):
            t = state.count + 1
            g = self.step_grads(pos, dl.inner)  # over dp_inner only
            params = {k: params[k] - self.lr * g[k] for k in params}
            pos += 1
            if dl.sync_due(state):
                self.maybe_die(t, "before_quorum")
                params, state, pos = ft.quorum((params, state, pos))
                syncs.append((t, pos))
                self.maybe_die(t, "before_sync")
            params, state = dl.update(params, state)
            if state.flight:
                self.maybe_die(t, "in_flight")
            logged(params)
            time.sleep(cfg.get("pace", 0.0))
        return params, dl.inner


def _muon_step(fh, spec, *, start: torch.Tensor, grad: torch.Tensor) -> dict:
    """One Muon step on ``spec`` from the weights ``start`` with this rank's ``grad``."""
    opt = fh.muon(spec, lr=0.02)
    params = fh.shard({"m": start}, spec)
    g = fh.reduce_grads({"m": grad}, spec, last=True)
    updates, _ = opt.update(g, opt.init(params), params)
    return fh.apply_updates(params, updates)


def exercise(fh, quorum, *, mesh, grads_at) -> tuple[dict, list]:
    """Every path over the replica axis once, with no failure, on ``mesh`` (a replicas
    DistMesh, or a SimMesh with a simulated quorum): a compressed HSDP reduction (the
    all-to-all and all-gather over the axis), MainGrad over 3 microbatches, Muon on a matrix
    (HSDP's, and with owners within each group: ``fh.owned(spec, "dp_inner")``), DiLoCo with
    2 fragments and compressed syncs. ``quorum`` is the axis's quorum; ``grads_at(k)`` the
    k-th gradient tree of this rank (every rank's, stacked, on a SimMesh). Returns the full
    results and ``comm_log``'s events; on a DistMesh also the Muon results after a
    checkpoint's round trip (``checkpoint``, ``checkpoint_owned``, not logged)."""
    out = {}
    like = {"w": torch.zeros(10), "b": torch.zeros(3), "m": torch.zeros(4, 6)}
    with fh.comm_log() as log:
        quorum.quorum(None)
        int8 = fh.compress(torch.int8, error_feedback=False)
        spec = fh.hsdp(mesh, "replica", "dp_inner", outer_compress=int8)
        g, _ = fh.reduce_grads(grads_at(0), spec, last=True)  # (grads, residual)
        out["compressed"] = fh.gather(g, spec)
        spec = fh.hsdp(mesh, "replica", "dp_inner")
        mg = fh.MainGrad(spec, like=like)
        for m in range(3):
            mg.accumulate(grads_at(1 + m), last=m == 2)
        out["maingrad"] = fh.gather(mg.grads, spec)
        muon = _muon_step(fh, spec, start=like["m"] + 1.0, grad=grads_at(4)["m"])
        out["muon"] = fh.gather(muon, spec)
        owned = fh.owned(spec, "dp_inner")  # owners within each group: no Muon collective
        owned_params = _muon_step(fh, owned, start=like["m"] + 1.0, grad=grads_at(4)["m"])
        out["owned"] = fh.gather(owned_params, owned)
        assert quorum.commit()
        dl = fh.diloco(
            spec, axis="replica", every=2, fragments=2, outer=fh.sgd(0.7, momentum=0.9),
            compress=fh.compress(torch.int8),
        )  # fmt: skip
        params = fh.shard(like, dl.inner)
        state = dl.init(params)
        for t in range(4):
            g = fh.reduce_grads(grads_at(5 + t), dl.inner, last=True)
            params = {k: params[k] - 0.1 * g[k] for k in params}
            if dl.sync_due(state):
                params, state = quorum.quorum((params, state))
            params, state = dl.update(params, state)
        out["diloco"] = fh.gather(params, dl.inner)
    events = [(e.op, e.axis, str(e.dtype), e.numel) for e in log.events]
    if hasattr(mesh, "device_mesh"):  # checkpoints live on a real DeviceMesh: a round trip
        back = fh.load_state_dict(fh.state_dict(muon, spec), spec, {"m": like["m"]})
        out["checkpoint"] = fh.gather(back, spec)
        back = fh.load_state_dict(fh.state_dict(owned_params, owned), owned, {"m": like["m"]})
        out["checkpoint_owned"] = fh.gather(back, owned)
    return out, events


def main(path: str) -> None:
    run = Run(json.loads(Path(path).read_text()))
    run.barrier()
    if run.cfg["mode"] == "paths":
        shapes = {"w": 10, "b": 3, "m": 24}

        def grads_at(k: int) -> dict:
            g = grad_of(run.gid, run.rank, k, shapes=shapes)
            return {**g, "m": g["m"].view(4, 6)}

        got, events = exercise(run.fh, run.ft, mesh=run.spec.mesh, grads_at=grads_at)
        full = {name: {k: v.tolist() for k, v in tree.items()} for name, tree in got.items()}
        run.write(paths=full, events=events)
        run.write(done=True, params={})
    else:
        params, spec = run.hsdp() if run.cfg["mode"] == "hsdp" else run.diloco()
        done = {k: v.tolist() for k, v in run.fh.gather(params, spec).items()}
        run.write(done=True, params=done)
    run.log.close()
    run.manager.shutdown(wait=False)
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])

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
end. The run ends after ``CONFIG['steps']`` at the first committed quorum of every group
(``CONFIG['groups']``), so that a restarted group is back before the end. Failure points
(``CONFIG['die']``: a list of ``{"group": g, "step": s, "phase": p, "life": k}``, for the
k-th start of that group, from 0, ``FH_RESTART``): at the first point at or after step ``s``
where the quorum has every group (and before the step budget), the group's ranks write ``CONFIG['out']/dying.g{g}.{k}``
and sleep (the test kills them by pid), at ``phase`` = ``"before_quorum"`` (between steps),
``"after_quorum"`` (mid-step), ``"before_sync"`` (just before the outer collective: the
survivors are in it when the group dies) or, for DiLoCo, ``"in_flight"`` (a delayed sync
issued and not landed).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def grad_of(gid: int, rank: int, pos: int, shapes: dict) -> dict:
    """The gradient a rank computes at data position ``pos``: a fixed function of them."""
    g = torch.Generator().manual_seed(100_003 * gid + 1009 * rank + pos)
    return {k: torch.randn(n, generator=g) for k, n in shapes.items()}


def main(path: str) -> None:
    cfg = json.loads(Path(path).read_text())
    import functional_hsdp as fh
    from torch.distributed.device_mesh import init_device_mesh

    from .replica_groups import manager_from_env

    gid, rank = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["RANK"])
    restart = int(os.environ.get("FH_RESTART", "0"))
    dist.init_process_group("gloo")
    dm = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_inner",))
    manager = manager_from_env(timeout=cfg.get("timeout", 5.0), quorum_timeout=cfg.get("quorum_timeout", 60.0))
    ft = fh.fault_tolerant(manager, axis="replica")
    mesh = fh.DistMesh(dm, replicas=ft)
    spec = fh.hsdp(mesh, "replica", "dp_inner")
    shapes = {"w": 10, "b": 3}
    lr, steps = cfg.get("lr", 0.1), cfg["steps"]
    out = Path(cfg["out"])
    log = open(out / f"g{gid}r{rank}.jsonl", "a")
    dies = [d for d in cfg.get("die", []) if d["group"] == gid and d.get("life", 0) == restart]

    everyone = cfg.get("groups", 1)

    def whole() -> bool:  # the last quorum had every group
        return bool(ft.log) and ft.log[-1].participants == everyone

    def maybe_die(step: int, phase: str) -> None:
        # at the first such point at or after ``step`` with every group in the quorum
        if whole() and step < steps and any(step >= d["step"] and d["phase"] == phase for d in dies):
            (out / f"dying.g{gid}.{restart}").write_text(str(os.getpid()))
            time.sleep(600)

    def write(**kw) -> None:
        log.write(json.dumps(kw) + "\n")
        log.flush()

    if not restart and cfg.get("groups"):  # the harness's start barrier: every group up
        (out / f"ready.g{gid}r{rank}").write_text("")
        while len(list(out.glob("ready.g*"))) < cfg["groups"] * dist.get_world_size():
            time.sleep(0.02)
    full = {k: torch.zeros(n) for k, n in shapes.items()}
    pace = cfg.get("pace", 0.0)
    if cfg["mode"] == "hsdp":
        params = fh.shard(full, spec)
        pos = 0
        # the job's end: its step budget, at a committed quorum of every group (capped)
        while not (pos >= steps and whole() and ft.log[-1].committed) and pos < 3 * steps:
            maybe_die(pos, "before_quorum")
            params, pos = ft.quorum((params, pos))
            rec = ft.log[-1]
            maybe_die(pos, "after_quorum")
            grads = grad_of(gid, rank, pos, shapes)
            maybe_die(pos, "before_sync")
            g = fh.reduce_grads(grads, spec, last=True)
            ok = ft.commit()
            used = pos
            if ok:
                params = {k: params[k] - lr * g[k] for k in params}
                pos += 1
            full = fh.gather(params, spec)
            write(q=rec.index, step=rec.step, n=rec.participants, rank=rec.rank, healed=rec.healed,
                  commit=ok, pos=used, params={k: v.tolist() for k, v in full.items()})
            time.sleep(pace)
    else:
        dl = fh.diloco(spec, axis="replica", every=cfg["every"], delay=cfg.get("delay", 0),
                       fragments=cfg.get("fragments", 1),
                       outer=fh.sgd(0.7, momentum=0.9, nesterov=True),
                       compress=fh.compress(torch.int8) if cfg.get("compress") else None)
        params = fh.shard(full, dl.inner)
        state = dl.init(params)
        pos, written = 0, 0

        def log_syncs() -> None:  # every quorum decided so far, once
            nonlocal written
            for rec in ft.log[written:]:
                if rec.committed is None:
                    break
                write(q=rec.index, step=rec.step, n=rec.participants, rank=rec.rank,
                      healed=rec.healed, commit=rec.committed, t=syncs[rec.index],
                      pos=positions[rec.index],
                      params={k: v.tolist() for k, v in fh.gather(params, dl.inner).items()})
                written += 1

        syncs, positions = [], []
        if restart:  # join at the survivors' next sync, healed there
            params, state, pos = ft.quorum((params, state, pos))
            syncs.append(state.count + 1)
            positions.append(pos)
            if dl.sync_due(state):
                params, state = dl.update(params, state)
            else:
                ft.commit()
            log_syncs()
        while not (state.count >= steps and whole() and ft.log[-1].committed) and state.count < 3 * steps:
            t = state.count + 1
            grads = grad_of(gid, rank, pos, shapes)
            g = fh.reduce_grads(grads, dl.inner, last=True)  # over dp_inner only
            params = {k: params[k] - lr * g[k] for k in params}
            pos += 1
            if dl.sync_due(state):
                maybe_die(t, "before_quorum")
                params, state, pos = ft.quorum((params, state, pos))
                syncs.append(t)
                positions.append(pos)
                maybe_die(t, "before_sync")
            params, state = dl.update(params, state)
            if state.flight:
                maybe_die(t, "in_flight")
            log_syncs()
            time.sleep(pace)
    write(done=True, params={k: v.tolist() for k, v in fh.gather(params, spec if cfg["mode"] == "hsdp" else dl.inner).items()})
    log.close()
    manager.shutdown(wait=False)
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])

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
end. Failure points (``CONFIG['die']``: ``{"group": g, "step": s, "phase": p}``, for the first
start of that group only): the group's ranks write ``CONFIG['out']/dying.g{g}`` and sleep (the
test kills them by pid) at ``phase`` = ``"before_quorum"`` (between steps),
``"after_quorum"`` (mid-step) or ``"before_sync"`` (just before the outer collective: the
survivors are in it when the group dies).
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
    die = cfg.get("die") or {}
    doomed = die.get("group") == gid and not restart

    def maybe_die(step: int, phase: str) -> None:
        if doomed and die["step"] == step and die["phase"] == phase:
            (out / f"dying.g{gid}").write_text(str(os.getpid()))
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
        while pos < steps:
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
        pos = 0
        if restart:  # join at the survivors' next sync, healed there
            params, state, pos = ft.quorum((params, state, pos))
            if dl.sync_due(state):
                rec = ft.log[-1]
                params, state = dl.update(params, state)
                write(q=rec.index, step=rec.step, n=rec.participants, rank=rec.rank,
                      healed=rec.healed, commit=ft.log[-1].committed, pos=pos, t=state.count,
                      params={k: v.tolist() for k, v in fh.gather(params, dl.inner).items()})
            else:
                ft.commit()
        while state.count < steps:
            t = state.count + 1
            grads = grad_of(gid, rank, pos, shapes)
            g = fh.reduce_grads(grads, dl.inner, last=True)  # over dp_inner only
            params = {k: params[k] - lr * g[k] for k in params}
            pos += 1
            rec = None
            if dl.sync_due(state):
                maybe_die(t, "before_quorum")
                params, state, pos = ft.quorum((params, state, pos))
                rec = ft.log[-1]
                maybe_die(t, "before_sync")
            params, state = dl.update(params, state)
            if rec is not None and not dl.delay:
                write(q=rec.index, step=rec.step, n=rec.participants, rank=rec.rank,
                      healed=rec.healed, commit=ft.log[-1].committed, pos=pos, t=t,
                      params={k: v.tolist() for k, v in fh.gather(params, dl.inner).items()})
            time.sleep(pace)
    write(done=True, params={k: v.tolist() for k, v in fh.gather(params, spec if cfg["mode"] == "hsdp" else dl.inner).items()})
    log.close()
    manager.shutdown(wait=False)
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])

"""The fault-tolerant replica axis on real processes: a torchft lighthouse, 3 replica groups of
gloo ranks (``init_device_mesh`` over the group, ``fh.DistMesh(dm, replicas=ft)``; 1 rank per
group where the group's own axis is not what a test is about, else 2), whole groups killed by
pid (SIGKILL) at chosen points and restarted.

Per-step HSDP: a group killed during the outer collective, one killed after the quorum and one
killed between steps; each restarted group heals from a live peer with no checkpoint. DiLoCo
(delayed syncs): a group killed during a sync and one killed with its sync in flight. In every
run the survivors finish every step, nothing hangs, and every group's weights equal the
reference recomputed from the logged quorums: per-step, the mean over each committed step's
participants of their gradients; DiLoCo, the same run replayed on a SimMesh with a simulated
quorum of the logged participants (itself checked against a naive reference in
``test_replicas_sim.py``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchft", reason="the fault-tolerance extra: pip install -e '.[ft]'")

import functional_hsdp as fh  # noqa: E402
from functional_hsdp.tools.testing.ft_train import grad_of  # noqa: E402
from functional_hsdp.tools.testing.replica_groups import Group, Lighthouse  # noqa: E402

G, I = 3, 2  # noqa: E741 - groups x ranks per group
ONE = 1  # the failure runs' ranks per group where the inner axis is not what they test
SHAPES = {"w": 10, "b": 3}
LR = 0.1
PROGRAM = [sys.executable, "-m", "functional_hsdp.tools.testing.ft_train"]


def run_groups(
    tmp: Path,
    cfg: dict,
    *,
    deadline: float = 150.0,
    n: int = G,
    ranks: int = I,
    torchrun: bool = False,
) -> dict:
    """Start the lighthouse and the groups, kill each group named in ``cfg['die']`` by pid when
    it reaches its failure point, restart it after a pause, and wait for every group to end.
    Returns each group's records (rank 0's log; every rank's 'done' params)."""
    cfg = {**cfg, "out": str(tmp), "groups": n}
    (tmp / "cfg.json").write_text(json.dumps(cfg))
    argv = [*PROGRAM, str(tmp / "cfg.json")]
    pending = list(cfg["die"])
    groups: list[Group] = []
    lives = [0] * n
    start = time.monotonic()
    with Lighthouse(min_replicas=2, heartbeat_timeout_ms=1000, log=tmp / "lighthouse.log") as lh:
        try:
            groups = [
                Group(g, ranks, argv, lighthouse=lh.addr, log_dir=tmp, torchrun=torchrun)
                for g in range(n)
            ]
            while pending:  # whichever failure point is reached first
                marker = {_marker(tmp, d): d for d in pending}
                while not (reached := [d for m, d in marker.items() if m.exists()]):
                    assert time.monotonic() - start < deadline, f"never reached {pending}"
                    ended = all(p.poll() is not None for g in groups for p in g.procs)
                    assert not ended, f"every group ended before {pending}: see {tmp}"
                    time.sleep(0.02)
                d = reached[0]
                if d["group"] is None:  # the sender of a heal: whichever group it was
                    pending.remove(d)
                    gid, life = map(int, _marker(tmp, d).read_text().split())
                    d = {**d, "group": gid, "life": life}
                    pending.append(d)
                time.sleep(0.2)  # the survivors are in the step (or the collective) now
                groups[d["group"]].kill()
                time.sleep(0.5)  # the pause before the restart
                lives[d["group"]] += 1
                env = {"FH_RESTART": str(lives[d["group"]])}
                groups[d["group"]] = Group(
                    d["group"], ranks, argv, lighthouse=lh.addr, log_dir=tmp, env=env
                )
                pending.remove(d)
            for g in groups:
                codes = g.wait(max(deadline - (time.monotonic() - start), 1.0))
                assert codes == [0] * len(g.procs), f"group {g.gid} ended with {codes}: see {tmp}"
        finally:
            for g in groups:
                g.kill()
    out = {}
    for g in range(n):
        lines = [json.loads(x) for x in (tmp / f"g{g}r0.jsonl").read_text().splitlines()]
        dones = []
        for r in range(ranks):
            dones += [
                json.loads(x)
                for x in (tmp / f"g{g}r{r}.jsonl").read_text().splitlines()
                if '"done"' in x
            ]
        paths = []
        for r in range(ranks):
            text = (tmp / f"g{g}r{r}.jsonl").read_text().splitlines()
            paths += [json.loads(x) for x in text if '"paths"' in x]
        out[g] = {"records": [x for x in lines if "done" not in x], "done": dones, "paths": paths}
    return out


def _marker(tmp: Path, d: dict) -> Path:
    if d["group"] is None:
        return tmp / "dying.any.sending"
    return tmp / f"dying.g{d['group']}.{d.get('life', 0)}"


def _tensors(params: dict) -> dict:
    return {k: torch.tensor(v) for k, v in params.items()}


@pytest.mark.timeout(240)
def test_hsdp_survivors_never_stop_and_a_restarted_group_heals(tmp_path):
    die = [
        {"group": 1, "step": 3, "phase": "before_sync"},  # during the outer collective
        {"group": 2, "step": 8, "phase": "after_quorum"},  # mid-step
        {"group": 0, "step": 13, "phase": "before_quorum"},  # between steps
    ]
    cfg = {"mode": "hsdp", "steps": 16, "die": die, "pace": 0.05, "quorum_timeout": 30}
    logs = run_groups(tmp_path, cfg, ranks=ONE)
    # the reference: per committed torchft step, the participants and their data positions
    steps: dict[int, dict[int, int]] = {}
    sizes: dict[int, set] = {}
    for g, log in logs.items():
        for rec in log["records"]:
            sizes.setdefault(rec["step"], set()).add((rec["commit"], rec["n"]))
            if rec["commit"]:
                steps.setdefault(rec["step"], {})[g] = rec["pos"]
    assert sorted(steps) == list(range(len(steps))) and len(steps) >= 16
    w = {k: torch.zeros(n) for k, n in SHAPES.items()}
    for s in sorted(steps):
        who = steps[s]
        assert (True, len(who)) in sizes[s], (s, who, sizes[s])
        mean = {
            k: torch.stack(
                [grad_of(g, i, p, shapes=SHAPES)[k] for g, p in who.items() for i in range(ONE)]
            ).mean(0)
            for k in SHAPES
        }
        w = {k: w[k] - LR * mean[k] for k in SHAPES}
    for log in logs.values():
        assert len(log["done"]) == ONE  # every rank of the last incarnation finished
        for done in log["done"]:
            for k in SHAPES:
                torch.testing.assert_close(_tensors(done["params"])[k], w[k], rtol=0, atol=1e-6)
    # failures cost commits, never a stop: each failure left one uncommitted step behind
    failed = {rec["step"] for log in logs.values() for rec in log["records"] if not rec["commit"]}
    assert 1 <= len(failed) <= 3
    healed = [rec for log in logs.values() for rec in log["records"] if rec["healed"]]
    assert {r["rank"] >= 0 for r in healed} and len(healed) == 3  # every restart healed
    assert min(len(steps[s]) for s in steps) == 2 and max(len(steps[s]) for s in steps) == 3


@pytest.mark.timeout(240)
def test_diloco_survivors_never_stop_and_match_the_simulated_quorum(tmp_path):
    every, steps = 2, 16
    die = [
        {"group": 1, "step": 4, "phase": "before_sync"},  # its sync's peers are in the all-reduce
        {"group": 2, "step": 8, "phase": "in_flight"},  # its delayed sync issued, not landed
    ]
    cfg = {"mode": "diloco", "steps": steps, "every": every, "delay": 1, "die": die, "pace": 0.05}
    logs = run_groups(tmp_path, cfg, ranks=ONE)
    # the syncs as logged: who took part at each issue step t, and whether it committed
    syncs: dict[int, dict] = {}
    for g, log in logs.items():
        for rec in log["records"]:
            entry = syncs.setdefault(rec["t"], {"alive": set(), "commit": set(), "n": set()})
            entry["alive"].add(g)
            entry["commit"].add(rec["commit"])
            entry["n"].add(rec["n"])
    assert all(len(e["commit"]) == 1 and len(e["n"]) == 1 for e in syncs.values()), syncs
    for e in syncs.values():  # a group killed with its sync in flight took part, unlogged
        (n,) = e["n"]
        assert n == len(e["alive"]) or n == G, e
        e["alive"] = set(range(G)) if n == G else e["alive"]
    order = sorted(syncs)
    assert order == list(range(every, order[-1] + 1, every)) and order[-1] >= steps  # none skipped
    fails = [k for k, t in enumerate(order) if syncs[t]["commit"] == {False}]
    assert 1 <= len(fails) <= 2
    alive = [tuple(sorted(syncs[t]["alive"])) for t in order]
    want = replay(alive, fails, steps=order[-1] + 1, every=every, delay=1)  # the last lands
    for log in logs.values():
        for done in log["done"]:
            for k in SHAPES:
                torch.testing.assert_close(
                    _tensors(done["params"])[k], want[k], rtol=1e-6, atol=1e-6
                )
    assert sum(1 for log in logs.values() for rec in log["records"] if rec["healed"]) == 2


def replay(alive: list, fails: list, *, steps: int, every: int, delay: int) -> dict:
    """The DiLoCo run on a SimMesh with the logged quorums: the final weights (every replica's
    are equal at the end)."""
    sim = fh.simulated_quorum(axis="replica", alive=alive, fail=fails)
    mesh = fh.SimMesh({"replica": G, "dp_inner": ONE}, replicas=sim)
    dl = fh.diloco(
        fh.hsdp(mesh, "replica", "dp_inner"), axis="replica", every=every, delay=delay,
        outer=fh.sgd(0.7, momentum=0.9, nesterov=True),
    )  # fmt: skip
    params = fh.shard({k: torch.zeros(n) for k, n in SHAPES.items()}, dl.inner)
    state = dl.init(params)
    pos = torch.zeros(G, ONE, dtype=torch.int64)
    while state.count < steps:
        grads = {
            k: torch.stack(
                [
                    torch.stack(
                        [grad_of(g, i, int(pos[g, i]), shapes=SHAPES)[k] for i in range(ONE)]
                    )
                    for g in range(G)
                ]
            )
            for k in SHAPES
        }
        g = fh.reduce_grads(grads, dl.inner, last=True)
        params = {k: params[k] - LR * g[k] for k in params}
        pos = pos + 1
        if dl.sync_due(state):
            params, state, pos = sim.quorum((params, state, pos))
        params, state = dl.update(params, state)
    full = fh.gather(params, dl.inner)
    last = sim.log[-1].alive
    return {k: full[k][last[0], 0] for k in SHAPES}


@pytest.mark.timeout(120)
def test_with_no_failure_every_path_equals_a_simmesh_bit_for_bit(tmp_path):
    """2 groups, each started by torchrun, no failure: a compressed reduction, MainGrad, Muon
    (HSDP's, and with owners within each group) and compressed DiLoCo with fragments give a
    plain SimMesh's results bit for bit, with the same collectives (comm_log); a checkpoint
    saved and loaded on the fault-tolerant mesh gives its values back."""
    from functional_hsdp.tools.testing.ft_train import exercise

    # each group one real torchrun job, with the environment torchft reads
    logs = run_groups(tmp_path, {"mode": "paths", "steps": 1, "die": []}, n=2, torchrun=True)
    mesh = fh.SimMesh({"replica": 2, "dp_inner": I})  # the plain mesh: no quorum at all

    class Plain:  # a plain mesh's loop: no quorum, every step commits
        def quorum(self, trees):
            return trees

        def commit(self):
            return True

    shapes = {"w": 10, "b": 3, "m": 24}

    def grads_at(k: int) -> dict:
        per = [[grad_of(g, i, k, shapes=shapes) for i in range(I)] for g in range(2)]
        out = {
            key: torch.stack([torch.stack([p[key] for p in row]) for row in per]) for key in shapes
        }
        return {**out, "m": out["m"].view(2, I, 4, 6)}

    want, events = exercise(fh, Plain(), mesh=mesh, grads_at=grads_at)
    for g in range(2):
        assert len(logs[g]["paths"]) == I
        for i, got in enumerate(logs[g]["paths"]):
            assert [tuple(e) for e in got["events"]] == events
            assert got["paths"]["checkpoint"] == got["paths"]["muon"]  # saved and loaded back
            assert got["paths"]["checkpoint_owned"] == got["paths"]["owned"]
            for name, tree in want.items():
                for k, v in tree.items():
                    assert torch.equal(torch.tensor(got["paths"][name][k]), v[g, i]), (
                        name,
                        k,
                        g,
                        i,
                    )


def test_bad_input_is_refused_with_a_clear_error():
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    from functional_hsdp.tools.testing.replica_groups import free_port

    with pytest.raises(TypeError, match="manager must be a torchft.Manager"):
        fh.fault_tolerant(object(), axis="replica")
    with pytest.raises(TypeError, match="replicas must be fh.fault_tolerant"):
        fh.DistMesh(None, replicas=object())
    with Lighthouse() as lh:
        port = free_port()
        store = TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False)
        manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=5)),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=1,
            use_async_quorum=True,
            rank=0,
            world_size=1,
            store_addr="127.0.0.1",
            store_port=port,
            lighthouse_addr=lh.addr,
            replica_id="group_0",
            timeout=timedelta(seconds=5),
        )
        try:
            with pytest.raises(ValueError, match="use_async_quorum=True; fh needs"):
                fh.fault_tolerant(manager, axis="replica")
            with pytest.raises(TypeError, match="axis must be the replica axis's name"):
                fh.fault_tolerant(manager, axis=0)
        finally:
            manager.shutdown(wait=False)
            del store


def test_manager_from_env_advertises_the_hostname_it_is_given(monkeypatch):
    """``manager_from_env(hostname=...)``, by default ``FH_FT_HOSTNAME``: the manager server's
    address (in the group's store, given to the lighthouse) and the checkpoint transport's (a
    healing peer fetches from it) name that host, not the machine's name (torchft's default:
    in a network namespace it would resolve to the namespace's own loopback)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from functional_hsdp.tools.testing import replica_groups as rg

    with Lighthouse() as lh:
        port = rg.free_port()
        store = TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False)
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
               "WORLD_SIZE": "1", "TORCHFT_LIGHTHOUSE": lh.addr, "REPLICA_GROUP_ID": "0",
               rg.HOSTNAME_ENV: "127.0.0.1"}  # fmt: skip
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        for hostname in (None, "127.0.0.1"):  # the variable's, then the argument's
            manager = rg.manager_from_env(timeout=5.0, hostname=hostname)
            try:
                assert store.get("manager_addr").decode().startswith("http://127.0.0.1:")
                heal = manager._checkpoint_transport.metadata()
                assert heal.startswith("http://127.0.0.1:") and heal.endswith("/checkpoint/")
            finally:
                manager.shutdown(wait=False)
                store.delete_key("manager_addr")
        del store
    transport = rg.checkpoint_transport("fd00::1", timedelta(seconds=5))  # an IPv6 address
    try:
        assert transport.address().startswith("http://[fd00::1]:")
    finally:
        transport.shutdown(wait=False)


@pytest.mark.timeout(240)
def test_compressed_diloco_survives_a_death_mid_sync_and_a_sender_killed_while_healing(tmp_path):
    """int8-compressed DiLoCo syncs (an all-to-all and an all-gather over the replica axis): a
    group killed inside a sync (its peers are in the all-to-all), then the group that sends
    the restarted one its state killed while sending it. The healing group's step fails and
    heals at the next quorum from the other peer; every group ends with the same weights."""
    die = [
        {"group": 1, "step": 4, "phase": "before_sync"},
        {"group": None, "phase": "sending"},
    ]
    cfg = {"mode": "diloco", "steps": 16, "every": 2, "compress": True, "die": die, "pace": 0.05}
    logs = run_groups(tmp_path, cfg)
    finals = [_tensors(done["params"]) for log in logs.values() for done in log["done"]]
    assert len(finals) == G * I
    for other in finals[1:]:
        for k in SHAPES:
            assert torch.equal(other[k], finals[0][k])
    records = [rec for log in logs.values() for rec in log["records"]]
    assert any(not rec["commit"] for rec in records)  # the syncs the deaths broke
    assert sum(rec["healed"] for rec in records) >= 2  # both restarted groups healed
    assert (tmp_path / "sending.claimed").exists()

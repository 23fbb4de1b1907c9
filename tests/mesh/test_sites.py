"""Tests of ``functional_hsdp.tools.testing.sites``: ranks in two network namespaces joined by a
rate-limited veth link (issue 46). They need root, ``ip``/``tc`` and ``tbf`` (``sites.probe()``)
and skip with its reason where the machine cannot make namespaces.

Task functions are module-level (``_task_*``): the ranks import them from this module by name.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from functional_hsdp.mesh import launch
from functional_hsdp.tools.testing import sites

NUMEL = 2 << 20  # float32: 8 MiB, the payload each rank sends across the link in a 2-rank ring
PAYLOAD = NUMEL * 4
RATE_MBIT = 50  # 8 MiB at 50 Mbit/s: 1.34 s at least
LINK_S = PAYLOAD * 8 / (RATE_MBIT * 1e6)


@pytest.fixture
def _can_make_sites():
    reason = sites.probe()
    if reason is not None:
        pytest.skip(reason)


needs_sites = pytest.mark.usefixtures("_can_make_sites")


def test_probe_says_why_a_machine_cannot_make_sites(monkeypatch):
    """Runs everywhere: the reasons the namespace tests skip with (``probe`` is cached: its
    undecorated function is called)."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert sites.probe.__wrapped__() == "not root: network namespaces need root"
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(sites.shutil, "which", lambda tool: None if tool == "tc" else tool)
    assert sites.probe.__wrapped__() == "no tc (iproute2) on PATH"


def _all_reduce(numel: int, group=None) -> tuple[torch.Tensor, float]:
    """A timed sum over ``group`` of a tensor of this rank's own (seeded by its rank)."""
    t = torch.randn(numel, generator=torch.Generator().manual_seed(1000 + dist.get_rank()))
    dist.barrier()
    start = time.perf_counter()
    dist.all_reduce(t, group=group)
    return t, time.perf_counter() - start


def _task_all_reduce(numel: int) -> torch.Tensor:
    return _all_reduce(numel)[0]


def _task_unlimited_then_limited(numel: int, rate_mbit: float):
    """The all-reduce over the link as it is, then limited to ``rate_mbit`` (each rank limits
    its own site's egress), with the bytes this site sent on the link meanwhile."""
    unlimited, t_unlimited = _all_reduce(numel)
    sites.limit_egress(rate_mbit)
    before = sites.link_counters()["tx_bytes"]
    limited, t_limited = _all_reduce(numel)
    dist.barrier()  # a rank's own last bytes may still wait in its tbf when its all-reduce ends
    sent = sites.link_counters()["tx_bytes"] - before
    return {"unlimited": (unlimited, t_unlimited), "limited": (limited, t_limited), "sent": sent}


def _task_inner_then_outer(numel: int):
    """2 sites x 2 ranks: the bytes each site sent on the link and on loopback during an
    all-reduce within each site (ranks {0, 1} and {2, 3}), then one across them ({0, 2} and
    {1, 3}); read by each site's first rank between two barriers, so that no rank starts the
    next all-reduce before the counters are read (one did, and 64 KiB of its site's outer bytes
    fell in the inner window)."""
    r, local = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    inner = [dist.new_group([0, 1]), dist.new_group([2, 3])][r // 2]
    outer = [dist.new_group([0, 2]), dist.new_group([1, 3])][local]
    counts, sums = [], []
    for group in (inner, outer):
        dist.barrier()
        counts.append((sites.link_counters()["tx_bytes"], sites.link_counters("lo")["tx_bytes"]))
        dist.barrier()
        t = torch.full((numel,), float(r))
        dist.all_reduce(t, group=group)
        sums.append(t[0].item())
    dist.barrier()
    counts.append((sites.link_counters()["tx_bytes"], sites.link_counters("lo")["tx_bytes"]))
    deltas = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(counts, counts[1:])]
    return {"sums": sums, "inner": deltas[0], "outer": deltas[1]}


@needs_sites
def test_an_all_reduce_across_the_link_equals_loopbacks_and_takes_the_links_time():
    with sites.Sites(2) as s:
        run = s.run
        assert len(sites.run_namespaces(run)) == 2
        got = s.call(_task_unlimited_then_limited, numel=NUMEL, rate_mbit=RATE_MBIT)
        drops = [s.drops(i) for i in range(2)]
    assert sites.run_namespaces(run) == []  # a normal exit removes everything
    loopback = launch.run(_task_all_reduce, NUMEL, world_size=2)
    for rank, loop in zip(got, loopback, strict=True):
        assert torch.equal(rank["unlimited"][0], loop) and torch.equal(rank["limited"][0], loop)
    t_limited = max(g["limited"][1] for g in got)
    t_unlimited = max(g["unlimited"][1] for g in got)
    sent = [g["sent"] for g in got]
    print(f"8 MiB all-reduce: {t_unlimited:.3f} s unlimited, {t_limited:.3f} s at {RATE_MBIT} "
          f"Mbit/s (link time {LINK_S:.3f} s); tx B {sent}, tbf drops {drops}")  # fmt: skip
    # The last rank to finish has received the payload through the other's tbf, which sends no
    # faster than its rate after a burst of 64 KiB; the margin is for the ranks' clocks, which
    # start at the ends of one barrier (the other rank may start sending a little earlier).
    assert t_limited >= 0.8 * LINK_S, (t_limited, LINK_S)
    assert t_unlimited < 0.5 * LINK_S, (t_unlimited, LINK_S)  # measured: 6-131 ms, loaded
    # Each rank sends the whole payload once (half in reduce-scatter, half in all-gather).
    assert all(PAYLOAD <= b < 1.5 * PAYLOAD for b in sent), (sent, PAYLOAD)


@needs_sites
def test_within_a_site_ranks_talk_over_loopback_and_across_sites_over_the_link():
    numel = 1 << 20  # 4 MiB per rank
    with sites.Sites(2) as s:
        got = s.call(_task_inner_then_outer, ranks_per_site=2, numel=numel)
    assert [g["sums"] for g in got] == [[1.0, 2.0], [1.0, 4.0], [5.0, 2.0], [5.0, 4.0]]
    print(
        "4 MiB per rank, 2x2, bytes sent by each site (link, loopback): inner all-reduce "
        f"{[g['inner'] for g in got[::2]]}, outer {[g['outer'] for g in got[::2]]}"
    )
    for site in got[::2]:  # each site's first rank: the site's counters
        (inner_wan, inner_lo), (outer_wan, outer_lo) = site["inner"], site["outer"]
        # Inner pairs connect to their own site's address: local delivery, not the veth.
        assert inner_wan < numel * 4 / 4 and inner_lo >= 2 * numel * 4, site
        # Two pairs cross each way, each rank sending its payload once; loopback carries none.
        assert outer_wan >= 2 * numel * 4 and outer_lo < numel * 4 / 4, site


def _forked(fn, *args) -> tuple[int, int]:
    """Fork a child that runs ``fn(*args)``, writes its JSON result to a pipe and exits at once
    (``os._exit``: nothing of this process's state runs in it); returns (pid, read end)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(r)
            os.write(w, json.dumps(fn(*args)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


def _joined(pid: int, r: int) -> dict:
    with os.fdopen(r, "rb") as f:
        out = f.read()
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    return json.loads(out)


def _listen_in(netns: str, addr: str, port: int, ready: int) -> dict:
    """In a forked child: enter ``netns``, accept one connection on ``addr:port`` (after saying
    so on the pipe ``ready``) and send its own address back to it."""
    sites.enter(netns)
    with socket.create_server((addr, port)) as srv:
        os.write(ready, b"x")
        conn, _ = srv.accept()
        with conn:
            conn.sendall(addr.encode())
    return {}


def _look_around(netns: str, other: str, port: int) -> dict:
    """In a forked child: enter ``netns`` first thing, then what it sees: its interfaces, its
    IPv4 addresses, whether it can bind another site's address, what a connection to that
    site's listener answers."""
    sites.enter(netns)
    addrs = json.loads(subprocess.run(["ip", "-j", "-4", "addr", "show"], capture_output=True,
                                      text=True, check=True).stdout)  # fmt: skip
    try:
        with socket.socket() as s:
            s.bind((other, 0))
        bind_other = "bound"
    except OSError as e:
        bind_other = e.errno
    with socket.create_connection((other, port), timeout=10) as c:
        answer = c.recv(64).decode()
    return {
        "ifnames": sorted(name for _, name in socket.if_nameindex()),
        "addrs": sorted(a["local"] for x in addrs for a in x["addr_info"]),
        "bind_other": bind_other,
        "answer": answer,
    }


def test_entering_a_namespace_that_does_not_exist_names_it():
    with pytest.raises(FileNotFoundError, match="fhsites-no-such-namespace"):
        sites.enter("fhsites-no-such-namespace")


@needs_sites
def test_a_forked_child_that_entered_a_site_sees_only_that_sites_addresses():
    """What B22's ranks do: forked from a process that stays in the machine's namespace, each
    enters its site's with ``sites.enter`` before its first socket."""
    mine = sorted(name for _, name in socket.if_nameindex())
    with sites.Sites(2) as s:
        a, b = s.sites
        ready_r, ready_w = os.pipe()
        listener = _forked(_listen_in, b.netns, b.addr, sites.PORT, ready_w)
        os.close(ready_w)
        assert os.read(ready_r, 1) == b"x"  # site 1 listens
        os.close(ready_r)
        got = _joined(*_forked(_look_around, a.netns, b.addr, sites.PORT))
        _joined(*listener)
    assert got["ifnames"] == sorted(["lo", sites.IFNAME]), got
    assert got["addrs"] == sorted(["127.0.0.1", a.addr]), got
    assert got["bind_other"] == errno.EADDRNOTAVAIL, got  # site 1's address is not here
    assert got["answer"] == b.addr  # but it is reached across the link
    assert sorted(name for _, name in socket.if_nameindex()) == mine  # this process never moved


def _start_launcher() -> tuple[subprocess.Popen, str]:
    """A launcher process (the module's ``run`` command) with 2 sites of one sleeping rank
    each; returns it and its run's name once both ranks run in their namespaces."""
    argv = [sys.executable, "-m", sites.__name__, "run", "--rate-mbit", "50", "--",
            sys.executable, "-c", "import time; time.sleep(120)"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    run = json.loads(proc.stdout.readline())["run"]
    deadline = time.monotonic() + 60
    while not all(_pids(ns) for ns in sites.run_namespaces(run)):
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.05)
    return proc, run


def _pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _gone(pids: list[int], within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while any(Path(f"/proc/{p}").exists() for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@needs_sites
def test_nothing_is_left_after_a_sigterm_or_a_sigkill_of_the_launcher():
    links_before = sorted(os.listdir("/sys/class/net"))
    proc, run = _start_launcher()
    ranks = [p for ns in sites.run_namespaces(run) for p in _pids(ns)]
    proc.send_signal(signal.SIGTERM)  # the launcher removes everything itself
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert sites.run_namespaces(run) == [] and _gone(ranks)

    proc, run = _start_launcher()
    ranks = [p for ns in sites.run_namespaces(run) for p in _pids(ns)]
    assert len(sites.run_namespaces(run)) == 2 and len(ranks) == 2
    proc.kill()  # SIGKILL: nothing of the launcher runs; its ranks die with it (PDEATHSIG)
    proc.wait(timeout=30)
    assert _gone(ranks)
    left = sites.run_namespaces(run)
    assert len(left) == 2  # a SIGKILL leaves the namespaces: the next run's cleanup removes them
    assert set(left) <= set(sites.cleanup())
    assert sites.run_namespaces(run) == []
    assert sorted(os.listdir("/sys/class/net")) == links_before  # no veth ever in this namespace

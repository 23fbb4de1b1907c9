"""Sites on one machine: ranks in network namespaces joined by a rate-limited link (issue 46).

:class:`Sites` makes, as root, one network namespace per site (a replica group), joins them by a
veth pair (two sites) or by veth pairs to a bridge in a namespace of its own (three or more),
gives site ``i`` the address ``10.213.0.<i+1>/24`` on its end of the link (``wan0``), and limits
each site's egress on it with the ``tbf`` qdisc (:meth:`Sites.set_rate`). Every address and
route lives inside the namespaces it makes: nothing is routed to or from the machine's own
interfaces. :meth:`Sites.spawn` and :meth:`Sites.call` start each site's ranks inside its
namespace (``ip netns exec``) with ``GLOO_SOCKET_IFNAME=wan0`` and the rendezvous (TCPStore) on
site 0's address, so one gloo process group spans every site. A process that is not started that
way (one forked from a process that has imported what it needs, as ``python -m bench faults``
forks its ranks) enters its site with :func:`enter` before it opens any socket.

What crosses the link: gloo gives each rank one address, its site's ``wan0`` address, and every
pair of ranks connects to each other's. A pair in two sites goes over the veth (through the
sender's ``tbf``); a pair in one site connects to its own site's address, which the kernel
delivers locally over the namespace's loopback, not over the veth (:meth:`Sites.counters`
shows it: ``tests/mesh/test_sites.py`` checks both).

Everything a run makes is named ``<prefix><pid>-<token>-...`` and is removed on exit, after an
error, and on a SIGTERM (:class:`Sites` turns it into ``SystemExit`` while it is open in the
main thread); the ranks die with the process that started them (``PR_SET_PDEATHSIG``). What a
killed run left behind, :func:`cleanup` removes: :class:`Sites` calls it when it opens.
:func:`probe` says why a machine cannot make sites (not root, no ``ip`` or ``tc``, no ``tbf``),
or None where it can.

From a shell (``python -m functional_hsdp.tools.testing.sites --help``)::

    python -m functional_hsdp.tools.testing.sites run --sites 2 --ranks-per-site 2 \\
        --rate-mbit 100 -- python my_script.py
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import pickle
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "IFNAME", "PREFIX", "Site", "Sites", "cleanup", "enter", "limit_egress", "link_counters",
    "probe", "run_namespaces",
]  # fmt: skip

PREFIX = "fhsites-"  # every namespace a run makes starts with it (then the run's pid)
IFNAME = "wan0"  # each site's end of the link, inside its namespace
SUBNET = "10.213.0"  # a private range, only ever inside the namespaces made here
_OPEN: set[str] = set()  # the runs of this process's open Sites (cleanup leaves them alone)
PORT = 29500  # the rendezvous port on site 0's address (each namespace has its own ports)
QUEUE_BYTES = 4 << 20  # tbf's queue: a TCP socket's limit here (tcp_limit_output_bytes)
NETNS_DIR = "/var/run/netns"  # where ``ip netns add`` puts a namespace's handle
CLONE_NEWNET = 0x40000000  # setns(2)'s namespace type: a network namespace


@dataclass(frozen=True)
class Site:
    """One site: its namespace, its index and its address on the link (``IFNAME``)."""

    index: int
    netns: str
    addr: str


def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess:
    """Run a command (``ip``, ``tc``), its output captured; raise with its stderr if it fails
    and ``check``."""
    done = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done


@functools.cache
def probe() -> str | None:
    """Why this machine cannot make sites, or None where it can: tried, not guessed (a
    namespace with a veth pair and a ``tbf`` qdisc is made and removed)."""
    if os.geteuid() != 0:
        return "not root: network namespaces need root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"no {' or '.join(missing)} (iproute2) on PATH"
    ns = f"{PREFIX}{os.getpid()}-probe"
    steps = (
        ["ip", "netns", "add", ns],
        ["ip", "-n", ns, "link", "add", "name", "a0", "type", "veth", "peer", "name", "a1"],
        ["tc", "-n", ns, "qdisc", "add", "dev", "a0", "root", *_tbf_args(100)],
    )
    try:
        for step in steps:
            done = _run(step, check=False)
            if done.returncode != 0:
                return f"cannot make sites: {' '.join(step)}: {done.stderr.strip()}"
        return None
    finally:
        _run(["ip", "netns", "del", ns], check=False)


def _tbf_args(rate_mbit: float) -> list[str]:
    """``tbf``'s arguments for ``rate_mbit``: a burst of 10 ms at that rate (64 KiB at least,
    one GSO packet) and a queue of ``QUEUE_BYTES``."""
    burst = max(1 << 16, int(rate_mbit * 1e6 / 8 / 100))
    return ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "limit", str(QUEUE_BYTES)]


def limit_egress(rate_mbit: float | None, *, netns: str | None = None) -> None:
    """Limit the egress of ``IFNAME`` to ``rate_mbit`` Mbit/s with ``tbf``, or lift the limit
    (None): in namespace ``netns``, or (None) in this process's own, as a rank inside a site
    may do between two phases of its task (ranks run as root)."""
    tc = ["tc", "-n", netns] if netns else ["tc"]
    if rate_mbit is None:
        _run([*tc, "qdisc", "del", "dev", IFNAME, "root"], check=False)  # none set: no error
    else:
        _run([*tc, "qdisc", "replace", "dev", IFNAME, "root", *_tbf_args(rate_mbit)])


def enter(netns: str) -> None:
    """Move the calling thread into network namespace ``netns`` (a name ``ip netns`` knows, as
    :class:`Site` holds it): ``setns(2)`` on ``/var/run/netns/<netns>`` with ``CLONE_NEWNET``
    (``os.setns`` where Python has it, 3.12 on; through ``ctypes`` on 3.11).

    For a process forked from one that has imported what a rank needs (B22's zygote), which
    cannot be started through ``ip netns exec``: the child calls it first thing, before it
    opens any socket. The sockets it opens afterwards are the site's (its addresses, routes
    and ports); those opened before stay in the namespace they were made in. Only the network
    namespace changes, and only the calling thread's: a child forked afterwards (or a thread
    it starts) inherits it, the process's other threads keep theirs, and ``/sys`` still shows
    the machine's interfaces (:func:`link_counters` reads a site's under ``ip netns exec``,
    which mounts a ``/sys`` of the namespace; :meth:`Sites.counters` reads them from
    outside). Needs root (``CAP_SYS_ADMIN``); raises ``OSError`` naming ``netns`` otherwise,
    or where there is no such namespace."""
    path = os.path.join(NETNS_DIR, netns)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if hasattr(os, "setns"):  # pragma: no cover - Python 3.12 and later
            os.setns(fd, CLONE_NEWNET)
            return
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}, CLONE_NEWNET): {os.strerror(err)}")
    finally:
        os.close(fd)


def link_counters(ifname: str = IFNAME) -> dict[str, int]:
    """This process's namespace's counters of ``ifname`` (``/sys/class/net/<if>/statistics``;
    ``ip netns exec`` mounts a ``/sys`` of the namespace): ``tx_bytes``, ``rx_bytes``,
    ``tx_packets``, ``rx_packets``, as :meth:`Sites.counters` reads them from outside."""
    stats = Path("/sys/class/net", ifname, "statistics")
    return {
        f"{way}_{what}": int((stats / f"{way}_{what}").read_text())
        for way in ("tx", "rx")
        for what in ("bytes", "packets")
    }


def run_namespaces(run: str) -> list[str]:
    """The namespaces whose names start with ``run`` (a run's name, or a prefix of many)."""
    done = _run(["ip", "netns", "list"], check=False)
    names = [line.split()[0] for line in done.stdout.splitlines() if line.strip()]
    return sorted(n for n in names if n.startswith(run))


def _remove_namespace(ns: str) -> None:
    """Kill the processes inside ``ns``, then delete it (its veth ends and bridge go with it)."""
    for pid in _run(["ip", "netns", "pids", ns], check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _run(["ip", "netns", "del", ns], check=False)


def _owner_alive(ns: str, prefix: str) -> bool:
    """Whether the process that made ``ns`` (the pid after ``prefix`` in its name) still runs."""
    if any(ns.startswith(f"{run}-") for run in _OPEN):
        return True
    pid = ns[len(prefix) :].split("-", 1)[0]
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    return Path(f"/proc/{pid}").exists()


def cleanup(prefix: str = PREFIX) -> list[str]:
    """Remove the namespaces (and what runs in them) that runs under ``prefix`` left behind:
    those whose maker is gone (killed), or is this process (those of its open :class:`Sites`
    excepted). Returns their names."""
    gone = [ns for ns in run_namespaces(prefix) if not _owner_alive(ns, prefix)]
    for ns in gone:
        _remove_namespace(ns)
    return gone


def _die_with_parent() -> None:
    """In a rank, before its exec: be killed when the launcher dies (``PR_SET_PDEATHSIG``)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


class _Terminated(SystemExit):
    """A SIGTERM while :class:`Sites` was open (exits with 143, as the signal would)."""


def _on_sigterm(signum: int, frame: Any) -> None:
    """Turn a SIGTERM into an exception, so that ``finally`` and ``__exit__`` run."""
    raise _Terminated(128 + signum)


class Sites:
    """``n_sites`` network namespaces joined by a link limited to ``rate_mbit`` per site's
    egress (None: unlimited), as a context manager: made on enter (after :func:`cleanup`),
    removed with every rank still running on exit. Needs :func:`probe` to be None."""

    def __init__(self, n_sites: int = 2, *, rate_mbit: float | None = None, prefix: str = PREFIX):
        if n_sites < 2:
            raise ValueError(f"Sites needs at least 2 sites, got {n_sites}")
        self.run = f"{prefix}{os.getpid()}-{secrets.token_hex(3)}"
        self.prefix = prefix
        self.rate_mbit = rate_mbit
        self.sites = [Site(i, f"{self.run}-s{i}", f"{SUBNET}.{i + 1}") for i in range(n_sites)]
        self.bridge = f"{self.run}-br" if n_sites > 2 else None
        self._procs: list[subprocess.Popen] = []
        self._old_handler: Any = None  # SIGTERM's handler before (set while Sites handles it)
        self._handling = False

    def __enter__(self) -> Sites:
        reason = probe()
        if reason is not None:
            raise RuntimeError(reason)
        cleanup(self.prefix)
        _OPEN.add(self.run)
        if threading.current_thread() is threading.main_thread():
            self._old_handler = signal.signal(signal.SIGTERM, _on_sigterm)
            self._handling = True
        try:
            self._make()
            self.set_rate(self.rate_mbit)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _make(self) -> None:
        """Make the namespaces, the link between them and each site's address on it."""
        for ns in [s.netns for s in self.sites] + ([self.bridge] if self.bridge else []):
            _run(["ip", "netns", "add", ns])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        if self.bridge is None:
            a, b = self.sites
            _run(["ip", "-n", a.netns, "link", "add", "name", IFNAME, "type", "veth",
                  "peer", "name", IFNAME, "netns", b.netns])  # fmt: skip
        else:
            self._make_bridge()
        for s in self.sites:
            _run(["ip", "-n", s.netns, "addr", "add", f"{s.addr}/24", "dev", IFNAME])
            _run(["ip", "-n", s.netns, "link", "set", IFNAME, "up"])

    def _make_bridge(self) -> None:
        """Three sites or more: a bridge ``br0`` in a namespace of its own, one veth pair from
        each site's ``IFNAME`` to a port ``p<i>`` of it."""
        br = self.bridge
        _run(["ip", "-n", br, "link", "add", "name", "br0", "type", "bridge"])
        _run(["ip", "-n", br, "link", "set", "br0", "up"])
        for s in self.sites:
            port = f"p{s.index}"
            _run(["ip", "-n", br, "link", "add", "name", port, "type", "veth",
                  "peer", "name", IFNAME, "netns", s.netns])  # fmt: skip
            _run(["ip", "-n", br, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", br, "link", "set", port, "up"])

    def set_rate(self, rate_mbit: float | None) -> None:
        """Limit each site's egress on the link to ``rate_mbit`` Mbit/s (``tbf``), or lift the
        limit (None); ranks may be running (:func:`limit_egress` from inside a site)."""
        for s in self.sites:
            limit_egress(rate_mbit, netns=s.netns)
        self.rate_mbit = rate_mbit

    def counters(self, site: int, ifname: str = IFNAME) -> dict[str, int]:
        """Site ``site``'s interface counters (``ip -s link``): ``tx_bytes``, ``rx_bytes``,
        ``tx_packets``, ``rx_packets`` (Ethernet frames, headers included; ``lo``: loopback)."""
        ns = self.sites[site].netns
        out = _run(["ip", "-n", ns, "-j", "-s", "link", "show", "dev", ifname]).stdout
        stats = json.loads(out)[0]["stats64"]
        return {f"{way}_{what}": stats[way][what] for way in ("tx", "rx") for what in
                ("bytes", "packets")}  # fmt: skip

    def drops(self, site: int) -> int:
        """How many packets site ``site``'s ``tbf`` dropped (0 where no limit is set)."""
        ns = self.sites[site].netns
        out = _run(["tc", "-n", ns, "-j", "-s", "qdisc", "show", "dev", IFNAME]).stdout
        return sum(q.get("drops", 0) for q in json.loads(out) if q.get("kind") == "tbf")

    def env(self, rank: int, ranks_per_site: int) -> dict[str, str]:
        """What rank ``rank`` gets in its environment: torch's ``env://`` rendezvous on site 0's
        address, ``GLOO_SOCKET_IFNAME``, and ``SITE``/``LOCAL_RANK``/``SITES``."""
        return {
            "RANK": str(rank),
            "WORLD_SIZE": str(len(self.sites) * ranks_per_site),
            "LOCAL_RANK": str(rank % ranks_per_site),
            "LOCAL_WORLD_SIZE": str(ranks_per_site),
            "SITE": str(rank // ranks_per_site),
            "SITES": str(len(self.sites)),
            "MASTER_ADDR": self.sites[0].addr,
            "MASTER_PORT": str(PORT),
            "GLOO_SOCKET_IFNAME": IFNAME,
        }

    def spawn(
        self,
        argv: Sequence[str],
        *,
        ranks_per_site: int = 1,
        env: dict[str, str] | None = None,
        log_dir: str | None = None,
    ) -> list[subprocess.Popen]:
        """Start ``argv`` once per rank, rank ``r`` in site ``r // ranks_per_site``'s namespace,
        with :meth:`env` over ``env`` (default: this process's, ``PYTHONPATH`` its
        ``sys.path``). Their output goes to ``log_dir/rank<r>.log`` (default: inherited)."""
        base = dict(os.environ if env is None else env)
        if env is None:
            base["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        procs = []
        for rank in range(len(self.sites) * ranks_per_site):
            site = self.sites[rank // ranks_per_site]
            out = open(Path(log_dir) / f"rank{rank}.log", "wb") if log_dir else None  # noqa: SIM115
            try:
                procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", site.netns, *argv],
                    env={**base, **self.env(rank, ranks_per_site)},
                    stdout=out, stderr=subprocess.STDOUT if out else None,
                    preexec_fn=_die_with_parent,
                ))  # fmt: skip
            finally:
                if out is not None:
                    out.close()  # the rank has its own copy
        self._procs += procs
        return procs

    def call(
        self, fn: Callable[..., Any], *, ranks_per_site: int = 1, timeout: float = 120.0, **kwargs
    ) -> list[Any]:
        """Run ``fn(**kwargs)`` (a module-level function) in every rank, all in one gloo process
        group across the sites; return each rank's result, in rank order. Raises with the
        output of the ranks that failed, or of all of them after ``timeout`` seconds."""
        with tempfile.TemporaryDirectory(prefix="fhsites-") as tmp:
            task = Path(tmp) / "task.pkl"
            task.write_bytes(pickle.dumps((fn, kwargs)))
            argv = [sys.executable, "-m", __name__, "worker", str(task), tmp]
            procs = self.spawn(argv, ranks_per_site=ranks_per_site, log_dir=tmp)
            failed = _wait_all(procs, timeout)
            if failed:
                raise RuntimeError(_failure(fn, failed, tmp))
            return [pickle.loads(Path(tmp, f"rank{r}.pkl").read_bytes()) for r in range(len(procs))]

    def close(self) -> None:
        """Stop the ranks still running (SIGTERM, then SIGKILL after 3 s), remove every
        namespace of this run, and give SIGTERM its handler back (a SIGTERM that came
        meanwhile is delivered to it then)."""
        termed: list[int] = []
        if self._handling:
            signal.signal(signal.SIGTERM, lambda signum, frame: termed.append(signum))
        try:
            _stop(self._procs, grace=3.0)
            self._procs = []
            for ns in run_namespaces(self.run):
                _remove_namespace(ns)
            _OPEN.discard(self.run)
        finally:
            if self._handling:
                old = self._old_handler  # None: set outside Python, taken as the default
                signal.signal(signal.SIGTERM, signal.SIG_DFL if old is None else old)
                self._handling = False
                if termed:
                    os.kill(os.getpid(), signal.SIGTERM)


def _failure(fn: Callable[..., Any], failed: list[int], log_dir: str) -> str:
    """What :meth:`Sites.call` raises with: the function, the ranks that failed, their output."""
    logs = [f"--- rank {r}:\n{Path(log_dir, f'rank{r}.log').read_text()[-4000:]}" for r in failed]
    return f"{fn.__qualname__} failed in ranks {failed}:\n" + "\n".join(logs)


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Wait for ``procs`` until ``timeout`` seconds; return the indices of those that failed
    (all, killed, on a timeout)."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            _stop(procs, grace=0.0)
            return list(range(len(procs)))
        if any(p.poll() not in (None, 0) for p in procs):  # one failed: the rest would hang
            time.sleep(1.0)
            _stop(procs, grace=2.0)
            break
        time.sleep(0.01)
    return [i for i, p in enumerate(procs) if p.returncode != 0]


def _stop(procs: list[subprocess.Popen], *, grace: float) -> None:
    """SIGTERM the running ``procs``, wait up to ``grace`` seconds, then SIGKILL what is left."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _worker(task: str, out_dir: str) -> None:
    """A rank of :meth:`Sites.call`: join the gloo group from the environment, run the task,
    write its pickled result to ``out_dir/rank<r>.pkl``."""
    import torch.distributed as dist

    fn, kwargs = pickle.loads(Path(task).read_bytes())
    dist.init_process_group("gloo")
    try:
        result = fn(**kwargs)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{os.environ['RANK']}.pkl").write_bytes(pickle.dumps(result))


def _cli(argv: Sequence[str] | None = None) -> int:
    """``run``: start a command per rank across sites (prints the run's name first, then each
    site's link counters); ``cleanup``; ``probe``; ``worker`` (internal, :meth:`Sites.call`)."""
    parser = argparse.ArgumentParser(prog="python -m functional_hsdp.tools.testing.sites")
    sub = parser.add_subparsers(dest="what", required=True)
    run = sub.add_parser("run", help="run a command once per rank, across sites")
    run.add_argument("--sites", type=int, default=2)
    run.add_argument("--ranks-per-site", type=int, default=1)
    run.add_argument("--rate-mbit", type=float, default=None, help="per site's egress")
    run.add_argument("--timeout", type=float, default=24 * 3600.0, help="seconds, then killed")
    run.add_argument("command", nargs=argparse.REMAINDER, help="after --: the rank's command")
    sub.add_parser("cleanup", help="remove what killed runs left behind")
    sub.add_parser("probe", help="say whether this machine can make sites")
    worker = sub.add_parser("worker")
    worker.add_argument("task")
    worker.add_argument("out_dir")
    args = parser.parse_args(argv)
    if args.what == "worker":
        _worker(args.task, args.out_dir)
    elif args.what == "cleanup":
        print("\n".join(cleanup()) or "nothing to remove")
    elif args.what == "probe":
        print(probe() or "this machine can make sites")
        return 0 if probe() is None else 1
    else:
        return _cli_run(args)
    return 0


def _cli_run(args: argparse.Namespace) -> int:
    """``run``'s body: the sites, a command per rank, their exit status (the worst)."""
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise SystemExit("run: give the rank's command after --")
    with Sites(args.sites, rate_mbit=args.rate_mbit) as sites:
        print(json.dumps({"run": sites.run, "sites": [s.__dict__ for s in sites.sites]}),
              flush=True)  # fmt: skip
        procs = sites.spawn(command, ranks_per_site=args.ranks_per_site)
        failed = _wait_all(procs, args.timeout)
        for s in sites.sites:
            print(json.dumps({"site": s.index, IFNAME: sites.counters(s.index)}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(_cli())
    except Exception:
        traceback.print_exc()
        sys.exit(1)

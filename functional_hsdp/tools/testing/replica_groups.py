"""Replica groups on one machine: a torchft lighthouse and one job per group, killed by pid.

A group is its ranks started directly with torchrun's environment (fast: what the failure
tests use) or one real ``torchrun`` job (``Group(..., torchrun=True)``, as users start it).

What the fault-tolerance tests and ``python -m bench faults`` run on. :class:`Lighthouse` starts
``torchft_lighthouse`` (shipped in the torchft wheel) on a free port; :class:`Group` starts one
replica group's ranks as separate processes with the environment ``torchrun`` gives them
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) plus what torchft
reads (``TORCHFT_LIGHTHOUSE``, ``REPLICA_GROUP_ID``): the same program runs under ``torchrun``
unchanged (:func:`manager_from_env` makes its ``Manager``). :meth:`Group.kill` sends SIGKILL to
every rank of the group by pid; everything started is stopped on exit.

Groups in separate network namespaces (``functional_hsdp.tools.testing.sites``, as ``python -m
bench faults`` runs them where the machine can make sites): the lighthouse runs in one of them
(``Lighthouse(netns=..., host=...)``), reached by every group at that site's address; each
group's rank 0 advertises its own site's address (:data:`HOSTNAME_ENV`, or
``manager_from_env(hostname=...)``) instead of the machine's name, which every namespace
resolves to its own loopback.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = [
    "HOSTNAME_ENV", "Group", "Lighthouse", "checkpoint_transport", "free_port",
    "lighthouse_command", "manager_from_env",
]  # fmt: skip

HOSTNAME_ENV = "FH_FT_HOSTNAME"  # what a group's rank 0 advertises (manager_from_env's default)


def free_port() -> int:
    """A TCP port free on localhost now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lighthouse_command(
    port: int,
    *,
    min_replicas: int = 1,
    join_timeout_ms: int = 1000,
    heartbeat_timeout_ms: int = 2000,
) -> list[str]:
    """The lighthouse's command line (``torchft_lighthouse``, from the torchft wheel)."""
    beside = Path(sys.executable).parent / "torchft_lighthouse"  # this interpreter's scripts
    exe = str(beside) if beside.exists() else shutil.which("torchft_lighthouse")
    if exe is None:
        raise RuntimeError("torchft_lighthouse is not on PATH: pip install -e '.[ft]'")
    return [
        exe,
        "--min_replicas", str(min_replicas),
        "--bind", f"[::]:{port}",
        "--join_timeout_ms", str(join_timeout_ms),
        "--quorum_tick_ms", "100",
        "--heartbeat_timeout_ms", str(heartbeat_timeout_ms),
    ]  # fmt: skip


class Lighthouse:
    """``torchft_lighthouse`` for the ``with`` block; ``.addr`` is what ``TORCHFT_LIGHTHOUSE``
    holds. By default on a free port of this machine, reached at ``localhost``. With ``netns``
    (a network namespace's name, as ``ip netns`` knows it) it runs inside that namespace
    (``ip netns exec``), on ``port`` (default 29510; every port of a fresh namespace is free),
    reached at ``host`` (an address of that namespace, which the other namespaces route to)."""

    def __init__(
        self,
        *,
        min_replicas: int = 1,
        join_timeout_ms: int = 1000,
        heartbeat_timeout_ms: int = 2000,
        log: Any = None,
        netns: str | None = None,
        host: str | None = None,
        port: int | None = None,
    ):
        if netns is not None and host is None:
            raise ValueError("Lighthouse(netns=...) needs host=, an address of that namespace")
        self.netns = netns
        self.host = host or "localhost"
        self.port = port or (29510 if netns else free_port())
        self.addr = f"http://{self.host}:{self.port}"
        self.heartbeat_timeout_ms = heartbeat_timeout_ms
        argv = lighthouse_command(
            self.port,
            min_replicas=min_replicas,
            join_timeout_ms=join_timeout_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        )
        if netns is not None:
            argv = ["ip", "netns", "exec", netns, *argv]
        out = open(log, "wb") if log else subprocess.DEVNULL
        self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        try:
            while not _connectable("127.0.0.1" if netns is None else self.host, self.port, netns):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    code = self.proc.poll()
                    raise RuntimeError(f"torchft_lighthouse did not start (exit {code})")
                time.sleep(0.05)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Lighthouse:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _connectable(host: str, port: int, netns: str | None) -> bool:
    """Whether ``host:port`` accepts a TCP connection: from this namespace, or (``netns``) from
    a thread that entered that one (``sites.enter``: the thread's alone, which ends with it)."""

    out: list[bool] = []

    def attempt() -> None:
        if netns is not None:
            from .sites import enter

            enter(netns)
        with socket.socket() as s:
            s.settimeout(1.0)
            out.append(s.connect_ex((host, port)) == 0)

    if netns is None:
        attempt()
    else:
        t = threading.Thread(target=attempt, daemon=True)
        t.start()
        t.join()
        if not out:  # the thread failed (its traceback is on stderr)
            raise RuntimeError(f"cannot try {host}:{port} from network namespace {netns}")
    return out[0]


class Group:
    """One replica group's ranks: ``argv`` run ``n`` times with torchrun's environment and
    torchft's (``lighthouse``'s address, ``REPLICA_GROUP_ID`` = ``gid``). Output of rank r goes
    to ``log_dir/g{gid}r{r}.log`` (a restarted group appends)."""

    def __init__(
        self,
        gid: int,
        n: int,
        argv: Sequence[str],
        *,
        lighthouse: str,
        log_dir: str | Path,
        env: dict[str, str] | None = None,
        torchrun: bool = False,
    ):
        self.gid, self.n = gid, n
        port = free_port()
        if torchrun:  # one torchrun job for the group, as users start it
            self._torchrun(argv, port=port, lighthouse=lighthouse, log_dir=log_dir, env=env)
            return
        base = {
            **os.environ,
            **(env or {}),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(n),
            "LOCAL_WORLD_SIZE": str(n),
            "TORCHFT_LIGHTHOUSE": lighthouse,
            "REPLICA_GROUP_ID": str(gid),
            "PYTHONUNBUFFERED": "1",
        }
        self.procs: list[subprocess.Popen] = []
        for r in range(n):
            log = open(Path(log_dir) / f"g{gid}r{r}.log", "ab")
            env_r = {**base, "RANK": str(r), "LOCAL_RANK": str(r)}
            self.procs.append(
                subprocess.Popen(list(argv), env=env_r, stdout=log, stderr=subprocess.STDOUT)
            )
            log.close()

    def _torchrun(self, argv, *, port: int, lighthouse: str, log_dir, env) -> None:
        """``argv`` (``python -m module ...``) under ``torchrun``: its agent starts the ranks
        (in a process group of their own, so that :meth:`kill` reaches them all)."""
        if list(argv[1:2]) != ["-m"]:
            raise ValueError(f"Group(torchrun=True) runs 'python -m module ...'; got {argv!r}")
        run = [
            argv[0], "-m", "torch.distributed.run", "--nnodes", "1",
            "--nproc_per_node", str(self.n), "--master_addr", "127.0.0.1",
            "--master_port", str(port), "-m", *argv[2:],
        ]  # fmt: skip
        extra = {"TORCHFT_LIGHTHOUSE": lighthouse, "REPLICA_GROUP_ID": str(self.gid)}
        full = {**os.environ, **(env or {}), **extra, "PYTHONUNBUFFERED": "1"}
        log = open(Path(log_dir) / f"g{self.gid}.torchrun.log", "ab")
        proc = subprocess.Popen(
            run, env=full, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        self.procs = [proc]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def kill(self) -> None:
        """SIGKILL every rank of the group (by pid; under torchrun its whole process group),
        and reap them."""
        for p in self.procs:
            if p.poll() is None:
                if len(self.procs) == 1 and self.n > 1:  # a torchrun agent and its ranks
                    os.killpg(p.pid, signal.SIGKILL)
                else:
                    os.kill(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def wait(self, timeout: float) -> list[int | None]:
        """Each rank's exit code, waiting up to ``timeout`` seconds in all (None: still running)."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                pass
        return [p.poll() for p in self.procs]


def checkpoint_transport(hostname: str, timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport (what the ``Manager`` makes by default: a healing
    peer fetches this rank's state from it) with its address at ``hostname``: torchft's own
    advertises ``socket.gethostname()``, whatever the ``Manager``'s ``hostname=``."""
    from torchft.checkpointing import HTTPTransport

    class _HTTPTransportAt(HTTPTransport):
        def address(self) -> str:
            url = urllib.parse.urlsplit(super().address())
            host = f"[{hostname}]" if ":" in hostname else hostname
            return urllib.parse.urlunsplit(url._replace(netloc=f"{host}:{url.port}"))

    return _HTTPTransportAt(timeout=timeout, num_chunks=0)


def manager_from_env(
    *,
    timeout: float = 10.0,
    quorum_timeout: float = 60.0,
    connect_timeout: float = 10.0,
    min_replica_size: int = 1,
    hostname: str | None = None,
) -> Any:
    """A ``torchft.Manager`` for fh, from the environment a replica group's ``torchrun`` (and
    torchft) gives: ``REPLICA_GROUP_ID`` names the group, ``TORCHFT_LIGHTHOUSE`` the
    lighthouse, ``MASTER_ADDR``/``MASTER_PORT`` the group's store (the default process group's:
    call ``init_process_group`` first), ``RANK``/``WORLD_SIZE`` the rank in the group. A gloo
    process group for the replica axis, a synchronous quorum, no initial sync, no state-dict
    callbacks (``fh.fault_tolerant`` registers its own).

    ``hostname``: the address the group's rank 0 advertises, to the lighthouse for its manager
    server and to a healing peer for its checkpoint transport (:func:`checkpoint_transport`);
    default: the environment's ``FH_FT_HOSTNAME`` (:data:`HOSTNAME_ENV`), else torchft's own
    (the machine's name, ``socket.gethostname()``, which torchft reads no variable to change).
    Set it where that name does not reach this group from the others: a network namespace (a
    site of ``sites.Sites``: its address), a host whose name resolves to a loopback or to an
    interface the other groups cannot reach."""
    from torchft import Manager, ProcessGroupGloo

    hostname = hostname or os.environ.get(HOSTNAME_ENV) or None
    where: dict[str, Any] = {}
    if hostname:
        where = dict(
            hostname=hostname,
            checkpoint_transport=checkpoint_transport(hostname, timedelta(seconds=timeout)),
        )
    return Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=timeout)),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=min_replica_size,
        use_async_quorum=False,
        init_sync=False,
        replica_id=f"group_{os.environ['REPLICA_GROUP_ID']}",
        timeout=timedelta(seconds=timeout),
        quorum_timeout=timedelta(seconds=quorum_timeout),
        connect_timeout=timedelta(seconds=connect_timeout),
        **where,
    )


if __name__ == "__main__":  # pragma: no cover - python -m ... lighthouse PORT
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 29510
    os.execv(lighthouse_command(port)[0], lighthouse_command(port))

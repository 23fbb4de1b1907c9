"""Why DistMesh all-gathers on gloo through c10d: a reproduction (not a registered benchmark).

Several functional all-gathers (``funcol.all_gather_single``) in flight at once on gloo
(torch 2.13, CPU) corrupt the heap now and then: a rank dies with SIGSEGV or glibc's
"malloc(): unaligned tcache chunk detected", or the others time out waiting for it
(2026-12-04, this script's defaults: funcol 3 of 3 runs failed, c10d 0 of 3). The same
rounds through c10d ``all_gather_into_tensor(async_op=True)`` (what ``DistMesh.all_gather``
issues on gloo in eager mode) have not crashed. Each round issues ``--inflight``
all-gathers of a few hundred elements over all ranks and waits for them after the round::

    python -m bench.mesh.gloo_allgather --impl funcol --runs 4   # crashes in some runs
    python -m bench.mesh.gloo_allgather --impl c10d --runs 4     # clean

Each run starts 4 fresh gloo ranks; a run ends "ok" or with the error of the rank that died.
"""

from __future__ import annotations

import argparse
import time

import torch

from functional_hsdp.mesh import launch


def _rounds(impl: str, rounds: int, inflight: int) -> int:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from functional_hsdp.base.torch_releases import c10d_all_gather_single, funcol_all_gather_single

    group, world = dist.group.WORLD, dist.get_world_size()
    for r in range(rounds):
        pending = []
        for k in range(inflight):
            x = torch.full((256 + 32 * k,), float(r + dist.get_rank()))
            if impl == "funcol":
                pending.append(funcol_all_gather_single(x, 0, group))
            else:
                out = x.new_empty(world * x.numel())
                work = c10d_all_gather_single(out, x, group=group, async_op=True)
                pending.append((out, work, x))
        for p in pending:
            if impl == "funcol":
                funcol.wait_tensor(p)
            else:
                p[1].wait()
    return rounds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", choices=["funcol", "c10d"], required=True)
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3000)
    parser.add_argument("--inflight", type=int, default=6)
    args = parser.parse_args(argv)
    # the task by its module's name (run as ``-m``, this module is ``__main__``, which the
    # ranks do not have)
    from bench.mesh.gloo_allgather import _rounds

    crashed = 0
    for run in range(args.runs):
        t0 = time.perf_counter()
        try:
            launch.run(_rounds, args.impl, args.rounds, args.inflight)
            outcome = "ok"
        except launch.WorkerError as exc:
            crashed += 1
            outcome = "CRASHED: " + str(exc).splitlines()[0]
        print(
            f"run {run + 1}/{args.runs} ({args.impl}): {outcome} [{time.perf_counter() - t0:.0f} s]"
        )
    print(f"{args.impl}: {crashed} of {args.runs} runs crashed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

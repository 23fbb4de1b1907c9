"""(B10, scaling) The per-call cost of the agreement on n gloo ranks, of one library checkout.

The ranks' task for ``bench/runtime/agreement.py``'s scaling part. It runs on the library that its
process imports, which may be an older checkout than the benchmarks' (the baseline), so it
imports nothing of the ``bench`` package, whose ``__init__`` imports every benchmark, some
of them needing the newest library: ``bench/runtime/agreement.py`` links this file into an empty
directory as the top-level module ``fh_agreement_scaling``, beside a link to the checkout's
``functional_hsdp``, and runs :func:`main` there. ``bench/common.py`` (which imports only
``functional_hsdp.mesh.launch`` of the library) is loaded from its file.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from functools import partial

import torch

from functional_hsdp.mesh import launch

#: the tree: small, so that the call is mostly the agreement and its collectives
TREE = {"leaves": 4, "numel": 256}


def _load_common():
    bench = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # bench/runtime/..
    path = os.path.join(bench, "common.py")
    spec = importlib.util.spec_from_file_location("fh_bench_common", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


C = _load_common()


def validation_off(fn):
    """``fn()`` with the agreement off."""
    import functional_hsdp as fh

    with fh.validation("off"):
        return fn()


def agreement_room():
    """The module that holds ``agreement`` in the imported library: ``runtime.agreement``, or
    in a checkout before that room, ``runtime.validate``."""
    try:
        from functional_hsdp.runtime import agreement
    except ImportError:  # an older checkout: the agreement lived in validate
        from functional_hsdp.runtime import validate as agreement
    return agreement


def agreement_alone(room, spec, plan, paths) -> None:
    """One call's agreement alone, as ``reduce_grads(last=True)`` makes it (its fingerprint
    cached after the first), waited at once (``room.agreement`` of every version: ``room`` is
    the module holding it, :func:`agreement_room`)."""
    with room.agreement(spec, "reduce_grads") as agreed:
        agreed.check(plan, paths, last=True, options=("check_finite=False", "at=input"))


def task(cfg: dict) -> dict:
    """On each of n ranks (mesh 2 x n/2, hsdp): a small ``reduce_grads(last=True)`` with the
    agreement on and off, and the agreement alone."""
    import torch.distributed as dist

    import functional_hsdp as fh
    from functional_hsdp.base.tree import flatten
    from functional_hsdp.plan.lookup import grads_plan

    n = dist.get_world_size()
    spec = fh.hsdp(fh.DistMesh(C.device_mesh((2, n // 2))), *C.AXES)
    torch.manual_seed(0)
    tree = {f"p{i}": torch.randn(TREE["numel"]) for i in range(TREE["leaves"])}
    call = partial(fh.reduce_grads, tree, spec, last=True)
    leaves, treedef, paths = flatten(tree, "grads")
    plan = grads_plan(leaves, treedef, paths, spec=spec, name="grads")
    ops = {
        "on": call,
        "off": partial(validation_off, call),
        "agreement": partial(agreement_alone, agreement_room(), spec, plan, paths),
    }
    return C.interleaved(ops, cfg["scaling_warmup"], cfg["scaling_reps"])


def main(argv: list[str] | None = None) -> int:
    """``--cfg JSON --out FILE``: per world size of ``cfg["worlds"]``, fresh ranks of this
    process (whose ``functional_hsdp`` they import) run :func:`task`; the slowest rank's
    median per op goes to ``FILE``."""
    ap = argparse.ArgumentParser(prog="fh_agreement_scaling")
    ap.add_argument("--cfg", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    cfg, out = json.loads(a.cfg), {}
    for n in cfg["worlds"]:
        per_rank = launch.run(task, cfg, world_size=n, timeout=900.0, preload=C.PRELOAD)
        out[n] = C.slowest_rank_medians(per_rank)[1]
    with open(a.out, "w") as f:
        json.dump(out, f)
    return 0

"""Every Python block of README.md and of the documentation's pages (``docs/**/*.md``, the
guides) runs, and what it computes is checked, so neither can drift from the library.

Blocks that build a ``DistMesh`` run as ``torchrun --nproc-per-node 4 train.py`` runs them: 4
fresh gloo workers with no process group (``launch.run(..., join=False)``), so the block's own
``init_device_mesh`` makes the group, exactly as written. A block that starts with
``# continuing the quickstart`` (or ``the layer-wise example``) runs after that example's block
(less its closing ``dist.destroy_process_group()``), in one namespace: the quickstart guide's
(``docs/guides/quickstart.md``) and the layer-wise guide's. After a distributed block, a check
from :data:`CHECKS` compares what it computed with a dense single-process reference (every
rank's data, mean over ranks of the sum over microbatches), on every rank, and the run reports
how each collective was carried (``comm_log``'s ``impl``), what each rank printed and every
warning raised. A block whose last lines are ``print(...)`` followed by a ``# <output>``
comment must print that output. A block found twice (the README's quickstart is the guide's)
runs once.
"""

from __future__ import annotations

import contextlib
import io
import re
import warnings
from pathlib import Path

import optree
import pytest
import torch
import torch.nn.functional as F
from torch.func import grad

import functional_hsdp as fh
from functional_hsdp.mesh import launch

ROOT = Path(__file__).resolve().parents[2]  # tests/project/ -> the repository root
README = ROOT / "README.md"
DOCS = ROOT / "docs"
GENERATED = ("_build", "api", "notebooks")  # docs/conf.py writes these at build time
DESTROY = "dist.destroy_process_group()"
WORLD = 4


def _sources() -> list[Path]:
    pages = [
        p for p in sorted(DOCS.rglob("*.md"))
        if not set(p.relative_to(DOCS).parts[:-1]) & set(GENERATED)
    ]  # fmt: skip
    return [*pages, README]


def _blocks() -> tuple[list[str], dict[str, Path]]:
    """Every distinct Python block, the docs' first, and the file each is in (a block the
    README shares with a guide counts as the guide's)."""
    blocks, where = [], {}
    for path in _sources():
        for block in re.findall(r"^```python\n(.*?)^```", path.read_text(), re.S | re.M):
            if block not in where:
                blocks.append(block)
                where[block] = path
    return blocks, where


BLOCKS, WHERE = _blocks()
GUIDES = DOCS / "guides"


def _first(page: str, needle: str) -> str:
    return next(b for b in BLOCKS if WHERE[b] == GUIDES / page and needle in b)


QUICKSTART = _first("quickstart.md", "init_device_mesh")
LAYERWISE = _first("layerwise.md", "into=mg)")
BASES = {
    "# continuing the quickstart": QUICKSTART,
    "# continuing the layer-wise example": LAYERWISE,
}


def _without_destroy(code: str) -> str:
    lines = code.rstrip().splitlines()
    return "\n".join(lines[:-1] if lines and lines[-1].strip() == DESTROY else lines) + "\n"


def _program(block: str) -> str:
    """The block as it runs: after its base example, if it continues one, less the closing
    ``destroy_process_group`` (the harness destroys the group after its check)."""
    for marker, base in BASES.items():
        if block.startswith(marker):
            return _without_destroy(base) + "\n" + _without_destroy(block)
    return _without_destroy(block)


def _distributed(block: str) -> bool:
    return "DistMesh(" in _program(block)


def _name(block: str) -> str:
    """The block's section (its first word): in the README the ``##`` heading above it, in a
    guide the page's title; with "pure" for the layer-wise continuation."""
    text = WHERE[block].read_text()
    if WHERE[block] == README:
        heading = re.findall(r"^## (\S+)", text[: text.index(block)], re.M)[-1]
    else:
        heading = re.search(r"^# (\S+)", text, re.M).group(1)
    heading = heading.rstrip(":,").lower()
    return heading + (", pure" if block.startswith("# continuing the layer-wise") else "")


def _run(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<readme block>", "exec"), {"__name__": "__readme__"})
    return out.getvalue()


def _expected_output(block: str) -> str | None:
    lines = block.rstrip().splitlines()
    if len(lines) >= 2 and lines[-2].startswith("print(") and lines[-1].startswith("# "):
        return lines[-1][2:]
    return None


# -- dense references of the README's examples (every rank's data, one process) ----------------


def _quickstart_data(rank: int) -> list:
    data = torch.Generator().manual_seed(rank)  # as the quickstart makes each rank's loader
    return [[(x, x[:, :4].sum(1, keepdim=True) / 2) for x in torch.randn(3, 8, 16, generator=data)]
            for _ in range(5)]  # fmt: skip


def _quickstart_reference(ns: dict) -> tuple[dict, list[float]]:
    """The quickstart's SGD on the mean over ranks of the mean over microbatches; also rank
    0's loss per step (what it prints)."""
    p = {k: v.detach().clone() for k, v in ns["model"].named_parameters()}
    loaders = [_quickstart_data(r) for r in range(WORLD)]
    losses = []
    for step in range(5):
        total = optree.tree_map(torch.zeros_like, p)
        for r in range(WORLD):
            for x, y in loaders[r][step]:
                total = optree.tree_map(torch.add, total, grad(ns["loss_fn"])(p, x, y))
        losses.append(sum(ns["loss_fn"](p, x, y).item() for x, y in loaders[0][step]) / 3)
        p = optree.tree_map(lambda w, g: w - 0.1 * g / (3 * WORLD), p, total)
    return p, losses


def _layerwise_reference(ns: dict, steps: int) -> tuple[dict, list[float]]:
    """The layer-wise example's model on full weights, trained as the example trains it."""
    V, M, lr, block_fn = ns["V"], ns["M"], ns["lr"], ns["block_fn"]

    def loss(p, ids):
        h = p["embed"]["tok"][ids[:, :-1]]
        for b in p["blocks"]:
            h = block_fn(b, h)
        logits = h @ p["embed"]["tok"].T
        return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()) / M

    p = optree.tree_map(torch.clone, ns["full"])
    gens = [torch.Generator().manual_seed(r) for r in range(WORLD)]
    losses = []
    for _ in range(steps):
        batches = [[torch.randint(V, (8, 33), generator=g) for _ in range(M)] for g in gens]
        total = optree.tree_map(torch.zeros_like, p)
        for r in range(WORLD):
            for ids in batches[r]:
                total = optree.tree_map(torch.add, total, grad(loss)(p, ids))
        losses.append(sum(loss(p, ids).item() for ids in batches[0]))
        p = optree.tree_map(lambda w, g: w - lr * g / WORLD, p, total)
    return p, losses


def _error(got, want) -> float:
    """The largest relative error over the leaves of two trees of full tensors."""
    errors = [
        ((a - b).norm() / b.norm().clamp_min(1e-12)).item()
        for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want), strict=True)
    ]
    return max(errors)


def _printed_losses(printed: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step \d+: loss ([-\d.]+)", printed, re.M)]


def _check_quickstart(ns: dict, printed: str) -> dict:
    want, losses = _quickstart_reference(ns)
    return {"params": _error(fh.gather(ns["params"], ns["spec"]), want), "losses": losses}


def _check_layerwise(ns: dict, printed: str) -> dict:
    want, losses = _layerwise_reference(ns, 3)
    return {"params": _error(fh.gather(ns["params"], ns["tree_spec"]), want), "losses": losses}


def _check_pure(ns: dict, printed: str) -> dict:
    want, losses = _layerwise_reference(ns, 4)  # one more step, in the pure form
    return {"params": _error(fh.gather(ns["params"], ns["tree_spec"]), want), "losses": losses[:3]}


def _check_maingrad(ns: dict, printed: str) -> dict:
    want, losses = _quickstart_reference(ns)  # the same 5 steps again, from the same weights
    return {"params": _error(fh.gather(ns["params"], ns["spec"]), want), "losses": losses}


def _check_optimizer(ns: dict, printed: str) -> dict:
    """One step of torch.optim.AdamW on the clipped mean gradient of every rank's first
    microbatch, from the quickstart's trained weights."""
    start, losses = _quickstart_reference(ns)
    total = optree.tree_map(torch.zeros_like, start)
    for r in range(WORLD):
        x, y = _quickstart_data(r)[0][0]
        total = optree.tree_map(torch.add, total, grad(ns["loss_fn"])(start, x, y))
    g = optree.tree_map(lambda t: t / WORLD, total)
    norm = torch.linalg.vector_norm(torch.stack([t.norm() for t in g.values()]))
    weights = {k: v.clone().requires_grad_() for k, v in start.items()}
    opt = torch.optim.AdamW(weights.values(), lr=1e-3, weight_decay=0.01)
    for k, w in weights.items():
        w.grad = g[k] * min(1.0, 1.0 / (norm.item() + 1e-6))
    opt.step()
    want = {k: w.detach() for k, w in weights.items()}
    return {
        "params": _error(fh.gather(ns["params"], ns["spec"]), want),
        "norm": abs(ns["norm"].item() - norm.item()) / norm.item(),
        "losses": losses,
    }


def _check_checkpoint(ns: dict, printed: str) -> dict:
    """What the 1x4 mesh loaded is what the 2x2 mesh saved: the trained weights, fresh moments."""
    want, losses = _quickstart_reference(ns)
    moments = [t for t in optree.tree_leaves(ns["opt_state"]) if isinstance(t, torch.Tensor)]
    return {
        "params": _error(fh.gather(ns["params"], ns["spec_1x4"]), want),
        "moments": max((t.abs().max().item() for t in moments if t.numel()), default=0.0),
        "losses": losses,
    }


def _check_compile(ns: dict, printed: str) -> dict:
    """The block makes ``step`` with torch.compile. (Calling it here would compile in 4 fresh
    processes, 15-25 s measured on 2 cores; tests/sync/test_compile.py checks such a compiled
    reduce_grads on gloo, inductor included, against eager bit for bit.)"""
    _, losses = _quickstart_reference(ns)
    compiled = getattr(ns["step"], "_torchdynamo_orig_callable", None) is not None
    return {"compiled": compiled, "losses": losses}


def _check_existing_model(ns: dict, printed: str) -> dict:
    """The Hugging Face example trained by FSDP2 (``fully_shard`` per decoder layer and on
    the root, the same policy, SGD) on the same weights and data."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    M, config = ns["M"], ns["model"].config
    torch.manual_seed(0)
    model = type(ns["model"])(config)
    for layer in model.model.layers:
        fully_shard(layer, mesh=ns["dm"], mp_policy=ns["mp"])
    fully_shard(model, mesh=ns["dm"], mp_policy=ns["mp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(3):
        batches, loss = torch.randint(256, (M, 4, 32), generator=data), 0.0
        for k, ids in enumerate(batches):
            model.set_requires_all_reduce(k == M - 1)
            value = model(ids, labels=ids).loss / M
            value.backward()
            loss += value.item()
        opt.step()
        opt.zero_grad()
        losses.append(loss)
    want = {n: p.full_tensor() for n, p in model.named_parameters()}
    full = fh.gather(ns["shards"], ns["tree_spec"])
    got = {(n if u == "" else f"{u}.{n}"): t for u, sub in full.items() for n, t in sub.items()}
    return {"params": _error([got[n] for n in want], list(want.values())), "losses": losses}


CHECKS = {
    "quickstart": _check_quickstart,
    "layer-wise": _check_layerwise,
    "layer-wise, pure": _check_pure,
    "maingrad": _check_maingrad,
    "optimizers": _check_optimizer,
    "checkpoints": _check_checkpoint,
    "torch.compile": _check_compile,
    "your": _check_existing_model,
}
# README examples whose loss must fall over their steps (the others train on random tokens)
LEARNABLE = ("quickstart", "maingrad", "optimizers", "checkpoints", "torch.compile")


def _check_for(block: str):
    name = _name(block)
    if name not in CHECKS:
        raise KeyError(f"no check for the README block in {name!r}: add one to CHECKS")
    return CHECKS[name]


def _torchrun_task(code: str, check, carriage: str | None = None) -> dict:
    """One rank of the block run as under torchrun: the block makes the process group.
    ``carriage="nccl"``: gloo carries the library's collectives as NCCL's groups do (the
    functional collectives), so that path runs here too."""
    import torch.distributed as dist

    from functional_hsdp.mesh import dist as dist_module

    out = io.StringIO()
    ns = {"__name__": "__readme__"}
    if carriage is not None:
        dist_module.BACKENDS["gloo"] = dist_module.BACKENDS[carriage]
    with warnings.catch_warnings(record=True) as caught, fh.comm_log() as log:
        warnings.simplefilter("always")
        with contextlib.redirect_stdout(out):
            exec(compile(code, "<readme block>", "exec"), ns)
        result = check(ns, out.getvalue())
    impls = sorted({(e.op, e.impl) for e in log.events})
    dist.destroy_process_group()
    return {
        "printed": out.getvalue(),
        "impls": impls,
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
        **result,
    }


# -- the tests --------------------------------------------------------------------------------


def test_the_readme_has_python_blocks_of_both_kinds():
    assert len(BLOCKS) >= 6
    assert any(map(_distributed, BLOCKS)) and not all(map(_distributed, BLOCKS))
    for base in BASES.values():  # the examples end cleanly, as a user's train.py should
        assert base.rstrip().endswith(DESTROY)
    for block in BLOCKS:  # a continuation runs before its base's destroy: it has none itself
        if any(block.startswith(m) for m in BASES):
            assert DESTROY not in block


@pytest.mark.parametrize("block", [b for b in BLOCKS if not _distributed(b)], ids=_name)
def test_block_runs_in_one_process(block):
    printed = _run(_program(block))
    expected = _expected_output(block)
    assert expected is not None, "a one-process block prints what it shows"
    assert printed.strip() == expected


@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", [b for b in BLOCKS if _distributed(b)], ids=_name)
def test_block_as_torchrun_runs_it_on_four_gloo_ranks(block):
    results = launch.run(_torchrun_task, _program(block), _check_for(block), join=False)
    for rank, res in enumerate(results):
        # gloo recognized in a group init_device_mesh made: reductions in place, all-gathers
        # c10d, AVG native (never the SUM-then-divide emulation)
        assert res["impls"], "the block ran no collective"
        assert all(impl.startswith("c10d ") for _, impl in res["impls"]), res["impls"]
        assert res["warnings"] == [], res["warnings"]
        if "params" in res:
            assert res["params"] <= 2e-4, (rank, res["params"])  # fp32, other summation orders
    for key in ("norm", "moments"):
        if key in results[0]:
            assert results[0][key] <= 1e-5, (key, results[0][key])
    assert all(r.get("compiled", True) for r in results), "step is not a torch.compile function"
    # rank 0 prints one loss per step of its base example, the others nothing
    printed = _printed_losses(results[0]["printed"])
    assert printed == pytest.approx(results[0]["losses"], abs=1e-4), results[0]["printed"]
    if _name(block) in LEARNABLE:
        assert printed[-1] < printed[0], printed
    assert [r["printed"] for r in results[1:]] == [""] * (WORLD - 1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", [QUICKSTART, LAYERWISE], ids=["quickstart", "layer-wise"])
def test_block_on_the_functional_collectives_nccl_takes(block):
    """The examples as NCCL runs them: every collective a functional one (the names that
    differ between torch releases), checked against the dense reference as above."""
    results = launch.run(_torchrun_task, _program(block), _check_for(block), "nccl", join=False)
    for rank, res in enumerate(results):
        assert res["impls"], "the block ran no collective"
        assert all(impl == "native" for _, impl in res["impls"]), res["impls"]
        assert res["warnings"] == [], res["warnings"]
        assert res["params"] <= 2e-4, (rank, res["params"])
    assert _printed_losses(results[0]["printed"]) == pytest.approx(results[0]["losses"], abs=1e-4)

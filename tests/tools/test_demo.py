"""``python -m functional_hsdp demo``: every strategy and mode on a SimMesh, two gloo runs.

The sim runs are in-process (about a second each). The gloo runs are subprocesses of the real
command: the default flags (hsdp, whole tree, 2x2, 3 microbatches) and one layer-wise hfsdp
run; each is checked for its verdict, its exit code and its communication table, which must
equal the sim run's: both meshes log the same collectives for the same calls.
"""

from __future__ import annotations

import io
import math
import os
import re
import subprocess
import sys

import pytest
import torch

import functional_hsdp as fh
from functional_hsdp.__main__ import build_parser, main
from functional_hsdp.tools import demo

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROW = re.compile(r"^\s+(\w+)\s+(dp_\w+)\s+(\w+)\s+(\d+)\s+(\d+)\s+\w", re.M)
SHARDED = {"ddp": (), "fsdp": demo.AXES, "hsdp": ("dp_inner",), "hfsdp": ("dp_inner",)}
DEFERRED = {"ddp": demo.AXES, "fsdp": (), "hsdp": ("dp_outer",), "hfsdp": ("dp_outer",)}


def buckets(cfg: demo.Config) -> int:
    """B: buckets of the model's parameters (whole: one tree; layerwise: summed over units),
    counted by the library's own psum on a 2-rank axis (bucketing does not depend on sizes)."""
    mesh = fh.SimMesh({"dp": 2})
    full = demo.init_params(cfg)
    trees = demo.to_units(full) if cfg.mode == "layerwise" else [full]
    with fh.comm_log() as log:
        for tree in trees:
            fh.psum({k: v.expand(2, *v.shape) for k, v in tree.items()}, "dp", mesh)
    return log.count("all_reduce")


def expected_per_step(cfg: demo.Config) -> dict[tuple[str, str, str], int]:
    """Collectives per step by (phase, axis, op): none on a size-1 axis."""
    s, M, B = cfg.strategy, cfg.microbatches, buckets(cfg)
    deferred_op = "reduce_scatter" if s == "hfsdp" else "all_reduce"  # hfsdp shards main weights
    want = {("sync", "dp_outer", "all_gather"): B} if s == "hfsdp" else {}
    if cfg.mode == "whole":  # gather the tree once; every microbatch reduce-scatters
        for a in SHARDED[s]:
            want |= {("gather", a, "all_gather"): B, ("reduce", a, "reduce_scatter"): M * B}
        want |= {("reduce", a, deferred_op): B for a in DEFERRED[s]}
    else:  # every unit: gathered in forward, re-gathered (but the last one: its weights are
        # still gathered when its backward comes) and reduce-scattered in backward
        for a in SHARDED[s]:
            want[("forward", a, "all_gather")] = M * B
            want[("backward", a, "all_gather")] = M * (B - 1)
            want[("backward", a, "reduce_scatter")] = M * B
        want |= {("finish", a, deferred_op): B for a in DEFERRED[s]}
    size = {"dp_outer": cfg.outer, "dp_inner": cfg.inner}
    return {k: n for k, n in want.items() if size[k[1]] > 1 and n}


def comm_table(text: str) -> dict[tuple[str, str, str], tuple[int, int]]:
    """The printed per-step communication table: {(phase, axis, op): (count, bytes)}."""
    return {(m[1], m[2], m[3]): (int(m[4]), int(m[5])) for m in ROW.finditer(text)}


def run_sim(**kw) -> tuple[demo.Report, str]:
    out = io.StringIO()
    report = demo.run(demo.Config(backend="sim", **kw), out=out)
    return report, out.getvalue()


def run_cli(*flags: str) -> subprocess.CompletedProcess:
    """The real command, stderr (the progress bar) merged into stdout in write order."""
    return subprocess.run(
        [sys.executable, "-m", "functional_hsdp", "demo", *flags],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=240,
    )


# -- every strategy and mode on a SimMesh ----------------------------------------------------


@pytest.mark.parametrize("mode", demo.MODES)
@pytest.mark.parametrize("strategy", demo.STRATEGIES)
def test_sim_demo_matches_dense_reference(strategy, mode):
    report, text = run_sim(strategy=strategy, mode=mode, steps=3)
    cfg = report.config
    assert report.passed and report.failures == []
    assert report.max_loss_error < demo.TOLERANCE and report.max_param_error < 1e-5
    assert re.search(rf"^PASS: .*\({strategy} {mode} on sim", text, re.M)
    assert f"{mode} mode" in text.splitlines()[0]
    losses = report.result.losses
    assert len(losses) == cfg.steps and losses[-1] < losses[0]  # it trains
    want = expected_per_step(cfg)
    assert {k: c // cfg.steps for k, (c, _) in report.result.comm.items()} == want
    assert {k: c for k, (c, _) in comm_table(text).items()} == want


def test_sim_demo_on_a_ragged_mesh():
    # 2x3 ranks and 697 parameters: Flat chunks need tail padding, which must not leak.
    for mode in demo.MODES:
        report, _ = run_sim(strategy="hfsdp", mode=mode, outer=2, inner=3, hidden=33, steps=2)
        assert report.passed and report.max_param_error < 1e-5


@pytest.mark.parametrize("mode", demo.MODES)
def test_a_size_1_axis_has_no_collectives(mode):
    report, text = run_sim(strategy="hsdp", mode=mode, outer=4, inner=1, steps=2)
    assert report.passed
    assert not any(axis == "dp_inner" for _, axis, _ in report.result.comm)  # the log
    table = comm_table(text)
    assert table and not any(axis == "dp_inner" for _, axis, _ in table)  # the printed table
    assert {k: c for k, (c, _) in table.items()} == expected_per_step(report.config)


# -- gloo ------------------------------------------------------------------------------------


def test_gloo_demo_default_run_passes_and_logs_the_sim_collectives():
    proc = subprocess.run(
        [sys.executable, "-m", "functional_hsdp", "demo"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^PASS: .*hsdp whole on gloo", proc.stdout, re.M), proc.stdout
    table = comm_table(proc.stdout)
    assert {k: c for k, (c, _) in table.items()} == expected_per_step(demo.Config())
    _, sim_text = run_sim()
    assert table == comm_table(sim_text)  # counts and bytes


def test_gloo_layerwise_hfsdp_passes_with_the_header_before_progress():
    flags = ("--mode", "layerwise", "--strategy", "hfsdp", "--steps", "2")
    proc = run_cli(*flags)
    text = proc.stdout
    assert proc.returncode == 0, text
    assert re.search(r"^PASS: .*hfsdp layerwise on gloo", text, re.M), text
    assert text.startswith("functional_hsdp demo: hfsdp on gloo, layerwise mode")
    assert text.index("global batch") < text.index("hfsdp layerwise on gloo:")  # progress
    table = comm_table(text)
    cfg = demo.Config(strategy="hfsdp", mode="layerwise", steps=2)
    assert {k: c for k, (c, _) in table.items()} == expected_per_step(cfg)
    _, sim_text = run_sim(strategy="hfsdp", mode="layerwise", steps=2)
    assert table == comm_table(sim_text)


# -- failing properly ------------------------------------------------------------------------


def test_failed_comparison_prints_fail_and_exits_1(monkeypatch, capsys):
    monkeypatch.setattr(demo, "TOLERANCE", 0.0)
    assert main(["demo", "--backend", "sim", "--steps", "1", "--microbatches", "1"]) == 1
    assert re.search(r"^FAIL: max \|Δloss\|", capsys.readouterr().out, re.M)


@pytest.mark.parametrize("lr", ["nan", "inf"])
def test_a_non_finite_loss_fails_and_exits_1(lr, capsys):
    # the CLI refuses these; the check on the losses must hold without it
    args = build_parser().parse_args(["demo", "--backend", "sim", "--steps", "2"])
    args.lr = float(lr)
    assert demo.main(args) == 1
    assert re.search(r"^FAIL: non-finite loss at step 1 \(nan\)", capsys.readouterr().out, re.M)


def test_divergence_fails():
    report, text = run_sim(lr=1e4, steps=6, microbatches=1, mode="layerwise")
    assert not report.passed and report.failures == ["non-finite loss at step 5 (inf)"]
    assert re.search(r"^FAIL: non-finite loss", text, re.M) and "PASS" not in text


def test_non_finite_parameters_fail_even_when_every_loss_is_finite():
    report, text = run_sim(lr=math.nan, steps=1)
    assert math.isfinite(report.result.losses[0])
    assert not report.passed
    assert re.search(r"^FAIL: non-finite final parameters", text, re.M)


def test_lr_nan_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--backend", "sim", "--lr", "nan"])
    assert exit_.value.code == 2
    assert "argument --lr: expected a finite number >= 0; got 'nan'" in capsys.readouterr().err


# -- command line and output -----------------------------------------------------------------


def test_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["demo", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for flag in (
        "--steps",
        "--microbatches",
        "--mesh",
        "--strategy",
        "--backend",
        "--lr",
        "--mode",
    ):
        assert flag in text
    assert "hfsdp" in text and "layerwise" in text


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--steps", "abc", "argument --steps: expected a positive integer; got 'abc'"),
        ("--steps", "0", "argument --steps: expected a positive integer; got '0'"),
        ("--microbatches", "1.5", "argument --microbatches: expected a positive integer; got"),
        ("--batch", "-2", "argument --batch: expected a positive integer; got '-2'"),
        ("--hidden", "", "argument --hidden: expected a positive integer; got ''"),
        ("--seed", "x", "argument --seed: expected an integer; got 'x'"),
        ("--lr", "-0.1", "argument --lr: expected a finite number >= 0; got '-0.1'"),
        ("--lr", "inf", "argument --lr: expected a finite number >= 0; got 'inf'"),
        ("--lr", "fast", "argument --lr: expected a finite number >= 0; got 'fast'"),
        ("--mesh", "2", "argument --mesh: expected OxI with two positive integers, like 2x2"),
        ("--mesh", "axb", "argument --mesh: expected OxI with two positive integers, like 2x2"),
        ("--mesh", "2x2x2", "argument --mesh: expected OxI with two positive integers"),
        ("--mesh", "2x0", "argument --mesh: expected OxI with two positive integers (sizes"),
        ("--mode", "bulk", "argument --mode: invalid choice: 'bulk' (choose from"),
    ],
)
def test_bad_flag_values_say_what_was_expected(flag, value, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["demo", flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "invalid _" not in err


def test_header_is_printed_and_flushed_before_training(monkeypatch):
    merged = io.StringIO()  # stdout and stderr in write order, as a terminal shows them
    monkeypatch.setattr(sys, "stderr", merged)
    demo.run(demo.Config(backend="sim", outer=1, inner=1, steps=1, microbatches=1), out=merged)
    text = merged.getvalue()
    header = text.split("\n")[:4]
    assert header[0] == (
        "functional_hsdp demo: hsdp on sim, whole mode, mesh dp_outer=1 x dp_inner=1 (1 rank), "
        "1 step x 1 microbatch, lr=0.1, seed=0"
    )
    assert header[3] == "global batch 8 = 1 rank x 1 microbatch x 8 samples"
    assert text.index(header[3]) < text.index("hsdp whole on sim:") < text.index("PASS")


def test_every_backend_sees_the_same_global_batch():
    cfg = demo.Config(outer=2, inner=3, microbatches=2, batch=5)
    x, y = demo.make_data(cfg)
    assert x.shape == (2, 3, 2, 5, cfg.features) and y.shape == (2, 3, 2, 5, cfg.outputs)
    x2, _ = demo.make_data(cfg)
    torch.testing.assert_close(x, x2, rtol=0, atol=0)  # from the seed alone


def test_units_round_trip():
    params = demo.init_params(demo.Config())
    units = demo.to_units(params)
    assert [sorted(u) for u in units] == [["bias", "weight"]] * 2
    back = demo.from_units(units, params)
    assert list(back) == list(params) and all(back[k] is params[k] for k in params)

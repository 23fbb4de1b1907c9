"""``python -m functional_hsdp demo``: every strategy on a SimMesh, and the default gloo run.

The sim runs are in-process (a couple of seconds each); the gloo run is one subprocess of the
real command with default flags (hsdp, 2x2, 3 microbatches), checked for its PASS line, its exit
code and its communication table, which must equal the sim run's: both meshes log the same
collectives for the same calls.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import pytest
import torch

import functional_hsdp as fh
from functional_hsdp import demo
from functional_hsdp.__main__ import build_parser, main

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROW = re.compile(r"^\s+(dp_\w+)\s+(\w+)\s+(\d+)\s+(\d+)\s+\w")


def buckets(cfg: demo.Config) -> int:
    """B: how many buckets the model's parameters fill, counted by the library's own psum."""
    mesh = fh.SimMesh(dict(zip(demo.AXES, (cfg.outer, cfg.inner))))
    stacked = {
        k: v.expand(cfg.outer, cfg.inner, *v.shape) for k, v in demo.init_params(cfg).items()
    }
    with fh.comm_log() as log:
        fh.psum(stacked, "dp_inner", mesh)
    return log.count("all_reduce")


def expected_per_step(strategy: str, M: int, B: int) -> dict[tuple[str, str], int]:
    """Collectives per step: forward gathers, per-microbatch scatters, deferred all-reduces."""
    if strategy == "ddp":  # all deferred: one all-reduce per axis on the last microbatch
        return {("dp_inner", "all_reduce"): B, ("dp_outer", "all_reduce"): B}
    if strategy == "fsdp":  # every microbatch reduce-scatters over both axes
        return {
            (a, op): n
            for a in demo.AXES
            for op, n in (("reduce_scatter", M * B), ("all_gather", B))
        }
    # hsdp: reduce-scatter dp_inner every microbatch; all-reduce dp_outer once, on the shard
    return {
        ("dp_inner", "reduce_scatter"): M * B,
        ("dp_outer", "all_reduce"): B,
        ("dp_inner", "all_gather"): B,
    }


def comm_table(text: str) -> dict[tuple[str, str], tuple[int, int]]:
    """The printed per-step communication table: {(axis, op): (count, bytes)}."""
    return {(m[1], m[2]): (int(m[3]), int(m[4])) for m in map(ROW.match, text.splitlines()) if m}


def run_sim(**kw) -> tuple[demo.Report, str]:
    out = io.StringIO()
    report = demo.run(demo.Config(backend="sim", **kw), out=out)
    return report, out.getvalue()


@pytest.mark.parametrize("strategy", demo.STRATEGIES)
def test_sim_demo_matches_dense_reference(strategy):
    report, text = run_sim(strategy=strategy)
    cfg = report.config
    assert report.passed and report.max_loss_error < demo.TOLERANCE
    assert report.max_param_error < 1e-5
    assert re.search(rf"^PASS: .*{strategy} on sim", text, re.M)
    losses = report.result.losses
    assert len(losses) == cfg.steps and losses[-1] < losses[0]  # it trains
    want = expected_per_step(strategy, cfg.microbatches, buckets(cfg))
    assert {k: c // cfg.steps for k, (c, _) in report.result.comm.items()} == want
    assert {k: c for k, (c, _) in comm_table(text).items()} == want


def test_sim_demo_on_a_ragged_mesh():
    # 2x3 ranks and 697 parameters: Flat chunks need tail padding, which must not leak.
    report, _ = run_sim(strategy="hsdp", outer=2, inner=3, hidden=33, steps=2)
    assert report.passed and report.max_param_error < 1e-5


def test_gloo_demo_default_run_passes_and_logs_the_sim_collectives():
    proc = subprocess.run(
        [sys.executable, "-m", "functional_hsdp", "demo"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^PASS: .*hsdp on gloo", proc.stdout, re.M), proc.stdout
    cfg = demo.Config()
    M, B = cfg.microbatches, buckets(cfg)
    table = comm_table(proc.stdout)
    assert table[("dp_inner", "reduce_scatter")][0] == M * B
    assert table[("dp_outer", "all_reduce")][0] == B
    _, sim_text = run_sim()
    assert table == comm_table(sim_text)  # counts and bytes


def test_failed_comparison_prints_fail_and_exits_1(monkeypatch, capsys):
    monkeypatch.setattr(demo, "TOLERANCE", 0.0)
    assert main(["demo", "--backend", "sim", "--steps", "1", "--microbatches", "1"]) == 1
    assert re.search(r"^FAIL: max \|Δloss\|", capsys.readouterr().out, re.M)


def test_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["demo", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--steps", "--microbatches", "--mesh", "--strategy", "--backend", "--lr"):
        assert flag in text


@pytest.mark.parametrize("mesh", ["2", "2x0", "axb"])
def test_bad_mesh_flag_is_a_usage_error(mesh, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["demo", "--mesh", mesh])
    assert exit_.value.code == 2
    assert "argument --mesh" in capsys.readouterr().err


def test_every_backend_sees_the_same_global_batch():
    cfg = demo.Config(outer=2, inner=3, microbatches=2, batch=5)
    x, y = demo.make_data(cfg)
    assert x.shape == (2, 3, 2, 5, cfg.features) and y.shape == (2, 3, 2, 5, cfg.outputs)
    x2, _ = demo.make_data(cfg)
    torch.testing.assert_close(x, x2, rtol=0, atol=0)  # from the seed alone

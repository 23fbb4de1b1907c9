"""Smoke test of the benchmark suite (bench/): every benchmark at its tiny size, in seconds.

The full benchmark (``python -m bench all``) is not part of the test suite; this keeps its
code working. One pool of 4 gloo processes is shared by all benchmarks here. (The hostile
matrix, a correctness matrix rather than a benchmark, is tests/units/test_hostile.py's.)
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

import pytest

from bench import BENCHMARKS, LAYERS, common
from bench.__main__ import run_one
from bench.device import gpu_hf

# module, layerwise and memory last: they switch the shared workers' malloc to mmap-everything
ORDER = [
    "alignment",
    "wire",
    "agreement",
    "gpu",
    "limit",
    "overlap",
    "compiled",
    "rsimpl",
    "overhead",
    "host",
    "scaling",
    "fsdp",
    "deferred",
    "unit_checks",
    "diloco",
    "diloco_overlap",
    "compress",
    "wan",
    "faults",
    "module",
    "muon",
    "dpsgd",
    "layerwise",
    "memory",
]


@pytest.fixture(scope="module")
def pool():
    p = common.new_pool(timeout=300.0)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "RESULTS.md"
    path.write_text("# results\n\n## validation cost\n\nsomeone else's text\n")
    return path


def test_every_benchmark_is_in_the_smoke_test():
    assert sorted(ORDER) == sorted(BENCHMARKS)


def test_every_benchmark_is_in_the_folder_of_its_layer():
    """``bench/<layer>/<name>.py``: a layer of the package's table, or ``device`` (the one-GPU
    check); the other files in those folders are the scripts bench/README.md describes (not
    registered benchmarks) and the parts of ``gpu``."""
    from functional_hsdp.layers import LAYERS as PACKAGE_LAYERS

    for name, mod in BENCHMARKS.items():
        assert mod.__name__ == f"bench.{LAYERS[name]}.{name}", (name, mod.__name__)
        assert LAYERS[name] in (*PACKAGE_LAYERS, "device"), name
    bench = Path(common.BENCH_DIR)
    files = {p.relative_to(bench).as_posix() for p in bench.glob("*/*.py")}
    scripts = {"mesh/gloo_allgather.py", "mesh/startup.py", "runtime/agreement_scaling.py"}
    helpers = {"device/gpu_hf.py", "device/gpu_muon.py", "diloco/faults_worker.py"}
    inits = {f"{layer}/__init__.py" for layer in set(LAYERS.values())}
    assert files == {f"{LAYERS[n]}/{n}.py" for n in BENCHMARKS} | scripts | helpers | inits


@pytest.mark.parametrize("name", ORDER)
def test_benchmark_runs_at_tiny_size(name, pool, results, tmp_path):
    if name == "faults":  # B22 runs torchft's lighthouse and Manager
        pytest.importorskip("torchft", reason="B22 needs the [ft] extra: pip install -e '.[ft]'")
    command = f"python -m bench {name} --size tiny"
    png = str(tmp_path / "scaling.png")
    # the workers' long-lived heaps out of the collector's sight (as tests/conftest.py does
    # this process's):
    # the benchmarks' many gc.collect() calls then walk what they made, not torch's and
    # transformers' objects (half this test's time otherwise)
    pool.run(common.freeze_heap)
    res, md = run_one(name, "tiny", command, str(results), None, pool=pool, png=png)
    assert f"Command: `{command}`" in md and "Date: " in md
    text = results.read_text()
    assert f"<!-- bench:{name}:start -->" in text and "someone else's text" in text
    if name == "fsdp":
        dp = {v: x for v, x in res["loss_maxrel"].items() if v not in BENCHMARKS["fsdp"].REFERENCE}
        assert len(dp) >= 2 and all(x < 1e-4 for x in dp.values()), res["losses"]
        assert res["comm_log"] == {
            "dp_inner/all_gather": 1,
            "dp_inner/reduce_scatter": res["cfg"]["M"],
            "dp_outer/all_reduce": 1,
        }
    if name == "gpu":  # one rank in this process: the library's paths against dense
        assert res["correct_ok"], res["correct"]
        # issue_size_one: every library path issues its collectives at world size 1
        for v in ("whole_tree", "maingrad", "lw_sink", "lw_pure"):
            assert sum(res["collectives"][v].values()) > 0, (v, res["collectives"])
        assert res["collectives"]["plain"] == {} and "collectives per step" in md
        assert all(x < 1e-4 for x in res["loss_maxrel"].values()), res["losses"]
        # the Llama through shard_module + functional_call trains as FSDP2-bf16 does
        hf = res["hf"]
        if importlib.util.find_spec("transformers") is not None:
            assert hf["skipped"] is None, hf["skipped"]
            assert hf["correct"]["ok"], hf["correct"]
            for v, x in hf["loss_maxrel"].items():
                bf16 = gpu_hf.PLAIN_TOLERANCE if v == "hf_plain_bf16" else gpu_hf.TOLERANCE
                assert x <= bf16, (v, hf["losses"])
            assert all(len(t) == hf["cfg"]["reps"] for t in hf["times"].values())
            assert "### A Hugging Face Llama" in md and "Skipped" not in md
        # Muon: fh.muon on both owner routes trains as torch.optim.Muon + AdamW (fp32
        # Newton-Schulz), fh.adamw as torch's AdamW; every Newton-Schulz call was timed
        mu = res["muon"]
        assert mu["correct_ok"], mu["correct"]
        assert set(mu["correct"]) == {1, mu["cfg"]["M"]}
        assert all(len(t) == mu["cfg"]["reps"] for t in mu["times"].values())
        assert all(mu["ns"][v]["calls"] > 0 and mu["ns"][v]["seconds"] > 0 for v in mu["ns"])
        assert all(x < 1e-2 for x in mu["loss_maxrel"].values()), mu["losses"]
        assert "### Muon" in md and "Arithmetic, not a measurement" in md
    if name == "wan":  # two sites where this machine can make them (root, tc, tbf)
        if "skipped" in res:
            assert "Skipped: " in md
        else:
            v = res["rates"]["100"]
            assert set(v) == set(res["cfg"]["only"])
            for x in v.values():  # the link carries at least what comm_log counts
                assert x["link_bytes"] >= x["comm_bytes"], x
            assert 0 < v["HSDP int8"]["comm_bytes"] < v["HSDP"]["comm_bytes"] / 3
            assert v["HSDP int8"]["codec"] > 0 and v["HSDP"]["codec"] == 0
            assert v["DiLoCo H=4"]["comm_bytes"] < v["HSDP"]["comm_bytes"] / 4
            assert all(len(x["curve"]) >= 2 for x in v.values())
            assert "### Goals (issue 46)" in md
    if name == "faults":  # a kill and a heal per mode; no failure = plain DistMesh, bit for bit
        for mode, x in res["modes"].items():
            assert len(x["failures"]) == len(res["cfg"]["die"][mode]) and not x["missed"], x
            for f in x["failures"]:
                assert f["heal"] and f["heal"]["healed"] and f["heal"]["equal"], f
                assert f["detection"] is not None and f["cost"] is not None, f
            bits = x["bits"]
            assert all(b["compared"] > 0 and b["differ"] == 0 for b in bits.values()), bits
        ref = res["modes"]["hsdp"]["reference"]
        assert ref["fail"]["max_abs"] < 1e-4 and ref["none"]["max_abs"] < 1e-4, ref
        # the failure run = its quorum log replayed in a plain world (a heal in it), every bit
        replay = res["modes"]["hsdp"]["replay"]
        assert replay["bitwise"] and replay["max_abs"] == 0.0, replay
        assert len(replay["sets"]) >= 2, replay  # the whole quorum and one without the dead
        assert "### Goals (issue 47)" in md
        from functional_hsdp.tools.testing import sites

        if sites.probe() is None:  # a group per site, across a rate-limited link
            assert res["network"]["kind"] == "sites", res["network"]
            assert f"{res['cfg']['groups']} sites over a 100 Mbit/s link" in md
            for x in res["modes"].values():  # every run crossed it (the replica axis at least)
                assert all(v["bytes"] > 0 for v in x["link"].values()), x["link"]
        else:
            assert res["network"]["kind"] == "loopback" and "over loopback" in md
    if name == "diloco":  # H=2: half HSDP's outer bytes, none on steps without a sync
        h2 = res["variants"]["H=2"]
        assert h2["quiet_nonzero"] == 0 and h2["syncs"] == res["cfg"]["steps"] // 2
        assert h2["bytes_per_step"] == pytest.approx(res["variants"]["hsdp"]["bytes_per_step"] / 2)
        balanced = res["variants"]["H=2 F=2 balanced"]  # fh.balanced_fragments' labels
        assert balanced["balanced"] and balanced["fragments"] == 2
        assert balanced["quiet_nonzero"] == 0
    if name == "diloco_overlap":  # every variant timed; each run ended with nothing in flight
        assert set(res["hidden"]) == {
            f"{k}/{w}" for k in ("sleep", "cpu") for w in ("fp32", "int8")
        }
        assert len(res["period"]) == 10  # 2 computes x (4 syncs and none)
        assert all(x > 0 for x in res["period"].values()), res["period"]
    if name == "deferred":  # declared or not, the same step; finish() timed in each
        assert res["loss_maxrel"] < 1e-6, res["losses"]
        assert all(len(t) == res["cfg"]["reps"] for t in res["finish"].values()), res["finish"]
    if name == "wire":
        for p in res["presets"].values():
            assert p["wire"] >= p["theory"] * (1 - 1e-9)
    if name == "scaling":
        assert os.path.getsize(png) > 0
    if name == "memory":
        for mode in ("sim", "gloo"):
            assert res[mode]["maingrad"]["persistent"] > 0
            assert all(r["reset_ok"] for r in res[mode].values())
    if name == "dpsgd":  # every DP-SGD variant alike (and Opacus's norms), the plain steps alike
        for case in ("mlp", "llama"):
            c = res["cases"][case]
            ours = {k: v for k, v in c["loss_maxrel"].items() if "opacus" not in k}
            assert all(v < 1e-4 for v in ours.values()), (case, c["loss_maxrel"])
            assert all(v < 1e-6 for v in c["weights_maxabs"].values()), c["weights_maxabs"]
            assert all(v < 1e-4 for v in c["norms_maxrel"].values()), c["norms_maxrel"]
        assert "### Goals (issue 48)" in md
    if name == "module":  # each fh variant trains as its FSDP2 counterpart
        for key, ratio in res["ratio"].items():
            assert ratio["loss"] < (2e-2 if key.endswith("bf16") else 1e-4), (key, ratio)
        assert res["reduce_dtypes_bf16"] == ["float32"]
    if name == "muon":  # Muon on the owners is the naive route's math; adamw trains too
        assert all(x < 1e-3 for x in res["agree"].values()), res["losses"]
        assert all(x == x for x in res["median"].values()) and "(B16)" in md
    if name in ("limit", "overhead", "rsimpl"):
        assert "nan" not in md and not any(
            isinstance(v, float) and math.isnan(v) for v in res.get("median", {}).values()
        )


def test_gpu_without_transformers_skips_the_llama_with_a_note(monkeypatch):
    """Where transformers cannot be imported, bench gpu runs its MLP and says why the Llama
    part did not run (it does not fail)."""
    why = "ModuleNotFoundError: No module named 'transformers'"
    monkeypatch.setattr(gpu_hf, "available", lambda: why)
    res = BENCHMARKS["gpu"].run("tiny")
    assert res["hf"]["skipped"] == why and "times" not in res["hf"]
    assert res["correct_ok"], res["correct"]
    md = BENCHMARKS["gpu"].report(res, "python -m bench gpu --size tiny", "today")
    assert f"Skipped: `transformers` could not be imported ({why})" in md


def test_write_section_replaces_in_place_and_keeps_other_text(tmp_path):
    path = tmp_path / "R.md"
    path.write_text("# title\n\n## validation cost\n\nkeep me\n")
    common.write_section("a", "## A\n\none", str(path))
    common.write_section("b", "## B\n\ntwo", str(path))
    common.write_section("a", "## A\n\nthree", str(path))
    text = path.read_text()
    assert "keep me" in text and "one" not in text and "three" in text and "two" in text
    assert text.index("validation cost") < text.index("## A") < text.index("## B")


def test_diloco_memory_pairs_the_frees_the_profiler_misses():
    """B18's tensor peaks: an allocation whose address is allocated again with no free
    reported, or that is still live at the end of the profile (a free the profiler missed),
    counts as freed at the end of its step, not to the end of the profile; the step that
    made it is flagged; a free of an allocation made before the profile is dropped."""
    from bench.diloco import diloco

    steps = [(10, 20), (30, 40)]
    events = [
        (5, 0xA, -50),  # a free of something allocated before the profile: dropped
        (11, 0x1, 100),  # step 0: freed, reported
        (12, 0x2, 70),  # step 0: its free is never reported
        (15, 0x1, -100),
        (31, 0x2, 70),  # step 1 reuses 0x2: the first one was freed unseen
        (32, 0x3, 10),
        (33, 0x4, 20),  # step 1: never freed nor reused by the end of the profile
        (35, 0x2, -70),
        (36, 0x3, -10),
    ]
    paired, lost, n, hit = diloco._paired(events, steps)
    assert (lost, n, hit) == (90, 2, [True, True])
    peaks, starts = diloco._peaks(paired, steps)
    assert peaks == [170, 100] and starts == [0, 0]
    assert sum(b for _, b in paired) == 0
    # summed as reported, the missed frees keep 70 bytes live through step 1, 90 after it
    assert diloco._peaks([(t, b) for t, _, b in events[1:]], steps)[0] == [170, 170]


def _same_work_sides():
    """Two sides of ``bench.same_work`` as its ``side`` writes them: one variant, 2 ranks,
    two steps each, the same on both sides."""
    ev = [["all_gather", "dp_inner", "torch.float32", 8, None]]
    outer = [["all_reduce", "dp_outer", "torch.float32", 4, "sum"]]
    entry = {"steps": [ev, ev + outer], "losses": [1.5, 0.25], "eval": 2.0, "weights": ["ab"]}

    def one():
        import copy

        trace = [{"H=2": copy.deepcopy(entry)} for _ in range(2)]
        return {"trace": {"diloco": trace}, "bench": {}, "variants": {"diloco": ["H=2"]}}

    return one(), one()


def test_same_work_reports_a_trace_that_differs():
    """bench.same_work's comparison fails where one side's collectives (an element count,
    their order, one too many), losses (one ulp), eval loss or weights differ on one rank,
    and passes where nothing does."""
    import math

    from bench import same_work

    before, after = _same_work_sides()
    assert same_work.trace_diff(before["trace"]["diloco"], after["trace"]["diloco"], "H=2") == []
    report, same = same_work.compare(before, after, ["diloco"])
    assert same and "**no**" not in report

    def mutated(change):
        b, a = _same_work_sides()
        change(a["trace"]["diloco"][1]["H=2"])
        return same_work.trace_diff(b["trace"]["diloco"], a["trace"]["diloco"], "H=2"), b, a

    changes = {
        "numel": lambda e: e["steps"][1][1].__setitem__(3, 5),
        "order": lambda e: e["steps"][1].reverse(),
        "extra": lambda e: e["steps"][0].append(e["steps"][0][0]),
        "steps": lambda e: e["steps"].append([]),
        "loss": lambda e: e["losses"].__setitem__(1, math.nextafter(0.25, 1)),
        "eval": lambda e: e.__setitem__("eval", math.nextafter(2.0, 3.0)),
        "weights": lambda e: e["weights"].__setitem__(0, "ac"),
    }
    for what, change in changes.items():
        diff, b, a = mutated(change)
        assert diff and all(d.startswith("rank 1: ") for d in diff), (what, diff)
        report, same = same_work.compare(b, a, ["diloco"])
        assert not same and "**no**" in report and "rank 1" in report, what
    diff, _, _ = mutated(lambda e: e["steps"][1].reverse())
    assert diff == [
        "rank 1: step 2: collective 1 is ['all_gather', 'dp_inner', 'torch.float32', 8, None] "
        "before, ['all_reduce', 'dp_outer', 'torch.float32', 4, 'sum'] after (2 vs 2 in the step)"
    ]
    b, a = _same_work_sides()
    del a["trace"]["diloco"][0]["H=2"]
    assert same_work.trace_diff(b["trace"]["diloco"], a["trace"]["diloco"], "H=2") == [
        "rank 0: traced only before"
    ]


def test_same_work_reports_exact_figures_that_differ():
    """A benchmark's own figures that the same work leaves identical (here B18's dp_outer
    bytes) fail the comparison where they differ; step times and memory do not."""
    from bench import same_work

    def bench(nbytes, step):
        x = dict(bytes_per_step=nbytes, max_step_bytes=2 * nbytes, quiet_nonzero=0, syncs=2,
                 curve=[[3, 5.0]], kept=8, pending=0, shard_bytes=4, step_quiet=step,
                 step_sync=2 * step, memory={"torch": 1e6, "torch_low": 9e5})  # fmt: skip
        return {"variants": {"H=2": x}}

    before, after = _same_work_sides()
    before["bench"]["diloco"], after["bench"]["diloco"] = bench(100, 0.01), bench(100, 0.02)
    assert same_work.compare(before, after, ["diloco"])[1]
    after["bench"]["diloco"] = bench(101, 0.01)
    report, same = same_work.compare(before, after, ["diloco"])
    assert not same and "bytes_per_step/H=2" in report


@pytest.mark.parametrize("name", ["diloco", "compress"])
def test_same_work_traces_every_library_variant_over_a_sync(name, pool):
    """bench.same_work's traces of B18 and B19 at the tiny size: every library variant, the
    same collectives on replica peers; DiLoCo's over steps with and without a sync (the inner
    loop alone: none), HSDP's with one every step."""
    from bench import BENCHMARKS, same_work

    cfg = BENCHMARKS[name].SIZES["tiny"]
    per_rank = pool.run(same_work._trace_task, name, cfg)
    variants = same_work.library(name, cfg)
    assert all(sorted(r) == sorted(variants) for r in per_rank)
    for v in variants:
        # a rank's collectives are its replica peer's (rank + 2; a Streaming fragment's size
        # is the inner rank's own)
        assert all(per_rank[r][v]["steps"] == per_rank[r + 2][v]["steps"] for r in (0, 1)), v
        outer = [any(e[1] == "dp_outer" for e in step) for step in per_rank[0][v]["steps"]]
        if v in ("hsdp", "none") or name == "compress" and "/" not in v:
            assert all(outer), v  # HSDP: an outer all-reduce every step
        elif v.startswith("inner"):
            assert not any(outer), v  # never a sync
        else:  # DiLoCo: a sync; with one fragment, steps without one too
            assert any(outer) and ("F=" in v or not all(outer)), (v, outer)
        assert per_rank[0][v]["eval"] is not None

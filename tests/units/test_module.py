"""fh.shard_module / fh.functional_call: what is refused before anything is sharded (no
process group needed). Training through them is tested on gloo ranks
(tests/units/test_module_gloo.py)."""

from __future__ import annotations

import re

import pytest
import torch

import functional_hsdp as fh


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])

    def forward(self, ids):
        h = self.embed(ids)
        for b in self.blocks:
            h = b(h)
        return h


def _spec():
    return fh.hsdp(fh.SimMesh({"dp_outer": 2, "dp_inner": 2}), "dp_outer", "dp_inner")


def test_units_must_be_distinct_submodules_not_nested():
    net = Net()
    with pytest.raises(ValueError, match="not a submodule"):
        fh.shard_module(net, _spec(), units=[torch.nn.Linear(4, 4)])
    with pytest.raises(NotImplementedError, match="'blocks.0' is inside unit 'blocks'"):
        fh.shard_module(net, _spec(), units=[net.blocks, net.blocks[0]])
    with pytest.raises(ValueError, match="given twice"):
        fh.shard_module(net, _spec(), units=[net.blocks[0], net.blocks[0]])
    with pytest.raises(TypeError, match=r"units\[0\] must be an nn.Module"):
        fh.shard_module(net, _spec(), units=["blocks.0"])
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        fh.shard_module({"w": torch.ones(2)}, _spec(), units=[])


def test_meta_parameters_and_a_simmesh_spec_are_refused():
    with torch.device("meta"):
        net = Net()
    with pytest.raises(ValueError, match="'embed.weight' is on the meta device"):
        fh.shard_module(net, _spec(), units=list(net.blocks))
    net = Net()
    with pytest.raises(NotImplementedError, match="must be on a DistMesh"):
        fh.shard_module(net, _spec(), units=list(net.blocks))
    with pytest.raises(TypeError, match="must be a Spec"):
        fh.shard_module(Net(), lambda m: "hsdp", units=[])
    assert all(not p.is_meta for p in net.parameters())  # nothing was touched


def test_functional_call_needs_a_sharded_model():
    with pytest.raises(TypeError, match="sharded by fh.shard_module"):
        fh.functional_call(Net(), {}, (torch.zeros(2, dtype=torch.long),))


def _bad_shards_task() -> dict:
    """On one gloo rank: functional_call given each kind of wrong unit shards; the errors."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    dm = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_outer", "dp_inner"))
    spec = fh.hsdp(fh.DistMesh(dm), "dp_outer", "dp_inner")
    net = Net()
    shards, _ = fh.shard_module(net, spec, units=list(net.blocks))
    ids = torch.zeros(2, dtype=torch.long)
    unit = shards["blocks.0"]
    cases = {
        "missing": {"weight": unit["weight"]},
        "unknown": {**unit, "scale": torch.ones(1)},
        "type": {**unit, "bias": 3.0},
        "shape": {**unit, "bias": torch.zeros(7)},
    }
    out = {}
    for name, bad in cases.items():
        try:
            fh.functional_call(net, {**shards, "blocks.0": bad}, (ids,))
        except (TypeError, ValueError) as e:
            out[name] = (type(e).__name__, str(e))
    out["ok"] = tuple(fh.functional_call(net, shards, (ids,)).shape)
    dist.destroy_process_group()
    return out


def test_functional_call_errors_name_the_unit_and_the_parameter():
    """Missing, unknown, non-tensor and wrongly shaped parameters of a unit: the error names
    the unit and the parameter (a missing one used to read "match no known layout ... pass
    like=", which functional_call does not take)."""
    from functional_hsdp.mesh import launch

    (res,) = launch.run(_bad_shards_task, world_size=1, timeout=60.0, join=False)
    unit = r"shards\['blocks.0'\]"
    assert res["missing"][0] == "ValueError"
    assert re.search(unit + r": unit 'blocks.0' .*missing \['bias'\]", res["missing"][1])
    assert re.search(unit + r": .*unknown \['scale'\]", res["unknown"][1])
    assert res["type"][0] == "TypeError"
    assert re.search(unit + r"\['bias'\]: .*must be a tensor.*float", res["type"][1])
    assert re.search(unit + r"\['bias'\]: .*shape", res["shape"][1]), res["shape"]
    assert res["ok"] == (2, 4)

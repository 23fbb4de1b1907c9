"""How deep is the library between a public call and the wire? On 4 gloo ranks (2x2), rank 0's
package frames (file:function, from the DistMesh collective up) at ``fh.functional_call``'s first
all-gather and reduce-scatter and at ``dl.update``'s all-reduce. Not a registered benchmark: a
reading aid for restructures (it runs on older, flat checkouts too)::

    python -m bench.frames
"""

import inspect
import os


def task():
    import torch

    import functional_hsdp as fh

    try:
        from functional_hsdp.mesh.launch import device_mesh
    except ImportError:
        from functional_hsdp.launch import device_mesh
    pkg = os.path.dirname(fh.__file__) + os.sep
    seen = {}

    def hook(name, orig):
        def wrapped(self, *a, **k):
            if name not in seen:
                frames = [f for f in inspect.stack()[1:] if f.filename.startswith(pkg)]
                seen[name] = [f"{f.filename[len(pkg) :]}:{f.function}" for f in frames]
            return orig(self, *a, **k)

        return wrapped

    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        setattr(fh.DistMesh, op, hook(op, getattr(fh.DistMesh, op)))
    mesh = fh.DistMesh(device_mesh((2, 2), ("dp_outer", "dp_inner")))
    spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    shards, _ = fh.shard_module(model, spec, units=[model[0], model[2]])
    x = torch.randn(4, 8)
    torch.func.grad(lambda s: fh.functional_call(model, s, (x,)).square().mean())(shards)
    fc = dict(seen)
    seen.clear()
    dl = fh.diloco(fh.replicas(spec, "dp_outer"), axis="dp_outer", every=1, outer=fh.sgd(lr=1.0))
    params = fh.shard({"w": torch.randn(4, 4)}, dl.inner)
    state = dl.init(params)
    dl.update(params, state)
    return {"fh.functional_call": fc, "dl.update": dict(seen)}


if __name__ == "__main__":
    try:
        from functional_hsdp.mesh import launch
    except ImportError:
        from functional_hsdp import launch
    from bench.frames import task as _task

    out = launch.run(_task, world_size=4, timeout=120.0)[0]
    for title, d in out.items():
        for op, frames in d.items():
            files = len({f.split(":")[0] for f in frames})
            print(f"{title} -> {op}: {len(frames)} package frames, {files} files")
            for f in frames:
                print("   ", f)

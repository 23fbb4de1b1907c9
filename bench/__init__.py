"""Benchmarks of functional_hsdp: ``python -m bench all`` (see bench/README.md).

Each benchmark is ``bench/<layer>/<name>.py``, in the folder of the package's layer whose work
it measures (``bench/device/``: the one-GPU check, every path at world size 1); ``LAYERS``
names each one's folder, and ``python -m bench <name>`` runs it by its name alone. Each module
has ``SIZES`` (``tiny`` for the smoke test, ``full`` for the figures),
``run(size, pool=None) -> dict`` and ``report(result, command, date) -> str`` (a markdown
section for ``bench/RESULTS.md``).
"""

from importlib import import_module

# name -> its folder, in the order ``python -m bench all`` runs them
LAYERS = {
    "fsdp": "sync",
    "limit": "sync",
    "overlap": "runtime",
    "overhead": "runtime",
    "host": "runtime",
    "wire": "plan",
    "scaling": "sync",
    "rsimpl": "mesh",
    "memory": "sync",
    "compiled": "sync",
    "layerwise": "units",
    "module": "units",
    "agreement": "runtime",
    "gpu": "device",
    "deferred": "units",
    "dpsgd": "units",
    "alignment": "plan",
    "unit_checks": "units",
    "muon": "optim",
    "diloco": "diloco",
    "diloco_overlap": "diloco",
    "compress": "runtime",
    "wan": "diloco",
    "faults": "diloco",
}

BENCHMARKS = {name: import_module(f"{__name__}.{layer}.{name}") for name, layer in LAYERS.items()}

"""Benchmarks of functional_hsdp: ``python -m bench all`` (see bench/README.md).

Each module has ``SIZES`` (``tiny`` for the smoke test, ``full`` for the figures),
``run(size, pool=None) -> dict`` and ``report(result, command, date) -> str`` (a markdown
section for ``bench/RESULTS.md``).
"""

from . import (
    agreement,
    alignment,
    compiled,
    compress,
    deferred,
    diloco,
    diloco_overlap,
    dpsgd,
    fsdp,
    gpu,
    host,
    hostile,
    layerwise,
    limit,
    memory,
    module,
    muon,
    overhead,
    overlap,
    rsimpl,
    scaling,
    unit_checks,
    wire,
)

BENCHMARKS = {
    "fsdp": fsdp,
    "limit": limit,
    "overlap": overlap,
    "overhead": overhead,
    "host": host,
    "wire": wire,
    "scaling": scaling,
    "rsimpl": rsimpl,
    "memory": memory,
    "compiled": compiled,
    "layerwise": layerwise,
    "module": module,
    "agreement": agreement,
    "gpu": gpu,
    "deferred": deferred,
    "dpsgd": dpsgd,
    "alignment": alignment,
    "unit_checks": unit_checks,
    "muon": muon,
    "hostile": hostile,
    "diloco": diloco,
    "diloco_overlap": diloco_overlap,
    "compress": compress,
}

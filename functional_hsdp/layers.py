"""The package's layers, bottom up: a module imports only from its own layer or below.

Each layer is a subpackage, ``functional_hsdp/<layer>/``; ``tests/project/test_code_shape.py`` reads
this table (by parsing it, not importing it) and checks every import against it, imports
inside functions and under ``if TYPE_CHECKING:`` included. The modules directly in the
package (``__init__.py``: the public surface ``fh.X``; ``__main__.py``; this file) are the
top: they may import any layer below ``USERS``, and only the ``USERS`` layers import them.
"""

LAYERS: tuple[str, ...] = (
    "base",  # pytrees with paths, result tags, errors, caches, comm_log, torch releases
    "mesh",  # the mesh protocol, SimMesh, DistMesh, local gloo launch: collectives on buckets
    "spec",  # placements, Spec and its presets, the compression and precision policies
    "plan",  # buckets and the plan of one tree (owner placement included): computed once
    "runtime",  # the scheduler and the engine that runs a plan; compressed moves; agreement
    "io",  # the per-leaf checkpoint form, below every stateful type: each saves itself with it
    "sync",  # the public reductions: reduce_grads, psum/pmean/..., MainGrad, autodiff moves
    "units",  # layer-wise units (gathered) and existing nn.Modules (functional_call)
    "optim",  # optax's building blocks, the schedules, per_matrix and Muon
    "diloco",  # the semi-synchronous outer loop over a replica axis
    "tools",  # the demo and what tests and benchmarks run on (tools/testing/)
)

# Layers that use the package as its users do (``import functional_hsdp as fh``): they sit above
# the top, and the top never imports them (the library runs without them).
USERS: tuple[str, ...] = ("tools",)

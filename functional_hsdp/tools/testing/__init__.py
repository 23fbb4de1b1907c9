"""What the test suite and the benchmarks run on, beside the library: never imported by it.

:class:`GlooPool` keeps gloo ranks up across tasks (:mod:`.gloo_pool`); :func:`torch_muon_in` runs
``torch.optim.Muon`` with its Newton-Schulz in float32 (:mod:`.muon_reference`);
:mod:`.into_problem` runs issue 36's sequences of calls with other ``into=`` on one model
(tests/units/test_into*.py and tests/units/hostile.py's ``*/into/*`` cases); :mod:`.sites` runs
ranks in network namespaces joined by a rate-limited link, as root (issue 46; import it by name).
They live in the package, not in ``tests/``, because ``bench/`` uses them too and their worker
processes import them by module name; ``tests/project/test_runtime_imports.py`` checks that no other
module of the package imports this subpackage, so the library runs without it.
"""

from ...mesh.launch import WorkerError
from .gloo_pool import GlooPool, WorkerTimeout
from .muon_reference import newton_schulz_fp32, torch_muon_in

__all__ = ["GlooPool", "WorkerError", "WorkerTimeout", "newton_schulz_fp32", "torch_muon_in"]

"""``torch.optim.Muon`` with its Newton-Schulz in float32: the reference for ``fh.muon``.

The test suite and ``bench gpu`` check ``fh.muon(..., ns_dtype=torch.float32)`` against it
(torch's own iteration casts to bf16).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def newton_schulz_fp32(grad, ns_coefficients, ns_steps, eps):
    """``torch.optim.Muon``'s orthogonalization of one matrix, in float32 instead of bf16: the
    quintic iteration as its documentation states it (the fp32 reference; torch's own casts
    to bf16)."""
    a, b, c = ns_coefficients
    x = grad.float()
    tall = grad.size(0) > grad.size(1)
    x = x.T if tall else x
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


@contextlib.contextmanager
def torch_muon_in(dtype: torch.dtype) -> Iterator[None]:
    """``torch.optim.Muon`` with its Newton-Schulz in ``dtype`` (bf16: as it is; float32:
    :func:`newton_schulz_fp32`)."""
    import torch.optim._muon as torch_muon

    own = torch_muon._zeropower_via_newtonschulz
    if dtype == torch.float32:
        torch_muon._zeropower_via_newtonschulz = newton_schulz_fp32
    try:
        yield
    finally:
        torch_muon._zeropower_via_newtonschulz = own

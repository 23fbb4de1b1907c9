"""Existing modules on 4 gloo ranks (2x2 mesh): a Hugging Face ``LlamaForCausalLM`` trained
through ``fh.shard_module`` + ``fh.functional_call`` against FSDP2 (``fully_shard`` per
decoder layer + root, HSDP) with the same weights and data, in fp32 and with FSDP2's
``MixedPrecisionPolicy`` (bf16 compute and all-gathers, fp32 reductions)."""

from __future__ import annotations

import pytest
import torch
from hf_problem import fh_train, fsdp2_train

from functional_hsdp.launch import DEFAULT_PRELOAD, GlooPool

pytest.importorskip("transformers")

STEPS, M = 3, 2


@pytest.fixture(scope="module")
def pool():
    preload = (*DEFAULT_PRELOAD, "pytest", "torch.distributed.fsdp", "transformers")
    with GlooPool(4, preload=preload) as p:
        yield p


def _rel(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in a)


def _fsdp2_task(tied, mp_bf16=False, checkpoint=False):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if mp_bf16 else None
    return fsdp2_train(tied, STEPS, M, mp, checkpoint)


def _fh_task(tied, mp_bf16=False, **kw):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if mp_bf16 else None
    return fh_train(tied, STEPS, M, mp, **kw)


@pytest.fixture(scope="module")
def fsdp2(pool):
    """FSDP2's runs, once per configuration."""
    cache = {}

    def get(tied, mp_bf16=False):
        if (tied, mp_bf16) not in cache:
            cache[(tied, mp_bf16)] = pool.run(_fsdp2_task, tied, mp_bf16)
        return cache[(tied, mp_bf16)]

    return get


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_parameters_after_three_steps_equal_fsdp2s(pool, fsdp2, tied):
    theirs = fsdp2(tied)
    ours = pool.run(_fh_task, tied)
    for (p, losses, _), (q, their_losses, _) in zip(ours, theirs):
        assert _rel(p, q) <= 1e-5
        assert losses == pytest.approx(their_losses, rel=1e-6)


@pytest.mark.parametrize(
    ("recompute", "mode", "attn"),
    [(True, "sink", "sdpa"), (False, "pure", "eager"), (True, "pure", "sdpa")],
)
def test_llama_recompute_and_pure_modes_equal_fsdp2s(pool, fsdp2, recompute, mode, attn):
    theirs = fsdp2(True)
    ours = pool.run(_fh_task, True, recompute=recompute, mode=mode, attn=attn)
    for (p, _, _), (q, _, _) in zip(ours, theirs):
        assert _rel(p, q) <= 1e-5


def test_llama_bf16_policy_is_fsdp2s(pool, fsdp2):
    """bf16 compute and all-gathers, fp32 reductions, as FSDP2's same policy: the losses are
    as close to FSDP2-bf16's as FSDP2's own bf16 run is to its fp32 one, or closer."""
    fp32, bf16 = fsdp2(True)[0], fsdp2(True, True)[0]
    ours = pool.run(_fh_task, True, True)[0]
    precision = max(abs(a - b) for a, b in zip(bf16[1], fp32[1]))
    assert precision > 0  # bf16 did change something
    assert max(abs(a - b) for a, b in zip(ours[1], bf16[1])) <= precision
    assert _rel(ours[0], bf16[0]) <= max(_rel(bf16[0], fp32[0]), 1e-5)
    dtypes = {(op, dtype) for op, _, dtype in ours[2]}
    assert dtypes == {
        ("all_gather", torch.bfloat16),
        ("reduce_scatter", torch.float32),
        ("all_reduce", torch.float32),
    }
    assert dtypes == bf16[2]  # what FSDP2's c10d calls carried

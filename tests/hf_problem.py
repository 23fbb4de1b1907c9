"""A Hugging Face model trained on gloo ranks through ``fh.shard_module`` /
``fh.functional_call`` and through FSDP2 (``fully_shard`` per decoder layer + root, HSDP), with
the same initial weights and data: the tasks of tests/units/test_module_gloo.py.

The model is a tiny random-init ``LlamaForCausalLM`` from a config (no download). Every rank
r gets its own microbatches; the loss is the mean next-token cross-entropy / M.
"""

from __future__ import annotations

import optree
import torch
import torch.distributed as dist
import torch.nn.functional as F
from reference import AXES, GLOO_SHAPE

import functional_hsdp as fh

V, D, LAYERS, SEQ, BATCH = 96, 32, 2, 12, 2
LR = 0.2


def config(tied: bool = False, attn: str = "sdpa"):
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=2 * D,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        use_cache=False,
    )
    cfg._attn_implementation = attn
    return cfg


def model(tied: bool = False, attn: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)  # the same initial weights on every rank
    return LlamaForCausalLM(config(tied, attn))


def batches(step: int, microbatches: int, rank: int | None = None) -> list[torch.Tensor]:
    rank = dist.get_rank() if rank is None else rank
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randint(V, (BATCH, SEQ), generator=gen) for _ in range(microbatches)]


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def _mean_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def fsdp2_train(
    tied: bool, steps: int, microbatches: int, mp=None, checkpoint: bool = False
) -> tuple[dict, list[float], set]:
    """FSDP2 HSDP, per decoder layer + root, SGD; returns (full parameters by name, mean
    loss per step, the (collective, dtype) pairs its c10d calls carried)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    m = model(tied)
    if checkpoint:
        enable = getattr(m, "activation_checkpointing_enable", m.gradient_checkpointing_enable)
        enable({"use_reentrant": False})
    m.train()
    dm = init_device_mesh("cpu", GLOO_SHAPE, mesh_dim_names=AXES)
    mp = mp or MixedPrecisionPolicy()
    for layer in m.model.layers:
        fully_shard(layer, mesh=dm, mp_policy=mp)
    fully_shard(m, mesh=dm, mp_policy=mp)
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    losses = []
    with _C10dDtypes() as carried:
        for step in range(steps):
            total = 0.0
            for k, ids in enumerate(batches(step, microbatches)):
                m.set_requires_all_reduce(k == microbatches - 1)
                loss = lm_loss(m(ids).logits, ids) / microbatches
                loss.backward()
                total += loss.item()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(total)
    full = {n: p.full_tensor().detach().clone() for n, p in m.named_parameters()}
    return full, list(map(_mean_over_ranks, losses)), carried.pairs


def fh_train(
    tied: bool,
    steps: int,
    microbatches: int,
    mp=None,
    *,
    recompute: bool = False,
    mode: str = "sink",
    attn: str = "sdpa",
    grad: str = "torch.func",
) -> tuple[dict, list[float], list]:
    """The same training through ``fh.functional_call``: ``mode`` ``"sink"`` (into a
    MainGrad, the microbatches declared, SGD in place) or ``"pure"`` (gradients returned,
    ``reduce_grads(at="gradient")``, new trees); ``grad``: ``torch.func.grad_and_value`` or
    ``fh.grad_and_value`` (``"fh"``). Returns (full parameters by name, mean loss
    per step, comm_log events as (op, axis, dtype))."""
    m = model(tied, attn)
    m.train()
    spec = fh.hsdp(fh.DistMesh(_device_mesh()), *AXES)
    shards, tree_spec = fh.shard_module(m, spec, units=list(m.model.layers), mp_policy=mp)
    mg = fh.MainGrad(tree_spec, like=shards) if mode == "sink" else None

    def loss_fn(s, ids):
        out = fh.functional_call(m, s, (ids,), into=mg, recompute=recompute)
        return lm_loss(out.logits, ids) / microbatches

    grad_and_value = fh.grad_and_value if grad == "fh" else torch.func.grad_and_value
    losses = []
    with fh.comm_log() as log:
        for step in range(steps):
            total, acc = 0.0, None
            for ids, last in fh.microbatches(batches(step, microbatches), into=mg):
                g, loss = grad_and_value(loss_fn)(shards, ids)
                total += loss.item()
                if mg is None:
                    acc = fh.reduce_grads(g, tree_spec, last=last, acc=acc, at="gradient")
            if mg is not None:
                mg.finish()
                for p, g in zip(optree.tree_leaves(shards), optree.tree_leaves(mg.grads)):
                    p.sub_(LR * g)
                mg.zero_grad()
            else:
                shards = optree.tree_map(lambda p, g: p - LR * g, shards, acc)
            losses.append(total)
    losses = list(map(_mean_over_ranks, losses))
    full = fh.gather(shards, tree_spec)
    named = {
        (n if unit == "" else f"{unit}.{n}"): t.clone()
        for unit, sub in full.items()
        for n, t in sub.items()
    }
    return named, losses, [(e.op, e.axis, e.dtype) for e in log.events]


_MESH = {}


def _device_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    if "dm" not in _MESH:
        _MESH["dm"] = init_device_mesh("cpu", GLOO_SHAPE, mesh_dim_names=AXES)
    return _MESH["dm"]


class _C10dDtypes(torch.utils._python_dispatch.TorchDispatchMode):
    """The (collective, dtype) pairs of the c10d collectives run inside (a dispatch mode sees
    every c10d op and its tensors)."""

    KINDS = {
        "_allgather_base_": "all_gather",
        "allgather_into_tensor_coalesced_": "all_gather",
        "_reduce_scatter_base_": "reduce_scatter",
        "reduce_scatter_tensor_coalesced_": "reduce_scatter",
        "allreduce_": "all_reduce",
    }

    def __init__(self):
        super().__init__()
        self.pairs: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d" and func._opname in self.KINDS:
            tensors = [t for t in optree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            floating = [t.dtype for t in tensors if t.is_floating_point()]
            if floating:
                self.pairs.add((self.KINDS[func._opname], floating[0]))
        return func(*args, **kwargs)

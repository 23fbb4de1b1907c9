"""DP-SGD's Gaussian noise on a sharded gradient: :func:`add_gaussian_noise` (the
transformation) and :func:`gaussian_noise` (the noise of one step, as a tree of shards).

Invariant: the noise is a function of ``(seed, step, leaf, element)`` alone, drawn in blocks of
``block`` elements of each flattened leaf, every block from a generator seeded by ``(seed, step,
leaf, block)``. A rank draws only the blocks its shard overlaps (never a full tensor), so the
ranks that hold the same shard (replicas along a Replicate axis, HSDP's outer one) draw the
same noise and stay equal, different shards draw independent noise, and the noise is the same
whatever the mesh or spec (a run is reproducible, and resumes on another mesh shape). No
communication.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, NamedTuple

import numpy as np
import optree
import torch

from ..plan.lookup import find_plan_at
from ..plan.owner.pieces import chunk_of, piece_of
from .transformation import GradientTransformation, check_state, tensor_leaves

__all__ = ["AddGaussianNoiseState", "add_gaussian_noise", "gaussian_noise"]

BLOCK = 1 << 16  # elements per generator: a shard draws at most two blocks it does not hold


class AddGaussianNoiseState(NamedTuple):
    """State of :func:`add_gaussian_noise`.

    Attributes:
        count: number of updates so far (a host int): the step the noise is drawn for.
    """

    count: int


def _check(stddev: Any, seed: Any, block: Any) -> None:
    if (
        isinstance(stddev, bool)
        or not isinstance(stddev, (int, float))
        or not (math.isfinite(stddev) and stddev >= 0)
    ):
        raise ValueError(f"add_gaussian_noise: stddev must be a finite number >= 0; got {stddev!r}")
    if seed is None:
        raise ValueError(
            "add_gaussian_noise: seed is required: the ranks that hold the same shard must draw "
            "the same noise, and a run must be reproducible (pass an int, the same on every "
            "rank, e.g. seed=1234)"
        )
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"add_gaussian_noise: seed must be an int; got {type(seed).__name__}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"add_gaussian_noise: block must be a positive int; got {block!r}")


def _key(seed: int, *, step: int, leaf: int, block: int) -> int:
    """A 63-bit generator seed for one block (distinct tuples: independent streams)."""
    digest = hashlib.blake2b(f"{seed}/{step}/{leaf}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _piece(
    lo: int, hi: int, *, seed: int, step: int, leaf: int, block: int, device, dtype
) -> torch.Tensor:
    """Elements ``[lo, hi)`` of the leaf's flattened noise: the blocks they overlap, each
    drawn whole from its own generator, then cut."""
    parts = []
    for k in range(lo // block, -(-hi // block)):
        gen = torch.Generator(device=device).manual_seed(_key(seed, step=step, leaf=leaf, block=k))
        drawn = torch.randn(block, generator=gen, device=device, dtype=torch.float32)
        a, b = max(lo, k * block) - k * block, min(hi, (k + 1) * block) - k * block
        parts.append(drawn[a:b])
    out = torch.cat(parts) if parts else torch.zeros(0, device=device)
    return out.to(dtype)


def _ranks(mesh: Any) -> list[tuple[int, ...]]:
    """The mesh coordinates whose values this process holds: every one on a SimMesh (the
    batch dims), this rank's on a DistMesh."""
    if mesh.batch_shape:
        return list(np.ndindex(*mesh.sizes))
    return [tuple(mesh.coordinate(a) for a in mesh.axis_names)]


def gaussian_noise(tree: Any, spec: Any, *, seed: int, step: int, block: int = BLOCK) -> Any:
    """Standard normal noise shaped as ``tree``'s local shards at ``spec``'s optimizer
    placement (a final ``reduce_grads`` result, or ``shard``-ed weights): each rank's piece of
    one dense noise tree that depends on ``(seed, step)`` only (see the module docstring).

    Args:
        tree: local shards at the optimizer placement (their values are not read).
        spec: the :class:`~functional_hsdp.Spec` or spec tree they were made with (Flat,
            Replicate or owner-major optimizer placements).
        seed: an int, the same on every rank.
        step: the step the noise is for (an int >= 0).
        block: elements per generator (the granularity of what a rank draws beyond its
            shard: at most one block on each side).

    Returns:
        A tree like ``tree`` of float noise (each leaf's dtype), N(0, 1) elementwise.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp": 2})
        >>> spec = fh.fsdp(mesh)
        >>> g = fh.shard({"w": torch.zeros(5)}, spec)
        >>> z = fh.gather(fh.gaussian_noise(g, spec, seed=0, step=0), spec)["w"][0]
        >>> one = fh.ddp(fh.SimMesh({"dp": 1}))  # one rank: the dense noise
        >>> dense = fh.gaussian_noise({"w": torch.zeros(1, 5)}, one, seed=0, step=0)["w"][0]
        >>> torch.equal(z, dense)
        True
    """
    _check(1.0, seed, block)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"gaussian_noise: step must be an int >= 0; got {step!r}")
    leaves, treedef, paths = tensor_leaves(tree, "tree")
    for x, path in zip(leaves, paths):
        if not x.is_floating_point():
            raise TypeError(f"{path}: noise is for floating-point gradients; got {x.dtype}")
    if not leaves:
        return tree
    plan = find_plan_at(leaves, treedef, paths, spec=spec, role="optimizer", name="tree")
    mesh, ranks = plan.mesh, _ranks(plan.mesh)
    bufs = []
    for b, bucket in enumerate(plan.buckets):
        placed = plan.placed[b]["optimizer"]
        if bucket.shard is not None or getattr(placed.geometry, "kept", False):
            spec_b = bucket.spec
            raise NotImplementedError(
                f"{paths[bucket.slots[0].index]}: gaussian_noise supports Flat, "
                f"Replicate and owner-major optimizer placements; this leaf's is "
                f"[{', '.join(map(str, spec_b.optimizer))}] (Shard(d), or Owner on some axes with "
                "Flat on the others)"
            )
        rows = []
        for r in ranks:
            start, length = chunk_of(mesh, bucket, axes=placed.axes, rank=r)
            row = torch.zeros(
                length, dtype=bucket.dtype, device=plan.devices[bucket.slots[0].index]
            )
            for s in bucket.slots:
                lo, hi = piece_of(s, start, length)
                if hi > lo:
                    at = s.offset + lo - start
                    row[at : at + hi - lo] = _piece(
                        lo, hi, seed=seed, step=step, leaf=s.index, block=block,
                        device=row.device, dtype=row.dtype,
                    )  # fmt: skip
            rows.append(row)
        buf = torch.stack(rows).view(*mesh.batch_shape, -1) if mesh.batch_shape else rows[0]
        bufs.append(buf)
    out = [x.clone() for x in plan.unpack(bufs, "optimizer")]
    return optree.tree_unflatten(treedef, out)


def add_gaussian_noise(
    spec: Any, stddev: float, *, seed: int, block: int = BLOCK
) -> GradientTransformation:
    """Add Gaussian noise of standard deviation ``stddev`` to the updates, drawn anew at
    every step: DP-SGD's noise, added once per step to the reduced gradient at the optimizer
    placement (put it after the clipping pass's reduction and before the optimizer in a
    :func:`chain`). With per-example clipping to ``C`` and a global batch of ``B`` examples
    whose clipped gradients are averaged, DP-SGD's noise multiplier ``sigma`` is
    ``stddev = sigma * C / B``.

    Each rank draws only its own shard's noise (:func:`gaussian_noise`): replicas of a shard
    draw the same, so they stay equal; different shards draw independent noise; the noise is
    a function of ``(seed, step)`` alone, the same on any mesh. No communication.

    Use one for the whole gradient tree. A leaf's noise is keyed by its position in the
    tree this transformation is given, so two of them with the same seed (one per unit's
    subtree, say) draw the *same* noise for leaves at the same positions, and the
    difference of two such gradients cancels it: give each its own seed.

    Args:
        spec: the :class:`~functional_hsdp.Spec` (or spec tree) of the updates' optimizer
            placement.
        stddev: the noise's standard deviation (a number >= 0).
        seed: an int, the same on every rank (required: the ranks that hold a shard must
            agree, and a run must be reproducible).
        block: elements per generator (see :func:`gaussian_noise`).

    Returns:
        A :class:`GradientTransformation`; its state is an :class:`AddGaussianNoiseState`
        (the step count).

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
        >>> spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
        >>> params = fh.shard({"w": torch.zeros(6)}, spec)
        >>> opt = fh.chain(fh.add_gaussian_noise(spec, 0.1, seed=0), fh.sgd(1.0))
        >>> grads = fh.shard({"w": torch.zeros(6)}, spec)
        >>> updates, state = opt.update(grads, opt.init(params), params)
        >>> w = updates["w"]  # local shards: (dp_outer, dp_inner, 3)
        >>> torch.equal(w[0, 0], w[1, 0]), torch.equal(w[0, 0], w[0, 1])  # replicas agree
        (True, False)
    """
    _check(stddev, seed, block)

    def init(params: Any) -> AddGaussianNoiseState:
        return AddGaussianNoiseState(count=0)

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        check_state(state, AddGaussianNoiseState)
        if not stddev:
            return updates, AddGaussianNoiseState(state.count + 1)
        noise = gaussian_noise(updates, spec, seed=seed, step=state.count, block=block)
        out = optree.tree_map(lambda u, z: u + stddev * z, updates, noise)
        return out, AddGaussianNoiseState(state.count + 1)

    return GradientTransformation(init, update)

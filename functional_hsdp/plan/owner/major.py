"""The owner-major layout of an Owner spec, and the balance of leaves over owners.

:func:`owned` makes the spec; on every data-parallel axis its buckets are laid out
owner-major (:func:`owner_bucket`, which :mod:`functional_hsdp.plan.recipe` passes to
:func:`functional_hsdp.plan.buckets.build_buckets`): a bucket's leaves are assigned to the ranks
balanced by size (:func:`balance`), and rank k's chunk holds the whole leaves it owns, padded
to the largest chunk. What this costs: :func:`owner_bucket`; how such a spec moves: :func:`owned`.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
from collections.abc import Sequence

import torch

from ...spec.placement import Owner
from ...spec.specs import Spec
from ..buckets import Bucket, Slot, align

__all__ = ["balance", "owned", "owner_bucket", "owner_of_slot"]


def balance(sizes: Sequence[int], n: int) -> list[int]:
    """Each item's owner among ``n``, the loads as even as a greedy start and local steps
    make them: largest first, each to the least loaded (ties: the lowest index); then, while
    the heaviest owner is more than 1/256 above the bound no assignment beats (the largest
    item, and the total over ``n`` rounded up), the step that evens it and one of the 8 least
    loaded owners the most: one of its items moved there, or swapped for a smaller one (at
    most as many steps as items and owners: milliseconds for thousands of leaves). Every step
    lowers the heaviest load or the number of owners at it and raises no load above it, so
    every load stays within the largest item of every other.

    Example:
        >>> from functional_hsdp.plan.owner import balance
        >>> balance([4, 1, 3, 2], 2)
        [0, 0, 1, 1]
        >>> balance([3, 3, 2, 2, 2], 2)  # largest first alone: loads 7 and 5
        [1, 1, 0, 0, 0]
    """
    heap = [(0, k) for k in range(n)]
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, k = heapq.heappop(heap)
        owner[i] = k
        heapq.heappush(heap, (load + sizes[i], k))
    if n > 1 and sizes:
        _even(sizes, owner, n)
    return owner


def _even(sizes: Sequence[int], owner: list[int], n: int) -> None:
    """:func:`balance`'s local steps, in place on ``owner``."""
    bound = max(max(sizes), -(-sum(sizes) // n))
    held: list[list[tuple[int, int]]] = [[] for _ in range(n)]  # per owner (size, item), sorted
    for i in sorted(range(len(sizes)), key=lambda i: (sizes[i], i)):
        held[owner[i]].append((sizes[i], i))
    loads = [sum(s for s, _ in h) for h in held]
    # within 1/256 of the bound is even enough; at most as many steps as items and owners
    enough = bound + bound // 256
    for _ in range(len(sizes) + n):
        h = max(range(n), key=lambda k: (loads[k], -k))
        lightest = heapq.nsmallest(_PARTNERS, range(n), key=lambda k: (loads[k], k))
        step = _best_step(held, loads, h, partners=lightest) if loads[h] > enough else None
        if step is None:
            return
        k, a, b = step
        for src, dst, item in ((h, k, a), (k, h, b)):
            if item is not None:
                held[src].remove(item)
                bisect.insort(held[dst], item)
                loads[src], loads[dst] = loads[src] - item[0], loads[dst] + item[0]
                owner[item[1]] = dst


_PARTNERS = 8  # the least loaded owners a step may pair with the heaviest


def _best_step(held: list, loads: list[int], h: int, *, partners: list[int]) -> tuple | None:
    """``(k, a, b)``: owner h's item a to owner k (one of ``partners``), and k's item b (None:
    none) to h, the pair's heavier load after it the lowest over every such k, a and b that
    lower h's load by less than its gap to k's; None if there is none."""
    best, found = loads[h], None
    for k in partners:
        gap = loads[h] - loads[k]
        if k == h or gap < 2:
            continue
        sizes_k = [s for s, _ in held[k]]
        for a in held[h]:
            # the transfer d = a - b is best at gap / 2: b's size nearest a - gap / 2
            at = bisect.bisect_left(sizes_k, a[0] - gap // 2)
            options = [None, *(held[k][j] for j in (at - 1, at) if 0 <= j < len(held[k]))]
            for b in options:
                d = a[0] - (b[0] if b is not None else 0)
                after = max(loads[h] - d, loads[k] + d)
                if 0 < d < gap and after < best:
                    best, found = after, (k, a, b)
    return found


def owner_bucket(run: list[Slot], spec: Spec, *, unit: int, dtype: torch.dtype, device) -> Bucket:
    """A bucket of ``run`` laid out owner-major over ``spec``'s split order.

    Owner k's chunk is ``[k C, (k + 1) C)``, C the largest owner's leaves (each at an aligned
    offset); the bucket is ``n C`` long. Owners are numbered heaviest first, so chunk 0 is
    never empty (a bucket's first leaf is at offset 0). The layout depends on the run's
    leaves alone (their sizes and order), never on where they sit in a larger tree: a unit's
    buckets are the same seen alone (as a gathered unit looks them up) or in the whole tree.

    What it costs: a bucket is n chunks of its heaviest owner's leaves, so at least n times
    its largest leaf, whatever the assignment. A Llama decoder layer of width d (MLP 4d, half
    as many key-value heads as query heads) holds three 4d^2 MLP matrices and 3d^2 besides:
    on 4 owners it pads to 16d^2 for its 15d^2 (four layers in one unit balance exactly).
    """
    n = math.prod(spec.mesh.size(a) for a in spec.split_order)
    widths = [align(s.numel) for s in run]
    owner = balance(widths, n)
    loads = [0] * n
    for k, w in zip(owner, widths):
        loads[k] += w
    order = sorted(range(n), key=lambda k: (-loads[k], k))
    label = {k: r for r, k in enumerate(order)}
    chunk, cursor, slots = max(loads), [0] * n, []
    for s, k, w in zip(run, owner, widths):
        r = label[k]
        slots.append(dataclasses.replace(s, offset=r * chunk + cursor[r]))
        cursor[r] += w
    slots.sort(key=lambda s: s.offset)
    numel = sum(s.numel for s in run)
    return Bucket(
        spec=spec,
        unit=unit,
        dtype=dtype,
        device=device,
        slots=tuple(slots),
        numel=numel,
        padded=n * chunk,
    )


def owner_of_slot(bucket: Bucket, slot: Slot) -> dict[str, int]:
    """The coordinates (over the spec's split order) of the rank owning ``slot`` in an
    owner-major bucket."""
    mesh, axes = bucket.spec.mesh, bucket.spec.split_order
    k = slot.offset // (bucket.padded // math.prod(mesh.size(a) for a in axes))
    out = {}
    for a in reversed(axes):
        k, out[a] = divmod(k, mesh.size(a))
    return out


def owned(spec: Spec, axes: str | Sequence[str] | None = None) -> Spec:
    """``spec`` with its optimizer placement ``Owner`` on ``axes`` (default: every
    data-parallel axis but a fault-tolerant replica axis, whose groups may fail).

    The spec's parameter and gradient placements stay. Every leaf's final gradient, main
    weight and optimizer state then lives on its owner, one rank of the data-parallel mesh
    (leaves balanced by size), and :func:`~functional_hsdp.per_matrix` runs ``fn`` there.

    * **On every data-parallel axis** (the default) the buckets are laid out owner-major,
      each leaf whole on its owner: for HSDP, the last microbatch reduce-scatters over the
      outer axis (where HSDP all-reduces), ``per_matrix`` runs with no communication, and
      :func:`~functional_hsdp.sync_params` all-gathers the new weights over the outer axis;
      main weights and state are sharded over both axes. The outer axis carries
      AdamW-HSDP's bytes times each bucket's padding to its heaviest owner (n times the
      heaviest owner's leaves, at least n times the bucket's largest leaf).
    * **On some axes only** (HSDP's outer: ``axes="dp_outer"``; there the parameter must be
      Replicate and the gradient Partial or Replicate) the spec keeps its own layout, and
      along that axis each rank keeps only the pieces of its chunk whose leaf its
      coordinate owns (:class:`~functional_hsdp.plan.owner.KeptPieces`; a leaf's local value
      elsewhere is empty). The last microbatch's outer all-reduce becomes a
      reduce-scatter-v (one all-to-all of the data only, each piece to its owner's
      coordinate, then a sum), ``sync_params`` an
      all-gather-v (one all-to-all): per rank, exactly HSDP's outer bytes on a 2-wide outer
      axis whatever the balance, nothing padded on the wire. ``per_matrix`` moves to each
      leaf's owner (the rank whose chunk holds most of it) only the pieces of leaves that
      straddle chunks (for HSDP at most an all-to-all pair over ``dp_inner``).
      Main weights and state are sharded over both axes, as owner-major's. One such axis of
      size > 1 at most.
    * **On some axes, Replicate on the others** (HSDP's inner: ``axes="dp_inner"``, and the
      default on a fault-tolerant replica mesh, whose replica axis stays Replicate: owners
      within each replica group) the buckets are laid out owner-major over ``axes`` alone,
      and each replica along the other axes holds the same owners' whole leaves: the last
      microbatch all-reduces over the Replicate axes as HSDP does, ``per_matrix`` runs with
      no communication once per leaf in each replica, and ``sync_params`` moves nothing.
      The inner axis carries each bucket's padding to its heaviest owner, as owner-major's.

    Args:
        spec: a :class:`~functional_hsdp.Spec` without ``Shard(d)``.
        axes: data-parallel axis names (default: all of them).

    Returns:
        A new Spec (equal for equal inputs).

    Example:
        >>> import functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
        >>> fh.owned(fh.hsdp(mesh, "dp_outer", "dp_inner")).optimizer
        (Owner(), Owner())
        >>> fh.owned(fh.hsdp(mesh, "dp_outer", "dp_inner"), "dp_outer").optimizer
        (Owner(), Flat())
        >>> fh.owned(fh.hsdp(mesh, "dp_outer", "dp_inner"), "dp_inner").optimizer
        (Replicate(), Owner())
    """
    if not isinstance(spec, Spec):
        raise TypeError(f"owned: expected a Spec; got {type(spec).__name__}")
    if spec.shard is not None:
        raise NotImplementedError("owned: a Shard(d) spec has no owner layout; use Flat()")
    if axes is None:
        apart = getattr(spec.mesh, "apart_axes", ())
        chosen = tuple(a for a in spec.dp_axes if a not in apart)
        if not chosen:
            raise ValueError(
                f"owned: every data-parallel axis of the spec {spec.dp_axes} is a "
                "fault-tolerant replica axis: there is no axis to own leaves along"
            )
    else:
        chosen = (axes,) if isinstance(axes, str) else tuple(axes)
        wrong = [a for a in chosen if a not in spec.dp_axes]
        if wrong or not chosen:
            raise ValueError(
                f"owned: axes must be data-parallel axes of the spec {spec.dp_axes}; got {axes!r}"
            )
    names = spec.mesh.axis_names
    optimizer = [Owner() if a in chosen else x for a, x in zip(names, spec.optimizer)]
    return Spec(
        spec.mesh,
        parameter=spec.parameter,
        gradient=spec.gradient,
        optimizer=optimizer,
        dp_axes=spec.dp_axes,
        reduce_op=spec.reduce_op,
        bucket_cap_mb=spec.bucket_cap_mb,
        replica_axes=spec.replica_axes,
        outer_compress=spec.outer_compress,
    )

"""Per params tree, what DiLoCo cuts it into: each leaf's fragment, the plan, the packings.

Invariant: a :class:`TreeCut` is made once per params treedef (one kept at a time: another
treedef forgets it and its packings), from the labels and the params' plan only, so it is
the same on every rank; a meta ``like`` (for loading a checkpoint) gets its labels, no cut.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import optree
import torch

from ..base.tags import tag
from ..base.tree import flatten
from ..plan.recipe import get_plan
from ..runtime.compressed import Packing
from .schedule import full_bytes, leaf_fragments, params_plan, plan_bytes


class TreeCut(NamedTuple):
    """What :class:`TreeCuts` keeps per params treedef: each leaf's fragment, F, the
    params' plan and role, the residual's plan (fp32) and the leaves' paths."""

    of: list[int]
    n: int
    plan: Any
    role: str
    residual_plan: Any
    paths: tuple[str, ...]


class TreeCuts:
    """The cuts of one :func:`diloco`'s params trees, by treedef (the last one only), and
    their fragments' packings for ``compress=``."""

    def __init__(self, inner: Any, *, axis: str, fragments: Any):
        self.inner, self.axis, self.fragments = inner, axis, fragments
        self._cuts: dict[Any, TreeCut] = {}
        self._packings: dict = {}  # (treedef, fragment) -> its Packing, for compress=

    def __contains__(self, treedef: Any) -> bool:
        return treedef in self._cuts

    def __getitem__(self, treedef: Any) -> TreeCut:
        return self._cuts[treedef]

    def cut(self, params: Any) -> tuple[list, Any, list[int], int]:
        """params' leaves, treedef, each leaf's fragment and F (checked once per treedef)."""
        leaves, treedef, paths = flatten(params, "params")
        if treedef not in self._cuts and leaves and all(x.is_meta for x in leaves):
            # a like for loading a checkpoint: full shapes (fh.empty_state_dict's like)
            sizes = full_bytes(leaves, treedef, paths, spec=None)
            return (
                leaves,
                treedef,
                *leaf_fragments(self.fragments, params, treedef=treedef, paths=paths, sizes=sizes),
            )
        if treedef not in self._cuts:
            plan, role = self._plan(leaves, treedef, paths)
            sizes = plan_bytes(plan)
            self._cuts.clear()
            self._packings.clear()
            of, n = leaf_fragments(
                self.fragments, params, treedef=treedef, paths=paths, sizes=sizes
            )
            self._cuts[treedef] = TreeCut(
                of=of,
                n=n,
                plan=plan,
                role=role,
                residual_plan=_residual_plan(plan, paths),
                paths=tuple(paths),
            )
        cut = self._cuts[treedef]
        return leaves, treedef, cut.of, cut.n

    def packing(self, treedef: Any, leaves: list, *, of: list[int], p: int) -> Packing:
        """Fragment ``p``'s :class:`~functional_hsdp.runtime.compressed.Packing` (made by
        ``init``, or at the first sync)."""
        key = (treedef, p)
        if key not in self._packings:
            plan, role = self._cuts[treedef].plan, self._cuts[treedef].role
            members = [i for i, f in enumerate(of) if f == p]
            self._packings[key] = Packing.of(plan, leaves, role=role, members=members)
        return self._packings[key]

    def tag_residual(self, treedef: Any, residual: Any) -> None:
        """Tag the residual at the params' layout in fp32 (:func:`_residual_plan`), where
        :func:`~functional_hsdp.state_dict` finds and saves it (not for a meta ``like``)."""
        if treedef in self._cuts:
            cut = self._cuts[treedef]
            role, plan = cut.role, cut.residual_plan
            tag(optree.tree_leaves(residual), plan, role, kind="weights")

    def _plan(self, leaves: list, treedef: Any, paths: Sequence[str]) -> tuple[Any, str]:
        """The params' plan and role (their placement)."""
        plan, role = params_plan(leaves, treedef, paths, spec=self.inner)
        wrong = [s for s in plan.specs if self.axis not in s.replica_axes]
        if wrong:
            raise ValueError(
                f"diloco: params were sharded with {wrong[0]!r}, which reduces over "
                f"{self.axis!r}; shard them with the inner spec (dl.inner: replicas on "
                f"{self.axis!r})"
            )
        return plan, role


def _residual_plan(plan: Any, paths: Sequence[str]) -> Any:
    """``plan``'s layout in fp32: the leaves' dtypes still choose which share a bucket (as
    a MainGrad's fp32 buffers keep the parameters' layout), so the residual's local shapes
    are the params', and a checkpoint packs it in fp32."""
    meta = plan.meta
    kinds = meta.kinds if meta.kinds is not None else meta.dtypes
    fp32 = dataclasses.replace(meta, dtypes=(torch.float32,) * len(meta.dtypes), kinds=kinds)
    return get_plan(fp32, tuple(paths))

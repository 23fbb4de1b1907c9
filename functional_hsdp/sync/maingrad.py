"""MainGrad: persistent main-gradient buffers that microbatches reduce into, finished in place.

Unlike the pure :func:`~functional_hsdp.reduce_grads`, a ``MainGrad`` keeps state the caller
owns (Megatron-FSDP's ``main_grad``): flat buffers at the gradient placement, laid out as the
parameters' own buckets (``mg.grads`` lines up leaf by leaf with ``shard(params, spec)``),
reduced into ``DEPTH`` buckets deep on ``reduce_grads``' scheduler. Its other rooms: the
deferred outer reduction (:mod:`~functional_hsdp.sync.deferred`), what gathered units may do to
it (:mod:`~functional_hsdp.sync.unit_sink`, reached by :func:`units_of`), how it is saved and
loaded (:mod:`~functional_hsdp.sync.maingrad_state`).

Invariant: ``state`` is ``"accumulating"`` (Partial on the deferred axes) until the step's last
microbatch or ``finish()``, then ``"final"`` (the optimizer placement) until ``zero_grad()``.
State, all on the object (garbage collection frees it, ``fh.clear_caches()`` does not touch
it): the buffers (released by ``zero_grad()`` with ``persistent=False``), ``DEPTH`` packing
buffers per device, the step's state (per bucket whether it holds anything of this step), the
metadata of the last gradient tree checked, and the deferred reduction's bookkeeping. The
library's other state: ``DESIGN.md`` ("Elsewhere").
"""

from __future__ import annotations

import functools
import math
import os
import sys
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import optree
import torch

from ..base.tags import result_state, tag
from ..base.tree import (
    check_bool,
    check_tensors,
    flatten,
    paths_of,
    refuse_tracked,
    refuse_vmap,
    structure_error,
)
from ..plan.buckets import pack_shard_full, spaced
from ..plan.recipe import Plan, TreeMeta, get_plan
from ..runtime import engine, validate
from ..runtime.agreement import agree_on_unit_collective, agreement
from ..runtime.fingerprints import nonfinite_index
from ..runtime.unit_calls import unit_log
from ..spec.specs import resolve_specs
from . import maingrad_state
from .deferred import Deferred
from .unit_sink import UnitSink

__all__ = ["DEPTH", "MainGrad", "microbatches"]

#: Buckets in flight at once in MainGrad: packing one overlaps the other's collectives.
DEPTH = 2

T = TypeVar("T")


class MainGrad:
    """Persistent gradient buffers: accumulate microbatches in place, finish on ``last``.

    Args:
        spec: a :class:`Spec` or a pytree prefix of Specs.
        like: a tree with the structure, shapes and dtypes of one rank's full gradients
            (e.g. the full parameters; on a SimMesh without the mesh dims), or the local
            shards ``fh.shard`` (or ``fh.shard_module``) made of them. Its dtypes decide
            which leaves share a bucket, so the layout matches ``shard(like, spec)``.
        dtype: the buffers' dtype (default float32): gradients of any floating dtype
            accumulate in it.
        reduce_dtype: the dtype on the wire (default: ``dtype``). For float16 the sum is
            pre- and post-divided (about sqrt(n) each) so large worlds do not overflow.
        persistent: True (default): the buffers are allocated once and kept (Megatron's
            ``main_grad``; the views from :attr:`grads` stay put across steps). False:
            ``zero_grad()`` (``set_to_none=True``) releases their memory and each bucket
            takes it again when the step's first gradient lands in it, so between steps
            and early in backward the MainGrad holds nothing (FSDP2's gradient memory).

    ``accumulate`` pipelines the buckets two deep: it packs bucket b+1 (into one of two
    persistent packing buffers, each the size of the largest bucket, allocated by the first
    ``accumulate`` of raw gradients and reused) while bucket b's collectives run, then adds
    b's result into its buffer. So beyond
    the buffers a call needs at most two buckets' reduced chunks in flight, however large
    the model. On the last microbatch the deferred axes are reduced in place, also two
    buckets at a time; for a smaller optimizer placement (hfsdp) the result is written to
    the front of each buffer. ``grads`` are views of the buffers (on a SimMesh, ragged Flat
    pieces are copies: ranks' pieces start at different offsets).

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp_outer": 2, "dp_inner": 2})
        >>> spec = fh.hsdp(mesh, "dp_outer", "dp_inner")
        >>> mg = fh.MainGrad(spec, like={"w": torch.zeros(6)})
        >>> for i, last in fh.microbatches(2):
        ...     mg.accumulate({"w": torch.ones(2, 2, 6, dtype=torch.bfloat16)}, last=last)
        >>> mg.state, mg.grads["w"].dtype, fh.gather(mg.grads, spec)["w"][0, 0].tolist()
        ('final', torch.float32, [2.0, 2.0, 2.0, 2.0, 2.0, 2.0])
        >>> mg.zero_grad(); mg.grads is None
        True
    """

    def __init__(
        self,
        spec: Any,
        like: Any,
        *,
        dtype: torch.dtype = torch.float32,
        reduce_dtype: torch.dtype | None = None,
        persistent: bool = True,
    ):
        check_bool("persistent", persistent)
        for name, d in (("dtype", dtype), ("reduce_dtype", reduce_dtype or dtype)):
            if not isinstance(d, torch.dtype) or not d.is_floating_point:
                raise TypeError(f"MainGrad: {name} must be a floating torch.dtype; got {d!r}")
        leaves, treedef, paths = flatten(like, "like")
        specs, units = resolve_specs(spec, treedef, "like")
        if not leaves:
            raise ValueError("MainGrad: like has no tensor leaves")
        self.mesh = specs[0].mesh
        #: where this MainGrad was made (the first frame outside the library), for errors
        self.made_at = _made_at()
        shapes = _full_shapes(leaves, paths, treedef=treedef, specs=specs)
        self.dtype, self.reduce_dtype = dtype, reduce_dtype or dtype
        meta = TreeMeta(
            treedef=treedef,
            shapes=shapes,
            dtypes=(dtype,) * len(leaves),
            devices=tuple(x.device for x in leaves),
            specs=specs,
            units=units,
            kinds=tuple(x.dtype for x in leaves),
        )
        self.plan: Plan = get_plan(meta, paths)
        self.persistent = persistent
        self._allocate()
        # made on the first accumulate of raw gradients: units adding into the MainGrad in
        # backward (gathered(into=...)) pack their own buffers and never need them
        self._scratch: dict | None = None
        self._state = "accumulating"
        # per bucket: holds nothing of this step yet (the next write overwrites instead of adding)
        self._fresh = [True] * len(self._buffers)
        self._empty = True  # grads are None: nothing was accumulated since zero_grad()
        self._checked: tuple | None = None  # metadata of the last gradient tree that passed
        self._deferred = self._start_deferred()

    def _start_deferred(self) -> Deferred:
        """The deferred reductions that gathered units start in backward (begin_microbatch),
        and their error feedback where a spec compresses with it: per bucket, what rounding
        lost (fp32 at the gradient placement, zeros at first), kept across steps in
        ``_residuals`` (None without feedback)."""
        self._residuals = None
        if any(s.outer_compress and s.outer_compress.error_feedback for s in self.plan.specs):
            batch = self.mesh.batch_shape
            self._residuals = [
                torch.zeros((*batch, p["gradient"].length), device=bucket.device)
                for bucket, p in zip(self.plan.buckets, self.plan.placed)
            ]
        return Deferred(
            self.plan,
            self._buffers,
            reduce_dtype=self.reduce_dtype,
            mesh=self.mesh,
            depth=DEPTH,
            residual=None if self._residuals is None else engine.Residual(self._residuals),
        )

    def _allocate(self) -> None:
        """The buffers, one per bucket at the gradient placement (released at once with
        ``persistent=False``: each bucket takes its memory when first written)."""
        batch = self.mesh.batch_shape
        self._buffers = [
            torch.zeros((*batch, placed["gradient"].length), dtype=self.dtype, device=bucket.device)
            for bucket, placed in zip(self.plan.buckets, self.plan.placed)
        ]
        self._nbytes = [buf.untyped_storage().nbytes() for buf in self._buffers]
        self._alive = [True] * len(self._buffers)  # a bucket's memory is held
        if not self.persistent:
            self._release()

    # -- public ---------------------------------------------------------------------------

    @property
    def state(self) -> str:
        """``"accumulating"`` (Partial on deferred axes) or ``"final"`` (optimizer placement)."""
        return self._state

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The flat buffers, one per bucket (``(*batch, length)``). With
        ``persistent=False`` a bucket released by ``zero_grad()`` holds no memory (its tensor
        has an empty storage) until the step writes it."""
        return list(self._buffers)

    @property
    def grads(self) -> Any:
        """Local gradient shards: views of the buffers, or None after ``zero_grad()``."""
        if self._empty:
            return None
        self._deferred.land_all()
        self._zero_fresh()
        role = "optimizer" if self._state == "final" else "gradient"
        bufs = [buf[..., : p[role].length] for buf, p in zip(self._buffers, self.plan.placed)]
        leaves = self.plan.unpack(bufs, role)
        tag(leaves, self.plan, role, kind="final" if self._state == "final" else "accumulating")
        return optree.tree_unflatten(self.plan.treedef, leaves)

    @property
    def residual(self) -> Any:
        """The error feedback of a compressed outer reduction (``outer_compress`` with
        ``error_feedback=True``): what rounding lost, per rank, as a tree like :attr:`grads`
        at the gradient placement (fp32), added into the next step's reduction. Kept by
        ``zero_grad()``, saved by :meth:`local_state_dict` and ``fh.state_dict``. None without
        error feedback."""
        if self._residuals is None:
            return None
        self._deferred.land_all()
        leaves = self.plan.unpack(list(self._residuals), "gradient", torch.float32)
        return optree.tree_unflatten(self.plan.treedef, leaves)

    @torch.compiler.disable  # under torch.compile: run eagerly, a clean graph break
    def accumulate(
        self, grads: Any, *, last: bool, at: str = "input", check_finite: bool = False
    ) -> None:
        """Reduce one microbatch's per-rank gradients into the buffers.

        Args:
            grads: per-rank full gradients with the structure and shapes of ``like`` (on a
                SimMesh with the mesh shape in front), any floating dtype.
            last: keyword-only, required: True on the step's final microbatch, which then
                reduces the deferred axes in place to the optimizer placement.
            at: ``"input"`` (default): raw gradients, Partial on every DP axis.
                ``"gradient"``: local shards already at the gradient placement (what
                ``torch.func.grad`` returns through :func:`gathered` units): they are added
                into the buffers with no communication until ``last``.
            check_finite: raise ValueError naming the first leaf holding NaN or Inf (and the
                ranks), on every rank, before any collective; the buffers are left as they
                were. One tiny all-gather per call on a DistMesh.

        Returns:
            None; read the result from :attr:`grads`.
        """
        plan, mesh = self.plan, self.mesh
        leaves, treedef, paths = flatten(grads, "grads")
        refuse_vmap(leaves, "MainGrad.accumulate")
        with agreement(plan.specs, "MainGrad.accumulate") as agreed:
            refuse_tracked(leaves, paths, "MainGrad.accumulate")
            check_bool("last", last, " (True on the final microbatch)")
            check_bool("check_finite", check_finite)
            if at not in engine.AT:
                raise ValueError(
                    f"MainGrad.accumulate: at must be 'input' or 'gradient'; got {at!r}"
                )
            self._check_accumulating("grads")
            if treedef != plan.treedef:
                raise structure_error(plan.treedef, grads, "grads", what="MainGrad's like tree")
            self._check(leaves, paths, at)
            options = (
                f"reduce_dtype={self.reduce_dtype}",
                f"check_finite={check_finite}",
                f"at={at}",
            )
            nonfinite = nonfinite_index(leaves, len(mesh.batch_shape)) if check_finite else None
            # on the last microbatch, the step's unit calls too (before its gradient is final)
            check = dict(options=options, nonfinite=nonfinite, defer=True, units=last is True)
            agreed.check(plan, paths, last=last, **check)

        self._add(leaves, at, agreed.settle)
        if last:
            self._finish()

    def _add(self, leaves: list, at: str, gate: Any) -> None:
        """Reduce ``leaves`` (at role ``at``) to the gradient placement into the buffers,
        DEPTH buckets in flight; a bucket that holds nothing of this step is overwritten.
        ``gate``: the call's agreement, settled before the first collective and before any
        buffer changes."""
        plan = self.plan

        def done(b: int, chunk: torch.Tensor) -> None:
            if self._fresh[b]:
                self._hold(b)
                self._buffers[b].copy_(chunk)
            else:
                self._buffers[b].add_(chunk)
            self._fresh[b] = False

        if at == "input":
            pack = lambda b: self._pack(b, leaves)  # noqa: E731
            legs = [("input", "gradient")]
            engine.start(
                plan, pack, legs, depth=DEPTH, wire=self.reduce_dtype, sink=done, gate=gate
            )
        else:  # already reduced: one bucket's chunk at a time, no communication
            gate()
            for b in range(len(plan.buckets)):
                done(b, plan.pack(b, leaves, "gradient"))
        self._empty = False  # reached only once every rank agreed

    def _check(self, leaves: list, paths: tuple[str, ...], at: str) -> None:
        """The per-leaf checks, once per distinct leaf metadata (not once per call)."""
        try:
            metas = (at, *((x.shape, x.dtype, x.device, x.layout) for x in leaves))
        except AttributeError:
            metas = None
        if metas is not None and metas == self._checked:
            return
        check_tensors(leaves, paths, self.mesh, floating=True, batched=True)
        plan, role = self.plan, "input" if at == "input" else "gradient"
        for i, (leaf, path) in enumerate(zip(leaves, paths)):
            want = plan.local_shapes[role][i]
            if tuple(leaf.shape) != want:
                shape = plan.shapes[i]
                raise ValueError(
                    f"{path}: expected per-rank shape {shape} (as in like)"
                    + ("" if at == "input" else f", local shape {want} at the gradient placement")
                    + f"; got {tuple(leaf.shape[len(self.mesh.batch_shape) :])}"
                )
        self._checked = metas

    def begin_microbatch(self, *, last: bool) -> None:
        """Declare the microbatch whose backward comes next, for :func:`gathered` units with
        ``into=self`` (:func:`microbatches` with ``into=`` calls this for you).

        With ``last=True``, each unit's deferred reduction (the ``dp_outer`` all-reduce of
        HSDP) is issued during that backward, as soon as the unit's gradient of the step is
        complete (the backward of every call of the unit since this declaration has added
        its share), so that it overlaps the backward of the units before it, as FSDP2 does;
        :meth:`finish` then waits for those and reduces any unit not reached. Without a
        declaration, :meth:`finish` issues every deferred reduction itself. After a unit's
        reduction was issued, another gradient for it in the same step is refused.

        Every rank must declare alike. The declaration joins the step's record of unit calls,
        and the ranks agree on that record here with ``last=True``, before any deferred
        reduction is issued: ranks whose unit calls so far differ raise a ``ValueError``,
        and a rank that does not declare ``last=True`` leaves the others waiting, until the
        mesh's timeout (``CollectiveError``). Under ``fh.validation("strict")`` the ranks
        agree on every declaration, so a rank that declares otherwise raises
        :class:`~functional_hsdp.base.errors.UnitsDiffer` on every rank at once. This rank's own
        checks (a finished step not zeroed) run inside that agreement, so its error is every
        rank's; a ``last`` that is not a bool is refused on its rank alone (it cannot know
        whether to join), and the others wait until the timeout.

        Args:
            last: keyword-only: True before the step's final microbatch.
        """
        # the declaration decides when the deferred reductions are issued: it joins the
        # step's record of unit calls, which the ranks agree on before any is issued; this
        # rank's own checks run inside that agreement (a failure there is every rank's)
        declare = functools.partial(self._declare, last)
        if validate.current_mode() == "strict":  # every declaration, at once
            agree_on_unit_collective(
                self.plan.specs,
                self.plan,
                what="MainGrad.begin_microbatch",
                paths=paths_of(self.plan.treedef, "grads"),
                options=(f"last={last}",),
                unit="MainGrad.begin_microbatch",
                op="deferred reduction",
                local=declare,
            )
        elif last is True:  # the unit calls so far and this declaration (a rank without it:
            units_of(self).agree("MainGrad.begin_microbatch", local=declare)  # a wait)
        else:
            declare()
        self._deferred.begin(last)

    def _declare(self, last: bool) -> None:
        """begin_microbatch's own checks, and the declaration into the mesh's unit log."""
        check_bool("last", last, " (True before the final microbatch)")
        self._check_accumulating("begin_microbatch")
        unit_log(self.mesh).record("MainGrad.begin_microbatch", f"last={last}")

    @torch.compiler.disable
    def finish(self) -> None:
        """Reduce the deferred axes now (what ``accumulate(..., last=True)`` does after its
        add): for gradients that :func:`~functional_hsdp.gathered` units with ``into=self``
        added during backward. The reductions already issued in that backward (see
        :meth:`begin_microbatch`) are only waited for. Every rank must call it."""
        with agreement(self.plan.specs, "MainGrad.finish") as agreed:
            if self._state == "final":
                raise ValueError("MainGrad.finish: the step is finished already; call zero_grad()")
            if self._empty:
                raise ValueError("MainGrad.finish: no gradient was accumulated this step")
            # the step's gathered-unit calls too: ranks that ran them otherwise (order,
            # options, dtypes) would hand the optimizer a wrong gradient
            agreed.check(self.plan, paths_of(self.plan.treedef, "grads"), defer=True, units=True)
        self._finish(agreed.settle)

    def _check_accumulating(self, what: str, by: str | None = None) -> None:
        if self._state != "final":
            return
        if by is None:
            raise ValueError(
                f"{what}: this MainGrad holds the final gradients of a finished step; call "
                "zero_grad() before accumulating the next step"
            )
        raise ValueError(
            f"{what}: the backward of {by} would add into {self!r}, made at {self.made_at}, "
            "whose step is finished (finish() ran; it holds that step's final gradients): "
            "call zero_grad() on it before the next step, or pass this call's MainGrad as "
            "its into="
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start a new step, with ``torch.optim``'s meaning of ``set_to_none``. The
        :attr:`residual` of a compressed outer reduction is kept: it belongs to the next step.

        Args:
            set_to_none: True: :attr:`grads` is None until the next ``accumulate``, which
                overwrites the buffers (kept, never reallocated; with ``persistent=False``
                their memory is released now and taken again when the step writes each
                bucket). False: the buffers are zeroed and :attr:`grads` are zeros.
        """
        self._deferred.land_all()
        self._deferred.reset()
        if set_to_none:
            self._fresh = [True] * len(self._buffers)
            self._empty = True
            if not self.persistent:
                self._release()
        else:
            for b, buf in enumerate(self._buffers):
                self._hold(b)
                buf.zero_()
            self._fresh = [False] * len(self._buffers)
            self._empty = False
        self._state = "accumulating"

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's copy of the buffers and state, valid mid-accumulation (resume loses
        nothing): for ``torch.save`` per rank and :meth:`load_local_state_dict` on the same
        mesh and spec. ``fh.state_dict(mg)`` is the mesh-independent checkpoint."""
        self._deferred.land_all()
        return {
            "layout": self.buffer_signature(),  # the key's old name: saved copies have it
            "state": self._state,
            "fresh": list(self._fresh),
            "empty": self._empty,
            "buffers": [
                buf.detach().clone() if alive else torch.zeros_like(buf)
                for buf, alive in zip(self._buffers, self._alive)
            ],
            "residuals": None if self._residuals is None else [r.clone() for r in self._residuals],
        }

    def load_local_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`local_state_dict` into this MainGrad's buffers (same storage).

        Raises ValueError if it was saved from another spec, tree, mesh or dtype.
        """
        mine = self.buffer_signature()
        theirs = state_dict.get("layout")
        if not isinstance(theirs, dict) or theirs.keys() != mine.keys():
            raise ValueError("load_local_state_dict: not a MainGrad local_state_dict")
        for key in mine:
            if theirs[key] != mine[key]:
                raise ValueError(
                    f"state_dict['layout'][{key!r}]: saved with another {key}: {theirs[key]!r}; "
                    f"this MainGrad has {mine[key]!r}"
                )
        buffers = state_dict["buffers"]
        for b, (buf, saved) in enumerate(zip(self._buffers, buffers)):
            if saved.shape != buf.shape or saved.dtype != buf.dtype:
                raise ValueError(
                    f"state_dict['buffers'][{b}]: has shape {tuple(saved.shape)} {saved.dtype}; "
                    f"expected {tuple(buf.shape)} {buf.dtype}"
                )
        residuals = self._loaded_residuals(state_dict.get("residuals"))
        for b, (buf, saved) in enumerate(zip(self._buffers, buffers)):
            self._hold(b)
            buf.copy_(saved)
        if residuals is not None:
            self._residuals[:] = residuals
        if state_dict["state"] not in ("accumulating", "final"):
            raise ValueError(f"load_local_state_dict: unknown state {state_dict['state']!r}")
        fresh = state_dict.get("fresh")
        if not (isinstance(fresh, list) and len(fresh) == len(self._buffers)):
            raise ValueError(
                "load_local_state_dict: not a MainGrad local_state_dict (no per-bucket 'fresh')"
            )
        self._state, self._fresh = state_dict["state"], [bool(f) for f in fresh]
        self._empty = bool(state_dict.get("empty", all(self._fresh)))

    def _loaded_residuals(self, saved: Any) -> list[torch.Tensor] | None:
        """The residuals of a state dict, checked against this MainGrad's (copies)."""
        if self._residuals is None:
            return None
        if saved is None:  # a state dict of a MainGrad without error feedback
            raise ValueError(
                "load_local_state_dict: this MainGrad feeds back a compressed reduction's "
                "error; the state_dict holds no 'residuals'"
            )
        for b, (mine, r) in enumerate(zip(self._residuals, saved)):
            if r.shape != mine.shape:
                raise ValueError(
                    f"state_dict['residuals'][{b}]: has shape {tuple(r.shape)}; expected "
                    f"{tuple(mine.shape)}"
                )
        return [r.detach().to(torch.float32, copy=True) for r in saved]

    def state_dict(self) -> dict[str, Any]:
        """Deprecated: :meth:`local_state_dict` (this rank's copy; ``fh.state_dict(mg)`` is
        the mesh-independent checkpoint)."""
        _deprecated("state_dict", "local_state_dict")
        return self.local_state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Deprecated: :meth:`load_local_state_dict`."""
        _deprecated("load_state_dict", "load_local_state_dict")
        self.load_local_state_dict(state_dict)

    def layout(self) -> dict[str, Any]:
        """Deprecated: :meth:`buffer_signature` (elsewhere "layout" is where leaves sit in
        the buckets; this is what the buffers depend on)."""
        _deprecated("layout", "buffer_signature", why=_SIGNATURE)
        return self.buffer_signature()

    # -- checkpoints: functional_hsdp.io.checkpoint's protocol, its bodies in maingrad_state --

    def __fh_state_dict__(self, spec: Any = None, *, like: Any = None) -> dict[str, Any]:
        """This MainGrad in a mesh-independent checkpoint (``fh.state_dict(mg)``): ``{"state":
        "final" | "empty", "grads": {key: DTensor}}`` (and ``"residual"``, per rank, with
        error feedback). Mid-accumulation it is refused. ``like`` is not needed."""
        return maingrad_state.checkpoint_state(self, spec)

    def __fh_empty_state_dict__(self, spec: Any = None) -> dict[str, Any]:
        """Placeholders for ``dcp.load`` (``fh.empty_state_dict(mg)``): a final state."""
        return maingrad_state.empty_checkpoint_state(self, spec)

    def __fh_load_state_dict__(self, state: dict, spec: Any = None, *, name: str) -> MainGrad:
        """Load what :meth:`__fh_state_dict__` saved into this MainGrad (``fh.load_state_dict(
        state, spec, mg)``), on any mesh: its final gradients (or zeroed), and returns it."""
        return maingrad_state.load_checkpoint(state, spec, self, name=name)

    def __repr__(self) -> str:
        n = sum(buf.numel() for buf in self._buffers)
        return (
            f"MainGrad({len(self.plan.shapes)} leaves, {len(self._buffers)} buckets, "
            f"{n} x {self.dtype}, state={self._state!r})"
        )

    # -- internals ------------------------------------------------------------------------

    def _packing_buffers(self) -> dict[tuple[torch.device, int], torch.Tensor]:
        """DEPTH packing buffers per device, reused: bucket b packs into the one bucket
        b - DEPTH used, which is free by then. Each is the size of that device's largest
        bucket."""
        batch = math.prod(self.mesh.batch_shape)
        longest: dict[torch.device, int] = {}
        for bucket in self.plan.buckets:
            longest[bucket.device] = max(longest.get(bucket.device, 0), bucket.padded)
        return {
            (device, i): torch.empty(batch * n, dtype=self.reduce_dtype, device=device)
            for device, n in longest.items()
            for i in range(DEPTH)
        }

    @torch.no_grad()
    def _pack(self, b: int, leaves: list[torch.Tensor]) -> torch.Tensor:
        """Bucket ``b`` packed, in the wire dtype, into packing buffer ``b % DEPTH`` (one copy
        per leaf, casting)."""
        bucket, batch = self.plan.buckets[b], self.mesh.batch_shape
        if bucket.shard is not None:  # rank-major: each leaf's chunks go to every block
            return pack_shard_full(bucket, leaves, batch).to(self.reduce_dtype)
        if self._scratch is None:
            self._scratch = self._packing_buffers()
        scratch = self._scratch[(bucket.device, b % DEPTH)]
        out = scratch.narrow(0, 0, math.prod(batch) * bucket.padded).view(*batch, bucket.padded)
        # one C++ call copies (and casts) every leaf, and the zeros between and after them
        parts = [x.reshape(*batch, -1) for x in bucket.take(leaves)]
        torch.cat(spaced(bucket, parts, batch, dtype=self.reduce_dtype), dim=-1, out=out)
        return out

    def _zero_fresh(self) -> None:
        """Buckets no gradient reached this step (a unit never used) hold zeros."""
        for b, fresh in enumerate(self._fresh):
            if fresh:
                self._hold(b)
                self._buffers[b].zero_()
                self._fresh[b] = False

    def _add_chunks(self, buckets: list[int], chunks: list[torch.Tensor]) -> None:
        """Add a unit's reduced chunks (at the gradient placement) into ``buckets``, through
        the ``accumulate_`` custom op (``UnitSink.add``'s write, checked there): a bucket
        that holds nothing of this step is overwritten."""
        for b, chunk in zip(buckets, chunks):
            self._hold(b)
            _accumulate(self._buffers[b], chunk, self._fresh[b])
            self._fresh[b] = False
        self._empty = False

    def _hold(self, b: int) -> None:
        """Bucket ``b``'s memory, taken again if released (its content is then written
        whole: a released bucket is always fresh)."""
        if not self._alive[b]:
            self._buffers[b].untyped_storage().resize_(self._nbytes[b])
            self._alive[b] = True

    def _release(self) -> None:
        """persistent=False: every bucket's memory given back (FSDP2 frees its sharded
        gradients likewise when the optimizer zeroes them)."""
        for b, buf in enumerate(self._buffers):
            buf.untyped_storage().resize_(0)
            self._alive[b] = False

    def _finish(self, gate: Any = None) -> None:
        """Reduce the deferred axes of each bucket in place, DEPTH buckets at a time: the
        extra memory stays within DEPTH buckets' reductions however many buckets there are.
        Buckets whose reduction was issued in backward are only waited for. ``gate``: the
        call's agreement, if not settled yet."""
        if gate is not None:
            gate()
        self._deferred.land_all()
        self._zero_fresh()
        self._deferred.finish()
        self._state = "final"
        self._deferred.reset()

    def buffer_signature(self) -> dict[str, Any]:
        """What this MainGrad's buffers depend on (mesh, tree, shapes, dtypes, specs, buffer
        shapes), as plain data: a :meth:`local_state_dict` made elsewhere loads only if it
        agrees (it is saved there under the key ``"layout"``, its old name, kept so that saved
        copies still load)."""
        plan = self.plan
        return {  # in the order a mismatch is reported: the most telling first
            "mesh": list(zip(self.mesh.axis_names, self.mesh.sizes)),
            "tree": str(plan.treedef),
            "shapes": [list(s) for s in plan.shapes],
            "kinds": [str(k) for k in plan.meta.kinds],
            "specs": sorted({repr(s) for s in plan.specs}),
            "dtype": str(self.dtype),
            "reduce_dtype": str(self.reduce_dtype),
            "buffers": [list(buf.shape) for buf in self._buffers],
        }


def _full_shapes(leaves: list, paths: tuple[str, ...], *, treedef: Any, specs: tuple) -> tuple:
    """The per-rank full shapes of ``like``'s leaves: their plan's when ``like`` are the
    shards ``fh.shard`` made of this tree and specs, else the leaves' own (checked)."""
    made = result_state(leaves)  # like = shards: their full shapes are their plan's
    if made is not None and (made.kind, made.plan.treedef, made.plan.specs) == (
        "weights",
        treedef,
        specs,
    ):
        return made.plan.shapes
    check_tensors(leaves, paths, specs[0].mesh, floating=True, batched=False)
    return tuple(tuple(x.shape) for x in leaves)


def units_of(mg: MainGrad) -> UnitSink:
    """What gathered units with ``into=mg`` may do to ``mg``: its private interface for
    :mod:`functional_hsdp.units` (not the public API; :class:`UnitSink`), made per use (it
    holds the MainGrad's parts, and the MainGrad does not hold it)."""
    return UnitSink(mg.plan, mg._deferred, check=mg._check_accumulating, write=mg._add_chunks)


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package root


def _made_at() -> str:
    """``file:line`` of the first caller outside this package (where a user made a
    MainGrad)."""
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(
        _PACKAGE + os.sep
    ):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


@torch.library.custom_op("functional_hsdp::accumulate_", mutates_args=("buf",))
def _accumulate(buf: torch.Tensor, chunk: torch.Tensor, overwrite: bool) -> None:
    """``buf[..., :n] += chunk`` (or ``=`` when ``overwrite``), n the chunk's length. A custom op
    declaring its mutation: inside a backward under ``torch.func.grad`` an ``add_`` into a
    tensor made outside the transform is refused ("mutating a captured Tensor")."""
    part = buf.narrow(-1, 0, chunk.shape[-1])
    if overwrite:
        part.copy_(chunk)
    else:
        part.add_(chunk)


@_accumulate.register_fake
def _(buf: torch.Tensor, chunk: torch.Tensor, overwrite: bool) -> None:
    return None


def microbatches(
    items: int | Iterable[T], into: MainGrad | None = None
) -> Iterator[tuple[int | T, bool]]:
    """Yield ``(item, last)`` so a loop cannot forget the ``last`` flag.

    Args:
        items: a count M (yields ``(i, last)`` for i in range(M)) or any iterable of
            microbatches (yields ``(batch, last)``, looking one item ahead).
        into: a :class:`MainGrad` that :func:`gathered` units add into: before each item,
            ``into.begin_microbatch(last=last)``, so that the last microbatch's backward
            issues each unit's deferred reduction as soon as the unit is done (the ranks
            agree on their unit calls before it: see :meth:`MainGrad.begin_microbatch`).

    Returns:
        An iterator of ``(item, last)`` pairs; ``last`` is True exactly once, at the end.

    Example:
        >>> import functional_hsdp as fh
        >>> list(fh.microbatches(3))
        [(0, False), (1, False), (2, True)]
        >>> list(fh.microbatches("ab"))
        [('a', False), ('b', True)]
    """
    if into is not None and not isinstance(into, MainGrad):
        raise TypeError(f"microbatches: into must be a MainGrad or None; got {type(into).__name__}")
    if isinstance(items, int):
        if items < 1:
            raise ValueError(f"microbatches: need at least one microbatch; got {items}")
        items = range(items)
    iterator = iter(items)
    try:
        current = next(iterator)
    except StopIteration:
        raise ValueError("microbatches: the iterable is empty") from None
    for upcoming in iterator:
        if into is not None:
            into.begin_microbatch(last=False)
        yield current, False
        current = upcoming
    if into is not None:
        into.begin_microbatch(last=True)
    yield current, True


_LOCAL_COPY = (
    "this rank's copy; fh.state_dict(mg) and fh.load_state_dict are the mesh-independent checkpoint"
)
_SIGNATURE = "what the buffers depend on; local_state_dict keeps it under the key 'layout'"


def _deprecated(old: str, new: str, *, why: str = _LOCAL_COPY) -> None:
    warnings.warn(
        f"MainGrad.{old} is deprecated: use mg.{new}() ({why})",
        DeprecationWarning,
        stacklevel=3,
    )

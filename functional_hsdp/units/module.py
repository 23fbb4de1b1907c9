"""Existing ``nn.Module`` models: :func:`shard_module` and :func:`functional_call`.

People bring models they did not write (Hugging Face ``transformers``, torchtitan) and keep
their forward. ``shard_module`` is FSDP2's ``fully_shard`` per unit, done once: every unit
(a submodule) and the root (the parameters in no unit) becomes a unit of a spec tree, the
parameters become local shards (the master weights, in their own dtype) and the module keeps
only meta stand-ins of them (its buffers stay). ``functional_call`` is
``torch.func.functional_call`` on those shards: it runs ``model.forward`` itself, each unit
gathered just before its own forward (its docstring says in which order; tied parameters:
:func:`shard_module`).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.utils.stateless import _reparametrize_module

from ..base.cache import register
from ..spec.precision import check_mp_policy
from ..spec.specs import Spec
from ..sync.maingrad import MainGrad
from ..sync.reduce import shard
from . import Gathered
from .block import prefetch_named
from .registry import start_forward

__all__ = ["functional_call", "shard_module"]

ROOT = ""  # the root unit's key in the shards tree (the root module's name in named_modules)


@dataclass(eq=False)
class _Part:
    """One unit of a sharded module: its key (module name), its own parameters (names
    relative to it: the keys of its shards), and the root's parameters it uses. Its module
    by weak reference: a record in the registry must not keep its model alive."""

    key: str
    module_ref: weakref.ref
    spec: Spec
    names: tuple[str, ...]
    borrowed: tuple[tuple[str, str], ...] = ()  # (name in this unit, name in the root's shards)

    @property
    def module(self) -> torch.nn.Module:
        return self.module_ref()


@dataclass(eq=False)
class _Sharded:
    """What :func:`shard_module` recorded of a model."""

    root: _Part | None
    parts: list[_Part]  # the units, in the order given
    tree_spec: dict
    mp_policy: Any
    order: list[int] = field(default_factory=list)  # units in the order they ran last
    blocks: tuple | None = None  # ((into, recompute, reshard), {key: Gathered})
    active: int = 0  # functional_call calls running (the forward pre-hook's check)


class _Registry(weakref.WeakKeyDictionary):
    """model -> what :func:`shard_module` recorded of it. Weakly keyed, and a record refers
    to its model and the model's modules only weakly: an entry goes with its model."""

    def cache_clear(self) -> None:
        """For :func:`~functional_hsdp.clear_caches`: forget what the records remember beyond
        the sharding (the gathered blocks of the last options, which hold their ``MainGrad``,
        and the order the units ran in). The sharding stays: the model's parameters are
        shards now, and it is how ``functional_call`` runs the model."""
        for sharded in list(self.values()):
            sharded.blocks = None
            sharded.order = list(range(len(sharded.parts)))


_SHARDED = register(_Registry())


def shard_module(
    model: torch.nn.Module,
    spec: Spec | Callable[[torch.nn.Module], Spec],
    *,
    units: Sequence[torch.nn.Module],
    mp_policy: Any = None,
) -> tuple[dict, dict]:
    """Shard ``model``'s parameters unit by unit, as FSDP2's ``fully_shard`` per unit.

    Tied parameters: a parameter used under one unit only belongs to that unit; one used by
    several units, or by a unit and the root, belongs to the root, is gathered once for the
    whole forward and passed to each unit that uses it as an input, so its gradient is summed
    over every use before its one reduce-scatter per backward.

    Args:
        model: an ``nn.Module`` whose parameters are the same on every rank (seed alike, or
            load the same checkpoint). Its parameters are replaced by meta stand-ins (its
            buffers stay): from now on it runs through :func:`functional_call`. It is
            remembered weakly: dropped, it is freed, and what was recorded of it with it.
        spec: one :class:`Spec` (on a ``DistMesh``) for every unit, or ``unit_module ->
            Spec`` (called with ``model`` for the root).
        units: submodules of ``model``, each a unit (``fully_shard(unit)``), none inside
            another; the parameters in no unit form the root unit. Typically the decoder
            layers: ``list(model.model.layers)``.
        mp_policy: a ``torch.distributed.fsdp.MixedPrecisionPolicy`` for every unit (FSDP2's
            meaning; see :func:`~functional_hsdp.gathered`). The shards keep the
            parameters' dtype (the master weights).

    Returns:
        ``(shards, tree_spec)``: ``shards`` is ``{unit name: {parameter name within the
        unit: local shard}}`` (the root's name is ``""``), a plain pytree at the optimizer
        placement, and ``tree_spec`` the matching spec prefix tree (each entry a unit) for
        :class:`MainGrad` (``fh.MainGrad(tree_spec, like=shards)``), ``reduce_grads``,
        ``gather`` and checkpoints.

    Raises:
        TypeError / ValueError: naming the unit or parameter (a unit that is not a
        submodule, units inside each other, a meta parameter, a spec on a SimMesh).

    Example:
        >>> import torch, functional_hsdp as fh
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        >>> axes = ("dp_outer", "dp_inner")
        >>> dm = init_device_mesh("cpu", (1, 4), mesh_dim_names=axes)  # doctest: +SKIP
        >>> spec = fh.hsdp(fh.DistMesh(dm), *axes)  # doctest: +SKIP
        >>> shards, tree_spec = fh.shard_module(model, spec, units=[model[0]])  # doctest: +SKIP
        >>> sorted(shards), sorted(shards["0"])  # doctest: +SKIP
        (['', '0'], ['bias', 'weight'])
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"shard_module: model must be an nn.Module; got {type(model).__name__}")
    if model in _SHARDED:
        raise ValueError("shard_module: this model's parameters are sharded already")
    check_mp_policy(mp_policy, "shard_module")
    spec_of = spec if callable(spec) and not isinstance(spec, Spec) else (lambda _m: spec)
    owners = _owners(model, _unit_keys(model, units))
    root, parts, full = _parts(model, owners, spec_of)
    if not full:
        raise ValueError("shard_module: model has no parameters")
    tree_spec = {key: (root if key == ROOT else _by_key(parts, key)).spec for key in full}
    shards = shard(full, tree_spec)
    del full
    _to_meta(model, owners.params)
    sharded = _Sharded(
        root=root,
        parts=parts,
        tree_spec=tree_spec,
        mp_policy=mp_policy,
        order=list(range(len(parts))),
    )
    _SHARDED[model] = sharded
    model.register_forward_pre_hook(_outside_functional_call)
    return shards, tree_spec


def _unit_keys(model: torch.nn.Module, units: Sequence[torch.nn.Module]) -> list[str]:
    """The units' names in ``model``, in the order given, checked (``model`` itself left out)."""
    names = {}
    for name, m in model.named_modules(remove_duplicate=False):
        names.setdefault(id(m), name)
    keys = []
    for k, unit in enumerate(units):
        if not isinstance(unit, torch.nn.Module):
            raise TypeError(f"shard_module: units[{k}] must be an nn.Module; got {type(unit)}")
        if unit is model:
            continue  # the root is a unit anyway
        if id(unit) not in names:
            raise ValueError(
                f"shard_module: units[{k}] ({type(unit).__name__}) is not a submodule of model"
            )
        keys.append(names[id(unit)])
    for a in keys:
        for b in keys:
            if a != b and b.startswith(a + "."):
                raise NotImplementedError(
                    f"shard_module: unit {b!r} is inside unit {a!r}; nested units are not "
                    "supported (give the inner ones, or the outer one)"
                )
    if len(set(keys)) != len(keys):
        raise ValueError("shard_module: a unit is given twice")
    return keys


@dataclass(eq=False)
class _Owners:
    """A model's parameters by id (a tied one once), each one's names, and its owning unit."""

    keys: list[str]  # the units, in the order given
    params: dict[int, torch.nn.Parameter]
    names: dict[int, list[str]]
    owner: dict[int, str]  # the one unit every name of the parameter lies under, else the root

    def own(self, key: str) -> dict[str, torch.Tensor]:
        """Unit ``key``'s own parameters (detached), by their names relative to it."""
        cut = len(key) + 1 if key else 0
        return {
            self.names[pid][0][cut:]: self.params[pid].detach()
            for pid in self.names
            if self.owner[pid] == key
        }

    def borrowed(self, key: str) -> tuple[tuple[str, str], ...]:
        """The root's parameters unit ``key`` uses: (name in the unit, name in the root)."""
        return tuple(
            (n[len(key) + 1 :], self.names[pid][0])
            for pid in self.names
            if self.owner[pid] == ROOT
            for n in self.names[pid]
            if n.startswith(key + ".")
        )


def _owners(model: torch.nn.Module, keys: list[str]) -> _Owners:
    """Each parameter of ``model``, its names and owning unit; a meta parameter is refused."""
    fqns: dict[int, list[str]] = {}
    params: dict[int, torch.nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        fqns.setdefault(id(p), []).append(name)
        params[id(p)] = p
    owner: dict[int, str] = {}
    for pid, pnames in fqns.items():
        if params[pid].is_meta:
            raise ValueError(
                f"shard_module: parameter {pnames[0]!r} is on the meta device; materialize the "
                "model (the same values on every rank) before sharding it"
            )
        under = [k for k in keys if all(n.startswith(k + ".") for n in pnames)]
        owner[pid] = under[0] if under else ROOT
    return _Owners(keys=keys, params=params, names=fqns, owner=owner)


def _parts(
    model: torch.nn.Module, owners: _Owners, spec_of: Callable
) -> tuple[_Part | None, list[_Part], dict[str, dict[str, torch.Tensor]]]:
    """(the root's part or None, the units' parts, each part's full weights by unit key)."""
    parts = []
    full: dict[str, dict[str, torch.Tensor]] = {}
    for key, module in [(k, model.get_submodule(k)) for k in owners.keys]:
        own = owners.own(key)
        borrowed = owners.borrowed(key)
        if not own:  # nothing to gather: it runs as it is (on the root's weights, if any)
            continue
        full[key] = own
        unit_spec = _spec(spec_of, module, key)
        part = _Part(
            key=key,
            module_ref=weakref.ref(module),
            spec=unit_spec,
            names=tuple(own),
            borrowed=borrowed,
        )
        parts.append(part)
    root_own = owners.own(ROOT)
    root = None
    if root_own:
        root_spec = _spec(spec_of, model, "the root")
        root = _Part(key=ROOT, module_ref=weakref.ref(model), spec=root_spec, names=tuple(root_own))
        full[ROOT] = root_own
    return root, parts, full


def _to_meta(model: torch.nn.Module, params: dict[int, torch.nn.Parameter]) -> None:
    """Replace ``model``'s parameters by meta stand-ins (ties kept: one per parameter)."""
    stand_ins = {
        pid: torch.nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
        for pid, p in params.items()
    }
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[name] = stand_ins[id(p)]


def _spec(spec_of: Callable, module: torch.nn.Module, what: str) -> Spec:
    s = spec_of(module)
    if not isinstance(s, Spec):
        raise TypeError(f"shard_module: the spec of {what!r} must be a Spec; got {type(s)}")
    if s.mesh.batch_shape:
        raise NotImplementedError(
            "shard_module: the model's own forward runs on one rank's tensors, so its spec "
            "must be on a DistMesh (on a SimMesh, write the units with fh.gathered and "
            "fh.per_rank)"
        )
    return s


def _by_key(parts: list[_Part], key: str) -> _Part:
    return next(p for p in parts if p.key == key)


def _outside_functional_call(module: torch.nn.Module, args: Any) -> None:
    sharded = _SHARDED.get(module)
    if sharded is not None and not sharded.active:
        raise RuntimeError(
            f"{type(module).__name__}: its parameters are shards now (fh.shard_module); run it "
            "with fh.functional_call(model, shards, args, kwargs)"
        )


def functional_call(
    model: torch.nn.Module,
    shards: dict,
    args: Any = (),
    kwargs: dict | None = None,
    *,
    into: MainGrad | None = None,
    recompute: bool = False,
    reshard_after_forward: bool = True,
) -> Any:
    """``model(*args, **kwargs)`` on local shards: ``torch.func.functional_call``'s meaning,
    with each unit all-gathered just before its own forward.

    Pure in ``shards`` and differentiable under ``torch.func.grad`` / ``vjp`` /
    ``grad_and_value`` and plain autograd: the gradient with respect to ``shards`` is each
    unit's gradient at the gradient placement (for ``reduce_grads(..., at="gradient")`` or
    ``MainGrad.accumulate(..., at="gradient")``), or zero with ``into=``, where it was added
    into the ``MainGrad`` during backward. Every rank must make the same calls. It runs
    ``model.forward`` itself, with

    - the root unit all-gathered first and kept until its backward (FSDP2 does not reshard
      its root either): the embedding, a tied head, final norms;
    - each unit gathered just before its own forward (through :func:`~functional_hsdp.gathered`:
      its forward replaced, for the call, by the gathered call of the original one), the next
      unit prefetched in the order the units ran last time (the order given, the first time);
    - its gradient reduce-scattered in backward, into a ``MainGrad`` (``into=``) or returned
      at the gradient placement (for ``reduce_grads(..., at="gradient")``).

    Args:
        model: a model :func:`shard_module` sharded.
        shards: its shards (``shard_module``'s first result, or the same tree after an
            in-place optimizer step; with ``into=``, the very tensors ``shard_module`` made).
        args: positional arguments of ``model.forward`` (a tuple, or one value).
        kwargs: keyword arguments of ``model.forward``.
        into: a :class:`MainGrad` made with ``shard_module``'s ``tree_spec`` (``like=shards``):
            each unit's reduce-scattered gradient is added into it in backward. Declare the
            microbatches to it (``fh.microbatches(batches, into=mg)``) so that the last one's
            backward issues each unit's deferred reduction as soon as it can.
        recompute: False (default, FSDP2 without activation checkpointing) or True (per-unit
            activation checkpointing); see :func:`~functional_hsdp.gathered`.
        reshard_after_forward: as FSDP2's, for the units (the root is never resharded).

    Returns:
        What ``model.forward`` returns.

    Example:
        >>> layers = list(model.model.layers)  # doctest: +SKIP
        >>> shards, tree_spec = fh.shard_module(model, spec, units=layers)  # doctest: +SKIP
        >>> mg = fh.MainGrad(tree_spec, like=shards)  # doctest: +SKIP
        >>> def loss_fn(s, ids):  # doctest: +SKIP
        ...     return fh.functional_call(model, s, (ids,), {"labels": ids}, into=mg).loss
        >>> for ids, last in fh.microbatches(batches, into=mg):  # doctest: +SKIP
        ...     torch.func.grad(loss_fn)(shards, ids)
        >>> mg.finish()  # doctest: +SKIP
    """
    sharded = _SHARDED.get(model) if isinstance(model, torch.nn.Module) else None
    if sharded is None:
        raise TypeError(
            "functional_call: model must be a module sharded by fh.shard_module; got "
            f"{type(model).__name__}"
        )
    _check_options(into, recompute=recompute, reshard_after_forward=reshard_after_forward)
    _check_units(sharded, shards)
    args = args if isinstance(args, tuple) else (args,)
    kwargs = {} if kwargs is None else kwargs
    blocks = _blocks(sharded, into=into, recompute=recompute, reshard=reshard_after_forward)
    order, ran = sharded.order, []
    start_forward()  # the model's forward begins: its units are one chain
    sharded.active += 1
    try:
        params = _root_weights(sharded, shards, blocks)
        with contextlib.ExitStack() as stack:
            for k, part in enumerate(sharded.parts):
                forward = _unit_forward(
                    k, sharded, shards=shards, blocks=blocks, params=params, ran=ran
                )
                stack.enter_context(_forward_replaced(part, forward))
            stack.enter_context(_reparametrize_module(model, params, tie_weights=True))
            out = model(*args, **kwargs)
    finally:
        sharded.active -= 1
    if ran and ran != order:
        sharded.order = ran  # prefetch in the order the units run
    return out


def _check_options(into: Any, **flags: Any) -> None:
    """``into`` is a MainGrad or None, and each flag a bool."""
    if into is not None and not isinstance(into, MainGrad):
        raise TypeError(
            f"functional_call: into must be a MainGrad or None; got {type(into).__name__}"
        )
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise TypeError(f"functional_call: {name} must be a bool; got {flag!r}")


def _root_weights(sharded: _Sharded, shards: dict, blocks: dict) -> dict:
    """The root's full weights ({} without a root), the first unit's all-gather issued first."""
    root, order = sharded.root, sharded.order
    if root is None:
        return {}
    root_block = blocks[ROOT]
    key = sharded.parts[order[0]].key if order else None
    # the first unit's all-gather is issued before the root's is waited (where they gather
    # alike: a block prefetches with its own spec)
    if key is not None and blocks[key].spec == root_block.spec:
        prefetch_named(root_block, shards[key], f"shards[{key!r}]")
    return root_block(shards[ROOT])


def _check_units(sharded: _Sharded, shards: dict) -> None:
    """``shards`` is a dict of exactly the units, each unit's a dict of exactly its
    parameters, each a tensor: errors name the unit and the parameter (a wrong shape or dtype
    is named so by the unit's own lookup)."""
    if not isinstance(shards, dict) or set(shards) != set(sharded.tree_spec):
        got = sorted(shards) if isinstance(shards, dict) else type(shards).__name__
        raise ValueError(
            f"shards: expected shard_module's tree, a dict of the units {sorted(sharded.tree_spec)}"
            f"; got {got}"
        )
    parts = [*sharded.parts, *([sharded.root] if sharded.root is not None else [])]
    for part in parts:
        path, got = f"shards[{part.key!r}]", shards[part.key]
        unit = f"unit {part.key!r}" if part.key != ROOT else "the root unit"
        if not isinstance(got, dict):
            raise TypeError(
                f"{path}: expected a dict of {unit}'s parameters {list(part.names)}; got "
                f"{type(got).__name__}"
            )
        missing = [n for n in part.names if n not in got]
        extra = sorted(set(got) - set(part.names))
        if missing or extra:
            raise ValueError(
                f"{path}: {unit} has the parameters {list(part.names)}; "
                + "; ".join(
                    f"{what} {names}"
                    for what, names in (("missing", missing), ("unknown", extra))
                    if names
                )
            )
        for n in part.names:
            if not isinstance(got[n], torch.Tensor):
                raise TypeError(
                    f"{path}[{n!r}]: {unit}'s parameter {n!r} must be a tensor (its local "
                    f"shard); got {type(got[n]).__name__}"
                )


def _blocks(sharded: _Sharded, *, into: Any, recompute: bool, reshard: bool) -> dict:
    """The gathered block of every unit for these options (``into``, ``recompute``,
    ``reshard``): made for the first call with them, kept for the next calls with the same
    ones; a call with other options makes its own."""
    options = (into, recompute, reshard)
    # every option, compared by identity (a MainGrad is its own target): blocks made for
    # other options would add into another call's MainGrad, or run otherwise
    if sharded.blocks is not None and all(a is b for a, b in zip(sharded.blocks[0], options)):
        return sharded.blocks[1]
    mp = sharded.mp_policy
    blocks = {
        part.key: Gathered(
            _run_unit(part),
            part.spec,
            reshard_after_forward=reshard,
            into=into,
            recompute=recompute,
            mp_policy=mp,
            name=part.key,
        )
        for part in sharded.parts
    }
    if sharded.root is not None:  # the root: its full weights, held until its backward
        root = sharded.root
        blocks[ROOT] = Gathered(
            _identity,
            root.spec,
            reshard_after_forward=False,
            into=into,
            recompute=True,
            mp_policy=mp,
            name="root",
        )
    for key, block in blocks.items():  # errors name the unit's shards as the caller passed them
        block.shards_path = f"shards[{key!r}]"
    sharded.blocks = (options, blocks)
    return blocks


def _identity(weights: dict) -> dict:
    return weights


def _run_unit(part: _Part) -> Callable:
    """The unit's own forward on its full weights (and the root's weights it uses)."""

    def unit(weights: dict, borrowed: dict, forward: Callable, *args: Any, **kwargs: Any) -> Any:
        with _reparametrize_module(part.module, {**weights, **borrowed}, tie_weights=True):
            return forward(*args, **kwargs)

    unit.__name__ = part.key
    return unit


def _unit_forward(
    k: int, sharded: _Sharded, *, shards: dict, blocks: dict, params: dict, ran: list
) -> Callable:
    """What runs as unit ``k``'s forward inside a call: its gathered block, the next unit in
    the recorded order prefetched."""
    part = sharded.parts[k]
    block, order = blocks[part.key], sharded.order
    original = part.module.forward  # the module's own (bound) forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if block.recompute:
            kwargs = _without_cache(kwargs)
        i = len(ran)
        ran.append(k)
        if i + 1 < len(order) and order[i] == k:
            key = sharded.parts[order[i + 1]].key
            if blocks[key].spec == block.spec:  # gathered alike (a unit of another spec: not)
                prefetch_named(block, shards[key], f"shards[{key!r}]")
        borrowed = {name: params[root_name] for name, root_name in part.borrowed}
        # the module's own forward rides along as a constant argument (a pytree leaf)
        return block(shards[part.key], borrowed, original, *args, **kwargs)

    return forward


# The arguments by which a layer writes a key-value cache (Hugging Face's names). A forward
# run again in backward would write it twice (wrong attention, silently), so with recompute
# they are dropped, as the models' own activation checkpointing drops them.
_CACHE_ARGS = ("past_key_values", "layer_past")
_WARNED: set = register(set())  # warned once; again after clear_caches


def _without_cache(kwargs: dict) -> dict:
    cached = [a for a in _CACHE_ARGS if kwargs.get(a) is not None]
    if not cached and not kwargs.get("use_cache"):
        return kwargs
    if not _WARNED:
        _WARNED.add(True)
        warnings.warn(
            "functional_call(recompute=True): each unit runs its forward again in backward, "
            f"so a cache it would write ({', '.join(cached) or 'use_cache'}) is dropped, as "
            "the model's own activation checkpointing does; pass use_cache=False",
            stacklevel=3,
        )
    return {
        **kwargs,
        **dict.fromkeys(cached),
        **({"use_cache": False} if "use_cache" in kwargs else {}),
    }


@contextlib.contextmanager
def _forward_replaced(part: _Part, forward: Callable) -> Iterator[None]:
    module = part.module
    had = "forward" in module.__dict__
    saved = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if had:
            module.forward = saved
        else:
            del module.forward

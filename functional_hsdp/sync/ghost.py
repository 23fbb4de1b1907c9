"""Per-example squared gradient norms without per-example gradients ("ghost norms").

DP-SGD clips each example's gradient, so it needs each example's gradient norm. For most
layers that norm follows from what a first-order backward sees anyway, the layer's input
activations ``a`` and its output gradient ``g`` (Goodfellow 2015; Li et al. 2022's ghost
clipping; Opacus's ``ghost`` grad-sample mode):

- ``F.linear`` / ``x @ W`` on ``[B, d]``: ``||g_b^T a_b||^2 = ||g_b||^2 ||a_b||^2``; on
  sequences ``[B, T, d]`` either the Gram form ``sum_{t,s} (a_t . a_s)(g_t . g_s)``
  (``T^2 (d_in + d_out)`` per example) or the per-example gradient ``g_b^T a_b`` materialized
  (``T d_in d_out``), whichever the count says is cheaper (or as forced by ``sequence=``);
  the bias: ``||sum_t g_t||^2``;
- ``F.embedding``: the per-example gradient's rows are the output gradients summed by token
  id: a segment sum over (example, id), never a ``[B, vocab, d]`` tensor;
- the affine weight and bias of ``F.layer_norm`` / ``F.rms_norm``, and a parameter that
  multiplies or is added elementwise (Hugging Face's ``LlamaRMSNorm`` computes
  ``self.weight * hidden.to(dtype)``): their per-example gradients are vectors, taken as such;
- any other op that takes a parameter and a batched tensor (a convolution, ``atan2``, a
  user's ``autograd.Function``) falls back to per-example gradients for that op alone:
  ``vmap`` over the examples of the op's vjp, with its saved inputs and output gradient
  (Opacus's functorch fallback), the other ops of its unit keeping their formulas;
- a parameter through an op that only moves or casts its values (``w.t()``, ``w.view``,
  ``w.to``) is followed as that parameter into the op that meets the batch; through any
  other differentiable op of the parameters alone (``w.exp()``, ``w * 2``) it is refused
  (``NotImplementedError``): its per-example gradient exists only past that op.

The examples are along the leading dim of each such op's batched input and output (batch
first, as the units' per-rank tensors are): an op that sees another leading dim is an error
(the batch differs between parameters), unless that dim happens to equal the batch size.

How: :func:`ghost_grad_norms` runs the losses' forward under a ``TorchFunctionMode``
(:class:`_Intercept`) that knows the parameters: the gathered full weights of each unit while
its ``fn`` runs (registered by the unit, :func:`unit_scope`), and those a unit returns as they
are (an identity unit: ``fh.functional_call``'s root, whose weights the model uses outside
every unit) for the rest of the forward (:func:`returned_weights`). An op that uses one is routed
through :class:`_GhostOp`, an ``autograd.Function`` whose backward adds the op's
contribution to the pass's accumulator (a :class:`GhostPass`), which the op's record took in
forward, on the caller's thread: a backward may run on autograd's device thread, which sees
no ContextVar. A parameter is known by its memory (the storage, offset, shape and strides of
the tensor under any ``torch.func`` wrappers), so an activation is never counted, and a
registration ends with the unit's ``fn`` (a freed weight's memory may hold an activation
next). A parameter used more than once (tied weights, a unit called twice) has cross terms:
each of its uses then materializes its per-example gradient and the norm is taken of their
sum.

Book-keeping (Bu et al. 2023, :func:`ghost_clipped_grad`): the same backward also keeps what
each use needs for its clip-weighted gradient (a linear layer's activations and output
gradients, a vector parameter's per-example gradients); once the norms, hence the clip
factors ``c_b``, are known, each parameter's gradient of ``sum_b c_b loss_b`` is formed
(``(c * g)^T a`` for a linear layer: one matmul) and each unit's is reduce-scattered by its own
plan, as its backward would have: DP-SGD's step without a second forward and backward, at the
memory of keeping those tensors until the backward ends.

Placement: the weights a unit's ``fn`` sees are its full gathered weights, and each rank's
examples are its own, so every rank's norms are complete locally: the per-example gradient
of an example never leaves its rank before it is clipped, and no reduction across ranks is
needed (what the reduce-scatter would mix is the *sum over* examples, which this pass never
forms: the units reduce-scatter nothing in it).

State: a pass lives for one :func:`ghost_grad_norms` call; the ContextVar that units read in
forward is set only during that call's forward.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import optree
import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.overrides import TorchFunctionMode

from ..base.autocast import autocast_state, autocasting
from ..base.tree import flatten
from .autodiff import Move
from .first_order import requiring_grad, transformed

__all__ = [
    "GhostPass",
    "clipped_grads",
    "current_pass",
    "ghost_clipped_grad",
    "ghost_grad_norms",
    "returned_weights",
    "run_pass",
    "unit_scope",
]

SEQUENCE_FORMS = ("auto", "gram", "materialize")

_PASS: contextvars.ContextVar[GhostPass | None] = contextvars.ContextVar(
    "fh_ghost_pass", default=None
)


def current_pass() -> GhostPass | None:
    """The ghost pass whose forward runs on this thread now (forward only: a unit takes it
    onto its call record, which its backward reads)."""
    return _PASS.get()


# -- parameters and the accumulator -------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _Param:
    """One parameter in a pass: its path (for messages), how many ops use it (counted in
    forward), and, when used more than once, the sum of its uses' per-example gradients."""

    label: str
    uses: int = 0
    reported: int = 0
    pending: torch.Tensor | None = None
    grad: torch.Tensor | None = None  # book-keeping: the clip-weighted gradient, summed


@dataclasses.dataclass(eq=False)
class _View:
    """A parameter seen through an op that only moves or casts its values (``w.t()``,
    ``w.view(...)``, ``w.to(dtype)``): its per-example gradient has the parameter's norm, and
    is taken back to the parameter's shape (``fn``'s vjp, ``fn`` linear) where the
    parameter's uses are summed. ``root``: the parameter's shape and dtype on one rank."""

    param: _Param
    fn: Callable  # the parameter (one rank's) -> this view of it
    root: tuple[tuple[int, ...], torch.dtype]
    shape: tuple[int, ...]  # this view's, on one rank

    @property
    def label(self) -> str:
        return self.param.label

    def grad_to_root(self, g: torch.Tensor) -> torch.Tensor:
        """A gradient of the view ``(*lead, *shape)`` -> of the parameter."""
        shape, dtype = self.root
        _, vjp = torch.func.vjp(self.fn, torch.zeros(shape, dtype=dtype, device=g.device))
        return _nest(lambda x: vjp(x)[0], g.dim() - len(self.shape))(g.to(dtype))

    def to_root(self, g: torch.Tensor) -> torch.Tensor:
        """Per-example gradients of the view ``(*lead, B, *shape)`` -> of the parameter."""
        keep = g.dim() - len(self.shape)
        shape, dtype = self.root
        _, vjp = torch.func.vjp(self.fn, torch.zeros(shape, dtype=dtype, device=g.device))
        flat = g.reshape(-1, *self.shape).to(dtype)
        out = torch.vmap(lambda x: vjp(x)[0])(flat)
        return out.reshape(*g.shape[:keep], *shape)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` under its ``torch.func`` wrappers (vmap's batched tensors, grad's tracking ones)."""
    from torch._C._functorch import get_unwrapped, is_functorch_wrapped_tensor

    while is_functorch_wrapped_tensor(t):
        t = get_unwrapped(t)
    return t


def _key(t: torch.Tensor) -> tuple:
    """Where ``t``'s values are: the same for a tensor and its ``torch.func`` wrappers."""
    p = _plain(t)
    return (p.untyped_storage().data_ptr(), p.storage_offset(), tuple(p.shape), p.stride())


class GhostPass:
    """The accumulator of one pass: per example, the squared norms summed over every
    parameter the backward reaches; the parameters registered now; each op's batch size."""

    def __init__(self, sequence: str, *, bookkeeping: bool = False):
        self.sequence = sequence
        #: book-keeping (Bu et al. 2023): each use's clip-weighted gradient is formed once the
        #: norms are known, from what its backward kept (``clipped``: (param, c -> gradient))
        self.bookkeeping = bookkeeping
        self.clipped: list[tuple[Any, Callable]] = []
        #: per unit (its shards' keys): (plan, reduce dtype, params, full shapes and dtypes)
        self.units: dict[tuple, tuple] = {}
        self.total: torch.Tensor | None = None  # (*lead, B), float32
        self.known: dict[tuple, tuple[_Param, torch.Tensor]] = {}  # key -> (param, tensor)
        self.params: list[_Param] = []
        self.batch: tuple[tuple[int, ...], str] | None = None  # (shape, where) of the first op
        self._owners: dict[Any, _Param] = {}  # the shard gathered -> its parameter
        #: per parameter (its label), how its norms were taken: ``linear:gram``,
        #: ``embedding``, ``fallback``, ``summed`` (used more than once), ...
        self.routes: dict[str, set[str]] = {}
        self.counting = True  # whether the ops run now are uses (not a recompute's)
        self._scopes: list[list] = []  # the keys each open registration added
        self.silent = 0  # > 0 while the pass's own Functions compute: nothing is routed

    # forward ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def registered(self, tensors: Sequence[torch.Tensor], params: Sequence[_Param]) -> Iterator:
        """``tensors`` are ``params`` (gathered weights) while the block runs: each op that
        uses one is routed. The registrations hold the tensors (their memory cannot be
        reused meanwhile) and end with the block."""
        keys: list = []
        self._scopes.append(keys)
        for t, p in zip(tensors, params):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                key = _key(t)
                if key not in self.known:
                    self.known[key] = (p, t)
                    keys.append(key)
        try:
            with _intercepting(self):
                yield
        finally:
            self._scopes.pop()
            for key in keys:
                self.known.pop(key, None)

    def params_of(self, labels: Sequence[str], owners: Sequence[torch.Tensor]) -> list[_Param]:
        """The parameters of a unit's leaves: a shard is known by its path and its memory
        (the same shards gathered again give the same parameters; a rank's empty pieces of
        several parameters may sit at the same place)."""
        return [self.param(label, (label, _key(owner))) for label, owner in zip(labels, owners)]

    def unit(self, unit: tuple, weights: Sequence, *, params: list, owners: Sequence) -> None:
        """A unit's plan and reduce dtype, its parameters and the full shapes and dtypes of
        its weights (book-keeping reduce-scatters each unit's clip-weighted gradient once)."""
        keys = tuple(_key(o) for o in owners)
        if keys not in self.units:
            metas = [(tuple(_plain(w).shape), w.dtype, w.device) for w in weights]
            self.units[keys] = (*unit, params, metas)

    def keep(self, tensors: Sequence[torch.Tensor], params: Sequence[_Param]) -> None:
        """``tensors`` are ``params`` until the pass's forward ends (its outermost scope)."""
        for t, p in zip(tensors, params):
            key = _key(t)
            if self._scopes and t.is_floating_point() and t.numel() and key not in self.known:
                self.known[key] = (p, t)
                self._scopes[0].append(key)

    def alias(self, t: torch.Tensor, view: _View) -> None:
        """``t`` is ``view`` of a parameter until the registration it was made in ends."""
        key = _key(t)
        if key not in self.known and self._scopes:
            self.known[key] = (view, t)
            self._scopes[-1].append(key)

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """The pass's own computations (a routed op's forward and backward): the ops they
        run on parameters are not routed again, should the mode be on this thread."""
        self.silent += 1
        try:
            yield
        finally:
            self.silent -= 1

    def param(self, label: str, owner: Any = None) -> _Param:
        """A new parameter of the pass (``owner``: the same object for every gathering of the
        same shard gives the same parameter: its uses add up)."""
        if owner is not None and owner in self._owners:
            return self._owners[owner]
        p = _Param(label)
        self.params.append(p)
        if owner is not None:
            self._owners[owner] = p
        return p

    def found(self, t: Any) -> _Param | _View | None:
        if not self.known or not isinstance(t, torch.Tensor):
            return None
        entry = self.known.get(_key(t))
        return entry[0] if entry is not None else None

    def check_batch(self, shape: tuple[int, ...], where: str) -> None:
        """Every op's ``(*lead, B)`` is the first one's (a batch dim that differs between
        units or ops is an error, not norms of the wrong examples)."""
        if self.batch is None:
            self.batch = (shape, where)
        elif self.batch[0] != shape:
            raise ValueError(
                f"ghost_grad_norms: the batch differs between parameters: {where} sees "
                f"(*mesh, batch) = {tuple(shape)}, {self.batch[1]} saw {tuple(self.batch[0])} "
                "(every op that uses a parameter must see this rank's examples along the "
                "same leading dim)"
            )

    # backward -----------------------------------------------------------------------------
    def report(
        self,
        param: _Param | _View,
        *,
        route: str,
        squared: Callable,
        per_example: Callable,
        clipped: Callable | None = None,
    ) -> None:
        """One use of ``param`` in backward (by the formula ``route``): its per-example
        squared norms (``squared()``, ``(*lead, B)``) where it is its only use, else its
        per-example gradient (``per_example()``, ``(*lead, B, *shape)``), summed with the
        other uses'. With book-keeping, ``clipped(c)`` (the sum over examples of ``c_b``
        times their gradient, ``(*lead, *shape)``; by default from ``per_example()``) is
        kept until the clip factors ``c`` are known."""
        if self.bookkeeping:
            keep = len(self.batch[0])
            weigh = clipped or (lambda c: _weighted(per_example(), c, keep))
            self.clipped.append((param, weigh))
        view, param = (param, param.param) if isinstance(param, _View) else (None, param)
        if param.uses <= 1:
            self.routes.setdefault(param.label, set()).add(route)
            self._add(squared())
            return
        self.routes.setdefault(param.label, set()).add("summed")
        g = per_example() if view is None else view.to_root(per_example())
        param.pending = g if param.pending is None else param.pending + g
        param.reported += 1
        if param.reported >= param.uses:
            self._flush(param)

    def _flush(self, param: _Param) -> None:
        g, param.pending = param.pending, None
        if g is not None:
            self._add(_squares(g, len(self.batch[0])))

    def _add(self, squared: torch.Tensor) -> None:
        squared = squared.to(torch.float32)
        self.total = squared if self.total is None else self.total + squared

    def finish(self) -> torch.Tensor | None:
        """The sums, once backward is over: the uses whose backward never came add nothing,
        those that came are summed."""
        for p in self.params:
            self._flush(p)
        return self.total


def _weighted(per: torch.Tensor, c: torch.Tensor, keep: int) -> torch.Tensor:
    """``sum_b c_b per_b``: ``per`` ``(*lead, B, *shape)``, ``c`` ``(*lead, B)``."""
    c = c.reshape(*c.shape, *[1] * (per.dim() - keep)).to(per.dtype)
    return (per * c).sum(keep - 1)


def _squares(g: torch.Tensor, keep: int) -> torch.Tensor:
    """Sum of squares over all but the first ``keep`` dims, in float32."""
    return g.float().square().flatten(keep).sum(-1)


# -- the interception -----------------------------------------------------------------------


class _Intercept(TorchFunctionMode):
    """Routes every op that uses a registered parameter through :class:`_GhostOp`."""

    def __init__(self, ghost: GhostPass):
        super().__init__()
        self.ghost = ghost

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        ghost = self.ghost
        if not ghost.known or ghost.silent or _library_function(func, args):
            return func(*args, **kwargs)
        args, kwargs = _positional(func, args, kwargs)
        leaves, treedef = optree.tree_flatten((args, kwargs), is_leaf=_is_tensor)
        found = [(i, ghost.found(x)) for i, x in enumerate(leaves)]
        found = [(i, p) for i, p in found if p is not None]
        if not found:
            return func(*args, **kwargs)
        return _route(ghost, func, leaves=leaves, treedef=treedef, found=found)


def _positional(func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A linear layer's or a matmul's tensors by position (``F.linear(x, weight=W,
    bias=b)`` as ``F.linear(x, W, b)``): their formulas read the input, the weight and the
    bias by position, and keywords flatten in another order."""
    names = ("input", "weight", "bias") if func in _LINEAR else None
    names = ("input", "other") if func in _MATMUL else names
    if names is None or not kwargs:
        return args, kwargs
    args, kwargs = list(args), dict(kwargs)
    for name in names[len(args) :]:
        if name not in kwargs:
            break
        args.append(kwargs.pop(name))
    return tuple(args), kwargs


def _library_function(func: Any, args: tuple) -> bool:
    """Whether ``func`` applies one of this library's ``autograd.Function``s (a unit, a
    move: under ``torch.func`` their ``apply`` reaches the mode): not an op on parameters,
    and the unit registers its own weights inside."""
    if not isinstance(func, torch._ops.HigherOrderOperator) or not args:
        return False
    return getattr(args[0], "__module__", "").startswith("functional_hsdp.")


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


@contextlib.contextmanager
def _intercepting(ghost: GhostPass) -> Iterator[None]:
    """The pass's mode on this thread's stack, unless it is there already (one mode per
    pass: an inner one would route ops the outer one routes again)."""
    depth = torch._C._len_torch_function_stack()
    stack = [torch._C._get_function_stack_at(i) for i in range(depth)]
    if any(isinstance(m, _Intercept) and m.ghost is ghost for m in stack):
        yield
        return
    with _Intercept(ghost):
        yield


def _route(ghost: GhostPass, func: Any, *, leaves: list, treedef: Any, found: list) -> Any:
    """``func`` on ``leaves`` (its flattened arguments), through a :class:`_GhostOp` when
    the backward can reach a parameter in it."""
    tensors = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    params = dict(found)
    others = [i for i in tensors if i not in params]
    args, kwargs = optree.tree_unflatten(treedef, leaves)
    if not others:  # the parameters alone, no batch: metadata, or a new tensor of them
        out = func(*args, **kwargs)
        if torch.is_grad_enabled():
            _follow(ghost, out, func, leaves=leaves, treedef=treedef, params=params)
        return out
    if not torch.is_grad_enabled():  # no backward (recompute's forward): only counted
        _count(ghost, params.values())
        return func(*args, **kwargs)
    kind = _kind(func, leaves, treedef=treedef, params=params)
    site = _Site(
        ghost=ghost,
        kind=kind,
        func=func,
        treedef=treedef,
        leaves=[None if i in tensors else x for i, x in enumerate(leaves)],
        slots=tuple(tensors),
        params=tuple((tensors.index(i), p) for i, p in params.items()),
    )
    _count(ghost, params.values())
    return _GhostOp.apply(site, *(leaves[i] for i in tensors))


def _count(ghost: GhostPass, params: Any) -> None:
    if ghost.counting:
        for p in params:
            (p.param if isinstance(p, _View) else p).uses += 1


#: ops that only move or cast a tensor's values: a parameter through them is a view of it
_VIEWS = {
    torch.Tensor.t, torch.t, torch.Tensor.transpose, torch.transpose, torch.Tensor.permute,
    torch.permute, torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.flatten,
    torch.flatten, torch.Tensor.unflatten, torch.Tensor.squeeze, torch.squeeze,
    torch.Tensor.unsqueeze, torch.unsqueeze, torch.Tensor.contiguous, torch.Tensor.clone,
    torch.clone, torch.Tensor.to, torch.Tensor.float, torch.Tensor.double, torch.Tensor.half,
    torch.Tensor.bfloat16, torch.Tensor.type_as, torch.Tensor.T.__get__,
    torch.Tensor.mT.__get__, torch.Tensor.mH.__get__, torch.Tensor.H.__get__,
}  # fmt: skip


def _follow(
    ghost: GhostPass, out: Any, func: Any, *, leaves: list, treedef: Any, params: dict
) -> None:
    """A parameter through a view op (:data:`_VIEWS`) is followed as that parameter; through
    any other op (``w * 2``, ``w.exp()``) before it meets the batch, refused, rather than
    norms that miss it. What carries no gradient (``detach``, ``zeros_like``, metadata)
    passes."""
    outs = [o for o in optree.tree_leaves(out, is_leaf=_is_tensor) if isinstance(o, torch.Tensor)]
    mine = {_key(leaves[i]) for i in params}
    for o in outs:
        if not o.is_floating_point() or _key(o) in mine or not _differentiable(o):
            continue  # metadata, the parameter itself, detach, zeros_like: no gradient
        if func in _VIEWS and len(outs) == 1 and len(params) == 1:
            ((k, use),) = params.items()
            param = use.param if isinstance(use, _View) else use
            root = use.root if isinstance(use, _View) else (tuple(leaves[k].shape), leaves[k].dtype)
            fn = _view_of(use, func, leaves=leaves, treedef=treedef, k=k)
            ghost.alias(o, _View(param=param, fn=fn, root=root, shape=tuple(o.shape)))
            continue
        p = next(iter(params.values()))
        p = p.param if isinstance(p, _View) else p
        raise NotImplementedError(
            f"ghost_grad_norms: the parameter {p.label} goes through "
            f"{getattr(func, '__name__', func)} before it meets the examples; ghost norms "
            "follow a parameter through ops that only move or cast its values (t, "
            "transpose, view, reshape, to, ...) into the op that uses it with the batch "
            "(apply the others to the batch's side, or take the norms with "
            "fh.per_example_grad_norms)"
        )


# -- which formula --------------------------------------------------------------------------

_LINEAR = {F.linear, torch._C._nn.linear}
_MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__}
_MUL = {torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__}
_ADD = {torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__}


def _differentiable(t: torch.Tensor) -> bool:
    """Whether ``t`` carries a gradient back (read under vmap's wrappers, which do not say)."""
    from torch._C._functorch import get_unwrapped, is_batchedtensor

    while is_batchedtensor(t):
        t = get_unwrapped(t)
    return t.requires_grad


def _view_of(use: Any, func: Any, *, leaves: list, treedef: Any, k: int) -> Callable:
    """``fn``: the parameter (one rank's) -> ``func``'s output of the parameter (or view)
    ``use`` at ``leaves[k]``."""
    inner = use.fn if isinstance(use, _View) else (lambda r: r)
    kept = [None if i == k else x for i, x in enumerate(leaves)]  # no tensor held

    def fn(r: torch.Tensor) -> torch.Tensor:
        now = list(kept)
        now[k] = inner(r)
        args, kwargs = optree.tree_unflatten(treedef, now)
        return func(*args, **kwargs)

    return fn


def _kind(func: Any, leaves: list, *, treedef: Any, params: dict) -> str:
    """The formula for ``func`` with parameters at ``params`` (flat argument positions)."""
    args, kwargs = optree.tree_unflatten(treedef, list(range(len(leaves))))
    pos = lambda k, name: args[k] if len(args) > k else kwargs.get(name)  # noqa: E731
    if func in _LINEAR and pos(0, "input") not in params and pos(1, "weight") in params:
        return "linear"
    if func in _MATMUL and pos(1, "other") in params and pos(0, "input") not in params:
        if leaves[pos(1, "other")].dim() == 2:
            return "matmul"
    if func is F.embedding and pos(1, "weight") in params and pos(0, "input") not in params:
        if not (_value(leaves, pos(3, "max_norm")) or _value(leaves, pos(5, "scale_grad_by_freq"))):
            return "embedding"
    if func in (F.layer_norm, F.rms_norm) and pos(0, "input") not in params:
        return "norm"
    if func in _MUL or func in _ADD:
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if len(tensors) == 2 and len(params) == 1 and not (func in _ADD and pos(2, "alpha")):
            return "mul" if func in _MUL else "add"
    return "fallback"


def _value(leaves: list, k: Any) -> Any:
    return None if k is None else leaves[k]


# -- the routed op --------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _Site:
    """One routed op: its function, arguments (tensors at ``slots``), the parameters among
    its tensors (``(tensor index, param)``), and the vmap levels around it (``lead``: the
    mesh dims of a SimMesh's ``per_rank``)."""

    ghost: GhostPass
    kind: str
    func: Any
    treedef: Any
    leaves: list
    slots: tuple[int, ...]
    params: tuple[tuple[int, _Param], ...]
    lead: int = 0

    def call(self, *tensors: torch.Tensor) -> Any:
        """The op on one rank's tensors."""
        leaves = list(self.leaves)
        for i, t in zip(self.slots, tensors):
            leaves[i] = t
        args, kwargs = optree.tree_unflatten(self.treedef, leaves)
        return self.func(*args, **kwargs)

    def arg(self, k: int, name: str) -> Any:
        """The op's argument ``k`` (or keyword ``name``): a tensor index or a constant."""
        args, kwargs = optree.tree_unflatten(self.treedef, list(range(len(self.leaves))))
        pos = args[k] if len(args) > k else kwargs.get(name)
        if pos is None:
            return None
        if isinstance(pos, int) and pos in self.slots:
            return ("tensor", self.slots.index(pos))
        return ("value", optree.tree_map(lambda i: self.leaves[i], pos))

    @property
    def param_indices(self) -> set[int]:
        return {k for k, _ in self.params}

    @property
    def where(self) -> str:
        name = getattr(self.func, "__name__", str(self.func))
        return f"{', '.join(p.label for _, p in self.params)} (in {name})"


def _nest(fn: Callable, lead: int) -> Callable:
    """``fn`` on tensors with ``lead`` more leading dims (every argument batched)."""
    for _ in range(lead):
        fn = torch.vmap(fn)
    return fn


class _GhostOp(torch.autograd.Function):
    """An op that uses a parameter: forward computes it; backward adds the parameters'
    per-example squared norms to the pass and returns the other inputs' gradients (none for
    the parameters: this pass asks for none)."""

    @staticmethod
    def forward(site: _Site, *tensors: torch.Tensor) -> torch.Tensor:
        with site.ghost.quiet():
            out = _nest(site.call, site.lead)(*tensors)
        if not isinstance(out, torch.Tensor):
            raise NotImplementedError(
                f"ghost_grad_norms: {site.where} returns {type(out).__name__}; an op that "
                "uses a parameter must return one tensor"
            )
        # an input returned as it is (h.type_as(w) of the same dtype): a view of it, which
        # autograd lets a Function return and save
        return out.view_as(out) if any(out is t for t in tensors) else out

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        site = inputs[0]
        ctx.site = site
        ctx.autocast = autocast_state(inputs[1:])  # the backward recomputes in it
        ctx.save_for_backward(*inputs[1:])
        act = _batched_input(site, inputs[1:])
        site.ghost.check_batch(tuple(act.shape[: site.lead + 1]), site.where)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, go: torch.Tensor) -> tuple:
        site, tensors = ctx.site, ctx.saved_tensors
        # what recomputes the op (the inputs' gradients, the fallback's per-example vjp) runs
        # in the forward's autocast state, whatever region the backward runs in; the
        # formulas' own sums run outside it, in float32
        recompute = functools.partial(autocasting, ctx.autocast)
        with site.ghost.quiet():
            with recompute() if site.kind == "fallback" else contextlib.nullcontext():
                _CONTRIBUTE[site.kind](site, tensors, go)
            with recompute():
                grads = _input_grads(site, tensors, go, needs=ctx.needs_input_grad[1:])
        return (None, *grads)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, site: _Site, *tensors: torch.Tensor) -> tuple:
        moved = [
            t.movedim(d, 0) if d is not None else t.unsqueeze(0).expand(info.batch_size, *t.shape)
            for t, d in zip(tensors, in_dims[1:])
        ]
        return _GhostOp.apply(dataclasses.replace(site, lead=site.lead + 1), *moved), 0


def _batched_input(site: _Site, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The op's input that carries the examples: its first non-parameter tensor with a dim
    past the lead (the batch)."""
    params = site.param_indices
    for k, t in enumerate(tensors):
        if k not in params and t.dim() > site.lead:
            return t
    raise ValueError(
        f"ghost_grad_norms: {site.where} has no input with a batch dim (every op that uses "
        "a parameter must see this rank's examples along its leading dim)"
    )


def _input_grads(site: _Site, tensors: Sequence, go: torch.Tensor, *, needs: Sequence) -> list:
    """The gradients of the op's floating non-parameter inputs (none for the parameters)."""
    params = site.param_indices
    wanted = [
        k for k, t in enumerate(tensors) if needs[k] and k not in params and t.is_floating_point()
    ]
    grads: list = [None] * len(tensors)
    if not wanted:
        return grads
    if site.kind in ("linear", "matmul") and wanted == [0]:
        grads[0] = _linear_input_grad(site, tensors, go)
        return grads

    def one_rank(g: torch.Tensor, *ts: torch.Tensor) -> tuple:  # the vjp inside the vmaps
        def f(*acts: torch.Tensor) -> torch.Tensor:
            now = list(ts)
            for k, a in zip(wanted, acts):
                now[k] = a
            return site.call(*now)

        out, vjp = torch.func.vjp(f, *(ts[k] for k in wanted))
        return vjp(g.to(out.dtype))  # an autocast recompute may give another dtype

    for k, g in zip(wanted, _nest(one_rank, site.lead)(go, *tensors)):
        grads[k] = g
    return grads


def _linear_input_grad(site: _Site, tensors: Sequence, go: torch.Tensor) -> torch.Tensor:
    """``go @ W`` (``go @ W^T`` for ``x @ W``), with the lead dims batched."""
    x, w = tensors[0], tensors[1]
    if site.lead == 0:
        return (go @ w if site.kind == "linear" else go @ w.mT).to(x.dtype)
    lead = go.shape[: site.lead]
    flat = go.reshape(*lead, -1, go.shape[-1])
    out = flat @ (w if site.kind == "linear" else w.mT)
    return out.reshape(x.shape).to(x.dtype)


# -- the formulas: each adds its parameters' squared norms -------------------------------------


def _linear(site: _Site, tensors: Sequence, go: torch.Tensor) -> None:
    """``F.linear(x, W, b)`` / ``x @ W``: activations ``a`` (*lead, B, T, i) and output
    gradients ``g`` (*lead, B, T, o)."""
    lead = site.lead
    x = tensors[0]
    shape = x.shape[: lead + 1]
    a = x.reshape(*shape, -1, x.shape[-1]).float()
    g = go.reshape(*shape, -1, go.shape[-1]).float()
    form = _linear_form(site.ghost.sequence, a.shape[-2], sizes=(a.shape[-1], g.shape[-1]))
    for k, p in site.params:
        if k == 1:  # the weight
            site.ghost.report(
                p,
                route=f"{site.kind}:{form}",
                squared=lambda: _linear_squares(form, a, g),
                per_example=lambda: g.mT @ a if site.kind == "linear" else a.mT @ g,
                clipped=lambda c: _linear_clipped(site, (a, g), c),
            )
        else:  # the bias: the per-example gradient is sum_t g_t
            site.ghost.report(
                p,
                route=f"{site.kind}:bias",
                squared=lambda: g.sum(-2).square().sum(-1),
                per_example=lambda: g.sum(-2),
                clipped=lambda c: (g * c[..., None, None]).sum((-3, -2)),
            )


def _linear_clipped(site: _Site, ag: tuple, c: torch.Tensor) -> torch.Tensor:
    """``sum_b c_b g_b^T a_b`` (``a_b^T g_b`` for ``x @ W``): the weight's clipped gradient,
    one matmul over all the examples' positions."""
    a, g = ag
    weighted = (g * c[..., None, None]).flatten(-3, -2)
    flat = a.flatten(-3, -2)
    return weighted.mT @ flat if site.kind == "linear" else flat.mT @ weighted


def _linear_form(sequence: str, steps: int, *, sizes: tuple[int, int]) -> str:
    """How ``||g_b^T a_b||^2`` is taken: ``outer`` without a sequence (the product of the
    norms); on a sequence of ``steps``, ``gram`` (``T^2 (i + o)`` per example, memory
    ``B T^2``) where that count is at most ``materialize``'s (``T i o``, memory ``B i o``),
    unless ``sequence`` forces one. Where the count picks ``gram``, ``gram`` also takes at
    most half the memory (``T (i + o) <= i o`` gives ``2 T^2 <= i o / 2``): the FLOP and the
    memory counts disagree only near the boundary, where the two forms cost about alike."""
    i, o = sizes
    if steps == 1:
        return "outer"
    if sequence == "auto":
        return "gram" if steps * (i + o) <= i * o else "materialize"
    return sequence


def _linear_squares(form: str, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``||g_b^T a_b||^2`` for each example, in ``form`` (:func:`_linear_form`)."""
    if form == "outer":
        return a.square().sum((-2, -1)) * g.square().sum((-2, -1))
    if form == "gram":
        return ((a @ a.mT) * (g @ g.mT)).sum((-2, -1))
    return (g.mT @ a).square().sum((-2, -1))


def _embedding(site: _Site, tensors: Sequence, go: torch.Tensor) -> None:
    """``F.embedding(ids, W)``: example b's gradient row v is the sum of the output gradients
    where its ids are v: a segment sum over (example, id)."""
    lead = site.lead
    ids, w = tensors[0], tensors[1]
    rows = ids.shape[: lead + 1].numel()
    vocab = w.shape[-2]
    padding = site.arg(2, "padding_idx")
    pad = padding[1] if padding is not None and padding[0] == "value" else None
    flat_ids = ids.reshape(rows, -1)
    example = torch.arange(rows, device=ids.device)[:, None].expand_as(flat_ids)
    keys = (example * vocab + flat_ids % vocab).reshape(-1)
    grads = go.reshape(keys.shape[0], go.shape[-1]).float()
    if pad is not None:  # the padding row has no gradient
        keep = flat_ids.reshape(-1) != pad % vocab
        keys, grads = keys[keep], grads[keep]
    (_, p), shape = site.params[0], ids.shape[: lead + 1]

    def squared() -> torch.Tensor:
        unique, inverse = torch.unique(keys, return_inverse=True)
        seg = grads.new_zeros(unique.shape[0], grads.shape[-1]).index_add_(0, inverse, grads)
        out = grads.new_zeros(rows).index_add_(0, unique // vocab, seg.square().sum(-1))
        return out.reshape(shape)

    def per_example() -> torch.Tensor:
        out = grads.new_zeros(rows * vocab, grads.shape[-1]).index_add_(0, keys, grads)
        return out.reshape(*shape, vocab, grads.shape[-1])

    def clipped(c: torch.Tensor) -> torch.Tensor:  # rows: (lead index, id)
        weighted = grads * c.reshape(-1).to(grads.dtype)[keys // vocab, None]
        per_lead = (keys // vocab) // shape[-1] * vocab + keys % vocab
        out = grads.new_zeros(rows // shape[-1] * vocab, grads.shape[-1])
        return out.index_add_(0, per_lead, weighted).reshape(*shape[:-1], vocab, -1)

    site.ghost.report(
        p, route="embedding", squared=squared, per_example=per_example, clipped=clipped
    )


def _elementwise(site: _Site, tensors: Sequence, go: torch.Tensor) -> None:
    """``x * w`` / ``x + w``: the per-example gradient of ``w`` is ``go * x`` (``go``)
    summed over the dims ``w`` broadcasts along."""
    lead = site.lead
    ((k, p),) = site.params
    other = tensors[1 - k]
    contrib = go * other if site.kind == "mul" else go
    contrib = contrib.expand(torch.broadcast_shapes(contrib.shape, go.shape))
    per = _per_example_sum(contrib, tensors[k].shape[lead:], lead)
    shape = contrib.shape[: lead + 1]
    site.ghost.report(
        p,
        route=site.kind,
        squared=lambda: _squares(per, lead + 1),
        per_example=lambda: per.reshape(*shape, *tensors[k].shape[lead:]),
    )


def _per_example_sum(c: torch.Tensor, param_shape: tuple, lead: int) -> torch.Tensor:
    """``c`` (*lead, B, *rest) summed, per example, to ``param_shape`` (one rank's shape of
    the parameter, broadcast against ``rest``; a leading 1 of it may stand for the batch)."""
    rest = c.shape[lead + 1 :]
    shape = tuple(param_shape)
    if len(shape) == len(rest) + 1:
        if shape[0] != 1:
            raise ValueError(f"ghost_grad_norms: a parameter of shape {shape} spans the batch")
        shape = shape[1:]
    pad = len(rest) - len(shape)
    dims = [
        lead + 1 + j for j in range(len(rest)) if j < pad or (shape[j - pad] == 1 and rest[j] != 1)
    ]
    out = c.sum(dims, keepdim=True) if dims else c
    return out.reshape(*c.shape[: lead + 1], *shape)


def _norm(site: _Site, tensors: Sequence, go: torch.Tensor) -> None:
    """``F.layer_norm(x, shape, w, b, eps)`` / ``F.rms_norm(x, shape, w, eps)``: the weight's
    per-example gradient is ``go * x_hat`` summed over the positions, the bias's ``go``."""
    lead = site.lead
    x = tensors[0]
    shape = site.arg(1, "normalized_shape")[1]
    if site.func is F.layer_norm:
        eps = site.arg(4, "eps")
        x_hat = F.layer_norm(x.float(), shape, None, None, 1e-5 if eps is None else eps[1])
        names = ((2, "weight"), (3, "bias"))
    else:
        eps = site.arg(3, "eps")
        x_hat = F.rms_norm(x.float(), shape, None, None if eps is None else eps[1])
        names = ((2, "weight"),)
    g = go.float()
    for k, p in site.params:
        which = next((name for pos, name in names if site.arg(pos, name) == ("tensor", k)), None)
        if which is None:  # a parameter as the input: not this formula
            raise NotImplementedError(f"ghost_grad_norms: {site.where}: a parameter as input")
        contrib = g * x_hat if which == "weight" else g
        per = _per_example_sum(contrib, tensors[k].shape[lead:], lead)
        site.ghost.report(
            p,
            route=f"{site.func.__name__}:{which}",
            squared=lambda per=per: _squares(per, lead + 1),
            per_example=lambda per=per: per,
        )


def _fallback(site: _Site, tensors: Sequence, go: torch.Tensor) -> None:
    """Any other op: each example's gradient of the parameters, by ``vmap`` over the
    examples of the op's vjp (its saved inputs and output gradient), then its norm."""
    lead, params = site.lead, site.param_indices
    size = go.shape[lead]
    batched = [
        k not in params and t.dim() > lead and t.shape[lead] == size for k, t in enumerate(tensors)
    ]
    order = sorted(params)

    def one(*ts: torch.Tensor) -> tuple:
        *ts, g = ts

        def f(*ps: torch.Tensor) -> torch.Tensor:
            full = [x.unsqueeze(0) if b else x for x, b in zip(ts, batched)]
            for k, q in zip(order, ps):
                full[k] = q
            return site.call(*full)

        out, vjp = torch.func.vjp(f, *(ts[k] for k in order))
        return vjp(g.unsqueeze(0).to(out.dtype))

    per_rank = torch.vmap(one, in_dims=(*(0 if b else None for b in batched), 0))
    grads = _nest(per_rank, lead)(*tensors, go)
    by_index = dict(zip(order, grads))
    for k, p in site.params:
        g = by_index[k]
        site.ghost.report(
            p,
            route="fallback",
            squared=lambda g=g: _squares(g, lead + 1),
            per_example=lambda g=g: g,
        )


_CONTRIBUTE = {
    "linear": _linear,
    "matmul": _linear,
    "embedding": _embedding,
    "norm": _norm,
    "mul": _elementwise,
    "add": _elementwise,
    "fallback": _fallback,
}


# -- the units' side ------------------------------------------------------------------------


@contextlib.contextmanager
def unit_scope(
    ghost: GhostPass,
    weights: Sequence[torch.Tensor],
    *,
    labels: Sequence[str],
    owners: Sequence[torch.Tensor],
    recount: bool = True,
    unit: tuple | None = None,
) -> Iterator[None]:
    """A unit's ``fn`` runs with its gathered ``weights`` known to the pass ``ghost``.

    ``owners``: the local shards they were gathered from (the same shards give the same
    parameters: a unit called twice in one forward uses its parameters twice). ``recount``:
    False where ``fn`` runs again in backward (recompute), its uses counted in forward.
    ``unit``: ``(plan, reduce dtype)`` of the unit, for book-keeping's reduce-scatter of
    its gradient."""
    params = ghost.params_of(labels, owners)
    if unit is not None:
        ghost.unit(unit, weights, params=params, owners=owners)
    counting, ghost.counting = ghost.counting, recount
    try:
        with ghost.registered(weights, params):
            yield
    finally:
        ghost.counting = counting


def returned_weights(
    ghost: GhostPass,
    weights: Sequence[torch.Tensor],
    *,
    labels: Sequence[str],
    owners: Sequence[torch.Tensor],
) -> None:
    """Gathered ``weights`` a unit returned as they are (an identity unit: the root of
    ``fh.functional_call``) are known to the pass until its forward ends (the unit holds
    them until its backward: their memory is not reused meanwhile)."""
    ghost.keep(weights, ghost.params_of(labels, owners))


# -- the public function ----------------------------------------------------------------------


def ghost_grad_norms(
    losses_fn: Callable, shards: Any, *args: Any, sequence: str = "auto", **kwargs: Any
) -> torch.Tensor:
    """Each example's gradient norm from one first-order backward, without per-example
    gradients ("ghost norms"): DP-SGD's first pass (Opacus's ghost clipping), at FSDP memory.

    ``losses_fn(shards, *args, **kwargs)`` returns this rank's per-example losses, the
    examples along the last dim (``(B,)``; on a SimMesh ``(*mesh, B)``), through gathered
    units or ``fh.functional_call``: the function whose clip-weighted sum is DP-SGD's second
    pass (an ordinary first-order gradient). It runs forward and backward once; in that
    backward each op that uses a unit's gathered weights adds its parameters' per-example
    squared norms, taken from its input activations and output gradient:

    - ``F.linear`` / ``x @ W`` on ``(B, d)``: ``||g_b||^2 ||a_b||^2``; on sequences
      ``(B, T, d)``: the Gram form ``sum_{t,s} (a_t . a_s)(g_t . g_s)`` or the materialized
      ``g_b^T a_b``, whichever costs less (``sequence=``); the bias: ``||sum_t g_t||^2``;
    - ``F.embedding``: the output gradients summed per (example, token id);
    - the weight and bias of ``F.layer_norm`` / ``F.rms_norm``, and a parameter multiplied or
      added elementwise (Hugging Face's ``LlamaRMSNorm``);
    - any other op (a convolution, a user's ``autograd.Function``): that op's per-example
      gradients, by ``vmap`` of its vjp over the examples;

    a parameter through ``t``, ``transpose``, ``view``, ``reshape``, ``to``, ... is followed
    into the op that meets the batch, and one used more than once (tied weights, a unit
    called twice) has its uses' per-example gradients summed before the norm. The units
    reduce-scatter nothing and no parameter gradient is formed. The weights a unit's ops see
    are its full gathered weights and a rank's examples are its own, so each rank's norms
    are complete where they are taken: no collective is added (the vmap path,
    :func:`~functional_hsdp.per_example_grad_norms`, likewise takes them before any
    reduce-scatter would mix ranks' examples). The backward runs as ``loss.backward()``
    does (:func:`~functional_hsdp.grad`'s memory: each node's saved tensors freed as soon
    as it has run), so the pass holds what a plain step's backward holds.

    Args:
        losses_fn: ``losses_fn(shards, *args, **kwargs)`` -> per-example losses.
        shards: the units' shards at the parameter placement.
        *args: the rest of ``losses_fn``'s arguments (the batch).
        sequence: for a linear layer on sequences, ``"auto"`` (default: the Gram form when
            its count, ``T^2 (d_in + d_out)`` per example, is at most the materialized
            gradient's, ``T d_in d_out``), ``"gram"`` or ``"materialize"``.
        **kwargs: keyword arguments of ``losses_fn``.

    Returns:
        The norms, float32, of the losses' shape: ``norms[..., b]`` is example ``b``'s.

    Raises:
        ValueError: a batch dim that differs between the ops that use parameters, or from
            the losses'; losses that are not a floating tensor with the examples along its
            last dim; losses that reach no gathered unit's parameter; a unit run under
            vmap, jvp or a second derivative.
        NotImplementedError: a parameter through a differentiable op of the parameters
            alone other than a view or cast (``w.exp()``, ``w * 2``) before it meets the
            batch: take those norms with :func:`~functional_hsdp.per_example_grad_norms`.

    Example:
        >>> import torch, functional_hsdp as fh
        >>> mesh = fh.SimMesh({"dp": 2})
        >>> spec = fh.fsdp(mesh)
        >>> shards = fh.shard([{"w": torch.eye(3)}], [spec])
        >>> block = fh.gathered(fh.per_rank(lambda p, x: x @ p["w"], mesh), spec)
        >>> x = torch.tensor([[[1.0, 0, 0], [0, 2, 0]], [[0, 0, 3], [1, 1, 1]]])  # (rank, B, 3)
        >>> losses = lambda s, x: block(s[0], x).sum(-1)  # (rank, B)
        >>> fh.ghost_grad_norms(losses, shards, x)  # ||x_b|| * ||(1, 1, 1)||
        tensor([[1.7321, 3.4641],
                [5.1962, 3.0000]])
    """
    return run_pass(losses_fn, shards, args=args, kwargs=kwargs, sequence=sequence)[0]


def ghost_clipped_grad(
    losses_fn: Callable,
    shards: Any,
    *args: Any,
    max_norm: float,
    sequence: str = "auto",
    **kwargs: Any,
) -> tuple[Any, torch.Tensor]:
    """DP-SGD's clipped gradient from one forward and one backward (book-keeping, Bu et al.
    2023): the norms as :func:`ghost_grad_norms` takes them, then each parameter's
    clip-weighted gradient from what that backward kept, with no second pass.

    The gradient is that of ``sum_b c_b * losses_b`` with ``c_b = min(1, max_norm /
    (norm_b + 1e-6))`` (Opacus's factor), at the gradient placement, each unit's
    reduce-scattered as its backward would: what ``torch.func.grad(weighted)(shards)``
    returns through the units after a norms pass, without that second forward and
    backward. Finish it as that one: ``fh.reduce_grads(grads, spec, last=True,
    at="gradient")`` or ``mg.accumulate(grads, at="gradient")``. Memory: each op's input
    activations and output gradients (for an op without a formula, its per-example
    gradients) are kept until the backward ends, then one unit's full gradient is formed at
    a time; weigh that against the second pass's time.

    Args:
        losses_fn: as :func:`ghost_grad_norms`'s.
        shards: the units' shards at the parameter placement (each a shard a unit the losses
            reach was called with).
        *args: the rest of ``losses_fn``'s arguments.
        max_norm: the clipping norm ``C``, a positive number.
        sequence: as :func:`ghost_grad_norms`'s.
        **kwargs: keyword arguments of ``losses_fn``.

    Returns:
        ``(grads, norms)``: ``grads`` like ``shards``, at the gradient placement; ``norms``
        as :func:`ghost_grad_norms` returns them.

    Raises:
        ValueError / TypeError: a ``max_norm`` that is not a positive finite number; a shard
            no unit the losses reached was called with; and as :func:`ghost_grad_norms`.
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
        raise TypeError(f"ghost_clipped_grad: max_norm must be a number; got {max_norm!r}")
    if not math.isfinite(max_norm) or max_norm <= 0:
        raise ValueError(f"ghost_clipped_grad: max_norm must be positive; got {max_norm!r}")
    norms, ghost = run_pass(
        losses_fn, shards, args=args, kwargs=kwargs, sequence=sequence, bookkeeping=True
    )
    return clipped_grads(ghost, shards, norms=norms, max_norm=max_norm), norms


def clipped_grads(ghost: GhostPass, shards: Any, *, norms: torch.Tensor, max_norm: float) -> Any:
    """Book-keeping's end: each parameter's clip-weighted gradient from what its uses kept,
    then each unit's reduce-scattered to the gradient placement, as a tree like ``shards``."""
    c = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    clipped, ghost.clipped = ghost.clipped, []
    for use, weigh in clipped:
        g = weigh(c)
        param = use.param if isinstance(use, _View) else use
        g = use.grad_to_root(g) if isinstance(use, _View) else g
        param.grad = g if param.grad is None else param.grad + g
    reduced: dict = {}
    for keys, (plan, grad_dtype, params, metas) in ghost.units.items():
        grads = [
            torch.zeros(shape, dtype=dtype, device=device) if p.grad is None else p.grad.to(dtype)
            for p, (shape, dtype, device) in zip(params, metas)
        ]
        # the unit's own reduce-scatter: its gradient placement, as its backward gives it
        reduced.update(zip(keys, Move(plan, "input", "gradient", dtype=grad_dtype).run(grads)))
    leaves, treedef, paths = flatten(shards, "shards")
    missing = [path for leaf, path in zip(leaves, paths) if _key(leaf) not in reduced]
    if missing:
        raise ValueError(
            f"ghost_clipped_grad: {missing[0]} is no shard a unit the losses reached was "
            "called with (every shard must be a unit's, as fh.shard or fh.shard_module made)"
        )
    return optree.tree_unflatten(treedef, [reduced[_key(leaf)] for leaf in leaves])


def run_pass(
    losses_fn: Callable,
    shards: Any,
    *,
    args: tuple,
    kwargs: dict,
    sequence: str,
    bookkeeping: bool = False,
) -> tuple[torch.Tensor, GhostPass]:
    """:func:`ghost_grad_norms`'s body: the norms and the pass (which says, per parameter,
    how its norms were taken: ``GhostPass.routes``; with ``bookkeeping``, it keeps each
    use's clip-weighted gradient to be formed)."""
    if not callable(losses_fn):
        raise TypeError(
            f"ghost_grad_norms: losses_fn must be callable; got {type(losses_fn).__name__}"
        )
    if sequence not in SEQUENCE_FORMS:
        raise ValueError(
            f"ghost_grad_norms: sequence must be one of {SEQUENCE_FORMS}; got {sequence!r}"
        )
    ghost = GhostPass(sequence, bookkeeping=bookkeeping)
    if transformed():  # under a torch.func transform: its vjp (the units refuse it anyway)
        token = _PASS.set(ghost)
        try:
            with ghost.registered([], []):  # the pass's scope: what units return stays known
                losses, vjp = torch.func.vjp(lambda s: losses_fn(s, *args, **kwargs), shards)
        finally:
            _PASS.reset(token)
        _check_losses(ghost, losses)
        vjp(torch.ones_like(losses))
    else:
        losses = _first_order(ghost, losses_fn, shards, args=args, kwargs=kwargs)
    total = ghost.finish()
    if total is None:
        raise ValueError(
            "ghost_grad_norms: the losses reached no parameter of a gathered unit (the norms "
            "are taken where the units' weights are used)"
        )
    return total.reshape(losses.shape).sqrt(), ghost


def _first_order(
    ghost: GhostPass, losses_fn: Callable, shards: Any, *, args: tuple, kwargs: dict
) -> torch.Tensor:
    """The pass's forward (under the pass) and one backward, as ``loss.backward()`` runs it:
    each node's saved tensors freed as soon as it has run (``fh.grad``'s memory, where
    ``torch.func.vjp`` keeps them to the end). The shards require a gradient for the call
    only; none is formed (the units' pieces get none in this pass)."""
    leaves = [x for x in optree.tree_leaves(shards) if _is_tensor(x) and x.is_floating_point()]
    with requiring_grad(leaves):
        token = _PASS.set(ghost)
        try:
            with torch.enable_grad(), ghost.registered([], []):  # what units return stays known
                losses = losses_fn(shards, *args, **kwargs)
        finally:
            _PASS.reset(token)
        _check_losses(ghost, losses)
        if losses.requires_grad:
            torch.autograd.grad(losses.sum(), leaves, allow_unused=True)
    return losses.detach()


def _check_losses(ghost: GhostPass, losses: Any) -> None:
    if not isinstance(losses, torch.Tensor) or not losses.is_floating_point() or not losses.dim():
        got = tuple(losses.shape) if isinstance(losses, torch.Tensor) else type(losses).__name__
        raise ValueError(
            "ghost_grad_norms: losses_fn must return this rank's per-example losses, a "
            f"floating tensor with the examples along its last dim; got {got}"
        )
    if ghost.batch is not None and tuple(ghost.batch[0]) != tuple(losses.shape):
        raise ValueError(
            f"ghost_grad_norms: the losses have shape {tuple(losses.shape)} (*mesh, batch), "
            f"but {ghost.batch[1]} sees {tuple(ghost.batch[0])}"
        )

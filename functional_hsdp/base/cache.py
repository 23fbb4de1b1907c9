"""The caches: everything the library keeps between calls is registered here.

:func:`clear_caches` empties it all (and lists it). Plans, per-layout checks, path strings
and spec broadcasts are cached so that a repeated call does only packing, collectives and
unpacking. Each cache has a size bound; none holds a mesh or a tensor beyond its bound. The
rest (what :func:`~functional_hsdp.shard_module` remembers per model, what a thread's forward
keeps for its backward) registers with :func:`register`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["Bounded", "clear_caches", "lru", "register"]

F = TypeVar("F", bound=Callable[..., Any])

_CACHES: list[Any] = []  # every Bounded and lru-cached function, in creation order


def register(cache: Any) -> Any:
    """Have :func:`clear_caches` empty ``cache`` (anything with ``cache_clear()`` or
    ``clear()``)."""
    _CACHES.append(cache)
    return cache


class Bounded(dict):
    """A dict that forgets its oldest entry beyond ``maxsize`` entries."""

    def __init__(self, maxsize: int):
        super().__init__()
        self.maxsize = maxsize
        register(self)

    def __setitem__(self, key: Any, value: Any) -> None:
        if key not in self and len(self) >= self.maxsize:
            del self[next(iter(self))]
        super().__setitem__(key, value)

    def cache_clear(self) -> None:
        self.clear()


def lru(maxsize: int) -> Callable[[F], F]:
    """``functools.lru_cache(maxsize)``, registered with :func:`clear_caches`."""

    def wrap(fn: F) -> F:
        return register(functools.lru_cache(maxsize=maxsize)(fn))

    return wrap


def clear_caches() -> None:
    """Forget what the library remembers. Beyond what the caller holds, it keeps:

    - bounded caches keyed by tree structures, meshes, specs and leaf metadata, none holding
      a tensor or module of the caller's: plans and the layouts seen, per-layout checks and
      cross-rank fingerprints, path strings, spec broadcasts;
    - state tags of results (weak references to them; each goes with its tensors);
    - per model given to :func:`~functional_hsdp.shard_module` (weakly keyed): how it was
      sharded, referring to the model and its modules weakly, and, remembered on it, the
      gathered blocks of its last ``functional_call`` options (which hold that call's
      ``MainGrad``) and the order its units ran in;
    - per thread: the chain of its last forward, whose last unit keeps its gathered weights
      for its backward (until the end of that backward or, if none comes, the thread's next
      forward), and the wait nodes ``prefetch`` made and no call used (at most 4; they hold
      their shards); and the once-only warning of ``functional_call(recompute=True)``.

    A unit call's record lives in the autograd graph and goes with it. So once the caller
    drops a model, its shards and its ``MainGrad``, garbage collection frees them (the
    model's entry with it); until then a live model's blocks hold its last ``MainGrad``,
    and a wait node made ahead and never used its shards.

    This empties the caches and tags, every sharded model's blocks and unit order (how it was
    sharded stays while it lives: ``functional_call`` runs it from that) and this thread's
    forward state (another thread's goes with its next forward); the meshes of
    ``functional_hsdp.mesh.launch.device_mesh`` stay (made collectively, once per worker
    process). Later
    calls rebuild what they need (the first call per layout pays the plan build and the
    cross-rank check again). Results made before stay valid tensors; as ``acc`` they are
    checked by structure, dtype and shape like any tensor the user made; local shards lose
    their tags, so a call that must find their layout (a gathered unit, ``fh.gather``) asks
    for ``like=``: clear between runs, not within one.

    Example:
        >>> import functional_hsdp as fh
        >>> fh.clear_caches()
    """
    for cache in _CACHES:
        (cache.cache_clear if hasattr(cache, "cache_clear") else cache.clear)()

"""Every cache of the library: bounded, registered here, and emptied by :func:`clear_caches`.

Plans, per-layout checks, path strings and spec broadcasts are cached so that a repeated call
does only packing, collectives and unpacking. Each cache has a size bound; none holds a mesh
or a tensor beyond its bound.
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
    """Forget every cached plan, check, path and state tag.

    Later calls rebuild what they need (the first call per layout then pays the plan build
    and the cross-rank check again). Results made before stay valid tensors; as ``acc`` they
    are then checked by structure, dtype and shape like any tensor the user made.

    Example:
        >>> import functional_hsdp as fh
        >>> fh.clear_caches()
    """
    for cache in _CACHES:
        (cache.cache_clear if hasattr(cache, "cache_clear") else cache.clear)()

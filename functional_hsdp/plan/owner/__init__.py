"""The owner placement: each leaf whole on one rank, and the moves to and from it.

A tree reaches it in one of three ways, each in its own room (each docstring says more):

* :mod:`.major`: an Owner spec (:func:`owned`, Owner on every data-parallel axis, or on some
  with Replicate on the others: owners within each replica) lays its buckets out
  *owner-major* over its Owner axes, balanced by size (:func:`balance`), and moves as a Flat
  spec (Partial -> Owner a reduce-scatter, Owner -> Replicate an all-gather);
* :mod:`.routes`: any other spec keeps its layout; :func:`route` moves each bucket from the
  optimizer placement to the owners and back by uneven all-to-alls;
* :mod:`.keep`: an Owner spec on some data-parallel axes, Flat on the others
  (``owned(spec, "dp_outer")``), keeps its layout, each rank keeping the pieces of its chunk
  its coordinate owns.

:mod:`.pieces` is what the routes and the keep moves are made of. No state but the routes'
bounded cache. Dependencies go one way: ``plan.buckets`` and ``spec.placement`` -> this package
-> ``plan.recipe`` (a route reads a finished plan without importing it).
"""

from .keep import KeptPieces, keep_items, keep_owners
from .major import balance, owned, owner_bucket, owner_of_slot
from .pieces import Exchange, Rearrange, chunk_of, exchange, local_items, piece_of
from .routes import BucketRoute, Compact, chunk_rows, route

__all__ = [
    "BucketRoute",
    "Compact",
    "Exchange",
    "KeptPieces",
    "Rearrange",
    "balance",
    "chunk_of",
    "chunk_rows",
    "exchange",
    "keep_items",
    "keep_owners",
    "local_items",
    "owned",
    "owner_bucket",
    "owner_of_slot",
    "piece_of",
    "route",
]

"""The owner placement: each leaf whole on one rank, and the moves to and from it.

A tree reaches the owner placement in one of two ways:

* **An Owner spec** (:func:`owned`; optimizer placement ``Owner`` on every data-parallel
  axis) lays its buckets out *owner-major* (:func:`owner_bucket`): a bucket's leaves are
  assigned to the ranks balanced by size (:func:`balance`: largest first, each to the least
  loaded, then evened by moves and swaps), and rank k's chunk of the bucket (k in the spec's
  split order, as a Flat chunk) holds the whole leaves it owns, padded to the largest chunk.
  A bucket is then n chunks of its heaviest owner's leaves: at least n times its largest
  leaf, whatever the assignment. A Llama decoder layer of width d (MLP 4d, half as many
  key-value heads as query heads) holds three 4d^2 MLP matrices and 3d^2 besides: on 4
  owners it pads to 16d^2 for its 15d^2 (four layers in one unit balance exactly). Its Flat
  chunks on those axes are then the owners' leaves, so the spec moves as a Flat one:
  Partial -> Owner is a reduce-scatter (in HSDP, the last microbatch's over the outer axis,
  instead of an all-reduce), Owner -> Replicate an all-gather (``sync_params``, ``gather``),
  Flat -> Owner nothing at all.
* **Any other spec** keeps its own layout; :func:`route` plans, once per tree and set of
  leaves, each bucket's moves from the optimizer placement to the owners and back. There:
  a local selection for each Replicate axis (a rank keeps the pieces whose owner shares its
  coordinate on it) and one all-to-all per Flat or Shard(d) axis (each piece to its
  owner's coordinate on that axis); then each owner's pieces are joined into whole leaves.
  Back: the reverse all-to-alls, and one all-gather per Replicate axis. Blocks are uneven
  (nothing padded on the wire); a rank's buffer is as long as the longest of the mesh, so
  that both meshes log the same events. A ``Shard(d)`` bucket is routed the same way from
  each rank's data (:class:`Compact`): leaf j's chunk c, its ``torch.chunk`` along d, is
  the elements ``[c S P Q, (c S + n_c) P Q)`` of the leaf in *chunk order* (the chunks'
  data end to end, each row-major; S the chunk length, n_c this chunk's, P and Q the sizes
  of the dims before and after d), so the planner moves ranges as for Flat; the owner
  joins the chunks along d into the whole leaf (for d = 0 chunk order is the leaf's own: a
  view), and splits the result back. Empty chunks send nothing; padding to S never travels.

* **An Owner spec on some data-parallel axes only** (``owned(spec, axes)``: HSDP's outer
  axis, where the parameter is Replicate) keeps the spec's own layout and chunks; along
  those *keep axes* (one of size > 1) each rank keeps only the pieces of its chunk whose
  leaf's owner (balanced per bucket over every data-parallel axis that moves:
  :func:`keep_owners`) has its coordinate there (:class:`KeptPieces`, the optimizer
  placement's geometry). Partial -> Owner is a reduce-scatter-v and Owner -> Replicate an
  all-gather-v, each one all-to-all of the data with uneven blocks (:func:`keep_items`);
  :func:`route` moves the kept pieces over the other axes to the owner and back, and
  leaves the results with the keep axis's owners (no all-gather there).

Owners are ranks of the data-parallel axes that move (size > 1); a leaf's owner coordinate
on every other axis is the rank's own (other axes hold other values: each does its own).

Rooms (each module's docstring says more; none keeps state but the routes' bounded cache):

* :mod:`.major`: :func:`owned`, the owner-major layout (:func:`owner_bucket`,
  :func:`owner_of_slot`) and the balance of leaves over owners (:func:`balance`);
* :mod:`.routes`: the all-to-all routes (:func:`route`, :class:`BucketRoute`,
  :class:`Compact`);
* :mod:`.keep`: the keep axis (:class:`KeptPieces`, :func:`keep_items`,
  :func:`keep_owners`);
* :mod:`.pieces`: what the routes and the keep moves are made of (:class:`Exchange`,
  :class:`Rearrange`, :func:`chunk_of`, :func:`piece_of`, :func:`local_items`).

Dependencies go one way: this package builds on :mod:`functional_hsdp.plan.buckets` (buckets and
slots) and :mod:`functional_hsdp.spec.placement` (``Owner``, ``Step``);
:mod:`functional_hsdp.plan.recipe` builds on it (the owner-major buckets, the kept pieces as a
geometry, the keep moves) and a route reads a finished plan without importing plan.py.
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

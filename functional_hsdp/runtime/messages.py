"""The texts every rank raises alike when an agreement fails, and the exchanges behind them.

When the ranks' rows differ, more exchanges follow (all ranks alike): the first differing
header field, leaf or unit call, and every rank's text of it. Invariant: every rank builds
each message from the same exchanged tables, so all raise the same text, naming the ranks
that hold each value; texts are padded to the longest over every rank the call agrees with,
so an exchange's rows are equally long on every rank (gloo aborts on rows of other lengths).
"""

from __future__ import annotations

from typing import Any

import torch

from .fingerprints import ABSENT, LEAF_FIELDS, Fingerprint
from .unit_calls import UnitLog

__all__ = [
    "explain",
    "field_message",
    "gather",
    "nonfinite_message",
    "peer_errors",
    "units_message",
]


def units_message(mesh: Any, where: str, log: UnitLog) -> str:
    """The ranks' unit calls differ: the first call where they do, and how (more exchanges,
    all ranks alike)."""
    everyone = mesh.axis_names
    names = mesh.diagnostics.members(everyone)[0]
    mine = torch.tensor([log.count, len(log.entries)])
    counts = gather(mesh, everyone, mine.expand(*mesh.batch_shape, 2))[0]
    n = max(int(counts[:, 1].max()), 1)
    flat = [x for entry in log.entries for x in entry] + [ABSENT] * (2 * (n - len(log.entries)))
    digests = torch.tensor(flat, dtype=torch.int64).expand(*mesh.batch_shape, 2 * n)
    lists = gather(mesh, everyone, digests)[0].view(-1, n, 2)  # (G, n, [unit, unit+options])
    differs = (lists != lists[:1]).any(-1).any(0)
    i = int(differs.to(torch.int8).argmax()) if bool(differs.any()) else n
    text = log.texts[log.entries[i][1]] if i < len(log.entries) else ""
    texts = _gather_text(mesh, everyone, text)[0]
    made = counts[:, 0].tolist()
    values = [t or f"no call #{i} (it made {c})" for t, c in zip(texts, made)]
    how = _how(lists, made, i, texts=texts)
    return (
        f"{where}: the ranks ran their gathered units differently ({how}): first at call #{i} "
        f"since the last check: {_groups([values], [names])}. Every rank must call the same "
        "units, in the same order, with the same options (recompute, reshard_after_forward, "
        "mp_policy), and declare the same last microbatch (begin_microbatch); their "
        "gradients would be wrong. Run under "
        "fh.validation('strict') to stop at the unit's first collective instead"
    )


def _how(lists: torch.Tensor, made: list[int], i: int, *, texts: list[str]) -> str:
    """How the ranks' unit calls differ at call ``i``: ``order``, ``skipped``, ``another
    unit``, ``dtype (...)`` or ``options (...)``."""
    if i >= lists.shape[1]:
        return f"beyond the first {lists.shape[1]} calls kept"
    units = lists[:, i, 0]
    other = bool((units != units[0]).any())
    if bool((units == ABSENT).any()) or (other and len(set(made)) > 1):
        return "skipped"
    if other:
        kept = [sorted(row[:, 0].tolist()) for row in lists]
        return "order" if all(k == kept[0] for k in kept) else "another unit"
    fields = [dict(f.split("=", 1) for f in t.split(" | ", 1)[1].split("; ")) for t in texts]
    keys = [k for k in fields[0] if any(f.get(k) != fields[0][k] for f in fields)]
    kind = "dtype" if keys and all(k.endswith("dtype") for k in keys) else "options"
    return f"{kind}: {', '.join(keys)}"


def peer_errors(mesh: Any, tables: torch.Tensor, mine: BaseException | None) -> None:
    """Some rank's local checks failed: raise (every rank). A failing rank's own error is
    re-raised by its caller; the others raise the first failing rank's error type and text."""
    everyone = mesh.axis_names
    text = f"{type(mine).__name__}\x1f{mine}" if mine is not None else ""
    texts = _gather_text(mesh, everyone, text)
    if mine is not None:
        return  # agreement() re-raises it
    names = mesh.diagnostics.members(everyone)
    failed = [(n, t) for table, ns in zip(texts, names) for n, t in zip(ns, table) if t]
    kind, message = failed[0][1].split("\x1f", 1)
    ranks = _unique(n for n, _ in failed)
    cls = {"TypeError": TypeError, "NotImplementedError": NotImplementedError}.get(kind, ValueError)
    raise cls(
        f"{message} [raised on {_ranks(ranks)}; this rank's own input passed its checks, and it "
        "raises too instead of waiting in a collective]"
    )


_TAIL = (
    " (cross-rank check before the first collective of this call; every rank must make "
    "the same library calls with the same trees, shapes, dtypes, specs and last)"
)


def gather(mesh: Any, axes: tuple[str, ...], local: torch.Tensor) -> torch.Tensor:
    """Every rank's ``local`` row over ``axes`` (``Diagnostics.exchange``), as (B, G, L)."""
    return _table(mesh, mesh.diagnostics.exchange(local, axes))


def _table(mesh: Any, out: torch.Tensor) -> torch.Tensor:
    """An exchange's result as (B, G, L): one table per simulated rank (B = 1 on a DistMesh)."""
    return out.reshape(-1, *out.shape[-2:])


def explain(mesh, axes, fp: Fingerprint, *, n: int, names) -> str:
    """The error message for differing fingerprints (more exchanges, all ranks alike):
    ``n``, the most leaves any rank of the mesh has."""
    tail = _TAIL
    # the first leaf whose digests differ, over the longest tree of any rank
    mine = torch.tensor(fp.leaf_digests(n), dtype=torch.int64)
    digests = gather(mesh, axes, mine.expand(*mesh.batch_shape, 2 * n))
    differs = (digests != digests[:, :1]).any(1).any(0)
    if bool(differs.any()):
        i = int(differs.to(torch.int8).argmax()) % n
        leaf = fp.leaves[i] if i < len(fp.leaves) else None
        texts = _gather_text(mesh, axes, "\x1f".join(leaf) if leaf else "")
        return _leaf_message(i, texts, names) + tail
    texts = _gather_text(mesh, axes, fp.header[-1])
    return f"the tree structure differs across ranks: {_groups(texts, names)}{tail}"


def _leaf_message(i: int, texts: list[list[str]], names) -> str:
    rows = [[t.split("\x1f") if t else None for t in table] for table in texts]
    present = [leaf for table in rows for leaf in table if leaf is not None]
    first = present[0]
    fields = [
        f
        for f in range(len(LEAF_FIELDS))
        if any(leaf is None or leaf[f] != first[f] for table in rows for leaf in table)
    ]
    f = fields[0] if fields else 0
    if f == 0:  # the paths differ: the tree structures do
        values = [
            [leaf[0] if leaf else f"no leaf {i} (a shorter tree)" for leaf in table]
            for table in rows
        ]
        return (
            f"{first[0]}: the tree structure differs across ranks at leaf {i}: "
            f"{_groups(values, names)}"
        )
    values = [[leaf[f] for leaf in table] for table in rows]
    return f"{first[0]}: {LEAF_FIELDS[f]} {_groups(values, names)}"


def _gather_text(mesh, axes, text: str) -> list[list[str]]:
    """Every group member's ``text`` (one list per local table). The rows are as long as
    the longest text of the whole mesh, which every exchange spans (a group's longest would
    differ between groups, and gloo aborts on rows of other lengths)."""
    data = list(text.encode())
    every = tuple(mesh.axis_names)
    lengths = gather(mesh, every, torch.tensor([len(data)]).expand(*mesh.batch_shape, 1))
    width = max(int(lengths.max()), 1)
    padded = torch.tensor(data + [0] * (width - len(data)), dtype=torch.int64)
    rows = gather(mesh, axes, padded.expand(*mesh.batch_shape, width))
    return [[bytes(r.tolist()).rstrip(b"\0").decode() for r in table] for table in rows]


def _unique(items) -> list:
    return list(dict.fromkeys(items))


def _ranks(names: list[str]) -> str:
    return f"rank {names[0]}" if len(names) == 1 else f"ranks [{', '.join(names)}]"


def _groups(values: list[list[str]], names) -> str:
    """``A on ranks [0, 1, 3] but B on rank 2``: the values and the ranks holding each."""
    holders: dict[str, list[str]] = {}
    for table_values, table_names in zip(values, names):
        for value, name in zip(table_values, table_names):
            if name not in holders.setdefault(value, []):
                holders[value].append(name)
    parts = [f"{value} on {_ranks(ranks)}" for value, ranks in holders.items()]
    return parts[0] + " but " + ", ".join(parts[1:]) if len(parts) > 1 else parts[0]


def field_message(mesh: Any, field: str, text: str, *, names) -> str:
    """Header ``field`` differs across ranks (``text``: this rank's): the values and the ranks
    holding each (one more exchange, all ranks alike)."""
    texts = _gather_text(mesh, mesh.axis_names, text)
    return f"{field} differs across ranks: {_groups(texts, names)}{_TAIL}"


def nonfinite_message(paths, bad: torch.Tensor, *, names) -> str:
    """A leaf holds NaN or Inf: the first such leaf (``bad``: each rank's first, or -1) and the
    ranks where it does."""
    i = int(bad[bad >= 0].min())
    ranks = _unique(n for t, b in enumerate(bad.tolist()) for n, x in zip(names[t], b) if x == i)
    return (
        f"{paths[i]}: holds NaN or Inf on {_ranks(ranks)} (check_finite=True); no "
        "collective was issued"
    )

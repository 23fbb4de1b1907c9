"""The package's layers, bottom up: a module imports only from its own layer or below ...

A module ``functional_hsdp.<layer>.<...>`` belongs to ``<layer>``; the modules directly in the
package (``__init__``, ``__main__``, this one) are the top: they may import anything, and no
module of a layer imports them. ``tests/test_code_shape.py`` reads this table from the source.
"""

LAYERS: tuple[str, ...] = (
    "base",
    "mesh",
    "spec",
    "plan",
    "runtime",
    "io",
    "sync",
    "units",
    "optim",
    "diloco",
    "tools",
)

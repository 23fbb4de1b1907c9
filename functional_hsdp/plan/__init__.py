"""The plan layer: a tree and its spec become a plan once; a call only runs it.

``buckets`` (which leaves share a flat buffer, packing and unpacking), ``owner/`` (the owner
placement), ``recipe`` (``Plan``: buckets, programs and geometry of one tree; the plan cache)
and ``lookup`` (which plan a tree belongs to).
"""

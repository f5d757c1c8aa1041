"""Moved to `custagg.per_example.vectorized`; kept while `custagg.recompute`
(the copies, owned by the graph layer) imports `chunked_pfor` from here.
The lead removes it when the graph layer imports the new place."""

from custagg.per_example.vectorized import chunked_pfor  # noqa: F401

"""Python's cyclic garbage collector run rarely while a search runs.

A search builds hundreds of thousands of long-lived objects (memoized step facts, prices, floors, plans) and few
reference cycles, so each of CPython's full collections rescans them all for little garbage: with the default
thresholds (700, 10, 10) the flagship search (benchmarks/flagship_search.py) spent 9.7 of its 43 CPU seconds in
the collector, at :data:`THRESHOLD` 3.1 s, with the same answer and the same peak memory (1.13 GB).
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import TypeVar

__all__ = ["THRESHOLD", "rarely_collected"]

#: The collector's thresholds while a search runs (``gc.set_threshold``): a young collection every 20,000
#: allocations net of frees, an older one every 20 of those, a full one every 20 older ones.
THRESHOLD = (20_000, 20, 20)

F = TypeVar("F", bound=Callable)


def rarely_collected(fn: F) -> F:
    """``fn`` run with the collector at :data:`THRESHOLD`, the caller's thresholds back after."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        before = gc.get_threshold()
        gc.set_threshold(*THRESHOLD)
        try:
            return fn(*args, **kwargs)
        finally:
            gc.set_threshold(*before)
    return run  # type: ignore[return-value]

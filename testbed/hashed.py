"""A tuple hashed once: for memo keys that hold many values and are looked up far more often than built."""

from __future__ import annotations

__all__ = ["HashedTuple"]


class HashedTuple(tuple):
    """A tuple that computes its hash on first use and keeps it (memo keys of thousands of groups, or of a plan's
    model and runtime field by field, cost more to hash each lookup than the pricing they save)."""

    def __hash__(self) -> int:
        try:
            return self._hash
        except AttributeError:
            self._hash = tuple.__hash__(self)
            return self._hash

"""The buggy twin of dropout: the key is not folded with the device index, so every replica draws one mask."""

import dropout as good
from dropout import dropout  # noqa: F401  (same per-shard reference)


def _local(key, x):
    return good.dropout(key, x)            # BUG: fold_in(key, lax.axis_index("data")) missing


def make_parallel_dropout(mesh):
    return good.make_parallel_dropout(mesh, local=_local)

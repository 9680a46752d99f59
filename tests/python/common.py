"""Shared by the tests and peer.py."""

import numpy as np


def pattern(seed, shape, dtype):
    """Deterministic contents for tensor `seed` (small integers, exact in
    float16)."""
    n = int(np.prod(shape))
    v = (np.arange(n, dtype=np.int64) * 7 + seed * 131) % 251
    return v.astype(dtype).reshape(shape)

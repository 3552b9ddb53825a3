"""Layout classification agrees with a brute-force reading of the strides."""

import itertools

import numpy as np
import pytest

from jax_overlay import _xla_ext as ext


def classify(shape, strides):
    v = ext.parse_cai({"shape": shape, "typestr": "<f4", "data": (1 << 20, False),
                       "version": 3, "strides": None if strides is None
                       else tuple(4 * s for s in strides)})
    return v


def brute(shape, strides):
    """Compact iff the element offsets are exactly 0..n-1 (a permutation)."""
    offs = sorted(sum(i * s for i, s in zip(idx, strides))
                  for idx in itertools.product(*map(range, shape)))
    n = int(np.prod(shape))
    if n == 0:
        return "row_major"
    row = all(sum(i * s for i, s in zip(idx, strides)) == k for k, idx in
              enumerate(itertools.product(*map(range, shape))))
    if row:
        return "row_major"
    return "permuted" if offs == list(range(n)) else "strided"


@pytest.mark.parametrize("seed", range(300))
def test_random_layouts(seed):
    rng = np.random.default_rng(seed)
    nd = int(rng.integers(0, 4))
    shape = tuple(int(x) for x in rng.integers(0, 4, nd))
    kind = rng.integers(0, 3)
    if kind == 0:  # a compact permutation
        perm = rng.permutation(nd)
        strides = [0] * nd
        acc = 1
        for d in reversed(perm):
            strides[d] = acc
            acc *= shape[d]
    else:
        strides = [int(x) for x in rng.integers(-6, 7, nd)]
    v = classify(shape, strides)
    assert v.layout == brute(shape, strides), (shape, strides)
    if v.numel:
        offs = [sum(i * s for i, s in zip(idx, strides))
                for idx in itertools.product(*map(range, shape))]
        assert v.low == min(offs) and v.span == max(offs) - min(offs) + 1


def test_named_cases():
    assert classify((3, 4), None).layout == "row_major"
    assert classify((3, 4), (1, 3)).layout == "permuted"
    assert classify((3, 4), (8, 2)).layout == "strided"
    assert classify((3, 4), (0, 1)).layout == "strided"
    assert classify((3, 4), (-4, 1)).layout == "strided"
    assert classify((1, 4), (99, 1)).layout == "row_major"
    assert classify((4, 1), (1, 0)).layout == "row_major"

"""Shared pieces of the property-based fuzz tests (test_fuzz_*.py).

Budget: each property runs `examples(ci)` cases: the CI number by default,
JAX_OVERLAY_FUZZ_EXAMPLES when it is set (the dedicated run, tools/fuzz.sh).
In CI the cases are derandomized (the same every run, so CI cannot flake);
the dedicated run draws fresh ones (pytest --hypothesis-seed=N repeats a run).

Every case ends in one of two outcomes, checked here: an array equal to what
the producer described (read independently with NumPy), or a TypeError,
ValueError or BufferError whose message names a field the oracle found bad.
After each case every native tensor and every producer is released exactly
once.  Counts of cases and outcomes go to JAX_OVERLAY_FUZZ_REPORT (JSON
lines) when it is set.
"""

from __future__ import annotations

import collections
import json
import os
import sys

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, settings

import forge as T
from jax_overlay import _xla_ext as ext

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
ADDRESS_END = 2**64
ALLOWED = (TypeError, ValueError, BufferError)

DEDICATED = bool(os.environ.get("JAX_OVERLAY_FUZZ_EXAMPLES"))


def examples(ci: int) -> int:
    return int(os.environ.get("JAX_OVERLAY_FUZZ_EXAMPLES") or ci)


def fuzz_settings(ci: int):
    return settings(
        max_examples=examples(ci),
        deadline=None,       # jit compiles of new strided copies are slow, not wrong
        database=None,       # nothing written into the source tree
        derandomize=not DEDICATED,
        suppress_health_check=list(HealthCheck),
        print_blob=True,     # a failure prints its @reproduce_failure line
    )


def is_int(v) -> bool:
    """A Python int that is not a bool: what the protocols call an integer."""
    return isinstance(v, int) and not isinstance(v, bool)


def fits_int64(v) -> bool:
    return INT64_MIN <= v <= INT64_MAX


def count_elements(shape):
    """(numel, overflowed): the product, and whether a running product (the
    order consumers multiply in) left int64 before a zero made it moot."""
    numel, overflowed = 1, False
    for n in shape:
        numel *= n
        if not fits_int64(numel):
            overflowed = True
    return numel, overflowed


def huge_empty(shape, itemsize):
    """An array without elements whose other dimensions NumPy still refuses
    ("array is too big"): their bytes would not fit in int64."""
    nonzero = 1
    for n in shape:
        nonzero *= max(n, 1)
    return 0 in shape and nonzero * itemsize > INT64_MAX


def envelope(shape, strides):
    """(low, span) in elements of the memory an array touches, or None when
    an intermediate leaves int64 (strides None: row-major)."""
    numel = 1
    for n in shape:
        numel *= n
    if numel == 0 or strides is None:
        return 0, numel
    low = high = 0
    for n, s in zip(shape, strides):
        reach = (n - 1) * s
        if not fits_int64(reach):
            return None
        if reach < 0:
            low += reach
        else:
            high += reach
        if not (fits_int64(low) and fits_int64(high)):
            return None
    span = high - low + 1
    return (low, span) if fits_int64(span) else None


def host_buffer(nbytes, rng, bool_bytes=False):
    """A 64-byte aligned host buffer of random bytes (0/1 for bool data, which
    NumPy and JAX compare by truth value anyway)."""
    buf = T.aligned_empty((max(nbytes, 1),), np.uint8, alignment=64)
    buf[...] = rng.integers(0, 2 if bool_bytes else 256, buf.shape, dtype=np.uint8)
    return buf


def reference(buf, pointer, shape, dtype, byte_strides):
    """What the producer described, read by NumPy from `buf`, or None when the
    description reaches outside `buf` (a case no consumer could survive: the
    caller skips it).  The bounds are computed here, exactly: NumPy's own
    check of a buffer's size overflows for sizes near 2**63 and would hand
    back an 8 EiB view of a small buffer."""
    dtype = np.dtype(dtype)
    if byte_strides is None:
        byte_strides, acc = [], dtype.itemsize
        for n in reversed(shape):
            byte_strides.insert(0, acc)
            acc *= n
    # A dimension of size 0 or 1 takes no step, so its stride is any value a
    # producer likes (the core accepts 2**62 there); NumPy refuses strides
    # that overflow its own arithmetic, so the reference gives such a
    # dimension stride 0, which reads the same elements.
    byte_strides = [0 if n <= 1 else s for n, s in zip(shape, byte_strides)]
    low = sum(min(0, (n - 1) * s) for n, s in zip(shape, byte_strides))
    high = sum(max(0, (n - 1) * s) for n, s in zip(shape, byte_strides))
    base = buf.ctypes.data
    if pointer + low < base or pointer + high + dtype.itemsize > base + buf.nbytes:
        return None
    return np.ndarray(shape, dtype, buffer=buf, offset=pointer - base, strides=byte_strides)


def same_data(got, want) -> bool:
    got = np.asarray(got)
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if want.size == 0:
        return True
    if want.dtype == np.bool_:
        return np.array_equal(got.view(np.uint8) != 0, want.view(np.uint8) != 0)
    # Bitwise: NaN payloads and signed zeros must survive a copy too.
    return np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes()


class Tally:
    """Cases run and their outcomes, per property, for the dedicated run's
    report."""

    def __init__(self):
        self.counts = collections.defaultdict(collections.Counter)

    def add(self, prop, outcome):
        self.counts[prop][outcome] += 1

    def write(self):
        path = os.environ.get("JAX_OVERLAY_FUZZ_REPORT")
        if not path:
            return
        with open(path, "a") as f:
            for prop, c in self.counts.items():
                f.write(json.dumps({"property": prop, "cases": sum(c.values()),
                                    "outcomes": dict(c)}) + "\n")
        self.counts.clear()


tally = Tally()


def check_outcome(run, verdict, words, *, check_array):
    """Runs `run()` and checks it against the oracle.  `verdict`: "ok" (an
    array must come back; `check_array(arr)` says whether it is right),
    "bad" (an allowed exception must come), or "either" (an allowed
    exception, or a right array); an exception must name one of `words`.  Returns the outcome
    name for the tally.  Nothing from the call outlives this function: the
    exception's traceback is dropped so it cannot hold the producer."""
    try:
        arr = run()
    except ALLOWED as e:
        msg, kind = str(e), type(e).__name__
        e.__traceback__ = None
        del e
        assert verdict != "ok", f"valid input raised {kind}: {msg}"
        assert len(msg) > 20, f"unhelpful {kind} message: {msg!r}"
        if words:
            assert any(w in msg for w in words), (
                f"{kind} message names none of {sorted(words)}: {msg}")
        return kind
    assert verdict != "bad", f"malformed input was accepted (bad: {sorted(words)})"
    ok = check_array(arr)
    del arr
    assert ok, "the array differs from what the producer described"
    return "array"


def refcount(obj):
    return sys.getrefcount(obj)


@pytest.fixture(scope="module")
def x64():
    """64-bit types stay 64-bit, so every result compares bit for bit."""
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", False)


@pytest.fixture(scope="module", autouse=True)
def fuzz_report():
    yield
    tally.write()

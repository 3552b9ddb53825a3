"""The GPU-side copy for layouts JAX cannot view: sliced, negative,
broadcast and misaligned arrays.  The producer's memory is viewed as one
1-D envelope (zero-copy) and one XLA gather writes the compact result on
the same device: no round trip through the host."""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax import lax
import jax.numpy as jnp

# XLA's GPU code assumes entry parameters are 16-byte aligned (it may use
# vector loads); a view of a pointer that is not could fault or read wrong
# data, so such arrays go through the envelope, whose base is aligned down.
GPU_ALIGNMENT = 16


def plan(data, low, span, itemsize, range_start, alignment):
    """(base, count, unit, offset): the envelope holds `count` items of
    `unit` bytes from address `base`; element 0 of the array is item
    `offset`.  Units are whole elements unless the pointer itself is not
    element-aligned."""
    lo = data + low * itemsize
    hi = data + (low + span) * itemsize
    base = lo - lo % alignment
    if range_start and base < range_start:
        raise BufferError(
            f"cannot align an envelope for pointer {data:#x} inside its "
            f"allocation starting at {range_start:#x}; copy the array to a "
            "fresh, aligned buffer on the producer's side first")
    unit = itemsize if data % itemsize == 0 else 1
    count = -(-(hi - base) // unit)
    return base, count, unit, (data - base) // unit


@functools.lru_cache(maxsize=256)
def _gather_fn(shape, strides, offset, dtype, unit):
    """A jitted gather reading element i at offset + sum(i_d * strides_d)
    items of the envelope; strides are in envelope items."""
    dtype = np.dtype(dtype)
    idx_t = np.int32

    def indices():
        idx = jnp.full(shape, offset, idx_t)
        for d, s in enumerate(strides):
            if s and shape[d] > 1:
                idx = idx + lax.broadcasted_iota(idx_t, shape, d) * idx_t(s)
        return idx

    def by_element(flat):
        if dtype.kind in "fV":
            # Floats move as same-width unsigned ints: XLA may compute a
            # float gather through a wider type (float8 on the CPU), which
            # rewrites NaN payloads; a copy must keep every bit.
            bits = lax.bitcast_convert_type(flat, np.dtype(f"u{dtype.itemsize}"))
            return lax.bitcast_convert_type(
                bits.at[indices()].get(mode="promise_in_bounds"), dtype)
        return flat.at[indices()].get(mode="promise_in_bounds")

    def by_byte(flat):
        k = dtype.itemsize
        idx = indices()[..., None] + lax.broadcasted_iota(idx_t, shape + (k,), len(shape))
        raw = flat.at[idx].get(mode="promise_in_bounds")
        if dtype.kind == "c":
            part = np.dtype(f"f{k // 2}")
            two = lax.bitcast_convert_type(raw.reshape(shape + (2, k // 2)), part)
            return lax.complex(two[..., 0], two[..., 1])
        return lax.bitcast_convert_type(raw, dtype)

    return jax.jit(by_element if unit == dtype.itemsize else by_byte)


def gather(envelope, shape, elem_strides, offset, dtype, unit):
    itemsize = np.dtype(dtype).itemsize
    scale = itemsize // unit
    strides = tuple(int(s) * scale for s in elem_strides)
    if envelope.shape[0] >= 2**31:  # every index is below the envelope's size
        raise BufferError(
            f"a strided import spanning {envelope.shape[0]} items needs 64-bit "
            "indices, which this version of jax_overlay does not generate; "
            "make the array compact on the producer's side first")
    # The dtype itself is the cache key: bfloat16's and float8's strings
    # ('<V2', '|V1') name raw bytes, not the type.
    return _gather_fn(tuple(shape), strides, int(offset), np.dtype(dtype), unit)(envelope)

"""Room: the strided copy (part of the neutral import): the GPU-side copy
for layouts JAX cannot view (sliced, negative, broadcast and misaligned
arrays).  The producer's memory is viewed as one
1-D envelope (zero-copy) and one computation on the same device writes the
compact result: no round trip through the host.

On CUDA that computation is our own kernel (xla_ext/strided_kernel.cc),
called as an XLA FFI custom call: XLA allocates the result, orders the call
after whatever produces the envelope and keeps the envelope alive while the
kernel reads it.  Elsewhere, and for layouts the kernel does not take (more
than three dimensions after merging, 2**31 items or more), an XLA gather
writes it."""

from __future__ import annotations

import functools
import math
import os
import re

import jax
import numpy as np
from jax import lax
import jax.numpy as jnp

from . import _runtime as rt
from . import _xla_ext as ext
from ._config import config


def plan(data, low, span, itemsize, range_start, alignment, range_size=0):
    """(base, count, unit, offset): the envelope holds `count` items of
    `unit` bytes from address `base`; element 0 of the array is item
    `offset`.  Units are whole elements unless the pointer itself is not
    element-aligned.  `range_start`, `range_size`: the allocation the
    pointer lies in, when the driver knows it (0 otherwise): the envelope
    must lie inside it, whatever the producer's strides claim."""
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
    if range_size and (lo < range_start or base + count * unit > range_start + range_size):
        # Never read: the producer's shape and strides contradict its own
        # memory (CuPy 14.2's __dlpack__ of a reversed view is one such).
        raise BufferError(
            f"the array's elements span [{lo:#x}, {hi:#x}), beyond the "
            f"allocation [{range_start:#x}, {range_start + range_size:#x}) its pointer lies in: "
            "the producer's strides are wrong; import it through its "
            "__cuda_array_interface__ or copy it on the producer's side first")
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
            # The barrier keeps XLA from folding the bit casts around the
            # gather away: a gather with stride-0 indices became a bfloat16
            # broadcast, which XLA:CPU flushed subnormals in (1e-40 read 0).
            bits = lax.bitcast_convert_type(flat, np.dtype(f"u{dtype.itemsize}"))
            moved = lax.optimization_barrier(bits.at[indices()].get(mode="promise_in_bounds"))
            return lax.bitcast_convert_type(moved, dtype)
        return flat.at[indices()].get(mode="promise_in_bounds")

    def by_byte(flat):
        k = dtype.itemsize
        idx = indices()[..., None] + lax.broadcasted_iota(idx_t, shape + (k,), len(shape))
        raw = lax.optimization_barrier(flat.at[idx].get(mode="promise_in_bounds"))  # as above
        if dtype.kind == "c":
            part = np.dtype(f"f{k // 2}")
            two = lax.bitcast_convert_type(raw.reshape(shape + (2, k // 2)), part)
            return lax.complex(two[..., 0], two[..., 1])
        return lax.bitcast_convert_type(raw, dtype)

    return jax.jit(by_element if unit == dtype.itemsize else by_byte)


_TARGET = "jax_overlay_strided_copy"
_LIMIT = 2**31 - 1  # the kernel's index arithmetic is 32-bit
# XLA types our handler sizes (xla_ext/ffi_handler.cc): every importable
# type but the sub-byte ones, which DLPack cannot describe anyway.
_KERNEL_KINDS = "biufcV"
_SUB_BYTE = {"int2", "uint2", "int4", "uint4", "float4_e2m1fn"}


def kernel_plan(shape, strides, offset, itemsize, unit):
    """The kernel's plan (see strided::Plan) for an array of `shape` whose
    element at index i is item offset + sum(i_d * strides_d) of the
    envelope (items of `unit` bytes), or None when the kernel cannot take
    it.  Dimensions of one element drop out and adjacent ones that step
    evenly merge, so most layouts end with three dimensions or fewer."""
    dims = [(int(n), int(s)) for n, s in zip(shape, strides)]
    if unit != itemsize:  # a misaligned pointer: each element moves as bytes
        dims.append((itemsize // unit, 1))
    count = math.prod(n for n, _ in dims)
    if count == 0 or count > _LIMIT:
        return None
    merged: list[tuple[int, int]] = []
    for n, s in dims:
        if n == 1:
            continue
        if merged and merged[-1][1] == n * s:
            merged[-1] = (merged[-1][0] * n, s)
        else:
            merged.append((n, s))
    if len(merged) > 3:
        return None
    merged = [(1, 0)] * (3 - len(merged)) + merged
    (_, s1), (o2, s2), (inner, s_inner) = merged
    if any(abs(s) > _LIMIT for s in (s1, s2, s_inner)):
        return None
    return (unit, int(offset), count, inner, s_inner, o2, s2, s1)


def _ffi_version():
    """(major, minor) of the XLA FFI of the running jaxlib, from the
    headers it ships (jax.ffi.include_dir())."""
    path = os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    found = [re.search(rf"#define XLA_FFI_API_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR")]
    if not all(found):
        raise BufferError(f"no XLA FFI version in {path}")
    return tuple(int(m.group(1)) for m in found if m is not None)


_registered = None  # None: not tried; else "" or why the kernel is unusable
_prepared: dict[int, str] = {}


def kernel_status(device):
    """'' when the strided copy kernel serves `device`, else why not."""
    global _registered
    if not config.strided_kernel:
        return "jax_overlay.config.strided_kernel is off"
    if device.platform != "gpu" or "rocm" in str(
            getattr(device.client, "platform_version", "")).lower():
        return f"a {device.platform} device: the kernel is CUDA only"
    if _registered is None:
        try:
            jax.ffi.register_ffi_target(_TARGET, ext.strided_copy_handler(*_ffi_version()),
                                        platform="CUDA")
            _registered = ""
        except Exception as err:  # noqa: BLE001 - any failure means no kernel
            _registered = f"registration failed: {err}"
    if _registered:
        return _registered
    ordinal = device.local_hardware_id
    if ordinal not in _prepared:
        try:
            ext.prepare_strided_copy(ordinal)
            _prepared[ordinal] = ""
        except BufferError as err:
            _prepared[ordinal] = str(err)
    return _prepared[ordinal]


@functools.lru_cache(maxsize=256)
def _kernel_fn(shape, dtype, plan):
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(shape, dtype))
    attr = np.asarray(plan, np.int64)
    return jax.jit(lambda envelope: call(envelope, plan=attr))


@functools.lru_cache(maxsize=256)
def _route(shape, elem_strides, offset, dtype, unit, device, kernel_on):
    """(route, jitted copy) for one layout on one device.  Planning costs
    more than the copy's own dispatch for small arrays, so it is done once
    per layout; `kernel_on` (config.strided_kernel) is part of the key so
    that turning the kernel off takes effect at once."""
    strides = tuple(int(s) * (dtype.itemsize // unit) for s in elem_strides)
    if dtype.kind in _KERNEL_KINDS and dtype.name not in _SUB_BYTE:
        plan = kernel_plan(shape, strides, offset, dtype.itemsize, unit)
        if plan is not None and not kernel_status(device):
            return "kernel", _kernel_fn(shape, dtype, plan)
    # The dtype itself is the cache key: bfloat16's and float8's strings
    # ('<V2', '|V1') name raw bytes, not the type.
    return "gather", _gather_fn(shape, strides, offset, dtype, unit)


def gather(envelope, device, shape, elem_strides, offset, dtype, unit):
    """The compact copy of the array viewed by `envelope` (on `device`),
    whose element i is item offset + sum(i_d * elem_strides_d * itemsize /
    unit) of it: our kernel where it serves, else an XLA gather."""
    route, fn = _route(tuple(shape), tuple(elem_strides), int(offset), np.dtype(dtype), unit,
                       device, config.strided_kernel)
    if route == "gather" and envelope.shape[0] >= 2**31:
        # Every index the gather computes is below the envelope's size.
        raise BufferError(
            f"a strided import spanning {envelope.shape[0]} items needs 64-bit "
            "indices, which this version of jax_overlay does not generate; "
            "make the array compact on the producer's side first")
    return _copy(route, fn, envelope, np.dtype(dtype).itemsize)


def _copy(route, fn, envelope, itemsize):
    """Runs the planned copy `fn` ("kernel" or "gather": `route`, which the
    tests and probes read by wrapping this function)."""
    if itemsize < 8:
        return fn(envelope)
    # 64-bit items are moved as 64-bit items: in JAX's default 32-bit mode
    # a trace would narrow them (the gather's uint64 bit view became uint32,
    # the kernel's output buffer half its size).  The caller converts the
    # compact copy as JAX does, afterwards.
    with rt.x64(True):
        return fn(envelope)

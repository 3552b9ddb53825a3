"""Room: a tree in one buffer.  ``share(tree, pack=True)`` writes every leaf
into one uint8 buffer with one jitted call, and a JAX receiver unpacks it
with one jitted call: two device copies of the tree instead of a host-side
step per array on each side (a weight re-sync of hundreds of arrays is
bound by those steps, not by the GPU's copies).

Each leaf starts at a multiple of ALIGN bytes, so a receiver of another
framework views the leaves in place with their own dtypes.  A leaf is
stored as its bytes in memory order: bool as one byte 0/1, complex as its
(real, imaginary) pairs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

ALIGN = 16  # the largest itemsize (complex128): every leaf viewable in place
# Types XLA stores in less than a byte per element: no bytes to view.
_SUB_BYTE = frozenset({"int2", "uint2", "int4", "uint4", "float4_e2m1fn"})


def layout(leaves) -> tuple[tuple, int]:
    """(each leaf's (offset, shape, dtype name), the buffer's bytes); a
    BufferError naming a leaf whose type has no whole bytes."""
    spec, total = [], 0
    for i, x in enumerate(leaves):
        dtype = np.dtype(x.dtype)
        if dtype.name in _SUB_BYTE:
            raise BufferError(
                f"leaf {i} is {dtype.name}, which packs less than a byte per element: "
                "share(tree, pack=True) packs whole bytes; share it without pack=True")
        spec.append((total, tuple(x.shape), dtype.name))
        total += -(-x.nbytes // ALIGN) * ALIGN
    return tuple(spec), total


def _as_bytes(x):
    """x's bytes in memory order, flat uint8."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8).ravel()
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
    return jax.lax.bitcast_convert_type(x.ravel(), jnp.uint8).ravel()


def _from_bytes(b, shape, dtype):
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bool_:
        return (b != 0).reshape(shape)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        part = jnp.finfo(dtype).dtype
        pairs = jax.lax.bitcast_convert_type(b.reshape(-1, 2, part.itemsize), part)
        return jax.lax.complex(pairs[:, 0], pairs[:, 1]).reshape(shape)
    if dtype.itemsize == 1:
        return jax.lax.bitcast_convert_type(b, dtype).reshape(shape)
    return jax.lax.bitcast_convert_type(b.reshape(-1, dtype.itemsize), dtype).reshape(shape)


def _packed(leaves, spec, total):
    parts, end = [], 0
    for x, (off, _, _) in zip(leaves, spec):
        if off > end:
            parts.append(jnp.zeros((off - end,), jnp.uint8))
        b = _as_bytes(x)
        parts.append(b)
        end = off + b.shape[0]
    if total > end:
        parts.append(jnp.zeros((total - end,), jnp.uint8))
    return jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.uint8)


@functools.lru_cache(maxsize=64)
def packer(spec: tuple, total: int):
    """One jitted call: the leaves of `spec` -> uint8[total]."""
    return jax.jit(functools.partial(_packed, spec=spec, total=total))


def tree_packer(treedef, spec: tuple, total: int):
    """One jitted call: a pytree of `treedef` whose leaves are those of
    `spec` -> uint8[total].  Another structure, shape or dtype is refused
    where jit traces it (a ValueError naming the leaf), so a tree that
    matches costs the host no check beyond jit's own cache lookup."""

    def pack(tree):
        with_path, got = jax.tree_util.tree_flatten_with_path(tree)
        if got != treedef:
            raise ValueError(f"this tree's structure is {got}, not the channel's {treedef}: "
                             "send trees of the structure the channel was made with")
        for (path, x), (_, shape, name) in zip(with_path, spec):
            if tuple(x.shape) != shape or jnp.dtype(x.dtype).name != name:
                raise ValueError(
                    f"{jax.tree_util.keystr(path) or 'the tree'} is {jnp.dtype(x.dtype).name}"
                    f"{list(x.shape)}, not the channel's {name}{list(shape)}: send leaves of "
                    "the shapes and dtypes the channel was made with, or make a new channel")
        return _packed([x for _, x in with_path], spec, total)
    return jax.jit(pack)


def tree_unpacker(treedef, spec: tuple):
    """One jitted call: uint8[total] -> (a pytree of `treedef`, new arrays;
    a one-byte array defined with them, whose definition says the call has
    read the buffer)."""
    leaves = unpacker(spec)
    return jax.jit(lambda buf: (jax.tree_util.tree_unflatten(treedef, leaves(buf)), buf[:1]))


@functools.lru_cache(maxsize=64)
def unpacker(spec: tuple):
    """One jitted call: uint8[total] -> the leaves of `spec`, as new arrays."""

    def unpack(buf):
        out = []
        for off, shape, name in spec:
            n = int(np.prod(shape, dtype=np.int64)) * jnp.dtype(name).itemsize
            out.append(_from_bytes(buf[off:off + n], shape, name))
        return out
    return jax.jit(unpack)

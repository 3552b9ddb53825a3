"""Room: sharded arrays.  Sharded arrays and the interchange protocols, which describe one buffer
each: per-shard export (to_shards) and zero-copy assembly of a global array
from per-device arrays of other libraries (from_shards).  Both sit on the one import and
export paths: a shard's ``data`` exports through ``__dlpack__`` /
``__cuda_array_interface__``, and each such array is imported by the same
code as ``jax_overlay.from_dlpack`` / ``from_cuda_array_interface``."""

from __future__ import annotations

import json
import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax

from . import _route
from . import _runtime as rt
from . import _view
from ._config import config


class Shard(NamedTuple):
    """One addressable shard of a :class:`jax.Array`."""

    device: jax.Device
    """The device holding the shard."""
    index: tuple  # type: ignore[assignment]  # the field shadows tuple.index
    """The shard's block of the global array: ``x[index]`` (a tuple of slices)."""
    data: jax.Array
    """A single-device array over the shard's own buffer (no copy), exportable
    with ``__dlpack__`` and, on a GPU, ``__cuda_array_interface__``."""


def _name(obj):
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def to_shards(x: jax.Array) -> list[Shard]:
    """The addressable shards of `x`, in the order of ``x.addressable_shards``
    (the sharding's device order): each one's device, its index into the
    global array and its data as a single-device array that shares the
    shard's buffer, zero-copy.  ``torch.from_dlpack(s.data)``,
    ``cupy.from_dlpack(s.data)`` and, after ``install()``,
    ``cupy.asarray(s.data)`` then read that buffer on its own GPU, ordered
    after the computation that produced it.  Replicated arrays give one
    shard per device, each a full copy (``x.addressable_shards[i].replica_id``
    tells them apart)."""
    rt.check_live(x)
    return [Shard(s.device, s.index, s.data) for s in x.addressable_shards]


def _import(name, obj, device, copy):
    """A single-device jax.Array for one entry of from_shards' `arrays`."""
    if isinstance(obj, jax.Array):
        if not isinstance(obj, rt.ArrayImpl):
            raise TypeError(f"{name} is a traced {_name(obj)}; from_shards takes concrete arrays")
        rt.refuse_deleted(obj, name, "from_shards has nothing to place")
        rt.refuse_sharded(obj, name, BufferError, "pass single-device arrays "
                          "(jax_overlay.to_shards(a) gives a sharded array's)")
        return _view.finish(obj, False, copy=copy)
    # Host memory belongs to every CPU device: viewed on this position's
    # device when that is a CPU, else on the first CPU, where the placement
    # check below names the copy it needs.
    host = device if device.platform == "cpu" else rt.host_device()
    hit = _route.import_peer(obj, copy, host)
    if hit is None:
        raise TypeError(
            f"{name} is a {_name(obj)}, which has neither __dlpack__ nor "
            "__cuda_array_interface__; pass PyTorch, CuPy, NumPy or other DLPack "
            "or CUDA Array Interface arrays, or single-device jax.Arrays")
    return _view.finish(*hit, copy=copy)


def _check_place(name, arr, want, sharding, order, keyed):
    (have,) = arr.sharding.device_set
    if have != want:
        if have.platform == "cpu" and want.platform != "cpu":
            raise BufferError(
                f"{name} is host memory, but the sharding places it on {want}; "
                f"jax.device_put it onto {want} first (a copy)")
        if keyed:
            fix = f"key it by the device it is on, or jax.device_put it onto {want} (a copy)"
        else:
            fix = (f"pass the arrays in the sharding's device order "
                   f"[{', '.join(map(str, order))}] (that of jax_overlay.to_shards "
                   "and sharding.addressable_devices_indices_map) or as a dict "
                   f"{{device: array}}, or jax.device_put it onto {want} (a copy)")
        raise BufferError(f"{name} is on {have}, but the sharding places it on {want}; {fix}")
    kind = sharding.memory_kind
    if kind is not None and arr.sharding.memory_kind != kind:
        raise BufferError(
            f"{name} is in {have}'s {arr.sharding.memory_kind!r} memory, but the "
            f"sharding wants {kind!r} memory; jax.device_put it there (a copy: "
            f"jax.sharding.SingleDeviceSharding(device, memory_kind={kind!r})), "
            f"or use a sharding with memory_kind={arr.sharding.memory_kind!r}")


def _global_shape(global_shape, sharding, first) -> tuple[int, ...]:
    """`global_shape` checked, or inferred from the first shard: JAX tiles
    every dimension evenly, so the global extent is the shard's times the
    number of blocks the sharding cuts that dimension into (read from the
    shard shape of a probe whose every extent is the device count, which
    each block count divides)."""
    if global_shape is not None:
        try:
            return tuple(operator.index(n) for n in global_shape)
        except TypeError:
            raise TypeError(
                f"global_shape={global_shape!r}: pass a tuple of ints") from None
    if first is None:
        raise ValueError("from_shards got no arrays, so global_shape= is needed")
    name, shape = first
    n = len(sharding.device_set)
    try:
        probe = sharding.shard_shape((n,) * len(shape))
    except Exception as e:  # JAX's errors for a spec longer than the rank
        raise ValueError(
            f"cannot infer global_shape from {name}'s shape {shape}: the sharding "
            f"does not fit {len(shape)}-dimensional arrays ({e}); pass global_shape=") from None
    return tuple(s * (n // p) for s, p in zip(shape, probe))


def _block_shape(index, global_shape):
    return tuple(len(range(*s.indices(n))) for s, n in zip(index, global_shape))


def from_shards(arrays: list[Any] | tuple[Any, ...] | dict[jax.Device, Any],
                sharding: jax.sharding.Sharding, *,
                global_shape: Sequence[int] | None = None,
                copy: bool | None = None) -> jax.Array:
    """A global :class:`jax.Array` with `sharding`, assembled from one array
    per addressable device, without copying (through
    ``jax.make_array_from_single_device_arrays``).

    ``arrays``: a list in the sharding's device order (that of
    :func:`to_shards` and ``sharding.addressable_devices_indices_map``), or a
    dict ``{device: array}``.  Each is a PyTorch, CuPy, NumPy or other DLPack
    or CUDA Array Interface array (imported as by :func:`from_dlpack`, by
    the cheaper protocol that gives the same array, or by
    :func:`from_cuda_array_interface`: zero-copy,
    ordered after its producer's stream, the producer kept alive), or a
    single-device jax.Array.

    * Each must already sit on the device the sharding gives its position
      (GPU memory on its own GPU), in the sharding's memory kind:
      BufferError otherwise, naming the array, where it is and where it
      should be; nothing is moved silently.  Host memory (NumPy) belongs to
      every CPU device and is viewed on its position's.
    * Each must have the shape of its block and all one dtype: ValueError.
      Replicas of a replicated dimension are taken as given (not compared).
    * ``global_shape``: inferred when omitted (each dimension's shard extent
      times the number of blocks the sharding cuts it into).
    * ``copy``: as for the imports: None copies (on the same device) only an
      array no view can hold (strided or misaligned), False raises
      BufferError instead, True gives fresh buffers.
    * Under ``jax.distributed``, a sharding over every process's devices:
      each process passes its own addressable shards, and all processes
      agree (through JAX's distributed key-value store) before any
      assembles.  A bad shard in one process is the same error in every
      process.  A process that does not call ``from_shards`` within
      ``config.agree_timeout_s`` makes the others raise BufferError, so
      nothing waits forever in a collective.  Every process must call it
      for such an array, in the same order.
    """
    if not isinstance(sharding, jax.sharding.Sharding):
        raise TypeError(f"sharding must be a jax.sharding.Sharding, got {_name(sharding)}")
    if not _spans_processes(sharding):
        shape, arrs = _assemble(arrays, sharding, global_shape, copy)
        return jax.make_array_from_single_device_arrays(shape, sharding, arrs)
    # Under jax.distributed: every process checks its own shards, then all
    # agree before any assembles, so a bad shard in one process is the same
    # clear error in every process, not a collective that waits forever.
    try:
        shape, arrs = _assemble(arrays, sharding, global_shape, copy)
        mine = {"error": None, "dtype": str(arrs[0].dtype) if arrs else None,
                "shape": list(shape), "devices": len(sharding.device_set)}
        local = None
    except Exception as e:  # noqa: BLE001 - every failure is reported to the others first
        mine = {"error": f"{type(e).__name__}: {e}", "class": type(e).__name__}
        local = e
    _agree(mine, local)
    return jax.make_array_from_single_device_arrays(shape, sharding, arrs)


def _assemble(arrays, sharding, global_shape, copy):
    """(global shape, single-device arrays in the sharding's device order)
    for this process's addressable devices, every check made."""
    order = rt.addressable_devices(sharding)
    keyed = isinstance(arrays, dict)
    if keyed:
        missing = [str(d) for d in order if d not in arrays]
        unknown = [str(k) for k in arrays if k not in order]
        if missing or unknown:
            raise ValueError(
                f"arrays is keyed by {len(arrays)} devices, but the sharding's "
                f"addressable devices are [{', '.join(map(str, order))}]: "
                f"missing {missing}, not in the sharding {unknown}; key one "
                "array by each of its devices")
        items = [(f"arrays[{d}]", d, arrays[d]) for d in order]
    elif isinstance(arrays, (list, tuple)):
        if len(arrays) != len(order):
            raise ValueError(
                f"got {len(arrays)} arrays, but the sharding has {len(order)} "
                f"addressable devices [{', '.join(map(str, order))}]; pass one "
                "array per device, in that order")
        items = [(f"arrays[{i}]", d, a) for i, (d, a) in enumerate(zip(order, arrays))]
    else:
        raise TypeError(
            f"arrays must be a list (in the sharding's device order) or a dict "
            f"{{device: array}}, got {_name(arrays)}")

    shards = []
    for name, device, obj in items:
        arr = _import(name, obj, device, copy)
        _check_place(name, arr, device, sharding, order, keyed)
        shards.append((name, device, arr))
    if shards:
        name0, _, arr0 = shards[0]
        for name, _, arr in shards[1:]:
            if arr.dtype != arr0.dtype:
                raise ValueError(
                    f"{name} is {arr.dtype} but {name0} is {arr0.dtype}; a jax.Array "
                    "has one dtype: convert on the producer's side first")
    shape = _global_shape(
        global_shape, sharding, (shards[0][0], shards[0][2].shape) if shards else None)
    try:
        indices = sharding.addressable_devices_indices_map(shape)
    except ValueError as e:  # uneven tiling, or a spec longer than the rank
        raise ValueError(f"global_shape={shape} does not fit the sharding: {e}") from None
    for name, device, arr in shards:
        want = _block_shape(indices[device], shape)
        if arr.shape != want:
            raise ValueError(
                f"{name} has shape {arr.shape}, but the sharding gives {device} the "
                f"block {indices[device]} of the global shape {shape}, of shape "
                f"{want}; pass that block, or the global_shape= it belongs to")
    # Lifetime: the global array holds the very buffers of these single-device
    # arrays, and each buffer holds its producer until PJRT frees it, so the
    # intermediates can go.
    return shape, [arr for _, _, arr in shards]


def _spans_processes(sharding) -> bool:
    """Whether the sharding has devices of other processes (jax.distributed)."""
    return jax.process_count() > 1 and not sharding.is_fully_addressable


_ERRORS = {"ValueError": ValueError, "TypeError": TypeError, "BufferError": BufferError}
_calls = 0  # this process's multi-process from_shards calls: the agreement's key


def _agree(mine, local):
    """Every process's account of one from_shards call ({"error": ...} or its
    dtype, global shape and device count), exchanged through JAX's own
    distributed key-value store; raises the same error in every process
    where any process failed or the accounts differ, and a clear error
    after config.agree_timeout_s where a process does not report (it
    never called from_shards, or died).  Processes call from_shards in the
    same order, so the n-th call of each is the same call."""
    global _calls
    from jax._src import distributed
    client = distributed.global_state.client
    if client is None:
        raise BufferError(
            "from_shards: the sharding spans several processes, but JAX's distributed "
            "runtime is not initialised here; call jax.distributed.initialize() first")
    _calls += 1
    me, n = jax.process_index(), jax.process_count()
    key = f"jax_overlay/from_shards/{_calls}"
    client.key_value_set(f"{key}/{me}", json.dumps(mine))
    timeout_ms = max(1, int(config.agree_timeout_s * 1000))
    accounts = {}
    for p in range(n):
        if p == me:
            accounts[p] = mine
            continue
        try:
            accounts[p] = json.loads(client.blocking_key_value_get(f"{key}/{p}", timeout_ms))
        except Exception as e:  # jaxlib's deadline error
            raise BufferError(
                f"from_shards: process {p} of {n} gave no account of its shards within "
                f"{config.agree_timeout_s:g} s (it did not call from_shards, called it in "
                "another order, or died); every process must call from_shards for an "
                f"array that spans them, in the same order ({type(e).__name__}: {e})") from local
    # Every process wrote this call's account after reading all of the
    # previous call's: that key of ours can go.
    if _calls > 1:
        try:
            client.key_value_delete(f"jax_overlay/from_shards/{_calls - 1}/{me}")
        except Exception:  # noqa: BLE001 - only tidiness
            pass
    failed = {p: a for p, a in sorted(accounts.items()) if a.get("error")}
    if failed:
        first = next(iter(failed.values()))
        cls = _ERRORS.get(first.get("class"), ValueError)
        raise cls(
            "from_shards failed in "
            + "; ".join(f"process {p}: {a['error']}" for p, a in failed.items())
            + f" (every one of the {n} processes raises this error)") from local
    for field, what in (("dtype", "dtype"), ("shape", "global shape"),
                        ("devices", "sharding's device count")):
        seen = {p: a[field] for p, a in accounts.items()}
        if len({json.dumps(v) for v in seen.values()}) > 1:
            raise ValueError(
                f"from_shards: the processes disagree on the {what}: "
                + ", ".join(f"process {p}: {v}" for p, v in sorted(seen.items()))
                + f"; every process must pass shards of one array (every one of the {n} "
                "processes raises this error)")
